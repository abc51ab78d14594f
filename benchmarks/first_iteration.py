"""Benchmark (GPU host): a converted torchvision model's first training iteration in a fresh process.

    python -m benchmarks.first_iteration --out first_iteration.json [--model resnet50] [--batch 64]
                                         [--autotune-limit 3] [--repeats 3]

The cache is made the way a job would make it: one process trains a step in record mode
(CUDNN_GRAPHS_RECORD), then `cudnn-graphs warmup SPECS --autotune` tunes every recorded spec. Then
fresh processes, alternating, each timed from its first line (before `import torch`) to the end of
one AMP fp16 channels_last training step (forward, cross-entropy, backward, SGD), all with the
driver's JIT cache on (as jobs run):
  ours            `cudnn_graphs.torch.convert(model)`, plans from the warm autotuned cache
  torch_bm_true   torch eager, cudnn.benchmark=True (it autotunes in every process; a first
                  process warmed the JIT cache, so each timed one is at least its second)
  torch_bm_false  torch eager, cudnn.benchmark=False
Each child also reports the seconds of its step alone (after the model is built) and, for ours, the
session's counters (builds, timings, disk hits): a warm process builds and times nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

_CHILD = r"""
import time
start = time.perf_counter()
import json, sys
import torch, torchvision
mode, model_name, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.backends.cudnn.benchmark = mode == "torch_bm_true"
cl = torch.channels_last
model = getattr(torchvision.models, model_name)(weights=None).cuda().to(memory_format=cl)
if mode in ("ours", "record"):
    import cudnn_graphs.torch as cgt
    model = cgt.convert(model)
x = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=cl)
target = torch.randint(0, 1000, (batch,), device="cuda")
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
torch.cuda.synchronize()
ready = time.perf_counter()
with torch.autocast("cuda", dtype=torch.float16):
    loss = torch.nn.functional.cross_entropy(model(x), target)
opt.zero_grad(set_to_none=True)
loss.backward()
opt.step()
torch.cuda.synchronize()
end = time.perf_counter()
out = {"seconds": round(end - start, 3), "step_s": round(end - ready, 3), "loss": float(loss)}
if mode in ("ours", "record"):
    import cudnn_graphs as cg
    c = cg.default_session(0).counters()
    out.update({k: c[k] for k in ("builds", "autotuned", "timings", "disk_hits", "memory_hits")})
print(json.dumps(out))
"""


def _child(mode: str, args, env: dict) -> dict:
    return harness.run_fresh(["-c", _CHILD, mode, args.model, str(args.batch)], env=env, timeout=1800)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text[-2000:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("first_iteration.json"))
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--autotune-limit", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache, specs = Path(tmp, "cache"), Path(tmp, "specs.jsonl")
        base = harness.fresh_env(Path(tmp, "pycache"), drop_prefix="CUDNN_GRAPHS_", CUDA_CACHE_PATH=Path(tmp, "jit"),
                                 CUDNN_GRAPHS_CACHE_DIR=cache)
        base.pop("CUDA_CACHE_DISABLE", None)
        recorded = _child("record", args, {**base, "CUDNN_GRAPHS_RECORD": str(specs)})
        warm = subprocess.run([sys.executable, "-m", "cudnn_graphs", "warmup", str(specs), "--autotune",
                               "--autotune-limit", str(args.autotune_limit), "--no-progress", "--json"],
                              cwd=harness.ROOT, env=base, capture_output=True, text=True, timeout=3600)
        if warm.returncode != 0:
            raise RuntimeError(warm.stderr[-3000:])
        first_torch = _child("torch_bm_true", args, base)  # the JIT cache's first fill for torch's kernels
        runs: dict[str, list] = {"ours": [], "torch_bm_true": [], "torch_bm_false": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(_child(mode, args, base))
    med = {mode: harness.median(r["seconds"] for r in rs) for mode, rs in runs.items()}
    result = {"model": args.model, "batch": args.batch, "autotune_limit": args.autotune_limit,
              "record_process": recorded, "warmup": _json_or_text(warm.stdout),
              "torch_first_process": first_torch, "runs": runs, "median_s": med,
              "median_step_s": {mode: harness.median(r["step_s"] for r in rs) for mode, rs in runs.items()},
              "speedup_vs_bm_true": round(med["torch_bm_true"] / med["ours"], 2),
              "speedup_vs_bm_false": round(med["torch_bm_false"] / med["ours"], 2)}
    harness.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "warmup")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
