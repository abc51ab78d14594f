"""Benchmark (GPU host): a converted torchvision model's first training iteration in a fresh process.

    python -m benchmarks.first_iteration --out first_iteration.json [--model resnet50] [--batch 64]
                                         [--autotune-limit 3] [--repeats 3]

The cache is made the way a job would make it: one process trains a step in record mode
(CUDNN_GRAPHS_RECORD) with `torch.backends.cudnn.benchmark = True`, as the timed ones run, so the specs
match (the convert layer autotunes each geometry there, every candidate timed: it keeps those plans in a
cache of its own, so that they do not stand in for --autotune-limit's), then `cudnn-graphs warmup SPECS
--autotune --autotune-limit N` tunes every recorded spec into the cache the timed processes read. Then
fresh processes, alternating, each
timed from its first line (before `import torch`) to the end of one AMP fp16 channels_last training step
(forward, cross-entropy, backward, SGD), all with the driver's JIT cache on (as jobs run):
  ours            `cudnn_graphs.torch.convert(model)`, cudnn.benchmark=True: fused runs' plans read from
                  the warm cache; convs outside them train through torch's conv, which times them
  ours_plans      the same with `train_convs="cudnn_graphs"`: every conv's autotuned plan read from the
                  warm cache, nothing timed (the record process runs this way, so it records every spec)
  ours_bm_false   the same, cudnn.benchmark=False (the default session, plans from the same cache)
  torch_bm_true   torch eager, cudnn.benchmark=True (it autotunes in every process; a first
                  process warmed the JIT cache, so each timed one is at least its second)
  torch_bm_false  torch eager, cudnn.benchmark=False
Each child also reports the seconds of its step alone (after the model is built) and, for ours, the
counters of the sessions its modules used (builds, autotuned, timings, disk hits): a warm process builds
and times nothing. Issue 38's goal is `speedup_vs_bm_true` (torch_bm_true / ours, whole process) >= 3;
`step_speedup_vs_bm_true` is the same ratio of the step alone. Each child's result is printed as one
JSON line as it ends. The exit status is 1 where a timed process failed (its error is in the JSON).
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
ours = sys.argv[4] != "torch"
torch.backends.cudnn.benchmark = sys.argv[5] == "benchmark"
cl = torch.channels_last
model = getattr(torchvision.models, model_name)(weights=None).cuda().to(memory_format=cl)
if ours:
    import cudnn_graphs.torch as cgt
    model = cgt.convert(model, train_convs="cudnn_graphs" if sys.argv[4] == "plans" else "torch")
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
out = {"mode": mode, "benchmark": torch.backends.cudnn.benchmark, "seconds": round(end - start, 3),
       "step_s": round(end - ready, 3), "loss": float(loss)}
if ours:
    import cudnn_graphs as cg
    sessions = {id(cg.default_session(0)): cg.default_session(0)}
    try:  # the sessions torch's flags chose (cudnn.benchmark: an autotuning one); internal, hence guarded
        from cudnn_graphs.torch import _conv
        sessions.update((id(s), s) for s in getattr(_conv, "_SESSIONS", {}).values())
    except ImportError:
        pass
    counts = [s.counters() for s in sessions.values()]
    out.update({k: sum(c.get(k, 0) for c in counts)
                for k in ("builds", "autotuned", "timings", "disk_hits", "memory_hits")})
    out["sessions"] = len(counts)
print(json.dumps(out))
"""
OURS = ("ours", "ours_bm_false", "ours_plans", "record")
PLANS = ("ours_plans", "record")  # train_convs="cudnn_graphs"; record so: every conv's specs are recorded
BENCHMARK_ON = ("ours", "ours_plans", "torch_bm_true", "record")  # record as `ours` runs, so the specs match
MODES = ("ours", "ours_plans", "ours_bm_false", "torch_bm_true", "torch_bm_false")


def _child(mode: str, args, env: dict, *, required: bool = False) -> dict:
    """One fresh process of `mode`, its JSON printed as it ends; a failure raises where `required`, else
    is reported as {"mode", "error"} (the other modes still run)."""
    route = "plans" if mode in PLANS else "ours" if mode in OURS else "torch"
    argv = ["-c", _CHILD, mode, args.model, str(args.batch), route,
            "benchmark" if mode in BENCHMARK_ON else "no-benchmark"]
    try:
        out = harness.run_fresh(argv, env=env, timeout=1800)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as err:  # Value/IndexError: no JSON
        if required:
            raise
        out = {"mode": mode, "error": f"{type(err).__name__}: {err}"[-2000:]}
    print(json.dumps(out), flush=True)  # kept if a time limit cuts the rest
    return out


def medians(runs: dict[str, list], key: str) -> dict[str, float]:
    """{mode: median of `key` over its runs that succeeded} (NaN for a mode none of whose runs did)."""
    return {mode: harness.median(r[key] for r in rs if key in r) for mode, rs in runs.items()}


def failures(runs: dict[str, list]) -> int:
    """How many timed processes failed."""
    return sum("error" in r for rs in runs.values() for r in rs)


def ratios(med: dict, step: dict) -> dict:
    """torch's / ours' seconds, whole process and step alone (NaN where a mode was not run)."""
    def r(a, b):
        return round(harness.ratio(a, b), 2)

    return {"speedup_vs_bm_true": r(med.get("torch_bm_true"), med.get("ours")),
            "step_speedup_vs_bm_true": r(step.get("torch_bm_true"), step.get("ours")),
            "speedup_vs_bm_false": r(med.get("torch_bm_false"), med.get("ours")),
            "step_speedup_vs_bm_false": r(step.get("torch_bm_false"), step.get("ours")),
            "ours_bm_false_speedup_vs_bm_true": r(med.get("torch_bm_true"), med.get("ours_bm_false")),
            "ours_plans_speedup_vs_bm_true": r(med.get("torch_bm_true"), med.get("ours_plans")),
            "ours_plans_step_speedup_vs_bm_true": r(step.get("torch_bm_true"), step.get("ours_plans"))}


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
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="the timed fresh processes, alternating in this order")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache, specs = Path(tmp, "cache"), Path(tmp, "specs.jsonl")
        base = harness.fresh_env(Path(tmp, "pycache"), drop_prefix="CUDNN_GRAPHS_", CUDA_CACHE_PATH=Path(tmp, "jit"),
                                 CUDNN_GRAPHS_CACHE_DIR=cache)
        base.pop("CUDA_CACHE_DISABLE", None)
        # its own cache: its plans, each tuned over every candidate, would otherwise be the ones timed
        recorded = _child("record", args, {**base, "CUDNN_GRAPHS_RECORD": str(specs),
                                           "CUDNN_GRAPHS_CACHE_DIR": str(Path(tmp, "record-cache"))}, required=True)
        warm = subprocess.run([sys.executable, "-m", "cudnn_graphs", "warmup", str(specs), "--autotune",
                               "--autotune-limit", str(args.autotune_limit), "--no-progress", "--json"],
                              cwd=harness.ROOT, env=base, capture_output=True, text=True, timeout=3600)
        if warm.returncode != 0:
            raise RuntimeError(warm.stderr[-3000:])
        first_torch = _child("torch_bm_true", args, base)  # the JIT cache's first fill for torch's kernels
        runs: dict[str, list] = {mode: [] for mode in args.modes}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(_child(mode, args, base))
    med, step = medians(runs, "seconds"), medians(runs, "step_s")
    result = {"model": args.model, "batch": args.batch, "autotune_limit": args.autotune_limit,
              "record_process": recorded, "warmup": _json_or_text(warm.stdout),
              "torch_first_process": first_torch, "runs": runs, "median_s": med, "median_step_s": step,
              **ratios(med, step)}
    harness.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "warmup")}), flush=True)
    failed = failures(runs)
    if failed:
        print(f"benchmarks.first_iteration: {failed} timed process(es) failed (their errors are in the JSON)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
