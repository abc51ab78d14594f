"""CPU: `cudnn-graphs doctor` as a new user meets it. A bad variable fails its line, never the whole report;
a cache root that cannot be created (under a file, in /proc or /sys, through a symlink loop) is a FAIL, not
"the first plan creates it"; and without the `cu12` extra (a real virtual environment of the base interpreter
that links this machine's packages but not the nvidia-cudnn wheel) the missing piece is named as libcudnn, not the
frontend, and `check` says once that it cannot build graphs instead of failing every valid spec."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config
from cudnn_graphs.cli import main
from cudnn_graphs.recording import spec_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = {"GPU", "libcudnn", "frontend", "configuration", "plan cache", "remote cache"}


def _doctor(capsys) -> tuple[int, dict[str, tuple[str, str]], str]:
    code = main(["doctor"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip() in ("ok", "warn", "FAIL")]
    return code, {line[6:20].strip(): (line[:4].strip(), line[21:]) for line in rows}, out


@pytest.mark.parametrize("variable, value", [(config.DISABLE_CACHE, "maybe"), (config.CACHE_MAX_BYTES, "lots")])
def test_a_bad_cache_variable_fails_its_lines_and_the_report_goes_on(capsys, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    code, rows, out = _doctor(capsys)
    assert code == 1 and set(rows) == CHECKS and "problem(s): fix them" in out
    assert rows["configuration"][0] == "FAIL" and variable in rows["configuration"][1]
    assert rows["remote cache"][0] == "ok"
    if variable == config.DISABLE_CACHE:
        assert rows["plan cache"] == ("FAIL", "see configuration")
    else:  # the directory is still checked; only the cap is unknown
        assert rows["plan cache"][0] == "ok" and "cap: see configuration" in rows["plan cache"][1]


def _under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "cache"


def _through_a_loop(tmp_path):
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    return tmp_path / "loop" / "cache"


def _a_loop(tmp_path):
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    return tmp_path / "loop"


@pytest.mark.parametrize("where", [_under_a_file, _through_a_loop, _a_loop, lambda _: "/proc/cudnn-graphs-cache",
                                   lambda _: "/sys/cudnn-graphs-cache"],
                         ids=["under-a-file", "through-a-loop", "a-loop", "proc", "sys"])
def test_a_cache_root_that_cannot_be_created_is_a_fail(capsys, monkeypatch, tmp_path, where):
    root = str(where(tmp_path))
    if root.startswith(("/proc", "/sys")) and not os.path.isdir(os.path.dirname(root)):
        pytest.skip(f"no {os.path.dirname(root)} here")
    monkeypatch.setenv(config.CACHE_DIR, root)
    code, rows, _ = _doctor(capsys)
    status, detail = rows["plan cache"]
    assert code == 1 and status == "FAIL" and root in detail and config.CACHE_DIR in detail, detail
    assert "creates it" not in detail and not os.path.exists(root)


def test_a_cache_root_that_can_be_created_is_ok_and_not_created(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(config.CACHE_DIR, str(tmp_path / "a" / "b"))
    _, rows, _ = _doctor(capsys)
    assert rows["plan cache"][0] == "ok" and "creates it" in rows["plan cache"][1]
    assert os.listdir(tmp_path) == []  # the probe leaves nothing behind


# --- without the cu12 extra ------------------------------------------------------------------------------------

# the cudnn wheels' files: nvidia/<dir> holds libcudnn, where the frontend and this library look for it
HIDDEN_NVIDIA = ("cudnn", "cudnn_jit")
HIDDEN_DIST = ("nvidia_cudnn_cu", "nvidia_cudnn_jit")


def _site_dirs() -> list[str]:
    """This interpreter's site directories, in import order (a venv's, or the system's and the user's)."""
    return [p for p in dict.fromkeys(sys.path) if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def _mirror_without_cudnn(sources: list[str], target: str) -> None:
    """`target` (a site directory) links every entry of `sources` but the cudnn wheels (the first source
    holding a name wins, as on sys.path); the `nvidia` namespace is merged and keeps its other wheels."""
    nvidia = os.path.join(target, "nvidia")
    for source in sources:
        for name in os.listdir(source):
            here, there = os.path.join(source, name), os.path.join(target, name)
            if name.lower().startswith(HIDDEN_DIST) or name == "__pycache__":
                continue
            if name == "nvidia" and os.path.isdir(here):
                os.makedirs(nvidia, exist_ok=True)
                for sub in os.listdir(here):
                    if sub not in HIDDEN_NVIDIA and not os.path.lexists(os.path.join(nvidia, sub)):
                        os.symlink(os.path.join(here, sub), os.path.join(nvidia, sub))
            elif not os.path.lexists(there):
                os.symlink(here, there)


@pytest.fixture(scope="module")
def no_cu12(tmp_path_factory) -> str:
    """A python that has this machine's packages but not the nvidia-cudnn wheel: a venv of the base
    interpreter (a venv made from a venv's python would inherit nothing, or with --system-site-packages
    the base's packages only) whose site directory links every installed package but the cudnn wheels."""
    venv = tmp_path_factory.mktemp("no-cu12")
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    _mirror_without_cudnn(_site_dirs(), site)
    probe = subprocess.run([python, "-c", "import cudnn\nfrom cudnn_graphs.execute import cudnn_backend\n"
                            "try:\n    cudnn_backend.lib()\nexcept Exception:\n    print('no libcudnn')"],
                           env=_env(), capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "no libcudnn":  # e.g. a system libcudnn the loader finds by its soname
        pytest.skip(f"libcudnn loads without the wheel here, or no frontend: {probe.stdout}{probe.stderr[-300:]}")
    return python


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT}


def test_without_the_cu12_extra_doctor_names_libcudnn_not_the_frontend(no_cu12):
    done = subprocess.run([no_cu12, "-m", "cudnn_graphs", "doctor"], env=_env(), capture_output=True, text=True,
                          timeout=120)
    rows = {line[6:20].strip(): line for line in done.stdout.splitlines() if line[:4].strip() in ("ok", "FAIL")}
    assert rows["frontend"].startswith("ok    frontend       nvidia-cudnn-frontend")
    assert rows["libcudnn"].startswith("FAIL") and "cudnn-graphs[cu12]" in rows["libcudnn"]
    assert "`check --no-graph`" in rows["libcudnn"]
    if rows["GPU"].startswith("FAIL"):
        assert "only `check --no-graph` and" in rows["GPU"]


def test_without_the_cu12_extra_check_says_once_that_it_builds_no_graph(no_cu12, tmp_path):
    specs = tmp_path / "s.jsonl"
    specs.write_text("".join(spec_line(cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1), padding=p)) + "\n"
                             for p in range(3)))
    done = subprocess.run([no_cu12, "-m", "cudnn_graphs", "check", str(specs)], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "building graphs needs libcudnn" in done.stderr and "--no-graph" in done.stderr
    done = subprocess.run([no_cu12, "-m", "cudnn_graphs", "check", "--no-graph", str(specs)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "3 ok, 0 failed" in done.stderr
