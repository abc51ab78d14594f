"""Every environment variable this library reads, read here and nowhere else.

Values are read when asked for (not at import), so a test or a launcher can set them late; a bad
value raises `ConfigError` naming the variable and the value.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

CACHE_DIR = "CUDNN_GRAPHS_CACHE_DIR"
MEMORY_CACHE_SIZE = "CUDNN_GRAPHS_MEMORY_CACHE_SIZE"
DISABLE_CACHE = "CUDNN_GRAPHS_DISABLE_CACHE"
CACHE_MAX_BYTES = "CUDNN_GRAPHS_CACHE_MAX_BYTES"

DEFAULT_MEMORY_CACHE_SIZE = 1024
DEFAULT_CACHE_MAX_BYTES = 4 << 30  # runtime-compiled plans are ~0.1 MB: tens of thousands of them
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    return os.environ.get(name)


def _int(name: str, default: int, *, minimum: int) -> int:
    raw = _raw(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(name, raw, "expected an integer") from None
    if value < minimum:
        raise ConfigError(name, raw, f"must be >= {minimum}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(name, raw, f"expected one of {sorted(_TRUE | _FALSE - {''})}")


def cache_dir() -> Path:
    """Root of the on-disk plan cache: $CUDNN_GRAPHS_CACHE_DIR, else the user cache dir."""
    raw = _raw(CACHE_DIR)
    if raw is not None:
        if raw.strip() == "":
            raise ConfigError(CACHE_DIR, raw, "is empty; unset it or name a directory")
        path = Path(raw).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(CACHE_DIR, raw, "exists and is not a directory")
        return path
    import platformdirs

    return Path(platformdirs.user_cache_dir("cudnn-graphs", appauthor=False))


def memory_cache_size() -> int:
    """How many built plans the in-memory LRU in front of the disk keeps (0 disables it)."""
    return _int(MEMORY_CACHE_SIZE, DEFAULT_MEMORY_CACHE_SIZE, minimum=0)


def cache_disabled() -> bool:
    """True when $CUDNN_GRAPHS_DISABLE_CACHE turns the on-disk cache off."""
    return _bool(DISABLE_CACHE, False)


def cache_max_bytes() -> int | None:
    """Size cap of the on-disk cache: bytes, or with a K/M/G/T suffix; 0 means no cap."""
    raw = _raw(CACHE_MAX_BYTES)
    if raw is None or raw.strip() == "":
        return DEFAULT_CACHE_MAX_BYTES
    text = raw.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (text[:-1], text[-1]) if text and text[-1] in _UNITS else (text, "")
    try:
        value = int(number, 10) * _UNITS[unit]
    except ValueError:
        raise ConfigError(CACHE_MAX_BYTES, raw, "expected a byte count such as 4294967296, 512M or 4G") from None
    if value < 0:
        raise ConfigError(CACHE_MAX_BYTES, raw, "must be >= 0 (0 means no cap)")
    return value or None


def describe() -> dict[str, str | None]:
    """Each variable with its raw value, for `cudnn-graphs env` and bug reports."""
    return {name: _raw(name) for name in (CACHE_DIR, MEMORY_CACHE_SIZE, DISABLE_CACHE, CACHE_MAX_BYTES)}
