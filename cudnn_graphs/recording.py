"""Spec files: reading them, and record mode, where every spec the program plans is appended once.

Run a job once under `with cudnn_graphs.record("specs.jsonl"):` (or with $CUDNN_GRAPHS_RECORD set),
then `cudnn-graphs warmup specs.jsonl` fills the cache before every later job. Lines are JSON of
`spec.to_dict()` (versioned by its "schema" field); a spec already in the file is not written again,
also when several processes of one job record into the same file at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Iterator

from plan_cache._files import NoFollowLock

from . import _json, config
from .errors import ConfigError, SpecError

log = logging.getLogger("cudnn_graphs")
_lock = threading.Lock()
_active: list["Recorder"] = []
_from_env: dict[str, "Recorder"] = {}
LOCK_WAIT = 1.0  # seconds a plan() waits for the record file's lock once; a stopped holder costs no more
MAX_PENDING = 4096  # specs kept in memory while the lock is held elsewhere
MAX_LINE_BYTES = 1 << 16  # a spec line is under 1 KB; a longer line is damage, skipped unread


class Recorder:
    """Appends unseen specs to one JSON Lines file; knows what the file already holds."""

    def __init__(self, path: str | os.PathLike[str]):
        try:
            self.path = Path(path).expanduser()
        except RuntimeError:  # ~user of an unknown user: config refuses it for $CUDNN_GRAPHS_RECORD, note() warns
            self.path = Path(path)
        self._seen: set[str] = set()
        self._loaded_size = 0  # bytes of the file already read into _seen
        self.failed = False  # set after a write error: warned once, then skipped
        self._pending: dict[str, None] = {}  # lines not appended yet (the lock was held), in order
        self._stuck = False  # the lock timed out: tried without waiting until acquired again

    def note(self, spec) -> bool:
        """Append `spec` unless the file already has it; True when a line was written. While another
        process holds the file's lock past LOCK_WAIT (stopped, or hung), the spec waits in memory and is
        appended with the next one noted once the lock is free. Raises NotRegularFileError for a target
        that is not a regular file (a FIFO would block, a device read without end), OSError when the file
        cannot be opened or written."""
        line = spec_line(spec)
        if line in self._seen:
            return False
        if len(self._pending) < MAX_PENDING:
            self._pending[line] = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_record_file(self.path)
        try:
            return self._append_pending(fd)
        finally:
            os.close(fd)

    def _append_pending(self, fd: int) -> bool:
        # One lock across processes: read what others appended, then append ours only if still new.
        # NoFollowLock: a symbolic link planted at FILE.lock is refused, never truncated (CVE-2025-68146).
        lock = NoFollowLock(f"{self.path}.lock", timeout=0.0 if self._stuck else LOCK_WAIT)
        try:
            lock.acquire()
        except TimeoutError:  # a stopped holder costs one LOCK_WAIT, then is only tried, never waited for
            if not self._stuck:
                log.warning("record mode: %s is locked by another process for over %.0f s (stopped or hung?); "
                            "specs wait in memory and are appended once it is free", lock.lock_file, LOCK_WAIT)
            self._stuck = True
            return False
        self._stuck = False
        try:
            self._refresh(fd)
            new = [line for line in self._pending if line not in self._seen]
            for line in new:
                _append(fd, line)
                self._seen.add(line)
            self._pending.clear()
            self._loaded_size = os.fstat(fd).st_size
        finally:
            lock.release()
        return bool(new)

    def _refresh(self, fd: int) -> None:
        """Read the lines appended since the last call, a line at a time (never the whole file at once)."""
        size = os.fstat(fd).st_size
        if size == self._loaded_size:
            return
        if size < self._loaded_size:  # truncated or replaced: what it held before may be gone
            self._seen.clear()
            self._loaded_size = 0
        with os.fdopen(os.dup(fd), "rb") as f:
            f.seek(self._loaded_size)
            for raw in _capped_lines(f):
                canonical = None if raw is None else _canonical(raw.decode("utf-8", errors="replace"))
                if canonical is not None:
                    self._seen.add(canonical)
            self._loaded_size = f.tell()

    def stop(self, err: BaseException) -> None:
        """Warn once and record nothing more into this file: recording must never stop the job it records."""
        self.failed = True
        reason = str(err) or type(err).__name__  # a MemoryError's str() is empty
        log.warning("record mode: cannot append to %s (%s); recording stops for this file", self.path, reason)


class NotRegularFileError(OSError):
    """A record target that is not a regular file: a FIFO blocks its reader, /dev/zero never ends."""


def _open_record_file(path: Path) -> int:
    """`path` opened for reading and appending, created if missing; NotRegularFileError unless it is a
    regular file. O_NONBLOCK: opening a FIFO must not wait for a writer before fstat can refuse it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _capped_lines(f) -> Iterator[bytes | None]:
    """The lines of binary file `f` from where it stands, each read with a cap so that memory holds one
    line whatever the file holds: None stands for a line over MAX_LINE_BYTES (no spec is that long),
    whose rest is skipped unread if the caller reads on."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        yield None
        while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
            pass


def _append(fd: int, line: str) -> None:
    """`line` and its newline at the end of the file (after a newline for a last line without one)."""
    data = (_separator(fd) + line + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]
    os.fsync(fd)


def read_spec_file(path: str) -> Iterator[tuple[str, int, dict | None, str | None]]:
    """(file, line number, dict or None, error or None) for every non-blank, non-comment line of a
    spec file ('-' reads standard input); the caller turns each dict into a spec and reports errors.
    A line that is not UTF-8, not JSON, nested too deep, holding an over-long number or a key twice is an
    error on that line, never an exception. A line over MAX_LINE_BYTES is an error that ends the file: past
    it lies no spec file (a binary file, /dev/zero)."""
    stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    with stream:
        for number, raw in enumerate(_capped_lines(stream), 1):
            if raw is None:
                yield path, number, None, f"not a spec file: line longer than {MAX_LINE_BYTES} bytes; " \
                                          "the rest of the file is not read"
                return
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                yield path, number, None, f"not UTF-8: byte {raw[err.start]:#04x} at column {err.start + 1}"
                continue
            if not text or text.startswith("#"):
                continue
            try:
                data = _json.loads(text)
            except json.JSONDecodeError as err:
                yield path, number, None, f"not JSON: {err.msg} at column {err.colno}"
            except RecursionError:
                yield path, number, None, "not a spec: JSON nested too deep"
            except ValueError as err:  # an integer of more than 4300 digits, a key given twice
                yield path, number, None, f"not a spec: {err}"
            else:
                if isinstance(data, dict):
                    yield path, number, data, None
                else:
                    yield path, number, None, f"not a spec: expected a JSON object, got {type(data).__name__}"


def _separator(fd: int) -> str:
    """A newline when the file's last line has none (edited by hand, or a writer killed mid-line):
    the next spec must not be glued to it."""
    end = os.fstat(fd).st_size
    if end == 0:
        return ""
    return "" if os.pread(fd, 1, end - 1) == b"\n" else "\n"


def spec_line(spec) -> str:
    """A spec's line in a spec file: canonical JSON, so equal specs give equal lines."""
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def _canonical(text: str) -> str | None:
    text = text.strip()
    if not text or text.startswith("#"):
        return None
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):  # a damaged line (deep nesting included): warmup reports it
        return None


@contextlib.contextmanager
def record(path: str | os.PathLike[str]) -> Iterator[Recorder]:
    """Within the block, every spec any session plans (memory hits aside) is appended to `path`
    (SpecError for a path starting with ~ of a user this system does not know)."""
    try:
        Path(path).expanduser()
    except RuntimeError:  # refused here, typed: Recorder would make a literal '~nouser' directory
        raise SpecError("path", os.fspath(path), "starts with ~ naming a user this system does not know") from None
    recorder = Recorder(path)
    with _lock:
        _active.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _active.remove(recorder)


def note(spec) -> None:
    """Called by sessions for each spec they plan: hands it to every active recorder."""
    for recorder in [*_active, *_env_recorder()]:
        if recorder.failed:
            continue
        try:
            recorder.note(spec)
        except Exception as err:  # recording must never stop the job it records: this file stops recording
            recorder.stop(err)


def _env_recorder() -> list[Recorder]:
    """The recorder $CUDNN_GRAPHS_RECORD names (none when unset); a value config refuses (a directory)
    gets a recorder that is stopped at once, so it warns once instead of raising from every plan()."""
    problem = None
    try:
        target = config.record_path()
    except ConfigError as err:
        target, problem = err.value, err
    if target is None:
        return []
    with _lock:
        recorder = _from_env.get(target) or _from_env.setdefault(target, Recorder(target))
    if problem is not None and not recorder.failed:
        recorder.stop(problem)
    return [recorder]
