"""A UBJSON writer shaped like nlohmann's `to_ubjson` (smallest integer type, 'D' floats, unsized
containers, keys without a marker): test data for `graph/serialized.py`, which only reads."""

from __future__ import annotations

import struct


def dumps(value) -> bytes:
    if value is None:
        return b"Z"
    if value is True:
        return b"T"
    if value is False:
        return b"F"
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, float):
        return b"D" + struct.pack(">d", value)
    if isinstance(value, str):
        return b"S" + _key(value)
    if isinstance(value, (list, tuple)):
        return b"[" + b"".join(dumps(v) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b"".join(_key(k) + dumps(v) for k, v in value.items()) + b"}"
    raise TypeError(type(value))


def _key(text: str) -> bytes:
    raw = text.encode()
    return _int(len(raw)) + raw


def _int(n: int) -> bytes:
    for marker, fmt, lo, hi in ((b"i", ">b", -128, 127), (b"U", ">B", 0, 255), (b"I", ">h", -2**15, 2**15 - 1),
                                (b"l", ">i", -2**31, 2**31 - 1), (b"L", ">q", -2**63, 2**63 - 1)):
        if lo <= n <= hi:
            return marker + struct.pack(fmt, n)
    return b"H" + _key(str(n))
