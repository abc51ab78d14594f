"""Bundles: many plan records in one portable, self-checking file, for sharing tuning across identical nodes.

A bundle file is a fixed 50-byte header followed by a msgpack payload (all integers little-endian):

    offset  size  field
    0       8     magic             b"CGBUNDL\\0"
    8       2     format version    uint16, BUNDLE_VERSION
    10      8     payload length    uint64, bytes that follow the header
    18      32    checksum          sha256 over header bytes 0..17 and the payload
    50      n     payload           msgpack map {"format": 1, "created": float, "records": [bin, ...]}

Each entry of "records" is a whole record file as `plan_cache.record.encode` writes it, so every entry checks
itself again on import: a bad outer check refuses the whole bundle before anything is written, a bad entry is
counted and skipped. No pickle: plain msgpack, decoded with `raw=False, strict_map_key=True`, no extension types.
Knows nothing of cuDNN: which records to accept and which stored record to keep are the caller's callbacks.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import msgpack

from . import record as record_mod
from ._files import write_atomic
from .errors import CorruptRecordError
from .store import STALE_TEMP_AGE, TEMP_PREFIX, _writer_is_dead, temp_name
from .record import HEADER_SIZE, PlanRecord, check_frame, decode, encode, validate_key

__all__ = ["BUNDLE_MAGIC", "BUNDLE_VERSION", "HEADER_SIZE", "CorruptBundleError", "ImportReport", "export_bundle", "import_bundle",
           "pack_bundle", "pack_frame", "unpack_bundle"]

BUNDLE_MAGIC = b"CGBUNDL\0"
BUNDLE_VERSION = 1
_PAYLOAD_FIELDS = frozenset({"format", "created", "records"})


# Thousands of plans of ~0.1 MB each: a bundle beyond this is not one, and is refused before it is read.
MAX_BUNDLE_BYTES = 1 << 30
# msgpack's limits for a payload: three short fields, then up to a million records (no record is under a
# kilobyte, so a full bundle holds far fewer), each a bin under the record cap. Nothing else is a container.
_UNPACK_LIMITS = {"max_str_len": 64, "max_bin_len": record_mod.MAX_RECORD_BYTES, "max_array_len": 1 << 20,
                  "max_map_len": len(_PAYLOAD_FIELDS), "max_ext_len": 64}  # an ext: refused by name


class CorruptBundleError(CorruptRecordError):
    """A bundle file failed its own check (magic, version, length, checksum or payload); nothing was imported."""

    def __init__(self, reason: str, path: str | os.PathLike[str] | None = None):
        super().__init__(reason)
        self.path = None if path is None else os.fspath(path)
        where = "" if self.path is None else f" {self.path!r}"
        self.args = (f"corrupt plan bundle{where}: {reason}",)

    def __reduce__(self):
        return (type(self), (self.reason, self.path))


class ImportReport(NamedTuple):
    imported: int = 0
    skipped_rejected: int = 0  # accept(record) said no: for instance, made for another environment
    skipped_kept: int = 0  # keep_existing(new, old) kept the record already stored
    corrupt: int = 0  # entries that failed their own check
    failed: int = 0  # the store could not write them (disk full, over its cap; the store warned)
    unchanged: int = 0  # the very same record was stored already: nothing written


# --- the format ----------------------------------------------------------------------------------------------

def pack_bundle(entries: Iterable[bytes], *, created: float | None = None, version: int = BUNDLE_VERSION) -> bytes:
    """The bytes of a bundle holding `entries` (encoded record files, as `plan_cache.record.encode` makes)."""
    stamp = time.time() if created is None else float(created)
    payload = msgpack.packb({"format": version, "created": stamp, "records": [bytes(e) for e in entries]},
                            use_bin_type=True)
    return pack_frame(payload, version=version)


def pack_frame(payload: bytes, *, version: int = BUNDLE_VERSION) -> bytes:
    """Header + payload, framed as a record file is (`plan_cache.record.pack_frame`) with the bundle's magic."""
    return record_mod.pack_frame(payload, version=version, magic=BUNDLE_MAGIC)


def unpack_bundle(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The encoded records in a bundle's bytes, after the outer check; any problem raises CorruptBundleError.
    The payload is read by the rule `import_bundle` streams it with."""
    payload = check_frame(memoryview(data), magic=BUNDLE_MAGIC, version=BUNDLE_VERSION, error=CorruptBundleError,
                          what="cudnn-graphs plan bundle")
    return list(_payload_entries(io.BytesIO(payload), None))


# --- export --------------------------------------------------------------------------------------------------

def export_bundle(store, path: str | os.PathLike[str], *, keys: Iterable[str] | None = None) -> int:
    """Write the records of `store` (all, or those under `keys`) to a bundle at `path`; how many were written.

    Records are read with `store.get`, so corrupt or untrusted ones are never exported (the store quarantines
    them). A key in `keys` with no readable record raises KeyError before anything is written. The file is
    written atomically: readers see the old file or the whole new one. A `path` that exists and is not a
    regular file (a FIFO, a device) raises NotRegularFileError (an OSError) and is left as it was.
    """
    wanted = None if keys is None else [validate_key(k) for k in keys]
    entries = []
    for key in (store.keys() if wanted is None else wanted):
        record = store.get(key)
        if record is None and wanted is not None:
            raise KeyError(f"no readable record under key {key!r}")
        if record is not None:  # evicted or found corrupt since keys() listed it
            entries.append(encode(record))
    target = Path(os.fspath(path))
    sweep_export_debris(target)
    temp = target.parent / f".{target.name}{temp_name()}"
    # mode: the umask decides, as for any file; a FIFO or device at `path` is refused, never replaced
    write_atomic(target, pack_bundle(entries), temp=temp, mode=0o666, regular_only=True)
    return len(entries)


def sweep_export_debris(target: Path) -> int:
    """Remove the temp files a killed export to `target` left beside it (.NAME.tmp-<writer>-<pid>-<hex>):
    those of a process of this host that is gone, and any without a write for STALE_TEMP_AGE; how many."""
    head = f".{target.name}"
    removed = 0
    for item in _listing(target.parent):
        if not item.name.startswith(head + TEMP_PREFIX):
            continue
        try:
            st = item.stat(follow_symlinks=False)
            stale = st.st_mtime < time.time() - STALE_TEMP_AGE
            if stat.S_ISREG(st.st_mode) and (stale or _writer_is_dead(item.name[len(head):])):
                os.unlink(item.path)
                removed += 1
        except OSError:  # gone meanwhile, or a directory we cannot write: the export itself will say so
            continue
    return removed


def _listing(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory if os.fspath(directory) else ".") as it:
            return list(it)
    except OSError:
        return []


# --- import --------------------------------------------------------------------------------------------------

def import_bundle(store, path: str | os.PathLike[str], *, accept: Callable[[PlanRecord], bool] | None = None,
                  keep_existing: Callable[[PlanRecord, PlanRecord], bool] | None = None) -> ImportReport:
    """Merge the records of the bundle at `path` into `store` (a store, or a function that opens one: it
    is called only once the bundle passed its checks, so a missing or corrupt bundle creates no cache).

    `accept(record)`: False skips the record (counted in `skipped_rejected`). `keep_existing(new, old)`: asked
    about a record already stored under the same key; True keeps the stored one (counted in `skipped_kept`);
    None replaces it. Raises OSError when the file cannot be read and CorruptBundleError when it fails its
    outer check; in both cases nothing is written. An entry that fails its own check is counted in `corrupt`.
    """
    with _open_bundle(path) as file:
        # Streamed, a record at a time: the outer check and the payload's shape are verified in full
        # passes before the first record is written, and memory holds one record, not the bundle.
        _check_stream(file, path)
        for _ in _stream_entries(file, path):
            pass
        store = store() if callable(store) else store
        counts = dict.fromkeys(ImportReport._fields, 0)
        for entry in _stream_entries(file, path):
            counts[_import_one(store, entry, accept, keep_existing)] += 1
    return ImportReport(**counts)


def _open_bundle(path: str | os.PathLike[str]):
    """The bundle file opened for reading, after checking from `fstat` that it is a regular file under the
    cap (a FIFO must not hang an import, nor a huge file be read at all)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptBundleError("not a regular file", path)
        if st.st_size > MAX_BUNDLE_BYTES:
            raise CorruptBundleError(f"{st.st_size} bytes is over the {MAX_BUNDLE_BYTES}-byte bundle cap", path)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_stream(file, path) -> None:
    """The outer check (magic, version, length, checksum) of an open bundle, read in chunks."""
    size = os.fstat(file.fileno()).st_size
    header = file.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE:
        raise CorruptBundleError(f"truncated header: {len(header)} of {HEADER_SIZE} bytes", path)
    found, version, length = record_mod._PREFIX.unpack_from(header)
    if found.rstrip(b"\0") != BUNDLE_MAGIC.rstrip(b"\0"):
        raise CorruptBundleError(f"bad magic {bytes(found)!r}: not a cudnn-graphs plan bundle", path)
    if version != BUNDLE_VERSION:
        raise CorruptBundleError(f"format version {version}, this code reads {BUNDLE_VERSION}", path)
    if length != size - HEADER_SIZE:
        raise CorruptBundleError(f"header says {length} payload bytes, file has {size - HEADER_SIZE}", path)
    digest = hashlib.sha256(header[:record_mod._PREFIX.size])
    while chunk := file.read(1 << 20):
        digest.update(chunk)
    if digest.digest() != header[record_mod._PREFIX.size:HEADER_SIZE]:
        raise CorruptBundleError("checksum mismatch", path)


def _stream_entries(file, path):
    """Each record entry of a checked bundle file's payload, one at a time (see `_payload_entries`)."""
    file.seek(HEADER_SIZE)
    return _payload_entries(file, path)


def _payload_entries(file, path):
    """Each record entry of the payload `file` holds from where it stands, one at a time, with its shape
    verified as it goes: exactly the fields format, created, records; plain msgpack; binary entries under
    the record cap; the whole payload, no more (a truncated records array is refused, not imported in part)."""
    unpacker = msgpack.Unpacker(file, raw=False, strict_map_key=True, ext_hook=_refuse_ext, read_size=1 << 20,
                                **_UNPACK_LIMITS)
    seen = {}
    try:
        try:
            count = unpacker.read_map_header()
        except ValueError:
            unpacker.skip()  # raises for bytes that are not msgpack at all
            raise CorruptBundleError("payload fields: the payload is not a map", path) from None
        for _ in range(count):
            key = _scalar(unpacker, path, "payload fields: a key is not a name")
            if key not in _PAYLOAD_FIELDS or key in seen:
                raise CorruptBundleError(f"payload fields: unexpected {key!r}", path)
            if key != "records":
                seen[key] = _scalar(unpacker, path, "payload fields have the wrong types")
                continue
            seen[key] = True
            yield from _records_array(unpacker, path)
    except msgpack.OutOfData:
        raise CorruptBundleError("payload is truncated", path) from None
    except CorruptBundleError:
        raise
    except Exception as err:  # msgpack's ValueError, FormatError, StackError, ExtraData ...
        raise CorruptBundleError(f"payload is not msgpack of a plan bundle ({type(err).__name__}: {err})",
                                 path) from None
    _check_end(unpacker, path)
    _check_payload_fields(seen, path)


def _records_array(unpacker, path):
    try:
        count = unpacker.read_array_header()
    except ValueError:
        raise CorruptBundleError("payload fields have the wrong types", path) from None
    for _ in range(count):
        entry = _scalar(unpacker, path, "a record entry is not binary data")
        if not isinstance(entry, bytes):
            raise CorruptBundleError("a record entry is not binary data", path)
        yield entry


def _scalar(unpacker, path, reason: str):
    """The next value, refused with `reason` if it is an array or a map: where a bundle holds a number, a name
    or a record, a container of millions of empty maps would be built in full before its type was checked
    (a failed header read consumes nothing)."""
    for read_header in (unpacker.read_array_header, unpacker.read_map_header):
        try:
            read_header()
        except ValueError:
            continue
        raise CorruptBundleError(reason, path)
    return unpacker.unpack()


def _check_end(unpacker, path) -> None:
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        return
    except Exception:  # garbage after the payload's map is data after it too
        pass
    raise CorruptBundleError("data after the payload", path)


def _check_payload_fields(seen: dict, path) -> None:
    if set(seen) != _PAYLOAD_FIELDS:
        raise CorruptBundleError(f"payload fields {sorted(seen)}, expected {sorted(_PAYLOAD_FIELDS)}", path)
    if type(seen["format"]) is not int or seen["format"] != BUNDLE_VERSION:
        raise CorruptBundleError(f"payload format {seen['format']!r}, this code reads {BUNDLE_VERSION}", path)
    if not isinstance(seen["created"], float):
        raise CorruptBundleError("payload fields have the wrong types", path)


def _refuse_ext(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code} in a plan bundle")  # plain data only


def _import_one(store, entry: bytes, accept, keep_existing) -> str:
    """Which `ImportReport` field this entry counts in, after putting it when it belongs."""
    try:
        record = decode(entry).record  # checks the entry's own checksum; PlanRecord validates the key
    except CorruptRecordError:
        return "corrupt"
    if accept is not None and not accept(record):
        return "skipped_rejected"
    stored = store.peek(record.key)
    if stored.status == "ok" and stored.record == record:  # importing a bundle twice writes nothing
        return "unchanged"
    if keep_existing is None:
        return "imported" if store.put(record) else "failed"
    kept = False

    def keep(old: PlanRecord) -> bool:
        nonlocal kept
        kept = bool(keep_existing(record, old))
        return kept

    if store.put(record, keep_existing=keep):
        return "imported"
    return "skipped_kept" if kept else "failed"
