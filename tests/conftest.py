"""Shared fixtures: every cache points at a temp dir; `gpu` tests skip cleanly without a GPU."""

from __future__ import annotations

import functools

import pytest

from cudnn_graphs import config
from cudnn_graphs.environment import Environment


@functools.lru_cache(maxsize=1)
def gpu_available() -> str | None:
    """None when a GPU and the cuDNN frontend are usable, else the reason to skip."""
    from cudnn_graphs.environment import _gpu_properties

    if "name" not in _gpu_properties(0):
        return "no CUDA GPU visible"
    try:
        import cudnn  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the machine
        return f"cuDNN frontend not importable: {err}"
    return None


def pytest_collection_modifyitems(config, items):
    from tests import gpu_levels

    gpu_levels.mark(items, pytest.mark.smoke, pytest.mark.two_gpu)  # the GPU suite's levels
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or gpu_available() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A GPU test module skipped at import for want of torch says first that there is no GPU, when
    there is none: that is the reason that matters on a CPU machine."""
    outcome = yield
    report = outcome.get_result()
    name = getattr(collector, "path", None)
    if report.skipped and name is not None and name.name.startswith("test_gpu_") and gpu_available():
        path, line, reason = report.longrepr
        report.longrepr = (path, line, f"{gpu_available()} (and {reason.removeprefix('Skipped: ')})")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's real cache."""
    root = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv(config.CACHE_DIR, str(root))
    return root


@pytest.fixture
def cache_dir(_isolated_cache):
    return _isolated_cache


@pytest.fixture
def fake_env() -> Environment:
    """A fixed, GPU-looking environment for signature tests that must not depend on this machine."""
    return Environment(gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132,
                       cudnn_backend_version=91900, cudnn_frontend_version="1.28.0",
                       cuda_driver_version=13000, cuda_runtime_version=13000,
                       deterministic=False, allow_tf32=True)
