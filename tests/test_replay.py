"""CPU: the policy of gpu_launch.replay.Replay (when a fallback call records its graph, replays it, or runs
directly), with stand-ins for the driver's capture and the re-pointed graph; tests/test_gpu_fallback_calls.py
runs the real ones against float64 references."""

from __future__ import annotations

import contextlib

import pytest

from gpu_launch import graph_patch, replay


class _Graph:
    def __init__(self, log):
        self.log = log

    def launch(self, ptrs, stream):
        self.log.append(("graph", stream, ptrs))


@pytest.fixture
def stand_in(monkeypatch):
    log, state = [], {"idle": True, "refuse": False, "recordings": 0}

    def record(run, ordinal):
        if state["refuse"]:
            raise graph_patch.PatchError("a stand-in refusal")
        state["recordings"] += 1
        return state["recordings"]

    monkeypatch.setattr(replay, "record", record)
    monkeypatch.setattr(replay.graph_patch, "PatchableGraph", lambda graph, moved, ptrs, ordinal: _Graph(log))
    monkeypatch.setattr(replay.graph_patch, "destroy", lambda graph: log.append(("destroyed", graph)))
    monkeypatch.setattr(replay.driver, "device", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(replay.driver, "stream_idle", lambda stream: state["idle"])
    monkeypatch.setattr(replay.driver, "reserve_executables", lambda count: log.append(("reserved", count)))
    monkeypatch.setattr(replay, "_next_check", {0: 1 << 30})  # the reserve is its own test's
    monkeypatch.setattr(replay, "_behind_work", True)  # the process-wide switch, back on after each test
    rep = replay.Replay(lambda ptrs, stream: log.append(("direct", stream, ptrs)), ordinal=0, label="test")
    return rep, log, state


def test_first_call_direct_then_one_recording_serves_every_pointer_set(stand_in):
    rep, log, state = stand_in
    for ptrs in ((256, 512), (256, 512), (1024, 512), (2048, 4096)):
        rep(ptrs, 7, False)
    assert log == [("direct", 7, (256, 512)), ("graph", 7, (256, 512)), ("graph", 7, (1024, 512)),
                   ("graph", 7, (2048, 4096))]
    assert state["recordings"] == 1 + graph_patch.MOVES and rep.replays == 2


def test_a_busy_stream_still_records_at_the_second_call(stand_in):
    rep, log, state = stand_in
    state["idle"] = False  # our own launches record without waiting for queued work
    for _ in range(3):
        rep((256,), 7, False)
    assert [entry[0] for entry in log] == ["direct", "graph", "graph"]


def test_once_a_recording_waited_for_the_queue_a_busy_stream_stays_direct(stand_in, monkeypatch):
    rep, log, state = stand_in
    monkeypatch.setattr(replay, "_behind_work", False)  # a launcher's recording was seen to wait
    state["idle"] = False
    for _ in range(3):
        rep((256,), 7, False)
    assert [entry[0] for entry in log] == ["direct"] * 3 and state["recordings"] == 0
    state["idle"] = True
    rep((256,), 7, False)
    assert log[-1][0] == "graph"


def test_capturing_caller_gets_direct_runs_that_land_in_its_graph(stand_in):
    rep, log, _ = stand_in
    rep((256,), 7, False)
    rep((256,), 7, False)
    rep((256,), 7, True)
    assert [entry[0] for entry in log] == ["direct", "graph", "direct"]


def test_each_stream_records_its_own_graph(stand_in):
    rep, log, _ = stand_in
    for stream in (7, 8, 7, 8):
        rep((256,), stream, False)
    assert [entry[:2] for entry in log] == [("direct", 7), ("direct", 8), ("graph", 7), ("graph", 8)]


def test_a_refused_recording_keeps_the_calls_direct_for_good(stand_in):
    rep, log, state = stand_in
    state["refuse"] = True
    for _ in range(4):
        rep((256,), 7, False)
    assert [entry[0] for entry in log] == ["direct"] * 4 and not rep.enabled and not rep.graphs


def _slow_collection(seconds: float):
    """A gc callback (appended after watch's clock) that makes each collection take `seconds`."""
    import time

    def slow(phase, info):
        if phase == "start":
            time.sleep(seconds)
    return slow


@pytest.fixture
def watched(monkeypatch):
    """(state, done): a watch started behind queued work on a stand-in stream (state["idle"] drains it)."""
    state = {"idle": False}
    monkeypatch.setattr(replay.driver, "stream_idle", lambda stream: state["idle"])
    monkeypatch.setattr(replay.driver, "reserve_executables", lambda count: log.append(("reserved", count)))
    monkeypatch.setattr(replay, "_next_check", {0: 1 << 30})  # the reserve is its own test's
    monkeypatch.setattr(replay, "_behind_work", True)
    monkeypatch.setattr(replay, "WAITED_S", 0.02)
    return state, replay.watch(7)


def test_a_wait_inside_a_garbage_collection_is_not_blamed_on_the_recording(watched, caplog):
    import gc

    state, done = watched
    slow = _slow_collection(0.05)
    gc.callbacks.append(slow)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(slow)
    state["idle"] = True  # the queue drained while the collector ran
    with caplog.at_level("WARNING", logger="cudnn_graphs"):
        done()
    assert replay._behind_work and "garbage collection" in caplog.text
    assert not any(isinstance(cb, replay._CollectorClock) for cb in gc.callbacks)


def test_a_wait_outside_the_collector_turns_recording_behind_work_off(watched, caplog):
    import time

    state, done = watched
    time.sleep(0.05)
    state["idle"] = True
    with caplog.at_level("WARNING", logger="cudnn_graphs"):
        done()
    assert not replay._behind_work and "waited" in caplog.text


def test_executable_slots_are_ensured_only_on_an_idle_stream_and_again_after_half_the_reserve(monkeypatch):
    """The driver's executable-slot growth waits for queued work (every ~43 live executables): reserve_slots
    ensures RESERVE free slots while nothing is queued, and again once RESERVE // 2 more executables exist."""
    from gpu_launch import driver, replay

    reserved, live, idle = [], [0], [True]
    monkeypatch.setattr(replay, "_next_check", {})
    monkeypatch.setattr(driver, "live_executables", lambda: live[0])
    monkeypatch.setattr(driver, "reserve_executables", reserved.append)
    monkeypatch.setattr(replay, "nothing_queued", lambda stream: idle[0])
    monkeypatch.setattr(driver, "device", lambda ordinal: contextlib.nullcontext())
    idle[0] = False
    replay.reserve_slots(0, 7)
    assert reserved == [], "reserving behind queued work would itself wait"
    idle[0] = True
    replay.reserve_slots(0, 7)
    assert reserved == [replay.RESERVE]
    live[0] = replay.RESERVE // 2 - 1
    replay.reserve_slots(0, 7)
    assert reserved == [replay.RESERVE], "half the reserve still free: nothing to do"
    live[0] += 1
    replay.reserve_slots(0, 7)
    assert reserved == [replay.RESERVE] * 2 and replay._next_check[0] == live[0] + replay.RESERVE // 2
    replay.reserve_slots(1, 7)
    assert len(reserved) == 3, "each device has its own pool"
