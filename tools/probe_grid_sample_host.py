"""Probe (GPU host): what each grid_sample call launches and where its host time goes (GPU held busy).

    python3 tools/probe_grid_sample_host.py [--profile]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import torch

    from fallback_kernels import grid_sample as gs
    from probe_call_path import host_us, profile_calls

    cases = {}
    for label, shape, dtype in (("f32", (8, 64, 128, 128), torch.float32), ("f16", (32, 32, 64, 64), torch.half)):
        n, _, h, w = shape
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        grid = (torch.rand(n, h, w, 2, device="cuda") * 2.2 - 1.1).to(dtype)
        go = torch.randn(n, shape[1], h, w, device="cuda", dtype=dtype)
        cases[f"{label} forward"] = lambda x=x, grid=grid: gs.grid_sample(x, grid)
        cases[f"{label} backward fast"] = lambda go=go, x=x, grid=grid: gs.grid_sample_backward(go, x, grid)
        cases[f"{label} backward det"] = lambda go=go, x=x, grid=grid: gs.grid_sample_backward(
            go, x, grid, deterministic=True)
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        fn()  # a second call on an idle stream records the graph where the plan has one
        prep = list(gs._memo.values())[-1]
        ops = [op[5] if op[0] == "launch" else f"{op[0]}({op[2]})" for op in prep.plan.ops]
        rep = gs._program(prep.plan, 0).replay
        how = "direct" if rep is None else f"graphs {len(rep.graphs)}, enabled {rep.enabled}"
        print(f"{name:24s} {host_us(fn):8.2f} us  ({how})  scratch {prep.plan.scratch_bytes} B  ops {ops}", flush=True)
    _pieces(gs, host_us)
    if args.profile:
        profile_calls(cases, top=18)
    return 0


def _pieces(gs, host_us) -> None:
    """Host us of each piece of a backward call that replays its graph (f16, the tile kernels)."""
    import torch

    from gpu_launch.streams import allocate, capture_probe, stream_pointer

    go = torch.randn(32, 32, 64, 64, device="cuda", dtype=torch.half)
    x, grid = torch.randn_like(go), (torch.rand(32, 64, 64, 2, device="cuda") * 2.2 - 1.1).half()
    options = ("backward", "bilinear", "zeros", False, True, True, False)
    gs.grid_sample_backward(go, x, grid)
    torch.cuda.synchronize()
    gs.grid_sample_backward(go, x, grid)
    key = gs._memo_key((go, x, grid), options)
    prep = gs._memo.get(key)
    plan = prep.plan
    prog = gs._program(plan, 0)
    stream = stream_pointer(None, "torch", 0)
    probe = capture_probe("torch", None)
    outs = [alloc() for _, alloc in prep.outputs]
    scratch = allocate(plan.scratch_bytes, "torch", 0)
    fixed = (go.data_ptr(), x.data_ptr(), grid.data_ptr(), *[o.data_ptr() for o in outs], scratch[1])
    outs2 = [alloc() for _, alloc in prep.outputs]
    other = fixed[:3] + tuple(o.data_ptr() for o in outs2) + fixed[-1:]
    turn = [0]

    def alternate():
        turn[0] ^= 1
        prog.replay(other if turn[0] else fixed, stream, False)

    pieces = {
        "whole call (f16 backward fast)": lambda: gs.grid_sample_backward(go, x, grid),
        "memo key (3 tensors)": lambda: gs._memo_key((go, x, grid), options),
        "memo lookup": lambda: gs._memo.get(key),
        "three data_ptr()": lambda: (go.data_ptr(), x.data_ptr(), grid.data_ptr()),
        "allocate grad_input": prep.outputs[0][1],
        "allocate grad_grid": prep.outputs[1][1],
        "allocate scratch": lambda: allocate(plan.scratch_bytes, "torch", 0),
        "stream_pointer": lambda: stream_pointer(None, "torch", 0),
        "capture probe": lambda: probe(stream),
        "_program lookup": lambda: gs._program(plan, 0),
        "replay, same pointers (graph launch)": lambda: prog.replay(fixed, stream, False),
        "replay, outputs alternating (2 nodes re-pointed)": alternate,
        "direct run of the 3 launches": lambda: prog.run(fixed, stream),
        "alloc: torch.empty_strided(shape, strides, dtype=, device=)":
            lambda: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device),
        "alloc: x.new_empty_strided(shape, strides)": lambda: x.new_empty_strided(x.shape, x.stride()),
        "alloc: x.new_empty(shape)": lambda: x.new_empty(x.shape),
        "alloc: torch.empty_like(x)": lambda: torch.empty_like(x),
        "alloc: torch.empty(shape, dtype=, device=)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "alloc: torch.empty(nbytes, dtype=uint8, device=)": lambda: torch.empty(1 << 20, dtype=torch.uint8,
                                                                                device=x.device),
    }
    for name, fn in pieces.items():
        print(f"  {name:52s} {host_us(fn):8.2f} us", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
