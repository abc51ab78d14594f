"""CPU: record mode pointed at something that is not a regular file (a FIFO, /dev/full, a directory) or
at a file with an endless line neither blocks, nor raises into plan(), nor reads without bound: one
warning, and recording into that target stops. Each case runs `Session.plan()` in a child process
with a deadline, as a job would (a hang must fail the test, not hold the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs import recording
from cudnn_graphs.recording import Recorder, spec_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1))

# Two plans with record mode on: whatever plan() does on this machine (NoGpuError on a CPU box, a plan
# on a GPU), it must not be the recorder's doing; the warnings go to stderr.
_JOB = textwrap.dedent("""
    import logging, sys
    import cudnn_graphs as cg
    from cudnn_graphs.errors import ConfigError
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1))
    def plan(s):
        try:
            cg.Session(cache=False).plan(s)
        except ConfigError:
            raise
        except cg.CudnnGraphsError:
            pass
    if sys.argv[1] == "env":
        plan(spec); plan(spec.replace(padding=1))
    else:
        with cg.record(sys.argv[2]):
            plan(spec); plan(spec.replace(padding=1))
    # VmHWM: this process's own peak (ru_maxrss would include the parent's, inherited at fork).
    peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print("job done, peak KiB", peak.split()[1])
""")


def _job(how: str, target: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, config.CACHE_DIR: str(tmp_path / "cache")}
    env.pop(config.RECORD, None)
    if how == "env":
        env[config.RECORD] = target
    return subprocess.run([sys.executable, "-c", _JOB, how, target], env=env, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("how", ["env", "record"])
@pytest.mark.parametrize("kind", ["fifo", "dev_full", "directory"])
def test_record_mode_at_a_target_that_is_not_a_regular_file_warns_once_and_the_job_goes_on(tmp_path, how, kind):
    target = {"fifo": str(tmp_path / "specs.fifo"), "dev_full": "/dev/full", "directory": str(tmp_path)}[kind]
    if kind == "fifo":
        os.mkfifo(target)
    try:
        done = _job(how, target, tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"plan() with record mode at a {kind} did not return within 30 s")
    assert done.returncode == 0 and "job done" in done.stdout, done.stderr[-2000:]
    assert done.stderr.count("recording stops for this file") == 1 and "Traceback" not in done.stderr


def test_an_existing_record_file_with_an_endless_line_is_read_with_a_cap(tmp_path):
    path = tmp_path / "rec.jsonl"
    with open(path, "wb") as f:  # 256 MiB of one line, then a recorded spec: memory holds one capped line
        for _ in range(256):  # in pieces: this test needs no 256 MiB either
            f.write(b"x" * (1 << 20))
        f.write(b"\n" + spec_line(SPEC).encode() + b"\n")
    done = _job("env", str(path), tmp_path)
    assert done.returncode == 0 and "recording stops" not in done.stderr, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 200 << 10  # KiB: the job with the line read whole peaked past 500 MiB
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == spec_line(SPEC).encode()  # seen past the long line: not written again
    assert [json.loads(line) for line in lines[2:] if line] == [json.loads(spec_line(SPEC.replace(padding=1)))]


def test_the_warning_names_an_error_whose_message_is_empty(tmp_path, caplog, monkeypatch):
    def no_memory(self, *args):
        raise MemoryError()

    monkeypatch.setattr(Recorder, "_refresh", no_memory)
    with cg.record(tmp_path / "rec.jsonl"):
        recording.note(SPEC)
    assert "(MemoryError)" in caplog.text and "()" not in caplog.text


def test_a_record_file_grown_by_another_process_is_read_from_where_it_was_left(tmp_path):
    path = tmp_path / "rec.jsonl"
    first, second = Recorder(path), Recorder(path)
    assert first.note(SPEC) and second.note(SPEC.replace(padding=1))
    assert first.note(SPEC.replace(padding=1)) is False and second.note(SPEC) is False
    path.write_text("")  # emptied by hand: what it held is gone, so it is written again once read anew
    assert first.note(SPEC.replace(padding=2)) is True and first.note(SPEC) is True
    assert path.read_text() == spec_line(SPEC.replace(padding=2)) + "\n" + spec_line(SPEC) + "\n"


def test_a_spec_line_over_the_cap_is_one_error_that_ends_the_file(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(spec_line(SPEC).encode() + b"\n" + b"7" * (recording.MAX_LINE_BYTES + 10) + b"\n{}\n")
    rows = list(recording.read_spec_file(str(path)))
    assert [r[1] for r in rows] == [1, 2] and rows[0][3] is None and "longer than" in rows[1][3]
