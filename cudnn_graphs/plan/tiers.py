"""Where a session's plan records live: read in order from its own store, the team's read-only system
store and the remote (Redis); written to its own store and, off the caller's path, to the remote."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from ..cache import keep_stored, open_remote, open_store, open_system_store
from ..cache.policy import for_machine, key_matches
from . import remote_writes

log = logging.getLogger("cudnn_graphs")


class Tiers:
    """A session's stores. What they do is counted in the session's `counts` (remote_hits, remote_refused,
    remote_writes, disk_writes) under its `lock`: the dict and the lock, not the session, so that no
    reference cycle keeps a session for the collector."""

    def __init__(self, cache: Any, remote: Any, env, *, counts: dict, lock: threading.Lock):
        """`cache` and `remote` as Session takes them; `cache=False` keeps nothing anywhere."""
        self.store = open_store(cache)
        # A team's read-only tier, consulted after the user's (unless this session keeps no cache at all).
        self.system_store = open_system_store() if cache is not False else None
        self.remote = open_remote(remote) if cache is not False else None
        self.env, self._counts, self._lock = env, counts, lock

    def count(self, name: str) -> None:
        with self._lock:  # loads run on several threads (prefetch), writes on the remote writer's
            self._counts[name] += 1

    def record(self, key: str):
        """The first tier's record for `key`, or None."""
        record = self.store.get(key) if self.store is not None else None
        if record is None and self.system_store is not None:
            record = self.system_store.get(key)
        if record is None and self.remote is not None:
            record = self._remote_record(key)
        return record

    def may_hold(self, key: str) -> bool:
        """Whether a record for `key` may be stored: on disk in a local tier, or a remote to ask."""
        on_disk = any(store is not None and store.path_of(key).exists() for store in (self.store, self.system_store))
        return on_disk or self.remote is not None

    def _remote_record(self, key: str):
        """The remote's record for `key` once it proves itself: signed (the store checks), its key the
        signature of its own spec and environment, made on a machine like this one; then kept locally."""
        record = self.remote.get(key)
        if record is None:
            return None
        if not key_matches(record) or not for_machine(record.meta, self.env):
            self.count("remote_refused")
            log.warning("remote plan cache: record %s refused (its key is not its spec's and environment's "
                        "signature on this machine)", key[:16])
            return None
        self.count("remote_hits")
        if self.store is not None:
            self.store.put(record, keep_existing=functools.partial(keep_stored, record))
        return record

    @property
    def writable(self) -> bool:
        return self.store is not None or self.remote is not None

    def put(self, record) -> None:
        """Store `record` locally and queue it for the remote. Never lets a heuristic choice overwrite an
        autotuned record another process wrote meanwhile."""
        if self.store is not None and self.store.put(record, keep_existing=functools.partial(keep_stored, record)):
            self.count("disk_writes")
        if self.remote is not None:
            _write_through(self.remote, record, self.count)


def _write_through(remote, record, count) -> None:
    """Write `record` to `remote` on the writer thread (`remote_writes`: bounded queue, bounded exit): the
    caller never waits for the network; a record never replaces a better one there (checked atomically)."""

    def write() -> None:
        if remote.put(record, keep_existing=keep_stored):
            count("remote_writes")

    remote_writes.submit(write)


def flush_remote_writes(timeout: float | None = None) -> bool:
    """Wait until every remote write queued so far is done (the CLI and tests; never needed on a hot path);
    False when `timeout` seconds passed first."""
    return remote_writes.flush(timeout)
