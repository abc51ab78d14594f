"""CPU: the remote tier under a hostile network and planted keys (issue 37, items 3, 6, 7). Real redis-servers
on loopback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cache import stores as stores_mod
from plan_cache import PlanStore, RemoteStore
from plan_cache import remote as remote_mod

from . import redis_server
from .test_remote_cache import ROOT, SECRET, _record

pytestmark = pytest.mark.skipif(redis_server.binary() is None, reason="no redis-server")
pytest.importorskip("redis")

PASSWORD = "pw-Hunter2-Secret"


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
    assert caplog.text.count("***@127.0.0.1") == 2
    for text in (caplog.text, repr(remote), str(remote.stats())):
        assert PASSWORD not in text
