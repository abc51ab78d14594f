"""CPU: hardening, round four (issue 55): secrets in URLs, `~user` paths, a capped cache's accounting,
bounded exits, a stopped record-mode lock holder, exit codes that tell the truth, debris. Real
redis-servers on loopback where a server is needed, real processes where one is stopped or killed."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time

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


# -- item 6: exit codes that tell the truth --------------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    if redis_server.binary() is None:
        pytest.skip("no redis-server")
    srv = redis_server.Server(tmp_path)
    yield srv
    srv.stop()


def _remote_env(url: str, key: bytes = SECRET) -> dict:
    return _env(**{config.REMOTE_CACHE: url, config.REMOTE_KEY: key.decode()})


def test_pull_that_refuses_every_record_exits_1(server, tmp_path):
    for rec in _records():
        RemoteStore(server.url, secret=SECRET).put(rec)
    out = _cli("cache", "pull", "--all", "--cache", str(tmp_path / "b"), env=_remote_env(server.url, b"another-key-0123456789"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "refused" in out.stdout and "pulled" not in out.stdout


def test_pull_into_a_cache_it_cannot_write_says_so_and_exits_1(server, tmp_path):
    for rec in _records():
        RemoteStore(server.url, secret=SECRET).put(rec)
    cache = tmp_path / "b"
    PlanStore(cache)  # a new root: v1/ laid out at once
    for rec in _records():  # a file where each record's directory goes: no write there succeeds, root or not
        (cache / "v1" / rec.key[:2]).write_bytes(b"")
    out = _cli("cache", "pull", "--all", "--cache", str(cache), env=_remote_env(server.url))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "kept the local record" not in out.stdout and "not written here" in out.stdout, out.stdout


def test_push_that_the_server_refuses_exits_1(tmp_path):
    if redis_server.binary() is None:
        pytest.skip("no redis-server")
    srv = redis_server.Server(tmp_path, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    local = tmp_path / "local"
    try:
        import redis

        with contextlib.suppress(redis.OutOfMemoryError):  # an idle server may be over 1 MB already
            redis.Redis.from_url(srv.url).set("ballast", b"x" * (2 << 20))  # then every write is refused (OOM)
        for rec in _records():
            PlanStore(local).put(rec)
        out = _cli("cache", "push", "--cache", str(local), env=_remote_env(srv.url))
    finally:
        srv.stop()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pushed " not in out.stdout and "not written" in out.stderr, out.stdout + out.stderr


def test_push_of_records_the_remote_keeps_exits_0(server, tmp_path):
    local = tmp_path / "local"
    for rec in _records():
        RemoteStore(server.url, secret=SECRET).put(rec.__class__(rec.key, rec.blob, {**rec.meta, "chosen_by": "autotune"}))
        PlanStore(local).put(rec)
    out = _cli("cache", "push", "--cache", str(local), env=_remote_env(server.url))
    assert out.returncode == 0 and "autotuned" in out.stdout, out.stdout + out.stderr


# -- item 7: debris ----------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_export_removes_the_temp_files_of_killed_exports(tmp_path):
    from plan_cache import store as store_mod
    from plan_cache.bundle import export_bundle

    cache = PlanStore(tmp_path / "cache")
    for rec in _records():
        cache.put(rec)
    target = tmp_path / "plans.bundle"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        names = {"dead": f".plans.bundle.tmp-{store_mod._writer_id()}-{_dead_pid()}-{'0' * 16}",
                 "live": f".plans.bundle.tmp-{store_mod._writer_id()}-{live.pid}-{'1' * 16}",
                 "old": f".plans.bundle.tmp-{os.getpid()}-{'2' * 16}",  # an earlier version's name: by age
                 "other": f".other.bundle.tmp-{store_mod._writer_id()}-{_dead_pid()}-{'3' * 16}"}
        for name in names.values():
            (tmp_path / name).write_bytes(b"x" * 1000)
        os.utime(tmp_path / names["old"], (1, 1))
        assert export_bundle(cache, target) == 3
        left = {p.name for p in tmp_path.iterdir()}
    finally:
        live.kill()
        live.wait()
    assert names["dead"] not in left and names["old"] not in left
    assert names["live"] in left and names["other"] in left  # a running export's, another target's


@pytest.mark.parametrize("bundle", ["missing", "corrupt", "directory"])
def test_import_of_a_bad_bundle_creates_no_cache(tmp_path, bundle):
    path = tmp_path / "in.bundle"
    if bundle == "corrupt":
        path.write_bytes(b"CGBUNDL\0" + b"\0" * 100)
    elif bundle == "directory":
        path.mkdir()
    out = _cli("cache", "import", str(path), "--cache", str(tmp_path / "new"), env=_env())
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "new").exists()


def test_pull_from_an_unreachable_remote_creates_no_cache(tmp_path):
    out = _cli("cache", "pull", "--cache", str(tmp_path / "new"), env=_remote_env(f"redis://127.0.0.1:{redis_server.free_port()}/0"))
    assert out.returncode == 1 and not (tmp_path / "new").exists(), out.stderr


# -- item 3: a capped cache keeps a running total; it does not rescan itself on every put ----------------------
def _keyed(i: int, size: int = 200):
    import hashlib

    from plan_cache import PlanRecord

    return PlanRecord(key=hashlib.sha256(str(i).encode()).hexdigest(), blob=b"b" * size, meta={"i": i})


@pytest.mark.parametrize("cap", [1 << 30, 300 * 400])  # far from full; full, so that every put evicts
def test_n_puts_into_a_capped_cache_list_directories_o_n_times(tmp_path, monkeypatch, cap):
    """What made import of 10,000 records 288 s under the default cap (7.8 s without): each put listed the
    whole cache. Directory listings are counted: a bounded number a put, whatever the cache holds."""
    store = PlanStore(tmp_path / "c", max_bytes=cap)
    listings = 0
    real = os.scandir

    def counting(path="."):
        nonlocal listings
        listings += 1
        return real(path)

    monkeypatch.setattr(os, "scandir", counting)
    n = 1500
    for i in range(n):
        assert store.put(_keyed(i))
    monkeypatch.setattr(os, "scandir", real)
    assert listings < 8 * n, f"{listings} directory listings for {n} puts"
    stats = store.stats()
    assert stats["total_bytes"] <= cap and (cap > 1 << 20 or stats["evictions"] > 0)
    assert stats["entries"] == (n if cap > 1 << 20 else stats["entries"])


def test_the_running_total_is_corrected_by_a_rescan_for_other_processes_writes(tmp_path, monkeypatch):
    from plan_cache import store as store_mod

    monkeypatch.setattr(store_mod, "RESCAN_PUTS", 10)
    size = len(store_mod.encode(_keyed(0)))
    ours, theirs = PlanStore(tmp_path / "c", max_bytes=40 * size), PlanStore(tmp_path / "c")
    for i in range(30):
        assert ours.put(_keyed(i))
    for i in range(30, 60):
        assert theirs.put(_keyed(i))  # another process: uncapped, unseen by ours until it rescans
    for i in range(60, 100):  # 30 puts: at least one rescan is due (after max(10, records found) puts)
        assert ours.put(_keyed(i))
    assert ours.stats()["total_bytes"] <= 40 * size


# -- item 4: exit never waits on the remote without bound -------------------------------------------------------
def _slow_redis(command: list[bytes]) -> bytes:
    """A server that answers a write correctly, 2 s late (EXEC), and everything else at once."""
    name = command[0].upper()
    if name == b"EXEC":
        time.sleep(2)
        return b"*1\r\n+OK\r\n"
    return {b"STRLEN": b":0\r\n", b"SET": b"+QUEUED\r\n", b"GET": b"$-1\r\n"}.get(name, b"+OK\r\n")


_QUEUE_WRITES = """
import sys
from cudnn_graphs.plan import tiers
from plan_cache import PlanRecord, RemoteStore
remote = RemoteStore(sys.argv[1], secret=b"fleet-secret-0123456789", timeout=0.5)
for i in range(300):  # more than the queue holds (256)
    tiers._write_through(remote, PlanRecord(key=f"k{i:04d}", blob=b"plan", meta={}), lambda name: None)
print("queued", flush=True)
"""


EXIT_DEADLINE = 2.0  # docs/cache.md's promise


def test_exit_waits_for_queued_remote_writes_at_most_its_deadline():
    from .resp_servers import FakeServer

    pytest.importorskip("redis")
    srv = FakeServer(_slow_redis, lifetime=60)
    try:
        child = subprocess.Popen([sys.executable, "-c", _QUEUE_WRITES, srv.url], cwd=ROOT, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "queued\n"  # every write is queued (or dropped): the process exits now
        start = time.monotonic()
        _, err = child.communicate(timeout=120)
        waited = time.monotonic() - start
    finally:
        srv.close()
    assert child.returncode == 0, err
    assert waited < EXIT_DEADLINE + 1.5, f"exit took {waited:.1f} s with writes 2 s apiece queued"
    assert err.count("write-throughs are waiting already") == 1, err  # the bounded queue said so, once
    assert err.count("not done") == 1 and "dropped" in err, err  # what exit drops, said once


# -- item 5: a stopped record-mode lock holder costs one short wait, and recording goes on ----------------------
_HOLD_AND_STOP = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_record_lock_holder_costs_one_short_wait_and_recording_goes_on(tmp_path, caplog):
    from cudnn_graphs import recording

    target = tmp_path / "specs.jsonl"
    specs = [cg.ConvFwdSpec((1, 8, 9, 9), (4, 8, 3, 3), padding=p) for p in range(4)]
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_AND_STOP, f"{target}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with recording.record(target), caplog.at_level(logging.WARNING):
            waits = []
            for spec in specs[:3]:
                start = time.monotonic()
                recording.note(spec)
                waits.append(time.monotonic() - start)
            holder.kill()  # the stopped holder goes: its lock with it
            holder.wait()
            recording.note(specs[3])
    finally:
        holder.kill()
        holder.wait()
    assert waits[0] < 3 and max(waits[1:]) < 0.5, waits  # one short wait, then only tried
    assert caplog.text.count("record mode") == 1, caplog.text
    assert [line for line in target.read_text().splitlines()] == [recording.spec_line(s) for s in specs]


# -- item 8: first-contact papercuts -----------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["deterministic", "allow_tf32", "fuse"])
@pytest.mark.parametrize("value", ["no", "False", 0, None])
def test_session_flags_are_true_or_false_never_bool_of_a_string(field, value):
    with pytest.raises(cg.SpecError) as err:
        cg.Session(cache=False, **{field: value})
    assert (err.value.field, err.value.value) == (field, value)


@pytest.mark.parametrize("arguments", [{"env": "H100"}, {"env": {"gpu_name": "H100"}}, {"policy": "fuse"}])
def test_signature_refuses_what_is_no_environment_with_a_typed_error(arguments):
    with pytest.raises(cg.SpecError) as err:
        cg.signature(cg.ConvFwdSpec((1, 8, 9, 9), (4, 8, 3, 3)), **arguments)
    assert err.value.field == next(iter(arguments))
    with pytest.raises(cg.SpecError):
        cg.signature("conv_fwd")


@pytest.mark.parametrize("url", ["http://cache:6379", f"http://u:{SEKRIT}@cache", "cache:6379", " "])
def test_a_session_refuses_a_remote_that_is_no_redis_url(url):
    with pytest.raises(cg.SpecError) as err:
        cg.Session(remote=url)
    assert err.value.field == "remote" and SEKRIT not in str(err.value)


@pytest.mark.parametrize("argv", [[], ["env", "--device", "-1"], ["doctor", "--device", "-2"],
                                  ["cache", "verify", "--device", "-1"], ["env", "--device", "9" * 5000],
                                  ["cache", "ls", "--bogus"], ["warmup", "--batch", "0"], ["cache"]])
def test_usage_errors_exit_2_with_one_line(argv):
    out = _cli(*argv, env=_env())
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and "usage:" not in out.stderr, out.stderr
    assert "9" * 200 not in out.stderr


def test_an_over_long_number_in_a_spec_line_is_said_in_words(tmp_path):
    path = tmp_path / "specs.jsonl"
    path.write_text('{"schema": 1, "op": "conv_fwd", "x_shape": [%s, 8, 9, 9]}\n' % ("9" * 5000))
    out = _cli("check", "--no-graph", str(path), env=_env())
    assert out.returncode == 1 and "5000 digits" in out.stderr, out.stderr
    assert "set_int_max_str_digits" not in out.stderr and "4300" not in out.stderr


def test_doctor_does_not_call_a_relative_cache_dir_ok(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cudnn_graphs", "doctor"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=_env(**{config.CACHE_DIR: "plans"}))
    line = next(line for line in out.stdout.splitlines() if "plan cache" in line)
    assert line.startswith("warn") and "relative" in line and str(tmp_path / "plans") in line, line


def test_the_dry_run_summary_never_reads_signatures_for_none():
    out = _cli("warmup", "--preset", "resnet50", "--dry-run", env=_env())
    assert out.returncode == 0, out.stderr
    assert "signatures for none" not in out.stderr and "signatures for" in out.stderr


def test_the_cpu_fallback_warns_once_per_process_not_per_shape(caplog):
    torch = pytest.importorskip("torch")
    import cudnn_graphs.torch as cgt
    from cudnn_graphs.torch import _fallback

    _fallback._said.clear()
    model = torch.nn.Sequential(cgt.Conv2d(3, 8, 3), cgt.Conv2d(8, 16, 1), cgt.Conv2d(16, 4, 5, padding=2))
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"):
        for batch in (1, 2):
            model(torch.randn(batch, 3, 12, 12))
    assert sum("CPU tensors" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("call", ["bicubic_5d", "bad_mode", "grid_rank"])
def test_grid_sample_refuses_bad_arguments_with_spec_errors_on_cpu_as_on_cuda(call):
    torch = pytest.importorskip("torch")
    import cudnn_graphs.torch as cgt
    from gpu_launch.errors import BufferMismatchError

    x5, g5 = torch.randn(1, 2, 3, 4, 5), torch.rand(1, 2, 2, 2, 3)
    calls = {"bicubic_5d": (lambda: cgt.grid_sample(x5, g5, mode="bicubic", align_corners=False), cg.SpecError),
             "bad_mode": (lambda: cgt.grid_sample(x5, g5, mode="area", align_corners=False), cg.SpecError),
             "grid_rank": (lambda: cgt.grid_sample(x5, g5[0], align_corners=False), BufferMismatchError)}
    fn, error = calls[call]
    with pytest.raises(error):
        fn()


@pytest.mark.parametrize("shapes", [(("1", 2, 5, 5), (1, 3, 3, 2)), ((1, 2, 5, 5), (1, 3, 3.0, 2)),
                                    ((1, 2, True, 5), (1, 3, 3, 2))])
def test_grid_sample_geometry_refuses_a_dimension_that_is_no_integer(shapes):
    from fallback_kernels import grid_sample as gs

    with pytest.raises(cg.SpecError) as err:
        gs.geometry(*shapes, "float32", "float32")
    assert err.value.field in ("input_shape", "grid_shape")


def test_record_of_an_unknown_users_home_is_a_spec_error_naming_the_path(tmp_path, monkeypatch):
    """cg.record("~nouser/...") is refused at once, typed, and makes no '~nouser' directory here."""
    from cudnn_graphs.errors import SpecError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as err:
        with cg.record("~no_such_user_cudnn_graphs/specs.jsonl"):
            pass
    assert err.value.field == "path" and "~no_such_user_cudnn_graphs" in str(err.value)
    assert list(tmp_path.iterdir()) == []
