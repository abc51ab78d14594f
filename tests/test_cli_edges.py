"""CPU: the CLI at its edges, as a careless user or a shell meets it. Unbounded inputs (/dev/zero, a 2 GiB
line, a 3 GiB key file) are one line on stderr, not a MemoryError; `| head -1` and Ctrl-C end quietly with
the shell's codes (141, 130); `--emit -` is standard output; an empty spec file is nothing to do, as no file
is; a JSON key given twice is an error; preset options without --preset are refused; dry-run lines tell
every spec apart; `--target-env` takes only what `cudnn-graphs env` prints.

The unbounded cases run in a child under a 1 GiB address-space limit: what reads without bound fails there
fast with a MemoryError (and a traceback) instead of filling this machine's memory."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cli import main
from cudnn_graphs.recording import spec_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def _cli(*argv: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "cudnn_graphs", *argv], env=full_env, capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory, **kwargs)


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "MemoryError" not in stderr, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    return "\n".join(lines)


def _sparse(path, size: int, tail: bytes = b"") -> str:
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: no disk used, read back as zeros
        f.seek(size)
        f.write(tail)
    return str(path)


# --- unbounded reads (item 11) --------------------------------------------------------------------------------

def test_a_spec_file_with_a_2_gib_line_is_one_error_on_that_line(tmp_path):
    path = _sparse(tmp_path / "big.jsonl", 2 << 30, b"\n" + spec_line(SPEC).encode() + b"\n")
    done = _cli("check", "--no-graph", path)
    text = _one_line(done.stderr)
    assert done.returncode == 1 and f"{path}:1: SpecError" in text and "longer than 65536 bytes" in text


def test_dev_zero_as_a_spec_file_is_one_error(tmp_path):
    done = _cli("warmup", "--dry-run", "/dev/zero")
    text = _one_line(done.stderr)
    assert done.returncode == 1 and "/dev/zero:1" in text and "longer than" in text


def test_dev_zero_as_the_target_env_is_one_error():
    done = _cli("warmup", "--dry-run", "--preset", "resnet18", "--target-env", "/dev/zero")
    text = _one_line(done.stderr)
    assert done.returncode == 2 and text.count("\n") == 0 and "--target-env /dev/zero: longer than" in text


def test_a_3_gib_key_file_is_one_config_error(tmp_path):
    key = _sparse(tmp_path / "key", 3 << 30, b"k" * 32)
    os.chmod(key, 0o600)
    done = _cli("env", env={config.REMOTE_KEY_FILE: key})
    text = _one_line(done.stderr)
    assert done.returncode == 1 and config.REMOTE_KEY_FILE in text and "a key file holds one key" in text
    assert config.REMOTE_KEY_FILE in str(json.loads(done.stdout)["config_errors"])


# --- --target-env takes what `env` prints (item 15) ------------------------------------------------------------

@pytest.mark.parametrize("edit, says", [
    (lambda env: {}, "field 'gpu_name' is missing"),
    (lambda env: {"environment": {}}, "field 'gpu_name' is missing"),
    (lambda env: {**env, "sm_count": "132"}, "sm_count='132': expected an integer"),
    (lambda env: {**env, "sm_count": True}, "sm_count=True: expected an integer"),
    (lambda env: {**env, "compute_capability": [9]}, "compute_capability=[9]: expected [major, minor]"),
    (lambda env: {**env, "allow_tf32": "yes"}, "allow_tf32='yes': expected true or false"),
    (lambda env: {**env, "gpu": "H100"}, "gpu='H100': unknown field"),
], ids=["empty", "empty-environment", "str-int", "bool-int", "short-cc", "str-bool", "unknown"])
def test_a_target_env_that_is_not_what_env_prints_is_refused_naming_the_field(tmp_path, capsys, fake_env, edit,
                                                                                says):
    specs = tmp_path / "s.jsonl"
    specs.write_text(spec_line(SPEC) + "\n")
    target = tmp_path / "target.json"
    target.write_text(json.dumps(edit(fake_env.to_dict())))
    for argv in (["warmup", "--dry-run", str(specs)], ["check", "--no-graph", str(specs)]):
        assert main([*argv, "--target-env", str(target)]) == 2
        err = capsys.readouterr().err
        assert says in err and "not the output of `cudnn-graphs env`" in err and err.count("\n") == 1


def test_the_whole_env_output_and_its_environment_object_are_both_accepted(tmp_path, capsys, fake_env):
    target = tmp_path / "target.json"
    for doc in ({"environment": fake_env.to_dict(), "config": {}}, fake_env.to_dict()):
        target.write_text(json.dumps(doc))
        assert main(["warmup", "--dry-run", "--preset", "resnet18", "--target-env", str(target)]) == 0
        assert "NVIDIA H100" in capsys.readouterr().err


# --- dry-run lines tell specs apart (item 15) -----------------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    (cg.ConvBwdDataSpec((1, 4, 4, 4), (4, 4, 3, 3), (1, 4, 7, 7), stride=2, padding=1),
     cg.ConvBwdDataSpec((1, 4, 4, 4), (4, 4, 3, 3), (1, 4, 8, 8), stride=2, padding=1)),
    (cg.ConvBwdFilterSpec((1, 4, 8, 8), (1, 4, 8, 8), (4, 4, 3, 3), padding=1),
     cg.ConvBwdFilterSpec((1, 4, 8, 8), (1, 4, 8, 8), (4, 4, 1, 1), padding=0)),
], ids=["dgrad-x", "wgrad-w"])
def test_dry_run_lines_of_different_specs_differ(tmp_path, capsys, a, b):
    path = tmp_path / "s.jsonl"
    path.write_text(spec_line(a) + "\n" + spec_line(b) + "\n")
    assert main(["warmup", "--dry-run", str(path)]) == 0
    first, second = (line.split("  ", 1)[1].rsplit(" (", 1)[0] for line in capsys.readouterr().out.splitlines())
    assert first != second
    role = "x" if a.op == "conv_bwd_data" else "w"
    assert f" {role}={'x'.join(map(str, getattr(a, f'{role}_shape')))}" in first


# --- a shell's view: pipes and Ctrl-C (item 17) ---------------------------------------------------------------

@pytest.mark.parametrize("argv", [["warmup", "--dry-run", "--preset", "resnet50"], ["check", "--no-graph", "-"]])
def test_a_reader_that_went_away_ends_the_command_quietly_with_141(argv):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen([sys.executable, "-m", "cudnn_graphs", *argv], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the first line is written
    _, err = child.communicate((spec_line(SPEC) + "\n").encode() * 50, timeout=60)
    assert child.returncode == 141 and b"Broken pipe" not in err and b"Traceback" not in err, err[-2000:]


def test_head_1_through_a_shell(tmp_path):
    path = tmp_path / "many.jsonl"  # ~300 KB of dry-run lines: more than a pipe holds, so head's exit is seen
    path.write_text("".join(spec_line(SPEC.replace(x_shape=(n, 8, 9, 9))) + "\n" for n in range(1, 2001)))
    script = (f"{sys.executable} -m cudnn_graphs warmup --dry-run {path} | head -1; "
              "echo \"status ${PIPESTATUS[0]}\" >&2")
    done = subprocess.run(["bash", "-c", script], env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.count("\n") == 1 and "conv_fwd" in done.stdout and done.stderr == "status 141\n"


def test_ctrl_c_is_one_line_and_130():
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen([sys.executable, "-m", "cudnn_graphs", "check", "--no-graph", "-"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        child.stdin.write((spec_line(SPEC) + "\n").encode())
        child.stdin.flush()
        assert child.stdout.readline().split()[1] == b"conv_fwd"  # it checked a line: now waits for the next
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130 and err == b"cudnn-graphs: interrupted\n"


# --- small things a new user meets (item 17) ------------------------------------------------------------------

def test_emit_dash_writes_standard_output_not_a_file_named_dash(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["warmup", "--preset", "resnet18", "--emit", "-"]) == 0
    captured = capsys.readouterr()
    specs = [cg.spec_from_dict(json.loads(line)) for line in captured.out.splitlines()]
    assert len(specs) == 36 and "standard output" in captured.err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"], ids=["empty", "blank", "comment"])
def test_a_spec_file_without_specs_is_nothing_to_do_as_no_file_is(tmp_path, capsys, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    assert main(["check", str(path)]) == 2 and "no specs in" in capsys.readouterr().err
    assert main(["warmup", str(path)]) == 2 and "nothing to do: no specs in" in capsys.readouterr().err
    assert main(["warmup", str(path), "--dry-run"]) == 2
    assert main(["warmup", str(path), "--preset", "resnet18", "--dry-run"]) == 0  # the preset has specs


def test_a_json_key_given_twice_is_an_error_on_its_line(tmp_path, capsys):
    path = tmp_path / "dup.jsonl"
    path.write_text(spec_line(SPEC)[:-1] + ', "padding": 2}\n')
    assert main(["check", "--no-graph", str(path)]) == 1
    assert f"{path}:1: SpecError" in capsys.readouterr().err
    assert main(["warmup", "--dry-run", str(path)]) == 1
    assert "key 'padding' appears twice" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--batch", "8"], ["--dtype", "bf16"], ["--layout", "NCHW"]])
def test_preset_options_without_a_preset_are_a_usage_error(tmp_path, capsys, option):
    path = tmp_path / "s.jsonl"
    path.write_text(spec_line(SPEC) + "\n")
    assert main(["warmup", str(path), "--dry-run", *option]) == 2
    assert f"{option[0]} shape the specs of --preset" in capsys.readouterr().err
