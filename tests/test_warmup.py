"""CPU: the warmup command's parsing, dry run, spec-file errors, presets, and record mode."""

from __future__ import annotations

import json
import multiprocessing

import pytest

import cudnn_graphs as cg
from cudnn_graphs import config, presets, recording, signature
from cudnn_graphs.cli import main


def test_help_lists_warmup(capsys):
    with pytest.raises(SystemExit):
        main(["warmup", "--help"])
    out = capsys.readouterr().out
    for flag in ("--preset", "--autotune", "--dry-run", "--strict", "--cache", "--device", "--batch", "--layout"):
        assert flag in out


def test_nothing_to_do_is_a_usage_error(capsys):
    assert main(["warmup"]) == 2
    assert "nothing to do" in capsys.readouterr().err


def test_dry_run_of_the_preset_prints_every_spec_with_its_signature(capsys):
    assert main(["warmup", "--preset", "resnet50", "--dry-run", "--batch", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    specs = presets.preset_specs("resnet50", batch=8)
    assert len(lines) == len(specs) == 69
    for line, spec in zip(lines, specs):
        assert line.startswith(signature(spec)[:16]) and spec.op in line


def test_resnet50_preset_is_its_layer_list():
    layers = presets.resnet_layers("resnet50")
    assert len(layers) == 53  # 1 stem + 16 blocks x 3 + 4 projections
    assert sum(layer.residual for layer in layers) == 16 and sum(not layer.relu for layer in layers) == 4
    specs = presets.preset_specs("resnet50", batch=32)
    ops = [s.op for s in specs]
    assert ops.count("conv_fwd") == 24 and ops.count("conv_bwd_data") == 22 and ops.count("conv_bwd_filter") == 23
    stem = specs[0]
    assert stem.x_shape == (32, 3, 224, 224) and stem.w_shape == (64, 3, 7, 7) and stem.stride == (2, 2)
    assert stem.padding == ((3, 3), (3, 3)) and stem.layout == "channels_last" and stem.dtype == "float16"
    projections = [s for s in specs if s.op == "conv_fwd" and s.activation.is_identity]
    assert [(s.x_shape[1], s.w_shape[0], s.stride[0]) for s in projections] == \
        [(64, 256, 1), (256, 512, 2), (512, 1024, 2), (1024, 2048, 2)]
    assert all(s.bias and not s.residual for s in projections)
    assert sum(s.residual for s in specs if s.op == "conv_fwd") == 4  # one expanding 1x1 shape per stage
    assert all(s.bias_grad for s in specs if s.op == "conv_bwd_filter")
    assert all(s.activation_backward.name == "relu" for s in specs if s.op == "conv_bwd_data")
    assert not any(s.op == "conv_bwd_data" and s.dx_shape[1] == 3 for s in specs)  # the image needs no gradient


@pytest.mark.parametrize("name, convs", [("resnet18", 20), ("resnet34", 36), ("resnet101", 104), ("resnet152", 155)])
def test_other_resnets_have_their_conv_counts(name, convs):
    assert len(presets.resnet_layers(name)) == convs


def test_unknown_preset_and_bad_batch():
    with pytest.raises(cg.SpecError, match="preset"):
        presets.preset_specs("vgg")
    with pytest.raises(cg.SpecError, match="batch"):
        presets.preset_specs("resnet50", batch=0)


def _spec_file(tmp_path):
    good = cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1, bias=True, activation="relu")
    lines = [json.dumps(good.to_dict()), "{broken", json.dumps({"schema": 99, "op": "conv_fwd"}),
             json.dumps(good.to_dict()), json.dumps(good.replace(stride=2).to_dict())]
    path = tmp_path / "specs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, good


def test_spec_file_errors_name_file_and_line_and_the_rest_still_runs(tmp_path, capsys):
    path, good = _spec_file(tmp_path)
    assert main(["warmup", str(path), "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert f"{path}:2: SpecError" in captured.err and "not JSON" in captured.err
    assert f"{path}:3: SpecError" in captured.err and "schema" in captured.err
    out = captured.out.splitlines()
    assert len(out) == 2 and out[0].startswith(signature(good)[:16])  # line 4 repeats line 1: planned once
    assert out[0].endswith(f"({path}:1)") and out[1].endswith(f"({path}:5)")


def test_strict_stops_at_the_first_bad_line(tmp_path, capsys):
    path, _ = _spec_file(tmp_path)
    assert main(["warmup", str(path), "--dry-run", "--strict"]) == 1
    captured = capsys.readouterr()
    assert f"{path}:2:" in captured.err and f"{path}:3:" not in captured.err and captured.out == ""


def test_record_mode_writes_each_spec_once(tmp_path):
    path = tmp_path / "rec" / "specs.jsonl"
    a = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    b = a.replace(stride=2)
    with cg.record(path) as recorder:
        recording.note(a)
        recording.note(b)
        recording.note(a)
        assert recorder.note(b) is False
    recording.note(a.replace(groups=2, w_shape=(4, 2, 3, 3)))  # outside the block: not recorded
    with cg.record(path):  # a second run: what the file holds is not appended again
        recording.note(b)
    lines = path.read_text().splitlines()
    assert [cg.spec_from_dict(json.loads(line)) for line in lines] == [a, b]


def test_record_variable_and_warmup_reads_the_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv(config.RECORD, str(path))
    spec = cg.ConvBwdDataSpec((1, 4, 8, 8), (4, 4, 3, 3), (1, 4, 8, 8), padding=1)
    recording.note(spec)
    recording.note(spec)
    assert len(path.read_text().splitlines()) == 1
    monkeypatch.delenv(config.RECORD)
    assert main(["warmup", str(path), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(signature(spec)[:16])


def test_record_variable_naming_a_directory_is_a_config_problem_and_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(config.RECORD, str(tmp_path))
    assert "is a directory" in config.problems()[config.RECORD]  # what `env` and `doctor` report
    for _ in range(3):  # never raised into the job's plan()
        recording.note(cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3)))
    assert caplog.text.count("recording stops for this file") == 1 and config.RECORD in caplog.text


def _record_many(path, n):
    for stride in range(1, n + 1):
        recording.Recorder(path).note(cg.ConvFwdSpec((1, 4, 16, 16), (4, 4, 3, 3), stride=stride))


def test_processes_recording_into_one_file_never_duplicate(tmp_path):
    path = tmp_path / "shared.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(str(path), 6)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == len(set(lines)) == 6


def test_a_recording_that_cannot_write_warns_once_and_never_raises(tmp_path, caplog, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(config.RECORD, str(blocker / "specs.jsonl"))  # its parent is a file: every write fails
    with caplog.at_level("WARNING", logger="cudnn_graphs"):
        recording.note(cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3)))
        recording.note(cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), stride=2))
    assert sum("record mode" in r.getMessage() for r in caplog.records) == 1


def test_devices_are_all_or_distinct_visible_ordinals():
    from cudnn_graphs.cli.warmup import parse_devices

    assert parse_devices("all", count=4) == [0, 1, 2, 3]
    assert parse_devices("ALL", count=2) == [0, 1]
    assert parse_devices("2,0", count=4) == [2, 0]
    for text, message in (("0,0", "twice"), ("4", "no GPU 4"), ("a,b", "ordinals"), ("-1", "no GPU -1")):
        with pytest.raises(ValueError, match=message):
            parse_devices(text, count=4)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        parse_devices("all", count=0)


def test_warmup_devices_without_a_gpu_is_one_clear_message(capsys, monkeypatch):
    from cudnn_graphs.cli import warmup

    monkeypatch.setattr(warmup, "parse_devices", lambda text: [0, 1])
    import sys

    monkeypatch.setattr(sys.modules["cudnn_graphs.environment"], "gpu_problem", lambda device: "no CUDA driver")
    assert main(["warmup", "--preset", "resnet50", "--devices", "all", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA driver" in err and err.count("\n") == 1


def test_specs_spread_over_worker_processes_and_every_outcome_comes_back(tmp_path):
    """The --devices machinery on a CPU: two spawned workers share one queue; with no GPU every spec fails
    (NoGpuError inside the worker), and the parent still gets one outcome per spec, counted per worker."""
    from types import SimpleNamespace

    from cudnn_graphs.cli.warmup import SpecSource
    from cudnn_graphs.cli.warmup_devices import plan_on_devices

    specs = [cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p) for p in range(6)]
    sources = [SpecSource(f"test:{i}", s) for i, s in enumerate(specs)]
    args = SimpleNamespace(cache=str(tmp_path / "cache"), autotune=False, autotune_limit=None, no_progress=True)
    summary = plan_on_devices(sources, args, [0, 1])
    assert sum(summary.counts.values()) == 6 and sum(summary.by_device.values()) == 6
    for device, n in summary.by_device.items():  # where the time went: a worker with results has its timing
        timing = summary.device_timing.get(device)
        assert (timing is None) == (n == 0)
        assert timing is None or 0 <= timing["first_s"] <= timing["last_s"] and timing["busy_s"] >= 0
    if not cg.environment(0).has_gpu:
        assert summary.counts["failed"] == 6 and all("NoGpuError" in m for _, _, m in summary.problems)


def test_a_long_warmup_lets_go_of_the_plans_it_stored(monkeypatch):
    """Plans are kept for the process (destroying one can wait for the GPU); a warm-up over many specs
    releases what it stored every RELEASE_EVERY specs instead of holding them all."""
    from types import SimpleNamespace

    from cudnn_graphs.cli import warmup

    released = []
    fake = SimpleNamespace(counters=lambda: dict.fromkeys(("autotuned", "builds", "rebuilds_from_heuristics"), 0),
                           plan=lambda spec: None, release_plans=lambda: released.append(1))
    monkeypatch.setattr(warmup, "warmup_session", lambda args, device: fake)
    monkeypatch.setattr(warmup, "RELEASE_EVERY", 3)
    sources = [warmup.SpecSource("t", cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=p)) for p in range(7)]
    args = SimpleNamespace(device=0, no_progress=True)
    summary = warmup._plan_all(sources, args)
    assert summary.counts["cached"] == 7 and len(released) == 2


def test_devices_draw_the_largest_convolutions_first():
    """`warmup --devices` queues specs by size, largest first, so no GPU is left timing a large one alone
    at the end while the others idle."""
    from cudnn_graphs import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec
    from cudnn_graphs.cli.warmup_devices import _work

    small = ConvFwdSpec((2, 8, 8, 8), (8, 8, 1, 1))
    large = ConvFwdSpec((2, 64, 32, 32), (64, 64, 3, 3), padding=1)
    dgrad = ConvBwdDataSpec((2, 64, 32, 32), (64, 64, 3, 3), (2, 64, 32, 32), padding=1)
    wgrad = ConvBwdFilterSpec((2, 64, 32, 32), (2, 64, 32, 32), (64, 64, 3, 3), padding=1)
    assert _work(large) == _work(dgrad) == _work(wgrad) > _work(small)


def test_dry_run_lines_name_the_batchnorm_fusions():
    """Specs that differ only in their prologue or statistics print different dry-run lines."""
    from cudnn_graphs.cli.warmup import describe_spec

    plain = cg.ConvFwdSpec((8, 64, 16, 16), (32, 64, 3, 3), padding=1, dtype="float16", layout="NHWC")
    lines = {describe_spec(s) for s in (plain, plain.replace(stats=True), plain.replace(prologue="scale_bias_relu"),
                                         plain.replace(prologue="scale_bias_relu", stats=True))}
    assert len(lines) == 4


def test_the_warmup_modules_import_one_way():
    """warmup and warmup_devices both build on warmup_plan; warmup_devices no longer imports warmup."""
    import ast
    import pathlib

    import cudnn_graphs

    src = pathlib.Path(cudnn_graphs.__file__).parent / "cli" / "warmup_devices.py"
    imported = {node.module for node in ast.walk(ast.parse(src.read_text())) if isinstance(node, ast.ImportFrom)}
    assert "warmup" not in imported and "warmup_plan" in imported
