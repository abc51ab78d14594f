"""The documentation against the code: README.md and docs/*.md.

- Every fenced ```python block runs without a GPU, unless the line before its fence is `<!-- gpu -->`
  (those are only compiled); a block that imports torch (or another optional package) skips without it.
- Every `cudnn-graphs` command, subcommand and flag (walked from the parser the installed entry point
  builds) is described in docs/cli.md under its command, and every flag the docs name exists.
- Every environment variable the library reads (all in cudnn_graphs/config.py) is described in
  docs/cli.md, and every CUDNN_GRAPHS_* name the docs mention is one the library reads.
- README.md stays a front door: at most 200 lines, linking every page of docs/; links resolve.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_MD = DOCS / "cli.md"
README_MAX_LINES = 200
DOC_PAGES = ("guide", "cli", "cache", "torch", "training", "kernels", "performance", "design", "troubleshooting")
GPU_MARK = "<!-- gpu -->"
OPTIONAL = ("torch", "torchvision", "cupy", "redis")  # a block importing one of these skips without it
PACKAGES = ("cudnn_graphs", "plan_cache", "fallback_kernels", "gpu_launch")
VARIABLE = re.compile(r"\bCUDNN_GRAPHS_[A-Z0-9_]*[A-Z0-9]\b")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _read(path: Path) -> str:
    if not path.exists():
        pytest.fail(f"{_rel(path)} does not exist")
    return path.read_text(encoding="utf-8")


def _blocks(path: Path):
    """(language, first line number of the code, marked gpu, code) for each fenced block of `path`."""
    text = path.read_text(encoding="utf-8")
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 2
        yield match.group(1).lower(), line, before == GPU_MARK, match.group(2)


def _python_blocks():
    return [pytest.param(path, line, gpu, code, id=f"{_rel(path)}:{line}")
            for path in _documents() for lang, line, gpu, code in _blocks(path) if lang in ("python", "py")]


def _without_code(text: str) -> str:
    """`text` with fenced blocks and inline code spans blanked (links inside them are not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"`[^`\n]*`", "``", text)


# --- (a) the examples run -------------------------------------------------------------------------------------

def _imported_roots(code: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module)
    # cudnn_graphs.torch needs torch as much as `import torch` does
    return {"torch" if name.startswith("cudnn_graphs.torch") else name.split(".")[0] for name in roots}


@pytest.mark.parametrize("path, line, gpu, code", _python_blocks())
def test_python_blocks_run_without_a_gpu(path, line, gpu, code, tmp_path, monkeypatch):
    compiled = compile(code, f"{_rel(path)}:{line}", "exec")  # GPU blocks must at least be Python
    if gpu:
        pytest.skip(f"marked {GPU_MARK}")
    for name in sorted(_imported_roots(code) & set(OPTIONAL)):
        pytest.importorskip(name)
    monkeypatch.chdir(tmp_path)  # files an example writes land here
    exec(compiled, {"__name__": "__doc_example__"})


def test_readme_has_an_example_that_runs_without_a_gpu():
    _read(README)
    assert any(lang == "python" and not gpu for lang, _, gpu, _ in _blocks(README)), \
        f"README.md: no ```python block without {GPU_MARK}: a newcomer without a GPU has nothing to run"


# --- (b) the CLI reference ------------------------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _root_parser() -> argparse.ArgumentParser:
    """The parser the `cudnn-graphs` entry point (pyproject's [project.scripts]) builds, however it is built."""
    entry = _entry_point()
    module, _, function = entry.partition(":")
    main = getattr(importlib.import_module(module), function)

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        main(["--help"])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    pytest.fail(f"{entry} returned without parsing its arguments")


def _entry_point() -> str:
    """pyproject's [project.scripts] `cudnn-graphs = "module:function"` (tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text[text.index("[project.scripts]"):]
    return re.search(r'^cudnn-graphs\s*=\s*"([^"]+)"', scripts, flags=re.M).group(1)


def _commands() -> dict[tuple[str, ...], list[argparse.Action]]:
    """{command path: its optional actions}, () being `cudnn-graphs` itself."""
    out: dict[tuple[str, ...], list[argparse.Action]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        out[path] = [a for a in parser._actions if a.option_strings]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + (name,))

    walk(_root_parser(), ())
    return out


def _flags(actions: list[argparse.Action], *, with_help: bool = False) -> set[str]:
    return {flag for a in actions if with_help or not isinstance(a, argparse._HelpAction) for flag in a.option_strings}


def _sections(text: str) -> list[tuple[int, str, str, str]]:
    """(level, title, own text up to the next heading, text up to the next heading of its level or above)."""
    body = FENCE.sub(lambda m: m.group(0).replace("#", " "), text)  # a '#' comment in a block is no heading
    heads = [(m.start(), m.end(), len(m.group(1)), m.group(2).strip())
             for m in re.finditer(r"^(#{1,6})[ \t]+(.+)$", body, flags=re.M)]
    out = []
    for i, (start, end, level, title) in enumerate(heads):
        own_end = heads[i + 1][0] if i + 1 < len(heads) else len(text)
        tree_end = next((s for s, _, lv, _ in heads[i + 1:] if lv <= level), len(text))
        out.append((level, title, text[end:own_end], text[end:tree_end]))
    return out


def _command_section(path: tuple[str, ...], sections) -> tuple[str, str] | None:
    title = "`" + " ".join(("cudnn-graphs", *path)) + "`"
    found = [(own, tree) for _, heading, own, tree in sections if title in heading]
    return found[0] if found else None


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_command_has_a_section_in_cli_md():
    sections = _sections(_read(CLI_MD))
    missing = [" ".join(("cudnn-graphs", *path)) for path in _commands() if _command_section(path, sections) is None]
    assert not missing, f"docs/cli.md has no heading naming these commands in backticks: {missing}"


def test_every_flag_is_documented_under_its_command():
    text = _read(CLI_MD)
    sections = _sections(text)
    missing = []
    for path, actions in _commands().items():
        section = _command_section(path, sections)
        tree = section[1] if section else ""
        missing += [f"cudnn-graphs {' '.join(path)} {flag}".replace("  ", " ")
                    for flag in sorted(_flags(actions)) if not _mentions(tree, flag)]
    missing += [flag for flag in ("-h", "--help") if not _mentions(text, flag)]
    assert not missing, f"docs/cli.md does not describe: {missing}"


def test_every_flag_in_cli_md_exists():
    commands = _commands()
    known = set().union(*(_flags(actions, with_help=True) for actions in commands.values()))
    text = _read(CLI_MD)
    unknown = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - known)
    assert not unknown, f"docs/cli.md names flags no command has: {unknown}"
    # a command's own table lists only its own flags
    wrong = []
    for path, actions in commands.items():
        section = _command_section(path, _sections(text))
        rows = re.findall(r"^\|([^|\n]*)\|", section[0], flags=re.M) if section else []
        listed = {flag for row in rows for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", row)}
        wrong += [f"cudnn-graphs {' '.join(path)}: {flag}" for flag in sorted(listed - _flags(actions, with_help=True))]
    assert not wrong, f"docs/cli.md lists flags under a command that does not take them: {wrong}"


def _command_lines(text: str) -> list[str]:
    """Every `cudnn-graphs ...` command line: in shell blocks and in inline code spans."""
    lines = []
    for match in FENCE.finditer(text):
        if match.group(1).lower() in ("bash", "sh", "shell", "console", ""):
            lines += [line.strip() for line in match.group(2).splitlines()
                      if line.strip().startswith("cudnn-graphs ")]
    lines += re.findall(r"`(cudnn-graphs [^`\n]+)`", _without_code_blocks(text))
    return lines


def _without_code_blocks(text: str) -> str:
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def test_command_lines_in_the_docs_use_existing_commands_and_flags():
    commands = _commands()

    def below(path: tuple[str, ...]) -> set[str]:  # a flag may come before its subcommand's name
        return set().union(*(_flags(a, with_help=True) for p, a in commands.items() if p[:len(path)] == path))

    bad = []
    for document in _documents():
        for line in _command_lines(document.read_text(encoding="utf-8")):
            path: tuple[str, ...] = ()
            for token in line.split("#", 1)[0].split()[1:]:
                for part in token.strip("[](){}").split("|"):
                    if part.startswith("-") and part not in ("-", "--"):
                        if part.split("=", 1)[0] not in below(path):
                            bad.append(f"{_rel(document)}: {line!r}: {part}")
                    elif path + (part,) in commands:
                        path = path + (part,)
    assert not bad, f"command lines naming flags their command does not take: {bad}"


# --- (c) environment variables --------------------------------------------------------------------------------

class _Recording(dict):
    """An empty os.environ that remembers every name asked for."""

    def __init__(self):
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return default

    def __getitem__(self, key):
        self.asked.add(key)
        raise KeyError(key)

    def __contains__(self, key):
        self.asked.add(key)
        return False


def _variables_read(monkeypatch) -> set[str]:
    """Every variable cudnn_graphs.config reads: its CUDNN_GRAPHS_* names, and every name its functions
    ask os.environ for when called with nothing set."""
    from cudnn_graphs import config

    names = {value for name, value in vars(config).items()
             if name.isupper() and isinstance(value, str) and VARIABLE.fullmatch(value)}
    environ = _Recording()
    monkeypatch.setattr(config, "os", types.SimpleNamespace(**{**vars(__import__("os")), "environ": environ,
                                                               "getenv": environ.get}))
    for name, function in vars(config).items():
        if isinstance(function, types.FunctionType) and function.__module__ == config.__name__:
            required = function.__code__.co_argcount - len(function.__defaults__ or ())
            if required == 0:
                try:
                    function()
                except Exception:  # noqa: BLE001 - a check that refuses the empty environment still asked
                    pass
    return names | environ.asked


def _environment_reads(path: Path) -> list[str]:
    """Places in `path` that read os.environ / getenv (a write or a copy for a child is not a read)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv" or (node.func.attr == "get" and _is_environ(node.func.value)):
                target = node
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            target = node
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            target = node
        if target is not None:
            found.append(f"{_rel(path)}:{target.lineno}")
    return found


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def test_environment_variables_are_read_only_in_config():
    config = ROOT / "cudnn_graphs" / "config.py"
    reads = [place for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if path != config
             for place in _environment_reads(path)]
    assert not reads, ("read environment variables in cudnn_graphs/config.py (and describe them in docs/cli.md), "
                       f"not here: {reads}")


def test_every_variable_read_is_documented(monkeypatch):
    sections = _sections(_read(CLI_MD))
    reference = next((tree for _, title, _, tree in sections if title.lower() == "environment variables"), None)
    assert reference is not None, "docs/cli.md has no 'Environment variables' section"
    missing = sorted(name for name in _variables_read(monkeypatch) if f"`{name}`" not in reference)
    assert not missing, f"docs/cli.md's 'Environment variables' does not describe: {missing}"


def test_every_documented_variable_exists(monkeypatch):
    read = _variables_read(monkeypatch)
    unknown = sorted({f"{_rel(path)}: {name}" for path in _documents()
                      for name in VARIABLE.findall(path.read_text(encoding="utf-8")) if name not in read})
    assert not unknown, f"the docs name variables the library does not read: {unknown}"


# --- (d) README as a front door; links ------------------------------------------------------------------------

def test_readme_is_at_most_200_lines():
    lines = _read(README).count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail "
                                       "into docs/ and link it")


def test_readme_and_the_docs_index_link_every_page():
    for index, prefix in ((README, "docs/"), (DOCS / "README.md", "")):
        links = {target.split("#")[0] for _, target in _links(_read(index))}
        missing = [f"{prefix}{page}.md" for page in DOC_PAGES if f"{prefix}{page}.md" not in links]
        assert not missing, f"{_rel(index)} does not link {missing}"
    for page in DOC_PAGES:
        assert (DOCS / f"{page}.md").exists(), f"docs/{page}.md"


def _links(text: str) -> list[tuple[str, str]]:
    return re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", _without_code(text))


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title, _, _ in _sections(path.read_text(encoding="utf-8")):
        slug = _slug(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_links_resolve():
    bad = []
    for document in _documents():
        for _, target in _links(document.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked offline
                continue
            file, _, anchor = target.partition("#")
            resolved = (document.parent / file).resolve() if file else document
            if not resolved.exists():
                bad.append(f"{_rel(document)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                bad.append(f"{_rel(document)}: {target} (no such heading)")
    assert not bad, f"links that do not resolve: {bad}"


HISTORICAL = re.compile(r"\b([0-9a-f]{7,40}):((?:tools|benchmarks)/[\w./*-]+)")
REPO_PATH = re.compile(r"(?<![\w/.:-])((?:benchmarks|tools)/[\w./-]*\.(?:py|json|png|md|jsonl|log))")
DATED = re.compile(r"\b20\d\d-\d\d-\d\d-[a-z0-9]+-[\w.*-]+?\.(?:json|log|png|jsonl)\b")


def _history(commit: str) -> list[str] | None:
    """The files of `commit`, or None where git or that commit is not here (a shallow clone)."""
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", commit],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.split() if done.returncode == 0 else None


def test_the_results_and_scripts_the_docs_name_exist():
    """A results file or script the docs name (`benchmarks/results/<gpu>/...`, `benchmarks/*.py`,
    `tools/*.py`) is one the repository holds; one removed is named `<commit>:path`, a file of that commit
    (checked where git has the commit); a dated results name appears only in that form."""
    import fnmatch

    missing, historical = [], {}
    for document in _documents():
        text = document.read_text(encoding="utf-8")
        for commit, path in HISTORICAL.findall(text):
            if not path.endswith("/") and "..." not in path:  # not a pattern such as `<commit>:tools/<probe>.py`
                historical.setdefault(commit, set()).add((_rel(document), path))
        current = HISTORICAL.sub("", text)
        missing += [f"{_rel(document)}: {path}" for path in REPO_PATH.findall(current) if not (ROOT / path).exists()]
        missing += [f"{_rel(document)}: {name} (a dated result outside git history)" for name in DATED.findall(current)]
        missing += [f"{_rel(document)}: tools/results/" for _ in re.findall(r"(?<!:)tools/results/", current)]
    for commit, cited in historical.items():
        files = _history(commit)
        if files is None:
            continue
        missing += [f"{doc}: {commit}:{path} (not in {commit})" for doc, path in sorted(cited)
                    if not any(fnmatch.fnmatchcase(f, path) for f in files)]
    assert not missing, f"files named in the docs that are not where they say: {missing}"
