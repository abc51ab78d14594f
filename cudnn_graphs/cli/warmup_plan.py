"""The planning core of a warm-up, shared by `warmup` (one GPU, in this process) and `warmup --devices`
(a worker per GPU): where a spec came from, the summary, the session a warm-up plans with, one spec
planned and its outcome, the progress bar."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import CudnnGraphsError, UnsupportedGraphError

OUTCOMES = ("cached", "built", "autotuned", "unsupported", "failed")
RELEASE_EVERY = 256  # specs a warm-up plans between letting go of the plans it stored

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
    # GPU ordinal -> {"first_s", "last_s": its first and last result after the specs were queued,
    # "busy_s": its planning time}: where a multi-GPU warm-up's time goes (start-up, uneven split)
    device_timing: dict = field(default_factory=dict)

    def add(self, outcome: str, seconds: float, where: str = "", message: str = "") -> None:
        self.counts[outcome] += 1
        self.seconds[outcome] += seconds
        if message:
            self.problems.append((where, outcome, message))


def describe_spec(spec) -> str:
    """One line with every parameter: op, shapes, stride, padding, dilation, groups, dtypes, layout, epilogue."""
    # Every given tensor: dy and w do not settle dgrad's x (stride), nor x and dy wgrad's w (kernel vs padding).
    roles = {"conv_fwd": ("x", "w"), "conv_bwd_data": ("dy", "w", "x"), "conv_bwd_filter": ("x", "dy", "w")}[spec.op]
    shapes = " ".join(f"{r}={'x'.join(map(str, getattr(spec, f'{r}_shape')))}" for r in roles)
    extra = [name for name in ("bias", "residual", "bias_grad", "stats") if getattr(spec, name, False)]
    if getattr(spec, "prologue", None):
        extra.append(spec.prologue)
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
    from ..plan import Session

    session = Session(device=device, cache=args.cache, policy="autotune" if args.autotune else "heuristic",
                      autotune_limit=args.autotune_limit)
    if session.store is None:
        from .. import config

        if args.cache is None and config.cache_disabled():
            raise CudnnGraphsError(f"the plan cache is disabled ({config.DISABLE_CACHE} is set): a warm-up would "
                                   f"keep nothing; unset it, or pass --cache DIR")
        raise CudnnGraphsError("the plan cache could not be opened (see the warning above); nothing would be kept")
    return session


def plan_one(session, source: SpecSource) -> tuple[str, float, str, str]:
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


def progress(items, args, total: int | None = None) -> Iterator:
    if args.no_progress or not sys.stderr.isatty():
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc="warmup", unit="spec", file=sys.stderr, total=total))
