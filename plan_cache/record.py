"""Plan records and their self-checking on-disk format.

A record file is a fixed 50-byte header followed by a msgpack payload (all integers little-endian):

    offset  size  field
    0       7     magic             b"CGPLAN\\0"
    7       1     reserved          0
    8       2     format version    uint16, FORMAT_VERSION
    10      8     payload length    uint64, bytes that follow the header
    18      32    checksum          sha256 over header bytes 0..17 and the payload
    50      n     payload           msgpack map {"key": str, "blob": bin, "meta": map, "created": float}

The checksum covers the first 18 header bytes too, so a flipped bit anywhere in the file is detected.
`decode` raises `CorruptRecordError(reason)` for every kind of bad input and never anything else.
No pickle: the payload is plain msgpack, decoded with `raw=False, strict_map_key=True`.
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from .errors import CorruptRecordError

__all__ = ["FORMAT_VERSION", "MAGIC", "HEADER_SIZE", "MAX_META_BYTES", "MAX_RECORD_BYTES", "PlanRecord",
           "DecodedRecord", "encode", "decode", "pack_frame", "validate_key"]

FORMAT_VERSION = 1
MAGIC = b"CGPLAN\0"
MAX_KEY_LENGTH = 200  # leaves room for the ".rec" suffix under the usual 255-byte file-name limit
# A plan record is kilobytes (a runtime-compiled plan with its cubins, ~1 MB): a larger file is garbage,
# rejected from its size alone, never read.
MAX_RECORD_BYTES = 64 << 20
# What a record's payload can hold, as msgpack's limits: `meta` (a spec, an environment, a few parts, a tuning
# table of some hundred candidates) is tens of kilobytes; the blob (runtime-compiled plans are up to ~150 KB)
# is one bin object whatever its size. Decoding builds an object per byte or so (an empty map: one byte, ~70
# bytes of Python objects), so containers are refused above MAX_META_BYTES encoded before any is built.
MAX_META_BYTES = 1 << 20
UNPACK_LIMITS = {"max_str_len": MAX_META_BYTES, "max_bin_len": MAX_RECORD_BYTES, "max_array_len": 1 << 16,
                 "max_map_len": 1 << 12, "max_ext_len": 64}  # an ext: refused by name
# msgpack type bytes of arrays and maps: fixmap, fixarray, array 16/32, map 16/32.
_CONTAINER_TYPES = frozenset(range(0x80, 0xa0)) | {0xdc, 0xdd, 0xde, 0xdf}
_MAX_META_DEPTH = 32

_PREFIX = struct.Struct("<8sHQ")  # magic (7 bytes + a reserved zero byte), format version, payload length
_DIGEST_SIZE = hashlib.sha256().digest_size
HEADER_SIZE = _PREFIX.size + _DIGEST_SIZE
_PAYLOAD_FIELDS = frozenset({"key", "blob", "meta", "created"})
_KEY_RE = re.compile(r"[0-9A-Za-z_-]+")


def validate_key(key: object) -> str:
    """Return `key` if it is a usable record key (it becomes a file name), else raise TypeError/ValueError."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected str, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_LENGTH or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: {key[:80]!r} must be 1-{MAX_KEY_LENGTH} characters of [0-9a-zA-Z_-]")
    return key


def _plain(value: Any, where: str, depth: int) -> Any:
    """A private copy of `value` as plain msgpack data (tuples become lists), or TypeError/ValueError naming `where`."""
    if depth > _MAX_META_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_META_DEPTH} levels")
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise ValueError(f"{where}: integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, str):
        _check_utf8(value, where)
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, msgpack.ExtType):  # a namedtuple: would otherwise pass as a list
        raise TypeError(f"{where}: msgpack extension types are not plain data")
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: key {name!r} is {type(name).__name__}, not str")
            _check_utf8(name, where)
            out[name] = _plain(item, f"{where}[{name!r}]", depth + 1)
        return out
    raise TypeError(f"{where}: {type(value).__name__} is not plain msgpack data (None, bool, int, float, str, "
                    "bytes, list, dict with str keys)")


def _check_utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates cannot be packed
        raise ValueError(f"{where}: string {text[:40]!r} is not valid UTF-8: {err.reason}") from None


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One cached plan: an opaque blob and plain, msgpack-serialisable metadata, stored under `key`.

    `meta` is copied on construction (tuples become lists), so later changes to the caller's dict do not leak in
    and a decoded record compares equal to the one that was stored.
    """

    key: str
    blob: bytes = field(repr=False)
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_key(self.key)
        if not isinstance(self.blob, bytes):
            raise TypeError(f"blob: expected bytes, got {type(self.blob).__name__}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta: expected dict, got {type(self.meta).__name__}")
        object.__setattr__(self, "meta", _plain(self.meta, "meta", 0))

    def __repr__(self) -> str:
        return f"PlanRecord(key={self.key!r}, blob=<{len(self.blob)} bytes>, meta={self.meta!r})"


class DecodedRecord(NamedTuple):
    record: PlanRecord
    created: float  # time.time() of the put that wrote it


def pack_frame(payload: bytes, *, version: int = FORMAT_VERSION, magic: bytes = MAGIC) -> bytes:
    """Header + payload. Public for tests that need a well-framed file with a bad payload or version,
    and for other self-checking files of this package (bundles), which pass their own magic."""
    prefix = _PREFIX.pack(magic, version, len(payload))
    digest = hashlib.sha256(prefix)
    digest.update(payload)
    return b"".join((prefix, digest.digest(), payload))


def encode(record: PlanRecord, *, created: float | None = None) -> bytes:
    """The bytes of a record file for `record`."""
    if not isinstance(record, PlanRecord):
        raise TypeError(f"record: expected PlanRecord, got {type(record).__name__}")
    stamp = time.time() if created is None else float(created)
    payload = msgpack.packb({"key": record.key, "blob": record.blob, "meta": record.meta, "created": stamp},
                            use_bin_type=True)
    return pack_frame(payload)


def decode(data: bytes | bytearray | memoryview, *, expected_key: str | None = None) -> DecodedRecord:
    """Check and decode a record file's bytes; any problem raises CorruptRecordError and nothing else."""
    view = memoryview(data)
    if len(view) == 0:
        raise CorruptRecordError("empty file")
    payload = check_frame(view, magic=MAGIC, version=FORMAT_VERSION, error=CorruptRecordError)
    fields = unpack_fields(payload, _PAYLOAD_FIELDS, error=CorruptRecordError, what="plan record")
    record, created = _record_from_fields(fields)
    if expected_key is not None and record.key != expected_key:
        raise CorruptRecordError(f"stored key {record.key!r} differs from requested key {expected_key!r}")
    return DecodedRecord(record, created)


def check_frame(view: memoryview, *, magic: bytes, version: int, error: type[CorruptRecordError],
                what: str = "cudnn-graphs plan record") -> memoryview:
    """The payload of a framed file after checking magic, version, length and checksum; `error(reason)` if bad."""
    if len(view) < HEADER_SIZE:
        raise error(f"truncated header: {len(view)} of {HEADER_SIZE} bytes")
    found, found_version, length = _PREFIX.unpack_from(view)
    if found.rstrip(b"\0") != magic.rstrip(b"\0"):
        raise error(f"bad magic {bytes(found)!r}: not a {what}")
    if found_version != version:
        raise error(f"format version {found_version}, this code reads {version}")
    if length != len(view) - HEADER_SIZE:
        raise error(f"header says {length} payload bytes, file has {len(view) - HEADER_SIZE}")
    digest = hashlib.sha256(view[:_PREFIX.size])
    digest.update(view[HEADER_SIZE:])
    if digest.digest() != view[_PREFIX.size:HEADER_SIZE]:
        raise error("checksum mismatch")
    return view[HEADER_SIZE:]


def unpack_fields(payload: memoryview, fields: frozenset, *, error: type[CorruptRecordError], what: str) -> dict:
    """A msgpack map with exactly `fields`, plain data only and within UNPACK_LIMITS; `error(reason)` else."""
    def refuse_ext(code: int, data: bytes) -> None:
        raise ValueError(f"msgpack extension type {code} in a {what}")  # plain data only

    _check_container_sizes(payload, error)
    try:
        found = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, ext_hook=refuse_ext,
                                **UNPACK_LIMITS)
    except Exception as err:  # msgpack raises many types (ValueError, ExtraData, StackError, UnicodeDecodeError...)
        raise error(f"payload is not msgpack: {type(err).__name__}: {err}") from None
    if not isinstance(found, dict) or set(found) != fields:
        shown = sorted(found) if isinstance(found, dict) else type(found).__name__
        raise error(f"payload fields are {shown}, expected {sorted(fields)}")
    return found


def _check_container_sizes(payload: memoryview, error: type[CorruptRecordError]) -> None:
    """Before anything is built: each key and value of the payload's top-level map that is an array or a map
    is at most MAX_META_BYTES encoded (skipping builds nothing). Anything else wrong with the payload is
    left to the decode that follows, which names it."""
    unpacker = msgpack.Unpacker(**UNPACK_LIMITS)
    unpacker.feed(payload)
    try:
        count = unpacker.read_map_header()
        for _ in range(2 * count):
            start = unpacker.tell()
            unpacker.skip()
            if payload[start] in _CONTAINER_TYPES and unpacker.tell() - start > MAX_META_BYTES:
                raise error(f"payload holds a container of {unpacker.tell() - start} bytes, over the "
                            f"{MAX_META_BYTES}-byte limit of a record's metadata")
    except error:
        raise
    except Exception:  # not a map, truncated, over a limit: the decode reports it
        return


def _record_from_fields(fields: dict) -> tuple[PlanRecord, float]:
    created = fields["created"]
    if not isinstance(created, float):
        raise CorruptRecordError(f"created is {type(created).__name__}, expected float")
    try:
        return PlanRecord(key=fields["key"], blob=fields["blob"], meta=fields["meta"]), created
    except (TypeError, ValueError) as err:
        raise CorruptRecordError(f"payload holds an invalid record: {err}") from None
