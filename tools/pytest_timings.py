"""A pytest plugin: append each test's wall time to a file as the test finishes, so a GPU suite cut
short by the device tool's time limit still says where its time went (`--durations` prints only at
the end).

    python -m pytest -p tools.pytest_timings tests/...     # writes $PYTEST_TIMINGS (default timings.tsv)
    python -m tools.pytest_timings tests/...               # the same

Each line: seconds (setup + call + teardown), outcome, node id; one line per module at its end too.
"""

from __future__ import annotations

import os
import sys
import time

_PATH = os.environ.get("PYTEST_TIMINGS", "timings.tsv")
_spent: dict[str, float] = {}
_outcome: dict[str, str] = {}
_module: dict[str, float] = {}


def _write(line: str) -> None:
    with open(_PATH, "a") as out:
        out.write(line + "\n")


def pytest_sessionstart(session) -> None:
    _write(f"# session start {time.strftime('%H:%M:%S')}")


def pytest_runtest_logreport(report) -> None:
    _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        _outcome[report.nodeid] = report.outcome
    if report.when == "teardown":
        spent = _spent.pop(report.nodeid)
        module = report.nodeid.split("::")[0]
        _module[module] = _module.get(module, 0.0) + spent
        _write(f"{spent:.2f}\t{_outcome.pop(report.nodeid, report.outcome)}\t{report.nodeid}")


def pytest_sessionfinish(session) -> None:
    for module, spent in sorted(_module.items(), key=lambda kv: -kv[1]):
        _write(f"# module {spent:.1f}\t{module}")


def main(argv=None) -> int:
    """pytest with this plugin loaded; arguments go to pytest."""
    import pytest

    return pytest.main(["-p", "tools.pytest_timings", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
