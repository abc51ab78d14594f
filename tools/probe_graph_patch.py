"""Probe (GPU host): which plans' CUDA graphs can be re-pointed, whether re-pointed replays compute what
direct runs compute, and what a re-pointed launch costs on the host.

  python3 tools/probe_graph_patch.py --out graph_patch.json [--batch 32] [--skip-resnet]

For every plan (ResNet-50's convs forward with bias+relu, dgrad and wgrad at fp16 channels_last, then
odd cases: fp32, bf16 with a residual, depthwise, grouped, channels-first, dgrad with relu', wgrad with
the bias gradient, 3-D) it records the plan with real and moved pointers (`gpu_launch.graph_patch`) and reports whether the
graph can be re-pointed (and why not), its kernels and pointer words. For a re-pointable graph it runs
three fresh buffer sets twice: directly into one copy and through the re-pointed graph into another
(outputs poisoned with NaN first), and compares every buffer: bit-identical where the plan is
deterministic. Host us per call with the GPU held busy, 8 buffer sets in rotation: direct,
re-pointed, and a plain graph replaying one set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"float16": "half", "bfloat16": "bfloat16", "float32": "float32"}


def _buffers(torch, spec, *, seed: int) -> dict:
    """Fresh buffers of every role: inputs random, outputs NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out_roles = {"y", "dx", "dw", "db"}
    bufs = {}
    for role, desc in spec.tensors().items():
        dtype = getattr(torch, DTYPES[desc.dtype])
        t = torch.empty_strided(desc.shape, desc.strides, dtype=dtype, device="cuda")
        if role in out_roles:
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randn(desc.shape, generator=gen, device="cuda", dtype=torch.float32) * 0.5)
        bufs[role] = t
    return bufs


def _clone(torch, bufs: dict) -> dict:
    out = {}
    for role, t in bufs.items():
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
        c.copy_(t)
        out[role] = c
    return out


def _ptrs(bound_roles, bufs) -> tuple[int, ...]:
    return tuple(bufs[role].data_ptr() for role in bound_roles)


def probe_plan(torch, session, spec, name: str, *, time_host: bool) -> dict:
    from gpu_launch import graph_patch

    plan = session.plan(spec)
    first = _buffers(torch, spec, seed=0)
    bound = plan.bind(**first, cuda_graph=False)
    roles = tuple(r for r in first)  # bind keeps the order buffers were given in
    launcher = bound.launcher
    stream = torch.cuda.current_stream().cuda_stream
    launcher.run(bound.ptrs, stream)  # loads every kernel before recording
    torch.cuda.synchronize()
    row = {"case": name, "engines": list(plan.engines), "deterministic": plan.deterministic}
    graph = launcher._record_raw(bound.ptrs, stream)
    try:
        moved = [launcher._record_raw(graph_patch.moved_pointers(bound.ptrs, m), stream)
                 for m in range(graph_patch.MOVES)]
        patched = graph_patch.PatchableGraph(graph, moved, bound.ptrs, ordinal=plan.device)
    except Exception as err:  # noqa: BLE001 -- the reason is the result
        row.update(repointable=False, reason=f"{type(err).__name__}: {getattr(err, 'reason', err)}")
        print(row, flush=True)
        return row
    row.update(repointable=True, kernels=patched.kernels, patched_kernels=len(patched.nodes),
               pointer_words=patched.sites)
    worst, identical = 0.0, True
    for seed in (1, 2, 3):
        a = _buffers(torch, spec, seed=seed)
        b = _clone(torch, a)
        launcher.run(_ptrs(roles, a), stream)
        patched.launch(_ptrs(roles, b), stream)
        torch.cuda.synchronize()
        for role in a:
            x, y = a[role].double(), b[role].double()
            if torch.isnan(y).any() != torch.isnan(x).any():
                worst = float("inf")
            d = (x - y).abs().max().item() / max(x.abs().max().item(), 1e-30)
            worst = max(worst, d)
            identical &= bool(torch.equal(a[role], b[role]))
    row.update(bit_identical=identical, max_rel_diff=worst)
    if time_host:
        row["host_us"] = _host_times(torch, spec, launcher, patched, roles, stream)
    print(row, flush=True)
    return row


def _host_times(torch, spec, launcher, patched, roles, stream, calls: int = 96) -> dict:
    sets = [_ptrs(roles, _buffers(torch, spec, seed=10 + i)) for i in range(8)]
    plain = launcher.capture(sets[0], stream)
    ways = {"direct": lambda p: launcher.run(p, stream), "repointed": lambda p: patched.launch(p, stream),
            "plain_graph_one_set": lambda p: plain.launch(stream)}
    for fn in ways.values():
        for p in sets:
            fn(p)
    samples = {k: [] for k in ways}
    for _ in range(5):
        for name, fn in ways.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e8))
            t = time.perf_counter()
            for i in range(calls):
                fn(sets[i % 8])
            samples[name].append((time.perf_counter() - t) / calls * 1e6)
            busy = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            if not busy:
                samples[name][-1] = float("nan")  # a call waited for the GPU
    return {k: round(statistics.median(v), 2) for k, v in samples.items()}


def cases(cg, *, batch: int, resnet: bool):
    from cudnn_graphs.presets import resnet_layers

    cl = "channels_last"
    out = []
    if resnet:
        seen = set()
        for layer in resnet_layers("resnet50"):
            key = (layer.c, layer.k, layer.r, layer.stride, layer.hw)
            if key in seen:
                continue
            seen.add(key)
            x = (batch, layer.c, layer.hw, layer.hw)
            w = (layer.k, layer.c, layer.r, layer.r)
            p = layer.r // 2
            common = dict(padding=p, stride=layer.stride, dtype="float16", layout=cl)
            fwd = cg.ConvFwdSpec(x, w, bias=True, activation="relu", **common)
            out.append((f"r50 fwd {key}", fwd))
            out.append((f"r50 dgrad {key}", cg.ConvBwdDataSpec(fwd.y_shape, w, x, **common)))
            out.append((f"r50 wgrad {key}", cg.ConvBwdFilterSpec(x, fwd.y_shape, w, **common)))
    x, w = (8, 64, 20, 20), (64, 64, 3, 3)
    out += [
        ("fp32 fwd", cg.ConvFwdSpec(x, w, padding=1, dtype="float32", layout=cl, bias=True, allow_tf32=False)),
        ("bf16 fwd residual gelu", cg.ConvFwdSpec(x, w, padding=1, dtype="bfloat16", layout=cl, bias=True,
                                                  residual=True, activation="gelu")),
        ("fp16 depthwise", cg.ConvFwdSpec(x, (64, 1, 3, 3), padding=1, groups=64, dtype="float16", layout=cl)),
        ("fp16 grouped 4", cg.ConvFwdSpec(x, (64, 16, 3, 3), padding=1, groups=4, dtype="float16", layout=cl)),
        ("fp16 channels_first", cg.ConvFwdSpec(x, w, padding=1, dtype="float16", bias=True, activation="relu")),
        ("fp16 dgrad relu'", cg.ConvBwdDataSpec(x, w, x, padding=1, dtype="float16", layout=cl,
                                                activation_backward="relu")),
        ("fp16 wgrad bias grad", cg.ConvBwdFilterSpec(x, x, w, padding=1, dtype="float16", layout=cl,
                                                      bias_grad=True)),
        ("fp16 3-D fwd", cg.ConvFwdSpec((2, 32, 8, 12, 12), (32, 32, 3, 3, 3), padding=1, dtype="float16",
                                        layout="channels_last", bias=True)),
        ("fp32 wgrad stride 2", cg.ConvBwdFilterSpec((8, 32, 17, 17), (8, 48, 9, 9), (48, 32, 3, 3), padding=1,
                                                     stride=2, dtype="float32", allow_tf32=False)),
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("graph_patch.json"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-resnet", action="store_true")
    args = ap.parse_args()
    import torch

    import cudnn_graphs as cg

    session = cg.Session(cache=tempfile.mkdtemp(prefix="cg-probe-"))
    rows = []
    for i, (name, spec) in enumerate(cases(cg, batch=args.batch, resnet=not args.skip_resnet)):
        try:
            rows.append(probe_plan(torch, session, spec, name, time_host=i == 0 or "fp32 fwd" in name))
        except Exception as err:  # noqa: BLE001 -- one case's failure is reported, the rest still run
            rows.append({"case": name, "error": f"{type(err).__name__}: {err}"})
            print(rows[-1], flush=True)
    ok = [r for r in rows if r.get("repointable")]
    summary = {"plans": len(rows), "repointable": len(ok),
               "all_repointed_match": all(r["max_rel_diff"] == 0 or not r["deterministic"] for r in ok),
               "reasons": sorted({r.get("reason") or r.get("error") for r in rows if not r.get("repointable")} - {None})}
    print(summary, flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
