"""The layout, the README's commands and CI agree."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", text, flags=re.S)


def test_top_level_layout():
    for name in ("pyproject.toml", "cudnn_graphs", "plan_cache", "fallback_kernels", "gpu_launch", "tests", "tools",
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


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, lazily inside functions too, as absolute dotted names."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _importers(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        hits = sorted(m for m in _imports(path) if m.split(".")[0] in forbidden or
                      any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def test_imports_go_one_way():
    """gpu_launch <- fallback_kernels <- cudnn_graphs; plan_cache knows none of them; and inside
    cudnn_graphs the cache layer never reaches up into plans."""
    assert _importers("gpu_launch", ("cudnn_graphs", "fallback_kernels", "plan_cache")) == {}
    assert _importers("fallback_kernels", ("cudnn_graphs", "plan_cache")) == {}
    assert _importers("plan_cache", ("cudnn_graphs", "fallback_kernels", "gpu_launch")) == {}
    assert _importers("cudnn_graphs/cache", ("cudnn_graphs.plan", "cudnn_graphs.torch", "cudnn_graphs.api")) == {}


def test_the_cache_layer_never_calls_into_a_session():
    """cudnn_graphs/cache/ reads records into data (`read_plan`); the plan layer (`plan/restore.py`) makes
    the Plan from the session's public side. Neither reaches into Session privates."""
    for path in sorted((ROOT / "cudnn_graphs" / "cache").rglob("*.py")):
        text = path.read_text()
        for private in ("session._", "._restore_part", "._new_plan", "._require_gpu", "._notes_source"):
            assert private not in text, f"{path.relative_to(ROOT)} calls {private}"
    restore = (ROOT / "cudnn_graphs" / "plan" / "restore.py").read_text()
    assert not re.search(r"session\._", restore), "plan/restore.py reads a Session private"
