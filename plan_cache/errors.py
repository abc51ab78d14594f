"""Typed errors of the plan cache. Each carries the fields a caller needs to act on it."""

from __future__ import annotations

import errno
import os


class CacheError(Exception):
    """Base of every error this package raises on purpose."""


class CorruptRecordError(CacheError, ValueError):
    """Bytes on disk are not a valid record; `reason` says which check failed.

    Used inside the package: the store turns it into a miss, a quarantined file and one warning.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"corrupt plan record: {reason}")


class UntrustedCacheError(CacheError, PermissionError):
    """The cache root (or a directory in it) is owned by another user or writable by group/others.

    Loading a plan loads native code, so such a directory is refused rather than used.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        self.message = (f"refusing plan cache directory {self.path!r}: {reason}. "
                        f"Fix: `chmod 700 {self.path}` if it is yours, or choose another cache directory")
        # errno/strerror/filename set so code that handles PermissionError generically still gets sense out of it.
        super().__init__(errno.EACCES, self.message, self.path)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class NotACacheError(CacheError, ValueError):
    """`clear` or `prune` was pointed at a directory that is not marked as a plan cache (no CACHEDIR.TAG,
    and not the layout this package writes): nothing in it is deleted."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path!r} is not a plan cache ({reason}); nothing was deleted. Name the cache "
                         "directory itself (a plan cache holds a CACHEDIR.TAG written by cudnn-graphs)")


class NotRegularFileError(CacheError, OSError):
    """A file about to be replaced exists and is not a regular file (a FIFO, a device, a directory, a
    link): replacing it would swap a device node or a pipe for a plain file, so it is refused."""

    def __init__(self, path: str | os.PathLike[str], kind: str):
        self.path = os.fspath(path)
        self.kind = kind
        super().__init__(errno.EEXIST, f"{self.path} exists and is {kind}, not a regular file; not replaced",
                         self.path)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (type(self), (self.path, self.kind))
