"""CPU: `cudnn-graphs doctor` reports each check with the fix and exits 1 on a problem; `warmup --emit`
writes the specs it would plan as an editable spec file that reads back to the same specs."""

from __future__ import annotations

import os

import pytest

from cudnn_graphs import config, spec_from_dict
from cudnn_graphs.cli import main
from cudnn_graphs.environment import gpu_problem
from cudnn_graphs.recording import read_spec_file


def _doctor(capsys) -> tuple[int, dict[str, str]]:
    code = main(["doctor"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:4].strip() in ("ok", "warn", "FAIL")]
    return code, {line[6:20].strip(): line[:4].strip() for line in lines}


def test_doctor_lists_every_check(capsys, cache_dir):
    code, status = _doctor(capsys)
    assert set(status) == {"GPU", "libcudnn", "frontend", "configuration", "plan cache", "remote cache"}
    assert status["configuration"] == "ok" and status["plan cache"] == "ok" and status["remote cache"] == "ok"
    assert code == (1 if gpu_problem(0) else 0) and (status["GPU"] == "FAIL") == bool(gpu_problem(0))


def test_doctor_says_why_the_remote_cache_is_off(capsys, monkeypatch):
    monkeypatch.setenv(config.REMOTE_CACHE, "redis://127.0.0.1:1/0")
    monkeypatch.delenv(config.REMOTE_KEY, raising=False)
    monkeypatch.delenv(config.REMOTE_KEY_FILE, raising=False)
    main(["doctor"])
    out = capsys.readouterr().out
    assert "remote cache" in out and "no signing key" in out and config.REMOTE_KEY in out


def test_doctor_flags_bad_settings_and_a_cache_others_can_write(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(config.POLICY, "fastest")
    _, status = _doctor(capsys)
    assert status["configuration"] == "FAIL"
    monkeypatch.delenv(config.POLICY)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv(config.CACHE_DIR, str(shared))
    code, status = _doctor(capsys)
    assert status["plan cache"] == "FAIL" and code == 1
    monkeypatch.setenv(config.DISABLE_CACHE, "1")
    _, status = _doctor(capsys)
    assert status["plan cache"] == "warn"


def test_warmup_emit_writes_an_editable_spec_file(tmp_path, capsys):
    out = tmp_path / "resnet50.jsonl"
    assert main(["warmup", "--preset", "resnet50", "--batch", "8", "--emit", str(out)]) == 0
    rows = list(read_spec_file(str(out)))
    specs = [spec_from_dict(data) for _, _, data, error in rows if error is None]
    assert len(specs) == len(rows) == len(set(specs)) > 50 and all(s.x_shape[0] == 8 for s in specs
                                                                    if hasattr(s, "x_shape"))
    assert main(["warmup", str(out), "--emit", str(tmp_path / "again.jsonl")]) == 0
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".emit-")]


@pytest.mark.parametrize("argv", [["doctor", "--help"], ["warmup", "--help"]])
def test_help_mentions_the_new_options(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    text = capsys.readouterr().out
    assert ("--emit" in text) if argv[0] == "warmup" else ("fix" in text)


def test_signatures_for_another_machine_from_its_env_output(tmp_path, capsys, fake_env):
    import json

    import cudnn_graphs as cg

    spec = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    specs = tmp_path / "s.jsonl"
    specs.write_text(json.dumps(spec.to_dict()) + "\n")
    target = tmp_path / "h100.json"
    target.write_text(json.dumps({"environment": fake_env.to_dict(), "config": {}}))
    want = cg.signature(spec, fake_env)[:16]
    assert main(["check", "--no-graph", "--target-env", str(target), str(specs)]) == 0
    assert capsys.readouterr().out.startswith(want)
    assert main(["warmup", "--dry-run", "--target-env", str(target), str(specs)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(want) and "NVIDIA H100" in captured.err
    assert main(["warmup", "--target-env", str(target), str(specs)]) == 2  # plans are built where they run
    target.write_text("[1, 2]")
    assert main(["check", "--no-graph", "--target-env", str(target), str(specs)]) == 2
    assert "not the output of `cudnn-graphs env`" in capsys.readouterr().err


def test_check_and_warmup_speak_json(tmp_path, capsys):
    import json

    import cudnn_graphs as cg

    good = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(good.to_dict()) + "\n{broken\n")
    assert main(["check", "--no-graph", "--json", str(path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["failed"]) == (1, 1) and doc["specs"][0]["signature"] == cg.signature(good)
    assert "not JSON" in doc["specs"][1]["error"] and doc["specs"][1]["line"] == 2
    assert main(["check", "--no-graph", str(path)]) == 1
    assert "checked 2 spec(s): 1 ok, 1 failed" in capsys.readouterr().err
    assert main(["warmup", "--preset", "resnet50", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["specs"]) == 69 and cg.spec_from_dict(doc["specs"][0]["spec"])
