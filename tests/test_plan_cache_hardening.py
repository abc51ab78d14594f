"""CPU: the store deletes only what it wrote and only in a marked cache root, never follows a planted lock
link, pays a stuck lock's wait once, evicts records stamped in the future, and judges a temp file's
writer only within its own PID namespace; a root-owned system tier lists what it serves."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from plan_cache import PlanRecord, PlanStore
from plan_cache import store as store_mod
from plan_cache.errors import CacheError, NotACacheError
from plan_cache.store import TAG_NAME, TAG_SIGNATURE

KEY_A, KEY_B, KEY_C, KEY_D = ("a1" + "0" * 62, "b2" + "0" * 62, "c3" + "0" * 62, "d4" + "0" * 62)
pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX locks, links, signals and modes")


def _record(key=KEY_A, size=100):
    return PlanRecord(key=key, blob=bytes(size), meta={"engine": "eng0"})


def _planted(directory, count=40):
    """`count` files a person keeps in `directory`, as the project of issue 37 kept quarantine/*.dat."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (directory / f"{i:02d}.dat").write_bytes(b"keep me")
    return sorted(os.listdir(directory))


# --- item 1: an empty path, the cache mark, and deleting only our own names -----------------------------------

def test_an_empty_root_is_refused_not_taken_for_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for empty in ("", " "):
        with pytest.raises(ValueError, match="root: .* empty path"):
            PlanStore(empty)
    assert os.listdir(tmp_path) == []


def test_a_root_the_store_creates_is_marked_with_a_cachedir_tag(tmp_path):
    store = PlanStore(tmp_path / "new")
    assert (store.root / TAG_NAME).read_bytes().startswith(TAG_SIGNATURE + b"\n")
    store.check_marked()  # no error


def test_clear_and_prune_refuse_a_project_directory_and_delete_nothing(tmp_path):
    project = tmp_path / "project"
    kept = _planted(project / "quarantine")
    (project / "main.py").write_text("print('hi')")
    os.chmod(project, 0o700)
    store = PlanStore(project)
    assert store.put(_record())  # a cache can live there; the directory is still not marked as one
    for action in (store.clear, lambda: store.prune(0)):
        with pytest.raises(NotACacheError, match="main.py|quarantine|no CACHEDIR.TAG") as err:
            action()
        assert isinstance(err.value, CacheError) and err.value.path == str(project)
    assert sorted(os.listdir(project / "quarantine")) == kept and store.get(KEY_A) is not None
    assert not (project / TAG_NAME).exists()


def test_clear_deletes_only_names_the_cache_writes(tmp_path):
    store = PlanStore(tmp_path / "c")
    for key in (KEY_A, KEY_B):
        assert store.put(_record(key))
    kept = _planted(store.root / "quarantine", 3)
    fan_out = store.path_of(KEY_A).parent
    (fan_out / "notes.txt").write_text("mine")
    (fan_out / "draft.rec").write_text("not a key of this directory")
    os.mkdir(store.root / "v1" / "docs", 0o700)
    (store.root / "v1" / "docs" / f"{KEY_C}.rec").write_text("a record name, but not in a fan-out directory")
    assert store.clear() == 2 and list(store.keys()) == []
    assert sorted(os.listdir(store.root / "quarantine")) == kept
    assert sorted(os.listdir(fan_out)) == ["draft.rec", "notes.txt"]
    assert os.listdir(store.root / "v1" / "docs") == [f"{KEY_C}.rec"]


def test_quarantine_pruning_never_deletes_a_persons_files(tmp_path, monkeypatch):
    store = PlanStore(tmp_path / "c")
    kept = _planted(store.root / "quarantine", 40)
    monkeypatch.setattr(store_mod, "QUARANTINE_KEEP", 3)
    for key in (KEY_A, KEY_B, KEY_C, KEY_D, "e5", "f6"):
        assert store.put(_record(key))
        store.path_of(key).write_bytes(b"corrupt")
        assert store.get(key) is None  # quarantined, and the quarantine pruned to the newest 3 of its own
    names = sorted(os.listdir(store.root / "quarantine"))
    assert [n for n in names if n.endswith(".dat")] == kept and len(names) == 40 + 3


def test_an_unmarked_cache_of_an_earlier_version_is_recognised_and_marked(tmp_path):
    store = PlanStore(tmp_path / "old")
    for key in (KEY_A, KEY_B):
        assert store.put(_record(key))
    store.get(KEY_A)
    (store.root / TAG_NAME).unlink()  # as versions before the mark left it
    assert PlanStore(store.root).clear() == 2
    assert (store.root / TAG_NAME).read_bytes().startswith(TAG_SIGNATURE)
    (store.root / TAG_NAME).unlink()
    (store.root / "README").write_text("a person's file beside the layout")
    with pytest.raises(NotACacheError, match="README"):
        store.prune(0)


def test_an_existing_empty_directory_is_marked_when_the_cache_is_laid_out_in_it(tmp_path):
    root = tmp_path / "made-by-mkdir-p"
    root.mkdir(mode=0o700)
    store = PlanStore(root)
    with pytest.raises(NotACacheError, match="no v1/"):
        store.clear()  # nothing of ours yet: not a cache
    assert store.put(_record())
    assert store.clear() == 1 and (root / TAG_NAME).exists()


# --- item 2: lock files are never followed through a link ----------------------------------------------------

@pytest.mark.parametrize("name", [".write.lock", ".evict.lock"])
def test_a_symlinked_lock_file_never_touches_its_target(tmp_path, name, caplog):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    store = PlanStore(tmp_path / "c", max_bytes=400)  # one record fits, two do not
    os.symlink(victim, store.root / name)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.put(_record(KEY_A), keep_existing=lambda old: False)  # takes .write.lock
        assert store.put(_record(KEY_B))  # over the cap: takes .evict.lock
        store.prune(0)
    assert victim.read_text() == "precious" and os.path.islink(store.root / name)
    assert "cannot take lock" in caplog.text


def test_the_filelock_floor_excludes_the_versions_that_follow_lock_links():
    """The soft-lock fallback (no flock on the mount) still uses filelock.SoftFileLock."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    wanted = re.findall(r'^\s*"filelock([^"]*)"', text, flags=re.M)
    floor = re.fullmatch(r">=(\d+)\.(\d+)\.(\d+)", wanted[0].replace(" ", "")) if len(wanted) == 1 else None
    assert floor and tuple(map(int, floor.groups())) >= (3, 20, 3), wanted


def test_a_fifo_at_a_lock_path_is_refused_without_blocking(tmp_path):
    store = PlanStore(tmp_path / "c", lock_timeout=30)
    os.mkfifo(store.root / ".write.lock", 0o600)
    started = time.monotonic()
    assert store.put(_record(), keep_existing=lambda old: False)
    assert time.monotonic() - started < 5


# --- item 8: a stopped lock holder costs one wait, not one per put ----------------------------------------------

_HOLD = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a job stopped (Ctrl-Z, a debugger) while it held the lock
"""


def test_a_stopped_lock_holder_costs_one_wait_not_one_per_put(tmp_path, caplog):
    store = PlanStore(tmp_path / "c", lock_timeout=0.5)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(store.root / ".write.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="plan_cache"):
            for i in range(5):
                assert store.put(_record(KEY_A, size=10 + i), keep_existing=lambda old: False)
        elapsed = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait(10)
    assert elapsed < 1.5, f"5 conditional puts took {elapsed:.1f} s beside a stopped holder"
    assert store.get(KEY_A).blob == bytes(14)
    assert len([r for r in caplog.records if "not acquired" in r.getMessage()]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plan_cache"):  # the holder is gone: locked again, no warning
        assert store.put(_record(KEY_A), keep_existing=lambda old: False)
    assert "lock" not in caplog.text


# --- item 9: mtimes in the future (clock skew) -----------------------------------------------------------------

def test_records_last_used_in_the_future_are_evicted_before_a_new_put(tmp_path):
    size = len(store_mod.encode(_record(KEY_A)))
    store = PlanStore(tmp_path / "c", max_bytes=3 * size)
    future = time.time() + 365 * 86400
    for key in (KEY_A, KEY_B, KEY_C):
        assert store.put(_record(key))
        os.utime(store.path_of(key), (future, future))
    assert store.put(_record(KEY_D))
    assert store.get(KEY_D) is not None, "the new record was evicted at once"
    assert len(store) == 3 and store.stats()["total_bytes"] <= 3 * size
    assert all(os.stat(store.path_of(k)).st_mtime <= time.time() for k in store.keys())  # set to now


def test_a_temp_file_stamped_in_the_future_is_swept_once_stale(tmp_path):
    store = PlanStore(tmp_path / "c", stale_temp_age=0.5)
    temp = store.path_of(KEY_A).parent / ".tmp-elsewhere-1-00ff"
    temp.parent.mkdir(mode=0o700)
    temp.write_bytes(b"x")
    future = time.time() + 86400
    os.utime(temp, (future, future))
    assert store.verify()["removed_temp"] == 0 and temp.exists()  # counted as written now
    time.sleep(0.7)
    assert store.verify()["removed_temp"] == 1 and not temp.exists()


# --- item 12: a live writer in another PID namespace of the same host name --------------------------------------

def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_the_sweep_spares_a_temp_named_for_the_same_host_but_not_this_pid_namespace(tmp_path):
    store = PlanStore(tmp_path / "c", max_bytes=1 << 20)
    fan_out = store.path_of(KEY_A).parent
    fan_out.mkdir(mode=0o700)
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32]
    pid = _dead_pid()  # no such process here; in the writer's own PID namespace it is alive and writing
    foreign = fan_out / f".tmp-{host}-{pid}-00ff"
    foreign.write_bytes(b"a live writer's half-written record")
    assert store.put(_record(KEY_B))  # a capped put sweeps temps of writers it knows are dead
    assert foreign.exists()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_writer_in_another_pid_namespace_names_its_temps_apart(tmp_path):
    code = "from plan_cache.store import temp_name; print(temp_name())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {done.stderr.strip()[:200]}")
    theirs = done.stdout.strip()
    ours = store_mod.temp_name()
    assert theirs.rsplit("-", 2)[0] != ours.rsplit("-", 2)[0]  # same host name, another writer id
    store = PlanStore(tmp_path / "c")
    fan_out = store.path_of(KEY_A).parent
    fan_out.mkdir(mode=0o700)
    name = f"{theirs.rsplit('-', 2)[0]}-{_dead_pid()}-00ff"
    (fan_out / name).write_bytes(b"x")
    (fan_out / f"{ours.rsplit('-', 2)[0]}-{_dead_pid()}-00ff").write_bytes(b"x")  # ours, and dead: swept
    assert store.verify()["removed_temp"] == 1 and os.listdir(fan_out) == [name]


# --- item 12: a root-owned system tier, listed by another user --------------------------------------------------

def _as_nobody(fn):
    """fn() in a forked child running as uid/gid 65534; its JSON result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            out = json.dumps(fn()).encode()
        except BaseException as err:
            out = json.dumps({"error": repr(err)}).encode()
        os.write(write, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def system_tier(record) -> str:
    """A root-owned tier holding `record`, as a team installs one: readable by all, writable by root alone.
    Under /tmp (a test's own tmp_path is root's alone); the caller removes it."""
    root = tempfile.mkdtemp(prefix="system-tier-")
    assert PlanStore(root).put(record)
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return root


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="a root-owned tier read by another uid")
def test_a_root_owned_system_tier_lists_what_it_serves(tmp_path):
    root = system_tier(_record())
    try:
        def look():
            seen = []
            handler = logging.Handler()
            handler.emit = lambda record: seen.append(record.getMessage())
            logging.getLogger("plan_cache").addHandler(handler)
            store = PlanStore(root, read_only=True)
            return {"get": store.get(KEY_A) is not None, "len": len(store), "keys": list(store.keys()),
                    "entries": store.stats()["entries"], "warnings": seen}

        seen = _as_nobody(look)
    finally:
        shutil.rmtree(root)
    assert seen == {"get": True, "len": 1, "keys": [KEY_A], "entries": 1, "warnings": []}
