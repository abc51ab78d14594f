"""`cudnn-graphs cache ...` on synthetic records in temp dirs: exit codes, output, files. CPU only."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import time

import pytest

from cudnn_graphs.cli import cache as cache_cli
from cudnn_graphs.cli.cache import add_cache_parser, human_bytes, parse_size, run_cache
from cudnn_graphs.environment import Environment
from plan_cache import FORMAT_VERSION, PlanRecord, PlanStore

from .test_plan_cache_bundle import A100, H100, SPECS, make_record

NO_GPU = Environment()
NO_FRONTEND = Environment(gpu_name=H100.gpu_name, compute_capability=(9, 0), sm_count=132)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-graphs")
    add_cache_parser(parser.add_subparsers(dest="command"))
    return run_cache(parser.parse_args(["cache", *argv]))


def record_path(root, key: str):
    return root / f"v{FORMAT_VERSION}" / key[:2] / f"{key}.rec"


def set_last_use(root, key: str, seconds_ago: float) -> None:
    stamp = time.time() - seconds_ago
    os.utime(record_path(root, key), (stamp, stamp))


@pytest.fixture
def on(monkeypatch):
    """on(env): the CLI sees `env` as this machine's environment."""
    def use(env: Environment) -> None:
        monkeypatch.setattr(cache_cli, "environment", lambda device=None, **_: env)
    use(NO_GPU)
    return use


@pytest.fixture
def root(tmp_path, on):
    """A cache of three records of three ops, last used 3 minutes, 2 hours and 5 days ago."""
    root = tmp_path / "cache"
    store = PlanStore(root)
    records = [make_record(SPECS[0]), make_record(SPECS[1], chosen_by="autotune"), make_record(SPECS[2], A100)]
    for record, age in zip(records, (200, 2 * 3600 + 5, 5 * 86400 + 5)):
        assert store.put(record)
        set_last_use(root, record.key, age)
    return root


def keys(root) -> list[str]:
    return sorted(PlanStore(root).keys())


def out_json(capsys):
    return json.loads(capsys.readouterr().out)


# --- ls ------------------------------------------------------------------------------------------------------

def test_ls_table_most_recent_first(root, capsys):
    before = {k: record_path(root, k).stat().st_mtime_ns for k in keys(root)}
    assert run(["ls", "--cache", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KEY", "OP", "DTYPE", "SHAPES", "CHOSEN", "ENGINES", "WORKSPACE", "SIZE",
                                "CREATED", "USED"]
    rows = lines[1:4]
    assert [row.split()[1] for row in rows] == ["conv_fwd", "conv_bwd_data", "conv_bwd_filter"]
    assert rows[0].startswith(make_record(SPECS[0]).key[:16] + "  ")
    assert "x=2x8x9x9 w=4x8x3x3" in rows[0] and "heuristics" in rows[0] and "eng0_k2=1_k3=0" in rows[0]
    assert "float16" in rows[1] and "autotune" in rows[1] and "dy=2x4x9x9" in rows[1]
    assert [row.split()[-1] for row in rows] == ["3m", "2h", "5d"]
    assert "4.0 KiB" in rows[0]
    assert lines[-1].startswith("3 records")
    assert {k: record_path(root, k).stat().st_mtime_ns for k in keys(root)} == before  # ls is not a use


def test_cache_option_before_or_after_the_subcommand(root, capsys):
    assert run(["--cache", str(root), "ls", "--json"]) == 0
    assert len(out_json(capsys)) == 3
    assert run(["ls", "--json", "--cache", str(root)]) == 0
    assert len(out_json(capsys)) == 3


def test_ls_json_and_op_filter(root, capsys):
    assert run(["ls", "--cache", str(root), "--json"]) == 0
    listed = out_json(capsys)
    assert [r["op"] for r in listed] == ["conv_fwd", "conv_bwd_data", "conv_bwd_filter"]
    first = listed[0]
    assert first["key"] == make_record(SPECS[0]).key and len(first["key"]) == 64
    assert first["shapes"] == {"x": [2, 8, 9, 9], "w": [4, 8, 3, 3]}
    assert first["engines"] == ["eng0_k2=1_k3=0"] and first["workspace_bytes"] == 4096
    assert first["size_bytes"] == record_path(root, first["key"]).stat().st_size
    assert first["environment"] == "NVIDIA H100 80GB HBM3, cuDNN 9.19.0" and first["status"] == "ok"
    assert run(["ls", "--cache", str(root), "--json", "--op", "conv_bwd_filter"]) == 0
    assert [r["op"] for r in out_json(capsys)] == ["conv_bwd_filter"]


def test_ls_lists_unreadable_and_odd_records_without_changing_anything(root, capsys):
    store = PlanStore(root)
    odd = [PlanRecord("ab" + "1" * 62, b"", {}),
           PlanRecord("ab" + "2" * 62, b"", {"spec": "nope", "parts": [3, {"engine": 7}], "created": "x",
                                             "environment": [1], "chosen_by": 5}),
           PlanRecord("ab" + "3" * 62, b"", {"spec": {"op": "conv_fwd", "x_shape": ["a"]}, "parts": {}})]
    for record in odd:
        store.put(record)
    garbage = record_path(root, "cd" + "4" * 62)
    garbage.parent.mkdir(mode=0o700)
    garbage.write_bytes(b"not a record")
    assert run(["ls", "--cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert "unreadable" in out and "truncated header" in out and "7 records" in out
    assert garbage.exists() and not (root / "quarantine").exists()  # ls only reads
    assert run(["ls", "--cache", str(root), "--json"]) == 0
    listed = {r["key"][:3]: r for r in out_json(capsys)}
    assert listed["cd4"]["status"] == "unreadable" and listed["cd4"]["op"] is None
    assert listed["ab2"]["engines"] == ["?"] and listed["ab2"]["created"] is None
    assert listed["ab2"]["environment"] == "unknown environment"


def test_ls_empty_cache_and_default_cache_dir(cache_dir, capsys, on):
    assert run(["ls"]) == 0
    assert capsys.readouterr().out.strip() == f"no plan records in {cache_dir}"
    PlanStore(cache_dir).put(make_record())
    assert run(["ls", "--json"]) == 0
    assert len(out_json(capsys)) == 1


def test_untrusted_cache_dir_is_a_usage_error(tmp_path, capsys):
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    assert run(["ls", "--cache", str(root)]) == 2
    assert capsys.readouterr().err.startswith("cudnn-graphs: refusing plan cache directory")


# --- stats ---------------------------------------------------------------------------------------------------

def test_stats(root, capsys):
    assert run(["stats", "--cache", str(root), "--json"]) == 0
    info = out_json(capsys)
    total = sum(record_path(root, k).stat().st_size for k in keys(root))
    assert (info["entries"], info["total_bytes"], info["unreadable"]) == (3, total, 0)
    assert info["by_op"] == {"conv_fwd": 1, "conv_bwd_data": 1, "conv_bwd_filter": 1}
    assert info["by_chosen_by"] == {"heuristics": 2, "autotune": 1}
    assert info["by_environment"] == {"NVIDIA H100 80GB HBM3, cuDNN 9.19.0": 2,
                                      "NVIDIA A100-SXM4-80GB, cuDNN 9.19.0": 1}
    assert info["max_bytes"] == 4 << 30
    assert run(["stats", "--cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert "entries    3" in out and "cap 4.0 GiB" in out and "least recently 5d ago" in out
    assert re.search(r"^heuristics +2$", out, re.M) and re.search(r"^autotune +1$", out, re.M)
    assert re.search(r"^NVIDIA H100 80GB HBM3, cuDNN 9.19.0 +2$", out, re.M)


def test_stats_of_an_empty_cache(tmp_path, capsys):
    PlanStore(tmp_path / "new")
    assert run(["stats", "--cache", str(tmp_path / "new")]) == 0
    assert "oldest -, newest -" in capsys.readouterr().out


@pytest.mark.parametrize("command, code", [("ls", 0), ("stats", 0), ("verify", 0), ("export", 1)])
def test_read_only_commands_never_create_the_cache(tmp_path, capsys, command, code):
    absent = tmp_path / "absent"
    argv = [command, str(tmp_path / "out.cgb")] if command == "export" else [command]
    assert run([*argv, "--cache", str(absent)]) == code
    captured = capsys.readouterr()
    assert not absent.exists() and "no plan cache at" in captured.out + captured.err


def test_importing_a_bundle_twice_writes_nothing_the_second_time(root, tmp_path, capsys):
    bundle = tmp_path / "b.cgb"
    run(["export", str(bundle), "--cache", str(root)])
    dest = tmp_path / "dest"
    assert run(["import", str(bundle), "--cache", str(dest), "--all"]) == 0
    first = capsys.readouterr().out
    assert run(["import", str(bundle), "--cache", str(dest), "--all"]) == 0
    second = capsys.readouterr().out
    assert _count(first, "imported") == 3 and _count(second, "imported") == 0
    assert _count(second, "already stored, unchanged") == 3


# --- verify --------------------------------------------------------------------------------------------------

def test_verify_without_gpu_checks_files_and_specs(root, capsys):
    assert run(["verify", "--cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert "specs only, not loaded" in out and "no problems found" in out


def test_verify_quarantines_a_corrupt_file_and_exits_1(root, capsys):
    key = keys(root)[0]
    path = record_path(root, key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert run(["verify", "--cache", str(root), "--json"]) == 1
    report = out_json(capsys)
    assert report["files"]["corrupt"] == 1 and report["files"]["ok"] == 2 and report["ok"] is False
    assert not path.exists() and len(os.listdir(root / "quarantine")) == 1
    assert run(["verify", "--cache", str(root)]) == 0  # quarantined: the cache is clean now


def test_verify_flags_a_spec_this_version_cannot_read(root, capsys):
    bad = PlanRecord("ee" + "5" * 62, b"", {"spec": {"schema": 1, "op": "conv_x"}})
    PlanStore(root).put(bad)
    assert run(["verify", "--cache", str(root)]) == 1
    out = capsys.readouterr().out
    assert "unusable" in out and bad.key[:16] in out and "1 problem(s) found" in out


def test_verify_load_without_gpu_is_a_usage_error(root, capsys, on):
    assert run(["verify", "--cache", str(root), "--load"]) == 2
    assert "--load needs a GPU" in capsys.readouterr().err
    on(NO_FRONTEND)
    assert run(["verify", "--cache", str(root), "--load"]) == 2
    assert "cuDNN frontend" in capsys.readouterr().err


def test_verify_loads_on_a_gpu(root, capsys, on, monkeypatch):
    on(H100)
    statuses = {make_record(SPECS[0]).key: ("loads", "eng0"), make_record(SPECS[1]).key: ("rebuilt", "knobs")}
    calls = []

    def fake_verify_load(record, *, device=0, sessions=None):
        calls.append((record.key, device, id(sessions)))
        return statuses.get(record.key, ("foreign", "another GPU"))

    monkeypatch.setattr(cache_cli, "verify_load", fake_verify_load)
    assert run(["verify", "--cache", str(root), "--device", "1", "--json"]) == 0  # default: load when a GPU is present
    report = out_json(capsys)
    assert report["load"] is True and report["records"] == {"loads": 1, "rebuilt": 1, "foreign": 1, "unusable": 0}
    assert {c[1] for c in calls} == {1} and len({c[2] for c in calls}) == 1  # one sessions memo for all
    statuses[make_record(SPECS[0]).key] = ("unusable", "does not load")
    assert run(["verify", "--cache", str(root)]) == 1
    out = capsys.readouterr().out
    assert "loaded on GPU 0" in out and "does not load" in out
    calls.clear()
    assert run(["verify", "--cache", str(root), "--no-load"]) == 0
    assert calls == []


def test_verify_survives_a_crashing_load(root, capsys, on, monkeypatch):
    on(H100)

    def boom(record, **_):
        raise RuntimeError("driver fell over")

    monkeypatch.setattr(cache_cli, "verify_load", boom)
    assert run(["verify", "--cache", str(root), "--json"]) == 1
    report = out_json(capsys)
    assert report["records"]["unusable"] == 3 and "driver fell over" in report["problems"][0]["detail"]


# --- prune ---------------------------------------------------------------------------------------------------

def test_prune_evicts_least_recently_used(root, capsys):
    sizes = {k: record_path(root, k).stat().st_size for k in keys(root)}
    newest = make_record(SPECS[0]).key
    assert run(["prune", "--cache", str(root), "--max-bytes", str(sizes[newest])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pruned 2 records: ") and f"-> {human_bytes(sizes[newest])} " in out
    assert keys(root) == [newest]
    assert run(["prune", "--cache", str(root), "--max-bytes", "2K"]) == 0
    assert capsys.readouterr().out.startswith("pruned 0 records")
    assert run(["prune", "--cache", str(root), "--max-bytes", "1K"]) == 0
    assert capsys.readouterr().out.startswith("pruned 1 record: ")
    assert keys(root) == []
    assert run(["prune", "--cache", str(root), "--max-bytes", "0"]) == 0


@pytest.mark.parametrize("text, value", [("500M", 500 << 20), ("1k", 1024), ("2GiB", 2 << 30), ("123", 123),
                                         ("0", 0)])
def test_parse_size_uses_the_config_parser(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12Q", "", "-5", "1.5G"])
def test_prune_rejects_a_bad_size(root, capsys, text):
    with pytest.raises(SystemExit) as exit_:
        run(["prune", "--cache", str(root), "--max-bytes", text])
    assert exit_.value.code == 2 and "--max-bytes" in capsys.readouterr().err
    assert len(keys(root)) == 3


# --- clear ---------------------------------------------------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_clear_with_yes(root, capsys):
    assert run(["clear", "--cache", str(root), "--yes"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 3 records from {root}"
    assert keys(root) == []


def test_clear_refuses_without_yes_when_not_a_tty(root, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert run(["clear", "--cache", str(root)]) == 2
    assert "without --yes" in capsys.readouterr().err
    assert len(keys(root)) == 3


@pytest.mark.parametrize("answer, code, left", [("y\n", 0, 0), ("yes\n", 0, 0), ("n\n", 1, 3), ("\n", 1, 3),
                                                ("", 1, 3)])
def test_clear_asks_on_a_tty(root, capsys, monkeypatch, answer, code, left):
    monkeypatch.setattr("sys.stdin", _Tty(answer))
    assert run(["clear", "--cache", str(root)]) == code
    assert "remove all 3 plan records" in capsys.readouterr().out
    assert len(keys(root)) == left


# --- export / import -----------------------------------------------------------------------------------------

def test_export_and_import_all(root, tmp_path, capsys):
    bundle = tmp_path / "fleet.cgb"
    assert run(["export", str(bundle), "--cache", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"exported 3 records to {bundle}")
    other = tmp_path / "other"
    assert run(["import", str(bundle), "--cache", str(other), "--all"]) == 0
    out = capsys.readouterr().out
    assert _count(out, "imported") == 3 and _count(out, "corrupt entries") == 0
    assert keys(other) == keys(root)


def _count(out: str, label: str) -> int:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return int(line.split()[-1])


def test_import_keeps_only_records_for_this_machine(root, tmp_path, capsys, on):
    bundle = tmp_path / "fleet.cgb"
    assert run(["export", str(bundle), "--cache", str(root)]) == 0
    on(H100)
    other = tmp_path / "other"
    assert run(["import", str(bundle), "--cache", str(other)]) == 0
    out = capsys.readouterr().out
    assert _count(out, "imported") == 2 and _count(out, "skipped: for another environment") == 1
    assert "another GPU" in out and "--all" in out
    assert keys(other) == sorted(make_record(s).key for s in SPECS[:2])


def test_import_without_gpu_says_why_everything_is_foreign(root, tmp_path, capsys):
    bundle = tmp_path / "fleet.cgb"
    run(["export", str(bundle), "--cache", str(root)])
    assert run(["import", str(bundle), "--cache", str(tmp_path / "other")]) == 0
    out = capsys.readouterr().out
    assert _count(out, "imported") == 0 and _count(out, "skipped: for another environment") == 3
    assert "no GPU is visible here" in out and "--all" in out


def test_import_never_replaces_autotuned_with_heuristic(tmp_path, capsys):
    dest, src = tmp_path / "dest", tmp_path / "src"
    tuned = make_record(chosen_by="autotune", blob=b"tuned")
    PlanStore(dest).put(tuned)
    PlanStore(src).put(make_record(chosen_by="heuristics"))
    run(["export", str(tmp_path / "h.cgb"), "--cache", str(src)])
    assert run(["import", str(tmp_path / "h.cgb"), "--cache", str(dest), "--all"]) == 0
    assert _count(capsys.readouterr().out, "skipped: stored record kept") == 1
    assert PlanStore(dest).get(tuned.key) == tuned


def test_export_chosen_keys_by_prefix(root, tmp_path, capsys):
    key = make_record(SPECS[1]).key
    bundle = tmp_path / "one.cgb"
    assert run(["export", str(bundle), "--cache", str(root), "--key", key[:16], "--key", key]) == 0
    assert capsys.readouterr().out.startswith("exported 1 record to")
    run(["import", str(bundle), "--cache", str(tmp_path / "other"), "--all"])
    assert keys(tmp_path / "other") == [key]


@pytest.mark.parametrize("prefix, message", [("zz", "no record key starts with 'zz'"), ("", "ambiguous")])
def test_export_bad_key_is_a_usage_error(root, tmp_path, capsys, prefix, message):
    assert run(["export", str(tmp_path / "x.cgb"), "--cache", str(root), "--key", prefix]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.cgb").exists()


def test_export_to_a_missing_directory_is_a_usage_error(root, tmp_path, capsys):
    assert run(["export", str(tmp_path / "nope" / "x.cgb"), "--cache", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cudnn-graphs: cannot write") and "x.cgb" in err


def test_import_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    assert run(["import", str(tmp_path / "missing.cgb"), "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cudnn-graphs: cannot read") and "missing.cgb" in err


def test_import_of_a_corrupt_bundle_imports_nothing(root, tmp_path, capsys):
    bundle = tmp_path / "fleet.cgb"
    run(["export", str(bundle), "--cache", str(root)])
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 1
    bundle.write_bytes(bytes(data))
    assert run(["import", str(bundle), "--cache", str(tmp_path / "other"), "--all"]) == 1
    err = capsys.readouterr().err
    assert "corrupt plan bundle" in err and "checksum mismatch" in err and "nothing imported" in err
    assert keys(tmp_path / "other") == []


def test_import_with_corrupt_entries_exits_1(tmp_path, capsys):
    from plan_cache.bundle import pack_bundle
    from plan_cache.record import encode

    (tmp_path / "m.cgb").write_bytes(pack_bundle([encode(make_record()), b"junk"]))
    assert run(["import", str(tmp_path / "m.cgb"), "--cache", str(tmp_path / "c"), "--all"]) == 1
    out = capsys.readouterr().out
    assert _count(out, "imported") == 1 and _count(out, "corrupt entries") == 1


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        run([])
    assert exit_.value.code == 2


def test_import_refuses_records_whose_key_is_not_their_own(tmp_path, capsys, on):
    good = make_record(SPECS[0])
    forged = PlanRecord(key=make_record(SPECS[1]).key, blob=good.blob, meta=good.meta)  # SPECS[0]'s plan under 1's key
    src = PlanStore(tmp_path / "src")
    src.put(good)
    src.put(forged)
    run(["export", str(tmp_path / "b.cgb"), "--cache", str(tmp_path / "src")])
    on(H100)
    for extra in ([], ["--all"]):
        dest = tmp_path / f"dest{len(extra)}"
        assert run(["import", str(tmp_path / "b.cgb"), "--cache", str(dest), *extra]) == 0
        assert keys(dest) == [good.key], extra
    assert _count(capsys.readouterr().out, "skipped: for another environment") == 1


def test_import_of_records_made_with_no_gpu_needs_all(tmp_path, capsys):
    src = PlanStore(tmp_path / "src")
    src.put(make_record(SPECS[0], env=Environment()))  # the no-GPU fingerprint, as a machine without one has
    run(["export", str(tmp_path / "b.cgb"), "--cache", str(tmp_path / "src")])
    assert run(["import", str(tmp_path / "b.cgb"), "--cache", str(tmp_path / "d1")]) == 0
    assert keys(tmp_path / "d1") == []
    assert run(["import", str(tmp_path / "b.cgb"), "--cache", str(tmp_path / "d2"), "--all"]) == 0
    assert len(keys(tmp_path / "d2")) == 1
