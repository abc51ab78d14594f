"""Durable whole-file writes: a temp file in the target's directory, fsync, os.replace, fsync of the directory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_BINARY = getattr(os, "O_BINARY", 0)


def write_atomic(path: Path, data: bytes, *, temp: Path, mode: int, extra_flags: int = 0) -> None:
    """Readers of `path` see its old content or all of `data`, never a part; `temp` must be in path's directory."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_BINARY | extra_flags, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)  # data on disk before the name points at it, or a crash can leave an empty file
        finally:
            os.close(fd)
        os.replace(temp, path)  # same directory, hence one filesystem: an atomic rename
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]  # os.write may write less than asked (signals, >2 GiB on Linux)


def fsync_dir(path: Path) -> None:
    """Make a rename durable. Not possible everywhere (Windows, some network filesystems): best effort."""
    flags = getattr(os, "O_DIRECTORY", None)
    if flags is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | flags | O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
