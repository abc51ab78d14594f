"""Where a converted ResNet-50 training step spends host time: cProfile over a few steps with autograd's
backward on the calling thread (so the profile sees it), beside torch's own model for the total.

    python tools/probe_chain_host.py --out probe_chain_host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import io
import pstats
import time

import torch
import torchvision

import cudnn_graphs.torch as cgt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe_chain_host.txt")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.autograd.set_multithreading_enabled(False)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    ours = cgt.convert(copy.deepcopy(model))
    x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device="cuda")
    report = []

    def step(m):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()

    for m in (model, ours):
        for _ in range(5):
            step(m)
    torch.cuda.synchronize()
    for name, m in (("torch", model), ("ours", ours)):
        torch.cuda._sleep(int(5e9))
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(m)
        host = (time.perf_counter() - t0) / args.steps
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        report.append(f"{name}: host ms per step {host * 1e3:.2f} (GPU still busy: {busy})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(ours)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    text = "\n".join(report) + "\n" + str(ours.cudnn_graphs_report) + "\n" + s.getvalue()
    print("\n".join(report))
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
