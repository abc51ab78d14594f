"""The layout, the README's commands and CI agree."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", text, flags=re.S)


def test_top_level_layout():
    for name in ("pyproject.toml", "cudnn_graphs", "plan_cache", "fallback_kernels", "tests", "tools",
                 "README.md", ".ci/run"):
        assert (ROOT / name).exists(), name


def test_ci_runs_exactly_the_readme_install_and_test_commands():
    text = (ROOT / "README.md").read_text()
    install = re.search(r"<!-- install -->\n```bash\n(.+?)\n```", text).group(1)
    test = re.search(r"<!-- test -->\n```bash\n(.+?)\n```", text).group(1)
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert install in ci and test in ci


def test_public_names_import():
    import cudnn_graphs as cg

    for name in ("ConvFwdSpec", "ConvBwdDataSpec", "ConvBwdFilterSpec", "SpecError", "UnsupportedGraphError",
                 "signature", "environment", "spec_from_dict", "build_graph", "Activation", "Environment"):
        assert hasattr(cg, name), name
    assert issubclass(cg.SpecError, ValueError)
