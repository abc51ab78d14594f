"""Probe (GPU host): where a converted model's training step goes, variant by variant.

    python3 tools/probe_model_step.py [--model resnet50] [--batch 64]

Times ms per AMP training step (CUDA events, median of blocks) for torch eager and for ours with the
launcher's CUDA-graph capture on and off, and reports the launchers' graph counts and waste, plus a
host-side profile of one step of ours.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_models import _alternate, _train_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--graphs", type=int, help="graphs kept per launcher (default: the library's)")
    args = p.parse_args()
    import torch
    import torchvision

    import cudnn_graphs as cg
    import cudnn_graphs.torch as cgt
    from cudnn_graphs.plan import launcher as launcher_mod

    torch.backends.cudnn.benchmark = True
    if args.graphs:
        launcher_mod.GRAPHS_PER_LAUNCHER = launcher_mod.CAPTURES_PER_LAUNCHER = args.graphs
    cl = torch.channels_last
    base = getattr(torchvision.models, args.model)(weights=None).cuda().to(memory_format=cl)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=cl)
    target = torch.randint(0, 1000, (args.batch,), device="cuda")
    theirs, ours = copy.deepcopy(base), cgt.convert(copy.deepcopy(base))
    steps = {"torch": _train_step(theirs, torch.optim.SGD(theirs.parameters(), lr=1e-4), x, target),
             "ours": _train_step(ours, torch.optim.SGD(ours.parameters(), lr=1e-4), x, target)}
    for step in steps.values():
        for _ in range(3):
            step()
    print("capture on:", _alternate(steps, rounds=3, steps=10))
    import time

    import faulthandler

    for name, step in steps.items():  # host time of one step behind a ~1 s sleep; a sync would drain it
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))
            t = time.perf_counter()
            faulthandler.dump_traceback_later(0.3, file=sys.stdout)  # where the host waits, if it does
            step()
            faulthandler.cancel_dump_traceback_later()
            host_ms = (time.perf_counter() - t) * 1e3
            busy = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
        print(f"{name}: host {host_ms:.1f} ms per step with the GPU busy; GPU still busy after: {busy}")
    launchers = [c.launcher for c in cg.default_session(0).calls.values()]
    before = sum(la.captures for la in launchers)
    print("capture on, again:", _alternate(steps, rounds=1, steps=10), "captures in those 10 steps of ours:",
          sum(la.captures for la in launchers) - before)
    print(f"{len(launchers)} launchers, {sum(len(la._graphs) for la in launchers)} graphs, "
          f"{sum(la.capture_enabled for la in launchers)} capturing, {sum(la.captures for la in launchers)} captures, "
          f"replays {sum(g.launches for la in launchers for g in la._graphs.values())}")
    for la in launchers:
        la.capture_enabled = False
        la._graphs.clear()
    print("capture off:", _alternate(steps, rounds=3, steps=10))
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():  # device kernels by name, and the host's total
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
        print(f"== {name}\n{table[-6000:]}")
    prof2 = cProfile.Profile()
    prof2.enable()
    for _ in range(3):
        steps["ours"]()
    torch.cuda.synchronize()
    prof2.disable()
    text = io.StringIO()
    pstats.Stats(prof2, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue()[-3000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
