"""A pytest plugin (GPU host): report every driver-layer call that holds the host for more than 0.1 s.

    python -m pytest -s -p tools.pytest_slow_driver_calls tests/test_gpu_....py   # from the repository root
    python -m tools.pytest_slow_driver_calls tests/test_gpu_....py                 # the same

Wraps the functions of `gpu_launch.driver` and `gpu_launch.graph_patch`, their classes' `__init__` and
`launch`, and `gpu_launch.replay.record` / `Replay._record`, and prints `SLOW <call> <ms> [caller chain]` for each
slow call: where a host wait behind queued GPU work happens (it found the intermittent 1 s wait of
`test_no_device_synchronisation[grid_sample f16]` inside cuGraphInstantiateWithFlags, `GraphExec.__init__`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
import traceback

SLOW_S = 0.1


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            if took > SLOW_S:
                frames = traceback.extract_stack()[-6:-1][::-1]
                chain = " <- ".join(f"{f.name}:{f.lineno}" for f in frames)
                print(f"\nSLOW {label} {took * 1e3:.0f} ms [{chain}]", flush=True)

    setattr(owner, name, timed)


def pytest_configure(config) -> None:
    from gpu_launch import driver, graph_patch, replay

    for module in (driver, graph_patch):
        for name, obj in list(vars(module).items()):
            if inspect.isfunction(obj) and obj.__module__ == module.__name__ and name != "lib":
                _wrap(module, name, f"{module.__name__}.{name}")
            elif inspect.isclass(obj) and obj.__module__ == module.__name__:
                for method in ("__init__", "launch"):
                    if method in vars(obj):
                        _wrap(obj, method, f"{module.__name__}.{name}.{method}")
    _wrap(replay, "record", "replay.record")
    _wrap(replay.Replay, "_record", "Replay._record")


def main(argv=None) -> int:
    """pytest with this plugin loaded and output shown (-s); arguments go to pytest."""
    import pytest

    return pytest.main(["-s", "-p", "tools.pytest_slow_driver_calls", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
