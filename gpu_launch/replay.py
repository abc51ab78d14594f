"""A fixed sequence of launches replayed as one CUDA graph, re-pointed per call (the fallback kernels' calls).

A fallback call queues a few launches (our kernels, memsets, cuBLASLt / cuBLAS GEMMs): each costs the
host 3-8 us, where one graph launch costs 2-3 us plus ~0.6 us per node whose pointers changed.
`Replay(run, ordinal=)` runs `run(ptrs, stream)` directly at first; the second call on a stream records
it with the real pointers and with moved ones (`graph_patch`, 1-2 ms once), and from then on launches one
`PatchableGraph` per (thread, stream), its pointer arguments rewritten when the call's pointers differ.
A sequence that cannot be captured or re-pointed stays direct, said once in the log.

Recordings do not wait for an idle stream: with a 1 s sleep queued, recording a grid_sample backward
took 1-2 ms of host time and a ResNet-50 conv plan 0.75-4 ms, the GPU still busy after
(`tools/probe_grid_sample_host.py`, `tools/probe_record_behind_work.py`; the GPU tests record behind a
queued sleep), so a training loop that never lets its stream idle still gets its graphs. Known waits:
the driver's pool of executable slots grows every ~43 live executables and the instantiation that grows
it waits for all queued work, whatever its graph (`reserve_slots` grows it ahead while the stream is
idle, at first sights and recordings); a kernel whose stack frame exceeds the context's stack limit (1 KB
a thread), at the instantiation of the first graph holding it; the first use of a torch kernel
(`tools/probe_stall_sources.py`). Should one recording behind queued work wait all the same, `watch()`
turns recording behind work off for the process: later recordings wait for an idle stream. A wait
inside a garbage collection is the collector's, not the recording's (a full suite run saw one free
earlier tests' plans mid-recording): it is logged and changes nothing.
While the caller's stream is being captured (`torch.cuda.graph`), calls run directly and their launches
land in the caller's graph.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable, Sequence

from . import driver, graph_patch
from .errors import CudaDriverError

log = logging.getLogger("cudnn_graphs")


class Replay:
    """`run(ptrs, stream)` (a fixed sequence of launches on device `ordinal`), replayed as a graph once recorded.

    `ptrs` is a tuple of addresses in a fixed role order; every pointer set given to one Replay must have
    the same addresses modulo 256 as the first (callers key their programs on that), since a recording
    may depend on alignment. `label` names the sequence in the log.
    """

    __slots__ = ("run", "ordinal", "label", "graphs", "enabled", "replays", "_seen")

    def __init__(self, run: Callable[[Sequence[int], int], None], *, ordinal: int, label: str):
        self.run, self.ordinal, self.label = run, ordinal, label
        self.graphs: dict[tuple[int, int], graph_patch.PatchableGraph] = {}  # by (thread, stream)
        self.enabled = True  # until a recording fails
        self.replays = 0
        self._seen: set[tuple[int, int]] = set()

    def __call__(self, ptrs: tuple[int, ...], stream: int, capturing: bool) -> None:
        """Run on `stream`; `capturing`: the caller's stream is being captured now (run directly then)."""
        key = (threading.get_ident(), stream)
        graph = self.graphs.get(key)
        if graph is not None:
            if not capturing:
                self.replays += 1
                graph.launch(ptrs, stream)
                return
        elif key in self._seen:
            if self.enabled and not capturing and may_record(stream):
                graph = self._record(key, ptrs, stream)
                if graph is not None:
                    graph.launch(ptrs, stream)
                    return
        else:
            self._seen.add(key)
            if not capturing:
                reserve_slots(self.ordinal, stream)  # a first sight, maybe on an idle stream: room for graphs
        self.run(ptrs, stream)

    def _record(self, key: tuple[int, int], ptrs: tuple[int, ...], stream: int):
        recordings: list[int] = []
        reserve_slots(self.ordinal, stream)
        done = watch(stream)
        try:
            with driver.device(self.ordinal):
                for move in range(-1, graph_patch.MOVES):
                    moved = ptrs if move < 0 else graph_patch.moved_pointers(ptrs, move)
                    recordings.append(record(lambda side: self.run(moved, side), self.ordinal))
            graph = graph_patch.PatchableGraph(recordings[0], recordings[1:], ptrs, ordinal=self.ordinal)
        except Exception as err:  # noqa: BLE001 - a refusal (PatchError, a library that cannot be captured)
            # PatchableGraph destroys the moved recordings whatever happens; the first stays ours on failure.
            for graph_ in recordings[:1] if len(recordings) == graph_patch.MOVES + 1 else recordings:
                graph_patch.destroy(graph_)
            log.info("%s: calls stay direct (%s)", self.label, getattr(err, "reason", err))
            self.enabled = False
            return None
        finally:
            done()
        self.graphs[key] = graph  # keyed by this thread: no other thread writes it
        return graph


def record(run: Callable[[int], None], ordinal: int) -> int:
    """`run(stream)` recorded on this thread's capture stream of device `ordinal`: an uninstantiated graph
    (nothing runs). Raises what `run` raised, or CudaDriverError when the capture was invalidated."""
    side = capture_stream(ordinal)
    error: BaseException | None = None
    graph = 0
    driver.begin_capture(side)
    try:
        run(side)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the capture is ended
        error = err
    finally:
        try:
            graph = driver.end_capture(side)
        except CudaDriverError as err:  # an invalidated capture only reports here
            error = error or err
    if error is not None or not graph:
        if graph:
            graph_patch.destroy(graph)
        raise error if error is not None else CudaDriverError("cuStreamEndCapture", -1, "an empty capture")
    return graph


# A recording's host time beyond which, the queue drained meanwhile, it waited for the GPU: recordings took
# 0.9-17 ms behind a 1 s sleep (tools/probe_record_behind_work.py), a wait lasts as long as the queue.
WAITED_S = 0.2
_behind_work = True  # recording behind queued work allowed (for the process, until `watch` sees one wait)


# Free executable slots ensured per device (driver.reserve_executables): RESERVE at a first sight or recording
# on an idle stream, again once RESERVE // 2 more of ours are alive than then. Ensured outright, not
# counted from ours: other executables share the pool (torch's graphs, torch.compile's) and the GPU suite
# saw a wait with ~140 of ours live and 256 reserved from our count.
RESERVE = 256  # 12 ms of host time (H100), at most once per RESERVE // 2 more live executables
_next_check: dict[int, int] = {}  # device -> our live-executable count at which to ensure slots again


def reserve_slots(ordinal: int, stream: int) -> None:
    """Before a recording for `stream` on device `ordinal`: while nothing is queued, make sure the driver's
    pool has RESERVE free executable slots, so that instantiations behind queued work later do not wait."""
    live = driver.live_executables()
    if live < _next_check.get(ordinal, 0) or not nothing_queued(stream):
        return
    with driver.device(ordinal):
        driver.reserve_executables(RESERVE)
    _next_check[ordinal] = live + RESERVE // 2


def may_record(stream: int) -> bool:
    """A recording on `stream` may start now: anywhere, unless one behind queued work was seen to wait."""
    return _behind_work or nothing_queued(stream)


def watch(stream: int) -> Callable[[], None]:
    """Call before recording for `stream`; call what it returns after. A recording that started behind queued
    work and ended after WAITED_S with the queue drained waited for it: later ones wait for an idle stream.
    Time spent in the garbage collector meanwhile is not the recording's: an object freed there (a
    cuDNN plan some caller dropped, say) may synchronise the device, and that is said instead."""
    if not _behind_work or nothing_queued(stream):
        return _nothing
    start = time.perf_counter()
    collecting = _CollectorClock()
    gc.callbacks.append(collecting)

    def done() -> None:
        global _behind_work
        if collecting in gc.callbacks:  # unless someone emptied the list meanwhile
            gc.callbacks.remove(collecting)
        took = time.perf_counter() - start
        if took <= WAITED_S or not nothing_queued(stream) or not _behind_work:
            return
        if took - collecting.total > WAITED_S:
            _behind_work = False
            log.warning("recording a CUDA graph behind queued work waited %.0f ms for the GPU; graphs are "
                        "recorded only on an idle stream from now on", took * 1e3)
        else:
            log.warning("a garbage collection during a CUDA graph recording took %.0f ms and the GPU's queue "
                        "drained meanwhile: an object it freed synchronised the device", collecting.total * 1e3)
    return done


class _CollectorClock:
    """A gc callback adding up the seconds spent in collections (between its "start" and "stop" calls)."""

    __slots__ = ("total", "_began")

    def __init__(self):
        self.total, self._began = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.total += time.perf_counter() - self._began
            self._began = None


def _nothing() -> None:
    return None


def nothing_queued(stream: int) -> bool:
    """`stream` and the legacy default stream (which blocking streams' work runs behind) are both idle
    (cuStreamQuery never waits): a recording now cannot wait for queued work."""
    return driver.stream_idle(stream) and (stream == 0 or driver.stream_idle(0))


_sides = threading.local()


def capture_stream(ordinal: int) -> int:
    """This thread's capture stream on device `ordinal` (the legacy default stream cannot be captured, and
    two threads never capture into one stream)."""
    streams = getattr(_sides, "streams", None)
    if streams is None:
        streams = _sides.streams = {}
    stream = streams.get(ordinal)
    if stream is None:
        with driver.device(ordinal):
            stream = streams[ordinal] = driver.new_stream()
    return stream
