"""CPU: the store deletes only what it wrote and only in a marked cache root, never follows a planted lock
link, pays a stuck lock's wait once, evicts records stamped in the future, and judges a temp file's
writer only within its own PID namespace; a root-owned system tier lists what it serves."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from plan_cache import PlanRecord, PlanStore

KEY_A, KEY_B = "a1" + "0" * 62, "b2" + "0" * 62
pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX locks, links, signals and modes")


def _record(key=KEY_A, size=100):
    return PlanRecord(key=key, blob=bytes(size), meta={"engine": "eng0"})


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
