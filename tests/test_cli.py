"""The console script: --help, --version, env, check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cudnn_graphs import ConvFwdSpec, __version__, signature
from cudnn_graphs.cli import main


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "cudnn-graphs" in out and "check" in out and "env" in out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"cudnn-graphs {__version__}"


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "cudnn_graphs", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and __version__ in done.stdout


def test_env_prints_fingerprint_and_config(capsys, cache_dir):
    assert main(["env"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache_dir"] == str(cache_dir)
    assert set(out["environment"]) >= {"gpu_name", "cudnn_backend_version", "compute_capability"}


def test_env_reports_bad_config(capsys, monkeypatch):
    monkeypatch.setenv("CUDNN_GRAPHS_CACHE_DIR", "")
    monkeypatch.setenv("CUDNN_GRAPHS_POLICY", "fastest")
    assert main(["env"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out["config_errors"]) == {"CUDNN_GRAPHS_CACHE_DIR", "CUDNN_GRAPHS_POLICY"}
    assert out["cache_dir"] is None and "fastest" in captured.err and "CUDNN_GRAPHS_CACHE_DIR" in captured.err


def test_check_reports_each_bad_line_and_keeps_going(tmp_path, capsys):
    good = ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1, bias=True, activation="relu")
    lines = [json.dumps(good.to_dict()), "", "# a comment", "{not json", json.dumps({"schema": 1, "op": "conv_x"}),
             json.dumps(good.replace(stride=2).to_dict())]
    path = tmp_path / "specs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert f"{path}:4: SpecError" in captured.err and "not JSON" in captured.err
    assert f"{path}:5: SpecError" in captured.err and "op='conv_x'" in captured.err
    printed = captured.out.splitlines()
    assert len(printed) == 2 and printed[0].startswith(signature(good)[:16])
    assert printed[1].endswith(f"{path}:6")


def test_check_all_good_exits_zero(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(ConvFwdSpec((1, 4, 5), (4, 4, 3)).to_dict()) + "\n")
    assert main(["check", str(path)]) == 0
    assert main(["check", "--no-graph", str(path)]) == 0


def test_check_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
