"""CPU: how a session picks its store, the size-cap variable, and records built from plans."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest

import cudnn_graphs as cg
from cudnn_graphs import ConfigError, config
from cudnn_graphs.cache import RECORD_SCHEMA, open_store, plan_to_record
from cudnn_graphs.plan import restore
from cudnn_graphs.plan.restore import load_plan
from cudnn_graphs.plan.plan import Plan, PlannedPart
from plan_cache import PlanStore


def test_default_store_is_the_configured_dir(cache_dir):
    store = cg.Session().store
    assert isinstance(store, PlanStore) and store.root == cache_dir
    assert store.max_bytes == config.DEFAULT_CACHE_MAX_BYTES


def test_cache_false_and_disable_variable_mean_memory_only(monkeypatch):
    assert cg.Session(cache=False).store is None
    monkeypatch.setenv(config.DISABLE_CACHE, "1")
    assert cg.Session().store is None


def test_cache_path_and_store_objects(tmp_path):
    store = PlanStore(tmp_path / "a")
    assert cg.Session(cache=store).store is store
    assert cg.Session(cache=tmp_path / "b").store.root == tmp_path / "b"
    with pytest.raises(TypeError, match="cache="):
        cg.Session(cache=3)


def test_untrusted_dir_falls_back_to_memory_with_a_warning(tmp_path, caplog):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert open_store(root) is None
    assert any(str(root) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("raw, expected", [("0", None), ("1024", 1024), ("512M", 512 << 20), ("4g", 4 << 30),
                                           ("2GiB", 2 << 30), (" 10k ", 10 << 10)])
def test_cache_max_bytes_parsing(monkeypatch, raw, expected):
    monkeypatch.setenv(config.CACHE_MAX_BYTES, raw)
    assert config.cache_max_bytes() == expected


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5G", "G"])
def test_cache_max_bytes_refuses_bad_values(monkeypatch, raw):
    monkeypatch.setenv(config.CACHE_MAX_BYTES, raw)
    with pytest.raises(ConfigError) as err:
        config.cache_max_bytes()
    assert err.value.variable == config.CACHE_MAX_BYTES and err.value.value == raw


class _FakeGraph:
    def serialize(self):
        return list(b"plan-bytes")


def _fake_plan(spec, signature="ab" * 32):
    part = PlannedPart(name="conv", graph=_FakeGraph(), roles=("x", "w", "y"), index=3, engine="eng0_k2=1",
                       engine_id=0, knobs={"TILE_SIZE": 1}, behavior_notes=("RUNTIME_COMPILATION",),
                       notes=("TENSOR_CORE",), workspace_size=256, scalars={100: np.full((1,), 0.5, np.float32)},
                       heuristic_index=3)
    return Plan(spec=spec, signature=signature, device=0, fused=True, parts=(part,), intermediates={}, handles=None)


def test_record_from_a_plan_round_trips_through_the_store(tmp_path, fake_env):
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1, alpha=0.5)
    record = plan_to_record(_fake_plan(spec), env=fake_env)
    store = PlanStore(tmp_path)
    assert store.put(record)
    back = store.get(record.key)
    assert msgpack.unpackb(back.blob) == [b"plan-bytes"]
    meta = back.meta
    assert meta["schema"] == RECORD_SCHEMA and cg.spec_from_dict(meta["spec"]) == spec
    assert meta["environment"]["gpu_name"] == fake_env.gpu_name and meta["chosen_by"] == "heuristics"
    part = meta["parts"][0]
    assert (part["engine_id"], part["knobs"], part["scalars"]) == (0, {"TILE_SIZE": 1}, [[100, 0.5]])
    assert part["numerical_notes"] == ["TENSOR_CORE"] and part["blob_index"] == 0


def test_record_for_another_spec_or_schema_is_not_loaded(fake_env):
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    record = plan_to_record(_fake_plan(spec), env=fake_env)
    other = spec.replace(padding=0)
    assert load_plan(record, spec=other, session=None) is None
    record.meta["schema"] = RECORD_SCHEMA + 1
    assert load_plan(record, spec=spec, session=None) is None


def test_unserializable_engine_stores_knobs_only(fake_env):
    class NoSerialize:
        def serialize(self):
            raise RuntimeError("engine does not support serialization")

    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    plan = _fake_plan(spec)
    plan.parts[0].graph = NoSerialize()
    record = plan_to_record(plan, env=fake_env)
    assert msgpack.unpackb(record.blob) == [None] and record.meta["parts"][0]["engine_id"] == 0


def test_unprobed_notes_are_not_stored_and_probe_lazily(fake_env):
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    plan = _fake_plan(spec)
    part = plan.parts[0]
    calls = []
    part.notes, part.notes_source = "unprobed", lambda: calls.append(1) or ("NONDETERMINISTIC",)
    assert "numerical_notes" not in plan_to_record(plan, env=fake_env).meta["parts"][0]
    assert part.deterministic is False and plan.deterministic is False
    assert part.numerical_notes == ("NONDETERMINISTIC",) and calls == [1]
    assert plan_to_record(plan, env=fake_env).meta["parts"][0]["numerical_notes"] == ["NONDETERMINISTIC"]


def test_sessions_that_choose_differently_do_not_share_records():
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1, bias=True, activation="relu")
    keys = {cg.Session(cache=False).signature(spec), cg.Session(cache=False, max_workspace_bytes=0).signature(spec),
            cg.Session(cache=False, fuse=False).signature(spec), cg.Session(cache=False, deterministic=True).signature(spec)}
    assert len(keys) == 4


def test_a_kernel_part_keeps_its_cubin_in_the_record(fake_env):
    from fallback_kernels.epilogue import KernelPart

    spec = cg.ConvBwdFilterSpec((2, 4, 6, 6), (2, 8, 6, 6), (8, 4, 3, 3), padding=1, bias_grad=True)
    kernel = KernelPart("bias_grad", ("dy", "db"), "kernel:bias_grad<float, float>", 0, b"\x7fELF-cubin",
                        "_Z9bias_gradIffEvPKT_PS0_4Meta", 8, 256, ("dy", "db"))
    plan = Plan(spec=spec, signature="a" * 64, device=0, fused=False, parts=(kernel,), intermediates={}, handles=None)
    record = plan_to_record(plan, env=fake_env)
    (entry,) = record.meta["parts"]
    assert (entry["kind"], entry["function"]) == ("kernel", "_Z9bias_gradIffEvPKT_PS0_4Meta")
    assert msgpack.unpackb(record.blob, raw=False)[entry["blob_index"]] == b"\x7fELF-cubin"


def _depthwise_bias(**kw):
    return cg.ConvFwdSpec((2, 8, 9, 9), (8, 1, 3, 3), padding=1, groups=8, bias=True, **kw)


@pytest.mark.parametrize("spec, rules", [
    (_depthwise_bias(), {"depthwise_fwd_epilogue_unfused": 1}),
    (_depthwise_bias(activation="relu"), {"depthwise_fwd_epilogue_unfused": 1}),
    (cg.ConvFwdSpec((2, 8, 9, 9), (8, 1, 3, 3), padding=1, groups=8), {}),  # no epilogue: plain conv anyway
    (cg.ConvFwdSpec((2, 8, 9, 9), (8, 8, 3, 3), padding=1, bias=True), {}),  # not depthwise
    (cg.ConvFwdSpec((2, 8, 9, 9), (8, 2, 3, 3), padding=1, groups=4, bias=True), {}),  # grouped, 2 per group
])
def test_plan_rules_stamp_the_specs_they_decide(spec, rules):
    from cudnn_graphs.plan.session import plan_rules

    assert plan_rules(spec) == rules
    assert cg.Session(cache=False).plan_rules(spec) == rules


def test_a_record_planned_under_older_rules_is_built_anew(fake_env, caplog, monkeypatch):
    """A depthwise conv + bias stored before the unfused rule (its record has no stamp) held cuDNN's slow
    fused engine: it must not load; stamped with the rule it loads as any record does."""
    spec = _depthwise_bias()
    session = cg.Session(cache=False)
    old = plan_to_record(_fake_plan(spec), env=fake_env)
    assert old.meta["plan_rules"] == {}
    with caplog.at_level(logging.INFO, logger="cudnn_graphs"):
        assert load_plan(old, spec=spec, session=session) is None
    assert any("older rules" in r.getMessage() for r in caplog.records)
    stamped = plan_to_record(_fake_plan(spec), env=fake_env, rules=session.plan_rules(spec))
    assert stamped.meta["plan_rules"] == {"depthwise_fwd_epilogue_unfused": 1}
    calls = []
    # no GPU here: stop at the parts
    monkeypatch.setattr(restore, "restore_part", lambda session, stored, i: calls.append(i) or (None, "disk"))
    assert load_plan(stamped, spec=spec, session=session).plan.signature == stamped.key and calls == [0]


def test_cache_verify_names_a_record_planned_under_older_rules():
    from cudnn_graphs.environment import environment
    from cudnn_graphs.plan.verify import verify_load

    spec = _depthwise_bias()
    status, detail = verify_load(plan_to_record(_fake_plan(spec), env=environment(0)))
    assert status == "unusable" and "older rules" in detail and "depthwise_fwd_epilogue_unfused" in detail


def test_a_stored_cubin_is_used_only_when_compiled_from_this_versions_kernel_source():
    """A record's kernel part keeps its cubin and the digest of the source it came from; a record from a
    version whose epilogue.cu differs (same function name, perhaps another body or argument list) is
    compiled again instead of run."""
    from fallback_kernels import epilogue
    from cudnn_graphs.plan.parts import stored_kernel

    blobs = [b"\x7fELF-cubin"]
    entry = {"kind": "kernel", "blob_index": 0, "function": "_Z3fwdPf", "source": epilogue.source_digest()}
    assert stored_kernel(entry, blobs) == (blobs[0], "_Z3fwdPf")
    assert stored_kernel({**entry, "source": "0" * 16}, blobs) is None, "another version's source"
    assert stored_kernel({k: v for k, v in entry.items() if k != "source"}, blobs) is None, "a record from before"
    assert stored_kernel({**entry, "blob_index": 1}, blobs) is None and stored_kernel({**entry, "blob_index": -1}, blobs) is None
    assert stored_kernel(entry, [None]) is None


def test_the_kernel_source_digest_follows_every_included_file(monkeypatch):
    from fallback_kernels import compile as kc

    before = kc.source_digest("epilogue.cu")
    real = kc._read

    def edited(name):
        return real(name) + ("\n// edited" if name == "types.cuh" else "")

    kc.source_digest.cache_clear()
    monkeypatch.setattr(kc, "_read", edited)
    try:
        assert kc.source_digest("epilogue.cu") != before, "a header edit must change the digest"
    finally:
        kc.source_digest.cache_clear()
