"""A plan store shared by a fleet, on Redis: signed records in, verified records out. Knows nothing of cuDNN.

Each record is kept under `{prefix}:v{FORMAT_VERSION}:{key}` as `SIG_MAGIC + HMAC-SHA256 + record bytes`,
the same self-checking bytes a local store file holds. The HMAC covers the Redis key name and the bytes,
under a secret the fleet shares: a plan loads native code, so a record nobody with the secret wrote, or
one moved to another key, is refused and counted, never served.

Failure is never the caller's problem. Every call has a socket timeout; an unreachable, stalled, full or
garbled server is one warning per kind of trouble, the call returns a miss (or "not written"), and a
back-off skips the server for `backoff` seconds instead of paying the timeout on every call. The local
store goes on as if there were no remote. URLs are shown with their password hidden (`redact_url`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from typing import Any, Callable, Iterator

from .errors import CacheError, CorruptRecordError
from .record import FORMAT_VERSION, MAX_RECORD_BYTES, PlanRecord, decode, encode, validate_key

log = logging.getLogger("plan_cache")

SIG_MAGIC = b"CGSIG1\0\0"
_SIG_SIZE = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16
_COUNTERS = ("hits", "misses", "puts", "puts_kept_existing", "refused_unsigned", "refused_signature",
             "corrupt", "timeouts", "unreachable", "full", "errors", "skipped_backing_off")
_PUT_RETRIES = 3  # optimistic transactions lost to concurrent writers before giving up on one put
_PASSWORD_PARAM = re.compile(r"(?i)([?&]password=)[^&#]*")


def redact_url(url: str) -> str:
    """`url` as it may be shown: its userinfo and any `password=` parameter replaced by `***` (URLs land in
    job logs). Everything up to the last '@' goes, so a password holding '/' or '@' goes whole."""
    url = _PASSWORD_PARAM.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme + sep + rest


class RemoteCacheError(CacheError):
    """The remote store cannot be set up (a bad URL, no `redis` package, a secret too short)."""


class RemoteStore:
    """Signed plan records on a Redis server at `url` (`redis://host:port/db`, `rediss://`, `unix://`).

    `get(key)` returns a `PlanRecord` or None (a miss, or any trouble); `put(record, keep_existing=)` writes
    unless `keep_existing(record, stored)` says the stored one stays, atomically against concurrent
    writers (WATCH / MULTI). Thread-safe; counters in `stats()`. `self.url` is the URL with its password
    hidden.
    """

    def __init__(self, url: str, *, secret: bytes, timeout: float = 0.5, backoff: float = 30.0,
                 prefix: str = "cudnn-graphs"):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise RemoteCacheError(f"the remote cache's secret must be at least {MIN_SECRET_BYTES} bytes")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 60):
            raise RemoteCacheError(f"timeout={timeout!r}: expected seconds in (0, 60]")
        try:
            import redis
        except ImportError:
            raise RemoteCacheError("the remote cache needs the redis client: pip install 'cudnn-graphs[remote]'") \
                from None
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                retry_on_timeout=False, health_check_interval=0)
        except ValueError as err:
            raise RemoteCacheError(f"remote cache URL {redact_url(url)!r}: {err}") from None
        self._redis = redis
        self.url, self.timeout, self.backoff, self.prefix = redact_url(url), float(timeout), float(backoff), prefix
        self._secret = bytes(secret)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._lock = threading.Lock()
        self._down_until = 0.0  # no calls before this (monotonic): the server failed recently
        self._full_until = 0.0  # no writes before this: the server said it is out of memory
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    # -- names and signatures ------------------------------------------------------------------------------
    def name_of(self, key: str) -> str:
        return f"{self.prefix}:v{FORMAT_VERSION}:{validate_key(key)}"

    def _signature(self, name: str, data: bytes) -> bytes:
        return hmac.new(self._secret, name.encode() + b"\0" + data, hashlib.sha256).digest()

    def _wrap(self, name: str, data: bytes) -> bytes:
        return SIG_MAGIC + self._signature(name, data) + data

    def _unwrap(self, name: str, value: bytes) -> bytes | None:
        head = len(SIG_MAGIC) + _SIG_SIZE
        if not value.startswith(SIG_MAGIC) or len(value) < head:
            self._count("refused_unsigned")
            self._warn_once("unsigned", "remote plan cache %s: a record without a signature was refused", self.url)
            return None
        data = value[head:]
        if not hmac.compare_digest(value[len(SIG_MAGIC):head], self._signature(name, data)):
            self._count("refused_signature")
            self._warn_once("signature", "remote plan cache %s: a record signed with another key (or altered) "
                            "was refused", self.url)
            return None
        return data

    # -- the store -----------------------------------------------------------------------------------------
    def get(self, key: str) -> PlanRecord | None:
        """The record stored under `key`, verified (signature, checksum, key), or None."""
        name = self.name_of(key)
        value = self._call("get", lambda: self._client.get(name))
        if value is _FAILED:
            return None
        if value is None:
            self._count("misses")
            return None
        if len(value) > MAX_RECORD_BYTES + 64:
            self._count("corrupt")
            return None
        data = self._unwrap(name, bytes(value))
        if data is None:
            return None
        try:
            record = decode(data, expected_key=key).record
        except CorruptRecordError as err:
            self._count("corrupt")
            self._warn_once("corrupt", "remote plan cache %s: a damaged record was refused (%s)", self.url, err)
            return None
        self._count("hits")
        return record

    def put(self, record: PlanRecord, *, keep_existing: Callable[[PlanRecord, PlanRecord], bool] | None = None) -> bool:
        """Store `record` unless `keep_existing(record, stored)` keeps a verified stored one; True when
        written. Never raises for the server's sake."""
        if time.monotonic() < self._full_until:
            self._count("skipped_backing_off")
            return False
        name = self.name_of(record.key)
        value = self._wrap(name, encode(record))
        outcome = self._call("put", lambda: self._put(name, record, value, keep_existing))
        if outcome is _FAILED or not outcome:
            return False
        self._count("puts")
        return True

    def _put(self, name: str, record: PlanRecord, value: bytes, keep_existing) -> bool:
        for _ in range(_PUT_RETRIES):
            with self._client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(name)
                    stored = pipe.get(name) if keep_existing is not None else None
                    old = self._verified(name, record.key, stored) if stored is not None else None
                    if old is not None and keep_existing(record, old):
                        self._count("puts_kept_existing")
                        return False
                    pipe.multi()
                    pipe.set(name, value)
                    pipe.execute()
                    return True
                except self._redis.WatchError:  # another writer got there first: look again
                    continue
        return False

    def _verified(self, name: str, key: str, value: bytes) -> PlanRecord | None:
        data = self._unwrap(name, bytes(value))
        try:
            return decode(data, expected_key=key).record if data is not None else None
        except CorruptRecordError:
            return None  # a damaged record is replaced, never kept

    def keys(self) -> Iterator[str]:
        """The keys of every record on the server under this store's prefix (empty when unreachable)."""
        pattern = f"{self.prefix}:v{FORMAT_VERSION}:*"
        names = self._call("scan", lambda: list(self._client.scan_iter(match=pattern, count=500)))
        if names is _FAILED:
            return iter(())
        head = len(pattern) - 1
        return iter(sorted(n.decode(errors="replace")[head:] for n in names))

    def stats(self) -> dict[str, Any]:
        """This process's counters, plus what the server says (records under the prefix, memory) when reachable."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        info = self._call("info", lambda: self._client.info("memory"))
        out["url"] = self.url
        out["reachable"] = info is not _FAILED
        if info is not _FAILED:
            out["server_used_memory"] = info.get("used_memory")
            out["server_maxmemory"] = info.get("maxmemory")
        return out

    # -- failure handling ----------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if time.monotonic() < self._down_until:
            self._count("skipped_backing_off")
            return _FAILED
        try:
            return fn()
        except self._redis.RedisError as err:
            self._failed(what, err)
            return _FAILED

    def _failed(self, what: str, err: Exception) -> None:
        redis = self._redis
        if isinstance(err, redis.TimeoutError):
            kind, pause = "timeouts", True
        elif isinstance(err, redis.ConnectionError):
            kind, pause = "unreachable", True
        elif isinstance(err, getattr(redis, "OutOfMemoryError", ())) or (
                isinstance(err, redis.ResponseError) and ("OOM" in str(err) or "maxmemory" in str(err))):
            kind, pause = "full", False
            self._full_until = time.monotonic() + self.backoff
        else:
            kind, pause = "errors", True
        self._count(kind)
        if pause:
            self._down_until = time.monotonic() + self.backoff
        skipped = "the remote is skipped" if pause else "writes to the remote are skipped"
        self._warn_once(kind, "remote plan cache %s: %s failed (%s: %s); the local cache goes on, %s for %.0f s",
                        self.url, what, type(err).__name__, err, skipped, self.backoff)

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning(message, *args)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


_FAILED = object()
