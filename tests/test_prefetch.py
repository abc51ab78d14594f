"""CPU: Session.prefetch reads spec files and iterables, counts what it finds, never raises."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import cudnn_graphs as cg
from cudnn_graphs.plan import resident


@pytest.fixture(autouse=True)
def _no_held_plans():
    resident.forget()  # the stand-in plans below must not reach other tests' sessions
    yield
    resident.forget()


def _specs():
    return [cg.ConvFwdSpec((2, 8, 9, 9), (8, 8, 3, 3), padding=1, bias=True, activation="relu"),
            cg.ConvBwdDataSpec((2, 8, 9, 9), (8, 8, 3, 3), (2, 8, 9, 9), padding=1)]


def test_prefetch_of_an_empty_cache_finds_every_spec_missing(cache_dir):
    session = cg.Session()
    assert session.prefetch(_specs()).wait(timeout=30) == {"loaded": 0, "in_memory": 0, "missing": 2, "failed": 0}
    assert session.counters()["builds"] == 0  # a prefetch never builds


def test_prefetch_reads_a_spec_file_and_counts_bad_lines(tmp_path):
    path = tmp_path / "specs.jsonl"
    lines = [json.dumps(s.to_dict()) for s in _specs()] + ["{not json", json.dumps({"schema": 1, "op": "nope"})]
    path.write_text("\n".join(lines) + "\n# a comment\n")
    prefetch = cg.Session().prefetch(path, background=False)
    assert prefetch.done()
    assert prefetch.wait() == {"loaded": 0, "in_memory": 0, "missing": 2, "failed": 2}


def test_prefetch_skips_plans_already_in_memory():
    session = cg.Session(cache=False)
    spec = _specs()[0]
    session._memory[spec] = object()  # stands for a plan planned earlier
    assert session.prefetch([spec, _specs()[1]], background=False).wait() == \
        {"loaded": 0, "in_memory": 1, "missing": 1, "failed": 0}


def test_prefetch_of_an_unreadable_file_is_a_warning_not_an_error(tmp_path, caplog):
    result = cg.Session().prefetch(tmp_path / "absent.jsonl").wait(timeout=30)
    assert result["failed"] == 1 and "prefetch stopped" in caplog.text


def test_prefetch_workers_must_be_a_positive_int():
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="workers="):
            cg.Session(cache=False).prefetch([], workers=bad)


def _slow_loads(monkeypatch, session, seconds):
    """Stored plans that take `seconds` to load (stands for cuDNN finalizing an engine's first plan)."""
    import time

    loading = []

    def load_stored(spec, key):
        loading.append(spec)
        time.sleep(seconds)
        return SimpleNamespace(device=session.device, signature=key, chosen_by="heuristics")

    import contextlib

    from gpu_launch import driver

    monkeypatch.setattr(session, "_load_stored", load_stored)
    monkeypatch.setattr(type(session.store), "path_of", lambda self, key: type("P", (), {"exists": lambda s: True})())
    monkeypatch.setattr(driver, "device", lambda ordinal: contextlib.nullcontext())  # no GPU here
    return loading


def test_prefetch_loads_on_several_threads(monkeypatch, cache_dir):
    import time

    session = cg.Session()
    specs = [cg.ConvFwdSpec((2, 8, 9, 9), (8, 8, 3, 3), padding=p) for p in range(8)]
    _slow_loads(monkeypatch, session, 0.2)
    start = time.perf_counter()
    assert session.prefetch(specs, workers=4).wait(timeout=30)["loaded"] == 8
    assert time.perf_counter() - start < 1.2, "eight 0.2 s loads on four threads took sequential time"


def test_a_call_waits_for_its_own_plan_not_for_other_loads(monkeypatch, cache_dir):
    """A prefetch thread loading a slow record must not hold up plan() of another spec."""
    import threading
    import time

    session = cg.Session()
    slow, fast = _specs()
    _slow_loads(monkeypatch, session, 0.0)
    gate = threading.Event()
    original = session._load_stored

    def load_stored(spec, key):
        if spec == slow:
            gate.wait(10)
        return original(spec, key)

    monkeypatch.setattr(session, "_load_stored", load_stored)
    prefetch = session.prefetch([slow], workers=1)
    time.sleep(0.05)  # the prefetch thread now holds the slow spec's lock
    start = time.perf_counter()
    session.plan(fast)
    assert time.perf_counter() - start < 1.0
    gate.set()
    assert prefetch.wait(timeout=10)["loaded"] == 1
    assert session.counters()["memory_hits"] == 0 and session.plan(slow) is session.plan(slow)
