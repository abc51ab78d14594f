"""Remote write-throughs, off the caller's path: one daemon thread a process, a bounded queue, and a
bounded wait at exit, so that a slow or stalled server can neither grow memory nor hold a process's exit.

A write that finds MAX_QUEUED writes already waiting is dropped; at exit, queued writes get at most
EXIT_DEADLINE seconds in all and the rest are dropped. Either is said once, with how many. A dropped
record stays in the local cache; the remote gets it from the next process that plans it, or `cache push`.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("cudnn_graphs")

MAX_QUEUED = 256  # write-throughs waiting for the remote; a record is ~0.1 MB, so at most some 25 MB
EXIT_DEADLINE = 2.0  # seconds a process's exit waits for its queued write-throughs, all of them together


class _Writer:
    def __init__(self):
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self._warned: set[str] = set()
        self._dropped = 0
        threading.Thread(target=self._run, name="cudnn-graphs-remote", daemon=True).start()
        atexit.register(self._at_exit)  # a daemon thread is never joined: this is the only wait at exit

    def submit(self, job: Callable[[], None]) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._dropped += 1
            self._warn_once("full", "remote plan cache: %d write-throughs are waiting already (the server is slow "
                            "or stalled); further records are not written to the remote until they drain (they "
                            "stay in the local cache)", MAX_QUEUED)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except Exception as err:  # one write's trouble must not end the writer for the process
                self._warn_once("error", "remote plan cache: a write-through failed (%s: %s)", type(err).__name__, err)
            finally:
                self._queue.task_done()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every write queued so far is done, waiting at most `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def _at_exit(self) -> None:
        if not self.wait(EXIT_DEADLINE):
            self._warn_once("exit", "remote plan cache: %d write-through(s) not done %.0f s after the process began "
                            "to exit, dropped (they stay in the local cache)", self._queue.unfinished_tasks,
                            EXIT_DEADLINE)

    def _warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)


_writer: list[_Writer] = []  # the process's one writer, started on first use
_writer_lock = threading.Lock()


def submit(job: Callable[[], None]) -> None:
    """Queue `job` (a remote write) for the writer thread, or drop it when MAX_QUEUED are waiting."""
    if not _writer:
        with _writer_lock:
            if not _writer:
                _writer.append(_Writer())
    _writer[0].submit(job)


def flush(timeout: float | None = None) -> bool:
    """Wait until every remote write queued so far is done; False when `timeout` seconds passed first."""
    return _writer[0].wait(timeout) if _writer else True
