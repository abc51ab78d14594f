"""Are a conv-BatchNorm run's results the same call after call, run directly and replayed? Which piece
differs first: each stage's statistics (cuDNN's genstats), our finalize, or the backward?

    python tools/probe_chain_replay.py
"""

from __future__ import annotations

import torch

import cudnn_graphs.torch._chain as ch
from tests.test_gpu_chain import Block, _run

CL = torch.channels_last


def calls(direct: bool, n=4):
    torch.manual_seed(3)
    block = Block(c=64, mid=32, k=64).cuda().to(memory_format=CL)
    chain = block.chain()
    x = torch.randn(8, 64, 16, 16, device="cuda").to(memory_format=CL)
    g = torch.randn(8, 64, 16, 16, device="cuda", dtype=torch.float16).to(memory_format=CL)
    saved_replayed, saved_bytes = ch._replayed, ch._bytes
    allocated = []

    def tracked(nbytes, device):
        t = saved_bytes(nbytes, device)
        allocated.append(t)
        return t

    ch._bytes = tracked
    if direct:
        ch._replayed = lambda replay, run, ptrs, stream: run(ptrs, stream)
    out = []
    try:
        for _ in range(n):
            allocated.clear()
            o, dx, dr = _run(block, chain, x, x, g, True)
            program, = chain._plans.values()
            stats = []
            for plan, buf in zip(program.plans, allocated[:len(program.plans)]):
                for name in ("sum", "sq_sum", "mean", "invstd"):
                    off = getattr(plan, name)
                    stats.append(buf[off:off + 4 * plan.k].view(torch.float32).clone())
                stats.append(buf[:plan.sum].clone())  # y
            out.append([o, dx] + [p.grad.clone() for p in block.parameters()] + stats)
            block.zero_grad()
    finally:
        ch._replayed, ch._bytes = saved_replayed, saved_bytes
    return out


torch.use_deterministic_algorithms(True)
names = ["out", "dx", "w0", "g0", "b0", "w1", "g1", "b1", "w2", "g2", "b2"]
names += [f"{n}{i}" for i in range(3) for n in ("sum", "sq", "mean", "inv", "y")]
for direct in (True, False):
    res = calls(direct)
    for j in range(1, len(res)):
        for i in range(j):
            differ = [nm for nm, a, b in zip(names, res[i], res[j]) if not torch.equal(a, b)]
            print("direct" if direct else "replay", f"call {i} vs {j}:", differ)
