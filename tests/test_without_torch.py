"""CPU: README's test command on a box without torch. Every test module is collected with torch, torchvision
and timm hidden (an import of them raises ModuleNotFoundError, as where they are not installed): a module
that imports them before `pytest.importorskip`, itself or through a helper it imports, is a collection
error here, the failure a fresh CPU box would see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = ("torch", "torchvision", "timm")

# a meta-path finder first in line that refuses the hidden packages, then pytest's own main
_COLLECT = f"""
import sys

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)", name=name)
        return None

for name in [m for m in sys.modules if m.split(".")[0] in {HIDDEN!r}]:
    del sys.modules[name]
sys.meta_path.insert(0, Hidden())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_test_module_collects_without_torch():
    done = subprocess.run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                              str(ROOT), os.environ.get("PYTHONPATH"))))})
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"collection without torch exited {done.returncode}:\n{tail}"
    assert " error" not in done.stdout.splitlines()[-1], tail
    # the torch-free modules still collect their tests (a blocker that hid everything would pass above)
    assert "tests/test_memo.py::test_the_hot_paths_keep_their_calls_in_the_one_memo" in done.stdout, tail
    assert "tests/test_docs.py::" in done.stdout, tail
