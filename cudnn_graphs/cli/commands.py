"""The `cudnn-graphs` command: its parser, `main`, and the commands small enough to live here (env, check)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .. import config
from .._version import __version__
from ..environment import environment, environment_from_file, libcudnn_problem
from ..errors import CudnnGraphsError, SpecError
from ..recording import read_spec_file
from ..signature import signature
from ..spec import spec_from_dict
from .cache import add_cache_parser, device_option, int_arg, run_cache


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on standard error, as docs/cli.md promises, not the whole usage block.
    Subcommands' parsers are of this class too (add_subparsers makes them of the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cudnn-graphs",
        description="Turn convolution op specs into cuDNN graphs and cache their plans on disk.",
        epilog="Exit status: 0 done; 1 problems found; 2 usage or configuration error; 130 interrupted; "
               "141 standard output closed early (| head).",
    )
    p.add_argument("--version", action="version", version=f"cudnn-graphs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="print the environment fingerprint and configuration as JSON")
    device_option(env)
    check = sub.add_parser(
        "check", help="validate spec files (JSON Lines of spec.to_dict()), build their graphs, print signatures")
    check.add_argument("specfile", nargs="+", help="JSON Lines file; '-' reads standard input")
    check.add_argument("--no-graph", action="store_true", help="only validate specs, do not build graphs")
    check.add_argument("--json", action="store_true", help="one JSON document: each line's signature or error")
    check.add_argument("--target-env", metavar="FILE", help="signatures for another machine: the JSON that "
                       "`cudnn-graphs env` printed there")
    _add_warmup_parser(sub)
    add_cache_parser(sub)
    doctor_help = ("check this machine: GPU, driver, libcudnn, frontend, configuration, cache directory, remote "
                   "cache; exit 1 with the fix when something is wrong")
    doctor = sub.add_parser("doctor", help=doctor_help, description=doctor_help[0].upper() + doctor_help[1:] + ".")
    device_option(doctor)
    return p


def _add_warmup_parser(sub) -> None:
    from ..presets import PRESETS

    w = sub.add_parser(
        "warmup", help="plan specs ahead of a job and store their plans in the cache",
        description="Plan every spec (from spec files and/or a preset network) and store it in the plan cache, "
                    "so a later job's first step loads plans instead of building or timing them.")
    w.add_argument("specfile", nargs="*", help="JSON Lines of spec.to_dict() (e.g. written by record mode); "
                   "'-' reads standard input")
    w.add_argument("--preset", choices=PRESETS, help="a network's conv layers: forward, dgrad and wgrad")
    w.add_argument("--batch", type=_positive_int, help="preset batch size (default 32); with --preset only")
    w.add_argument("--dtype", type=_dtype_arg,
                   help="preset dtype, any spelling the API takes: float16/half/fp16, bfloat16/bf16, float32, "
                   "float64 (default float16); with --preset only")
    w.add_argument("--layout", type=_layout_arg,
                   help="preset memory layout: channels_last/NHWC or channels_first/NCHW, any case "
                   "(default channels_last); with --preset only")
    w.add_argument("--autotune", action="store_true",
                   help="time every candidate plan and store the fastest (upgrades heuristic records)")
    w.add_argument("--autotune-limit", type=_positive_int, default=None, metavar="N",
                   help="time at most N candidates per graph")
    device_option(w)
    w.add_argument("--devices", metavar="all|I,J,...", help="spread the specs over these GPUs, one worker process "
                   "each, all writing one cache (identical GPUs share every record)")
    w.add_argument("--cache", metavar="DIR", help="cache directory (default: $CUDNN_GRAPHS_CACHE_DIR or the user "
                   "cache dir)")
    w.add_argument("--dry-run", action="store_true", help="print specs and signatures only; needs no GPU")
    w.add_argument("--target-env", metavar="FILE", help="with --dry-run: signatures for another machine, from the "
                   "JSON that `cudnn-graphs env` printed there")
    w.add_argument("--emit", metavar="FILE", help="write the specs (spec files and preset) to FILE ('-': standard "
                   "output) as JSON Lines for editing, then stop; needs no GPU")
    w.add_argument("--strict", action="store_true", help="stop at the first bad spec-file line")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--json", action="store_true", help="the summary (or, with --dry-run, every spec with its "
                   "signature) as one JSON document")


def _dtype_arg(text: str) -> str:
    """--dtype through the API's own alias table."""
    from ..spec import dtypes

    try:
        return dtypes.canonical_dtype("--dtype", text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(err.reason) from None


def _layout_arg(text: str) -> str:
    """--layout through the API's own alias table (a preset's convs are 2-D)."""
    from ..spec import geometry

    try:
        return geometry.canonical_layout(text, 4)
    except SpecError as err:
        raise argparse.ArgumentTypeError(err.reason) from None


_positive_int = int_arg(1)


def _check(args) -> int:
    from ..graph import build_graph

    if not args.no_graph and libcudnn_problem() is not None:  # else every valid spec fails alike, one by one
        raise CudnnGraphsError(f"building graphs needs libcudnn: {libcudnn_problem()}. Fix: pip install "
                               "'cudnn-graphs[cu12]' (or [cu13]), or pass --no-graph to validate the specs only")
    rows = []
    env = environment_from_file(args.target_env) if args.target_env else environment()
    for path, number, data, error in (item for f in args.specfile for item in read_spec_file(f)):
        row = {"file": path, "line": number}
        try:
            if error is not None:
                raise SpecError("line", number, error)
            spec = spec_from_dict(data)
            if not args.no_graph:
                build_graph(spec)
            row.update(op=spec.op, signature=signature(spec, env))
            if not args.json:
                print(f"{row['signature'][:16]}  {spec.op:16s} {path}:{number}")
        except CudnnGraphsError as err:
            row.update(error=f"{type(err).__name__}: {err}")
            if not args.json:
                print(f"{path}:{number}: {row['error']}", file=sys.stderr)
        rows.append(row)
    if not rows:  # as with no file at all: nothing was checked, which is not a pass
        print(f"cudnn-graphs check: no specs in {', '.join(args.specfile)}", file=sys.stderr)
        return 2
    failed = sum("error" in row for row in rows)
    if args.json:
        print(json.dumps({"ok": len(rows) - failed, "failed": failed, "specs": rows}, indent=1))
    else:
        print(f"checked {len(rows)} spec(s): {len(rows) - failed} ok, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def _env(args) -> int:
    """The fingerprint and every variable; a variable Session() would refuse is flagged, exit 1."""
    problems = config.problems()
    out = {"environment": environment(args.device).to_dict(), "config": config.describe(),
           "config_errors": problems, "version": __version__,
           "cache_dir": None if config.CACHE_DIR in problems else str(config.cache_dir())}
    print(json.dumps(out, indent=2))
    for message in problems.values():
        print(f"cudnn-graphs: {message}", file=sys.stderr)
    return 1 if problems else 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a job stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a Unix tool whose reader went away (`| head -1`) exits with


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done; 1 problems found (bad spec lines, failed plans, a check that failed); 2 usage or
    configuration errors, one line on stderr; 130 interrupted (Ctrl-C); 141 standard output closed early."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except KeyboardInterrupt:
        print("cudnn-graphs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except (CudnnGraphsError, OSError) as err:
        print(f"cudnn-graphs: {err}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args) -> int:
    if args.command == "env":
        return _env(args)
    if args.command == "check":
        return _check(args)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(args)
    if args.command == "cache":
        return run_cache(args)
    if args.command == "warmup":
        from .warmup import run_warmup

        return run_warmup(args)
    parser.error("name a command: env, doctor, check, warmup or cache")


def _drop_stdout() -> None:
    """Point standard output at /dev/null: what is still buffered for the reader that went away would
    otherwise fail again, with a second message, when the interpreter flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no usable stdout at all: nothing left to protect
        pass


if __name__ == "__main__":
    sys.exit(main())
