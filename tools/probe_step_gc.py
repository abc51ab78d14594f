"""Probe (GPU host): how much of a training step the Python garbage collector takes, ours and torch's.

    python3 tools/probe_step_gc.py --out probe_step_gc.json [--models resnet50 mobilenet_v3_large] [--batch 64]

Per model (bench_models.train_setup: AMP, channels_last, SGD; ours = `convert(model)`), steady-state ms per
training step (CUDA events around blocks of 10 steps, median of 5 blocks, ours and torch alternating) with
the collector as it is, with everything alive frozen first (`gc.freeze()`: later collections skip it),
and disabled (`gc.disable()`); plus, with the collector as it is, the collections per step by generation
and the host ms they took (gc.callbacks).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import _alternate, train_setup  # noqa: E402


class _GcClock:
    def __init__(self):
        self.counts, self.ms, self._t0 = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3


def _collections(step, steps: int = 20) -> dict:
    import torch

    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        torch.cuda.synchronize()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(clock)
    return {"per_step_by_generation": [c / steps for c in clock.counts], "gc_ms_per_step": clock.ms / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v3_large"])
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    import torch

    results = []
    for name in args.models:
        setup = train_setup(name, args.batch)
        for step in setup.steps.values():
            for _ in range(5):
                step()
        row = {"model": name, "gc_thresholds": gc.get_threshold()}
        row["collections"] = {k: _collections(step) for k, step in setup.steps.items()}
        row["ms_gc_on"] = _alternate(setup.steps, rounds=5, steps=10)
        gc.freeze()
        row["ms_gc_frozen"] = _alternate(setup.steps, rounds=5, steps=10)
        gc.unfreeze()
        gc.disable()
        try:
            row["ms_gc_off"] = _alternate(setup.steps, rounds=5, steps=10)
        finally:
            gc.enable()
        for k in ("ms_gc_on", "ms_gc_frozen", "ms_gc_off"):
            row[k]["speedup"] = row[k]["torch"] / row[k]["ours"]
        print(json.dumps(row), flush=True)
        results.append(row)
        del setup
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
