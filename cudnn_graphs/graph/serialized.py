"""The frontend's serialized plan, read without the frontend: which parts the backend alone can run.

`pygraph.serialize()` writes UBJSON (nlohmann's `to_ubjson`) of an object whose "cudnn_backend_data"
is cuDNN's JSON form of the execution plan and whose other fields say what the frontend adds at
execute time. A plan the backend can run by itself has none of those additions: no workspace
regions the frontend fills, no uid replacements, no frontend workspace, no tensor dumps; its
pass-by-value scalars are ones the caller supplies (our builders' scalars).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

_MAX_DEPTH = 32  # our plans nest 4 deep; a deeper blob is not one of them


class UBJSONError(ValueError):
    """The bytes are not UBJSON as nlohmann writes it."""


@dataclass(frozen=True)
class BackendPlan:
    """What the backend needs to run a serialized plan: its JSON and the uids of its variant pack."""

    plan_json: bytes
    uids: frozenset[int]
    scalar_uids: frozenset[int]  # pass-by-value tensors: host pointers in the variant pack


def backend_plan(blob: bytes) -> BackendPlan | None:
    """The plan in `blob` when the backend can run it without the frontend's execute-time additions,
    else None (the frontend deserializes it). Raises UBJSONError on bytes that are not a serialized plan."""
    doc = loads(blob)
    if not isinstance(doc, dict) or not isinstance(doc.get("cudnn_backend_data"), str):
        raise UBJSONError("no cudnn_backend_data string: not a serialized frontend plan")
    if any(_present(doc.get(field)) for field in ("workspace_modifications", "variant_pack_replacements",
                                                   "tensors_to_dump")):
        return None
    if doc.get("fe_workspace_size") not in (None, 0):
        return None
    uids = doc.get("variant_pack_uids")
    if not isinstance(uids, list) or not uids or not all(isinstance(u, int) for u in uids):
        return None
    scalars = doc.get("pass_by_values") or {}
    if not isinstance(scalars, dict) or not all(k.lstrip("-").isdigit() for k in scalars):
        return None
    return BackendPlan(doc["cudnn_backend_data"].encode(), frozenset(uids), frozenset(int(k) for k in scalars))


def _present(value: Any) -> bool:
    return value not in (None, {}, [], 0, "")


# Big-endian scalar types by UBJSON marker.
_NUMBERS = {b"i": struct.Struct(">b"), b"U": struct.Struct(">B"), b"I": struct.Struct(">h"),
            b"l": struct.Struct(">i"), b"L": struct.Struct(">q"), b"d": struct.Struct(">f"),
            b"D": struct.Struct(">d")}
_CONSTANTS = {b"Z": None, b"T": True, b"F": False}


def loads(data: bytes) -> Any:
    """Decode one UBJSON value (the subset nlohmann writes, optimized containers included)."""
    reader = _Reader(bytes(data))
    value = reader.value(reader.marker(), 0)
    if reader.pos != len(reader.data):
        raise UBJSONError(f"{len(reader.data) - reader.pos} bytes after the value")
    return value


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise UBJSONError(f"truncated at byte {self.pos}")
        out, self.pos = self.data[self.pos:end], end
        return out

    def marker(self) -> bytes:
        m = self.take(1)
        while m == b"N":  # no-op padding
            m = self.take(1)
        return m

    def value(self, m: bytes, depth: int) -> Any:
        if m in _CONSTANTS:
            return _CONSTANTS[m]
        number = _NUMBERS.get(m)
        if number is not None:
            return number.unpack(self.take(number.size))[0]
        if m == b"S":
            return self.string()
        if m == b"C":
            return self.take(1).decode("latin-1")
        if m == b"H":
            return int(self.string())  # nlohmann writes uint64 beyond int64 as a high-precision number
        if depth >= _MAX_DEPTH:
            raise UBJSONError(f"nested deeper than {_MAX_DEPTH}")
        if m == b"[":
            return self.array(depth + 1)
        if m == b"{":
            return self.object(depth + 1)
        raise UBJSONError(f"unknown marker {m!r} at byte {self.pos - 1}")

    def length(self) -> int:
        m = self.marker()
        number = _NUMBERS.get(m)
        if number is None or m in (b"d", b"D"):
            raise UBJSONError(f"length marker {m!r} at byte {self.pos - 1}")
        n = number.unpack(self.take(number.size))[0]
        if n < 0:
            raise UBJSONError(f"negative length at byte {self.pos}")
        return n

    def string(self) -> str:
        try:
            return self.take(self.length()).decode()
        except UnicodeDecodeError as err:
            raise UBJSONError(f"string is not UTF-8: {err}") from None

    def header(self) -> tuple[bytes | None, int | None]:
        """An optimized container's ($type, #count); (None, None) for one closed by its end marker."""
        kind = count = None
        if self.data[self.pos:self.pos + 1] == b"$":
            self.pos += 1
            kind = self.take(1)
        if self.data[self.pos:self.pos + 1] == b"#":
            self.pos += 1
            count = self.length()
        elif kind is not None:
            raise UBJSONError("a typed container without a count")
        return kind, count

    def array(self, depth: int) -> list:
        kind, count = self.header()
        if count is not None:
            if kind is not None and kind in _CONSTANTS:
                return [_CONSTANTS[kind]] * count
            return [self.value(kind or self.marker(), depth) for _ in range(count)]
        out = []
        while (m := self.marker()) != b"]":
            out.append(self.value(m, depth))
        return out

    def object(self, depth: int) -> dict:
        kind, count = self.header()
        out = {}
        if count is not None:
            for _ in range(count):
                key = self.string()
                out[key] = self.value(kind or self.marker(), depth)
            return out
        while self.marker() != b"}":
            self.pos -= 1  # keys carry no marker: that byte began the key's length
            key = self.string()
            out[key] = self.value(self.marker(), depth)
        return out
