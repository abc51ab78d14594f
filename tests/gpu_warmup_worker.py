"""Run in a fresh process by test_gpu_autotune: plan and run every spec of a preset, print stats as JSON.

    python -m tests.gpu_warmup_worker PRESET BATCH   (the cache root comes from $CUDNN_GRAPHS_CACHE_DIR)
"""

from __future__ import annotations

import json
import math
import sys

import cudnn_graphs as cg
from cudnn_graphs.presets import preset_specs


def main(preset: str, batch: int) -> int:
    import torch

    from tests import gpu_reference as ref

    session = cg.Session(policy="autotune")  # an autotuning session: it must still find nothing to tune
    outputs = {"conv_fwd": ("y",), "conv_bwd_data": ("dx",), "conv_bwd_filter": ("dw", "db")}
    unwritten = []
    specs = preset_specs(preset, batch=batch)
    for spec in specs:
        plan = session.plan(spec)
        bufs = {r: ref.poisoned(d) if r in outputs[spec.op] else ref.random(d) for r, d in spec.tensors().items()}
        plan.execute(**bufs)
        torch.cuda.synchronize()
        if any(not math.isfinite(float(bufs[r].double().sum())) for r in outputs[spec.op]):
            unwritten.append(spec.op)
    chosen = sorted({session.plan(s).chosen_by for s in specs})
    print(json.dumps({"stats": session.stats(), "specs": len(specs), "unwritten": unwritten, "chosen_by": chosen}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2])))
