"""CPU: the read-only system tier ($CUDNN_GRAPHS_SYSTEM_CACHE_DIR), as MIOpen keeps a system database
under the user's: consulted after the user cache, never written, touched or quarantined in, and refused
when anyone but its owner (the user or root) can write it."""

from __future__ import annotations

import logging
import os

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cache import LoadOutcome, open_system_store
from plan_cache import PlanRecord, PlanStore, UntrustedCacheError

SPEC = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX owners and modes")


@pytest.fixture
def system(tmp_path, monkeypatch):
    root = tmp_path / "system"
    PlanStore(root).put(PlanRecord(cg.Session(cache=False).signature(SPEC), b"plan", {"from": "system"}))
    os.chmod(root, 0o755)  # readable by the team, writable by its owner alone
    monkeypatch.setenv(config.SYSTEM_CACHE_DIR, str(root))
    return root


def test_the_system_tier_is_read_only_and_leaves_no_trace(system):
    store = open_system_store()
    key = cg.Session(cache=False).signature(SPEC)
    path = store.path_of(key)
    before = os.stat(path).st_mtime_ns
    assert store.get(key).meta == {"from": "system"}
    assert os.stat(path).st_mtime_ns == before
    assert store.put(PlanRecord(key, b"other", {})) is False and store.get(key).blob == b"plan"
    path.write_bytes(b"damaged")
    assert store.get(key) is None and path.read_bytes() == b"damaged"  # a miss, not quarantined
    assert not (system / "quarantine").exists()


def test_a_session_consults_the_system_tier_after_its_own(system, monkeypatch):
    from types import SimpleNamespace

    from cudnn_graphs.plan import resident
    from cudnn_graphs.plan import session as session_mod

    seen = []
    session = cg.Session()
    plan = SimpleNamespace(device=session.device, signature=session.signature(SPEC), chosen_by="heuristics")
    monkeypatch.setattr(session_mod, "load_plan",
                        lambda record, spec, session: seen.append(record.meta) or LoadOutcome(plan, "disk", False))
    resident.forget()
    try:
        assert session.plan(SPEC) is plan and seen == [{"from": "system"}]
    finally:
        resident.forget()  # a stand-in plan must not reach other tests' sessions
    assert cg.Session(cache=False).system_store is None  # cache=False keeps nothing on disk, either tier


def test_a_group_writable_system_tier_is_refused_with_a_warning(system, caplog):
    os.chmod(system, 0o775)
    with pytest.raises(UntrustedCacheError, match="lets group or others write"):
        PlanStore(system, read_only=True)
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"):
        assert open_system_store() is None
    assert "is not used" in caplog.text


def test_a_missing_system_tier_is_a_configuration_error(tmp_path, monkeypatch):
    monkeypatch.setenv(config.SYSTEM_CACHE_DIR, str(tmp_path / "absent"))
    assert config.SYSTEM_CACHE_DIR in config.problems()
    with pytest.raises(cg.ConfigError, match="cache import"):
        config.system_cache_dir()
