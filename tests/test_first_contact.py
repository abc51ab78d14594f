"""CPU: a machine with no GPU, driver or libcudnn gets one typed error that says what is missing and
what still works, from the API and from `warmup`; a disabled cache is named, not "the warning above"."""

from __future__ import annotations

import argparse

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cli import warmup
from cudnn_graphs.environment import gpu_problem
from cudnn_graphs.errors import CudnnGraphsError, NoGpuError

NO_GPU = gpu_problem(0)
needs_no_gpu = pytest.mark.skipif(NO_GPU is None, reason="this machine has a usable GPU")
SPEC = cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1))


@needs_no_gpu
def test_planning_without_a_gpu_is_one_typed_error_with_the_way_on():
    with pytest.raises(NoGpuError) as info:
        cg.Session(cache=False).plan(SPEC)
    err = info.value
    assert isinstance(err, CudnnGraphsError) and err.reason == NO_GPU
    assert "--dry-run" in str(err) and "cudnn-graphs[cu12]" in str(err)


@needs_no_gpu
def test_a_stored_record_on_a_machine_without_a_gpu_is_kept_and_the_error_is_the_machine(tmp_path, fake_env):
    from plan_cache import PlanRecord, PlanStore

    session = cg.Session(cache=PlanStore(tmp_path))
    key = session.signature(SPEC)
    meta = {"schema": 1, "spec": SPEC.to_dict(), "parts": [{"kind": "cudnn"}], "fused": False, "intermediates": {}}
    session.store.put(PlanRecord(key, b"\x90", meta))
    with pytest.raises(NoGpuError):
        session.plan(SPEC)
    assert session.store.get(key) is not None and session.counters()["rebuilds_from_heuristics"] == 0


@needs_no_gpu
def test_warmup_without_a_gpu_says_so_once(capsys):
    from cudnn_graphs.cli import main

    assert main(["warmup", "--preset", "resnet50", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("no usable CUDA GPU") == 1 and "--dry-run" in err


def test_warmup_with_the_cache_disabled_names_the_variable(monkeypatch):
    monkeypatch.setenv(config.DISABLE_CACHE, "1")
    args = argparse.Namespace(device=0, cache=None, autotune=False, autotune_limit=None, no_progress=True)
    with pytest.raises(CudnnGraphsError, match=config.DISABLE_CACHE):
        warmup._plan_all([], args)
