"""Device time of one training step by kernel: torch eager against `convert(model)` with and without the
fused conv-BatchNorm runs (torch.profiler, CUDA kernels only, summed per kernel name, per step).

AMP fp16, channels_last, `cudnn.benchmark=True`; also wall ms per step (interleaved blocks, medians).

    python tools/probe_step_kernels.py --model resnet50 --out probe_step_kernels.json
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

import cudnn_graphs.torch as cgt


def make_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def kernels(step, n=3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0):
            totals[ev.key[:90]] += ev.self_device_time_total / n / 1000
    return totals


def wall(step, n=10):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="probe_step_kernels.json")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = getattr(torchvision.models, args.model)().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    steps = {"torch": make_step(base, x, y),
             "ours": make_step(cgt.convert(copy.deepcopy(base)), x, y),
             "ours_unfused_bn": make_step(cgt.convert(copy.deepcopy(base), fuse_batchnorm=False), x, y)}
    for step in steps.values():
        for _ in range(5):
            step()
    walls = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            walls[k].append(wall(step))
    out = {"meta": {"gpu": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch},
           "wall_ms": {k: statistics.median(v) for k, v in walls.items()}, "kernels": {}}
    for k, step in steps.items():
        totals = kernels(step)
        out["kernels"][k] = {"total_ms": sum(totals.values()), "top": totals.most_common(30)}
    print(json.dumps({"wall_ms": out["wall_ms"], "device_ms": {k: v["total_ms"] for k, v in out["kernels"].items()}}))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
