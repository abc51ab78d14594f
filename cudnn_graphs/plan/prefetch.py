"""Loading stored plans ahead of the first call, on a background thread: `Session.prefetch`."""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

log = logging.getLogger("cudnn_graphs")


WORKERS = 4  # cuDNN finalizes plans with the GIL released: a slow engine's first load need not hold up the rest


class Prefetch:
    """A running (or finished) prefetch: `wait()` returns its counts, `done()` says whether it ended.

    Counts: `loaded` (now in memory), `in_memory` (were already), `missing` (no record on disk: the
    first call builds it), `failed` (bad spec lines, records that did not load: the first call
    rebuilds). A prefetch never raises into the caller's thread and never builds a plan. Up to
    `workers` threads load at once, each on its own cuDNN handle; a call that needs a plan being
    loaded waits for that one load, not for the whole prefetch.
    """

    def __init__(self, session, specs: Iterable[Any], *, background: bool, workers: int = WORKERS):
        self.counts = {"loaded": 0, "in_memory": 0, "missing": 0, "failed": 0}
        self._session, self._specs = session, iter(specs)
        self._lock = threading.Lock()  # guards the spec iterator (a file being read) and the counts
        self._workers = max(1, int(workers))
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="cudnn-graphs-prefetch", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        helpers = [threading.Thread(target=self._drain, name=f"cudnn-graphs-prefetch-{i}", daemon=True)
                   for i in range(1, self._workers)]
        for helper in helpers:
            helper.start()
        self._drain()
        for helper in helpers:
            helper.join()

    def _drain(self) -> None:
        while True:
            with self._lock:
                try:
                    spec = next(self._specs)
                except StopIteration:
                    return
                except Exception as err:  # e.g. an unreadable spec file: the first calls plan as usual
                    log.warning("prefetch stopped: %s", err)
                    self.counts["failed"] += 1
                    return
            try:
                outcome = "failed" if spec is None else self._session._prefetch_one(spec)
            except Exception as err:  # one bad record or spec: the others still load
                log.warning("prefetch: %s", err)
                outcome = "failed"
            with self._lock:
                self.counts[outcome] += 1

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict[str, int]:
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            return dict(self.counts)


def specs_of(source: Any) -> Iterable[Any]:
    """Specs from a spec-file path (JSON Lines, as `warmup` reads) or an iterable of specs; a line
    that does not parse yields None (counted as failed) after one warning."""
    import os

    if not isinstance(source, (str, os.PathLike)):
        yield from source
        return
    from ..recording import read_spec_file
    from ..spec import spec_from_dict

    for path, number, data, error in read_spec_file(os.fspath(source)):
        try:
            if error is not None:
                raise ValueError(error)
            yield spec_from_dict(data)
        except Exception as err:  # a bad line: one warning, the rest still loads
            log.warning("prefetch: %s:%d skipped: %s", path, number, err)
            yield None
