"""CPU: hardening, round four (issue 55): secrets in URLs, `~user` paths, a capped cache's accounting,
bounded exits, a stopped record-mode lock holder, exit codes that tell the truth, debris. Real
redis-servers on loopback where a server is needed, real processes where one is stopped or killed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from plan_cache import PlanStore, RemoteCacheError, RemoteStore, redact_url

from . import redis_server
from .test_remote_cache import ROOT, SECRET, _record

SEKRIT = "Sekrit-Hunter2-pw"
needs_redis = pytest.mark.skipif(redis_server.binary() is None, reason="no redis-server")


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cudnn_graphs", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _env(**extra: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_GRAPHS_")}
    return {**base, "PYTHONPATH": str(ROOT), **extra}


def _records(n: int = 3):
    return [_record(cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p)) for p in range(n)]


# -- item 1: every secret a URL can carry stays out of every output --------------------------------------------
@pytest.mark.parametrize("url", [
    f"redis://h:6379/0?pass%77ord={SEKRIT}", f"redis://h:6379/0?%70assword={SEKRIT}&db=1",
    f"rediss://h:6379/0?ssl_password={SEKRIT}", f"redis://h/0?Password={SEKRIT}", f"redis://h/0?db=0;password={SEKRIT}",
    f"redis://h/0?password={SEKRIT[:5]}&{SEKRIT[5:]}", f"redis://h/0?password=x#{SEKRIT}",
    f"redis://:{SEKRIT[:5]}/{SEKRIT[5:]}@h:6379/0", f"redis://u:{SEKRIT[:5]}?{SEKRIT[5:]}@h/0",
])
def test_redact_url_hides_every_secret_redis_py_would_read(url):
    shown = redact_url(url)
    for piece in (SEKRIT, SEKRIT[:5], SEKRIT[5:]):
        assert piece not in shown, shown


@needs_redis
def test_no_output_echoes_a_secret_query_parameter_or_a_url_redis_py_cannot_parse(tmp_path, caplog):
    srv = redis_server.Server(tmp_path, "--requirepass", SEKRIT)
    local = tmp_path / "local"
    for rec in _records():
        PlanStore(local).put(rec)
    urls = [f"redis://127.0.0.1:{srv.port}/0?pass%77ord={SEKRIT}", f"redis://127.0.0.1:{srv.port}/0?%70assword={SEKRIT}",
            f"redis://127.0.0.1:{srv.port}/0?ssl_password={SEKRIT}",  # an option the TCP connection refuses
            f"redis://:{SEKRIT[:6]}/{SEKRIT[6:]}@127.0.0.1:{srv.port}/0"]  # an unescaped '/': redis-py cannot parse it
    outputs = []
    try:
        for url in urls:
            env = _env(**{config.REMOTE_CACHE: url, config.REMOTE_KEY: SECRET.decode()})
            for args in (["env"], ["doctor"], ["cache", "stats", "--remote", "--cache", str(local)],
                         ["cache", "push", "--cache", str(local)], ["cache", "pull", "--cache", str(tmp_path / "b")],
                         ["cache", "pull", "--remote", url, "--cache", str(tmp_path / "c")]):
                outputs.append(_cli(*args, env=env))
        assert "pushed" in outputs[3].stdout, outputs[3].stderr  # pass%77ord authenticates: the server was used
        with caplog.at_level(logging.WARNING), pytest.raises(RemoteCacheError) as bad:
            RemoteStore(urls[-1], secret=SECRET)
    finally:
        srv.stop()
    for out in outputs:
        for piece in (SEKRIT, SEKRIT[:6], SEKRIT[6:]):
            assert piece not in out.stdout + out.stderr, (out.args, out.stdout, out.stderr)
    assert "cannot be cast" not in str(bad.value) and SEKRIT[:6] not in str(bad.value)


# -- item 2: ~unknownuser in a path variable is a ConfigError, never a RuntimeError or a traceback --------------
_NOBODY = "~no-such-user-cg55/plans"


@pytest.mark.parametrize("variable", [config.CACHE_DIR, config.SYSTEM_CACHE_DIR, config.RECORD, config.REMOTE_KEY_FILE])
def test_an_unknown_users_home_is_a_config_error_naming_the_variable(variable, monkeypatch, tmp_path):
    for name in (config.CACHE_DIR, config.SYSTEM_CACHE_DIR, config.RECORD, config.REMOTE_KEY, config.REMOTE_KEY_FILE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(config.CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(variable, _NOBODY)
    assert config.problems()[variable].startswith(f"${variable}='{_NOBODY}'")
    out = _cli("env", env=_env(**{variable: _NOBODY}))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"${variable}='{_NOBODY}'" in out.stderr
    if variable == config.RECORD:
        return
    with pytest.raises(cg.ConfigError) as err:
        cg.Session(remote="redis://127.0.0.1:1/0")
    assert (err.value.variable, err.value.value) == (variable, _NOBODY)


def test_record_mode_with_an_unknown_users_home_warns_once_and_plans_go_on(monkeypatch, caplog):
    from cudnn_graphs import recording

    monkeypatch.setenv(config.RECORD, _NOBODY + "/specs.jsonl")
    monkeypatch.setattr(recording, "_from_env", {})
    with caplog.at_level(logging.WARNING):
        for padding in range(3):
            recording.note(cg.ConvFwdSpec((1, 8, 9, 9), (4, 8, 3, 3), padding=padding))
    assert caplog.text.count("record mode") == 1 and config.RECORD in caplog.text
