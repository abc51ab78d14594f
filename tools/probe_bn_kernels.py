"""Probe (GPU host): the fused runs' BatchNorm kernels (batchnorm.cu) on ResNet-50's layers, device us and
achieved bandwidth, this source against another one.

    mkdir before && git archive HEAD~1 fallback_kernels | tar -x -C before
    python -m tools.probe_bn_kernels --before before/fallback_kernels --out probe_bn_kernels.json

Per layer (batch 64 by default, float16, channels-last rows x channels) and launch -- the statistics, the
backward reduction with the mask from y * scale + shift, a stored output or the output pass's bits, the
backward pass with and without the residual's gradient, the output pass plain and with a downsample's
BatchNorm -- the device us per call (median of blocks of back-to-back calls behind a GPU sleep) and GB/s of
the bytes it must move, for the current source (and, with --waves, its reduction grid at other sizes) and,
with --before, another version's fallback_kernels folder (its launcher and kernels, imported as a package of
their own), with the largest difference between the two versions' outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from benchmarks import harness

LAYERS = ((56, 64), (56, 256), (28, 128), (28, 512), (14, 256), (14, 1024), (7, 512), (7, 2048))


def _package(folder: Path, name: str):
    """`folder` (a fallback_kernels tree) imported as package `name`; its relative imports stay inside it."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.batchnorm")


def _buffers(torch, rows: int, c: int, chunks_bytes: int) -> dict:
    def h(*shape, lo=-1.0):
        return (torch.rand(*shape, device="cuda") * (1 - lo) + lo).half()
    return {"y": h(rows, c), "da": h(rows, c), "a": h(rows, c, lo=-0.3), "r": h(rows, c),
            "scale": h(c, lo=0.5), "shift": h(c), "scale2": h(c, lo=0.5), "shift2": h(c),
            "gamma": torch.rand(c, device="cuda") + 0.5, "mean": torch.rand(c, device="cuda") - 0.5,
            "invstd": torch.rand(c, device="cuda") + 0.5, "coef": torch.empty(3 * c, device="cuda"),
            "dgamma": torch.empty(c, device="cuda"), "dbeta": torch.empty(c, device="cuda"),
            "sum": torch.empty(c, device="cuda"), "sq_sum": torch.empty(c, device="cuda"),
            "partials": torch.empty(max(chunks_bytes, 4) // 4 + 64, device="cuda"),
            "counters": torch.zeros(1024, dtype=torch.int32, device="cuda"),
            "out": torch.empty(rows, c, device="cuda", dtype=torch.half),
            "dz": torch.empty(rows, c, device="cuda", dtype=torch.half),
            "bits": torch.zeros(rows * c // 8 + 16, device="cuda", dtype=torch.uint8),
            "rm": torch.zeros(c, device="cuda"), "rv": torch.ones(c, device="cuda"),
            "nbt": torch.zeros(1, dtype=torch.int64, device="cuda"),
            "f_scale": torch.empty(c, device="cuda", dtype=torch.half),
            "f_shift": torch.empty(c, device="cuda", dtype=torch.half),
            "f_mean": torch.empty(c, device="cuda"), "f_invstd": torch.empty(c, device="cuda")}


def _launches(bn, b: dict, stream: int) -> dict:
    """{name: (call, bytes moved, output tensors)}."""
    p = {k: v.data_ptr() for k, v in b.items()}
    n = b["y"].numel() * 2
    common = dict(da=p["da"], y=p["y"], scale=p["scale"], shift=p["shift"], gamma=p["gamma"], mean=p["mean"],
                  invstd=p["invstd"], partials=p["partials"], coef=p["coef"], dgamma=p["dgamma"], dbeta=p["dbeta"],
                  dy=p["out"], relu=True, counters=p["counters"])

    def reduce(out):
        bits = (0,) if len(bn._reduce.slots) == 14 else ()  # a version whose reduction can read mask bits
        return lambda: bn._reduce(stream, p["da"], p["y"], out, *bits, p["scale"], p["shift"], p["gamma"], p["mean"],
                                  p["invstd"], p["partials"], p["dgamma"], p["dbeta"], p["coef"], p["counters"])
    return {
        "stats": (lambda: bn.stats(stream, y=p["y"], partials=p["partials"], sum=p["sum"], sq_sum=p["sq_sum"],
                                   counters=p["counters"]), n, ("sum", "sq_sum")),
        "reduce": (reduce(0), 2 * n, ("dgamma", "dbeta", "coef")),
        "reduce_stored": (reduce(p["a"]), 3 * n, ("dgamma", "dbeta", "coef")),
        "backward": (lambda: bn.backward(stream, out=0, **common), 5 * n, ("out",)),
        "backward_stored_dz": (lambda: bn.backward(stream, out=p["a"], dz=p["dz"], **common), 8 * n, ("out", "dz")),
        "backward_bits_dz": (lambda: bn.backward(stream, out=0, bits=p["bits"], dz=p["dz"], **common),
                             6 * n + 2 * n // 16, ("out", "dz")),  # da, y twice; dy, dz; the bits twice
        "finalize": (lambda: bn.finalize(stream, sum=p["gamma"], sq_sum=p["invstd"], gamma=p["gamma"], beta=p["mean"],
                                         running_mean=p["rm"], running_var=p["rv"], num_batches=p["nbt"],
                                         scale=p["f_scale"], shift=p["f_shift"], mean=p["f_mean"], invstd=p["f_invstd"],
                                         eps=1e-5, momentum=0.1), 0, ("f_scale", "f_shift")),
        "apply": (lambda: bn.apply(stream, y=p["y"], scale=p["scale"], shift=p["shift"], out=p["out"], relu=True),
                  2 * n, ("out",)),
        "apply_branch": (lambda: bn.apply(stream, y=p["y"], scale=p["scale"], shift=p["shift"], out=p["out"],
                                          relu=True, residual=p["r"], scale2=p["scale2"], shift2=p["shift2"]),
                         3 * n, ("out",)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="another version's fallback_kernels folder")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--waves", type=int, nargs="*", default=[],
                    help="also the current source with REDUCE_WAVES set to each of these")
    ap.add_argument("--narrow", action="store_true",
                    help="also the current source with 8 threads a row (64 float16 channels a tile) at every C")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    from fallback_kernels import batchnorm as now
    versions = {"now": now}
    if args.before:
        versions["before"] = _package(args.before.resolve(), "fallback_kernels_before")
    cycles = harness.sleep_cycles_for(20.0)
    stream = torch.cuda.current_stream().cuda_stream
    rows_out = []
    for hw, c in LAYERS:
        rows = args.batch * hw * hw
        kernels = {v: m.BatchNormKernels(rows, c, "float16", 0) for v, m in versions.items()}
        if args.narrow:
            layout = now.reduce_layout
            now.reduce_layout = lambda dtype, c: (v[0], 8) if (v := layout(dtype, c))[0] > 2 else v
            try:
                kernels["narrow"] = now.BatchNormKernels(rows, c, "float16", 0)
            finally:
                now.reduce_layout = layout
        for w in args.waves:
            now.REDUCE_WAVES, default = w, now.REDUCE_WAVES
            try:
                kernels[f"waves{w}"] = now.BatchNormKernels(rows, c, "float16", 0)
            finally:
                now.REDUCE_WAVES = default
        b = _buffers(torch, rows, c, max(k.partials_bytes for k in kernels.values()))
        for name in _launches(kernels["now"], b, stream):
            row = {"hw": hw, "channels": c, "launch": name}
            outs = {}
            for v, bn in kernels.items():
                call, nbytes, outputs = _launches(bn, b, stream)[name]
                try:
                    call()
                except TypeError:  # a version without this launch's arguments
                    continue
                outs[v] = [b[o].double().clone() for o in outputs]
                us = harness.device_ms(call, calls=20, rounds=9, sleep_cycles=cycles, warmup=2) * 1e3
                row[f"{v}_us"], row[f"{v}_GBps"] = round(us, 2), round(nbytes / us / 1e3, 1)
            if "before" in outs and "now" in outs:
                row["max_diff"] = max(float(((x - y).abs() / (y.abs() + 1e-3)).max())
                                      for x, y in zip(outs["now"], outs["before"]))
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    total = {v: round(sum(r.get(f"{v}_us", 0) for r in rows_out), 1) for v in kernels}
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "batch": args.batch,
                                          "total_us": total, "rows": rows_out}, indent=1))
    print(json.dumps({"total_us": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
