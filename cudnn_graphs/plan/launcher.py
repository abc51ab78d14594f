"""A plan prepared for repeated calls whose pointers change: the hot path under every entry point.

`Launcher.launch(ptrs, stream)` patches this call's pointers into arrays built once per (thread,
stream) and runs each part through the backend's own entry; nothing is described or checked (the
caller's memo key already proved the buffers match). On a later sight the run is recorded into a CUDA
graph and replayed from then on (one graph launch, 2-3 us, instead of a cuDNN execute per part, 10-15
us), except while the stream is being captured by someone else: their graph then records the parts.

Where the plan's kernels take their pointers as plain arguments (`gpu_launch.graph_patch` proves it by
recording twice), one graph per (thread, stream) serves every pointer set: its kernels' arguments are
rewritten before a launch whose pointers differ from the last. Otherwise a graph serves the one pointer
set it was recorded with.

Recording is a warm-up activity with a fixed budget, measured on an H100 (driver 580, cuDNN 9.19):
- it happens behind queued work: 18 ResNet-50 plans recorded with a second of work queued took 0.75-4 ms
  of host time each and the GPU stayed busy (`tools/probe_record_behind_work.py`), so a training loop
  whose stream never idles gets its graphs. Before re-pointed graphs, a recording at a pointer set's
  second sight held the host for the whole queue (tests/test_gpu_calls.py, two runs of two; and
  `cuGraphInstantiate` once in a training loop): the driver grows its pool of executable slots every ~43
  live executables and that waits for queued work, so first sights and recordings on an idle stream
  reserve slots ahead (`gpu_launch.replay.reserve_slots`); should a recording wait all the same,
  `gpu_launch.replay.watch` sees it and from then on the process records only on an idle stream;
- it costs 0.5-2 ms of host time where a replay saves ~10 us, and where graphs cannot be re-pointed a
  training loop's activations come back only for a while (torch's caching allocator: about half of a
  step's pointer sets recur a step or two later, then drift); so a launcher records at most
  GRAPHS_PER_LAUNCHER graphs, its first sets (a loop over stable buffers, or layers of one geometry
  sharing the plan), and keeps them all (evicting made a rotation of pointer sets re-record forever).
Every other pointer set runs directly, which never synchronises.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

from gpu_launch import driver, graph_patch
from gpu_launch.replay import capture_stream, may_record, record, reserve_slots, watch

from ..errors import CudaDriverError, GraphCaptureError

log = logging.getLogger("cudnn_graphs")

GRAPHS_PER_LAUNCHER = 8  # graphs recorded in a launcher's life, all kept (see above)
CAPTURES_PER_LAUNCHER = GRAPHS_PER_LAUNCHER  # the name tools use for the same budget
_SEEN_LIMIT = 64


class _Prepared:
    """The parts of one plan ready to run on one stream from one thread (its cuDNN handle)."""

    __slots__ = ("runs", "stream", "handles")

    def __init__(self, plan, slots: dict[str, int], framework: str, stream: int, *, scratch_of: int | None = None,
                 workspace_ptr: int | None = None):
        # A capture runs on a side stream but must use the scratch of the stream its graph replays on.
        _, scratch = plan._scratch_for(stream if scratch_of is None else scratch_of, framework)
        workspace_ptr = scratch["workspace"] if workspace_ptr is None else workspace_ptr
        self.handles, self.stream = plan.handles, stream
        self.runs = [part.runner(slots, scratch, workspace_ptr, stream, plan.handles) for part in plan.parts]

    def __call__(self, ptrs: Sequence[int]) -> None:
        self.handles.on_stream(self.stream)
        for run in self.runs:
            run(ptrs)


class Launcher:
    """One plan, one order of pointer roles, one framework (whose allocator serves scratch)."""

    def __init__(self, plan, roles: tuple[str, ...], framework: str, *, workspace_ptr: int | None = None):
        self.plan, self.roles, self.framework = plan, roles, framework
        self.workspace_ptr = workspace_ptr  # the caller's workspace (Plan.bind(workspace=)), else the plan's
        self._slots = {role: i for i, role in enumerate(roles)}
        self._prepared: dict[tuple[int, int], _Prepared] = {}
        self._graphs: dict[tuple, driver.GraphExec] = {}  # by (thread, stream, pointers)
        self._patched: dict[tuple, graph_patch.PatchableGraph] = {}  # by (thread, stream): any aligned pointers
        self.patching = True  # until a recording shows this plan's kernels cannot be re-pointed
        self._seen: dict[tuple, int] = {}
        self.captures = 0  # graphs recorded so far, at most GRAPHS_PER_LAUNCHER
        self.replays = 0  # graph launches, for reports
        self.capture_enabled = True
        self._lock = threading.Lock()

    def prepared(self, stream: int) -> _Prepared:
        key = (threading.get_ident(), stream)
        prep = self._prepared.get(key)
        if prep is None:
            with self._lock:
                prep = self._prepared[key] = _Prepared(self.plan, self._slots, self.framework, stream,
                                                       workspace_ptr=self.workspace_ptr)
        return prep

    def run(self, ptrs: Sequence[int], stream: int) -> None:
        """Run every part directly on `stream`."""
        self.prepared(stream)(ptrs)

    def launch(self, ptrs: tuple[int, ...], stream: int, capturing: Callable[[int], bool]) -> None:
        """Run on `stream`: a graph replay where one serves these pointers, else directly."""
        tid = threading.get_ident()
        if self._patched:
            patched = self._patched.get((tid, stream))
            if patched is not None and not _low_bits(ptrs) and not capturing(stream):
                self.replays += 1
                patched.launch(ptrs, stream)
                return
        key = (tid, stream, ptrs)
        graph = self._graphs.get(key)
        if graph is not None and not capturing(stream):
            self.replays += 1
            graph.launch(stream)
            return
        if graph is None and self.capture_enabled and self._due(key) and not capturing(stream) \
                and may_record(stream) and self._record(key, ptrs, stream):
            return
        if graph is None and self.capture_enabled and key[:2] not in self._seen and not capturing(stream):
            reserve_slots(self.plan.device, stream)  # a first sight, maybe on an idle stream: room for graphs
        self.prepared(stream)(ptrs)
        if graph is None and self.capture_enabled:
            if len(self._seen) >= _SEEN_LIMIT:
                self._seen.clear()
            self._seen[key] = self._seen[key[:2]] = 1

    def _due(self, key: tuple) -> bool:
        """Record on the second sight: of this pointer set, or of any set once graphs can be re-pointed."""
        return bool(self._seen.get(key) or (self.patching and not _low_bits(key[2]) and self._seen.get(key[:2])))

    def _record(self, key: tuple, ptrs: tuple[int, ...], stream: int) -> bool:
        """Record a graph for these pointers (a re-pointable one where it can be) and launch it."""
        reserve_slots(self.plan.device, stream)
        done = watch(stream)
        try:
            graph = self._record_patchable(ptrs, stream) if self.patching and not _low_bits(ptrs) \
                else self.capture(ptrs, stream)
        except GraphCaptureError as err:
            log.info("%s: calls stay direct (%s)", self.plan.spec.op, err)
            self.capture_enabled = False
            return False
        finally:
            done()
        self._seen.pop(key, None)
        self.captures += 1
        repoints = getattr(graph, "repoints", False)
        with self._lock:
            if repoints:
                self._patched[key[:2]] = graph
            else:
                self._graphs[key] = graph
        if self.captures >= GRAPHS_PER_LAUNCHER:
            log.info("%s: %d graphs recorded; new pointer sets run directly from now on", self.plan.spec.op,
                     self.captures)
            self.capture_enabled = False
            self._seen.clear()
        graph.launch(ptrs, stream) if repoints else graph.launch(stream)
        return True

    def _record_patchable(self, ptrs: tuple[int, ...], stream: int):
        """A PatchableGraph for these pointers, else (this plan's kernels cannot be re-pointed: said once
        in the log, never tried again) a plain graph of them."""
        graph, moved = self._record_raw(ptrs, stream), []
        try:
            for move in range(graph_patch.MOVES):
                moved.append(self._record_raw(graph_patch.moved_pointers(ptrs, move), stream))
            return graph_patch.PatchableGraph(graph, moved, ptrs, ordinal=self.plan.device)
        except GraphCaptureError as err:  # an engine refused moved pointers: the recordings made are dropped
            for recording in moved:
                graph_patch.destroy(recording)
            log.info("%s: one graph per pointer set (%s)", self.plan.spec.op, err)
            self.patching = False
        except (graph_patch.PatchError, CudaDriverError) as err:
            log.info("%s: one graph per pointer set (%s)", self.plan.spec.op, getattr(err, "reason", err))
            self.patching = False
        return _instantiate(graph, self.plan)

    def capture(self, ptrs: Sequence[int], stream: int) -> driver.GraphExec:
        """Record one run with these pointers into a CUDA graph that replays on any stream."""
        return _instantiate(self._record_raw(ptrs, stream), self.plan)

    def _record_raw(self, ptrs: Sequence[int], stream: int) -> int:
        """One run with these pointers recorded (not instantiated, nothing runs), on this thread's capture
        stream; nothing runs while capturing, so no ordering with `stream` is needed."""
        side = capture_stream(self.plan.device)
        prep = _Prepared(self.plan, self._slots, self.framework, side, scratch_of=stream,
                         workspace_ptr=self.workspace_ptr)
        try:
            return record(lambda _side: prep(ptrs), self.plan.device)
        except Exception as err:  # an engine refused to run under capture, or the capture was invalidated
            raise GraphCaptureError(self.plan.spec, self.plan.engines, err) from err
        finally:
            self.plan.handles.on_stream(stream)


def _instantiate(graph: int, plan) -> driver.GraphExec:
    try:
        return driver.GraphExec(graph)
    except CudaDriverError as err:
        raise GraphCaptureError(plan.spec, plan.engines, err) from err


def _low_bits(ptrs: Sequence[int]) -> int:
    """Nonzero when a pointer is off the alignment a re-pointable graph serves (torch's blocks are 512-aligned)."""
    bits = 0
    for p in ptrs:
        bits |= p
    return bits & (graph_patch.ALIGNMENT_CLASS - 1)
