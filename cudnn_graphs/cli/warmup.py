"""`cudnn-graphs warmup`: plan specs ahead of a job so its first step finds every plan on disk."""

from __future__ import annotations

import sys
from typing import Any

from ..errors import CudnnGraphsError, NoGpuError, SpecError
from ..recording import read_spec_file
from ..spec import spec_from_dict
from .warmup_plan import OUTCOMES, RELEASE_EVERY, SpecSource, Summary, describe_spec, plan_one, progress, warmup_session

PRESET_DEFAULTS = {"batch": 32, "dtype": "float16", "layout": "channels_last"}


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
        from ..presets import preset_specs

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
    from ..environment import gpu_problem

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

    from ..recording import spec_line

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
    from ..environment import environment, environment_from_file
    from ..signature import signature

    env = environment_from_file(args.target_env) if getattr(args, "target_env", None) else environment(args.device)
    if getattr(args, "json", False):
        import json

        print(json.dumps({"environment": env.to_dict(), "specs": [
            {"signature": signature(s.spec, env), "where": s.where, "spec": s.spec.to_dict()} for s in sources]},
            indent=1))
        return
    for source in sources:
        print(f"{signature(source.spec, env)[:16]}  {describe_spec(source.spec)}  ({source.where})")
    print(f"{len(sources)} specs; {_signatures_for(env)}", file=sys.stderr)


def _signatures_for(env) -> str:
    if env.has_gpu:
        return f"signatures for {env.gpu_name}, cuDNN {env.cudnn_backend_version}"
    return ("signatures for this machine, which has no GPU: no GPU's plans have them (--target-env FILE gives "
            "another machine's, from the JSON `cudnn-graphs env` printed there)")


def _plan_all(sources: list[SpecSource], args) -> Summary:
    from ..plan.tiers import flush_remote_writes

    session = warmup_session(args, args.device)
    summary = Summary()
    for i, source in enumerate(progress(sources, args)):
        summary.add(*plan_one(session, source))
        if i % RELEASE_EVERY == RELEASE_EVERY - 1:
            session.release_plans()  # stored already; a warm-up of thousands of specs must not hold them all
    flush_remote_writes()  # the remote gets every record before the command returns
    return summary


def _print_summary(summary: Summary, args, *, bad_lines: int) -> None:
    if getattr(args, "json", False):
        import json

        print(json.dumps({"counts": summary.counts, "seconds": {k: round(v, 3) for k, v in summary.seconds.items()},
                          "by_device": {str(k): v for k, v in sorted(summary.by_device.items())},
                          "device_timing": {str(k): v for k, v in sorted(summary.device_timing.items())},
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
