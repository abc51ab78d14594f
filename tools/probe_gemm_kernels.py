"""Probe (GPU host): which kernels gemm_bias_act's forward runs and for how long, beside torch's act(addmm).

    python3 tools/probe_gemm_kernels.py

torch.profiler over 10 forward calls of each, on the three shapes of bench_gemm_act.py; prints the CUDA
kernels with their mean device time (us), so a device-time gap can be pinned on the GEMM or the pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _kernels(fn, calls: int = 10) -> list:
    """The CUDA kernels `calls` calls of fn ran (torch.profiler's averages), after one warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [ev for ev in prof.key_averages() if ev.device_time_total > 0]


def main() -> int:
    import torch

    from bench_gemm_act import SHAPES
    from fallback_kernels.gemm_act import gemm_bias_act

    torch.backends.cuda.matmul.allow_tf32 = False
    acts = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}
    for name, dtype, act, m, k, n, *_ in SHAPES:
        dt = getattr(torch, dtype)
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt) * k ** -0.5
        bias = torch.randn(n, device="cuda", dtype=dt)
        for label, fn in (("ours", lambda: gemm_bias_act(a, b, bias, activation=act)),
                          ("torch", lambda: acts[act](torch.addmm(bias, a, b)))):
            print(f"== {name} {label}")
            for ev in _kernels(fn):
                print(f"   {ev.device_time_total / ev.count:9.1f} us x{ev.count:3d}  {ev.key[:110]}")
    # the forward pass alone, per activation, on one shape: which formulas make it compute-bound
    from fallback_kernels import gemm_act

    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for act in ("identity", "gelu", "silu", "elu", "tanh", "sigmoid", "softplus"):
        fn = lambda: gemm_bias_act(a, b, bias, activation=act, save_for_backward=False)  # noqa: E731
        for ev in (ev for ev in _kernels(fn) if "act_fwd_rows" in ev.key):
            name = ev.key.split("(")[0].removeprefix("void ")
            regs = gemm_act._function("bfloat16", 0, name, act).num_regs
            print(f"   pass {act:9s} {ev.device_time_total / ev.count:7.1f} us  {regs} registers  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
