"""The `cudnn-graphs` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator, Sequence

from . import config
from ._version import __version__
from .environment import environment
from .errors import CudnnGraphsError, SpecError
from .signature import signature
from .spec import spec_from_dict


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cudnn-graphs",
        description="Turn convolution op specs into cuDNN graphs and cache their plans on disk.",
    )
    p.add_argument("--version", action="version", version=f"cudnn-graphs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="print the environment fingerprint and configuration as JSON")
    env.add_argument("--device", type=int, default=0, help="GPU ordinal (default 0)")
    check = sub.add_parser(
        "check", help="validate spec files (JSON Lines of spec.to_dict()), build their graphs, print signatures")
    check.add_argument("specfile", nargs="+", help="JSON Lines file; '-' reads standard input")
    check.add_argument("--no-graph", action="store_true", help="only validate specs, do not build graphs")
    return p


def _read_specs(path: str) -> Iterator[tuple[str, int, dict | None, str | None]]:
    """(file, line number, dict or None, error or None) for every non-blank, non-comment line."""
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with stream:
        for number, line in enumerate(stream, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                yield path, number, json.loads(text), None
            except json.JSONDecodeError as err:
                yield path, number, None, f"not JSON: {err.msg} at column {err.colno}"


def _check(args) -> int:
    from .graph import build_graph

    failures = 0
    env = environment()
    for path, number, data, error in (item for f in args.specfile for item in _read_specs(f)):
        try:
            if error is not None:
                raise SpecError("line", number, error)
            spec = spec_from_dict(data)
            if not args.no_graph:
                build_graph(spec)
            print(f"{signature(spec, env)[:16]}  {spec.op:16s} {path}:{number}")
        except CudnnGraphsError as err:
            failures += 1
            print(f"{path}:{number}: {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "env":
            out = {"environment": environment(args.device).to_dict(), "config": config.describe(),
                   "cache_dir": str(config.cache_dir()), "version": __version__}
            print(json.dumps(out, indent=2))
            return 0
        if args.command == "check":
            return _check(args)
    except (CudnnGraphsError, OSError) as err:
        print(f"cudnn-graphs: {err}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
