"""Probe (GPU host): what each launch costs the host inside a converted model's AMP training step.

    python3 tools/probe_step_launches.py [--model resnet50] [--batch 64] [--out probe.json]

Wraps the launch layer with perf_counter (no profiler): re-pointed graph launches (and within them the
node updates and cuGraphLaunch), plain graph launches, direct cuDNN runs; per step, after 40 warm steps,
the mean host us per call and the calls per step, beside the step's host ms (ours, and torch's).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import train_setup  # noqa: E402


class _Timers:
    def __init__(self):
        self.t, self.n = collections.Counter(), collections.Counter()

    def wrap(self, owner, name, label):
        original = getattr(owner, name)
        timers = self

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.t[label] += time.perf_counter() - start
                timers.n[label] += 1

        setattr(owner, name, wrapper)


def _host_ms(step, n=5) -> float:
    import torch

    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return round(statistics.median(out), 2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    from cudnn_graphs.plan import launcher
    from gpu_launch import driver, graph_patch

    steps = train_setup(args.model, args.batch).steps
    for _ in range(40):
        for step in steps.values():
            step()
    out = {"model": args.model, "batch": args.batch, "device": torch.cuda.get_device_name(),
           "host_ms": {name: _host_ms(step) for name, step in steps.items()}}
    timers = _Timers()
    timers.wrap(graph_patch.PatchableGraph, "launch", "re-pointed graph launch (all)")
    timers.wrap(graph_patch, "_set_node", "node update (cuGraphExec*NodeSetParams)")
    timers.wrap(driver.GraphExec, "launch", "cuGraphLaunch (GraphExec.launch)")
    timers.wrap(launcher._Prepared, "__call__", "direct run (cuDNN execute)")
    timers.wrap(launcher.Launcher, "launch", "Launcher.launch (all)")
    n = 5
    torch.cuda.synchronize()
    for _ in range(n):
        steps["ours"]()
    torch.cuda.synchronize()
    out["per_call_us"] = {k: round(timers.t[k] / timers.n[k] * 1e6, 2) for k in timers.t}
    out["calls_per_step"] = {k: timers.n[k] / n for k in timers.n}
    out["host_ms_per_step_inside"] = {k: round(timers.t[k] / n * 1e3, 2) for k in timers.t}
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
