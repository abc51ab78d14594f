"""CPU: files and directories planted in a plan cache (FIFOs, directories, symbolic links at every
level, foreign-writable directories, over-size sparse files) never hang, leak, escape or crash it."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest

from plan_cache import PlanRecord, PlanStore, UntrustedCacheError
from plan_cache.record import MAX_RECORD_BYTES

KEY_A, KEY_B = "a1" + "0" * 62, "b2" + "0" * 62
pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file types and modes")


def _record(key=KEY_A):
    return PlanRecord(key=key, blob=b"plan bytes", meta={"engine": "eng0"})


@pytest.fixture
def store(tmp_path):
    return PlanStore(tmp_path / "cache")


def _path(store, key=KEY_A):
    return store.path_of(key)


def _in_time(fn, seconds=5.0):
    """fn() on a thread; fails instead of hanging when it does not return in time."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} hung"
    return out["value"]


def test_a_fifo_at_a_record_path_is_a_miss_not_a_hang(store):
    path = _path(store)
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path, 0o600)
    assert _in_time(lambda: store.get(KEY_A)) is None
    assert store.stats()["untrusted"] == 1
    assert _in_time(store.verify)["ok"] == 0
    assert _in_time(lambda: store.peek(KEY_A)).status in ("missing", "untrusted")


def test_a_directory_at_a_record_path_is_a_miss_and_leaks_no_descriptor(store):
    path = _path(store)
    path.mkdir(mode=0o700, parents=True)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(100):
        assert store.get(KEY_A) is None
        assert store.peek(KEY_A).status in ("missing", "untrusted")
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
    assert store.put(_record()) and store.get(KEY_A) == _record()  # moved aside, the key works again


def test_a_symlinked_records_directory_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir(mode=0o700)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / "v1").symlink_to(outside)
    with pytest.raises(UntrustedCacheError, match="symbolic link"):
        PlanStore(root)
    assert PlanStore.open_or_none(root) is None


def test_the_root_itself_may_be_reached_through_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    store = PlanStore(tmp_path / "link")
    assert store.put(_record()) and store.get(KEY_A) == _record()


def test_a_symlinked_fan_out_directory_is_never_read_written_or_deleted_through(store, tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    victim = outside / f"{KEY_A}.rec"
    victim.write_bytes(b"someone else's file")
    _path(store).parent.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.get(KEY_A) is None
        assert store.put(_record()) is False
        assert store.delete(KEY_A) is False
        assert store.clear() == 0
        assert list(store.keys()) == [] and store.stats()["entries"] == 0
    assert victim.read_bytes() == b"someone else's file" and sorted(p.name for p in outside.iterdir()) == [victim.name]
    assert "symbolic link" in caplog.text


def test_a_symlinked_quarantine_never_receives_or_loses_files(store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    kept = [outside / f"file{i}" for i in range(8)]
    for f in kept:
        f.write_bytes(b"x")
    (store.root / "quarantine").symlink_to(outside)
    path = _path(store)
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"not a record")
    os.chmod(path, 0o600)
    assert store.get(KEY_A) is None  # corrupt: deleted, since it cannot be quarantined
    assert not path.exists()
    store.clear()
    assert all(f.exists() for f in kept) and len(list(outside.iterdir())) == len(kept)


@pytest.mark.parametrize("where", ["fan-out", "quarantine"])
def test_directories_others_can_write_are_not_used(store, where, caplog):
    assert store.put(_record())
    if where == "fan-out":
        os.chmod(_path(store).parent, 0o777)
        with caplog.at_level(logging.WARNING, logger="plan_cache"):
            assert store.get(KEY_A) is None
            assert store.put(_record(KEY_A)) is False
        assert "lets group or others write" in caplog.text
        assert _path(store).exists()  # refused, not deleted: a person decides
    else:
        quarantine = store.root / "quarantine"
        quarantine.mkdir(mode=0o700)
        os.chmod(quarantine, 0o777)
        (quarantine / "planted").write_bytes(b"x")
        _path(store).write_bytes(b"corrupt now")
        assert store.get(KEY_A) is None
        store.clear()
        assert (quarantine / "planted").exists()
        assert not any(name.endswith(".rec") for name in os.listdir(quarantine))


def test_an_oversize_sparse_record_is_rejected_from_its_size_alone(store, monkeypatch):
    path = _path(store)
    path.parent.mkdir(mode=0o700)
    with open(path, "wb") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # sparse: no disk used
    os.chmod(path, 0o600)
    import plan_cache.store as store_mod

    monkeypatch.setattr(store_mod, "_read_exactly", lambda *a: pytest.fail("an over-size file was read"))
    assert store.get(KEY_A) is None
    assert store.stats()["corrupt"] == 1


def test_peek_is_read_only(store):
    assert store.put(_record())
    before = os.stat(_path(store)).st_mtime_ns
    peeked = store.peek(KEY_A)
    assert peeked.status == "ok" and peeked.record == _record() and stat.S_ISREG(peeked.stat.st_mode)
    assert os.stat(_path(store)).st_mtime_ns == before and store.stats()["hits"] == 0


def test_bundle_import_refuses_fifos_and_oversize_files_before_reading(store, tmp_path, monkeypatch):
    from plan_cache import bundle
    from plan_cache.bundle import CorruptBundleError, import_bundle

    fifo = tmp_path / "b.cgb"
    os.mkfifo(fifo, 0o600)
    err = _in_time(lambda: _raises(lambda: import_bundle(store, fifo)))
    assert isinstance(err, CorruptBundleError) and "not a regular file" in str(err)
    huge = tmp_path / "huge.cgb"
    with open(huge, "wb") as f:
        f.truncate(bundle.MAX_BUNDLE_BYTES + 1)
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("an over-size bundle was read"))
    with pytest.raises(CorruptBundleError, match="bundle cap"):
        import_bundle(store, huge)


def _raises(fn):
    try:
        fn()
    except Exception as err:  # handed back to the test thread, re-raised there
        return err
    return None


def test_temp_files_of_dead_writers_are_swept_at_once_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from plan_cache import store as store_mod

    store = PlanStore(tmp_path / "cache", max_bytes=1 << 20)
    fan = _path(store).parent
    fan.mkdir(mode=0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    names = {"dead": f"{store_mod.TEMP_PREFIX}{store_mod._writer_id()}-{int(dead.stdout)}-00ff",
             "live": f"{store_mod.TEMP_PREFIX}{store_mod._writer_id()}-{os.getppid()}-00ff",
             "other host": f"{store_mod.TEMP_PREFIX}elsewhere-{int(dead.stdout)}-00ff",
             "old style": f"{store_mod.TEMP_PREFIX}{int(dead.stdout)}-00ff"}
    for name in names.values():
        (fan / name).write_bytes(b"x" * 1000)
    assert store.put(_record())  # a capped put scans, and sweeps what dead writers left
    left = set(os.listdir(fan))
    assert names["dead"] not in left
    assert {names["live"], names["other host"], names["old style"]} <= left  # fresh and not provably dead
    old = os.stat(fan / names["other host"]).st_mtime - 3600
    for name in ("other host", "old style"):
        os.utime(fan / names[name], (old, old))
    assert PlanStore(store.root, stale_temp_age=60).verify()["removed_temp"] == 2  # the age rule: any host
    assert set(os.listdir(fan)) == {names["live"], f"{KEY_A}.rec"}


def test_a_lock_refused_once_does_not_turn_the_store_to_soft_locks(store, monkeypatch, caplog):
    import errno

    from plan_cache._files import NoFollowLock

    real_acquire = NoFollowLock.acquire
    calls = []

    def refuse_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_acquire(self, *args, **kwargs)

    monkeypatch.setattr(NoFollowLock, "acquire", refuse_once)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.prune(1 << 30) == 0  # no lock this time: nothing evicted, a warning
        store.prune(1 << 30)
    assert "going on without it" in caplog.text and store._use_soft_lock is False and len(calls) == 2


def test_prune_clear_and_verify_on_a_read_only_disk_warn_and_do_not_raise(store, monkeypatch, caplog):
    import errno

    for key in (KEY_A, KEY_B):
        assert store.put(_record(key))

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

    monkeypatch.setattr(os, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.prune(0) == 0
        assert store.clear() == 0
        store.verify()
    assert "Read-only" in caplog.text and len(store) == 2
