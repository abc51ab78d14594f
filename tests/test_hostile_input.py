"""CPU: spec files, spec values and record files written carelessly or with ill intent get typed errors
on the line at fault (never a traceback), and record mode never stops the job it records."""

from __future__ import annotations

import json

import pytest

import cudnn_graphs as cg
from cudnn_graphs import SpecError
from cudnn_graphs.cli import main
from cudnn_graphs.recording import Recorder, read_spec_file

GOOD = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)


@pytest.mark.parametrize("line, reason", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "nested too deep"),
    (('{"schema": 1, "op": "conv_fwd", "x_shape": [1, ' + "9" * 5000 + ', 3, 3]}').encode(), "digits"),
])
def test_spec_file_lines_that_cannot_be_read_are_errors_on_their_line(tmp_path, line, reason):
    path = tmp_path / "specs.jsonl"
    path.write_bytes(line + b"\n" + json.dumps(GOOD.to_dict()).encode() + b"\n")
    rows = list(read_spec_file(str(path)))
    assert rows[0][1] == 1 and rows[0][2] is None and reason in rows[0][3]
    assert rows[1][2] == GOOD.to_dict() and rows[1][3] is None


@pytest.mark.parametrize("line", [
    b"\xff\n",
    b"[" * 5000 + b"]" * 5000,
    json.dumps({**GOOD.to_dict(), "alpha": 1}).replace('"alpha": 1', '"alpha": 1' + "0" * 400).encode(),
    json.dumps({**GOOD.to_dict(), "x_shape": [2 ** 63, 8, 9, 9]}).encode(),
    json.dumps({**GOOD.to_dict(), "padding": [[[[[[[1]]]]]]]}).encode(),
])
def test_check_reports_bad_lines_without_a_traceback(tmp_path, capsys, line):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(line + b"\n")
    assert main(["check", "--no-graph", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:1: SpecError" in err and "Traceback" not in err and len(err) < 2000


@pytest.mark.parametrize("changes, field", [
    (dict(x_shape=(2 ** 63, 8, 9, 9)), "x_shape"), (dict(padding=10 ** 400), "padding"),
    (dict(stride=2 ** 40), "stride"), (dict(dilation=(2 ** 31, 1)), "dilation"),
    (dict(alpha=10 ** 400), "alpha"), (dict(x_shape=(2 ** 30, 2 ** 30, 2 ** 30, 8)), "x_shape"),
])
def test_values_beyond_int64_or_float_range_are_spec_errors(changes, field):
    with pytest.raises(SpecError) as info:
        GOOD.replace(**changes)
    assert info.value.field == field and len(str(info.value)) < 300


def test_a_spec_error_shows_huge_and_deep_values_bounded():
    deep = [1]
    for _ in range(3000):
        deep = [deep]
    for value in (deep, 10 ** 5000, "x" * 100000):
        text = str(SpecError("padding", value, "bad"))
        assert text.startswith("padding=") and len(text) < 300


@pytest.mark.parametrize("schema", [1.0, True, "1", None])
def test_the_schema_is_the_int_one(schema):
    data = {**GOOD.to_dict(), "schema": schema}
    with pytest.raises(SpecError, match="schema"):
        cg.spec_from_dict(data)


def test_a_missing_schema_says_what_to_add():
    data = GOOD.to_dict()
    del data["schema"]
    with pytest.raises(SpecError, match='add "schema": 1'):
        cg.spec_from_dict(data)


def test_record_mode_survives_a_damaged_record_file(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b"[" * 5000 + b"\n" + b"\xff\xfe\n" + json.dumps(GOOD.to_dict()).encode())  # no final newline
    recorder = Recorder(path)
    other = GOOD.replace(padding=2)
    assert recorder.note(other) is True
    assert recorder.note(GOOD) is False  # already there, on the line without a newline
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[-2]) == json.loads(cg.recording.spec_line(other))
    assert json.loads(lines[-3]) == GOOD.to_dict()


def test_record_mode_never_raises_into_the_job(tmp_path, monkeypatch, caplog):
    from cudnn_graphs import recording

    monkeypatch.setattr(recording.Recorder, "note", lambda self, spec: (_ for _ in ()).throw(RecursionError("x")))
    with cg.record(tmp_path / "rec.jsonl"):
        recording.note(GOOD)  # logged, not raised
        recording.note(GOOD)
    assert caplog.text.count("recording stops for this file") == 1


@pytest.mark.parametrize("dtype, compute, says", [("float64", "float32", "float64 data takes float64 compute"),
                                                  ("float16", "float64", "float64 compute needs float64 data")])
def test_compute_dtype_errors_blame_the_right_side(dtype, compute, says):
    with pytest.raises(SpecError, match=says):
        cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1), dtype=dtype, compute_dtype=compute)


def test_a_numpy_array_is_called_a_cpu_buffer():
    np = pytest.importorskip("numpy")
    from cudnn_graphs import BufferMismatchError

    with pytest.raises(BufferMismatchError, match="CPU"):
        cg.conv_fwd(np.ones((1, 2, 3, 3), np.float32), np.ones((2, 2, 1, 1), np.float32))


def test_shapes_written_in_nhwc_order_get_a_hint():
    with pytest.raises(SpecError, match=r"channels-last order, try \(2, 8, 9, 9\)"):
        cg.ConvFwdSpec((2, 9, 9, 8), (4, 8, 3, 3), layout="NHWC")
