"""CPU: the CLI at its edges, as a careless user or a shell meets it. Unbounded inputs (/dev/zero, a 2 GiB
line, a 3 GiB key file) are one line on stderr, not a MemoryError; `--target-env` takes only what
`cudnn-graphs env` prints.

The unbounded cases run in a child under a 1 GiB address-space limit: what reads without bound fails there
fast with a MemoryError (and a traceback) instead of filling this machine's memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

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
