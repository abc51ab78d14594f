"""benchmarks/ and tools/ without a GPU: every module imports and answers --help, none edits sys.path or
reaches into another script's private names, the curated results are where benchmarks/README.md says,
none of it ships in the wheel, and the harness's pure parts (rounds, medians, ratios, metadata) work."""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("benchmarks", "tools")
GPUS = ("h100", "h200")
NOT_CLIS = {"benchmarks.harness"}  # imported by the others, not run


def _modules(folder: str) -> list[str]:
    return sorted(f"{folder}.{p.stem}" for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")


MODULES = [m for folder in FOLDERS for m in _modules(folder)]
BENCHMARKS = [m.split(".")[1] for m in _modules("benchmarks") if m not in NOT_CLIS]


def _path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


# --- every module runs as `python -m` without a GPU -----------------------------------------------------

@pytest.mark.parametrize("module", [m for m in MODULES if m not in NOT_CLIS])
def test_help_runs_without_a_gpu(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    missing = re.search(r"No module named '(torch|cudnn|cupy)'", done.stderr)
    if done.returncode and missing:
        pytest.skip(f"{module} imports {missing.group(1)}, not installed here")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout.lower()


def test_the_harness_imports_without_torch_or_a_gpu():
    """Importing the harness (and so any benchmark) touches neither torch nor CUDA."""
    code = "import sys; import benchmarks.harness; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# --- no sys.path edits, no reaching into another script's privates --------------------------------------

def _script_names() -> set[str]:
    return {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py")}


@pytest.mark.parametrize("module", MODULES)
def test_no_sys_path_edits_nor_private_imports(module):
    path = _path(module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = []
    aliases = set()  # names bound to another module of benchmarks/ or tools/
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            bad.append(f"line {node.lineno}: sys.path")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in _script_names() and top not in FOLDERS:
                    bad.append(f"line {node.lineno}: imports the script {alias.name} as a top-level module")
                if top in FOLDERS and alias.name != module:
                    aliases.add(alias.asname or top)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top in _script_names() and top not in FOLDERS:
                bad.append(f"line {node.lineno}: imports from the script {node.module} as a top-level module")
            if top in FOLDERS:
                for alias in node.names:
                    if alias.name.startswith("_"):
                        bad.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                    if f"{node.module}.{alias.name}" in MODULES:
                        aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and isinstance(node.value, ast.Name) and node.value.id in aliases:
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"


# --- curated results and packaging ----------------------------------------------------------------------

def test_results_are_one_per_benchmark_and_gpu_model():
    results = ROOT / "benchmarks" / "results"
    bad = []
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        rel = path.relative_to(results)
        if len(rel.parts) != 2 or rel.parts[0] not in GPUS or path.stem not in BENCHMARKS \
                or path.suffix not in (".json", ".png"):
            bad.append(f"{rel}: not <gpu>/<benchmark>.json|png")
            continue
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            device = data.get("device") or (data.get("meta") or {}).get("device")
            if device and rel.parts[0].upper() not in device.upper():
                bad.append(f"{rel}: measured on {device}")
    assert not bad, bad


def test_the_benchmarks_readme_names_every_benchmark_and_result():
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    missing = [name for name in BENCHMARKS if f"`{name}`" not in text]
    missing += [str(p.relative_to(ROOT / "benchmarks")) for p in (ROOT / "benchmarks" / "results").rglob("*.json")
                if str(p.relative_to(ROOT / "benchmarks")) not in text]
    assert not missing, f"benchmarks/README.md does not name: {missing}"


def test_the_tools_readme_indexes_every_probe():
    text = (ROOT / "tools" / "README.md").read_text(encoding="utf-8")
    missing = [m.split(".")[1] for m in _modules("tools") if f"`{m.split('.')[1]}`" not in text]
    assert not missing, f"tools/README.md does not index: {missing}"


def test_the_wheel_ships_neither_benchmarks_nor_tools():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]", text)
    assert include, "pyproject.toml names the packages it ships (packages.find include)"
    patterns = re.findall(r'"([^"]+)"', include.group(1))
    shipped = [m for m in ("benchmarks", "benchmarks.harness", "tools", "tools.kernel_resources")
               if any(fnmatch.fnmatchcase(m, p) for p in patterns)]
    assert not shipped, shipped


# --- the harness's pure parts ---------------------------------------------------------------------------

def test_interleaved_alternates_and_keeps_medians():
    order = []
    samples = {"a": [1.0, 5.0, 3.0], "b": [10.0, 30.0, 20.0]}

    def x(fn):
        order.append(("x", fn()))
        return samples[fn()].pop(0)

    def y(fn):  # several samples in one round
        order.append(("y", fn()))
        return [1.0, 2.0] if fn() == "a" else [0.0, 0.0]

    candidates = {"A": lambda: "a", "B": lambda: "b"}
    got = harness.interleaved(candidates, {"x": x, "y": y}, rounds=3)
    assert got == {"x": {"A": 3.0, "B": 20.0}, "y": {"A": 1.5, "B": 0.0}}  # medians of every round's samples
    assert order[:4] == [("x", "a"), ("x", "b"), ("y", "a"), ("y", "b")]  # measure by measure, A then B
    assert order[4:8] == [("x", "b"), ("x", "a"), ("y", "b"), ("y", "a")]  # the next round starts with B
    assert len(order) == 12
    order.clear()
    harness.interleaved(candidates, {"y": y, "z": lambda fn: order.append(("z", fn())) or 0.0}, rounds=1,
                        by="candidate")
    assert order == [("y", "a"), ("z", "a"), ("y", "b"), ("z", "b")]  # candidate by candidate
    order.clear()
    three = {"A": lambda: "a", "B": lambda: "b", "C": lambda: "c"}
    harness.interleaved(three, {"z": lambda fn: order.append(fn()) or 0.0}, rounds=4)
    assert "".join(order) == "abcbcacababc"  # each candidate leads a round in turn
    with pytest.raises(ValueError):
        harness.interleaved(candidates, {"y": y}, rounds=1, by="time")


def test_median_ratio_geomean():
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert math.isnan(harness.median([]))
    assert harness.ratio(10.0, 4.0) == 2.5
    assert math.isnan(harness.ratio(10.0, 0.0)) and math.isnan(harness.ratio(float("nan"), 1.0))
    assert harness.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert harness.geomean(x for x in (2.0, 8.0)) == pytest.approx(4.0)
    assert math.isnan(harness.geomean([]))


def test_metadata_and_json_shape(tmp_path):
    meta = harness.metadata()
    for key in (*harness.PROVENANCE, "device_count", "cuda", "cupy", "python", "source_sha256", "commit_from"):
        assert key in meta, key
    json.dumps(meta)  # serialisable as it is
    assert meta["argv"][0] == sys.executable and meta["cudnn_graphs"]  # the library's version, installed or not
    assert len(meta["source_sha256"]) == 64
    if (ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]) and isinstance(meta["dirty"], bool)
    path = harness.write_json(tmp_path / "sub" / "r.json", {"device": "X", "rows": [1, 2], "odd": Path("p")})
    data = json.loads(path.read_text())
    assert list(data)[0] == "meta" and data["rows"] == [1, 2] and data["device"] == "X" and data["odd"] == "p"
    assert harness.title(data, "what").startswith("what: X, torch ")


def test_the_revision_comes_from_git_else_from_the_callers_variables(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "_git", lambda *args: None)  # a copy of the tree without .git (a GPU host)
    monkeypatch.delenv(harness.COMMIT_VARIABLE, raising=False)
    assert harness.revision()["commit"] is None and harness.revision()["commit_from"] is None
    monkeypatch.setenv(harness.COMMIT_VARIABLE, "abc1234")
    monkeypatch.setenv(harness.DIRTY_VARIABLE, "0")
    got = harness.revision()
    assert (got["commit"], got["dirty"], got["commit_from"]) == ("abc1234", False, "environment")
    monkeypatch.setenv(harness.DIRTY_VARIABLE, "1")
    assert harness.revision()["dirty"] is True
    # the source digest follows the code, not the results
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "cudnn_graphs").mkdir()
    (tmp_path / "cudnn_graphs" / "a.py").write_text("x = 1")
    before = harness.source_digest(tmp_path)
    (tmp_path / "benchmarks" / "results" / "r.py").write_text("not code")
    assert harness.source_digest(tmp_path) == before
    (tmp_path / "cudnn_graphs" / "a.py").write_text("x = 2")
    assert harness.source_digest(tmp_path) != before


def _results_files() -> list[Path]:
    return sorted((ROOT / "benchmarks" / "results").rglob("*.json"))


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(ROOT / "benchmarks" / "results")))
def test_every_results_file_says_what_it_measured_or_why_not(path):
    """A results file carries its provenance (one run of one command: argv one command line), or, stored
    before that was recorded, a "legacy" entry saying what it lacks (benchmarks/README.md, "Results")."""
    data = json.loads(path.read_text())
    if "legacy" in data:
        assert isinstance(data["legacy"], str) and len(data["legacy"]) > 20, "legacy: say what is missing"
        return
    meta = data.get("meta") or {}
    missing = [key for key in harness.PROVENANCE if meta.get(key) is None and key != "dirty"]
    assert not missing, f"no {missing} in meta, and not marked legacy"
    assert isinstance(meta["dirty"], bool), "meta.dirty: whether the tree differed from the commit"
    assert all(isinstance(a, str) for a in meta["argv"]), "meta.argv: one command line (no merged runs)"


def test_fresh_env(monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("CUDNN_GRAPHS_X", "1")
    env = harness.fresh_env("/tmp/pyc", drop_prefix="CUDNN_GRAPHS_", A=1)
    assert env["PYTHONPYCACHEPREFIX"] == "/tmp/pyc" and env["A"] == "1"
    assert "PYTHONDONTWRITEBYTECODE" not in env and "CUDNN_GRAPHS_X" not in env
    kept = harness.fresh_env(CUDA_CACHE_DISABLE="1")  # no pycache: bytecode settings as inherited
    assert kept["PYTHONDONTWRITEBYTECODE"] == "1" and kept["CUDA_CACHE_DISABLE"] == "1"
    assert harness.run_fresh(["-c", "print('x'); print('{\"a\": 1}')"]) == {"a": 1}
    with pytest.raises(RuntimeError, match="boom"):
        harness.run_fresh(["-c", "import sys; sys.exit('boom')"])


def test_png_without_matplotlib_is_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert harness.bar_chart(tmp_path / "x.png", {"g": {"ours": 1.0}}, title="t", ylabel="y") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plots_draw_from_stored_results(tmp_path):
    """--plot-from redraws a stored result without a GPU (skips where matplotlib is not installed)."""
    pytest.importorskip("matplotlib")
    for name, gpu in (("calls", "h100"), ("fallback_calls", "h100"), ("models", "h200")):
        out = tmp_path / f"{name}.png"
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--plot-from",
                               str(ROOT / "benchmarks" / "results" / gpu / f"{name}.json"), "--plot", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert out.stat().st_size > 1000


def test_correctness_helpers_on_cpu_tensors():
    torch = pytest.importorskip("torch")
    from benchmarks.grid_sample import make_grid

    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    dy, b = torch.randn(2, 4, 6, 6), torch.randn(4)
    want = harness.conv2d_reference(x, w, dy, bias=b, padding=1)
    assert want["y"].dtype == torch.float64 and want["dx"].shape == x.shape and want["dw"].shape == w.shape
    y = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1))
    assert harness.rel_err(y, want["y"]) < 1e-5
    poisoned = harness.poisoned_like(y)
    assert poisoned.shape == y.shape and torch.isnan(poisoned).all()
    assert harness.rel_err(poisoned, want["y"]) == math.inf
    grid = make_grid(3, (5, 7), "random", "float16", device="cpu", span=1.1)
    assert grid.shape == (3, 5, 7, 2) and grid.dtype == torch.float16 and float(grid.abs().max()) <= 1.1
    assert make_grid(2, (4, 4), "affine", torch.float32, device="cpu").shape == (2, 4, 4, 2)


def _slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("readme", ["benchmarks/README.md", "tools/README.md"])
def test_the_readmes_links_resolve(readme):
    path = ROOT / readme
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve()
        if not resolved.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                bad.append(f"{target} (no such heading)")
    assert not bad, f"{readme}: {bad}"


# --- the model, DDP and first-iteration benchmarks' parts that need no GPU ---------------------------------

def test_models_ratios_and_summary_skip_what_is_missing():
    from benchmarks import models

    out = {"train_ms": {"torch": 20.0, "ours": 16.0, "torch_graphed": 12.0, "ours_graphed": 10.0},
           "train_host_ms": {"torch": 15.0, "ours": float("nan")}}
    got = models.train_ratios(out)
    assert got["eager"]["wall"] == 1.25 and got["graphed"]["wall"] == pytest.approx(1.2)
    assert math.isnan(got["eager"]["host"]) and math.isnan(got["graphed"]["device"])  # NaN, or not measured
    results = [{"model": "a", "phase": "done", "train_speedup": 1.0, "graphed_speedup": 1.0, "infer_speedup": 1.0,
                "train_ratios": got},
               {"model": "b", "phase": "done", "train_speedup": 4.0, "graphed_speedup": float("nan"),
                "infer_speedup": 4.0},
               {"model": "c", "phase": "train", "train_speedup": 0.25, "error": "the child exited 1"}]
    args = type("Args", (), {"policy": "heuristic", "autotune_limit": 3, "graphs": True, "compile": True})
    summary = models.summary(results, args, device="X", torch_version="t", complete=True)
    assert summary["train_geomean"] == pytest.approx(1.0)  # 1, 4 and 0.25: a model cut short keeps what it measured
    assert summary["graphed_geomean"] == pytest.approx(1.0) and summary["infer_geomean"] == pytest.approx(2.0)
    assert summary["ratio_geomeans"]["eager"]["wall"] == 1.25 and math.isnan(summary["ratio_geomeans"]["eager"]["host"])
    assert summary["failed"] == ["c"]
    json.dumps(summary)


def test_models_parent_keeps_each_childs_last_line(capsys):
    from benchmarks import models

    line = "import json; print('noise'); print(json.dumps({'model': 'm', 'phase': 'train'})); "
    done = models.run_child([sys.executable, "-c", line + "print(json.dumps({'model': 'm', 'phase': 'done'}))"],
                            "m", timeout=60)
    assert done == {"model": "m", "phase": "done"} and "noise" in capsys.readouterr().out  # echoed
    failed = models.run_child([sys.executable, "-c", line + "raise SystemExit(3)"], "m", timeout=60)
    assert failed["phase"] == "train" and failed["error"] == "the child exited 3"
    late = models.run_child([sys.executable, "-c", line + "import time; time.sleep(60)"], "m", timeout=1)
    assert late["phase"] == "train" and "stopped after 1 s" in late["error"]


def test_ddp_refuses_without_two_gpus_and_starts_ranks_as_torchrun_does():
    from benchmarks import ddp

    for argv in ([], ["--gpus", "1"]):
        done = subprocess.run([sys.executable, "-m", "benchmarks.ddp", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode != 0 and ("needs" in done.stderr or "at least 2" in done.stderr), done.stderr[-2000:]
    env = ddp.rank_env(1, 2, 29999, base={"PYTHONPATH": "/x"})
    assert env["RANK"] == env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29999"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/x"]
    s = ddp.summary({"torch": [30.0, 20.0, 25.0], "ours": [20.0, 25.0, 22.0]}, {"torch": [6.9, 6.1], "ours": [6.9, 6.2]})
    assert s["ms_per_step"] == {"torch": 25.0, "ours": 22.0} and s["ratio"] == pytest.approx(25 / 22)
    assert math.isnan(s["ratio_captured"]) and s["loss_after"] == {"torch": 6.1, "ours": 6.2}


def _ddp_args(**kw):
    import argparse

    return argparse.Namespace(**{"gpus": 2, "timeout": 60.0, **kw})


def _fake_ranks(monkeypatch, script: str) -> None:
    """benchmarks.ddp's ranks replaced by `python -c script` (RANK in their environment)."""
    from benchmarks import ddp

    monkeypatch.setattr(ddp, "worker_command", lambda argv, rank: [sys.executable, "-c", script])


def test_ddp_parent_stops_the_ranks_when_one_fails(monkeypatch, capsys):
    import time

    from benchmarks import ddp

    # rank 1 fails while rank 0 would wait for it forever (in a collective): the parent names it, stops rank 0
    _fake_ranks(monkeypatch, "import os, sys, time\nif os.environ['RANK'] == '1': time.sleep(0.5); sys.exit(3)\n"
                             "time.sleep(120)")
    began = time.monotonic()
    assert ddp.launch([], _ddp_args()) == 3
    assert time.monotonic() - began < 30
    assert "rank 1 exited 3: stopping the others" in capsys.readouterr().err
    # killed by a signal (the OOM killer, say): 128 + N, not a negative status
    _fake_ranks(monkeypatch, "import os, signal, time\n"
                             "if os.environ['RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(120)")
    assert ddp.launch([], _ddp_args()) == 128 + 9
    assert "rank 0 exited -9" in capsys.readouterr().err
    _fake_ranks(monkeypatch, "import time; time.sleep(120)")  # a hang: --timeout stops both
    began = time.monotonic()
    assert ddp.launch([], _ddp_args(timeout=1.0)) == 124
    assert time.monotonic() - began < 30 and "--timeout 1 s passed" in capsys.readouterr().err
    _fake_ranks(monkeypatch, "import sys; print('ok')")
    assert ddp.launch([], _ddp_args()) == 0


def test_a_failing_ddp_rank_leaves_at_once():
    """A rank that raises exits 1 with its rank named, without the interpreter's teardown: that is where
    an NCCL process group can hang while a peer waits (here a non-daemon thread stands in for it)."""
    code = ("import sys, threading, time\nfrom benchmarks import ddp\n"
            "threading.Thread(target=time.sleep, args=(120,)).start()\n"
            "def boom(args):\n    raise RuntimeError('NCCL error: boom')\n"
            "ddp.worker = boom\nsys.exit(ddp.main(['--worker']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "1"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "benchmarks.ddp: rank 1 failed: RuntimeError: NCCL error: boom" in done.stderr
    assert "Traceback" in done.stderr


def test_first_iteration_ratios_skip_failed_processes():
    from benchmarks import first_iteration

    runs = {"ours": [{"seconds": 3.0, "step_s": 1.0}, {"mode": "ours", "error": "x"}],
            "torch_bm_true": [{"seconds": 9.0, "step_s": 4.0}], "ours_bm_false": [{"mode": "ours_bm_false", "error": "y"}]}
    med, step = first_iteration.medians(runs, "seconds"), first_iteration.medians(runs, "step_s")
    got = first_iteration.ratios(med, step)
    assert got["speedup_vs_bm_true"] == 3.0 and got["step_speedup_vs_bm_true"] == 4.0
    assert math.isnan(got["speedup_vs_bm_false"]) and math.isnan(got["ours_bm_false_speedup_vs_bm_true"])
    assert first_iteration.failures(runs) == 2 and first_iteration.failures({"ours": [{"seconds": 1.0}]}) == 0


def test_first_iteration_reports_a_child_without_json_and_goes_on(monkeypatch, capsys):
    import argparse

    from benchmarks import first_iteration

    def no_json(argv, **kw):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr(first_iteration.harness, "run_fresh", no_json)
    args = argparse.Namespace(model="resnet50", batch=2)
    got = first_iteration._child("ours", args, {})
    assert got["mode"] == "ours" and got["error"].startswith("ValueError: ") and "error" in capsys.readouterr().out
    with pytest.raises(ValueError):  # the record process is required
        first_iteration._child("record", args, {}, required=True)


def test_first_iteration_runs_each_mode_on_its_training_route(monkeypatch):
    import argparse

    from benchmarks import first_iteration

    seen = {}
    monkeypatch.setattr(first_iteration.harness, "run_fresh",
                        lambda argv, **kw: seen.setdefault(argv[2], argv[5:7]) and {"mode": argv[2]})
    args = argparse.Namespace(model="resnet50", batch=2)
    for mode in (*first_iteration.MODES, "record"):
        first_iteration._child(mode, args, {})
    assert seen == {"ours": ["ours", "benchmark"], "ours_plans": ["plans", "benchmark"],
                    "ours_bm_false": ["ours", "no-benchmark"], "torch_bm_true": ["torch", "benchmark"],
                    "torch_bm_false": ["torch", "no-benchmark"], "record": ["plans", "benchmark"]}


def test_models_compares_the_plans_route_with_torch_eager():
    from benchmarks import models

    got = models.train_ratios({"train_ms": {"torch": 20.0, "ours": 16.0, "ours_plans": 25.0, "torch_aa": 21.0}})
    assert got["eager"]["wall"] == 1.25 and got["plans"]["wall"] == 0.8
    assert got["aa"]["wall"] == pytest.approx(20 / 21)  # the run's noise between identical candidates


# --- README's headline numbers are their results files' --------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)x?(?![\w.])")
DATE = re.compile(r"^(20\d\d-\d\d-\d\d)\b")


def _headline_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Headline numbers"):]
    section = section[:section.index("\n## ", 1)]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    assert rows and rows[0][:3] == ["what (on one NVIDIA H100 80GB unless said)", "ours", "against"], rows[:1]
    return rows[1:]


def _numbers(data) -> list[float]:
    if isinstance(data, dict):
        return [v for value in data.values() for v in _numbers(value)]
    if isinstance(data, list):
        return [v for value in data for v in _numbers(value)]
    return [float(data)] if isinstance(data, (int, float)) and not isinstance(data, bool) else []


def _stored(figure: str, values: list[float]) -> bool:
    """`figure` as written (its decimals) is one of `values` rounded so, in its unit or in ms / s / us."""
    decimals = len(figure.partition(".")[2])
    return any(round(v * scale, decimals) == float(figure) for v in values for scale in (1.0, 1e3, 1e-3))


def test_every_readme_headline_figure_is_its_results_files():
    """Each headline row links its results file(s); every figure in its `ours` and `against` cells (times,
    ratios, ranges' ends) is a value stored there, as rounded; its date is the file's where the file records
    one. A withdrawn row states no figure."""
    bad = []
    rows = _headline_rows()
    assert len(rows) >= 5, "README's headline table is gone"
    for what, ours, against, date, details in (row[:5] for row in rows):
        name = what[:50]
        files = re.findall(r"\]\((benchmarks/results/[^)\s]+\.json)\)", details)
        if ours.lower().startswith("withdrawn"):
            bad += [f"{name}: withdrawn but states {f}" for f in FIGURE.findall(ours + " " + against)]
            continue
        if not files:
            bad.append(f"{name}: no results file linked")
            continue
        stored = [json.loads((ROOT / f).read_text()) for f in files]
        values = [v for data in stored for v in _numbers(data)]
        bad += [f"{name}: {figure} not in {files}" for figure in FIGURE.findall(ours + " " + against)
                if not _stored(figure, values)]
        dates = {(data.get("meta") or {}).get("date", "")[:10] for data in stored} - {""}
        written = DATE.match(date)
        if not written or (dates and written.group(1) not in dates):
            bad.append(f"{name}: date {date!r}, the file's {sorted(dates)}")
    assert not bad, bad


def test_the_headline_check_catches_a_changed_figure(monkeypatch):
    """The check above fails on a figure one digit off (it is not vacuous)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if "| ResNet-50 training step" in line)
    figure = FIGURE.findall(row.split("|")[2])[0]
    changed = row.replace(figure, figure[:-1] + str((int(figure[-1]) + 1) % 10), 1)
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: original(self, *a, **k).replace(row, changed)
                        if self.name == "README.md" else original(self, *a, **k))
    with pytest.raises(AssertionError, match="not in"):
        test_every_readme_headline_figure_is_its_results_files()


# --- device figures keep their host-bound flag; A/B interleaved everywhere ---------------------------------------

def test_device_figures_keep_their_host_bound_blocks(monkeypatch):
    runs = iter([([2.0, 4.0, 3.0], 1), ([5.0], 0), ([7.0], 1)])
    monkeypatch.setattr(harness, "device_samples", lambda fn, **kw: next(runs))
    got = harness.device_ms(lambda: None, calls=1, rounds=3)
    assert got == 3.0 and got.host_bound == 1 and got.blocks == 3
    assert got.record() == {"ms": 3.0, "host_bound_blocks": 1, "blocks": 3}
    a, b = (lambda: None), (lambda: None)
    timer = harness.DeviceTime(calls=4)
    medians = harness.interleaved({"a": a, "b": b}, {"ms": timer}, rounds=1)["ms"]
    assert medians == {"a": 5.0, "b": 7.0}
    assert timer.flags({"a": a, "b": b}) == {"a": {"host_bound_blocks": 0, "blocks": 1},
                                              "b": {"host_bound_blocks": 1, "blocks": 1}}
    assert harness.above_wall(5.32, 4.51) and not harness.above_wall(4.0, 4.51)
    assert not harness.above_wall(float("nan"), 1.0)


@pytest.mark.parametrize("name", ["fallback_calls", "mlp", "gemm_act", "grid_sample", "ddp", "models", "calls",
                                  "chains", "conv_layers", "fused_graphs"])
def test_benchmarks_comparing_with_torch_interleave_through_the_harness(name):
    """Ours and torch's alternate round by round through `harness.interleaved` (docs/performance.md says
    so), not one candidate's figures taken after the other's."""
    tree = ast.parse(_path(f"benchmarks.{name}").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "interleaved" and isinstance(n.func.value, ast.Name) and n.func.value.id == "harness"]
    assert calls, f"benchmarks/{name}.py does not time through harness.interleaved"


# --- benchmarks.models: arguments, the table, the hand-written ResNet-18 ------------------------------------------

def _models_args(argv):
    import argparse

    from benchmarks import models

    captured = {}
    original = models.parse

    def keep(parser, args):  # main's parser, parsed by models.parse, without running anything
        captured["args"] = original(parser, args)
        raise SystemExit(0)

    models.parse = keep
    try:
        with pytest.raises(SystemExit):
            models.main(argv)
    finally:
        models.parse = original
    assert isinstance(captured["args"], argparse.Namespace)
    return captured["args"]


def test_models_arguments_smoke_and_defaults(monkeypatch):
    from benchmarks import models

    args = _models_args([])
    assert args.models[:len(models.TORCHVISION)] == list(models.TORCHVISION) and models.HAND in args.models
    assert args.compile and args.graphs and args.aa and args.plans and args.rounds == 5
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "timm" else object())
    assert not any(m.startswith("timm:") for m in models.default_models())
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    assert [m for m in models.default_models() if m.startswith("timm:")] == list(models.TIMM)
    smoke = _models_args(["--smoke"])
    assert smoke.models == [models.HAND] and smoke.rounds == 2 and smoke.train_batch == 16
    assert not smoke.aa and not smoke.plans and smoke.compile
    picked = _models_args(["--smoke", "--models", "resnet50", "timm:resnet18", "--rounds", "3", "--aa"])
    assert picked.models == ["resnet50", "timm:resnet18"] and picked.rounds == 3 and picked.aa
    assert picked.steps == models.SMOKE["steps"]
    assert not _models_args(["--no-compile"]).compile


def test_models_table_lists_each_candidates_figures(tmp_path, capsys):
    from benchmarks import models

    result = {"model": "m", "train_ms": {"torch": 20.0, "ours": 16.0, "torch_compile": 18.0, "ours_compile": 12.0,
                                         "torch_aa": 20.5},
              "train_host_ms": {"torch": 15.0, "ours": 10.0}, "train_device_ms": {"torch": 9.0, "ours": 8.5},
              "infer_ms": {"torch": 4.0, "ours": 2.0, "torch_autocast": 5.0}}
    text = models.table([result, {"model": "n", "error": "the child exited 1"}])
    rows = [line for line in text.splitlines() if line.startswith("| m |")]
    assert rows[0] == "| m | torch | 20.00 | 15.00 | 9.00 | 1.00 |"
    assert "| m | torch_compile | 18.00 | - | - | 1.11 |" in rows
    assert "| m | ours | 16.00 | 10.00 | 8.50 | 1.25 |" in rows
    assert "| m | ours_compile | 12.00 | - | - | 1.50 |" in rows  # against torch_compile
    assert not any("torch_aa" in row or "graphed" in row for row in rows)  # not run: no row
    assert "torch_autocast 5.00" in rows[-1] and "| n | error | the child exited 1 |" in text
    stored = tmp_path / "models.json"
    stored.write_text(json.dumps({"models": [result]}))
    assert models.main(["--table-from", str(stored)]) == 0
    assert "| m | ours | 16.00 |" in capsys.readouterr().out


def test_the_hand_written_resnet18_is_torchvisions_network():
    """Same parameters by name and shape as torchvision's resnet18 (CPU, no torchvision: counted), and where
    torchvision imports, the same output from the same state_dict."""
    torch = pytest.importorskip("torch")
    from benchmarks import models

    torch.manual_seed(0)
    net = models.hand_resnet18().eval()
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert sum(v.numel() for v in net.parameters()) == 11_689_512  # torchvision resnet18's count
    assert shapes["layer2.0.downsample.0.weight"] == (128, 64, 1, 1) and shapes["fc.weight"] == (1000, 512)
    assert not any(type(m).__module__.startswith("torchvision") for m in net.modules())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        got = net(x)
    assert got.shape == (2, 1000) and torch.isfinite(got).all()
    tv = pytest.importorskip("torchvision")
    reference = tv.models.resnet18(weights=None).eval()
    reference.load_state_dict(net.state_dict())  # strict: every name and shape the same
    with torch.no_grad():
        want = reference(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
