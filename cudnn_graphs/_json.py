"""JSON as people's files hold it: an object that names a key twice is refused, not read as its last value,
and a number too long for int() is refused in words a person reads, not Python's."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """`json.loads` that raises ValueError for an object with a repeated key (an edit gone wrong, which
    json would settle silently by keeping the last value)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_integer)


MAX_DIGITS = 4300  # Python's own cap on int() of a string (sys.get_int_max_str_digits' default)


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_DIGITS:  # int() would say "Exceeds the limit ... use sys.set_int_max_str_digits()"
        raise ValueError(f"a number of {digits} digits (no value here is longer than 19)")
    return int(text)


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {repeated!r} appears twice")
    return out
