"""PlanStore: a directory of self-checking plan records, safe to share between processes.

Layout under `root` (every directory mode 0o700, every file 0o600):

    root/v1/<key[:2]>/<key>.rec       one record (format: plan_cache.record); its mtime is the last use
    root/v1/<key[:2]>/.tmp-<writer>-<pid>-<hex>  a write in progress, or debris of a killed writer: swept at
                                      the next scan when that pid is gone from this host and PID namespace
                                      (<writer> names both), else once stale
    root/quarantine/<ns>-<pid>-<hex>-<name>   corrupt or untrusted files, kept for inspection (newest few)
    root/.evict.lock                  flock held only while evicting (.evict.softlock where flock fails)
    root/.write.lock                  flock held by conditional puts (read-compare-replace)
    root/CACHEDIR.TAG                 marks the root as a cache (bford.info/cachedir): backup tools skip it,
                                      and `clear`/`prune` refuse a directory without it

`clear`, `prune`, eviction and the sweeps delete only names of this layout, and `clear`/`prune` only in a
marked root. The mark is written when the store creates the root, or lays out `v1/` in a directory that
holds nothing else; a root of an earlier version (no mark, only this layout) is marked when first cleared
or pruned; a directory that holds other files is never marked.

Parts, in order: trust checks, reading (get), writing (put), eviction, maintenance (verify, delete, clear).
Concurrency model: readers and writers take no lock. A write goes to a unique temp file in the record's own
directory, is fsynced and then `os.replace`d over the record's name, so a reader opens either the old whole
file or the new whole file. Only eviction takes a lock, so that two evictors do not both delete to the cap.
Nothing here raises on a bad disk: a bad record is a miss, a failed write is `False`, each with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import heapq
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ._files import NoFollowLock, write_atomic
from .errors import CorruptRecordError, NotACacheError, UntrustedCacheError
from .record import FORMAT_VERSION, MAX_RECORD_BYTES, PlanRecord, decode, encode, validate_key

if TYPE_CHECKING:
    import filelock

__all__ = ["PlanStore", "STALE_TEMP_AGE", "TOUCH_INTERVAL", "QUARANTINE_KEEP"]

logger = logging.getLogger("plan_cache")

STALE_TEMP_AGE = 600.0  # seconds without a write after which a temp file is a dead writer's debris
TOUCH_INTERVAL = 1.0  # a hit rewrites the last-use time only when it is older than this: hot gets stay read-only
RESCAN_PUTS = 256  # a capped store rescans after at least this many puts (or as many as it last found)...
RESCAN_SECONDS = 60.0  # ...or this long: what other processes wrote is counted from then on
QUARANTINE_KEEP = 32  # quarantined files kept for inspection; older ones are deleted
RECORD_SUFFIX = ".rec"
TEMP_PREFIX = ".tmp-"
TAG_NAME = "CACHEDIR.TAG"
TAG_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"  # the Cache Directory Tagging spec's header
_TAG_TEXT = TAG_SIGNATURE + (b"\n# This file is a cache directory tag created by cudnn-graphs (its plan cache).\n"
                             b"# For information about cache directory tags see https://bford.info/cachedir/\n")
_ROOT_NAMES = frozenset({TAG_NAME, f"v{FORMAT_VERSION}", "quarantine", ".write.lock", ".evict.lock",
                         ".write.softlock", ".evict.softlock"})
_FAN_OUT_RE = re.compile(r"[0-9A-Za-z_-]{1,2}")  # key[:2] of a valid key
_QUARANTINED_RE = re.compile(r"\d{20}-\d+-[0-9a-f]{8}-.*\.rec", re.S)  # _move_to_quarantine's names
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO planted at a record path must not block
# errno values that mean "this filesystem has no flock" (not "this attempt failed")
_NO_FLOCK = {getattr(errno, name) for name in ("ENOSYS", "ENOTSUP", "EOPNOTSUPP", "ENOLCK") if hasattr(errno, name)}
_COUNTERS = ("hits", "misses", "puts", "puts_skipped", "puts_kept_existing", "evictions", "corrupt", "untrusted")


class _Entry(NamedTuple):
    path: str
    size: int
    mtime_ns: int
    ino: int


class _SizeIndex:
    """What this process knows of a capped cache's record files: built by a full scan, kept by this
    process's puts and evictions, a heap of last uses for the least recently used. Other processes' writes
    are seen at the next scan, due after as many puts as the scan found records (at least RESCAN_PUTS) or
    RESCAN_SECONDS: scans cost O(1) a put, amortised, and import or pull of N records O(N)."""

    def __init__(self, entries: list[_Entry]):
        self.files = {e.path: e for e in entries}
        self.total = sum(e.size for e in entries)
        self.heap = [(e.mtime_ns, e.path) for e in entries]
        heapq.heapify(self.heap)
        self.puts, self.made = 0, time.monotonic()

    def due(self) -> bool:
        return self.puts >= max(RESCAN_PUTS, len(self.files)) or time.monotonic() - self.made > RESCAN_SECONDS

    def add(self, entry: _Entry, *, put: bool = False) -> None:
        old = self.files.get(entry.path)
        self.total += entry.size - (old.size if old is not None else 0)
        self.files[entry.path] = entry
        heapq.heappush(self.heap, (entry.mtime_ns, entry.path))
        self.puts += put

    def refile(self, entry: _Entry) -> None:
        heapq.heappush(self.heap, (entry.mtime_ns, entry.path))

    def drop(self, path: str) -> None:
        old = self.files.pop(path, None)
        self.total -= old.size if old is not None else 0

    def oldest(self) -> _Entry | None:
        """The least recently used entry as last known, taken off the heap; None when none is left.
        Heap items that no longer match the entry (replaced, refiled) are skipped."""
        while self.heap:
            mtime_ns, path = heapq.heappop(self.heap)
            entry = self.files.get(path)
            if entry is not None and entry.mtime_ns == mtime_ns:
                return entry
        return None


class Peeked(NamedTuple):
    """A record file as read, without side effects: `status` as `_Loaded`'s, with the reason when not ok."""

    status: str
    record: PlanRecord | None = None
    stat: os.stat_result | None = None
    reason: str = ""


class _Loaded(NamedTuple):
    status: str  # "ok", "missing", "corrupt", "untrusted" or "unreadable"
    record: PlanRecord | None = None
    stat: os.stat_result | None = None


# --- trust ---------------------------------------------------------------------------------------------------

def _euid() -> int | None:
    getter = getattr(os, "geteuid", None)  # absent on Windows, where ownership is not checked
    return getter() if getter is not None else None


def _distrust(st: os.stat_result, *, root_may_own: bool = False) -> str | None:
    """Why a file or directory with this stat must not be trusted, or None if it may be. `root_may_own`:
    a system cache, which root (or the user) owns and nobody else can write."""
    uid = _euid()
    if uid is not None and st.st_uid != uid and not (root_may_own and st.st_uid == 0):
        owners = "the current user or root" if root_may_own else "the current user"
        return f"owned by uid {st.st_uid}, not by {owners} (uid {uid})"
    if os.name == "posix" and st.st_mode & 0o022:
        return f"mode {stat.filemode(st.st_mode)} ({oct(st.st_mode & 0o777)}) lets group or others write"
    return None


def _trusted_dir(path: Path, *, follow: bool = False, create: bool = True) -> bool:
    """Create `path` 0o700 if absent (`create`); refuse it if it is not a directory we alone can write;
    whether it was created. Only the root may be reached through a symbolic link (`follow`): nothing
    under it is ever followed. Without `create`, a missing `path` is fine (False)."""
    created = False
    try:
        if create:
            path.mkdir(mode=_DIR_MODE, parents=True)
            os.chmod(path, _DIR_MODE)  # a umask cannot widen 0o700, but an odd one could narrow it unusably
            created = True
    except FileExistsError:
        pass
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        if create:
            raise
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedCacheError(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "plan cache path is not a directory", os.fspath(path))
    reason = _distrust(st)
    if reason is not None:
        raise UntrustedCacheError(path, reason)
    return created


def _trusted_existing_dir(path: Path) -> None:
    """A read-only tier's root: it must exist, be a directory, be owned by the user or root, and be
    writable by nobody else (a group-writable team directory is refused too)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "plan cache path is not a directory", os.fspath(path))
    reason = _distrust(st, root_may_own=True)
    if reason is not None:
        raise UntrustedCacheError(path, reason)


def _unsafe_dir(path: str | Path, *, root_may_own: bool = False) -> str | None:
    """Why a directory under the root must not be read, written or deleted through (a link, not a
    directory, or not ours alone), else None; a missing one is not unsafe."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return _distrust(st, root_may_own=root_may_own)


def _number(name: str, value: Any, *, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: {value!r} must be a finite number >= 0")
    return value


def _scandir(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):  # removed by a concurrent clear or a person
        return []


class PlanStore:
    """A persistent, process-safe store of `PlanRecord`s under `root`.

    `max_bytes` caps the total size of record files (least recently used records are evicted after a put);
    `lock_timeout` bounds the wait for the eviction lock (on timeout eviction is skipped this time);
    `stale_temp_age` is the age after which a temp file counts as a dead writer's and is swept;
    `touch_interval` throttles last-use updates on hits (0: record every hit).
    Raises UntrustedCacheError (a PermissionError) when `root` is not ours alone; `open_or_none` does not.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None, lock_timeout: float = 10.0,
                 stale_temp_age: float = STALE_TEMP_AGE, touch_interval: float = TOUCH_INTERVAL,
                 read_only: bool = False):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)):
            raise TypeError(f"max_bytes: expected int or None, got {type(max_bytes).__name__}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes: {max_bytes} must be > 0 (None for no cap)")
        self._max_bytes = max_bytes
        self._lock_timeout = float(_number("lock_timeout", lock_timeout))
        self._stale_temp_age = float(_number("stale_temp_age", stale_temp_age))
        self._touch_interval_ns = int(_number("touch_interval", touch_interval) * 1e9)
        if not os.fspath(root).strip():  # Path("") is the working directory: an unset variable, not a cache
            raise ValueError(f"root: {os.fspath(root)!r} is an empty path, not a cache directory")
        self._root = Path(os.fspath(root))
        self._records = self._root / f"v{FORMAT_VERSION}"
        self._quarantine = self._root / "quarantine"
        self._use_soft_lock = False
        self._stuck: set[str] = set()  # locks that timed out: tried without waiting until acquired again
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts_lock = threading.Lock()
        self._index: _SizeIndex | None = None  # a capped store's running total: built at its first put
        self._index_lock = threading.Lock()
        self._read_only = bool(read_only)
        if self._read_only:  # a shared system tier: never created, written, touched or quarantined in
            _trusted_existing_dir(self._root)
            return
        if _trusted_dir(self._root, follow=True):
            self._lay_out()
        else:  # an existing root gets v1/ at its first put: `cache ls` on a read-only one creates nothing
            _trusted_dir(self._records, create=False)

    @classmethod
    def open_or_none(cls, root: str | os.PathLike[str], **kwargs: Any) -> PlanStore | None:
        """The store, or None (after one warning) when `root` is untrusted or unusable: caller goes memory-only."""
        try:
            return cls(root, **kwargs)
        except OSError as err:  # UntrustedCacheError is a PermissionError, hence an OSError
            logger.warning("plan cache: persistent cache disabled, plans are kept in memory only: %s", err)
            return None

    @property
    def root(self) -> Path:
        return self._root

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    def __repr__(self) -> str:
        return f"PlanStore({os.fspath(self._root)!r}, max_bytes={self._max_bytes})"

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def _record_path(self, key: str) -> Path:
        return self._records / key[:2] / f"{key}{RECORD_SUFFIX}"

    def path_of(self, key: str) -> Path:
        """Where the record for `key` lives (it may not exist): for tools that read files without a get()."""
        return self._record_path(validate_key(key))

    # --- reading ---------------------------------------------------------------------------------------------

    def get(self, key: str) -> PlanRecord | None:
        """The record stored under `key`, or None when absent, corrupt or untrusted (never raises for those)."""
        validate_key(key)
        path = self._record_path(key)
        if self._read_only:
            peeked = self._read(path, key)
            if peeked.status not in ("ok", "missing"):
                logger.warning("plan cache: %s record %s in the read-only cache %s (%s); treated as a miss",
                               peeked.status, path.name, self._root, peeked.reason)
            self._count("hits" if peeked.status == "ok" else "misses")
            return peeked.record
        loaded = self._load(path, key)
        if loaded.status != "ok":
            self._count("misses")
            return None
        self._count("hits")
        self._touch(path, loaded.stat)
        return loaded.record

    def _load(self, path: Path, key: str) -> _Loaded:
        peeked = self._read(path, key)
        if peeked.status in ("ok", "missing", "unreadable"):
            if peeked.status == "unreadable":
                logger.warning("plan cache: cannot read %s (%s); treated as a miss", path, peeked.reason)
            return _Loaded(peeked.status, peeked.record, peeked.stat)
        if peeked.stat is None and peeked.reason.startswith("directory "):
            # never read, move or delete through a link or a directory others control
            self._count("untrusted")
            logger.warning("plan cache: %s; record %s treated as a miss", peeked.reason, path.name)
            return _Loaded("untrusted")
        return self._reject(path, peeked.stat, peeked.reason, status=peeked.status)

    def peek(self, key: str) -> Peeked:
        """The record under `key` read as `get` reads it, but read-only: no last-use update, nothing
        quarantined, nothing counted (`cudnn-graphs cache ls` and `verify` reports use it)."""
        return self._read(self._record_path(validate_key(key)), key)

    def _read(self, path: Path, key: str) -> Peeked:
        reason = self._unsafe_parents(path)
        if reason is not None:
            return Peeked("untrusted", None, None, reason)
        try:
            # O_NOFOLLOW: a symlink planted in the cache must not make us load a file from elsewhere.
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | _O_BINARY | _O_NONBLOCK)
        except FileNotFoundError:
            return Peeked("missing")
        except OSError as err:
            if err.errno == errno.ELOOP:
                return Peeked("untrusted", None, None, "is a symbolic link")
            return Peeked("unreadable", None, None, str(err))
        try:
            st = os.fstat(fd)  # type, owner and size are checked before a byte is read
            status, reason = self._refusal(st, root_may_own=self._read_only)
            data = _read_exactly(fd, st.st_size) if status is None else b""
        except OSError as err:
            return Peeked("unreadable", None, None, str(err))
        finally:
            os.close(fd)
        if status is not None:
            return Peeked(status, None, st, reason)
        try:
            record = decode(data, expected_key=key).record
        except CorruptRecordError as err:
            return Peeked("corrupt", None, st, err.reason)
        return Peeked("ok", record, st)

    def _unsafe_parents(self, path: Path) -> str | None:
        """Why the directories between the root and `path` must not be used, else None."""
        for directory in (self._records, path.parent):
            reason = _unsafe_dir(directory, root_may_own=self._read_only)
            if reason is not None:
                return f"directory {os.fspath(directory)} {reason}"
        return None

    @staticmethod
    def _refusal(st: os.stat_result, *, root_may_own: bool = False) -> tuple[str | None, str]:
        """(status, reason) for a record file that must not be read, else (None, "")."""
        if not stat.S_ISREG(st.st_mode):
            return "untrusted", "not a regular file"
        reason = _distrust(st, root_may_own=root_may_own)
        if reason is not None:  # deserialising a plan loads native code: never from a file others control
            return "untrusted", reason
        if st.st_size > MAX_RECORD_BYTES:
            return "corrupt", f"{st.st_size} bytes is larger than any record"
        return None, ""

    def _touch(self, path: Path, st: os.stat_result) -> None:
        # Last use lives in the record's own mtime, set explicitly: no sidecar to orphan, works on noatime mounts,
        # and a put (a new file) starts it at "now". Throttled so that hot hits do not write.
        now = time.time_ns()
        if 0 <= now - st.st_mtime_ns < self._touch_interval_ns:  # a future mtime (skewed clock) is rewritten too
            return
        try:
            os.utime(path, ns=(now, now))
        except OSError:  # evicted or replaced meanwhile: a lost touch only makes LRU order slightly stale
            pass

    def _reject(self, path: Path, st: os.stat_result | None, reason: str, *, status: str) -> _Loaded:
        """Count, quarantine and log (exactly one warning) a record that must not be used."""
        self._count(status)
        outcome = self._move_to_quarantine(path, st)
        logger.warning("plan cache: %s record %s (%s); %s; treated as a miss", status, path, reason, outcome)
        return _Loaded(status)

    def _move_to_quarantine(self, path: Path, st: os.stat_result | None) -> str:
        if st is not None:
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                return "already removed"
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return "left in place: a newer write replaced it"  # do not quarantine a good record
        dest = self._quarantine / f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}-{path.name}"
        try:
            self._quarantine.mkdir(mode=_DIR_MODE, exist_ok=True)
            unsafe = _unsafe_dir(self._quarantine)
            if unsafe is not None:  # moving into a linked or foreign directory would write outside the cache
                raise UntrustedCacheError(self._quarantine, unsafe)
            os.rename(path, dest)
        except FileNotFoundError:
            return "already removed"
        except OSError as err:
            try:
                os.unlink(path)
            except OSError:
                return f"left in place: cannot move or delete it ({err})"
            return f"deleted: cannot quarantine it ({err})"
        self._prune_quarantine()
        return f"moved to {dest}"

    def _prune_quarantine(self) -> None:
        entries = sorted(self._quarantined(), key=lambda e: e.name)  # names start with time_ns: oldest first
        for entry in entries[:max(0, len(entries) - QUARANTINE_KEEP)]:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)

    def _quarantined(self) -> list[os.DirEntry]:
        """The files this store moved into quarantine/ (by their names): never anything else a person put
        there, never through a link or in a foreign directory."""
        if _unsafe_dir(self._quarantine) is not None:
            return []
        return [e for e in _scandir(self._quarantine)
                if _QUARANTINED_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False)]

    # --- writing ---------------------------------------------------------------------------------------------

    def put(self, record: PlanRecord, *, keep_existing: Callable[[PlanRecord], bool] | None = None) -> bool:
        """Store `record`, replacing any under its key. False, with one warning, if it cannot be stored.

        `keep_existing(old)`: when given, it is asked about the record already stored (read under a lock
        that every conditional writer takes) and True keeps the old record; `put` then returns False.
        """
        if self._read_only:
            self._count("puts_skipped")
            logger.warning("plan cache: %s is read-only here; record %s not stored", self._root, record.key)
            return False
        data = encode(record)
        limit = min(self._max_bytes or MAX_RECORD_BYTES, MAX_RECORD_BYTES)
        if len(data) > limit:
            self._count("puts_skipped")
            logger.warning("plan cache: record %s is %d bytes, over the cache's %d-byte cap; not stored",
                           record.key, len(data), limit)
            return False
        path = self._record_path(record.key)
        try:
            if keep_existing is None:
                self._write_atomic(path, data)
            elif not self._write_unless_kept(path, record.key, data, keep_existing):
                self._count("puts_kept_existing")
                return False
        except OSError as err:
            self._count("puts_skipped")
            logger.warning("plan cache: cannot write %s (%s); the plan is not cached on disk", path, err)
            return False
        self._count("puts")
        if self._max_bytes is not None:
            self._evict_if_over(keep=os.fspath(path))
        return True

    def _write_unless_kept(self, path: Path, key: str, data: bytes, keep_existing: Callable[[PlanRecord], bool]) -> bool:
        # Read-compare-replace under one lock, so two conditional writers cannot both pass the check.
        with self._lock(".write"):  # on a lock timeout (warned) the compare still runs, unlocked
            old = self._load(path, key)
            if old.status == "ok" and keep_existing(old.record):
                return False
            self._write_atomic(path, data)
        return True

    def _write_atomic(self, path: Path, data: bytes) -> None:
        directory = path.parent
        try:
            directory.mkdir(mode=_DIR_MODE, exist_ok=True)
        except FileNotFoundError:  # the first put, or v1/ removed under us (a person's rm -rf)
            self._lay_out()
            directory.mkdir(mode=_DIR_MODE, exist_ok=True)
        reason = self._unsafe_parents(path)
        if reason is not None:  # a linked fan-out directory would put the record outside the cache
            raise UntrustedCacheError(directory, reason)
        write_atomic(path, data, temp=directory / temp_name(), mode=_FILE_MODE, extra_flags=_O_NOFOLLOW)

    def _lay_out(self) -> None:
        """Create v1/ (private), and mark the root a cache when it holds nothing but this layout."""
        _trusted_dir(self._root, follow=True)
        _trusted_dir(self._records)
        if self._unmarked_reason() is not None and self._foreign_name() is None:
            self._write_tag()

    # --- the cache mark --------------------------------------------------------------------------------------

    def _write_tag(self) -> None:
        try:  # best effort: an unmarked cache still works, only `clear` and `prune` refuse it
            write_atomic(self._root / TAG_NAME, _TAG_TEXT, temp=self._root / f"{TAG_NAME}{temp_name()}",
                         mode=_FILE_MODE, extra_flags=_O_NOFOLLOW)
        except OSError as err:
            logger.info("plan cache: cannot write %s in %s (%s)", TAG_NAME, self._root, err)

    def _unmarked_reason(self) -> str | None:
        """Why the root's CACHEDIR.TAG does not mark it a cache (absent, not a file, no signature), else None."""
        try:
            fd = os.open(self._root / TAG_NAME, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK)
        except FileNotFoundError:
            return f"it has no {TAG_NAME}"
        except OSError as err:
            return f"its {TAG_NAME} cannot be read ({err.strerror or err})"
        try:
            head = os.read(fd, len(TAG_SIGNATURE)) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        except OSError:
            head = b""
        finally:
            os.close(fd)
        return None if head == TAG_SIGNATURE else f"its {TAG_NAME} lacks the cache directory signature"

    def _foreign_name(self) -> str | None:
        """A name in the root or v1/ that this layout never writes, or None: then the root is a cache of
        this package, perhaps of a version that wrote no mark. v1/ itself must exist."""
        if _unsafe_dir(self._records) is not None or not self._records.is_dir():
            return f"v{FORMAT_VERSION}/"
        for item in _scandir(self._root):
            if item.name not in _ROOT_NAMES and not item.name.startswith(f"{TAG_NAME}{TEMP_PREFIX}"):
                return item.name
        for item in _scandir(self._records):
            if not (_FAN_OUT_RE.fullmatch(item.name) and item.is_dir(follow_symlinks=False)):
                return f"v{FORMAT_VERSION}/{item.name}"
        return None

    def check_marked(self) -> None:
        """Raise NotACacheError unless the root is marked a cache. An unmarked root that holds only this
        layout (written by a version before the mark) is marked now; a directory with other files never is."""
        reason = self._unmarked_reason()
        if reason is None:
            return
        foreign = self._foreign_name()
        if foreign == f"v{FORMAT_VERSION}/":
            raise NotACacheError(self._root, f"{reason} and no v{FORMAT_VERSION}/ directory of records")
        if foreign is not None:
            raise NotACacheError(self._root, f"{reason}, and it holds {foreign!r}, which the plan cache never writes")
        self._write_tag()

    # --- eviction --------------------------------------------------------------------------------------------

    def _evict_if_over(self, *, keep: str) -> None:
        """After a put of `keep` into a capped store: evict least recently used records while this
        process's running total says the cache is over its cap. No scan of the whole cache per put."""
        try:
            with self._index_lock:
                self._note_put(keep)
                if self._index.total <= self._max_bytes:
                    return
                with self._eviction_lock() as held:
                    if held:
                        self._evict_indexed(keep)
        except OSError as err:
            logger.warning("plan cache: eviction failed (%s); the cache may exceed its cap until the next put", err)

    def _note_put(self, path: str) -> None:
        """Count the record just written at `path` in the running total; rescan instead when the index is
        missing or due (it corrects what other processes wrote or removed meanwhile)."""
        if self._index is None or self._index.due():
            self._index = _SizeIndex(self._scan(sweep_before=time.time() - self._stale_temp_age)[0])
            return
        self._sweep_dir(os.path.dirname(path))  # a writer killed mid-put left its temp here, most likely
        try:
            st = os.lstat(path)
        except FileNotFoundError:  # evicted by another process already
            return
        self._index.add(_Entry(path, st.st_size, st.st_mtime_ns, st.st_ino), put=True)

    def _evict_indexed(self, keep: str) -> None:
        index, held_back = self._index, []
        while index.total > self._max_bytes:
            entry = index.oldest()
            if entry is None:  # nothing evictable is known: the next put rescans
                self._index = None
                break
            if entry.path == keep or not _own_record(entry.path):
                held_back.append(entry)
            else:
                self._evict_entry(index, entry)
        for entry in held_back:
            index.refile(entry)

    def _evict_entry(self, index: _SizeIndex, entry: _Entry) -> None:
        try:
            st = os.lstat(entry.path)
        except FileNotFoundError:  # removed by another process
            index.drop(entry.path)
            return
        if (st.st_ino, st.st_mtime_ns) != (entry.ino, entry.mtime_ns):  # used or rewritten since: file it as it is
            index.add(_Entry(entry.path, st.st_size, _not_future(entry.path, st), st.st_ino))
            return
        if self._unlink_if_unchanged(entry):
            index.drop(entry.path)
            self._count("evictions")
            self._sweep_dir(os.path.dirname(entry.path))

    def _sweep_dir(self, directory: str) -> None:
        """Remove the stale temp files of one fan-out directory (a few files: cheap on every put)."""
        before = time.time() - self._stale_temp_age
        for item in _scandir(directory):
            if item.name.startswith(TEMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    self._remove_if_stale(item.path, before)

    def _forget_sizes(self) -> None:
        """After maintenance that removed records (prune, clear): the next capped put rescans."""
        with self._index_lock:
            self._index = None

    def _evict(self, max_bytes: int | None = None, *, keep: str | None = None) -> int:
        """Evict least recently used records down to the cap; never `keep`, the record this put just wrote
        (records whose mtime was in the future count as used now, and would outrank it)."""
        # Rescan under the lock: another evictor may have run since the unlocked look. Sweep dead temps as we go.
        cap = self._max_bytes if max_bytes is None else max_bytes
        entries, _ = self._scan(sweep_before=time.time() - self._stale_temp_age)
        total, evicted = sum(e.size for e in entries), 0
        for entry in sorted(entries, key=lambda e: e.mtime_ns):  # least recently used first
            if total <= cap:
                break
            if entry.path == keep or not _own_record(entry.path):
                continue
            if self._unlink_if_unchanged(entry):
                total -= entry.size
                evicted += 1
                self._count("evictions")
        return evicted

    def prune(self, max_bytes: int) -> int:
        """Evict least recently used records until at most `max_bytes` remain; how many were removed.
        Only in a root marked a cache (else NotACacheError); 0 when another process holds the eviction lock."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: {max_bytes!r} must be an int >= 0")
        self.check_marked()
        self._forget_sizes()
        with self._eviction_lock() as held:
            if not held:
                return 0
            return self._evict(max_bytes)

    @staticmethod
    def _unlink_if_unchanged(entry: _Entry) -> bool:
        try:
            now = os.lstat(entry.path)
            if (now.st_ino, now.st_mtime_ns) != (entry.ino, entry.mtime_ns):
                return False  # used or rewritten since the scan: no longer the least recently used
            os.unlink(entry.path)
        except FileNotFoundError:
            return False
        except OSError as err:  # a read-only disk, say: this record stays, the others are still tried
            logger.warning("plan cache: cannot remove %s (%s)", entry.path, err)
            return False
        return True

    def _eviction_lock(self) -> contextlib.AbstractContextManager[bool]:
        return self._lock(".evict")

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[bool]:
        lock = self._acquire_lock(name)
        try:
            yield lock is not None
        finally:
            if lock is not None:
                lock.release()

    def _acquire_lock(self, name: str) -> NoFollowLock | filelock.BaseFileLock | None:
        # A lock that timed out once (its holder stopped or hung) is only tried, not waited for, until it is
        # acquired again: otherwise every conditional put would wait the whole timeout, every time.
        timeout = 0.0 if name in self._stuck else self._lock_timeout
        if not self._use_soft_lock:
            lock = NoFollowLock(self._root / f"{name}.lock", timeout=timeout)
            try:
                lock.acquire()
                self._stuck.discard(name)
                return lock
            except TimeoutError:  # before OSError: TimeoutError is an OSError
                return self._lock_timed_out(name, lock.lock_file)
            except (NotImplementedError, OSError) as err:
                if isinstance(err, OSError) and err.errno not in _NO_FLOCK:
                    # EACCES, EROFS, ENOSPC...: this attempt fails, the next one tries flock again
                    logger.warning("plan cache: cannot take lock %s (%s); going on without it", name, err)
                    return None
                # No flock here (some network filesystems): an exclusively created lock file still serialises.
                logger.info("plan cache: file locks unsupported under %s (%s); using a soft lock", self._root, err)
                self._use_soft_lock = True
        import filelock  # only writers on a filesystem without flock: a reader never imports it

        lock = filelock.SoftFileLock(os.fspath(self._root / f"{name}.softlock"), timeout=timeout)
        try:
            lock.acquire()
            self._stuck.discard(name)
            return lock
        except filelock.Timeout:  # a TimeoutError
            return self._lock_timed_out(name, lock.lock_file)
        except OSError as err:  # a read-only or full disk: no lock this time
            logger.warning("plan cache: cannot take lock %s (%s); going on without it", name, err)
            return None

    def _lock_timed_out(self, name: str, path: str) -> None:
        what = "eviction skipped" if name == ".evict" else "going on without it"
        if name not in self._stuck:  # one warning per stuck spell, not one per put
            self._stuck.add(name)
            logger.warning("plan cache: lock %s not acquired in %.1f s (its holder may be stopped or hung); %s, "
                           "and it is not waited for again until it is free", path, self._lock_timeout, what)
        return None

    def _scan(self, *, sweep_before: float | None = None) -> tuple[list[_Entry], int]:
        """Every record file, and how many temp files older than `sweep_before` were removed (None: none are,
        and nothing is written). Sweeping, a record or temp file last used in the future (a skewed clock)
        is set to now: it would otherwise never be evicted or swept."""
        entries: list[_Entry] = []
        removed = 0
        for sub in self._fan_out_dirs():
            for item in _scandir(sub.path):
                try:
                    if item.name.endswith(RECORD_SUFFIX):
                        st = item.stat(follow_symlinks=False)
                        mtime_ns = st.st_mtime_ns if sweep_before is None else _not_future(item.path, st)
                        entries.append(_Entry(item.path, st.st_size, mtime_ns, st.st_ino))
                    elif sweep_before is not None and item.name.startswith(TEMP_PREFIX):
                        removed += self._remove_if_stale(item.path, sweep_before)
                except FileNotFoundError:  # evicted, replaced or swept by another process while we looked
                    continue
        return entries, removed

    def _fan_out_dirs(self) -> list[os.DirEntry]:
        """The record directories that may be listed, read and deleted in: real directories named as key
        prefixes that we alone own (or root, in a read-only system tier). A linked or foreign one is skipped
        with a warning, any other name silently; their files are never touched."""
        owners = {"root_may_own": self._read_only}
        reason = _unsafe_dir(self._records, **owners)
        if reason is not None:
            logger.warning("plan cache: %s %s; its records are not used", self._records, reason)
            return []
        out = []
        for sub in _scandir(self._records):
            listed = _FAN_OUT_RE.fullmatch(sub.name) and (sub.is_dir(follow_symlinks=False) or sub.is_symlink())
            unsafe = _unsafe_dir(sub.path, **owners) if listed else "skip"
            if unsafe is None:
                out.append(sub)
            elif unsafe != "skip":
                logger.warning("plan cache: directory %s %s; its files are not used", sub.path, unsafe)
        return out

    @staticmethod
    def _remove_if_stale(path: str, before: float) -> int:
        """Remove a temp file whose writer is gone: a process of this host that no longer exists, or
        (any host) no write for longer than the stale age. mtime, not ctime: a live writer's temp
        keeps a fresh mtime while it writes, so it is never swept."""
        if not _writer_is_dead(os.path.basename(path)) and _not_future(path, os.lstat(path)) >= before * 1e9:
            return 0
        try:
            os.unlink(path)
        except OSError:  # gone already, or a read-only disk: nothing to sweep now
            return 0
        return 1

    # --- maintenance -----------------------------------------------------------------------------------------

    def verify(self) -> dict[str, int]:
        """Check every record, quarantine bad ones, sweep stale temps; counts of what was found."""
        entries, removed = self._scan(sweep_before=time.time() - self._stale_temp_age)
        report = {"ok": 0, "corrupt": 0, "untrusted": 0, "unreadable": 0, "removed_temp": removed}
        for entry in entries:
            path = Path(entry.path)
            key = path.name[:-len(RECORD_SUFFIX)]
            try:
                validate_key(key)
                misplaced = key[:2] != path.parent.name
            except ValueError:
                misplaced = True
            if misplaced:  # no get() can reach it; it only takes space
                self._reject(path, None, "file name does not match its location", status="corrupt")
                report["corrupt"] += 1
                continue
            status = self._load(path, key).status
            if status != "missing":
                report[status] += 1
        self._prune_quarantine()
        return report

    def delete(self, key: str) -> bool:
        """Remove the record under `key`; True if there was one."""
        validate_key(key)
        path = self._record_path(key)
        reason = self._unsafe_parents(path)
        if reason is not None:  # deleting through a linked directory would delete outside the cache
            logger.warning("plan cache: cannot delete %s: %s", path.name, reason)
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as err:
            logger.warning("plan cache: cannot delete %s (%s)", path, err)
            return False
        with self._index_lock:
            if self._index is not None:
                self._index.drop(os.fspath(path))
        return True

    def clear(self) -> int:
        """Remove every record, stale temp file and quarantined file; the number of records removed. Only
        names this store writes are deleted, and only in a root marked a cache (else NotACacheError)."""
        self.check_marked()
        self._forget_sizes()
        entries, _ = self._scan(sweep_before=time.time() - self._stale_temp_age)
        entries = [e for e in entries if _own_record(e.path)]
        removed, failed = 0, None
        for entry in entries:
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as err:  # a read-only disk: report once, remove what can be removed
                failed = failed or err
        if failed is not None:
            logger.warning("plan cache: %d record(s) could not be removed (%s)", len(entries) - removed, failed)
        for item in self._quarantined():
            with contextlib.suppress(OSError):
                os.unlink(item.path)
        return removed

    def keys(self) -> Iterator[str]:
        """The keys of the stored records (a snapshot per directory; other processes may change it)."""
        for sub in self._fan_out_dirs():
            for item in _scandir(sub.path):
                key = item.name[:-len(RECORD_SUFFIX)]
                if item.name.endswith(RECORD_SUFFIX) and key[:2] == sub.name and _is_key(key):
                    yield key

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def stats(self) -> dict[str, Any]:
        """Entries and bytes on disk now, the cap, and this process's counters since the store was opened."""
        entries, _ = self._scan()
        with self._counts_lock:
            counts = dict(self._counts)
        return {"entries": len(entries), "total_bytes": sum(e.size for e in entries), "max_bytes": self._max_bytes,
                **counts}


def temp_name() -> str:
    """A unique name for a temp file of this process: .tmp-<writer id>-<pid>-<hex>."""
    return f"{TEMP_PREFIX}{_writer_id()}-{os.getpid()}-{secrets.token_hex(8)}"


@functools.lru_cache(maxsize=1)
def _writer_id() -> str:
    """Where a writer's pid means something, as temp names carry it: this host's name and, on Linux, a
    digest of this boot and PID namespace (containers of one host name each have their own pids). Asked
    on the first write, so a process that only reads never imports socket."""
    import hashlib
    import socket

    name = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            space = os.readlink("/proc/self/ns/pid").encode() + f.read(64)
    except OSError:  # not Linux, or no /proc: the host name alone, as before
        return name
    return f"{name}.{hashlib.sha256(space).hexdigest()[:12]}"


def _writer_is_dead(name: str) -> bool:
    """Whether the temp file `name` (.tmp-<writer id>-<pid>-<hex>) belongs to a process of this host and
    PID namespace that has exited. Other writer ids (another host, another container of the same host
    name, a name without a namespace), old-style names and any doubt say alive: the age rule sweeps those."""
    parts = name[len(TEMP_PREFIX):].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != _writer_id() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but not ours to signal, or a platform without kill(pid, 0)
        return False
    return False


def _not_future(path: str, st: os.stat_result) -> int:
    """The file's mtime in ns, or now, written to the file, when it lies in the future (a clock that ran
    ahead): last use "now" lets it age from here."""
    now = time.time_ns()
    if st.st_mtime_ns <= now:
        return st.st_mtime_ns
    try:
        os.utime(path, ns=(now, now), follow_symlinks=False)
        return os.lstat(path).st_mtime_ns  # as stored (a coarse clock rounds): eviction compares it
    except OSError:  # gone, or a read-only disk: still counted as used now
        return now


def _read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`, and no more (a file that grew meanwhile is read as checked; a short one
    yields what it has and fails its checksum)."""
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _own_record(path: str) -> bool:
    """Whether `path` is named as this store names records: <fan-out>/<key>.rec, a valid key under its key[:2]."""
    directory, name = os.path.split(path)
    key = name[:-len(RECORD_SUFFIX)]
    return name.endswith(RECORD_SUFFIX) and _is_key(key) and key[:2] == os.path.basename(directory)


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except ValueError:
        return False
    return True
