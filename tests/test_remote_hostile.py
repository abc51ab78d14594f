"""CPU: the remote tier under a hostile network and planted keys (issue 37, items 3, 6, 7). Real redis-servers
on loopback, and small real TCP servers (tests/resp_servers.py) for what a real Redis never does: trickle a
reply, answer in the wrong shape, send a fake huge bulk header."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cache import stores as stores_mod
from plan_cache import FORMAT_VERSION, PlanRecord, PlanStore, RemoteCacheError, RemoteStore
from plan_cache.record import MAX_RECORD_BYTES
from plan_cache import remote as remote_mod

from . import redis_server
from .resp_servers import FakeServer, trickle
from .test_remote_cache import ROOT, SECRET, _record

pytestmark = pytest.mark.skipif(redis_server.binary() is None, reason="no redis-server")
pytest.importorskip("redis")

PASSWORD = "pw-Hunter2-Secret"


@pytest.fixture
def server(tmp_path):
    srv = redis_server.Server(tmp_path)
    yield srv
    srv.stop()


def _raw(url: str):
    import redis

    return redis.Redis.from_url(url)


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cudnn_graphs", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _env(url: str, **extra: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_GRAPHS_")}
    return {**base, "PYTHONPATH": str(ROOT), config.REMOTE_CACHE: url, config.REMOTE_KEY: SECRET.decode(), **extra}


def _records(n: int = 3):
    return [_record(cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p)) for p in range(n)]


# -- item 3: the password in the URL --------------------------------------------------------------------------
@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@cache:6379/0", "redis://***@cache:6379/0"),
    ("redis://user:pw@cache:6379/0", "redis://***@cache:6379/0"),
    ("rediss://user:p%40ss/w@cache/0", "rediss://***@cache/0"),  # a '/' inside the password
    ("redis://cache:6379/0?password=pw&db=1", "redis://cache:6379/0?password=***&db=1"),
    ("redis://u:pw@cache/0?PassWord=pw", "redis://***@cache/0?PassWord=***"),
    ("unix://:pw@/run/redis.sock?db=2", "unix://***@/run/redis.sock?db=2"),
    ("http://u:pw@cache", "http://***@cache"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
])
def test_redact_url_hides_userinfo_and_password_parameters(url, shown):
    assert remote_mod.redact_url(url) == shown


def test_the_password_in_the_url_reaches_no_output(tmp_path, caplog, monkeypatch):
    srv = redis_server.Server(tmp_path, "--requirepass", PASSWORD)
    url = f"redis://default:{PASSWORD}@127.0.0.1:{srv.port}/0"
    wrong = f"redis://default:{PASSWORD}-wrong@127.0.0.1:{srv.port}/0"
    local = tmp_path / "local"
    for rec in _records():
        PlanStore(local).put(rec)
    outputs = []
    try:
        for args in (["env"], ["doctor"], ["cache", "stats", "--remote", "--cache", str(local)],
                     ["cache", "stats", "--remote", "--json", "--cache", str(local)],
                     ["cache", "push", "--cache", str(local)], ["cache", "pull", "--cache", str(tmp_path / "b")]):
            outputs.append(_cli(*args, env=_env(url)))
        assert "pushed" in outputs[4].stdout, outputs[4].stderr  # the password works: the server was used
        outputs.append(_cli("cache", "pull", "--cache", str(tmp_path / "b"), env=_env(wrong)))
        outputs.append(_cli("doctor", env=_env(wrong)))
    finally:
        srv.stop()
    for args in (["cache", "stats", "--remote", "--cache", str(local)], ["cache", "pull", "--cache", str(local)],
                 ["doctor"]):
        outputs.append(_cli(*args, env=_env(url)))  # unreachable: the warning and the message name the server
    outputs.append(_cli("env", env=_env(f"http://default:{PASSWORD}@cache:6379")))  # a refused value is shown
    outputs.append(_cli("doctor", env=_env(url, **{config.REMOTE_KEY: ""})))  # no key: "URL is off"
    for out in outputs:
        assert PASSWORD not in out.stdout + out.stderr, out.args
    assert any("***@127.0.0.1" in out.stdout + out.stderr for out in outputs)
    monkeypatch.setattr(stores_mod, "_warned", set())
    monkeypatch.setenv(config.REMOTE_CACHE, url)
    monkeypatch.delenv(config.REMOTE_KEY, raising=False)
    monkeypatch.delenv(config.REMOTE_KEY_FILE, raising=False)
    with caplog.at_level(logging.WARNING):
        assert stores_mod.open_remote() is None
        remote = RemoteStore(url, secret=SECRET, timeout=0.3)
        assert remote.get(_record().key) is None  # stopped: one warning naming the server
        with pytest.raises(RemoteCacheError) as bad:
            RemoteStore(url + "?bogus=1", secret=SECRET)
    assert caplog.text.count("***@127.0.0.1") == 2
    for text in (caplog.text, repr(remote), str(remote.stats()), str(bad.value)):
        assert PASSWORD not in text


# -- item 6: deadlines, shapes, sizes --------------------------------------------------------------------------
def test_a_trickling_server_is_cut_off_at_the_deadline():
    srv = FakeServer(lambda cmd: trickle(b"$100\r\n" + b"x" * 100 + b"\r\n", 0.1), lifetime=6)
    try:
        remote = RemoteStore(srv.url, secret=SECRET, timeout=1.0, write_timeout=1.0)  # reads and writes alike
        for call in (lambda: remote.get(_record().key), lambda: remote.put(_record())):
            start = time.monotonic()
            call()
            assert time.monotonic() - start < 1.5, "a byte every 0.1 s held the call past its 1 s deadline"
            remote._down_until = 0.0  # past the back-off: the next call goes to the server again
        assert remote.stats()["timeouts"] >= 1
    finally:
        srv.close()


def test_name_resolution_is_inside_the_deadline(monkeypatch):
    real = socket.getaddrinfo

    def silent_resolver(host, *args, **kwargs):  # the system resolver when its DNS server never answers
        if host == "cache.invalid":
            time.sleep(3)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", silent_resolver)
    remote = RemoteStore("redis://cache.invalid:6379/0", secret=SECRET, timeout=0.5)
    start = time.monotonic()
    assert remote.get(_record().key) is None
    assert time.monotonic() - start < 1.0 and remote.stats()["timeouts"] == 1


def _integers(cmd):  # a RESP service that answers everything with an integer
    return b":5\r\n"


def test_a_reply_of_the_wrong_shape_is_one_warning_and_the_back_off(caplog):
    srv = FakeServer(_integers)
    try:
        remote = RemoteStore(srv.url, secret=SECRET, timeout=0.5, backoff=30)
        with caplog.at_level(logging.WARNING, logger="plan_cache"):
            assert remote.get(_record().key) is None
            assert remote.put(_record()) is False and list(remote.keys()) == []
            stats = remote.stats()
        assert stats["errors"] == 1 and stats["skipped_backing_off"] == 3 and not stats["reachable"]
        assert caplog.text.count("remote plan cache") == 1
        for call, failed in ((remote.stats, lambda s: not s["reachable"]), (remote.keys, lambda k: list(k) == []),
                             (lambda: remote.put(_record()), lambda ok: ok is False)):
            remote._down_until = 0.0  # past the back-off: each kind of call meets the wrong shape itself
            assert failed(call())
        assert remote.stats()["errors"] == 4
    finally:
        srv.close()


def test_the_cli_against_a_service_of_the_wrong_shape_prints_one_line(tmp_path):
    srv = FakeServer(_integers, lifetime=30)
    local = tmp_path / "local"
    PlanStore(local).put(_record())
    try:
        for args, code in ((["cache", "stats", "--remote", "--cache", str(local)], 0),
                           (["cache", "pull", "--cache", str(local)], 1), (["cache", "push", "--cache", str(local)], 1),
                           (["doctor"], None)):
            out = _cli(*args, env=_env(srv.url))
            assert "Traceback" not in out.stderr and (code is None or out.returncode == code), (args, out.stderr)
            assert len([line for line in out.stderr.splitlines() if "remote" in line]) <= 2, out.stderr
    finally:
        srv.close()


def _net_out(client) -> int:
    return client.info("stats")["total_net_output_bytes"]


def test_a_value_too_large_for_a_record_is_never_downloaded(server):
    remote = RemoteStore(server.url, secret=SECRET, timeout=2.0)
    raw = _raw(server.url)
    rec = _record()
    name = remote.name_of(rec.key)
    raw.setrange(name, MAX_RECORD_BYTES + (1 << 20), b"x")  # 65 MiB, made on the server
    before = _net_out(raw)
    assert remote.get(rec.key) is None
    assert remote.put(rec, keep_existing=lambda new, old: True)  # not a record: replaced, never read
    assert _net_out(raw) - before < 1 << 20, "the value was downloaded before the size check"
    assert remote.stats()["too_large"] == 1
    assert remote.get(rec.key).blob == rec.blob and remote.stats()["errors"] == 0


def _flood(head: bytes):
    def reply(cmd):
        yield head
        for _ in range(96):
            yield b"x" * (1 << 20)
    return reply


@pytest.mark.parametrize("head", [b"$100000000000\r\n", b"+"], ids=["fake 100 GB bulk header", "endless line"])
def test_a_reply_longer_than_the_call_may_read_fails_fast(head):
    srv = FakeServer(_flood(head), lifetime=10)
    try:
        remote = RemoteStore(srv.url, secret=SECRET, timeout=2.0)
        start = time.monotonic()
        assert remote.get(_record().key) is None
        assert time.monotonic() - start < 1.0 and remote.stats()["errors"] == 1
        time.sleep(0.3)
        assert srv.sent < 16 << 20, f"the client read {srv.sent >> 20} MiB of a reply no record can be"
    finally:
        srv.close()


def test_a_scan_that_never_ends_is_cut_off():
    srv = FakeServer(lambda cmd: b"*2\r\n$1\r\n7\r\n*0\r\n", lifetime=10)  # cursor 7 forever, no keys
    try:
        remote = RemoteStore(srv.url, secret=SECRET, timeout=0.5, list_timeout=1.0)
        start = time.monotonic()
        assert list(remote.keys()) == []
        assert time.monotonic() - start < 1.5 and remote.stats()["timeouts"] == 1
    finally:
        srv.close()


# -- item 7: planted keys --------------------------------------------------------------------------------------
def _plant(server, remote):
    records = _records()
    for rec in records:
        assert remote.put(rec)
    raw = _raw(server.url)
    prefix = f"cudnn-graphs:v{FORMAT_VERSION}:"
    raw.hset(prefix + "0", "field", "value")  # a valid key name (sorts first) holding a hash: WRONGTYPE
    raw.set(prefix + "../../etc/passwd", b"x")  # not a valid key
    raw.set(prefix.encode() + b"\xff\xfe", b"x")  # not even UTF-8
    return records


def test_a_key_of_the_wrong_type_stays_a_per_key_miss(server, caplog):
    remote = RemoteStore(server.url, secret=SECRET, timeout=0.5)
    records = _plant(server, remote)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert remote.get("0") is None
        assert all(remote.get(rec.key) is not None for rec in records), "one planted key backed the remote off"
        assert remote.put(_record(blob=b"other"))
    stats = remote.stats()
    assert (stats["wrong_type"], stats["errors"], stats["skipped_backing_off"]) == (1, 0, 0)
    assert sorted(remote.keys()) == sorted(["0", *(r.key for r in records)])
    assert remote.stats()["ignored_names"] == 2
    rec = records[0]
    assert remote.put(PlanRecord("0", rec.blob, rec.meta), keep_existing=lambda new, old: True)  # replaced
    assert remote.get("0").blob == rec.blob and remote.stats()["errors"] == 0


def test_pull_with_planted_keys_pulls_every_valid_record(server, tmp_path):
    records = _plant(server, RemoteStore(server.url, secret=SECRET))
    out = _cli("cache", "pull", "--all", "--cache", str(tmp_path / "b"), env=_env(server.url))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert sorted(PlanStore(tmp_path / "b").keys()) == sorted(r.key for r in records)
    assert "refused" not in out.stdout and "not a plan record" in out.stdout, out.stdout


def test_writes_default_to_a_longer_deadline_than_reads():
    """Writes run off the job's path (a background thread that a plan build in C++ can starve of the GIL):
    they get max(5 s, timeout), reads keep `timeout`; a bad value is refused naming the argument."""
    remote = RemoteStore("redis://127.0.0.1:1/0", secret=SECRET, timeout=0.5)
    assert remote.timeout == 0.5 and remote.write_timeout == 5.0
    assert RemoteStore("redis://127.0.0.1:1/0", secret=SECRET, timeout=8).write_timeout == 8.0
    with pytest.raises(RemoteCacheError, match="write_timeout"):
        RemoteStore("redis://127.0.0.1:1/0", secret=SECRET, write_timeout=0)
