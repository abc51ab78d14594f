"""CPU: `cudnn-graphs cache` as a careless user and an imported bundle meet it: an empty or mistyped path,
a directory that is not a cache, an output that is a FIFO or a device, hostile record meta; `--json`
stays JSON. Also record mode's lock file and `warmup --emit`'s output."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import stat

import pytest

import cudnn_graphs as cg
from cudnn_graphs import recording
from cudnn_graphs.cache.policy import keep_stored
from cudnn_graphs.cli import main
from plan_cache import PlanRecord, PlanStore

from .test_cache_cli import run
from .test_plan_cache_bundle import SPECS, make_record

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX FIFOs, device nodes and modes")


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every other JSON reader does."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def _planted(directory, count=40):
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (directory / f"{i:02d}.dat").write_bytes(b"keep me")
    return sorted(os.listdir(directory))


# --- item 1 and 15: empty, mistyped and foreign paths --------------------------------------------------------

@pytest.mark.parametrize("argv", [["clear", "--yes"], ["prune", "--max-bytes", "0"], ["ls"], ["import", "x.cgb"]])
def test_an_empty_cache_path_is_refused_and_the_working_directory_untouched(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    kept = _planted(tmp_path / "quarantine")
    assert run([*argv, "--cache", ""]) == 2
    err = capsys.readouterr().err
    assert "--cache ''" in err and "empty path" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path / "quarantine")) == kept and sorted(os.listdir(tmp_path)) == ["quarantine"]


@pytest.mark.parametrize("argv", [["clear", "--yes"], ["prune", "--max-bytes", "0"]])
def test_clear_and_prune_refuse_a_directory_that_is_not_a_cache(tmp_path, capsys, argv):
    project = tmp_path / "project"
    kept = _planted(project / "quarantine")
    (project / "setup.py").write_text("")
    assert run([*argv, "--cache", str(project)]) == 2
    err = capsys.readouterr().err
    assert "is not a plan cache" in err and "nothing was deleted" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(project / "quarantine")) == kept and not (project / "v1").exists()


@pytest.mark.parametrize("argv", [["clear", "--yes"], ["prune", "--max-bytes", "1G"]])
def test_clear_and_prune_on_a_mistyped_path_fail_and_create_nothing(tmp_path, capsys, argv):
    typo = tmp_path / "cahce"
    assert run([*argv, "--cache", str(typo)]) == 2
    assert f"no plan cache at {typo}" in capsys.readouterr().err
    assert not typo.exists()


@pytest.mark.parametrize("argv, message", [(["clear", "--yes"], "1 record could not be removed"),
                                           (["prune", "--max-bytes", "0"], "over the target")])
def test_clear_and_prune_that_could_not_remove_everything_exit_1(tmp_path, argv, message):
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    cache = tmp_path / "cache"
    store = PlanStore(cache)
    for spec in SPECS[:2]:
        assert store.put(make_record(spec))
    stuck = str(store.path_of(make_record(SPECS[0]).key).parent)
    assert stuck != str(store.path_of(make_record(SPECS[1]).key).parent)
    script = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" || exit 99; shift; exec "$@"')
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", stuck, sys.executable, "-m", "cudnn_graphs",
                           "cache", *argv, "--cache", str(cache)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if done.returncode == 99:
        pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()[:200]}")
    assert done.returncode == 1, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert sorted(PlanStore(cache).keys()) == [make_record(SPECS[0]).key]  # the other one went


@pytest.mark.parametrize("command", ["ls", "stats", "verify"])
def test_json_on_a_missing_cache_is_still_json(tmp_path, capsys, command):
    missing = tmp_path / "none"
    assert run([command, "--json", "--cache", str(missing)]) == 0
    out = capsys.readouterr()
    data = _strict_json(out.out)
    assert "no plan cache" in out.err and not missing.exists()
    if command == "ls":
        assert data == []
    elif command == "stats":
        assert data["entries"] == 0 and data["cache"] == str(missing) and data["by_op"] == {}
    else:
        assert data["ok"] is True and data["files"]["ok"] == 0 and data["problems"] == []


@pytest.mark.parametrize("argv", [["ls"], ["stats"], ["verify", "--no-load"], ["export", "out.cgb"]])
def test_looking_at_an_existing_root_creates_no_v1(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    assert run([*argv, "--cache", str(cache)]) == 0
    assert os.listdir(cache) == []


# --- item 4: outputs that are not regular files ------------------------------------------------------------------

def _special_files(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo, 0o600)
    out = [fifo]
    try:
        os.mknod(tmp_path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a device node, as /dev/full is
        out.append(tmp_path / "null")
    except PermissionError:  # not root: the FIFO stands for both
        pass
    return out


def test_export_refuses_a_fifo_or_a_device_node(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert PlanStore(cache).put(make_record())
    for target in _special_files(tmp_path):
        kind = os.lstat(target).st_mode
        assert run(["export", str(target), "--cache", str(cache)]) == 2
        err = capsys.readouterr().err
        assert "not a regular file" in err and len(err.strip().splitlines()) == 1
        assert os.lstat(target).st_mode == kind
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_warmup_emit_refuses_a_fifo_or_a_device_node(tmp_path, capsys):
    for target in _special_files(tmp_path):
        kind = os.lstat(target).st_mode
        assert main(["warmup", "--preset", "resnet18", "--batch", "2", "--emit", str(target)]) == 2
        assert "not a regular file" in capsys.readouterr().err
        assert os.lstat(target).st_mode == kind
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".emit-")]


# --- item 12: hostile record meta --------------------------------------------------------------------------------

def _put(cache, record) -> None:
    assert PlanStore(cache).put(record)


def test_a_created_stamp_of_minus_infinity_neither_crashes_nor_breaks_json(tmp_path, capsys):
    cache = tmp_path / "cache"
    record = make_record()
    for created in (-math.inf, math.nan, math.inf):
        _put(cache, PlanRecord(record.key, record.blob, {**record.meta, "created": created}))
        assert run(["ls", "--cache", str(cache)]) == 0
        assert run(["stats", "--cache", str(cache)]) == 0
        capsys.readouterr()
        assert run(["ls", "--json", "--cache", str(cache)]) == 0
        assert _strict_json(capsys.readouterr().out)[0]["created"] is None
        assert run(["stats", "--json", "--cache", str(cache)]) == 0
        assert _strict_json(capsys.readouterr().out)["oldest_created"] is None


def test_record_meta_reaches_the_terminal_escaped(tmp_path, capsys):
    cache = tmp_path / "cache"
    record = make_record()
    meta = {**record.meta, "chosen_by": "\x1b[2J\x1b]0;owned\x07tuned\r"}
    meta["parts"] = [{**meta["parts"][0], "engine": "eng\x1b[31m0"}]
    meta["environment"] = {**meta["environment"], "gpu_name": "H100\x1b[8m\u202e"}
    _put(cache, PlanRecord(record.key, record.blob, meta))
    for command in ("ls", "stats"):
        assert run([command, "--cache", str(cache)]) == 0
        out = capsys.readouterr().out
        assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
    assert run(["ls", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[2J\\x1b]0;owned\\x07tuned\\r" in out and "eng\\x1b[31m0" in out
    assert run(["ls", "--json", "--cache", str(cache)]) == 0  # JSON escapes for itself: the value stays exact
    assert _strict_json(capsys.readouterr().out)[0]["chosen_by"] == meta["chosen_by"]


def test_a_record_naming_an_unknown_plan_rule_is_replaced_by_an_autotuned_one(tmp_path):
    store = PlanStore(tmp_path / "cache")
    stale = make_record()
    stale = PlanRecord(stale.key, b"stale", {**stale.meta, "plan_rules": {"no_such_rule": 7}})
    assert store.put(stale)
    tuned = make_record(chosen_by="autotune", blob=b"tuned")
    assert store.put(tuned, keep_existing=functools.partial(keep_stored, tuned))
    assert store.get(tuned.key).blob == b"tuned"
    heuristic = make_record(blob=b"heuristic")  # the autotuned record still outranks a heuristic one
    assert not store.put(heuristic, keep_existing=functools.partial(keep_stored, heuristic))


# --- item 2: record mode's lock file -----------------------------------------------------------------------------

def test_record_mode_never_follows_a_linked_lock_file(tmp_path, caplog):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "specs.jsonl"
    os.symlink(victim, f"{path}.lock")
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"), cg.record(path):
        recording.note(SPECS[0])
    assert victim.read_text() == "precious" and os.path.islink(f"{path}.lock")
    assert "recording stops" in caplog.text


# --- item 12: `ls` and `stats` of a root-owned system tier, by another user ----------------------------------------

@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="a root-owned tier read by another uid")
def test_ls_and_stats_list_a_root_owned_system_tier_for_another_user():
    import contextlib
    import io
    import shutil

    from .test_plan_cache_hardening import _as_nobody, system_tier

    tier = system_tier(make_record())
    try:
        def look():
            out = {}
            for command in ("ls", "stats"):
                text = io.StringIO()
                with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
                    code = run([command, "--json", "--cache", tier])
                out[command] = [code, json.loads(text.getvalue()) if code == 0 else None]
            return out

        seen = _as_nobody(look)
    finally:
        shutil.rmtree(tier)
    assert seen["ls"][0] == 0 and [row["key"] for row in seen["ls"][1]] == [make_record().key]
    assert seen["stats"][0] == 0 and seen["stats"][1]["entries"] == 1
