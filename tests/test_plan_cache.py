"""plan_cache: record format, corruption handling, eviction, trust checks, maintenance. CPU only.

Concurrency (many processes, writers killed mid-write) is in test_plan_cache_concurrency.py.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import random
import stat
import time

import filelock
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plan_cache
from plan_cache import (FORMAT_VERSION, CorruptRecordError, PlanRecord, PlanStore, UntrustedCacheError)
from plan_cache import record as record_mod
from plan_cache import _files as files_mod
from plan_cache import store as store_mod

KEY_A = "a1" + "0" * 62
KEY_B = "b2" + "1" * 62
KEY_C = "c3" + "2" * 62
KEY_D = "d4" + "3" * 62
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _record(key: str = KEY_A, size: int = 256, **meta) -> PlanRecord:
    return PlanRecord(key=key, blob=bytes(i % 256 for i in range(size)), meta={"engine": 3, **meta})


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "plan_cache" and r.levelno == logging.WARNING]


def _record_path(store: PlanStore, key: str):
    return store.root / f"v{FORMAT_VERSION}" / key[:2] / f"{key}.rec"


def _quarantined(store: PlanStore) -> list[str]:
    q = store.root / "quarantine"
    return sorted(os.listdir(q)) if q.exists() else []


def _temps(store: PlanStore) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(store.root) for f in files if f.startswith(".tmp-")]


@pytest.fixture
def store(tmp_path) -> PlanStore:
    return PlanStore(tmp_path / "cache")


# --- the record ----------------------------------------------------------------------------------------------

NESTED_META = {"engine": 7, "knobs": {"tile": [128, 64], "split_k": None, "swizzle": True},
               "ratio": 0.25, "neg": -(2 ** 63), "big": 2 ** 64 - 1, "name": "ünïcødé ✓", "raw": b"\x00\xff",
               "deep": {"a": {"b": {"c": [[], {}, [1.5, "x"]]}}}}


@pytest.mark.parametrize("blob", [bytes(range(256)), b"", bytes(range(256)) * 4096], ids=["all-bytes", "empty", "1MiB"])
def test_record_round_trip(blob):
    record = PlanRecord(key=KEY_A, blob=blob, meta=NESTED_META)
    decoded = record_mod.decode(record_mod.encode(record, created=123.5), expected_key=KEY_A)
    assert decoded.record == record
    assert decoded.record.blob == blob and decoded.record.meta == NESTED_META
    assert decoded.created == 123.5


def test_store_round_trip(store):
    record = PlanRecord(key=KEY_A, blob=bytes(range(256)), meta=NESTED_META)
    assert store.put(record) is True
    assert store.get(KEY_A) == record
    assert store.put(PlanRecord(key=KEY_B, blob=b"", meta={})) is True
    assert store.get(KEY_B) == PlanRecord(key=KEY_B, blob=b"", meta={})


def test_record_header_layout():
    data = record_mod.encode(_record())
    assert data.startswith(b"CGPLAN\0")
    assert int.from_bytes(data[8:10], "little") == FORMAT_VERSION
    assert int.from_bytes(data[10:18], "little") == len(data) - record_mod.HEADER_SIZE
    payload = msgpack.unpackb(data[record_mod.HEADER_SIZE:], raw=False)
    assert set(payload) == {"key", "blob", "meta", "created"} and payload["key"] == KEY_A


def test_meta_is_copied_and_tuples_become_lists():
    meta = {"shape": (1, 2), "inner": {"x": 1}}
    record = PlanRecord(key=KEY_A, blob=b"x", meta=meta)
    meta["inner"]["x"] = 2
    assert record.meta == {"shape": [1, 2], "inner": {"x": 1}}
    with pytest.raises(AttributeError):
        record.key = KEY_B  # frozen
    assert "blob=<1 bytes>" in repr(record)


@pytest.mark.parametrize("key, error", [
    ("", ValueError), ("a/b", ValueError), ("../etc", ValueError), ("ab.rec", ValueError), ("a b", ValueError),
    ("é1", ValueError), ("x" * 201, ValueError), ("ab\n", ValueError), (123, TypeError), (None, TypeError),
    (b"ab", TypeError),
])
def test_record_rejects_bad_key(key, error):
    with pytest.raises(error, match="key"):
        PlanRecord(key=key, blob=b"", meta={})


@pytest.mark.parametrize("blob", ["text", bytearray(b"x"), None, memoryview(b"x")])
def test_record_rejects_non_bytes_blob(blob):
    with pytest.raises(TypeError, match="blob"):
        PlanRecord(key=KEY_A, blob=blob, meta={})


@pytest.mark.parametrize("meta, error", [
    ([("a", 1)], TypeError), (None, TypeError), ({1: "int key"}, TypeError), ({"x": {2: 3}}, TypeError),
    ({"s": {1, 2}}, TypeError), ({"o": object()}, TypeError), ({"c": 1j}, TypeError),
    ({"big": 2 ** 64}, ValueError), ({"small": -(2 ** 63) - 1}, ValueError), ({"sur": "\ud800"}, ValueError),
    ({"\udfff": 1}, ValueError), ({"e": msgpack.ExtType(1, b"x")}, TypeError),
])
def test_record_rejects_unpackable_meta(meta, error):
    with pytest.raises(error, match="meta"):
        PlanRecord(key=KEY_A, blob=b"", meta=meta)


def test_record_rejects_too_deep_meta():
    meta: dict = {}
    for _ in range(40):
        meta = {"n": meta}
    with pytest.raises(ValueError, match="nested deeper"):
        PlanRecord(key=KEY_A, blob=b"", meta=meta)


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats(allow_nan=False)
    | st.text(st.characters(exclude_categories=["Cs"])) | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


@FUZZ
@given(meta=st.dictionaries(st.text(st.characters(exclude_categories=["Cs"]), max_size=8), _PLAIN, max_size=6),
       blob=st.binary(max_size=512))
def test_record_round_trip_fuzz(meta, blob):
    record = PlanRecord(key=KEY_A, blob=blob, meta=meta)
    assert record_mod.decode(record_mod.encode(record)).record == record


@FUZZ
@given(data=st.binary(max_size=300))
def test_decode_of_garbage_raises_only_corrupt_record_error(data):
    with pytest.raises(CorruptRecordError):
        record_mod.decode(data)


@FUZZ
@given(data=st.data())
def test_decode_detects_every_single_bit_flip_and_cut(data):
    encoded = bytearray(record_mod.encode(_record(size=data.draw(st.integers(0, 200)))))
    if data.draw(st.booleans()):
        bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
        encoded[bit // 8] ^= 1 << (bit % 8)
    else:
        del encoded[data.draw(st.integers(0, len(encoded) - 1)):]
    with pytest.raises(CorruptRecordError):
        record_mod.decode(bytes(encoded))


# --- corruption: always a quarantined miss with one warning ----------------------------------------------------

def _payload(data: bytes) -> bytes:
    return data[record_mod.HEADER_SIZE:]


def _flip(offset):
    def mutate(data: bytes) -> bytes:
        out = bytearray(data)
        out[offset if offset >= 0 else len(out) + offset] ^= 0x10
        return bytes(out)
    return mutate


def _fields(data: bytes) -> dict:
    return msgpack.unpackb(_payload(data), raw=False)


def _reframe(**change):
    def mutate(data: bytes) -> bytes:
        fields = {**_fields(data), **change}
        return record_mod.pack_frame(msgpack.packb({k: v for k, v in fields.items() if v is not ...},
                                                   use_bin_type=True))
    return mutate


HS = record_mod.HEADER_SIZE
CORRUPTIONS = {
    **{f"truncate-{n}": (lambda n: lambda d: d[:n])(n) for n in (1, 6, 9, 17, HS - 1, HS, HS + 1, -1)},
    "zero-length": lambda d: b"",
    "flip-magic": _flip(0), "flip-reserved": _flip(7), "flip-version": _flip(8), "flip-length": _flip(10),
    "flip-checksum-first": _flip(18), "flip-checksum-last": _flip(HS - 1), "flip-payload-first": _flip(HS),
    "flip-payload-middle": _flip(HS + 150), "flip-payload-last": _flip(-1),
    "garbage-small": lambda d: random.Random(1).randbytes(10),
    "garbage-header-size": lambda d: random.Random(2).randbytes(HS + 40),
    "garbage-large": lambda d: random.Random(3).randbytes(5000),
    "garbage-with-magic": lambda d: b"CGPLAN\0" + random.Random(4).randbytes(400),
    "wrong-magic": lambda d: b"XXPLAN\0" + d[7:],
    "wrong-version": lambda d: record_mod.pack_frame(_payload(d), version=FORMAT_VERSION + 1),
    "version-zero": lambda d: record_mod.pack_frame(_payload(d), version=0),
    "trailing-byte": lambda d: d + b"\0",
    "length-says-more": lambda d: d[:10] + (len(d) - HS + 5).to_bytes(8, "little") + d[18:],
    "payload-not-msgpack": lambda d: record_mod.pack_frame(b"\xc1\xc1\xc1"),
    "payload-extra-data": lambda d: record_mod.pack_frame(_payload(d) + b"\x01"),
    "payload-is-list": lambda d: record_mod.pack_frame(msgpack.packb([1, 2, 3])),
    "payload-huge-claimed-array": lambda d: record_mod.pack_frame(b"\xdd\xff\xff\xff\xff"),
    "payload-missing-field": _reframe(created=...),
    "payload-extra-field": _reframe(extra=1),
    "payload-blob-is-str": _reframe(blob="text"),
    "payload-created-is-int": _reframe(created=5),
    "payload-meta-int-key": lambda d: record_mod.pack_frame(
        msgpack.packb({**_fields(d), "meta": {1: 2}}, use_bin_type=True)),
    "payload-meta-ext-type": _reframe(meta={"x": msgpack.ExtType(5, b"native")}),
    "payload-bad-key": _reframe(key="../../etc/passwd"),
    "payload-other-key": _reframe(key=KEY_B),
}


def _assert_quarantined_miss(store, key, caplog, *, counter="corrupt"):
    path = _record_path(store, key)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.get(key) is None
    assert len(_warnings(caplog)) == 1, [r.getMessage() for r in _warnings(caplog)]
    assert counter in _warnings(caplog)[0].getMessage() and str(path) in _warnings(caplog)[0].getMessage()
    assert not os.path.lexists(path)
    assert len(_quarantined(store)) == 1 and _quarantined(store)[0].endswith(path.name)
    assert store.stats()[counter] == 1 and store.stats()["misses"] == 1 and store.stats()["hits"] == 0
    fresh = _record(key, size=64, attempt=2)
    assert store.put(fresh) is True and store.get(key) == fresh  # the key works again


@pytest.mark.parametrize("mutate", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_record_is_a_quarantined_miss(store, caplog, mutate):
    assert store.put(_record(KEY_A, size=300))
    path = _record_path(store, KEY_A)
    path.write_bytes(mutate(path.read_bytes()))
    _assert_quarantined_miss(store, KEY_A, caplog)


def test_record_under_the_wrong_key_is_a_quarantined_miss(store, caplog):
    a = _record(KEY_A)
    assert store.put(a) and store.put(_record(KEY_B))
    _record_path(store, KEY_B).write_bytes(_record_path(store, KEY_A).read_bytes())
    _assert_quarantined_miss(store, KEY_B, caplog)
    assert store.get(KEY_A) == a


def test_same_corrupt_file_warns_once_then_is_a_plain_miss(store, caplog):
    assert store.put(_record())
    _record_path(store, KEY_A).write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.get(KEY_A) is None
        assert store.get(KEY_A) is None
    assert len(_warnings(caplog)) == 1
    assert store.stats()["corrupt"] == 1 and store.stats()["misses"] == 2


def test_quarantine_keeps_only_the_newest(store, monkeypatch):
    monkeypatch.setattr(store_mod, "QUARANTINE_KEEP", 3)
    for i in range(6):
        assert store.put(_record())
        _record_path(store, KEY_A).write_bytes(b"junk %d" % i)
        assert store.get(KEY_A) is None
    kept = _quarantined(store)
    assert len(kept) == 3
    assert sorted((store.root / "quarantine" / name).read_bytes() for name in kept) == [b"junk 3", b"junk 4",
                                                                                        b"junk 5"]


def test_verify_quarantines_bad_records_and_counts(store, caplog):
    for key in (KEY_A, KEY_B, KEY_C):
        assert store.put(_record(key))
    _record_path(store, KEY_B).write_bytes(b"")
    misplaced = store.root / f"v{FORMAT_VERSION}" / "zz" / f"{KEY_C}.rec"
    misplaced.parent.mkdir()
    misplaced.write_bytes(_record_path(store, KEY_C).read_bytes())
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        report = store.verify()
    assert report == {"ok": 2, "corrupt": 2, "untrusted": 0, "unreadable": 0, "removed_temp": 0}
    assert len(_warnings(caplog)) == 2 and len(_quarantined(store)) == 2
    assert sorted(store.keys()) == [KEY_A, KEY_C]
    assert store.verify() == {"ok": 2, "corrupt": 0, "untrusted": 0, "unreadable": 0, "removed_temp": 0}


# --- eviction and the cap ------------------------------------------------------------------------------------

RECORD_SIZE = len(record_mod.encode(_record(size=1000)))


def _set_last_use(store, key, seconds_ago):
    t = time.time() - seconds_ago
    os.utime(_record_path(store, key), (t, t))


def _lru_store(tmp_path, **kw) -> PlanStore:
    store = PlanStore(tmp_path / "lru", max_bytes=3 * RECORD_SIZE + RECORD_SIZE // 2, **kw)
    for key, age in ((KEY_A, 300), (KEY_B, 200), (KEY_C, 100)):
        assert store.put(_record(key, size=1000))
        _set_last_use(store, key, age)  # explicit, distinct ages: no dependence on timestamp granularity
    return store


def test_eviction_removes_least_recently_put_first(tmp_path):
    store = _lru_store(tmp_path, touch_interval=0)
    assert store.put(_record(KEY_D, size=1000))
    assert sorted(store.keys()) == [KEY_B, KEY_C, KEY_D]
    assert store.stats()["evictions"] == 1


def test_eviction_order_follows_recorded_last_use(tmp_path):
    store = _lru_store(tmp_path, touch_interval=0)
    assert store.get(KEY_A) is not None  # a is now the most recently used
    assert store.put(_record(KEY_D, size=1000))
    assert sorted(store.keys()) == [KEY_A, KEY_C, KEY_D]
    assert store.stats()["total_bytes"] <= store.max_bytes


def test_hit_touch_is_throttled(tmp_path):
    store = PlanStore(tmp_path / "c", touch_interval=1.0)
    assert store.put(_record())
    path = _record_path(store, KEY_A)
    _set_last_use(store, KEY_A, 0.3)
    before = path.stat().st_mtime_ns
    assert store.get(KEY_A) is not None
    assert path.stat().st_mtime_ns == before  # recent enough: the hit does not write
    _set_last_use(store, KEY_A, 50)
    assert store.get(KEY_A) is not None
    assert abs(path.stat().st_mtime - time.time()) < 5


def test_total_stays_under_cap(tmp_path):
    cap = 20_000
    store = PlanStore(tmp_path / "c", max_bytes=cap)
    rng = random.Random(7)
    for i in range(60):
        assert store.put(_record(f"{i:02x}{'e' * 10}", size=rng.randrange(0, 8000)))
        assert store.stats()["total_bytes"] <= cap
    assert store.stats()["evictions"] > 0 and store.stats()["entries"] >= 2


def test_record_larger_than_cap_is_not_stored(tmp_path, caplog):
    store = PlanStore(tmp_path / "c", max_bytes=RECORD_SIZE + 10)
    small = _record(KEY_A, size=1000)
    assert store.put(small)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.put(_record(KEY_B, size=1100)) is False
    assert len(_warnings(caplog)) == 1 and "cap" in _warnings(caplog)[0].getMessage()
    assert store.get(KEY_B) is None and store.get(KEY_A) == small
    assert store.stats()["puts_skipped"] == 1 and store.stats()["evictions"] == 0


def _hold_lock(path: str, held, release) -> None:
    with filelock.FileLock(path):
        held.set()
        release.wait(30)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_eviction_skipped_when_lock_times_out(tmp_path, caplog):
    store = _lru_store(tmp_path, lock_timeout=0.2)
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(store.root / ".evict.lock"), held, release))
    holder.start()  # another process is evicting
    try:
        assert held.wait(30)
        with caplog.at_level(logging.WARNING, logger="plan_cache"):
            assert store.put(_record(KEY_D, size=1000)) is True
    finally:
        release.set()
        holder.join(30)
    assert len(_warnings(caplog)) == 1 and "eviction skipped" in _warnings(caplog)[0].getMessage()
    assert len(store) == 4 and store.stats()["evictions"] == 0
    assert store.put(_record(KEY_D, size=1000)) and len(store) == 3  # lock free again: evicts


def test_soft_lock_fallback_when_file_locks_fail(tmp_path, monkeypatch):
    class NoFlock:
        def __init__(self, *args, **kwargs):
            pass

        def acquire(self):
            raise OSError(errno.ENOLCK, "no locks available")

    store = _lru_store(tmp_path)
    monkeypatch.setattr(store_mod, "NoFollowLock", NoFlock)  # flock fails: ENOLCK, as on some network mounts
    assert store.put(_record(KEY_D, size=1000))
    assert sorted(store.keys()) == [KEY_B, KEY_C, KEY_D] and store._use_soft_lock
    assert not (store.root / ".evict.softlock").exists()  # released


def test_put_write_failure_is_a_warning_not_an_exception(store, caplog, monkeypatch):
    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_mod, "write_all", disk_full)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.put(_record()) is False
    assert len(_warnings(caplog)) == 1 and "No space left" in _warnings(caplog)[0].getMessage()
    assert _temps(store) == [] and store.get(KEY_A) is None  # the temp file was cleaned up
    assert store.stats()["puts_skipped"] == 1 and store.stats()["puts"] == 0


def test_put_into_unwritable_directory_returns_false(store, caplog, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(store_mod.os, "replace", read_only)
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.put(_record()) is False
    assert len(_warnings(caplog)) == 1 and _temps(store) == []


def test_put_rejects_non_records(store):
    with pytest.raises(TypeError, match="PlanRecord"):
        store.put({"key": KEY_A})


# --- trust ---------------------------------------------------------------------------------------------------

def test_fresh_root_and_files_are_private(tmp_path):
    store = PlanStore(tmp_path / "new" / "cache")
    assert store.put(_record())
    path = _record_path(store, KEY_A)
    for directory in (store.root, path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702, 0o1777])
def test_group_or_world_writable_root_is_refused(tmp_path, mode):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UntrustedCacheError) as err:
        PlanStore(root)
    assert isinstance(err.value, PermissionError) and err.value.path == str(root)
    assert str(root) in str(err.value) and "chmod 700" in str(err.value) and oct(mode & 0o777) in str(err.value)


def test_writable_version_dir_is_refused(tmp_path):
    PlanStore(tmp_path / "c")
    os.chmod(tmp_path / "c" / f"v{FORMAT_VERSION}", 0o777)
    with pytest.raises(UntrustedCacheError, match=f"v{FORMAT_VERSION}"):
        PlanStore(tmp_path / "c")


def test_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "c"
    PlanStore(root)
    monkeypatch.setattr(store_mod, "_euid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(UntrustedCacheError, match="owned by uid"):
        PlanStore(root)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another uid needs root")
def test_root_really_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(UntrustedCacheError, match="uid 65534"):
        PlanStore(root)


def test_root_that_is_a_file_is_an_os_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        PlanStore(tmp_path / "f")


def test_open_or_none_falls_back_with_one_warning(tmp_path, caplog):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert PlanStore.open_or_none(root) is None
    assert len(_warnings(caplog)) == 1 and "chmod 700" in _warnings(caplog)[0].getMessage()
    assert PlanStore.open_or_none(tmp_path / "file") is None
    opened = PlanStore.open_or_none(tmp_path / "ok", max_bytes=1000)
    assert isinstance(opened, PlanStore) and opened.max_bytes == 1000


def test_group_writable_record_is_refused_unread(store, caplog, monkeypatch):
    assert store.put(_record())
    os.chmod(_record_path(store, KEY_A), 0o620)
    monkeypatch.setattr(store_mod, "decode", lambda *a, **k: pytest.fail("untrusted record deserialised"))
    _assert_quarantined_miss_untrusted(store, caplog, "lets group or others write")


def test_record_owned_by_another_user_is_refused_unread(store, caplog, monkeypatch):
    assert store.put(_record())
    uid = _record_path(store, KEY_A).stat().st_uid
    monkeypatch.setattr(store_mod, "_euid", lambda: uid + 1)
    # Only the record is foreign here: the directories' own checks have their tests (test_plan_cache_paths.py).
    monkeypatch.setattr(store_mod, "_unsafe_dir", lambda path, **kwargs: None)
    monkeypatch.setattr(store_mod, "decode", lambda *a, **k: pytest.fail("untrusted record deserialised"))
    _assert_quarantined_miss_untrusted(store, caplog, f"owned by uid {uid}")


def test_symlinked_record_is_refused(store, caplog):
    a = _record(KEY_A)
    assert store.put(a)
    link = _record_path(store, KEY_B)
    link.parent.mkdir(mode=0o700)
    link.symlink_to(_record_path(store, KEY_A))
    _assert_quarantined_miss_untrusted(store, caplog, "symbolic link", key=KEY_B)
    assert store.get(KEY_A) == a  # the link target is untouched


def _assert_quarantined_miss_untrusted(store, caplog, reason, key=KEY_A):
    with caplog.at_level(logging.WARNING, logger="plan_cache"):
        assert store.get(key) is None
    assert len(_warnings(caplog)) == 1 and reason in _warnings(caplog)[0].getMessage()
    assert not os.path.lexists(_record_path(store, key)) and len(_quarantined(store)) == 1
    assert store.stats()["untrusted"] == 1 and store.stats()["corrupt"] == 0


# --- maintenance: temp sweep, keys, delete, stats, clear -------------------------------------------------------

def _make_temp(store, key, age):
    path = _record_path(store, key).parent / f".tmp-999-{age}"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(b"CGPLAN\0partial")
    t = time.time() - age
    os.utime(path, (t, t))
    return path


def test_verify_sweeps_stale_temps_but_keeps_fresh_ones(store):
    assert store.put(_record())
    old, fresh = _make_temp(store, KEY_A, 3600), _make_temp(store, KEY_B, 1)
    assert store.verify() == {"ok": 1, "corrupt": 0, "untrusted": 0, "unreadable": 0, "removed_temp": 1}
    assert not old.exists() and fresh.exists()
    assert list(store.keys()) == [KEY_A]


def test_stale_age_is_configurable(tmp_path):
    store = PlanStore(tmp_path / "c", stale_temp_age=0.5)
    temp = _make_temp(store, KEY_A, 2)
    assert store.verify()["removed_temp"] == 1 and not temp.exists()


def test_eviction_sweeps_stale_temps(tmp_path):
    store = _lru_store(tmp_path, stale_temp_age=60)
    old, fresh = _make_temp(store, KEY_A, 120), _make_temp(store, KEY_C, 10)
    assert store.put(_record(KEY_D, size=1000))
    assert not old.exists() and fresh.exists()


def test_keys_delete_stats(store):
    keys = [KEY_A, KEY_B, KEY_C, "a1ff", "Z_-9"]
    for key in keys:
        assert store.put(_record(key, size=100))
    _make_temp(store, KEY_A, 1)
    (store.root / f"v{FORMAT_VERSION}" / "a1" / "notes.txt").write_text("not a record")
    assert sorted(store) == sorted(keys) and sorted(store.keys()) == sorted(keys) and len(store) == 5
    assert store.delete(KEY_B) is True and store.delete(KEY_B) is False
    assert store.get(KEY_B) is None and store.get(KEY_A) is not None
    stats = store.stats()
    on_disk = sum(_record_path(store, k).stat().st_size for k in keys if k != KEY_B)
    assert stats == {"entries": 4, "total_bytes": on_disk, "max_bytes": None, "hits": 1, "misses": 1, "puts": 5, "puts_kept_existing": 0,
                     "puts_skipped": 0, "evictions": 0, "corrupt": 0, "untrusted": 0}


def test_clear(store):
    for key in (KEY_A, KEY_B):
        assert store.put(_record(key))
    assert store.clear() == 2
    assert list(store) == [] and store.get(KEY_A) is None and store.stats()["total_bytes"] == 0
    assert store.put(_record(KEY_A)) and store.get(KEY_A) is not None


def test_put_replaces(store):
    assert store.put(_record(size=10, v=1))
    assert store.put(_record(size=20, v=2))
    assert store.get(KEY_A) == _record(size=20, v=2) and len(store) == 1


@pytest.mark.parametrize("kwargs, error", [
    ({"max_bytes": 0}, ValueError), ({"max_bytes": -1}, ValueError), ({"max_bytes": 1.5}, TypeError),
    ({"max_bytes": True}, TypeError), ({"lock_timeout": -1}, ValueError), ({"lock_timeout": "5"}, TypeError),
    ({"stale_temp_age": float("nan")}, ValueError), ({"touch_interval": -0.1}, ValueError),
])
def test_store_rejects_bad_arguments(tmp_path, kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        PlanStore(tmp_path / "c", **kwargs)


def test_bad_key_on_get_is_a_programming_error(store):
    with pytest.raises(ValueError, match="key"):
        store.get("../escape")
    with pytest.raises(ValueError, match="key"):
        store.delete("")


def test_public_names():
    for name in ("PlanRecord", "PlanStore", "UntrustedCacheError", "CorruptRecordError", "FORMAT_VERSION"):
        assert hasattr(plan_cache, name), name
    assert issubclass(UntrustedCacheError, PermissionError)
    assert CorruptRecordError("why").reason == "why"


def test_conditional_put_keeps_the_existing_record(tmp_path):
    store = PlanStore(tmp_path / "c")
    store.put(PlanRecord("k1", b"tuned", {"chosen_by": "autotune"}))
    kept = store.put(PlanRecord("k1", b"heur", {"chosen_by": "heuristics"}),
                     keep_existing=lambda old: old.meta["chosen_by"] == "autotune")
    assert kept is False and store.get("k1").blob == b"tuned"
    assert store.stats()["puts_kept_existing"] == 1
    assert store.put(PlanRecord("k1", b"tuned2", {"chosen_by": "autotune"}), keep_existing=lambda old: False)
    assert store.get("k1").blob == b"tuned2"
    assert store.put(PlanRecord("k2", b"x", {}), keep_existing=lambda old: True)  # nothing to keep: written


def test_prune_evicts_least_recently_used_down_to_the_cap(tmp_path):
    store = PlanStore(tmp_path / "c", touch_interval=0)
    for i, key in enumerate(["a1", "b2", "c3"]):
        store.put(PlanRecord(key, bytes(1000), {}))
        path = store._record_path(key)
        os.utime(path, ns=(i * 10**9, i * 10**9))  # a1 oldest
    size = os.path.getsize(store._record_path("a1"))
    assert store.prune(2 * size) == 1 and sorted(store.keys()) == ["b2", "c3"]
    assert store.prune(0) == 2 and list(store.keys()) == []
    with pytest.raises(ValueError):
        store.prune(-1)
