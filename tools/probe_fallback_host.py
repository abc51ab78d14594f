"""Probe (GPU host): where a fallback kernel call's host time goes (cProfile, GPU held busy).

    python3 tools/probe_fallback_host.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from fallback_kernels import grid_sample as gs
    from fallback_kernels.gemm_act import gemm_bias_act

    x = torch.randn(32, 32, 64, 64, device="cuda", dtype=torch.half)
    grid = (torch.rand(32, 64, 64, 2, device="cuda") * 2.2 - 1.1).half()
    go = torch.randn_like(x)
    a = torch.randn(4096, 1024, device="cuda", dtype=torch.half)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.half)
    bias = torch.randn(4096, device="cuda", dtype=torch.half)
    cases = {"grid_sample f16": lambda: gs.grid_sample(x, grid),
             "grid_sample_backward f16 fast": lambda: gs.grid_sample_backward(go, x, grid),
             "gemm_bias_act fp16 relu": lambda: gemm_bias_act(a, b, bias, activation="relu")}
    from probe_call_path import host_us

    from gpu_launch import driver
    from gpu_launch.streams import stream_pointer

    gs.grid_sample(x, grid)
    prep = next(iter(gs._memo.values()))
    step = gs._program(prep.plan, 0)[0]
    stream = stream_pointer(None, "torch", 0)
    ctx = driver.device(0)

    def enter_exit():
        with ctx:
            pass

    out = prep.outputs[0][1]()
    ptrs = {"input": x.data_ptr(), "grid": grid.data_ptr(), "output": out.data_ptr()}
    key = gs._memo_key((x, grid), ("forward", "bilinear", "zeros", False))
    pieces = {
        "grid_sample f16 (whole call)": cases["grid_sample f16"],
        "memo key": lambda: gs._memo_key((x, grid), ("forward", "bilinear", "zeros", False)),
        "memo lookup": lambda: gs._lookup(key),
        "allocate the output": prep.outputs[0][1],
        "_run (patch + launch)": lambda: gs._run(prep.plan, "torch", 0, dict(ptrs)),
        "Kernel.launch": lambda: step.kernel.launch(stream),
        "driver.device enter+exit": enter_exit,
        "stream_pointer": lambda: stream_pointer(None, "torch", 0),
    }
    for name, fn in pieces.items():
        print(f"{name:40s} {host_us(fn):8.2f} us", flush=True)
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        print(f"== {name}, 200 calls\n" + text.getvalue()[-3200:], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
