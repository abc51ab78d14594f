"""`cudnn-graphs warmup`: plan specs ahead of a job so its first step finds every plan on disk."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import CudnnGraphsError, NoGpuError, SpecError, UnsupportedGraphError
from .recording import read_spec_file
from .spec import spec_from_dict

OUTCOMES = ("cached", "built", "autotuned", "unsupported", "failed")
RELEASE_EVERY = 256  # specs a warm-up plans between letting go of the plans it stored
PRESET_DEFAULTS = {"batch": 32, "dtype": "float16", "layout": "channels_last"}


@dataclass
class SpecSource:
    """Where a spec came from, for messages: a file and line, or a preset."""

    where: str
    spec: Any


@dataclass
class Summary:
    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    seconds: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0.0))
    problems: list = field(default_factory=list)  # (where, outcome, message)
    by_device: dict = field(default_factory=dict)  # GPU ordinal -> specs it planned (--devices)

    def add(self, outcome: str, seconds: float, where: str = "", message: str = "") -> None:
        self.counts[outcome] += 1
        self.seconds[outcome] += seconds
        if message:
            self.problems.append((where, outcome, message))


def collect(args) -> tuple[list[SpecSource], list[str]]:
    """Distinct specs from the spec files then the preset, and one message per bad spec-file line."""
    sources: dict[Any, SpecSource] = {}
    errors: list[str] = []
    for path in args.specfile:
        for _, number, data, error in read_spec_file(path):
            where = f"{path}:{number}"
            try:
                if error is not None:
                    raise SpecError("line", number, error)
                spec = spec_from_dict(data)
            except CudnnGraphsError as err:
                errors.append(f"{where}: {type(err).__name__}: {err}")
                if args.strict:
                    return list(sources.values()), errors
                continue
            sources.setdefault(spec, SpecSource(where, spec))
    if args.preset:
        from .presets import preset_specs

        for spec in preset_specs(args.preset, batch=args.batch, dtype=args.dtype, layout=args.layout):
            sources.setdefault(spec, SpecSource(f"preset {args.preset}", spec))
    return list(sources.values()), errors


def run_warmup(args) -> int:
    usage = _usage_error(args)
    if usage is not None:
        print(f"cudnn-graphs warmup: {usage}", file=sys.stderr)
        return 2
    sources, errors = collect(args)
    for message in errors:
        print(message, file=sys.stderr)
    if args.strict and errors:
        return 1
    if not sources and not errors:  # as with no file at all: an empty spec file is nothing to do
        print(f"cudnn-graphs warmup: nothing to do: no specs in {', '.join(args.specfile)}", file=sys.stderr)
        return 2
    if getattr(args, "emit", None):
        return _emit(sources, args.emit, bad_lines=len(errors))
    if args.dry_run:
        _dry_run(sources, args)
        return 1 if errors else 0
    from .environment import gpu_problem

    devices = [args.device]
    if getattr(args, "devices", None):
        try:
            devices = parse_devices(args.devices)
        except ValueError as err:
            print(f"cudnn-graphs warmup: --devices {args.devices!r}: {err}", file=sys.stderr)
            return 2
    problem = next((p for p in map(gpu_problem, devices) if p is not None), None)
    if problem is not None:  # one message, not one driver error per spec
        print(f"cudnn-graphs warmup: {NoGpuError(problem)}", file=sys.stderr)
        return 2
    if getattr(args, "devices", None):
        from .warmup_devices import plan_on_devices

        summary = plan_on_devices(sources, args, devices)
    else:
        summary = _plan_all(sources, args)
    _print_summary(summary, args, bad_lines=len(errors))
    return 1 if errors or summary.counts["failed"] or summary.counts["unsupported"] else 0


def _usage_error(args) -> str | None:
    """What makes these options a usage error, or None; fills in the preset options' defaults."""
    if not args.specfile and not args.preset:
        return "nothing to do: give spec files and/or --preset"
    if getattr(args, "target_env", None) and not args.dry_run:
        return "--target-env goes with --dry-run: plans are built for the machine they run on"
    given = [f"--{name}" for name in PRESET_DEFAULTS if getattr(args, name, None) is not None]
    if given and not args.preset:  # spec files carry their own batch, dtype and layout
        return f"{'/'.join(given)} shape the specs of --preset; give --preset too"
    for name, default in PRESET_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    return None


def parse_devices(text: str, count: int | None = None) -> list[int]:
    """`all` or comma-separated ordinals, checked against the GPUs this process sees; ValueError if not."""
    if count is None:
        from gpu_launch.driver import device_count

        count = device_count()
    if count == 0:
        raise ValueError("no CUDA GPU is visible")
    if text.strip().lower() == "all":
        return list(range(count))
    try:
        devices = [int(part, 10) for part in text.split(",")]
    except ValueError:
        raise ValueError("expected 'all' or GPU ordinals such as 0,1") from None
    bad = [d for d in devices if not 0 <= d < count]
    if bad:
        raise ValueError(f"no GPU {bad[0]} here (this process sees {count}: 0..{count - 1})")
    if len(set(devices)) != len(devices):
        raise ValueError("a GPU is listed twice")
    return devices


def _emit(sources: list[SpecSource], path: str, *, bad_lines: int) -> int:
    """The specs as a spec file (one canonical JSON line each), written atomically, for editing."""
    import os
    import tempfile

    from plan_cache._files import replace_regular

    from .recording import spec_line

    text = "".join(spec_line(source.spec) + "\n" for source in sources)
    if path == "-":  # as for spec files read: '-' is standard output, not a file named '-'
        sys.stdout.write(text)
        sys.stdout.flush()
        print(f"wrote {len(sources)} specs to standard output", file=sys.stderr)
        return 1 if bad_lines else 0
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".emit-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        replace_regular(temp, path)  # a FIFO or device named as the output is refused, never replaced
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    print(f"wrote {len(sources)} specs to {path}", file=sys.stderr)
    return 1 if bad_lines else 0


def _dry_run(sources: list[SpecSource], args) -> None:
    from .environment import environment, environment_from_file
    from .signature import signature

    env = environment_from_file(args.target_env) if getattr(args, "target_env", None) else environment(args.device)
    if getattr(args, "json", False):
        import json

        print(json.dumps({"environment": env.to_dict(), "specs": [
            {"signature": signature(s.spec, env), "where": s.where, "spec": s.spec.to_dict()} for s in sources]},
            indent=1))
        return
    for source in sources:
        print(f"{signature(source.spec, env)[:16]}  {describe_spec(source.spec)}  ({source.where})")
    print(f"{len(sources)} specs; signatures for {env.gpu_name}, cuDNN {env.cudnn_backend_version}", file=sys.stderr)


def describe_spec(spec) -> str:
    """One line with every parameter: op, shapes, stride, padding, dilation, groups, dtypes, layout, epilogue."""
    # Every given tensor: dy and w do not settle dgrad's x (stride), nor x and dy wgrad's w (kernel vs padding).
    roles = {"conv_fwd": ("x", "w"), "conv_bwd_data": ("dy", "w", "x"), "conv_bwd_filter": ("x", "dy", "w")}[spec.op]
    shapes = " ".join(f"{r}={'x'.join(map(str, getattr(spec, f'{r}_shape')))}" for r in roles)
    extra = [name for name in ("bias", "residual", "bias_grad") if getattr(spec, name, False)]
    for name in ("activation", "activation_backward"):
        act = getattr(spec, name, None)
        if act is not None and not act.is_identity:
            extra.append(str(act))
    for name in ("alpha", "beta"):
        if getattr(spec, name, 1.0) != 1.0:
            extra.append(f"{name}={getattr(spec, name)}")
    pads = ",".join(str(pre) if pre == post else f"{pre}/{post}" for pre, post in spec.padding)
    geometry = (f"s{','.join(map(str, spec.stride))} p{pads} d{','.join(map(str, spec.dilation))} g{spec.groups}")
    numerics = spec.dtype + (f"/{spec.compute_dtype}" if spec.compute_dtype != "float32" else "")
    if spec.dtype == "float32":
        numerics += " tf32" if spec.allow_tf32 else " no-tf32"
    explicit = "".join(f" {role}.strides={'x'.join(map(str, strides))}" for role, strides in spec.strides)
    return (f"{spec.op:16s} {shapes} {geometry} {numerics} {spec.layout}{explicit}"
            + (f" +{'+'.join(extra)}" if extra else ""))


def warmup_session(args, device: int):
    """The session a warm-up plans with on `device`; CudnnGraphsError when it would keep nothing."""
    from .plan import Session

    session = Session(device=device, cache=args.cache, policy="autotune" if args.autotune else "heuristic",
                      autotune_limit=args.autotune_limit)
    if session.store is None:
        from . import config

        if args.cache is None and config.cache_disabled():
            raise CudnnGraphsError(f"the plan cache is disabled ({config.DISABLE_CACHE} is set): a warm-up would "
                                   f"keep nothing; unset it, or pass --cache DIR")
        raise CudnnGraphsError("the plan cache could not be opened (see the warning above); nothing would be kept")
    return session


def _plan_all(sources: list[SpecSource], args) -> Summary:
    from .plan.session import flush_remote_writes

    session = warmup_session(args, args.device)
    summary = Summary()
    for i, source in enumerate(_progress(sources, args)):
        summary.add(*_plan_one(session, source))
        if i % RELEASE_EVERY == RELEASE_EVERY - 1:
            session.release_plans()  # stored already; a warm-up of thousands of specs must not hold them all
    flush_remote_writes()  # the remote gets every record before the command returns
    return summary


def _plan_one(session, source: SpecSource) -> tuple[str, float, str, str]:
    before = session.counters()  # not stats(): that scans the cache directory
    start = time.perf_counter()
    try:
        session.plan(source.spec)
    except UnsupportedGraphError as err:
        return "unsupported", time.perf_counter() - start, source.where, f"{describe_spec(source.spec)}: {err}"
    except Exception as err:  # one bad spec must not stop the warm-up of the rest
        return "failed", time.perf_counter() - start, source.where, f"{describe_spec(source.spec)}: " \
                                                                    f"{type(err).__name__}: {err}"
    after = session.counters()
    return _outcome(before, after), time.perf_counter() - start, "", ""


def _outcome(before: dict, after: dict) -> str:
    if after["autotuned"] > before["autotuned"]:
        return "autotuned"
    if after["builds"] > before["builds"] or after["rebuilds_from_heuristics"] > before["rebuilds_from_heuristics"]:
        return "built"
    return "cached"


def _progress(items, args, total: int | None = None) -> Iterator:
    if args.no_progress or not sys.stderr.isatty():
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc="warmup", unit="spec", file=sys.stderr, total=total))


def _print_summary(summary: Summary, args, *, bad_lines: int) -> None:
    if getattr(args, "json", False):
        import json

        print(json.dumps({"counts": summary.counts, "seconds": {k: round(v, 3) for k, v in summary.seconds.items()},
                          "by_device": {str(k): v for k, v in sorted(summary.by_device.items())},
                          "bad_lines": bad_lines, "problems": [{"where": w, "outcome": o, "message": m}
                                                               for w, o, m in summary.problems]}, indent=1))
        return
    rows = [(name, summary.counts[name], f"{summary.seconds[name]:.2f}") for name in OUTCOMES]
    total = (sum(summary.counts.values()), f"{sum(summary.seconds.values()):.2f}")
    width = max(len(r[0]) for r in rows)
    print(f"{'outcome':{width}s}  {'specs':>5s}  {'seconds':>8s}")
    for name, count, seconds in rows:
        print(f"{name:{width}s}  {count:5d}  {seconds:>8s}")
    print(f"{'total':{width}s}  {total[0]:5d}  {total[1]:>8s}")
    if summary.by_device:
        print("per GPU: " + ", ".join(f"{device}: {n} specs" for device, n in sorted(summary.by_device.items())))
    if bad_lines:
        print(f"{bad_lines} spec-file line(s) could not be read (listed above)")
    for where, outcome, message in summary.problems:
        print(f"{outcome}: {where}: {message}", file=sys.stderr)
