"""grid_sample backward: torch vs fallback_kernels (fast and deterministic), side by side in one run.

    python -m benchmarks.grid_sample [--out grid_sample.json] [--reps 50] [--grids random,affine]

Per shape and grid kind: torch's CUDA backward (aten::grid_sampler_{2,3}d_backward, both gradients),
ours fast and ours deterministic (the tile kernels where they apply, else atomics / a counting sort),
bilinear / zeros / align_corners=False. Every algorithm of a shape runs in the same interleaved rounds
(`harness.interleaved`, --rounds 5), medians. Two numbers each:

* gpu_ms: CUDA-event time of one call (--reps calls in all, spread over the rounds), with the GPU held busy
  by a sleep kernel while the call is enqueued, so launch gaps from host overhead are excluded (pure device
  time; `host_bound_blocks` counts the calls whose sleep ended first);
* wall_ms: --reps back-to-back calls a round, host included (what a training loop sees when the host is
  the bottleneck). A variant's knobs are set around each of its calls (a dict update, in its wall time).

Inputs rotate over two fresh random sets. GB/s is against the bytes that must move: read grad_output,
input and grid, write grad_input and grad_grid. Grids: "random" = uniform in [-1, 1] (scattered access),
"affine" = a smooth rotation / scaling (neighbouring points sample neighbouring pixels).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

from benchmarks import harness

SHAPES = [
    dict(name="f32 (8,64,128,128) NCHW -> 128x128", dtype="float32", input=(8, 64, 128, 128), out=(128, 128),
         layout="contiguous", variants=True),
    dict(name="f16 (32,32,64,64) NCHW -> 64x64", dtype="float16", input=(32, 32, 64, 64), out=(64, 64),
         layout="contiguous", variants=True),
    dict(name="f32 (8,64,128,128) NHWC -> 128x128", dtype="float32", input=(8, 64, 128, 128), out=(128, 128),
         layout="channels_last", variants=False),
    dict(name="f32 (4,32,32,64,64) NCDHW -> (32,64,64)", dtype="float32", input=(4, 32, 32, 64, 64),
         out=(32, 64, 64), layout="contiguous", variants=True),
]


def make_grid(n, out_sp, kind, dtype, device="cuda", *, span=1.0):
    """A sampling grid for `n` items of output size `out_sp`: "random" uniform over [-span, span]
    (scattered reads), "affine" a smooth rotation and scaling (neighbouring points sample neighbouring
    pixels). `dtype`: a torch dtype or its name."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    nd = len(out_sp)
    if kind == "random":
        return (torch.rand((n, *out_sp, nd), device=device) * (2 * span) - span).to(dtype)
    theta = torch.zeros((n, nd, nd + 1), device=device)
    for b in range(n):
        a = 0.3 + 0.1 * b
        rot = torch.eye(nd, device=device)
        rot[0, 0], rot[0, 1], rot[1, 0], rot[1, 1] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
        theta[b, :, :nd] = rot * 0.9
        theta[b, :, nd] = 0.05
    return F.affine_grid(theta, (n, 1, *out_sp), align_corners=False).to(dtype)


def make_set(shape, kind):
    import torch

    dt, nd = getattr(torch, shape["dtype"]), len(shape["out"])
    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    x = torch.randn(shape["input"], device="cuda", dtype=dt)
    go = torch.randn((shape["input"][0], shape["input"][1], *shape["out"]), device="cuda", dtype=dt)
    if shape["layout"] == "channels_last":
        x, go = x.contiguous(memory_format=fmt), go.contiguous(memory_format=fmt)
    return dict(x=x, go=go, grid=make_grid(shape["input"][0], shape["out"], kind, dt))


def torch_backward(s):
    import torch

    x, go, grid = s["x"], s["go"], s["grid"]
    op = torch.ops.aten.grid_sampler_2d_backward if x.dim() == 4 else torch.ops.aten.grid_sampler_3d_backward
    return op(go, x, grid, 0, 0, False, [True, True])


def ours_backward(deterministic):
    from fallback_kernels import grid_sample as gs

    def fn(s):
        return gs.grid_sample_backward(s["go"], s["x"], s["grid"], mode="bilinear", padding_mode="zeros",
                                       align_corners=False, deterministic=deterministic)
    return fn


def rotating(fn, sets):
    """A call of `fn` on the next of the input `sets` (they rotate)."""
    rotation = itertools.cycle(sets)
    return lambda: fn(next(rotation))


def with_tuning(fn, tuning: dict):
    """`fn` with `grid_sample.TUNING` updated by `tuning` around each call (restored after)."""
    if not tuning:
        return fn
    from fallback_kernels import grid_sample as gs

    def run(s):
        saved = dict(gs.TUNING)
        gs.TUNING.update(tuning)
        try:
            return fn(s)
        finally:
            gs.TUNING.clear()
            gs.TUNING.update(saved)
    return run


def timed(calls: dict, *, reps: int, rounds: int) -> tuple[dict, dict, dict]:
    """({name: gpu ms}, {name: wall ms}, {name: host-bound blocks}) of zero-argument `calls`, interleaved:
    a ~1 ms sleep keeps the GPU busy while each gpu call is enqueued; each warmed up by 5 calls first."""
    for call in calls.values():
        for _ in range(5):
            call()
    device = harness.DeviceTime(calls=1, blocks=max(1, reps // rounds), sleep_cycles=2_000_000)
    got = harness.interleaved(calls, {"gpu": device, "wall": lambda call: harness.wall_ms(call, calls=reps)},
                              rounds=rounds)
    flags = {k: v["host_bound_blocks"] for k, v in device.flags(calls).items()}
    return got["gpu"], got["wall"], flags


def f64_reference(s):
    """torch's native kernel in float64 on the same (rounded) inputs: the accuracy yardstick."""
    import torch

    d = {k: v.double() for k, v in s.items()}
    with torch.backends.cudnn.flags(enabled=False):
        return torch_backward(d)


def breakdown(fn, s):
    """Device time of each op of one call of ours (CUDA events between ops; GPU kept busy while enqueueing)."""
    import cupy
    import torch

    from fallback_kernels import grid_sample as gs

    torch.cuda.synchronize()
    gs.PROFILE = []
    try:
        harness.sleep(2_000_000)
        fn(s)
        torch.cuda.synchronize()
        return [(label, cupy.cuda.get_elapsed_time(a, b)) for label, a, b in gs.PROFILE]
    finally:
        gs.PROFILE = None


def min_bytes(s):
    x, go, grid = s["x"], s["go"], s["grid"]
    return (go.numel() + 2 * x.numel()) * x.element_size() + 2 * grid.numel() * grid.element_size()


def run(args):
    import torch

    results = []
    for shape in SHAPES:
        for kind in args.grids:
            sets = [make_set(shape, kind) for _ in range(2)]
            ref = torch_backward(sets[0])
            ref64 = f64_reference(sets[0])
            entry = dict(shape=shape["name"], grid=kind, dtype=shape["dtype"],
                         min_mb=min_bytes(sets[0]) / 1e6, algos={}, breakdown={})
            algos = {"torch": torch_backward, "fast": ours_backward(False), "deterministic": ours_backward(True)}
            variants = {"deterministic[sorted, tap keys]": ({"det_keys": "tap"}, True)}
            if shape["variants"] and args.variants:
                variants.update({"fast[go_transpose]": ({"go_transpose": True}, False),
                                 "fast[no_input_transpose]": ({"input_transpose": False}, False)})
            runs = {**algos, **{n: with_tuning(ours_backward(det), tuning) for n, (tuning, det) in variants.items()}}
            for name, fn in runs.items():
                got = fn(sets[0])
                entry["algos"][name] = dict(
                    rel_err_vs_torch=[harness.rel_err(got[0], ref[0]), harness.rel_err(got[1], ref[1])],
                    rel_err_vs_f64=[harness.rel_err(got[0], ref64[0]), harness.rel_err(got[1], ref64[1])])
                if name in ("fast", "deterministic"):
                    entry["breakdown"][name] = breakdown(fn, sets[0])
            gpu, wall, flags = timed({name: rotating(fn, sets) for name, fn in runs.items()}, reps=args.reps,
                                     rounds=args.rounds)
            for name, figures in entry["algos"].items():
                figures.update(gpu_ms=gpu[name], wall_ms=wall[name], gbps=entry["min_mb"] / 1e3 / (gpu[name] / 1e3),
                               host_bound_blocks=flags[name])
            t = entry["algos"]["torch"]
            for a in entry["algos"].values():
                a["speedup_gpu"] = t["gpu_ms"] / a["gpu_ms"]
                a["speedup_wall"] = t["wall_ms"] / a["wall_ms"]
            results.append(entry)
            print_entry(entry, flush=True)
            del sets
            torch.cuda.empty_cache()
    return results


def print_entry(e, flush=False):
    t = e["algos"]["torch"]
    print(f"\n{e['shape']}  grid={e['grid']}  min bytes {e['min_mb']:.1f} MB")
    print(f"  {'algorithm':26s} {'gpu ms':>8s} {'x torch':>8s} {'GB/s':>7s} {'wall ms':>8s} {'x torch':>8s}  "
          f"rel err (gi, gg) vs float64")
    for name, a in e["algos"].items():
        print(f"  {name:26s} {a['gpu_ms']:8.3f} {t['gpu_ms'] / a['gpu_ms']:8.2f} {a['gbps']:7.0f} "
              f"{a['wall_ms']:8.3f} {t['wall_ms'] / a['wall_ms']:8.2f}  "
              f"{a['rel_err_vs_f64'][0]:.1e}, {a['rel_err_vs_f64'][1]:.1e}", flush=flush)
    for name, ops in e["breakdown"].items():
        parts = ", ".join(f"{label.split('<')[0]} {ms * 1e3:.0f}" for label, ms in ops)
        print(f"  {name} us per op: {parts}", flush=flush)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every algorithm of a shape")
    p.add_argument("--grids", default="random,affine", type=lambda s: s.split(","))
    p.add_argument("--no-variants", dest="variants", action="store_false", help="skip the fast path's knobs")
    args = p.parse_args(argv)
    import cupy
    import torch

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}  torch {torch.__version__}  cupy {cupy.__version__}")
    t0 = time.time()
    results = run(args)
    doc = dict(device=props.name, torch=torch.__version__, cupy=cupy.__version__, reps=args.reps, rounds=args.rounds,
               mode="bilinear", padding_mode="zeros", align_corners=False, seconds=time.time() - t0,
               results=results)
    if args.out:
        harness.write_json(args.out, doc)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
