"""GPU: `warmup --devices` plans through one worker process per GPU into one cache; a second run finds
everything cached. (On a one-GPU host this runs one worker; the two-GPU split is the same code.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudnn_graphs.presets import preset_specs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def _warmup(cache: Path, *extra: str) -> dict:
    env = {**os.environ, "CUDNN_GRAPHS_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "cudnn_graphs", "warmup", "--preset", "resnet50", "--batch", "2",
                           "--devices", "all", "--no-progress", "--json", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_warmup_over_every_gpu_fills_one_cache(tmp_path):
    from gpu_launch.driver import device_count

    n = len(preset_specs("resnet50", batch=2))
    first = _warmup(tmp_path / "cache")
    assert first["counts"]["built"] == n and first["counts"]["failed"] == 0
    assert sum(first["by_device"].values()) == n and len(first["by_device"]) == device_count()
    second = _warmup(tmp_path / "cache")
    assert second["counts"]["cached"] == n
