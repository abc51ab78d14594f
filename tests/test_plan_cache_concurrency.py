"""plan_cache under concurrency: many processes on one store, and writers killed with SIGKILL mid-write.

Every blob is derived from a seed stored in its meta, with the blob's sha256 alongside, so a reader can tell a
whole record from a torn one without any shared state.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
import traceback

import pytest

from plan_cache import PlanRecord, PlanStore

KEYS = [hashlib.sha256(b"key %d" % i).hexdigest() for i in range(8)]
CTX = multiprocessing.get_context("fork")  # fast start; the children run only plan_cache code

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _blob(seed: int, size: int) -> bytes:
    unit = hashlib.sha256(seed.to_bytes(8, "little")).digest()
    return (unit * (size // len(unit) + 1))[:size]


def _make(key: str, seed: int, size: int) -> PlanRecord:
    blob = _blob(seed, size)
    return PlanRecord(key=key, blob=blob, meta={"seed": seed, "size": size,
                                                "sha256": hashlib.sha256(blob).hexdigest()})


def _problem(record: PlanRecord | None, key: str) -> str | None:
    """Why `record` is not a whole record written for `key`, or None if it is (or is a miss)."""
    if record is None:
        return None
    if record.key != key:
        return f"asked {key}, got {record.key}"
    if hashlib.sha256(record.blob).hexdigest() != record.meta["sha256"]:
        return f"{key}: blob does not match its checksum"
    if record.blob != _blob(record.meta["seed"], record.meta["size"]):
        return f"{key}: blob is not the one its seed makes"
    return None


class _WarningCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _hammer(root: str, worker: int, max_bytes: int, seconds: float, results) -> None:
    counter = _WarningCounter()
    logging.getLogger("plan_cache").addHandler(counter)
    out = {"worker": worker, "puts": 0, "failed_puts": 0, "hits": 0, "misses": 0, "problems": [], "error": None}
    try:
        store = PlanStore(root, max_bytes=max_bytes, touch_interval=0)
        rng = random.Random(worker)
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            key = rng.choice(KEYS)
            if rng.random() < 0.5:
                n += 1
                ok = store.put(_make(key, seed=worker * 1_000_000 + n, size=rng.randrange(1, 48) * 1024))
                out["puts" if ok else "failed_puts"] += 1
            else:
                record = store.get(key)
                out["hits" if record is not None else "misses"] += 1
                problem = _problem(record, key)
                if problem:
                    out["problems"].append(problem)
    except BaseException:
        out["error"] = traceback.format_exc()
    out["warnings"] = counter.messages
    results.put(out)


def test_sixteen_processes_share_one_store(tmp_path):
    root = str(tmp_path / "shared")
    max_bytes = 200 * 1024  # about five of the eight keys at the mean size: eviction runs all the time
    PlanStore(root)
    results = CTX.Queue()
    procs = [CTX.Process(target=_hammer, args=(root, w, max_bytes, 2.0, results)) for w in range(16)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=60) for _ in procs]  # drain before join: a full pipe would block the children
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for out in outs:
        assert out["error"] is None, out["error"]
        assert out["problems"] == [], out["problems"][:5]
        assert out["failed_puts"] == 0 and out["warnings"] == [], out["warnings"][:5]
    assert sum(o["puts"] for o in outs) > 100 and sum(o["hits"] for o in outs) > 100  # really contended

    store = PlanStore(root, max_bytes=max_bytes)
    report = store.verify()
    assert report["corrupt"] == report["untrusted"] == report["unreadable"] == 0 and report["ok"] == len(store)
    assert [f for _, _, files in os.walk(root) for f in files if f.startswith(".tmp-")] == []
    for key in store.keys():
        assert _problem(store.get(key), key) is None
    assert store.put(_make(KEYS[0], seed=1, size=1024))  # one uncontended put settles the cap exactly
    assert store.stats()["total_bytes"] <= max_bytes


def test_threads_share_one_store(tmp_path):
    store = PlanStore(tmp_path / "c", max_bytes=100 * 1024, touch_interval=0)
    problems: list[str] = []

    def work(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for n in range(60):
                key = rng.choice(KEYS)
                if rng.random() < 0.5:
                    assert store.put(_make(key, seed=worker * 1000 + n, size=rng.randrange(1, 24) * 1024))
                else:
                    problem = _problem(store.get(key), key)
                    if problem:
                        problems.append(problem)
        except BaseException:
            problems.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    stats = store.stats()
    assert stats["hits"] + stats["misses"] + stats["puts"] == 8 * 60  # counters lose no updates
    assert stats["corrupt"] == 0


# --- writers killed mid-write --------------------------------------------------------------------------------

BIG = 4 * 1024 * 1024


def _write_forever(root: str, started) -> None:
    store = PlanStore(root)
    n = 0
    while True:
        n += 1
        store.put(_make(KEYS[n % 4], seed=os.getpid() * 1000 + n, size=BIG + n % 4096))
        started.set()


def _temp_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.startswith(".tmp-")]


def test_writers_killed_mid_write_never_expose_partial_records(tmp_path):
    root = str(tmp_path / "killed")
    reader = PlanStore(root, touch_interval=0)
    rng = random.Random(0)
    seen = 0
    for _ in range(15):
        started = CTX.Event()
        child = CTX.Process(target=_write_forever, args=(root, started))
        child.start()
        assert started.wait(timeout=30)
        kill_at = time.monotonic() + rng.uniform(0.0, 0.06)
        while time.monotonic() < kill_at or not _temp_files(root):  # read while it writes; kill inside a write
            for key in KEYS[:4]:
                record = reader.get(key)
                assert _problem(record, key) is None
                seen += record is not None
            if time.monotonic() > kill_at + 2:
                break
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
        for key in KEYS[:4]:
            assert _problem(reader.get(key), key) is None
    assert seen > 0 and reader.stats()["corrupt"] == 0

    leftovers = _temp_files(root)
    assert leftovers, "no writer was killed inside a write"
    assert all(os.path.getsize(t) <= BIG + 4096 + 200 for t in leftovers)
    # Their writers are dead processes of this host: swept at once, however fresh (a live writer's are kept:
    # test_plan_cache_paths.py).
    assert PlanStore(root).verify()["removed_temp"] == len(leftovers)
    assert _temp_files(root) == []

    sweeper = PlanStore(root)
    report = sweeper.verify()
    assert report == {"ok": len(sweeper), "corrupt": 0, "untrusted": 0, "unreadable": 0, "removed_temp": 0}
    assert len(sweeper) >= 1
    for key in sweeper.keys():
        assert _problem(sweeper.get(key), key) is None
