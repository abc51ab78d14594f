"""CPU: the GPU suite's levels (tests/gpu_levels.py). Every GPU test file contributes a smoke test that
exists, or is listed as a two-GPU file; the markers are registered; the marking picks one case per file."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from tests import gpu_levels

ROOT = Path(__file__).resolve().parent.parent
GPU_FILES = sorted(p.name for p in (ROOT / "tests").glob("test_gpu_*.py"))


def test_every_gpu_test_file_has_a_smoke_test_or_is_a_two_gpu_file():
    uncovered = [f for f in GPU_FILES if f not in gpu_levels.SMOKE and f not in gpu_levels.TWO_GPU]
    assert not uncovered, f"add these GPU test files to tests/gpu_levels.py (SMOKE or TWO_GPU): {uncovered}"
    gone = sorted((set(gpu_levels.SMOKE) | gpu_levels.TWO_GPU) - set(GPU_FILES))
    assert not gone, f"tests/gpu_levels.py names files that are not there: {gone}"
    assert not set(gpu_levels.SMOKE) & gpu_levels.TWO_GPU


def test_each_smoke_test_is_a_test_of_its_file():
    missing = []
    for file, function in gpu_levels.SMOKE.items():
        tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if function not in names:
            missing.append(f"{file}: {function}")
    assert not missing, f"smoke tests that are not module-level tests of their file: {missing}"


def test_the_markers_are_registered():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for marker in ("gpu", "smoke", "two_gpu"):
        assert re.search(rf'^\s*"{marker}: ', text, flags=re.M), marker


class _Item(SimpleNamespace):
    def add_marker(self, marker):
        self.markers.append(marker)


def test_marking_takes_each_files_first_case_and_every_two_gpu_test():
    file, function = next(iter(gpu_levels.SMOKE.items()))
    two = next(iter(gpu_levels.TWO_GPU))

    def item(name, path, original=None):
        return _Item(name=name, originalname=original, path=Path("tests") / path, markers=[])

    items = [item(f"{function}[a]", file, function), item(f"{function}[b]", file, function),
             item("test_other", file), item("test_x", two), item("test_y", two), item("test_z", "test_cli.py")]
    gpu_levels.mark(items, "smoke", "two_gpu")
    assert [i.markers for i in items] == [["smoke"], [], [], ["two_gpu"], ["two_gpu"], []]
