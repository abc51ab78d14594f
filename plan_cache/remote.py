"""A plan store shared by a fleet, on Redis: signed records in, verified records out. Knows nothing of cuDNN.

Each record is kept under `{prefix}:v{FORMAT_VERSION}:{key}` as `SIG_MAGIC + HMAC-SHA256 + record bytes`,
the same self-checking bytes a local store file holds. The HMAC covers the Redis key name and the bytes,
under a secret the fleet shares: a plan loads native code, so a record nobody with the secret wrote, or
one moved to another key, is refused and counted, never served.

Failure is never the caller's problem. Every call ends by its deadline (`timeout` seconds for the whole
call, name resolution included, however slowly the server answers) and reads no more than a record can be
(a value's length is asked before the value); an unreachable, stalled, full or garbled server, or a reply
of the wrong shape, is one warning per kind of trouble, the call returns a miss (or "not written"), and a
back-off skips the server for `backoff` seconds instead of paying the timeout on every call. A key's own
trouble (another type, too long, not signed) is that key's miss, never the server's back-off. The local
store goes on as if there were no remote. URLs are shown with their password hidden (`redact_url`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator
from urllib.parse import unquote_plus

from .errors import CacheError, CorruptRecordError
from .record import FORMAT_VERSION, MAX_RECORD_BYTES, PlanRecord, decode, encode, validate_key

log = logging.getLogger("plan_cache")

SIG_MAGIC = b"CGSIG1\0\0"
_SIG_SIZE = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16
_COUNTERS = ("hits", "misses", "puts", "puts_kept_existing", "refused_unsigned", "refused_signature",
             "corrupt", "wrong_type", "too_large", "ignored_names", "timeouts", "unreachable", "full", "errors",
             "skipped_backing_off")
_PUT_RETRIES = 3  # optimistic transactions lost to concurrent writers before giving up on one put
_MAX_VALUE = len(SIG_MAGIC) + _SIG_SIZE + MAX_RECORD_BYTES  # the longest value a record can be stored as
_MAX_NAMES = 1_000_000  # names a listing keeps: a server that never ends its SCAN cannot fill memory
# A query parameter whose name (percent-decoded, as redis-py's parse_qs decodes it: `pass%77ord` is
# `password`) says secret: redis-py hands `password`, `ssl_password` and any other name to the connection.
_SECRET_NAME = re.compile(r"(?i)pass|secret|token|auth|cred")


def redact_url(url: str) -> str:
    """`url` as it may be shown: its userinfo and the value of every query parameter that names a secret
    replaced by `***` (URLs land in job logs). Everything up to the last '@' goes, so a password holding
    '/', '?', '#' or '@' goes whole; a fragment, and a query part that is no `name=value` (the rest of a
    value holding '&' or ';'), go too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    rest, hash_, _ = rest.partition("#")
    base, question, query = rest.partition("?")
    if question:
        base += "?" + "".join(_shown_param(part) for part in re.split(r"([&;])", query))
    return scheme + sep + base + ("#***" if hash_ else "")


def _shown_param(part: str) -> str:
    if part in ("&", ";", ""):
        return part
    name, equals, _ = part.partition("=")
    if not equals:
        return "***"
    return f"{name}=***" if _SECRET_NAME.search(unquote_plus(name)) else part


class RemoteCacheError(CacheError):
    """The remote store cannot be set up (a bad URL, no `redis` package, a secret too short)."""


class RemoteReplyError(CacheError):
    """The server's reply to `command` is not what Redis answers (a proxy or another RESP service), or is
    longer than the call may read. A remote error like any other: one warning, then the back-off."""

    def __init__(self, command: str, detail: str):
        self.command, self.detail = command, detail
        super().__init__(f"the reply to {command} {detail}")


class RemoteStore:
    """Signed plan records on a Redis server at `url` (`redis://host:port/db`, `rediss://`, `unix://`).

    `get(key)` returns a `PlanRecord` or None (a miss, or any trouble); `fetch(key)` also says which;
    `put(record, keep_existing=)` writes unless `keep_existing(record, stored)` says the stored one stays,
    atomically against concurrent writers (WATCH / MULTI). Each read ends within `timeout` seconds, each write
    within `write_timeout` (default the larger of 5 s and `timeout`: writes run on a background thread, off
    the job's path, and a thread starved of the GIL by a plan build in C++ lost its 0.5 s to waiting: a
    warm-up on an H200 stored 23 of 69 records so); listing the keys within `list_timeout`. Thread-safe; counters in `stats()`. `self.url` is the URL with its
    password hidden.
    """

    def __init__(self, url: str, *, secret: bytes, timeout: float = 0.5, backoff: float = 30.0,
                 prefix: str = "cudnn-graphs", list_timeout: float = 30.0, write_timeout: float | None = None):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise RemoteCacheError(f"the remote cache's secret must be at least {MIN_SECRET_BYTES} bytes")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 60):
            raise RemoteCacheError(f"timeout={timeout!r}: expected seconds in (0, 60]")
        if not (isinstance(list_timeout, (int, float)) and 0 < list_timeout <= 3600):
            raise RemoteCacheError(f"list_timeout={list_timeout!r}: expected seconds in (0, 3600]")
        if write_timeout is None:
            write_timeout = max(5.0, float(timeout))
        if not (isinstance(write_timeout, (int, float)) and 0 < write_timeout <= 600):
            raise RemoteCacheError(f"write_timeout={write_timeout!r}: expected seconds in (0, 600]")
        try:
            import redis

            from . import _redis_io
        except ImportError:
            raise RemoteCacheError("the remote cache needs the redis client: pip install 'cudnn-graphs[remote]'") \
                from None
        try:
            self._client = _redis_io.client(url, timeout)
        except (ValueError, TypeError) as err:
            raise RemoteCacheError(f"remote cache URL {redact_url(url)!r}: {_parse_trouble(err)}") from None
        self._redis, self._io = redis, _redis_io
        self.url, self.timeout, self.backoff, self.prefix = redact_url(url), float(timeout), float(backoff), prefix
        self.list_timeout, self.write_timeout = float(list_timeout), float(write_timeout)
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
        return self.fetch(key)[0]

    def fetch(self, key: str) -> tuple[PlanRecord | None, str]:
        """`get(key)`, and what happened: "hit", "miss", "refused" (unsigned, or signed with another key),
        "corrupt", "wrong_type" (a key holding no string), "too_large" (never downloaded), or "failed" (the
        server failed, or is skipped while backing off)."""
        name = self.name_of(key)
        value = self._call("get", lambda: self._read(self._client, name))
        if value is _FAILED:
            return None, "failed"
        if isinstance(value, str):
            return None, self._key_trouble(value)
        data = self._unwrap(name, value)
        if data is None:
            return None, "refused"
        try:
            record = decode(data, expected_key=key).record
        except CorruptRecordError as err:
            self._count("corrupt")
            self._warn_once("corrupt", "remote plan cache %s: a damaged record was refused (%s)", self.url, err)
            return None, "corrupt"
        self._count("hits")
        return record, "hit"

    def _read(self, client: Any, name: str) -> bytes | str:
        """The value under `name`, or why not: "miss", "wrong_type", "too_large". Its length is asked first,
        so a value no record can be is never downloaded."""
        try:
            size = _integer("STRLEN", client.strlen(name))
            if size == 0:  # no such key (or an empty string, which is no record either)
                return "miss"
            if size > _MAX_VALUE:
                return "too_large"
            self._io.allow(size)
            value = client.get(name)
        except self._redis.ResponseError as err:
            if str(err).startswith("WRONGTYPE"):  # a planted key of another type: its trouble, not the server's
                return "wrong_type"
            raise
        if value is None:
            return "miss"  # deleted between the two commands
        if not isinstance(value, bytes):
            raise RemoteReplyError("GET", _not("a string", value))
        return value

    def _key_trouble(self, outcome: str) -> str:
        if outcome == "miss":
            self._count("misses")
        elif outcome == "wrong_type":
            self._count("wrong_type")
            self._warn_once("wrong_type", "remote plan cache %s: a key holding another type than a string was "
                            "skipped", self.url)
        else:
            self._count("too_large")
            self._warn_once("too_large", "remote plan cache %s: a value longer than any record (%d bytes) was "
                            "skipped unread", self.url, _MAX_VALUE)
        return outcome

    def put(self, record: PlanRecord, *, keep_existing: Callable[[PlanRecord, PlanRecord], bool] | None = None) -> bool:
        """Store `record` unless `keep_existing(record, stored)` keeps a verified stored one; True when
        written. Never raises for the server's sake."""
        if time.monotonic() < self._full_until:
            self._count("skipped_backing_off")
            return False
        name = self.name_of(record.key)
        value = self._wrap(name, encode(record))
        outcome = self._call("put", lambda: self._put(name, record, value, keep_existing), seconds=self.write_timeout)
        if outcome is _FAILED or not outcome:
            return False
        self._count("puts")
        return True

    def _put(self, name: str, record: PlanRecord, value: bytes, keep_existing) -> bool:
        for _ in range(_PUT_RETRIES):
            with self._client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(name)
                    stored = self._read(pipe, name) if keep_existing is not None else None
                    old = self._verified(name, record.key, stored) if isinstance(stored, bytes) else None
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
        """The keys of every record on the server under this store's prefix (empty when unreachable). Names
        there that are no record key (planted, or another program's) are skipped, counted in `ignored_names`."""
        head = f"{self.prefix}:v{FORMAT_VERSION}:".encode()
        names = self._call("scan", lambda: self._scan(head + b"*"), seconds=self.list_timeout)
        if names is _FAILED:
            return iter(())
        names = set(names)  # SCAN may name a key twice
        keys = {key for key in map(functools.partial(_key_of, head), names) if key is not None}
        self._count("ignored_names", len(names) - len(keys))
        return iter(sorted(keys))

    def _scan(self, pattern: bytes) -> list:
        names: list = []
        cursor = 0
        while True:
            with self._io.limits(self.timeout):  # each page within a call's time too
                reply = self._client.scan(cursor, match=pattern, count=500)
            if not (isinstance(reply, (tuple, list)) and len(reply) == 2 and isinstance(reply[1], list)
                    and all(isinstance(name, bytes) for name in reply[1])):
                raise RemoteReplyError("SCAN", _not("a cursor and a list of names", reply))
            cursor = _integer("SCAN", reply[0])
            names.extend(reply[1])
            if len(names) > _MAX_NAMES:
                raise RemoteReplyError("SCAN", f"names more than {_MAX_NAMES} keys")
            if cursor == 0:
                return names

    def counters(self) -> dict[str, int]:
        """This process's counters (no call to the server)."""
        with self._lock:
            return dict(self._counts)

    def backing_off(self) -> bool:
        """Whether the server failed lately and calls are being skipped."""
        return time.monotonic() < self._down_until

    def stats(self) -> dict[str, Any]:
        """This process's counters, plus what the server says (records under the prefix, memory) when reachable."""
        info = self._call("info", lambda: _mapping("INFO", self._client.info("memory")))
        out: dict[str, Any] = self.counters()
        out["url"] = self.url
        out["reachable"] = info is not _FAILED
        if info is not _FAILED:
            out["server_used_memory"] = info.get("used_memory")
            out["server_maxmemory"] = info.get("maxmemory")
        return out

    # -- failure handling ----------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any], *, seconds: float | None = None) -> Any:
        if time.monotonic() < self._down_until:
            self._count("skipped_backing_off")
            return _FAILED
        try:
            with self._io.limits(self.timeout if seconds is None else seconds):
                return fn()
        except Exception as err:  # whatever a stranger's reply makes the client raise is the server's trouble
            self._failed(what, err)
            return _FAILED

    def _failed(self, what: str, err: Exception) -> None:
        redis = self._redis
        if isinstance(err, (redis.TimeoutError, socket.timeout)):
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
            self._disconnect()
        skipped = "the remote is skipped" if pause else "writes to the remote are skipped"
        self._warn_once(kind, "remote plan cache %s: %s failed (%s: %s); the local cache goes on, %s for %.0f s",
                        self.url, what, type(err).__name__, _shown(err), skipped, self.backoff)

    def _disconnect(self) -> None:
        try:  # a connection that took a reply of the wrong shape may hold the rest of it: start afresh
            self._client.connection_pool.disconnect()
        except Exception:  # closing what is broken may fail too; nothing is left to do then
            pass

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning(message, *args)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n


_FAILED = object()


def _parse_trouble(err: Exception) -> str:
    """Why redis-py refused a URL, without its words: they may quote the URL ("Port could not be cast to
    integer value as 'pa'" is the start of a password holding an unescaped '/')."""
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if isinstance(err, TypeError) and unknown:
        return f"redis-py knows no option {unknown.group(1)!r}"
    return ("redis-py cannot parse it (a malformed host, port or option value, or a password holding '/', "
            "'?', '#' or '@' not percent-encoded)")


def _integer(command: str, reply: Any) -> int:
    if isinstance(reply, bool) or not isinstance(reply, int) or reply < 0:
        raise RemoteReplyError(command, _not("a count", reply))
    return reply


def _mapping(command: str, reply: Any) -> dict:
    if not isinstance(reply, dict):
        raise RemoteReplyError(command, _not("a mapping", reply))
    return reply


def _key_of(head: bytes, name: bytes) -> str | None:
    """The record key a listed name stands for, or None for a name that is none (planted, or not ours)."""
    if not name.startswith(head):
        return None
    try:
        return validate_key(name[len(head):].decode("ascii"))
    except (UnicodeDecodeError, ValueError, TypeError):
        return None


def _not(expected: str, reply: Any) -> str:
    return f"is not {expected} but {type(reply).__name__} {_shown(repr(reply))[:60]}"


def _shown(value: Any) -> str:
    """A server's words as one short printable line: they reach job logs and terminals."""
    text = str(value)
    return (text if text.isprintable() else ascii(text))[:200]
