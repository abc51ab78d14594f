"""CPU: the launcher's policy (direct runs, capture on a pointer set's second sight, replays, a graph
budget per launcher, nothing evicted or recorded late; one re-pointable graph per stream where the
plan's kernels allow it), with stand-ins for the plan's parts and for CUDA graphs."""

from __future__ import annotations

import pytest

from gpu_launch import replay
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


class _Repointable:
    repoints = True

    def __init__(self, log):
        self.log = log

    def launch(self, ptrs, stream):
        self.log.append(("repointed", stream, ptrs))


def _stand_in(monkeypatch, *, repointable: bool) -> Launcher:
    plan = _Plan()
    lau = Launcher(plan, ("x", "y"), "torch")

    def capture(ptrs, stream):
        return _Graph(plan.log, tuple(ptrs))

    def record_patchable(ptrs, stream):
        if repointable:
            return _Repointable(plan.log)
        lau.patching = False
        return capture(ptrs, stream)

    monkeypatch.setattr(lau, "capture", capture)
    monkeypatch.setattr(lau, "_record_patchable", record_patchable)
    monkeypatch.setattr(launcher_mod.driver, "stream_idle", lambda stream: lau.idle)
    monkeypatch.setattr(replay, "_next_check", {plan.device: 1 << 30})  # the reserve: tests/test_replay.py
    monkeypatch.setattr(replay, "_behind_work", True)  # the process-wide switch, back on after each test
    lau.idle = True
    return lau


@pytest.fixture
def launcher(monkeypatch):
    """A plan whose kernels cannot be re-pointed: one graph per pointer set."""
    return _stand_in(monkeypatch, repointable=False)


@pytest.fixture
def repointing(monkeypatch):
    return _stand_in(monkeypatch, repointable=True)


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
    # One recording, at the stream's second aligned sight: the attempt at a re-pointable graph (which
    # this plan refuses; its graph of that set is kept). No set seen once costs another.
    assert launcher.captures == 1 and launcher.capture_enabled and not launcher.patching


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


def test_records_behind_queued_work(launcher):
    launcher.idle = False  # a training loop's stream is never idle: recording must not need it
    for _ in range(3):
        launcher.launch((16, 32), 7, _never)
    assert launcher.captures == 1 and [entry[0] for entry in launcher.plan.log] == ["direct", "replay", "replay"]


def test_a_recording_that_waited_for_the_queue_makes_later_ones_wait_for_an_idle_stream(launcher, monkeypatch):
    monkeypatch.setattr(replay, "WAITED_S", 0.0)
    capture = launcher.capture

    def waits_for_the_queue(ptrs, stream):  # the stand-in for a recording that drained the GPU
        launcher.idle = True
        return capture(ptrs, stream)

    monkeypatch.setattr(launcher, "capture", waits_for_the_queue)
    launcher.idle = False
    for _ in range(2):
        launcher.launch((16, 32), 7, _never)
    assert launcher.captures == 1 and not replay._behind_work
    launcher.idle = False  # from now on a busy stream means no recording
    for _ in range(3):
        launcher.launch((64, 128), 7, _never)
    assert launcher.captures == 1 and [entry[0] for entry in launcher.plan.log[-3:]] == ["direct"] * 3
    launcher.idle = True  # the next sight with an idle stream records
    launcher.launch((64, 128), 7, _never)
    assert launcher.captures == 2


def test_a_repointable_graph_serves_every_aligned_pointer_set_of_its_stream(repointing):
    sets = [(4096 * i, 4096 * i + 512) for i in range(1, 40)]
    for ptrs in sets:  # a rotation: no set is seen twice, the second sight of the stream records
        repointing.launch(ptrs, 7, _never)
    log = repointing.plan.log
    assert [entry[0] for entry in log[:2]] == ["direct", "repointed"] and repointing.captures == 1
    assert log[1:] == [("repointed", 7, ptrs) for ptrs in sets[1:]]


def test_repointable_graphs_are_kept_per_stream_and_skip_misaligned_sets(repointing):
    for stream in (7, 9):
        for ptrs in ((512, 1024), (2048, 4096), (8192, 1024)):
            repointing.launch(ptrs, stream, _never)
    assert repointing.captures == 2
    repointing.plan.log.clear()
    repointing.launch((512 + 16, 1024), 7, _never)  # a view at an offset: not the class the graph serves
    repointing.launch((512, 1024), 9, lambda stream: True)  # the caller is capturing: direct
    assert [entry[0] for entry in repointing.plan.log] == ["direct", "direct"]


def test_a_plan_that_cannot_be_repointed_falls_back_to_graphs_per_pointer_set(launcher):
    launcher.launch((512, 1024), 7, _never)
    launcher.launch((2048, 4096), 7, _never)  # second sight of the stream: the re-pointing attempt fails
    assert not launcher.patching and launcher.captures == 1
    for _ in range(2):
        launcher.launch((8192, 1024), 7, _never)
    assert launcher.captures == 2 and launcher.plan.log[-1] == ("replay", 7, (8192, 1024))
