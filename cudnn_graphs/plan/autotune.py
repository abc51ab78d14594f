"""Autotuning: build every candidate plan of a graph, time each on real data, keep the fastest.

Candidates come from heuristics A, B and FALLBACK (de-duplicated by engine id + knobs, in that order,
so the heuristic choice is always among them and the winner is never slower than it beyond noise).
Each is timed with CUDA events after warm-up, as the median of several samples, on scratch buffers
filled with random data (never zeros: zeros run faster than real data on some engines) or on the
request's own buffers. Candidates that fail to build or run are skipped and recorded.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..graph import frontend
from ..spec.dtypes import ITEMSIZE

log = logging.getLogger("cudnn_graphs")

WARMUP = 2
SAMPLES = 7
SAMPLE_MS = 0.5  # launches per sample are batched up to about this long, so tiny convs time above noise
MAX_BATCH = 50


@dataclass
class Candidate:
    """One row of a timing table."""

    index: int
    engine: str
    engine_id: int | None
    knobs: dict
    workspace_size: int | None
    status: str  # "ok", "build_failed", "run_failed", "duplicate", "over_limit"
    median_ms: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "engine": self.engine, "engine_id": self.engine_id, "knobs": dict(self.knobs),
               "workspace_size": self.workspace_size, "status": self.status,
               "median_ms": None if self.median_ms is None else round(self.median_ms, 5)}
        if self.error:
            out["error"] = self.error[:300]
        return out


@dataclass
class Tuned:
    """The winner of one graph part and the table it won."""

    index: int
    table: list[Candidate]
    heuristic_index: int | None  # the plan heuristics A would have chosen (first that builds)
    tune_ms: float


def candidate_modes() -> list:
    fe = frontend.cudnn()
    return [fe.heur_mode.A, fe.heur_mode.B, fe.heur_mode.FALLBACK]


def tune_part(g, *, buffers: Callable[[], tuple[dict, Callable[[int], int]]], make_call: Callable[..., Any],
              limit: int | None, stream_ptr: int) -> Tuned:
    """Build and time every candidate of graph `g` (its execution plans already created and filtered).

    `buffers()` gives (role -> pointer, workspace(nbytes) -> pointer); `make_call(index, ptrs, ws_ptr)`
    returns a no-argument launch of plan `index`. Raises RuntimeError when no candidate runs.
    """
    start = time.perf_counter()
    table, seen, first_built = [], set(), None
    ptrs, workspace = None, None
    for index in range(g.get_execution_plan_count()):
        row = _describe(g, index)
        key = (row.engine_id, tuple(sorted(row.knobs.items())))
        if row.engine_id is not None and key in seen:
            row.status = "duplicate"
            table.append(row)
            continue
        seen.add(key)
        if limit is not None and sum(r.status == "ok" for r in table) >= limit:
            row.status = "over_limit"
            table.append(row)
            continue
        try:
            g.build_plan_at_index(index)
            row.workspace_size = int(g.get_workspace_size_plan_at_index(index))
            row.engine = g.get_plan_name_at_index(index)
        except Exception as err:  # a declined engine: skip it, keep the reason
            row.status, row.error = "build_failed", str(err)
            table.append(row)
            continue
        first_built = index if first_built is None else first_built
        if ptrs is None:
            ptrs, workspace = buffers()
        try:
            call = make_call(index, ptrs, workspace(row.workspace_size))
            row.median_ms = time_call(call, stream_ptr)
            row.status = "ok"
        except Exception as err:  # an engine that builds but fails at run time is skipped, not fatal
            row.status, row.error = "run_failed", str(err)
        table.append(row)
    timed = [r for r in table if r.status == "ok"]
    if not timed:
        reasons = "; ".join(f"{r.engine}: {r.error}" for r in table if r.error)[-600:]
        raise RuntimeError(f"no candidate plan built and ran ({len(table)} tried): {reasons or 'empty plan list'}")
    best = min(timed, key=lambda r: r.median_ms)
    g.build_plan_at_index(best.index)  # serialize() writes the plan built last: make that the winner
    return Tuned(best.index, table, first_built, (time.perf_counter() - start) * 1e3)


def _describe(g, index: int) -> Candidate:
    try:
        engine_id, knobs = g.get_engine_and_knobs_at_index(index)
        return Candidate(index, f"eng{int(engine_id)}", int(engine_id), frontend.knob_names(knobs), None, "pending")
    except Exception:  # not knowable before a build on this frontend: filled in after it
        return Candidate(index, f"plan{index}", None, {}, None, "pending")


def time_call(call: Callable[[], None], stream_ptr: int) -> float:
    """Median ms of `call` on `stream_ptr`: warm-up, then SAMPLES event-timed batches of launches."""
    import cupy

    from gpu_launch.streams import external_stream

    stream = external_stream(stream_ptr) if stream_ptr else cupy.cuda.Stream.null
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(WARMUP):
        call()
    start.record(stream)
    call()
    end.record(stream)
    end.synchronize()
    once = max(cupy.cuda.get_elapsed_time(start, end), 1e-3)
    batch = max(1, min(MAX_BATCH, math.ceil(SAMPLE_MS / once)))
    samples = []
    for _ in range(SAMPLES):
        start.record(stream)
        for _ in range(batch):
            call()
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) / batch)
    return statistics.median(samples)


def random_fill(desc, *, device: int, seed: int) -> tuple[Any, int]:
    """(owner, pointer) of a new buffer for `desc` holding N(0, 1) samples in its dtype (never zeros)."""
    import cupy
    import numpy

    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, desc.strides))
    with cupy.cuda.Device(device):
        memory = cupy.cuda.alloc(span * ITEMSIZE[desc.dtype])
        rng = cupy.random.default_rng(seed)
        if desc.dtype == "float64":
            values = rng.standard_normal(span, dtype=numpy.float64)
        else:
            values = rng.standard_normal(span, dtype=numpy.float32)
            if desc.dtype == "float16":
                values = values.astype(numpy.float16)
            elif desc.dtype == "bfloat16":  # no CuPy bf16 dtype: keep the top 16 bits of each float32
                values = (values.view(numpy.uint32) >> 16).astype(numpy.uint16)
        target = cupy.ndarray((span,), dtype=values.dtype, memptr=memory)
        target[...] = values
    return memory, memory.ptr
