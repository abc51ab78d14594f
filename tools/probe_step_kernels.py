"""Device time of one training step by kernel: torch eager against `convert(model)` with and without the
fused conv-BatchNorm runs (torch.profiler, CUDA kernels only, summed per kernel name, per step).

AMP fp16, channels_last, `cudnn.benchmark=True`; also wall ms per step (interleaved blocks, medians).

    python -m tools.probe_step_kernels --model resnet50 --out probe_step_kernels.json
"""

from __future__ import annotations

import argparse
import collections
import copy
import json

from benchmarks import harness


def make_step(model, x, y):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def kernels(step, n=3) -> collections.Counter:
    """Device ms per step by kernel (the profiler's CUDA kernels over `n` steps, names cut at 90)."""
    totals = collections.Counter()
    for key, us in harness.kernel_us(step, calls=n, warmup=0).items():
        totals[key[:90]] += us / 1000
    return totals


def wall(step, n=10):
    """ms per step: CUDA events around a block of `n` steps, no sleep ahead (host included)."""
    return harness.device_ms(step, calls=n, sleep_cycles=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="probe_step_kernels.json")
    args = p.parse_args(argv)
    import torch
    import torchvision

    import cudnn_graphs.torch as cgt

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
    walls = harness.interleaved(steps, {"wall": wall}, rounds=args.rounds)["wall"]
    out = {"model": args.model, "batch": args.batch, "wall_ms": walls, "kernels": {}}
    for k, step in steps.items():
        totals = kernels(step)
        out["kernels"][k] = {"total_ms": sum(totals.values()), "top": totals.most_common(30)}
    print(json.dumps({"wall_ms": out["wall_ms"], "device_ms": {k: v["total_ms"] for k, v in out["kernels"].items()}}))
    harness.write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
