"""Run in a fresh process by test_gpu_cache: plan a fixed set of specs, check them, print stats as JSON.

    python -m tests.gpu_cache_worker   (the cache root comes from $CUDNN_GRAPHS_CACHE_DIR)
"""

from __future__ import annotations

import json
import sys

import cudnn_graphs as cg

SPECS = [
    # runtime-compiled fused graphs (the ones worth caching)
    cg.ConvFwdSpec((4, 32, 20, 20), (32, 32, 3, 3), padding=1, dtype="float16", layout="channels_last",
                   bias=True, residual=True, activation="relu"),
    cg.ConvFwdSpec((4, 32, 20, 20), (64, 32, 3, 3), padding=1, dtype="bfloat16", layout="channels_last",
                   bias=True, activation="gelu"),
    cg.ConvBwdDataSpec((4, 32, 20, 20), (32, 32, 3, 3), (4, 32, 20, 20), padding=1, dtype="float16",
                       layout="channels_last", activation_backward="relu"),
    # plain graphs, and one with a fallback-kernel part
    cg.ConvFwdSpec((4, 16, 20, 20), (32, 16, 3, 3), padding=1, dtype="float32", allow_tf32=False),
    cg.ConvBwdFilterSpec((4, 32, 20, 20), (4, 32, 20, 20), (32, 32, 3, 3), padding=1, dtype="float16",
                         layout="channels_last", bias_grad=True),
]


def main() -> int:
    import torch

    from tests import gpu_reference as ref

    session = cg.Session(allow_tf32=False)
    errors = []
    for spec in SPECS:
        plan = session.plan(spec)
        outputs = {"conv_fwd": ("y",), "conv_bwd_data": ("dx",), "conv_bwd_filter": ("dw", "db")}[spec.op]
        bufs = {r: ref.poisoned(d) if r in outputs else ref.random(d) for r, d in spec.tensors().items()}
        plan.execute(**bufs)
        torch.cuda.synchronize()
        want = {"conv_fwd": lambda: {"y": ref.fwd(spec, bufs)}, "conv_bwd_data": lambda: {"dx": ref.dgrad(spec, bufs)},
                "conv_bwd_filter": lambda: ref.wgrad(spec, bufs)}[spec.op]()
        errors.append(max(ref.rel_err(bufs[r], want[r]) for r in want))
        if errors[-1] >= ref.TOLERANCE[spec.dtype]:
            print(f"mismatch {spec.op} {spec.dtype}: {errors[-1]} engines {plan.engines}", file=sys.stderr)
    print(json.dumps({"stats": session.stats(), "errors": errors,
                      "fused": [session.plan(s).fused for s in SPECS],
                      "loaded_by": [[_loaded_by(p) for p in session.plan(s).parts] for s in SPECS],
                      "frontend_imported": "cudnn" in sys.modules}))
    return 0 if all(e < ref.TOLERANCE[s.dtype] for e, s in zip(errors, SPECS)) else 1


def _loaded_by(part) -> str:
    if not hasattr(part, "backend"):
        return "kernel"
    return "backend" if part.backend is not None else "frontend"


if __name__ == "__main__":
    raise SystemExit(main())
