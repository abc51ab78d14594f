"""Fallback kernels where users call them, beside torch, in one run (issue 18's three figures).

    python3 tools/bench_fallback_calls.py --out calls.json

For grid_sample forward / backward (fast and deterministic; f32 (8,64,128,128) and f16 (32,32,64,64),
bilinear, zeros, random grids over [-1.1, 1.1]) and gemm_bias_act forward / backward (the three shapes of
bench_gemm_act.py), with torch's equivalent:

* host_us: host time per call with the GPU held busy by a queued sleep (probe_call_path.host_us: median of 7
  rounds of 40 calls);
* latency_ms: one call from an idle GPU, CUDA events around it (median of 25);
* device_ms: back-to-back calls, CUDA events around 20 of them, per call (median of 5).

Inputs are fresh N(0, 1) data (never zeros); the GPU's JIT cache is left on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_call_path import host_us  # noqa: E402  (tools/ is sys.path[0] when run as a script)


def _latency_ms(fn, reps=25) -> float:
    import torch

    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return round(statistics.median(out), 4)


def _device_ms(fn, calls=20, rounds=5) -> float:
    import torch

    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # the host queues all calls before the first runs: no launch gaps
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return round(statistics.median(out), 4)


def _measure(fns: dict) -> dict:
    import torch

    for fn in fns.values():  # as a loop's first iterations: plans, then a call on an idle stream records its graph
        fn()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    return {name: {"host_us": round(host_us(fn, calls=40), 2), "latency_ms": _latency_ms(fn), "device_ms": _device_ms(fn)}
            for name, fn in fns.items()}


def grid_cases() -> dict:
    import torch
    import torch.nn.functional as F

    from fallback_kernels import grid_sample as gs

    out = {}
    for label, dtype, shape in (("f32 (8,64,128,128)", torch.float32, (8, 64, 128, 128)),
                                ("f16 (32,32,64,64)", torch.float16, (32, 32, 64, 64))):
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        n, _, h, w = shape
        grid = (torch.rand(n, h, w, 2, device="cuda") * 2.2 - 1.1).to(dtype)
        go = torch.randn(n, shape[1], h, w, device="cuda", dtype=dtype)
        mask = [True, True]
        torch_bwd = torch.ops.aten.grid_sampler_2d_backward
        out[label] = _measure({
            "ours forward": lambda: gs.grid_sample(x, grid),
            "torch forward": lambda: F.grid_sample(x, grid, align_corners=False),
            "ours backward fast": lambda: gs.grid_sample_backward(go, x, grid),
            "ours backward deterministic": lambda: gs.grid_sample_backward(go, x, grid, deterministic=True),
            "torch backward": lambda: torch_bwd(go, x, grid, 0, 0, False, mask),
        })
    return out


def gemm_cases() -> dict:
    import torch

    from bench_gemm_act import SHAPES
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

        def torch_bwd():
            y = acts[act](torch.addmm(biasr, ar, br))
            torch.autograd.grad(y, (ar, br, biasr), dy)

        out[name] = _measure({
            "ours forward": lambda: gemm_bias_act(a, b, bias, activation=act),
            "torch forward": lambda: acts[act](torch.addmm(bias, a, b)),
            "ours backward": lambda: gemm_bias_act_backward(dy, a, b, aux, activation=act),
            "torch backward": torch_bwd,
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="fallback_calls.json")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-grid", action="store_true")
    args = p.parse_args()
    import torch

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_grid:
        result["grid_sample"] = grid_cases()
    if not args.skip_gemm:
        result["gemm_bias_act"] = gemm_cases()
    text = json.dumps(result, indent=1)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
