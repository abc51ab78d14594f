"""Probe (GPU host): grid_sample backward device time per algorithm, this kernel source against another one.

    mkdir before && git archive HEAD~1 fallback_kernels | tar -x -C before
    python -m tools.probe_grid_sample_backward --before before/fallback_kernels --out probe_grid_sample_backward.json

Per shape (random grids over [-1.1, 1.1], both gradients) and algorithm -- fast or deterministic, through the
shared-memory tile kernels or, with TUNING["tile"] off, the global ones (gs_backward; gs_count / gs_place /
gs_gather_exact or the sorted keys) -- device us per call (median of blocks of back-to-back calls behind a
GPU sleep) for the current source and for --before, and the largest difference between the two sources'
gradients; with --kernels, each kernel's device us as well. Written to compare a refactor of the kernels against
the code it replaced. --before is another version's fallback_kernels folder: each grid_sample program is read
from it (its includes from it too), or, for a version from before the split, every program from its one
grid_sample.cu.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import harness

SHAPES = (  # name, dtype, input shape, output spatial, mode
    ("f32 (8,64,128,128)", "float32", (8, 64, 128, 128), (128, 128), "bilinear"),
    ("f16 (32,32,64,64)", "float16", (32, 32, 64, 64), (64, 64), "bilinear"),
    ("f32 3-D (2,16,32,32,32)", "float32", (2, 16, 32, 32, 32), (32, 32, 32), "bilinear"),
    ("f32 bicubic (4,32,64,64)", "float32", (4, 32, 64, 64), (64, 64), "bicubic"),
    ("f16 nearest (32,32,64,64)", "float16", (32, 32, 64, 64), (64, 64), "nearest"),
    ("f64 (2,16,64,64)", "float64", (2, 16, 64, 64), (64, 64), "bilinear"),
)
ALGORITHMS = {  # name: (deterministic, TUNING["tile"])
    "fast_tile": (False, True), "fast_global": (False, False),
    "det_tile": (True, True), "det_global": (True, False),
}


def _kernel_us(fn) -> dict:
    """Mean device us per call of each kernel fn launches, by name without arguments."""
    out: dict = {}
    for key, us in harness.kernel_us(fn, calls=5).items():
        name = key.split("(")[0].removeprefix("void ")
        out[name] = round(out.get(name, 0.0) + us, 2)
    return out


def device_us(fn, *, cycles: int) -> float:
    """Median device us per call over 15 blocks of 20 back-to-back calls, each queued behind a ~20 ms sleep."""
    return round(harness.device_ms(fn, calls=20, rounds=15, sleep_cycles=cycles, warmup=3) * 1e3, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path,
                    help="another version's fallback_kernels folder (its grid_sample*.cu and headers)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", action="store_true", help="also each kernel's device us (torch.profiler)")
    args = ap.parse_args(argv)

    import torch

    from fallback_kernels import compile as compile_mod
    from fallback_kernels import grid_sample as gs

    current = compile_mod.source
    folder = args.before
    if not folder.is_dir():
        raise SystemExit(f"--before {folder}: not a folder of kernel sources (see --help)")

    def before_text(filename: str, seen: set) -> str:
        seen.add(filename)
        path = folder / filename
        if not path.exists() and filename.startswith("grid_sample") and filename.endswith(".cu"):
            path = folder / "grid_sample.cu"  # a version from before the split: one file held every program
        text = path.read_text() if path.exists() else compile_mod._read(filename)
        return compile_mod._LOCAL_INCLUDE.sub(lambda m: "" if m.group(1) in seen else before_text(m.group(1), seen),
                                              text)

    def source(filename: str) -> str:  # the --before text while TUNING's options name it
        if filename.startswith("grid_sample") and "-DPROBE_BEFORE" in gs.TUNING.get("options", ()):
            return before_text(filename, set())
        return current(filename)

    compile_mod.source = source
    cycles = harness.sleep_cycles_for(20.0)
    defaults = {"tile": gs.TUNING["tile"], "options": gs.TUNING.get("options", ())}
    rows = []
    for name, dt, shape, out, mode in SHAPES:
        dtype = getattr(torch, dt)
        x = torch.randn(shape, device="cuda", dtype=dtype)
        grid = (torch.rand(shape[0], *out, len(out), device="cuda", dtype=torch.float64) * 2.2 - 1.1).to(dtype)
        go = torch.randn(shape[0], shape[1], *out, device="cuda", dtype=dtype)
        for algo, (det, tile) in ALGORITHMS.items():
            row = {"shape": name, "mode": mode, "algorithm": algo}
            grads = {}
            for label, options in (("now", ()), ("before", ("-DPROBE_BEFORE",))):
                gs.TUNING.update(tile=tile, options=options)
                try:
                    def call():
                        return gs.grid_sample_backward(go, x, grid, mode=mode, deterministic=det)
                    grads[label] = [g.double() for g in call()]
                    torch.cuda.synchronize()
                    row[f"{label}_us"] = device_us(call, cycles=cycles)
                    if args.kernels:
                        row[f"{label}_kernels"] = _kernel_us(call)
                finally:
                    gs.TUNING.update(defaults)
            row["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads["now"], grads["before"]))
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
