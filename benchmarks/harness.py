"""The measuring every benchmark (and every kept probe in tools/) shares: one implementation of each method.

Timing (GPU; torch is imported only inside the functions, so this module imports anywhere):

- `host_us`: host time per call with the GPU held busy by a queued sleep kernel, so the host never waits
  for the device (what a training loop's host spends on a call);
- `latency_ms`: one call from an idle GPU, CUDA events around it (what a step sees when the host cannot
  run ahead);
- `device_ms` / `device_samples` / `DeviceTime`: blocks of back-to-back calls between CUDA events, queued
  behind a sleep so launch gaps do not count (device time alone); with `sleep_cycles=0`, launch gaps
  included; a block queued after its sleep ended is host-bound, and the figure keeps that count
  (`DeviceMs.host_bound`, `DeviceTime.flags`; `above_wall` flags a device figure above its wall time);
- `wall_ms`: host wall time of back-to-back calls, synchronised before and after;
- `behind_sleep`: the host time of one step with ~1 s of GPU work queued, and whether it waited for it;
- `kernel_us`: torch.profiler's CUDA kernels of some calls, device us per call by kernel name.

Rounds: `interleaved` alternates candidates (ours, torch's ...) round by round and keeps the medians, so
both see the same host; hosts drift by 20-50 % between runs, so compare within a run.
Checks: `rel_err` against a float64 reference, `poisoned_like` / `spec_buffers` for outputs that must be
written (NaN until then). Children a benchmark starts: `die_with_parent`. Output: `write_json` (with
`metadata()`: commit and dirty flag, source digest, device, driver, torch, cuDNN, frontend and library versions,
command line, date; one run of one command a file) and `png` / `bar_chart` (matplotlib optional: without it a
one-line note and no PNG).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]  # the repository: fresh processes start here (`-m benchmarks.x`)

# torch.cuda._sleep cycles: ~0.1 s at an H100's ~1.9 GHz, longer than the host needs to queue the calls
# of one sample; the host figures use longer ones where a sample queues more.
SLEEP_DEVICE = int(2e8)
SLEEP_STALL = int(2e9)  # ~1 s: "behind queued work"


def _torch():
    import torch

    return torch


def _events():
    torch = _torch()
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def sleep(cycles: int) -> None:
    """Queue a kernel that spins for `cycles` GPU clock cycles on the current stream."""
    if cycles:
        _torch().cuda._sleep(int(cycles))


def sleep_cycles_for(ms: float) -> int:
    """torch.cuda._sleep cycles lasting about `ms` on this GPU (calibrated once, from one 1e6-cycle sleep)."""
    start, end = _events()
    sleep(1000)
    start.record()
    sleep(10**6)
    end.record()
    end.synchronize()
    return int(10**6 * ms / max(start.elapsed_time(end), 1e-3))


# -- timing -------------------------------------------------------------------------------------------

def host_us(fn: Callable, *, calls: int, rounds: int = 1, sleep_cycles: int = SLEEP_DEVICE,
            nan_if_drained: bool = False) -> float:
    """Median over `rounds` of host us per call of `calls` calls, each round queued behind a sleep of
    `sleep_cycles` (0: none, the GPU idle at the start). `nan_if_drained`: a round whose queue drained
    before the host finished is NaN (a call waited for the GPU: not a host figure)."""
    torch = _torch()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        sleep(sleep_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - start) / calls * 1e6
        drained = nan_if_drained and torch.cuda.current_stream().query()
        samples.append(float("nan") if drained else elapsed)
    torch.cuda.synchronize()
    return median(samples)


def latency_ms(fn: Callable, *, reps: int = 25) -> float:
    """Median ms of one call from an idle GPU: CUDA events around it, the device synchronised before."""
    torch = _torch()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = _events()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return median(samples)


def device_samples(fn: Callable, *, calls: int, rounds: int, sleep_cycles: int = SLEEP_DEVICE,
                   warmup: int = 0) -> tuple[list[float], int]:
    """ms per call of `rounds` blocks of `calls` back-to-back calls between CUDA events, after `warmup`
    calls. With `sleep_cycles`, each block is queued behind a sleep from an idle GPU, so the host's
    launch gaps do not count; the second value counts the blocks whose sleep was over before the block
    was queued (host-bound: launch gaps counted after all)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = _events()
    samples, host_bound = [], 0
    for _ in range(rounds):
        if sleep_cycles:
            torch.cuda.synchronize()
            sleep(sleep_cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host_bound += bool(sleep_cycles) and bool(start.query())
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return samples, host_bound


class DeviceMs(float):
    """A device-time figure in ms that keeps how it was taken: `host_bound` of its `blocks` were queued after
    their sleep had ended, so launch gaps count in them (the host, not the device, set their pace)."""

    def __new__(cls, ms: float, *, host_bound: int = 0, blocks: int = 0):
        figure = super().__new__(cls, ms)
        figure.host_bound, figure.blocks = host_bound, blocks
        return figure

    def record(self) -> dict:
        """The figure for a results file: {"ms", "host_bound_blocks", "blocks"}."""
        return {"ms": float(self), "host_bound_blocks": self.host_bound, "blocks": self.blocks}


def device_ms(fn: Callable, *, calls: int, rounds: int = 1, sleep_cycles: int = SLEEP_DEVICE,
              warmup: int = 0) -> DeviceMs:
    """Median of `device_samples`: back-to-back device ms per call, a `DeviceMs` that keeps how many blocks
    were host-bound (a figure with any is not device time alone: report the flag with it)."""
    samples, host_bound = device_samples(fn, calls=calls, rounds=rounds, sleep_cycles=sleep_cycles, warmup=warmup)
    return DeviceMs(median(samples), host_bound=host_bound, blocks=len(samples))


class DeviceTime:
    """An `interleaved` measure: `device_samples` of `blocks` blocks of `calls` calls per round, keeping per
    candidate how many blocks were host-bound (`flags`), which a median alone would drop."""

    def __init__(self, *, calls: int, blocks: int = 1, sleep_cycles: int = SLEEP_DEVICE, warmup: int = 0):
        self.calls, self.per_round, self.sleep_cycles, self.warmup = calls, blocks, sleep_cycles, warmup
        self.host_bound: dict = {}
        self.blocks: dict = {}

    def __call__(self, fn: Callable) -> list[float]:
        samples, host_bound = device_samples(fn, calls=self.calls, rounds=self.per_round,
                                             sleep_cycles=self.sleep_cycles, warmup=self.warmup)
        self.host_bound[fn] = self.host_bound.get(fn, 0) + host_bound
        self.blocks[fn] = self.blocks.get(fn, 0) + len(samples)
        return samples

    def flags(self, candidates: dict[str, Callable]) -> dict[str, dict[str, int]]:
        """{candidate: {"host_bound_blocks", "blocks"}}."""
        return {name: {"host_bound_blocks": self.host_bound.get(fn, 0), "blocks": self.blocks.get(fn, 0)}
                for name, fn in candidates.items()}


def above_wall(device: float, wall: float) -> bool:
    """A "device" figure above the wall time of the same work cannot be device time alone (launch gaps or a
    host stall got in): flag it beside the figure, never drop it silently."""
    return not (math.isnan(device) or math.isnan(wall)) and device > wall


def wall_ms(fn: Callable, *, calls: int = 1, rounds: int = 1) -> float:
    """Median over `rounds` of host wall ms per call of `calls` back-to-back calls, synchronised before and
    after (host overhead included: what a loop sees when the host is the bottleneck)."""
    torch = _torch()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    return median(samples)


def behind_sleep(step: Callable, *, cycles: int = SLEEP_STALL) -> dict:
    """The host ms of one `step` with ~`cycles` of GPU sleep queued ahead, whether the GPU was still busy
    after it, and whether it waited (took > 0.2 s and left the GPU idle; a direct launch that waited
    leaves its own kernel running, so busy-after alone does not tell)."""
    torch = _torch()
    torch.cuda.synchronize()
    sleep(cycles)
    start = time.perf_counter()
    step()
    took = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"host_ms": round(took * 1e3, 3), "gpu_busy_after": busy, "waited": took > 0.2 and not busy}


def kernel_us(fn: Callable, *, calls: int, warmup: int = 1) -> dict[str, float]:
    """{kernel name as torch.profiler keys it: device us per call} of `calls` calls of `fn` (CUDA
    activity only: kernels, memsets, copies), after `warmup` calls."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = ev.self_device_time_total
        if us > 0 or ev.device_type.name == "CUDA":
            out[ev.key] = out.get(ev.key, 0.0) + us / calls
    return out


# -- rounds and their summaries -----------------------------------------------------------------------

def median(samples: Iterable[float]) -> float:
    """statistics.median, NaN for no samples."""
    samples = list(samples)
    return statistics.median(samples) if samples else float("nan")


def interleaved(candidates: dict[str, Callable], measures: dict[str, Callable], *, rounds: int,
                by: str = "measure") -> dict[str, dict[str, float]]:
    """{measure: {candidate: median}}: each round runs every measure on every candidate, then the next
    round, so drift hits all alike; each round starts one candidate later (A B C, B C A, C A B ...), so
    no candidate always runs right after the same other one. `measures[m](candidate)` returns one
    sample or a list of them. by="measure": a round goes measure by measure (A's host, B's host, A's
    latency ...); by="candidate": candidate by candidate (A's host, A's latency, ..., then B's)."""
    if by not in ("measure", "candidate"):
        raise ValueError(f"by: 'measure' or 'candidate', not {by!r}")
    samples = {m: {c: [] for c in candidates} for m in measures}
    names = list(candidates)
    for r in range(rounds):
        turn = names[r % len(names):] + names[:r % len(names)] if names else []
        order = ([(m, c) for m in measures for c in turn] if by == "measure"
                 else [(m, c) for c in turn for m in measures])
        for m, c in order:
            got = measures[m](candidates[c])
            samples[m][c].extend(got if isinstance(got, (list, tuple)) else [got])
    return {m: {c: median(v) for c, v in per.items()} for m, per in samples.items()}


def ratio(baseline: float, ours: float) -> float:
    """baseline / ours (a speed-up when both are times): NaN where either is missing or ours is 0."""
    if not ours or baseline is None or ours is None or math.isnan(baseline) or math.isnan(ours):
        return float("nan")
    return baseline / ours


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# -- correctness --------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    """‖got - want‖ / ‖want‖ in float64 (torch tensors); inf where `got` holds a NaN (an output never
    written keeps its poison)."""
    torch = _torch()
    got, want = got.double(), want.double()
    if torch.isnan(got).any():
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def poisoned_like(t):
    """A tensor shaped, strided and typed as `t`, filled with NaN: an output the code under test must write."""
    return _torch().full_like(t, float("nan"))


OUTPUT_ROLES = ("y", "dx", "dw", "db")  # a spec's roles the plan writes


def spec_buffers(spec, framework: str = "torch") -> dict:
    """Buffers for every role of a conv `spec` as its tensors() describe them (shape, strides, dtype) on
    CUDA, through torch or CuPy: inputs N(0, 1), outputs NaN."""
    out = {}
    for role, desc in spec.tensors().items():
        if framework == "torch":
            torch = _torch()
            t = torch.empty_strided(desc.shape, desc.strides, dtype=getattr(torch, desc.dtype), device="cuda")
            out[role] = t.normal_() if role not in OUTPUT_ROLES else t.fill_(float("nan"))
        else:
            import cupy as cp

            dtype = cp.dtype(desc.dtype)
            extent = 1 + sum((n - 1) * st for n, st in zip(desc.shape, desc.strides))
            flat = cp.empty(extent, dtype=dtype)
            if role in OUTPUT_ROLES:
                flat.fill(float("nan"))
            else:
                flat[...] = cp.random.standard_normal(extent, dtype=cp.float32)
            out[role] = cp.ndarray(desc.shape, dtype, flat.data,
                                   strides=tuple(dtype.itemsize * st for st in desc.strides))
    return out


def conv2d_reference(x, w, dy, *, bias=None, stride=1, padding=0) -> dict:
    """float64 torch on the same (rounded) inputs: {"y": relu(conv(x, w) + bias), "dx", "dw"} of
    conv(x, w) for the gradient dy."""
    torch = _torch()
    import torch.nn.functional as F

    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    out = F.conv2d(xd, wd, stride=stride, padding=padding)
    out.backward(dy.double())
    pre = out.detach() if bias is None else out.detach() + bias.double().view(1, -1, 1, 1)
    return {"y": torch.relu(pre), "dx": xd.grad, "dw": wd.grad}


# -- fresh processes ----------------------------------------------------------------------------------

def fresh_env(pycache=None, *, base: dict | None = None, drop_prefix: str | None = None, **variables) -> dict:
    """The environment of a timed fresh process: `base` (default os.environ) less the variables starting
    with `drop_prefix`, plus `variables`. With `pycache`, bytecode goes under that private prefix (written
    by the first children; an installed package has its .pyc files, while a copied checkout or a read-only
    site-packages would compile every import) and PYTHONDONTWRITEBYTECODE (set on some hosts) is removed."""
    env = dict(os.environ if base is None else base)
    if drop_prefix:
        env = {k: v for k, v in env.items() if not k.startswith(drop_prefix)}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    env.update({k: str(v) for k, v in variables.items()})
    return env


def die_with_parent() -> None:
    """A `preexec_fn` for benchmark children: the kernel kills the child when its parent dies (a time
    limit's SIGKILL leaves no rank or model child holding a GPU; Linux only, elsewhere nothing)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_fresh(args: list[str], *, env: dict | None = None, timeout: float | None = None, json_lines: bool = True):
    """Run `python *args` (e.g. ["-m", "benchmarks.cache", "--child"]) in the repository root; raise with
    its stderr's tail if it fails. Returns its last stdout line as JSON (`json_lines`), else all stdout
    parsed as JSON."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1] if json_lines else done.stdout)


# -- output -------------------------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


# what every results file records (`metadata()`); a stored file written before it says why it lacks them in
# a top-level "legacy" entry instead (tests/test_benchmarks.py holds both to it)
PROVENANCE = ("commit", "dirty", "device", "driver", "torch", "cudnn_torch", "cudnn_backend", "cudnn_frontend",
              "cudnn_graphs", "argv", "date")
# the code a result measures: its digest identifies it where no git is (a copy of the working tree on a GPU host)
SOURCE_DIRS = ("cudnn_graphs", "fallback_kernels", "gpu_launch", "plan_cache", "benchmarks")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")
# where git is not there to ask, the command's caller says which commit the tree is (`BENCHMARK_COMMIT=$(git
# rev-parse HEAD) BENCHMARK_DIRTY=$(git status --porcelain -uno | grep -q . && echo 1 || echo 0)`)
COMMIT_VARIABLE, DIRTY_VARIABLE = "BENCHMARK_COMMIT", "BENCHMARK_DIRTY"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the library's and the benchmarks' source files (path and bytes, sorted; results excluded)."""
    import hashlib

    digest = hashlib.sha256()
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "results" not in path.relative_to(root).parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def revision() -> dict:
    """{"commit", "dirty", "commit_from", "source_sha256"}: git's HEAD and whether tracked files differ from it
    (results files aside: a run rewriting its own result is not a code change), else $BENCHMARK_COMMIT /
    $BENCHMARK_DIRTY (commit_from "environment"), else None (commit_from None)."""
    out = {"commit": None, "dirty": None, "commit_from": None, "source_sha256": source_digest()}
    head = _git("rev-parse", "HEAD")
    if head:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
        out.update(commit=head.strip(), dirty=None if status is None else bool(status.strip()), commit_from="git")
    elif os.environ.get(COMMIT_VARIABLE):
        dirty = os.environ.get(DIRTY_VARIABLE)
        out.update(commit=os.environ[COMMIT_VARIABLE], commit_from="environment",
                   dirty=None if dirty is None else dirty not in ("", "0", "false"))
    return out


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version ("580.65.06"), from /proc or nvidia-smi; None without one."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        import re

        found = re.search(r"Kernel Module(?: for \w+)?\s+([\d.]+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def _cudnn_backend() -> int | None:
    """libcudnn's version as this library loads it (the frontend's backend), None where none loads."""
    try:
        if "cudnn" in sys.modules:  # the frontend's module; its backend_version loads libcudnn
            return int(sys.modules["cudnn"].backend_version())
        from cudnn_graphs.execute import cudnn_backend

        return int(cudnn_backend.lib().cudnnGetVersion())
    except Exception:  # noqa: BLE001 - no libcudnn here
        return None


def _library_version() -> str | None:
    try:
        from cudnn_graphs._version import __version__

        return __version__
    except ImportError:
        return _version("cudnn-graphs")


def metadata() -> dict:
    """Where and what a result measured: the commit (and whether the tree differed from it) and a digest of
    the source, the device and its driver, torch / cuDNN (torch's and this library's) / frontend / library /
    CuPy versions, Python, the command line and the time. Works without a GPU (device and driver None)."""
    meta = {**revision(), "device": None, "device_count": 0, "driver": driver_version(), "torch": None,
            "cuda": None, "cudnn_torch": None, "cudnn_backend": _cudnn_backend(),
            "cudnn_frontend": _version("nvidia-cudnn-frontend"), "cudnn_graphs": _library_version(), "cupy": None,
            "python": platform.python_version(), "argv": [sys.executable, *sys.argv],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch

        meta.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            meta.update(device=torch.cuda.get_device_name(), device_count=torch.cuda.device_count(),
                        cudnn_torch=torch.backends.cudnn.version())
    except ImportError:
        pass
    if "cupy" in sys.modules:
        meta["cupy"] = sys.modules["cupy"].__version__
    return meta


def write_json(path, result: dict) -> Path:
    """Write `result` as indented JSON with a "meta" entry (`metadata()`) first; returns the path. One run of
    one command writes one file: a result is never merged into an earlier one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": metadata(), **result}, indent=1, default=str))
    return path


def png(path, draw: Callable) -> Path | None:
    """`draw(plt)` returns a matplotlib figure, saved at `path`; without matplotlib, a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path}", file=sys.stderr)
        return None
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def bar_chart(path, groups: dict[str, dict[str, float]], *, title: str, ylabel: str,
              baseline: float | None = None) -> Path | None:
    """Grouped bars: one group a row (an entry point, a kernel call), one bar a series (ours, torch); a
    series a group lacks leaves a gap. `baseline`: a horizontal line there (1.0 for speed-ups)."""
    def draw(plt):
        series = list(dict.fromkeys(s for bars in groups.values() for s in bars))
        width = 0.8 / max(len(series), 1)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) + 2), 4.5))
        for i, name in enumerate(series):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            heights = [groups[g].get(name, float("nan")) for g in groups]
            bars = ax.bar(xs, heights, width, label=name)
            ax.bar_label(bars, labels=["" if math.isnan(h) else f"{h:.3g}" for h in heights], fontsize=7)
        if baseline is not None:
            ax.axhline(baseline, color="k", lw=0.8)
        ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        return fig

    return png(path, draw)


def title(result: dict, what: str) -> str:
    """A plot title: what, on which device, with which torch."""
    meta = result.get("meta", {})
    device = result.get("device") or meta.get("device") or "?"
    return f"{what}: {device}, torch {result.get('torch') or meta.get('torch') or '?'}"
