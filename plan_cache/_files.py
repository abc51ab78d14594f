"""Durable whole-file writes (a temp file in the target's directory, fsync, os.replace, fsync of the
directory), replacing only regular files, and lock files that are never followed through a link."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

from .errors import NotRegularFileError

try:
    import fcntl
except ImportError:  # Windows: no flock; callers fall back to a soft lock
    fcntl = None

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_BINARY = getattr(os, "O_BINARY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def write_atomic(path: Path, data: bytes, *, temp: Path, mode: int, extra_flags: int = 0,
                 regular_only: bool = False) -> None:
    """Readers of `path` see its old content or all of `data`, never a part; `temp` must be in path's directory.
    `regular_only`: refuse (NotRegularFileError) a `path` that exists and is not a regular file."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_BINARY | extra_flags, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)  # data on disk before the name points at it, or a crash can leave an empty file
        finally:
            os.close(fd)
        if regular_only:
            replace_regular(temp, path)
        else:
            os.replace(temp, path)  # same directory, hence one filesystem: an atomic rename
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)


def replace_regular(temp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """`os.replace(temp, path)` unless `path` exists and is not a regular file (NotRegularFileError): a
    user's output file named /dev/full or a FIFO must not be swapped for a plain file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, file_kind(st.st_mode))
    os.replace(temp, path)


def file_kind(mode: int) -> str:
    """'a FIFO', 'a directory' ...: what a file of this st_mode is, for messages."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


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


class NoFollowLock:
    """An exclusive flock(2) on the file `path`, for `with` or acquire()/release().

    The lock file is opened O_NOFOLLOW and never truncated: a symbolic link planted at `path` is refused
    (ELOOP), where filelock 3.13-3.20.0 emptied the link's target (CVE-2025-68146), whatever filelock
    version is installed. acquire() raises TimeoutError when another holder keeps it `timeout` seconds,
    NotImplementedError where there is no flock, and OSError when the file cannot be opened or locked.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float):
        self.lock_file = os.fspath(path)
        self.timeout = timeout
        self._fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None:
            raise NotImplementedError("no fcntl.flock on this platform")
        # O_NONBLOCK: a FIFO planted at the path must not block the open
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0o600)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(self.lock_file, file_kind(mode))
            _flock_within(fd, self.timeout, self.lock_file)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of this open file drops its flock

    def __enter__(self) -> NoFollowLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _flock_within(fd: int, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:  # held by another open file, in this process or another
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"lock {name} still held by another process after {timeout:.1f} s") from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
