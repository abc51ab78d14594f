"""`cudnn-graphs warmup --devices`: the specs spread over several GPUs, one worker process per GPU.

Workers take the next spec from one queue, largest convolution first (autotuning times differ by spec and
grow with its size: a large one drawn last would leave the other GPUs idle while it is timed), plan it in
a session on their GPU and report the outcome. The first GPU's worker is a thread of this process, which
has imported everything already: it starts at once, while the spawned workers of the other GPUs are
still starting (a spawned interpreter imports torch, CuPy and the frontend again, seconds of a minute's
warm-up); all write one cache (the store is
safe for many processes) and, when configured, the remote. Keys hold no device index, so a record a worker
wrote on GPU 1 serves GPU 0 of this node and every identical node. The parent draws one progress bar and
one summary over all of them.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import signal
import sys
import threading
import time

from .warmup_plan import RELEASE_EVERY, SpecSource, Summary, plan_one, progress, warmup_session

_RESULT_TIMEOUT = 5.0  # seconds between checks that the workers are still alive


def plan_on_devices(sources: list[SpecSource], args, devices: list[int]) -> Summary:
    ctx = multiprocessing.get_context("spawn")  # a forked CUDA context is unusable; workers start clean
    tasks, results = ctx.Queue(), ctx.Queue()
    queued = time.perf_counter()
    for i, source in sorted(enumerate(sources), key=lambda item: -_work(item[1].spec)):
        tasks.put((i, source.where, source.spec.to_dict()))
    for _ in devices:
        tasks.put(None)  # one stop mark per worker
    options = {"cache": args.cache, "autotune": args.autotune, "autotune_limit": args.autotune_limit}
    workers = [ctx.Process(target=_worker, args=(device, options, tasks, results), daemon=True,
                           name=f"cudnn-graphs-warmup-gpu{device}") for device in devices[1:]]
    _start_ignoring_ctrl_c(workers)
    here = threading.Thread(target=_worker, args=(devices[0], options, tasks, results), daemon=True,
                            name=f"cudnn-graphs-warmup-gpu{devices[0]}")
    here.start()
    workers.insert(0, _ThreadWorker(here))
    summary = Summary(by_device=dict.fromkeys(devices, 0))
    interrupted = False
    try:
        for device, outcome in progress(_results(results, workers, len(sources)), args, total=len(sources)):
            if device >= 0:  # -1: lost with a worker that died
                summary.by_device[device] += 1
                _time(summary.device_timing, device, outcome[1], queued)
            summary.add(*outcome)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        for w in workers:
            w.join(timeout=0 if interrupted else 60)  # Ctrl-C: the workers stop now, not after their spec
            if w.is_alive():
                w.terminate()
    return summary


def _time(timing: dict, device: int, busy: float, queued: float) -> None:
    now = round(time.perf_counter() - queued, 3)
    entry = timing.setdefault(device, {"first_s": now, "last_s": now, "busy_s": 0.0})
    entry["last_s"] = now
    entry["busy_s"] = round(entry["busy_s"] + busy, 3)


def _work(spec) -> int:
    """A spec's size in multiply-adds (its output times one output element's inputs): the order to draw in."""
    out = spec.y_shape if spec.op == "conv_fwd" else spec.dy_shape
    return math.prod(out) * math.prod(spec.w_shape[1:])


class _ThreadWorker:
    """The in-process worker, answering what the parent asks of a worker process."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def terminate(self) -> None:
        pass  # a daemon thread: it ends with the process, after the spec it is planning


def _start_ignoring_ctrl_c(workers) -> None:
    """Start the workers with SIGINT ignored, which they inherit from their start on: Ctrl-C reaches the
    whole process group, and the parent alone answers it (terminating them), so that it prints one line,
    not a traceback per GPU."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for w in workers:
            w.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _results(results, workers, expected: int):
    """(device, outcome) per spec as workers finish them; a worker that dies fails what it had not reported."""
    received = 0
    while received < expected:
        try:
            item = results.get(timeout=_RESULT_TIMEOUT)
        except queue.Empty:
            if any(w.is_alive() for w in workers):
                continue
            for _ in range(expected - received):  # every worker is gone: the rest will never come
                yield -1, ("failed", 0.0, "warmup", "a worker process exited before planning this spec")
            return
        kind, device, payload = item
        if kind == "error":  # the worker could not start its session: it planned nothing
            print(f"cudnn-graphs warmup: GPU {device}: {payload}", file=sys.stderr)
            continue
        received += 1
        yield device, payload


def _worker(device: int, options: dict, tasks, results) -> None:
    """One GPU's worker: plan specs from `tasks` until the stop mark, report each outcome."""
    from types import SimpleNamespace

    from ..plan.tiers import flush_remote_writes
    from ..spec import spec_from_dict

    try:
        session = warmup_session(SimpleNamespace(**options), device)
    except Exception as err:  # a session that keeps nothing, a bad configuration: say so, leave the specs to others
        results.put(("error", device, f"{type(err).__name__}: {err}"))
        return
    done = 0
    while True:
        task = tasks.get()
        if task is None:
            break
        _, where, data = task
        outcome = plan_one(session, SpecSource(where, spec_from_dict(data)))
        results.put(("done", device, outcome))
        done += 1
        if done % RELEASE_EVERY == 0:
            session.release_plans()
    flush_remote_writes()
