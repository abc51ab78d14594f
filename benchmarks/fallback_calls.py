"""Fallback kernels where users call them, beside torch, in one run (issue 18's three figures).

    python -m benchmarks.fallback_calls --out fallback_calls.json [--plot fallback_calls.png]
    python -m benchmarks.fallback_calls --plot-from benchmarks/results/h100/fallback_calls.json   # no GPU

For grid_sample forward / backward (fast and deterministic; f32 (8,64,128,128) and f16 (32,32,64,64),
bilinear, zeros, random grids over [-1.1, 1.1]) and gemm_bias_act forward / backward (the three shapes of
`benchmarks.gemm_act`), with torch's equivalent doing the same work: torch's backward is
`torch.autograd.grad` on a graph its forward built once (`retain_graph=True`), against our backward alone.
Ours and torch's calls of a case alternate round by round (`harness.interleaved`, --rounds 7), medians:

* host_us: host time per call with the GPU held busy by a queued sleep (40 calls a round);
* latency_ms: one call from an idle GPU, CUDA events around it (5 a round);
* device_ms: back-to-back calls, CUDA events around 20 of them, per call (one block a round, queued behind
  a sleep; `device_host_bound_blocks` counts the blocks whose sleep ended first: launch gaps counted there).

Inputs are fresh N(0, 1) data (never zeros); the GPU's JIT cache is left on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness
from benchmarks.gemm_act import SHAPES
from benchmarks.grid_sample import make_grid


ROUNDS = 7


def measure(fns: dict, *, rounds: int = ROUNDS) -> dict:
    """Each call's three figures, every call of the case in the same interleaved rounds; every call run twice
    first, as a loop's first iterations (plans, then a call on an idle stream records its graph)."""
    import torch

    for fn in fns.values():
        fn()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    device = harness.DeviceTime(calls=20)
    got = harness.interleaved(fns, {"host_us": lambda fn: harness.host_us(fn, calls=40),
                                    "latency_ms": lambda fn: harness.latency_ms(fn, reps=5),
                                    "device_ms": device}, rounds=rounds)
    flags = device.flags(fns)
    return {name: {"host_us": round(got["host_us"][name], 2), "latency_ms": round(got["latency_ms"][name], 4),
                   "device_ms": round(got["device_ms"][name], 4),
                   "device_host_bound_blocks": flags[name]["host_bound_blocks"]}
            for name in fns}


def grid_cases(*, rounds: int = ROUNDS) -> dict:
    import torch
    import torch.nn.functional as F

    from fallback_kernels import grid_sample as gs

    out = {}
    for label, dtype, shape in (("f32 (8,64,128,128)", torch.float32, (8, 64, 128, 128)),
                                ("f16 (32,32,64,64)", torch.float16, (32, 32, 64, 64))):
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        n, _, h, w = shape
        grid = make_grid(n, (h, w), "random", dtype, span=1.1)
        go = torch.randn(n, shape[1], h, w, device="cuda", dtype=dtype)
        mask = [True, True]
        torch_bwd = torch.ops.aten.grid_sampler_2d_backward
        out[label] = measure({
            "ours forward": lambda: gs.grid_sample(x, grid),
            "torch forward": lambda: F.grid_sample(x, grid, align_corners=False),
            "ours backward fast": lambda: gs.grid_sample_backward(go, x, grid),
            "ours backward deterministic": lambda: gs.grid_sample_backward(go, x, grid, deterministic=True),
            "torch backward": lambda: torch_bwd(go, x, grid, 0, 0, False, mask),
        }, rounds=rounds)
    return out


def gemm_cases(*, rounds: int = ROUNDS) -> dict:
    import torch

    from fallback_kernels.gemm_act import gemm_bias_act, gemm_bias_act_backward

    torch.backends.cuda.matmul.allow_tf32 = False
    acts = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}
    out = {}
    for name, dtype, act, m, k, n, *_ in SHAPES:
        dt = getattr(torch, dtype)
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt) * k ** -0.5
        bias = torch.randn(n, device="cuda", dtype=dt)
        dy = torch.randn(m, n, device="cuda", dtype=dt)
        _, aux = gemm_bias_act(a, b, bias, activation=act)
        ar, br, biasr = (t.detach().clone().requires_grad_(True) for t in (a, b, bias))
        y = acts[act](torch.addmm(biasr, ar, br))  # torch's forward, once: its backward alone is timed

        def torch_bwd(y=y, ar=ar, br=br, biasr=biasr, dy=dy):
            torch.autograd.grad(y, (ar, br, biasr), dy, retain_graph=True)

        out[name] = measure({
            "ours forward": lambda: gemm_bias_act(a, b, bias, activation=act),
            "torch forward": lambda: acts[act](torch.addmm(bias, a, b)),
            "ours backward": lambda: gemm_bias_act_backward(dy, a, b, aux, activation=act),
            "torch backward": torch_bwd,
        }, rounds=rounds)
    return out


def plot(result: dict, path) -> None:
    """Each call's speed-up over torch's in latency from an idle GPU (torch ms / ours ms)."""
    rows = {}
    for kernel in ("grid_sample", "gemm_bias_act"):
        for case, calls in result.get(kernel, {}).items():
            for name, figures in calls.items():
                who, op, *variant = name.split(" ")  # "ours backward fast": ours, backward, fast
                if who == "ours":
                    torch_ms = calls[f"torch {op}"]["latency_ms"]
                    rows.setdefault(f"{kernel} {case} {op}", {})[" ".join(["ours", *variant])] = harness.ratio(
                        torch_ms, figures["latency_ms"])
    harness.bar_chart(path, rows, title=harness.title(result, "fallback kernels, latency from an idle GPU"),
                      ylabel="torch ms / ours ms", baseline=1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("fallback_calls.json"))
    p.add_argument("--plot", type=Path, help="draw each call's speed-up in latency as a PNG here")
    p.add_argument("--plot-from", type=Path, metavar="JSON", help="only draw --plot from a stored result (no GPU)")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-grid", action="store_true")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of every call of a case")
    args = p.parse_args(argv)
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), args.plot or args.plot_from.with_suffix(".png"))
        return 0
    import torch

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "torch_backward": "autograd.grad on a graph built once (retain_graph): backward alone"}
    if not args.skip_grid:
        result["grid_sample"] = grid_cases(rounds=args.rounds)
    if not args.skip_gemm:
        result["gemm_bias_act"] = gemm_cases(rounds=args.rounds)
    harness.write_json(args.out, result)
    print(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
