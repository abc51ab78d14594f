"""Every environment variable this library reads, read here and nowhere else.

Values are read when asked for (not at import), so a test or a launcher can set them late; a bad
value raises `ConfigError` naming the variable and the value.
"""

from __future__ import annotations

import os
from pathlib import Path

from plan_cache import redact_url

from .errors import ConfigError, shown

CACHE_DIR = "CUDNN_GRAPHS_CACHE_DIR"
MEMORY_CACHE_SIZE = "CUDNN_GRAPHS_MEMORY_CACHE_SIZE"
DISABLE_CACHE = "CUDNN_GRAPHS_DISABLE_CACHE"
CACHE_MAX_BYTES = "CUDNN_GRAPHS_CACHE_MAX_BYTES"
RECORD = "CUDNN_GRAPHS_RECORD"
POLICY = "CUDNN_GRAPHS_POLICY"
SYSTEM_CACHE_DIR = "CUDNN_GRAPHS_SYSTEM_CACHE_DIR"
REMOTE_CACHE = "CUDNN_GRAPHS_REMOTE_CACHE"
REMOTE_KEY = "CUDNN_GRAPHS_REMOTE_KEY"
REMOTE_KEY_FILE = "CUDNN_GRAPHS_REMOTE_KEY_FILE"
REMOTE_TIMEOUT = "CUDNN_GRAPHS_REMOTE_TIMEOUT"
POLICIES = ("heuristic", "autotune")
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
MIN_REMOTE_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 1 << 16  # a secret of some bytes; a key file of gigabytes is a mistake, never read
DEFAULT_REMOTE_TIMEOUT = 0.5

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


def _expanded(name: str, raw: str) -> Path:
    """`raw` with a leading ~ or ~user expanded; ConfigError when that user (or the home directory) is
    unknown, where Path.expanduser raises RuntimeError."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        raise ConfigError(name, raw, "starts with ~ naming a user (or home directory) this system does not know") \
            from None


def cache_dir() -> Path:
    """Root of the on-disk plan cache: $CUDNN_GRAPHS_CACHE_DIR, else the user cache dir."""
    raw = _raw(CACHE_DIR)
    if raw is not None:
        if raw.strip() == "":
            raise ConfigError(CACHE_DIR, raw, "is empty; unset it or name a directory")
        path = _expanded(CACHE_DIR, raw)
        if path.exists() and not path.is_dir():
            raise ConfigError(CACHE_DIR, raw, "exists and is not a directory")
        return path
    import platformdirs

    return Path(platformdirs.user_cache_dir("cudnn-graphs", appauthor=False))


def system_cache_dir() -> Path | None:
    """$CUDNN_GRAPHS_SYSTEM_CACHE_DIR: a read-only plan cache a team shares (consulted after the user's), or None."""
    raw = _raw(SYSTEM_CACHE_DIR)
    if raw is None or raw.strip() == "":
        return None
    path = _expanded(SYSTEM_CACHE_DIR, raw)
    if not path.is_dir():
        raise ConfigError(SYSTEM_CACHE_DIR, raw, "is not an existing directory (fill it with `cudnn-graphs cache "
                          "import FILE --cache DIR` as its owner)")
    return path


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
    try:
        value = parse_bytes(raw)
    except ValueError as err:
        raise ConfigError(CACHE_MAX_BYTES, raw, f"{err} (0 means no cap)") from None
    return value or None


def parse_bytes(text: str) -> int:
    """A byte count such as 4294967296, 512M, 4G or 4GiB (K/M/G/T are powers of 1024); ValueError if not."""
    body = text.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (body[:-1], body[-1]) if body and body[-1] in _UNITS else (body, "")
    try:
        value = int(number, 10) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{shown(text)} is not a byte count such as 4294967296, 512M or 4G") from None
    if value < 0:
        raise ValueError(f"{shown(text)}: must be >= 0")
    return value


def record_path() -> str | None:
    """$CUDNN_GRAPHS_RECORD: a spec file every planned spec is appended to (record mode), or None."""
    raw = _raw(RECORD)
    if raw is None or raw.strip() == "":
        return None
    path = _expanded(RECORD, raw)
    if path.is_dir():
        raise ConfigError(RECORD, raw, "is a directory; name a .jsonl file to append specs to")
    return str(path)


def default_policy() -> str:
    """$CUDNN_GRAPHS_POLICY: how sessions made without a `policy` choose plans (default heuristic)."""
    raw = _raw(POLICY)
    if raw is None or raw.strip() == "":
        return "heuristic"
    if raw.strip().lower() not in POLICIES:
        raise ConfigError(POLICY, raw, f"expected one of {list(POLICIES)}")
    return raw.strip().lower()


def remote_cache_url() -> str | None:
    """$CUDNN_GRAPHS_REMOTE_CACHE: the Redis server sessions share plans through, or None."""
    raw = _raw(REMOTE_CACHE)
    if raw is None or raw.strip() == "":
        return None
    if not raw.strip().startswith(REMOTE_SCHEMES):
        raise ConfigError(REMOTE_CACHE, redact_url(raw), f"expected a URL starting with one of {list(REMOTE_SCHEMES)}, "
                          "e.g. redis://cache-host:6379/0")
    return raw.strip()


def remote_cache_key() -> bytes | None:
    """The secret remote records are signed with: $CUDNN_GRAPHS_REMOTE_KEY, else the contents of
    $CUDNN_GRAPHS_REMOTE_KEY_FILE (a regular file of this user's that no one else may read), else None."""
    raw = _raw(REMOTE_KEY)
    if raw is not None and raw.strip() != "":
        if len(raw.strip().encode()) < MIN_REMOTE_KEY_BYTES:
            raise ConfigError(REMOTE_KEY, "<hidden>", f"is shorter than {MIN_REMOTE_KEY_BYTES} bytes")
        return raw.strip().encode()
    path = _raw(REMOTE_KEY_FILE)
    if path is None or path.strip() == "":
        return None
    return _key_file(_expanded(REMOTE_KEY_FILE, path), path)


def _key_file(path: Path, raw: str) -> bytes:
    import stat

    try:
        st = path.stat()
    except OSError as err:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(REMOTE_KEY_FILE, raw, "is not a regular file")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ConfigError(REMOTE_KEY_FILE, raw, "is owned by another user")
    if st.st_mode & 0o077:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"is readable or writable by others (mode {st.st_mode & 0o777:o}); "
                          "chmod 600 it")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"is {st.st_size} bytes; a key file holds one key, at most "
                          f"{MAX_KEY_FILE_BYTES} bytes")
    key = _read_key(path, raw)
    if len(key) < MIN_REMOTE_KEY_BYTES:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"holds fewer than {MIN_REMOTE_KEY_BYTES} bytes")
    return key


def _read_key(path: Path, raw: str) -> bytes:
    try:
        with open(path, "rb") as f:
            key = f.read(MAX_KEY_FILE_BYTES + 1).strip()  # capped: the file may have grown since the stat
    except OSError as err:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"cannot be read ({err.strerror})") from None
    if len(key) > MAX_KEY_FILE_BYTES:
        raise ConfigError(REMOTE_KEY_FILE, raw, f"holds more than {MAX_KEY_FILE_BYTES} bytes")
    return key


def remote_cache_timeout() -> float:
    """$CUDNN_GRAPHS_REMOTE_TIMEOUT: seconds each remote call may take (default 0.5)."""
    raw = _raw(REMOTE_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_REMOTE_TIMEOUT
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(REMOTE_TIMEOUT, raw, "expected seconds, e.g. 0.5") from None
    if not 0 < value <= 60:
        raise ConfigError(REMOTE_TIMEOUT, raw, "must be > 0 and <= 60 seconds")
    return value


def library_dirs() -> list[str]:
    """$LD_LIBRARY_PATH's directories: searched first for libcudnn, as the cuDNN frontend does, so both
    load the same library. Not ours to validate: the dynamic loader reads it too."""
    return [d for d in (_raw("LD_LIBRARY_PATH") or "").split(os.pathsep) if d]


def problems() -> dict[str, str]:
    """{variable: the error its value gives} for every variable set to a value this library refuses:
    what `cudnn-graphs env` reports before a Session() would raise it."""
    checks = {CACHE_DIR: cache_dir, MEMORY_CACHE_SIZE: memory_cache_size, DISABLE_CACHE: cache_disabled,
              CACHE_MAX_BYTES: cache_max_bytes, RECORD: record_path, POLICY: default_policy,
              SYSTEM_CACHE_DIR: system_cache_dir, REMOTE_CACHE: remote_cache_url, REMOTE_KEY: remote_cache_key,
              REMOTE_TIMEOUT: remote_cache_timeout}
    out = {}
    for name, check in checks.items():
        try:
            check()
        except ConfigError as err:  # under the variable at fault: the key file's, where the key comes from one
            out[err.variable] = str(err)
    return out


def describe() -> dict[str, str | None]:
    """Each variable with its raw value, for `cudnn-graphs env` and bug reports."""
    shown = {name: _raw(name) for name in (CACHE_DIR, MEMORY_CACHE_SIZE, DISABLE_CACHE, CACHE_MAX_BYTES, RECORD,
                                           POLICY, SYSTEM_CACHE_DIR, REMOTE_CACHE, REMOTE_KEY_FILE, REMOTE_TIMEOUT)}
    shown[REMOTE_KEY] = None if _raw(REMOTE_KEY) is None else "<set, hidden>"  # a secret never goes in a report
    shown[REMOTE_CACHE] = None if shown[REMOTE_CACHE] is None else redact_url(shown[REMOTE_CACHE])  # nor a password
    return shown
