"""GPU, two GPUs: DistributedDataParallel over NCCL, two processes (torchrun's environment variables), a
converted small ResNet beside torch's own from the same initialisation and data (tests/gpu_ddp_worker.py):
losses track over 20 steps, gradients all-reduce the same, no_sync accumulates as torch's, a captured
model under DDP trains as the eager one, and no warning mentions streams or gradient strides."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs"),
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                                 reason="needs torch.distributed with NCCL")]
ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
# NVLink multicast stays off on shared hosts: a program using it can take the GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    port, cache = _free_port(), tmp_path_factory.mktemp("ddp-cache")
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDNN_GRAPHS_CACHE_DIR=str(cache), **NO_MULTICAST,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.gpu_ddp_worker"], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            last = stdout.strip().splitlines()[-1:] or [""]
            assert last[0].startswith("{"), f"rank exited {proc.returncode} with no report:\n{stderr[-4000:]}"
            outs.append({**json.loads(last[0]), "returncode": proc.returncode, "stderr": stderr[-2000:]})
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return sorted(outs, key=lambda o: o["rank"])


def test_ranks_exit_cleanly(ranks):
    # apart from the rest: a rank that reported and then failed in teardown still shows what it saw
    assert [out["returncode"] for out in ranks] == [0] * WORLD, [out["stderr"] for out in ranks]


def test_losses_track_torch_ddp_over_twenty_steps(ranks):
    for out in ranks:
        ours, theirs = out["train"]["ours"], out["train"]["torch"]
        assert len(ours) == len(theirs) == 20
        assert theirs[-1] < theirs[0], theirs  # it learns: a comparison worth making
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert abs(a - b) < 0.03 * max(1.0, abs(b)), (out["rank"], step, ours, theirs)  # float16 noise
        assert out["train"]["params_in_sync"], "the converted model's replicas drifted apart"
        assert all(status == "fused" for status in out["train"]["chains"]), out["train"]["chains"]


def test_buckets_are_torchs(ranks):
    buckets = ranks[0]["train"]["buckets"]
    assert buckets["ours"]["bucket_sizes"] == buckets["torch"]["bucket_sizes"], buckets  # same Parameters, same order
    # several buckets (bucket_cap_mb is small): rebuilt in the order gradients became ready, which a
    # fused conv-BatchNorm run changes; what is reduced is the same
    assert buckets["ours"]["num_buckets_reduced"] == buckets["torch"]["num_buckets_reduced"] > 1, buckets


def test_no_sync_accumulates_locally_then_all_reduces_as_torch_does(ranks):
    for out in ranks:
        ns = out["no_sync"]
        assert ns["local_same_on_ranks"] == {"torch": False, "ours": False}, ns  # no all-reduce under no_sync
        assert ns["synced_same_on_ranks"] == {"torch": True, "ours": True}, ns   # then one, of both micro-batches
        assert ns["local_rel_err"] < 2e-2 and ns["synced_rel_err"] < 2e-2, ns


def test_a_captured_model_under_ddp_trains_as_the_eager_one(ranks):
    for out in ranks:
        cap = out["captured"]
        assert cap["captures"] == 1
        for a, b in zip(cap["captured"], cap["eager"]):
            assert abs(a - b) < 1e-2 * max(1.0, abs(b)), cap


def test_no_stream_or_stride_warnings(ranks):
    for out in ranks:
        bad = [w for w in out["warnings"] if "stream" in w.lower() or "stride" in w.lower()]
        assert not bad, bad


def test_runtime_stays_small(ranks):
    assert max(out["seconds"] for out in ranks) < 120, [out["seconds"] for out in ranks]  # cold plan cache included
