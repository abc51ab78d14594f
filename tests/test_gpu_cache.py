"""GPU: plans built in one process are loaded, not rebuilt, by the next; damaged records are survived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

pytest.importorskip("torch")

import cudnn_graphs as cg  # noqa: E402
from cudnn_graphs.plan import resident  # noqa: E402
from plan_cache import PlanRecord, PlanStore  # noqa: E402

from . import gpu_cache_worker as worker  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _fresh_process(cache_dir: Path) -> dict:
    env = dict(os.environ, CUDNN_GRAPHS_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_cache_worker"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-cache")
    first = _fresh_process(root)
    return root, first


def test_first_process_builds_and_writes(warm_cache):
    _, first = warm_cache
    n = len(worker.SPECS)
    assert first["stats"]["builds"] == n and first["stats"]["disk_writes"] == n
    assert first["fused"][:3] == [True, True, True], "the runtime-compiled fused graphs must be in the test"


def test_fresh_process_loads_everything_with_zero_builds(warm_cache):
    root, _ = warm_cache
    second = _fresh_process(root)
    stats = second["stats"]
    assert stats["builds"] == 0 and stats["rebuilds_from_knobs"] == 0
    assert stats["disk_hits"] == len(worker.SPECS)
    assert "frontend" not in sum(second["loaded_by"], []), second["loaded_by"]
    assert not second["frontend_imported"], "a warm process imported the cuDNN frontend"


def test_backend_and_frontend_loads_compute_the_same_bits(warm_cache, monkeypatch):
    """The backend's plan from the stored JSON and the frontend's deserialized graph run one engine."""
    import torch

    from cudnn_graphs.plan import restore

    from . import gpu_reference as ref

    root, _ = warm_cache
    for spec in worker.SPECS:
        outputs = {"conv_fwd": ("y",), "conv_bwd_data": ("dx",), "conv_bwd_filter": ("dw", "db")}[spec.op]
        inputs = {r: ref.random(d) for r, d in spec.tensors().items() if r not in outputs}
        results = []
        for backend in (True, False):
            monkeypatch.setattr(restore, "_BACKEND_LOADS", backend)
            session = _session(root)
            plan = session.plan(spec)
            assert session.stats()["disk_hits"] == 1
            cudnn_parts = [p for p in plan.parts if hasattr(p, "backend")]
            assert cudnn_parts and all((p.backend is not None) == backend for p in cudnn_parts)
            outs = {r: ref.poisoned(d) for r, d in spec.tensors().items() if r in outputs}
            plan.execute(**inputs, **outs)
            torch.cuda.synchronize()
            results.append(outs)
        for role in outputs:  # a nondeterministic engine (split-K wgrad, say) may differ in the last bits
            same = torch.equal(results[0][role], results[1][role]) if plan.deterministic else \
                ref.rel_err(results[0][role], results[1][role].double()) < ref.TOLERANCE[spec.dtype]
            assert same, f"{spec.op} {role} differs between the backend and the frontend load"


def _session(root):
    """A session that sees the store as a fresh process would: no plan held by the process."""
    resident.forget()
    return cg.Session(allow_tf32=False, cache=PlanStore(root))


def test_doctored_blob_is_rebuilt_from_engine_and_knobs(warm_cache, tmp_path):
    root, _ = warm_cache
    spec = worker.SPECS[0]
    store = PlanStore(root)
    key = _session(root).signature(spec)
    record = store.get(key)
    blobs = msgpack.unpackb(record.blob)
    doctored = [b"\x00garbage" + bytes(b[:64]) if b else b for b in blobs]
    store.put(PlanRecord(key, msgpack.packb(doctored, use_bin_type=True), record.meta))
    session = _session(root)
    session.plan(spec)
    stats = session.stats()
    assert (stats["rebuilds_from_knobs"], stats["builds"]) == (1, 0)
    assert store.get(key).blob != msgpack.packb(doctored, use_bin_type=True), "the record was not rewritten"
    again = _session(root)
    again.plan(spec)
    assert again.stats()["disk_hits"] == 1


def test_corrupt_file_is_a_miss_and_a_rebuild(warm_cache, caplog):
    root, _ = warm_cache
    spec = worker.SPECS[3]
    key = _session(root).signature(spec)
    path = next(Path(root).rglob(f"{key}*"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    session = _session(root)
    plan = session.plan(spec)
    stats = session.stats()
    assert (stats["builds"], stats["corrupt_records"]) == (1, 1)
    assert plan.engines and any("quarantine" in str(p) for p in Path(root).rglob("*"))


def test_a_record_planned_under_older_rules_is_replaced_even_when_autotuned(tmp_path):
    """A depthwise conv + bias record from before the unfused rule (no stamp), marked autotuned so it
    outranks a heuristic plan: the next session builds anew, stores the stamped record over it, and the
    one after loads that with zero builds."""
    spec = cg.ConvFwdSpec((2, 16, 14, 14), (16, 1, 7, 7), padding=3, groups=16, bias=True, dtype="float16",
                          layout="channels_last")
    first = _session(tmp_path)
    first.plan(spec)
    store = PlanStore(tmp_path)
    key = first.signature(spec)
    record = store.get(key)
    assert record.meta["plan_rules"] == {"depthwise_fwd_epilogue_unfused": 1}
    stale = {k: v for k, v in record.meta.items() if k != "plan_rules"} | {"chosen_by": "autotune"}
    store.put(PlanRecord(key, record.blob, stale))
    second = _session(tmp_path)
    plan = second.plan(spec)
    assert second.stats()["builds"] == 1 and second.stats()["disk_hits"] == 0
    assert not plan.fused
    assert store.get(key).meta["plan_rules"] == {"depthwise_fwd_epilogue_unfused": 1}, "the stale record stayed"
    third = _session(tmp_path)
    third.plan(spec)
    assert (third.stats()["disk_hits"], third.stats()["builds"]) == (1, 0)
