"""CPU: the launcher's policy (direct runs, capture on a pointer set's second sight, replays, a graph
budget per launcher, nothing evicted or recorded late), with stand-ins for the plan's parts and for
CUDA graphs."""

from __future__ import annotations

import pytest

from cudnn_graphs.errors import GraphCaptureError
from cudnn_graphs.plan import launcher as launcher_mod
from cudnn_graphs.plan.launcher import Launcher


class _Handles:
    def current(self):
        return "handle"

    def on_stream(self, stream):
        return "handle"


class _Part:
    def __init__(self, log):
        self.log = log

    def runner(self, slots, fixed, workspace_ptr, stream_ptr, handle):
        return lambda ptrs: self.log.append(("direct", stream_ptr, tuple(ptrs)))


class _Plan:
    device = 0
    engines = ("stand-in",)

    def __init__(self):
        self.log = []
        self.parts = (_Part(self.log),)
        self.handles = _Handles()

        class spec:
            op = "conv_fwd"

        self.spec = spec

    def _scratch_for(self, stream, framework):
        return [], {"workspace": 0}


class _Graph:
    def __init__(self, log, ptrs):
        self.log, self.ptrs, self.launches = log, ptrs, 0

    def launch(self, stream):
        self.launches += 1
        self.log.append(("replay", stream, self.ptrs))


@pytest.fixture
def launcher(monkeypatch):
    plan = _Plan()
    lau = Launcher(plan, ("x", "y"), "torch")

    def capture(ptrs, stream):
        return _Graph(plan.log, tuple(ptrs))

    monkeypatch.setattr(lau, "capture", capture)
    monkeypatch.setattr(launcher_mod.driver, "stream_idle", lambda stream: lau.idle)
    lau.idle = True
    return lau


def _never(stream):
    return False


def test_second_sight_captures_then_replays(launcher):
    for _ in range(4):
        launcher.launch((16, 32), 7, _never)
    kinds = [entry[0] for entry in launcher.plan.log]
    assert kinds == ["direct", "replay", "replay", "replay"] and launcher.captures == 1


def test_a_capturing_stream_gets_direct_runs(launcher):
    for _ in range(3):
        launcher.launch((16, 32), 7, _never)
    launcher.plan.log.clear()
    launcher.launch((16, 32), 7, lambda stream: True)  # the caller is capturing: record the parts
    assert launcher.plan.log == [("direct", 7, (16, 32))]


def _launch_times(launcher, ptrs, n):
    for _ in range(n):
        launcher.launch(ptrs, 7, _never)


def test_streams_and_pointer_sets_have_their_own_graphs(launcher):
    for _ in range(2):
        launcher.launch((16, 32), 7, _never)
        launcher.launch((16, 32), 9, _never)
        launcher.launch((48, 64), 7, _never)
    assert launcher.captures == 3
    assert [entry[0] for entry in launcher.plan.log[-3:]] == ["replay", "replay", "replay"]


def test_a_rotation_past_the_budget_runs_directly_and_never_records_late(launcher):
    budget = launcher_mod.GRAPHS_PER_LAUNCHER
    sets = [(16 * (i + 1),) * 2 for i in range(budget + 3)]
    for _ in range(3):  # activations in rotation, each set recurring
        for ptrs in sets:
            launcher.launch(ptrs, 7, _never)
    assert launcher.captures == budget and not launcher.capture_enabled
    launcher.plan.log.clear()
    for _ in range(200):  # however often the graphs replay, no capture comes later
        for ptrs in sets:
            launcher.launch(ptrs, 7, _never)
    assert launcher.captures == budget
    kinds = [entry[0] for entry in launcher.plan.log]
    assert kinds.count("replay") == 200 * budget and kinds.count("direct") == 200 * 3


def test_pointer_sets_seen_once_never_cost_a_capture(launcher):
    for ptr in range(16, 16 * 200, 16):
        launcher.launch((ptr, ptr), 7, _never)
    assert launcher.captures == 0 and launcher.capture_enabled


def test_capture_stops_for_good_once_the_budget_is_spent_and_every_graph_stays(launcher):
    budget = launcher_mod.GRAPHS_PER_LAUNCHER
    sets = [(16 * (i + 1), 0) for i in range(budget + 1)]
    for ptrs in sets[:budget]:  # each set recorded at its second sight
        _launch_times(launcher, ptrs, 2)
    assert launcher.captures == budget and not launcher.capture_enabled
    _launch_times(launcher, sets[budget], 100)  # a new set, seen often: it runs directly, never recorded
    assert launcher.captures == budget and launcher.plan.log[-1] == ("direct", 7, sets[budget])
    launcher.plan.log.clear()
    for ptrs in sets[:budget]:  # nothing was evicted: every recorded set still replays
        launcher.launch(ptrs, 7, _never)
    assert [entry[0] for entry in launcher.plan.log] == ["replay"] * budget


def test_an_engine_that_cannot_be_captured_stays_direct(launcher, monkeypatch):
    def refuse(ptrs, stream):
        raise GraphCaptureError(launcher.plan.spec, ("stand-in",), RuntimeError("not capturable"))

    monkeypatch.setattr(launcher, "capture", refuse)
    for _ in range(5):
        launcher.launch((16, 32), 7, _never)
    assert not launcher.capture_enabled
    assert [entry[0] for entry in launcher.plan.log] == ["direct"] * 5


def test_no_recording_behind_queued_work(launcher):
    launcher.idle = False  # the stream has work queued: recording would wait for it
    for _ in range(5):
        launcher.launch((16, 32), 7, _never)
    assert launcher.captures == 0 and [entry[0] for entry in launcher.plan.log] == ["direct"] * 5
    launcher.idle = True  # the next sight with an idle stream records it
    launcher.launch((16, 32), 7, _never)
    launcher.launch((16, 32), 7, _never)
    assert launcher.captures == 1 and [entry[0] for entry in launcher.plan.log[-2:]] == ["replay", "replay"]
