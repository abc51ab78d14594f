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
import sys
import threading
from pathlib import Path
from typing import Iterator

from . import config

log = logging.getLogger("cudnn_graphs")
_lock = threading.Lock()
_active: list["Recorder"] = []
_from_env: dict[str, "Recorder"] = {}


class Recorder:
    """Appends unseen specs to one JSON Lines file; knows what the file already holds."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path).expanduser()
        self._seen: set[str] = set()
        self._loaded_size = -1
        self.failed = False  # set after a write error: warned once, then skipped

    def note(self, spec) -> bool:
        """Append `spec` unless the file already has it; True when a line was written."""
        line = spec_line(spec)
        if line in self._seen:
            return False
        from plan_cache._files import NoFollowLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One lock across processes: read what others appended, then append ours only if still new.
        # NoFollowLock: a symbolic link planted at FILE.lock is refused, never truncated (CVE-2025-68146).
        with NoFollowLock(f"{self.path}.lock", timeout=30):
            self._refresh()
            if line in self._seen:
                return False
            with open(self.path, "a+", encoding="utf-8") as f:
                f.write(_separator(f) + line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._seen.add(line)
            self._loaded_size = self.path.stat().st_size
        return True

    def _refresh(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._loaded_size:
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for text in f:
                canonical = _canonical(text)
                if canonical is not None:
                    self._seen.add(canonical)
        self._loaded_size = size


def read_spec_file(path: str) -> Iterator[tuple[str, int, dict | None, str | None]]:
    """(file, line number, dict or None, error or None) for every non-blank, non-comment line of a
    spec file ('-' reads standard input); the caller turns each dict into a spec and reports errors.
    A line that is not UTF-8, not JSON, nested too deep or holding an over-long number is an error on
    that line, never an exception."""
    stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    with stream:
        for number, raw in enumerate(stream, 1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                yield path, number, None, f"not UTF-8: byte {raw[err.start]:#04x} at column {err.start + 1}"
                continue
            if not text or text.startswith("#"):
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                yield path, number, None, f"not JSON: {err.msg} at column {err.colno}"
            except RecursionError:
                yield path, number, None, "not a spec: JSON nested too deep"
            except ValueError as err:  # e.g. an integer of more than 4300 digits
                yield path, number, None, f"not a spec: {err}"
            else:
                if isinstance(data, dict):
                    yield path, number, data, None
                else:
                    yield path, number, None, f"not a spec: expected a JSON object, got {type(data).__name__}"


def _separator(f) -> str:
    """A newline when the file's last line has none (edited by hand, or a writer killed mid-line):
    the next spec must not be glued to it."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return ""
    f.buffer.seek(end - 1)
    last = f.buffer.read(1)
    f.seek(0, os.SEEK_END)
    return "" if last == b"\n" else "\n"


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
    """Within the block, every spec any session plans (memory hits aside) is appended to `path`."""
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
    recorders = list(_active)
    target = config.record_path()
    if target is not None:
        with _lock:
            recorder = _from_env.get(target) or _from_env.setdefault(target, Recorder(target))
        recorders.append(recorder)
    for recorder in recorders:
        if recorder.failed:
            continue
        try:
            recorder.note(spec)
        except Exception as err:  # recording must never stop the job it records: this file stops recording
            recorder.failed = True
            log.warning("record mode: cannot append to %s (%s); recording stops for this file", recorder.path, err)
