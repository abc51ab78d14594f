"""JSON as people's files hold it: an object that names a key twice is refused, not read as its last value."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """`json.loads` that raises ValueError for an object with a repeated key (an edit gone wrong, which
    json would settle silently by keeping the last value)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {repeated!r} appears twice")
    return out
