"""Benchmark (GPU host): torchvision, timm and hand-written networks with `cudnn_graphs.torch.convert` against torch, one run.

    python -m benchmarks.models --out models.json [--models resnet50 timm:convnext_tiny resnet18_hand ...]
                                [--no-graphs] [--no-compile] [--plot models.png]
    python -m benchmarks.models --smoke --out smoke.json      # a short GPU check: resnet18_hand, small batches
    python -m benchmarks.models --plot-from models.json [--plot models.png]   # redraw, no GPU
    python -m benchmarks.models --table-from models.json      # the per-model table, no GPU

Models: a torchvision constructor name (`resnet50`), `timm:<name>` (`timm.create_model(name, pretrained=False)`;
the timm defaults are listed when timm imports), or `resnet18_hand`: a ResNet-18 written here with plain
modules (conv -> bn -> `F.relu` in `forward`, the residual added, relu functional; torchvision's parameter
names, none of its classes), the way users write their own networks. Every run of one command writes one
results file (`--out`, rewritten after each model) with the harness's provenance.

Each model runs in a fresh child process (the same command with `--one NAME`), so CUDA graphs' memory pools,
the profiler and a failure stay with that model. The child prints its result so far as one JSON line as
each part ends; the parent echoes them, keeps the last, rewrites --out after each model and goes on to the
next model when one fails or passes --model-timeout.

Per model (AMP fp16 autocast, channels_last, `cudnn.benchmark=True`: torch autotunes in every process,
ours plans a geometry first seen with the autotune policy and keeps it in the plan cache):
- train: a step (forward, cross-entropy, backward, SGD) at --train-batch; the candidates run in the same
  interleaved rounds:
    torch          torch eager;
    ours           `convert(model)` eager (parameters of its own, the same initialisation): convs outside
                   fused runs train through torch's conv (`train_convs="torch"`, the default);
    ours_plans     with --plans (default on), `convert(model, train_convs="cudnn_graphs")`: those convs
                   on this library's plans and autograd node instead (the A/B behind that default);
    torch_aa       with --aa (default on), a second copy of torch's model: torch / torch_aa (`aa_ratio`)
                   is this run's noise between identical candidates, the band the other ratios sit in;
    torch_graphed  `torch.cuda.make_graphed_callables(model, (static_x,))` as a careful torch user must
                   write it: under `torch.autocast(..., cache_enabled=False)`, its own warm-up on a side
                   stream (num_warmup_iters=3), a static input of its own that each batch is copied into;
    ours_graphed   `cudnn_graphs.torch.capture(convert(model), (x,))` under
                   `torch.autocast("cuda", dtype=torch.float16)` (which does all of that itself);
    torch_compile  `torch.compile(model)` (--no-compile drops both compiled candidates);
    ours_compile   `torch.compile(convert(model))`.
  Loss, backward and SGD run outside the graphs on both sides, as `capture` leaves them; `--no-graphs`
  drops the two graphed candidates. A candidate that fails to build or in its warm-up steps is left out,
  its error in `errors`. Per candidate and step:
    wall ms (the main number): CUDA events around blocks of --steps steps, no sleep ahead, medians;
    host ms: one step queued behind a sleep kernel, so the host never waits for the GPU (a sample whose
      sleep was over before the host had queued the whole step is dropped: the host waited for the GPU,
      e.g. on a full launch queue of ~1000 launches; `train_host_dropped` counts them);
    device ms, two ways: `train_device_ms`, the profiler's kernel sum (`harness.kernel_us`, 3 steps;
      taken last, after inference and the loss curves, as the profiler can leave CUPTI attached), and
      `train_device_events_ms`, CUDA events around the step behind that sleep (no launch gaps).
  `train_ratios`: torch / ours of each figure, eager (torch vs ours), graphed (torch_graphed vs
  ours_graphed) and compiled (torch_compile vs ours_compile); the summary's `ratio_geomeans` are their
  geo-means over the models.
- infer: ms per forward at --infer-batch under no_grad, interleaved: the model in float16 (`.half()`),
  torch against ours `convert(model.eval(), inference=True)` (BatchNorm folded, epilogues fused), each also
  compiled (`torch_compile`, `ours_compile`); and float32 weights under `torch.autocast(float16)`
  (`torch_autocast`, `ours_autocast`), as mixed-precision serving runs them.
- losses: --loss-steps training steps from one initialisation on fixed random batches, both losses.
The float32 check and the loss curves run with `cudnn.benchmark` off (correctness only; no autotuning of
their geometries). Plans are built (or loaded) before timing: the first iteration is
`benchmarks.first_iteration`'s subject. Inputs are random; outputs of ours and torch's are compared once per model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import harness

TORCHVISION = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_800mf")
TIMM = ("timm:resnet50", "timm:efficientnet_b0", "timm:convnext_tiny", "timm:mobilenetv3_large_100", "timm:resnet18")
HAND = "resnet18_hand"
SMOKE = {"models": [HAND], "train_batch": 16, "infer_batch": 8, "rounds": 2, "steps": 2, "loss_steps": 2,
         "model_timeout": 420.0}
# the pairs each ratio compares (torch's side first) and the figures compared
PAIRS = {"eager": ("torch", "ours"), "graphed": ("torch_graphed", "ours_graphed"), "plans": ("torch", "ours_plans"),
         "aa": ("torch", "torch_aa"), "compile": ("torch_compile", "ours_compile")}
INFER_PAIRS = {"half": ("torch", "ours"), "compile": ("torch_compile", "ours_compile"),
               "autocast": ("torch_autocast", "ours_autocast")}
TABLE_CANDIDATES = ("torch", "torch_graphed", "torch_compile", "ours", "ours_graphed", "ours_compile")
FIGURES = {"wall": "train_ms", "host": "train_host_ms", "device": "train_device_ms",
           "device_events": "train_device_events_ms"}
PROFILED_STEPS = 3


def default_models() -> list[str]:
    """torchvision's five, the hand-written ResNet-18, and timm's five where timm imports."""
    import importlib.util

    return [*TORCHVISION, HAND, *(TIMM if importlib.util.find_spec("timm") else ())]


def hand_resnet18(num_classes: int = 1000):
    """A ResNet-18 as a user writes one: plain nn.Conv2d / nn.BatchNorm2d / nn.Linear modules, `F.relu` called
    in each `forward`, the residual added by hand; torchvision's parameter names (a torchvision resnet18
    loads its state_dict), none of its classes."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                               if stride != 1 or cin != cout else None)

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            widths = (64, 128, 256, 512)
            for i, width in enumerate(widths):
                cin = widths[max(i - 1, 0)]
                setattr(self, f"layer{i + 1}", nn.Sequential(Block(cin, width, 1 if i == 0 else 2),
                                                             Block(width, width, 1)))
            self.fc = nn.Linear(512, num_classes)
            for m in self.modules():  # torchvision's initialisation, so the two train alike
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    return ResNet18()


def build(name: str):
    """The model `name` names (see the module's docstring), randomly initialised."""
    if name == HAND:
        return hand_resnet18()
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name.removeprefix("timm:"), pretrained=False)
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def alternate(steps_by_name: dict, *, rounds: int, steps: int) -> dict[str, float]:
    """{name: median ms per step}: CUDA events around blocks of `steps` steps, the candidates' blocks
    alternating round by round."""
    block = {"ms": lambda step: harness.device_ms(step, calls=steps, sleep_cycles=0)}
    return harness.interleaved(steps_by_name, block, rounds=rounds)["ms"]


def train_step(model, opt, x, target):
    import torch

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def torch_graphed(model, x):
    """`model` graphed by `torch.cuda.make_graphed_callables` the way torch's documentation asks for
    under AMP: autocast's cast cache off while graphing, a static input (a copy of the batch: each call
    with another tensor copies it in, as each new batch of a loader would), warm-up steps on a side
    stream before capture (make_graphed_callables runs them). Returns the module, its forward replaced."""
    import torch

    static_x = x.clone()
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        return torch.cuda.make_graphed_callables(model, (static_x,), num_warmup_iters=3)


def ours_graphed(model, x):
    """`capture(convert(model), (x,))` under the autocast the loop runs in, as its docstring shows."""
    import torch

    import cudnn_graphs.torch as cgt

    with torch.autocast("cuda", dtype=torch.float16):
        return cgt.capture(cgt.convert(model), (x,))


class BehindSleep:
    """An `interleaved` measure: host ms of one step queued behind a sleep of `cycles`, and (kept in
    `device`, by step) the CUDA events' ms around it. A sample is kept only where the sleep was still
    running when the host had queued the step (the host never waited, and the step's kernels ran back to
    back); the others are counted in `dropped`."""

    def __init__(self, cycles: int):
        self.cycles = cycles
        self.device: dict = {}
        self.dropped: dict = {}

    def __call__(self, step) -> list[float]:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        harness.sleep(self.cycles)
        start.record()
        began = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - began) * 1e3
        end.record()
        in_time = not start.query()  # the sleep still running: nothing of the step has started yet
        end.synchronize()
        if not in_time:
            self.dropped[step] = self.dropped.get(step, 0) + 1
            return []
        self.device.setdefault(step, []).append(start.elapsed_time(end))
        return [host_ms]


def profiled_ms(step) -> float:
    """Device ms per step: the profiler's CUDA kernels, memsets and copies summed (NaN if it saw none)."""
    total = sum(harness.kernel_us(step, calls=PROFILED_STEPS, warmup=1).values()) / 1e3
    return total if total > 0 else float("nan")


def train_ratios(out: dict) -> dict[str, dict[str, float]]:
    """{pair: {figure: torch's / ours}} of one model's result (NaN where either is missing)."""
    return {pair: {figure: harness.ratio(out.get(key, {}).get(theirs), out.get(key, {}).get(ours))
                   for figure, key in FIGURES.items()}
            for pair, (theirs, ours) in PAIRS.items()}


def emit(out: dict, phase: str) -> None:
    """One JSON line: the model's result so far (what the parent keeps if the child stops after it)."""
    print(json.dumps({**out, "phase": phase}, default=str), flush=True)


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:1000]


def warmed(steps: dict, errors: dict, *, calls: int = 3) -> dict:
    """`steps` less those that raise in `calls` warm-up calls (plans built, kernels loaded, autotuned by
    torch, compiled, SGD's state), their errors kept in `errors`."""
    import torch

    kept = {}
    for key, step in steps.items():
        try:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            kept[key] = step
        except Exception as err:  # noqa: BLE001 - reported; the other candidates still run
            errors[key] = _error(err)
    return kept


def bench_model(name: str, args) -> dict:
    import torch

    import cudnn_graphs.torch as cgt

    cl = torch.channels_last
    torch.manual_seed(0)
    base = build(name).cuda().to(memory_format=cl)
    out: dict = {"model": name, "device": torch.cuda.get_device_name(), "errors": {}}
    t0 = time.perf_counter()

    # -- training steady state --------------------------------------------------------------------
    x = torch.randn(args.train_batch, 3, 224, 224, device="cuda").contiguous(memory_format=cl)
    target = torch.randint(0, 1000, (args.train_batch,), device="cuda")
    models = {"torch": copy.deepcopy(base), "ours": cgt.convert(copy.deepcopy(base))}
    out["converted"] = len(models["ours"].cudnn_graphs_report.replaced)
    if args.plans:
        models["ours_plans"] = cgt.convert(copy.deepcopy(base), train_convs="cudnn_graphs")
    if args.aa:
        models["torch_aa"] = copy.deepcopy(base)
    if args.graphs:
        for key, make in (("torch_graphed", torch_graphed), ("ours_graphed", ours_graphed)):
            try:
                models[key] = make(copy.deepcopy(base), x)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - reported; the other candidates still run
                out["errors"][key] = _error(err)
    if args.compile:
        for key, make in (("torch_compile", lambda m: m), ("ours_compile", cgt.convert)):
            try:
                models[key] = torch.compile(make(copy.deepcopy(base)))
            except Exception as err:  # noqa: BLE001 - reported; the other candidates still run
                out["errors"][key] = _error(err)
    steps = {k: train_step(m, torch.optim.SGD(m.parameters(), lr=1e-4), x, target) for k, m in models.items()}
    steps = warmed(steps, out["errors"])
    out["setup_s"] = round(time.perf_counter() - t0, 1)
    # a sleep well past the slowest candidate's step, so each host sample is queued behind it
    out["train_sleep_ms"] = round(max(50.0, 3 * max(harness.wall_ms(s, calls=3) for s in steps.values())), 1)
    behind = BehindSleep(harness.sleep_cycles_for(out["train_sleep_ms"]))
    measures = {"wall": lambda step: harness.device_ms(step, calls=args.steps, sleep_cycles=0), "host": behind}
    got = harness.interleaved(steps, measures, rounds=args.rounds)
    out["train_ms"], out["train_host_ms"] = got["wall"], got["host"]
    out["train_device_events_ms"] = {k: harness.median(behind.device.get(s, [])) for k, s in steps.items()}
    out["train_host_dropped"] = {k: behind.dropped.get(s, 0) for k, s in steps.items()}
    out["train_speedup"] = harness.ratio(got["wall"].get("torch"), got["wall"].get("ours"))
    out["compile_speedup"] = harness.ratio(got["wall"].get("torch_compile"), got["wall"].get("ours_compile"))
    out["graphed_speedup"] = harness.ratio(got["wall"].get("torch_graphed"), got["wall"].get("ours_graphed"))
    out["plans_speedup"] = harness.ratio(got["wall"].get("torch"), got["wall"].get("ours_plans"))
    out["aa_ratio"] = harness.ratio(got["wall"].get("torch"), got["wall"].get("torch_aa"))
    out["train_ratios"] = train_ratios(out)
    emit(out, "train")  # kept if a time limit cuts the rest

    # -- inference --------------------------------------------------------------------------------
    eval_base = copy.deepcopy(base).eval()
    xi = torch.randn(args.infer_batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=cl)
    infer_models = {"torch": copy.deepcopy(eval_base).half(),
                    "ours": cgt.convert(copy.deepcopy(eval_base).half(), inference=True),
                    # float32 weights, float16 compute under autocast: mixed-precision serving
                    "torch_autocast": copy.deepcopy(eval_base),
                    "ours_autocast": cgt.convert(copy.deepcopy(eval_base), inference=True)}
    if args.compile:
        infer_models["torch_compile"] = torch.compile(copy.deepcopy(eval_base).half())
        infer_models["ours_compile"] = torch.compile(cgt.convert(copy.deepcopy(eval_base).half(), inference=True))
    report = infer_models["ours"].cudnn_graphs_report
    out["inference_fusion"] = {"folded_batchnorm": len(report.folded_batchnorm),
                               "fused_activation": len(report.fused_activation),
                               "fused_residual": len(report.fused_residual)}

    xf = xi.float()

    def forward(model, autocast: bool):
        def step():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
                return model(xf if autocast else xi)
        return step

    fwd = {k: forward(m, k.endswith("_autocast")) for k, m in infer_models.items()}
    with torch.no_grad():
        ref, got_i = infer_models["torch"](xi).double(), infer_models["ours"](xi).double()
    out["infer_finite"] = {"torch": bool(ref.isfinite().all()), "ours": bool(got_i.isfinite().all())}
    # relative to the reference, or absolute where it is all zeros (a randomly initialised head can be)
    out["infer_rel_err_fp16"] = float((got_i - ref).norm() / ref.norm()) if ref.norm() > 0 else None
    out["infer_max_abs_err_fp16"] = float((got_i - ref).abs().max())
    out["infer_rel_err_fp32"] = _fp32_check(eval_base, xi.float())
    with torch.no_grad():
        fwd = warmed(fwd, out["errors"])
    infer = alternate(fwd, rounds=args.rounds, steps=args.steps)
    out["infer_ms"] = infer
    out["infer_speedup"] = harness.ratio(infer.get("torch"), infer.get("ours"))
    out["infer_ratios"] = {pair: harness.ratio(infer.get(theirs), infer.get(ours))
                           for pair, (theirs, ours) in INFER_PAIRS.items()}
    del fwd, infer_models
    emit(out, "infer")

    # -- loss curves from one initialisation ------------------------------------------------------
    if args.loss_steps:
        with untuned():
            out["losses"] = loss_curves(base.train(), args)
        emit(out, "losses")

    # -- device time by the profiler, last: it can leave CUPTI attached, costing host time after it ---
    out["train_device_ms"] = {}
    for k, step in steps.items():
        try:
            out["train_device_ms"][k] = profiled_ms(step)
        except Exception as err:  # noqa: BLE001 - the profiler's figure is one of two
            out["train_device_ms"][k] = float("nan")
            out["errors"][f"profiler {k}"] = _error(err)
    out["train_ratios"] = train_ratios(out)
    emit(out, "done")
    return out


@contextlib.contextmanager
def untuned():
    """`cudnn.benchmark` off inside: correctness checks (the float32 outputs, the loss curves) need no
    autotuned plans, and their geometries would each cost both sides an autotuning otherwise."""
    import torch

    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def _fp32_check(base, x) -> float:
    """Relative error of the converted inference model against torch's, both float32 with TF32 off
    (random-initialised networks can overflow float16 in torch and ours alike)."""
    import torch

    import cudnn_graphs.torch as cgt

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad(), untuned():
            want = copy.deepcopy(base).float()(x).double()
            got = cgt.convert(copy.deepcopy(base).float(), inference=True)(x).double()
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return float((got - want).norm() / want.norm())


def table(results: list[dict]) -> str:
    """A markdown table of each model's training step, ms: wall, host (GPU held busy) and device (profiler
    kernel sum) per candidate (torch eager / graphed / compiled, ours eager / graphed / compiled), then its
    inference ms per candidate; '-' where not measured."""
    def ms(value) -> str:
        return f"{value:.2f}" if _finite(value) else "-"

    lines = ["| model | candidate | wall ms | host ms | device ms | wall: torch's / this |",
             "|---|---|---|---|---|---|"]
    for r in results:
        wall, host, device = (r.get(key) or {} for key in ("train_ms", "train_host_ms", "train_device_ms"))
        for c in TABLE_CANDIDATES:
            if c in wall or c in host or c in device:
                eager = "torch" if c.startswith("torch") else c.replace("ours", "torch", 1)
                lines.append(f"| {r['model']} | {c} | {ms(wall.get(c))} | {ms(host.get(c))} | {ms(device.get(c))} | "
                             f"{ms(harness.ratio(wall.get(eager), wall.get(c)))} |")
        infer = r.get("infer_ms") or {}
        if infer:
            lines.append(f"| {r['model']} | inference ms | " + ", ".join(f"{k} {ms(v)}" for k, v in infer.items())
                         + " | | | |")
        if r.get("error"):
            lines.append(f"| {r['model']} | error | {r['error']} | | | |")
    return "\n".join(lines)


def loss_curves(base, args) -> dict[str, list[float]]:
    import torch

    import cudnn_graphs.torch as cgt

    cl = torch.channels_last
    curves = {}
    for name in ("torch", "ours"):
        model = copy.deepcopy(base)
        if name == "ours":
            cgt.convert(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # a descent both can follow
        gen = torch.Generator(device="cuda").manual_seed(7)
        batches = [(torch.randn(16, 3, 128, 128, device="cuda", generator=gen).contiguous(memory_format=cl),
                    torch.randint(0, 10, (16,), device="cuda", generator=gen)) for _ in range(4)]
        step_losses = []
        for i in range(args.loss_steps):
            x, target = batches[i % len(batches)]
            step_losses.append(float(train_step(model, opt, x, target)()))
        curves[name] = step_losses
    return curves


def plot(results: list[dict], path: Path, *, title: str = "") -> None:
    """Speedups (torch ms / ours ms) for training (eager, and both sides under CUDA graphs where measured)
    and inference, and each model's loss curves."""
    def bars(ax, names, series):
        width = 0.8 / max(len(series), 1)
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
            heights = [float("nan") if v is None else v for v in values]
            drawn = ax.bar(xs, heights, width, label=label,
                           color=["tab:green" if h >= 1 else "tab:red" for h in heights] if len(series) == 1 else None)
            ax.bar_label(drawn, labels=["" if math.isnan(h) else f"{h:.2f}x" for h in heights], fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.axhline(1.0, color="k", lw=0.8)
        if len(series) > 1:
            ax.legend(fontsize=8)

    def draw(plt):
        names = [r["model"] for r in results]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        train = {"eager": [r.get("train_speedup") for r in results]}
        if any(_finite(r.get("graphed_speedup")) for r in results):
            train["CUDA graphs, both sides"] = [r.get("graphed_speedup") for r in results]
        bars(axes[0], names, train)
        axes[0].set_title("training step: torch ms / ours ms")
        bars(axes[1], names, {"inference": [r.get("infer_speedup") for r in results]})
        axes[1].set_title("inference: torch ms / ours ms")
        for i, r in enumerate(results):
            losses = r.get("losses") or {}
            color = f"C{i}"
            if "torch" in losses:
                axes[2].plot(losses["torch"], color=color, lw=1.2, label=f"{r['model']} torch")
            if "ours" in losses:
                axes[2].plot(losses["ours"], color=color, lw=1.2, ls="--", label=f"{r['model']} ours")
        axes[2].set_title("training loss, one initialisation (solid torch, dashed ours)", fontsize=10)
        axes[2].set_xlabel("step")
        axes[2].legend(fontsize=6, ncol=2)
        if title:
            fig.suptitle(title)
        return fig

    harness.png(path, draw)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def geo(values) -> float:
    """Geo-mean of the finite positive values (NaN where there is none)."""
    return harness.geomean(v for v in values if _finite(v))


def summary(results: list[dict], args, *, device: str, torch_version: str, complete: bool) -> dict:
    return {"device": device, "torch": torch_version, "models": results, "complete": complete,
            "policy": args.policy, "autotune_limit": args.autotune_limit if args.policy == "autotune" else None,
            "graphs": args.graphs, "compile": args.compile,
            "train_geomean": geo(r.get("train_speedup") for r in results),
            "compile_geomean": geo(r.get("compile_speedup") for r in results),
            "graphed_geomean": geo(r.get("graphed_speedup") for r in results),
            "plans_geomean": geo(r.get("plans_speedup") for r in results),
            "aa_ratios": {r["model"]: r.get("aa_ratio") for r in results if "aa_ratio" in r},
            "infer_geomean": geo(r.get("infer_speedup") for r in results),
            "ratio_geomeans": {pair: {figure: geo(r.get("train_ratios", {}).get(pair, {}).get(figure) for r in results)
                                      for figure in FIGURES} for pair in PAIRS},
            "failed": [r["model"] for r in results if r.get("phase") != "done"]}


def run_child(command: list[str], name: str, *, timeout: float) -> dict:
    """Run one model's child, echoing its stdout; its last JSON line about `name` (with "error" added
    where it failed, ran past `timeout` seconds or printed none)."""
    last: dict = {"model": name}
    proc = subprocess.Popen(command, cwd=harness.ROOT, stdout=subprocess.PIPE, text=True,  # stderr: ours
                            preexec_fn=harness.die_with_parent)
    late = threading.Event()
    timer = threading.Timer(timeout, lambda: (late.set(), proc.kill()))
    timer.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("{"):
                try:
                    got = json.loads(line)
                except ValueError:
                    continue
                if isinstance(got, dict) and got.get("model") == name:
                    last = got
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # the parent is being stopped: the child goes with it
            proc.kill()
            proc.wait()
    if code != 0:
        last["error"] = f"the child exited {code}" + (f", stopped after {timeout:g} s" if late.is_set() else "")
    return last


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_child, which kills the child


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--models", nargs="*", help="torchvision names, timm:<name>, resnet18_hand (default: "
                   f"{', '.join(TORCHVISION)}, {HAND}, and where timm imports {', '.join(TIMM)})")
    p.add_argument("--smoke", action="store_true", help="a short GPU check: " + ", ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in SMOKE.items())
        + " (--models still picks), no A/A and no plans candidates")
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--infer-batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--loss-steps", type=int, default=20)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="train both sides under CUDA graphs too: torch's make_graphed_callables against "
                        "cudnn_graphs.torch.capture (default on)")
    p.add_argument("--plans", action=argparse.BooleanOptionalAction, default=True,
                   help="add ours_plans: convert(train_convs='cudnn_graphs') (default on)")
    p.add_argument("--aa", action=argparse.BooleanOptionalAction, default=True,
                   help="add torch_aa, a second copy of torch's model: the run's own noise band (default on)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="add torch.compile of torch's model and of the converted one, training and inference "
                        "(default on; compiling takes a minute or more a model)")
    p.add_argument("--policy", choices=("heuristic", "autotune"), default="heuristic",
                   help="the policy of the device's default session; under cudnn.benchmark=True (set here) "
                        "the converted modules plan with the autotune policy whatever this says")
    p.add_argument("--autotune-limit", type=int, default=3, help="candidates timed per spec with --policy autotune")
    p.add_argument("--model-timeout", type=float, default=900, help="seconds one model's child may run")
    p.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)  # the child: one model, JSON lines
    p.add_argument("--plot-from", type=Path, metavar="JSON", help="only draw --plot from results written by --out "
                   "(no GPU needed)")
    p.add_argument("--table-from", type=Path, metavar="JSON", help="only print the per-model table of results "
                   "written by --out (no GPU needed)")
    args = parse(p, argv)
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())["models"]))
        return 0
    if args.plot_from:
        stored = json.loads(args.plot_from.read_text())
        plot(stored["models"], args.plot or args.plot_from.with_suffix(".png"),
             title=f"{stored.get('device', '')}, torch {stored.get('torch', '')}: AMP fp16, channels_last")
        return 0
    if args.one:
        return _child(args)
    import torch

    if not torch.cuda.is_available():  # no CUDA context in the parent: the GPU is the children's
        print("benchmarks.models needs a CUDA GPU", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    results: list[dict] = []
    for name in args.models:  # the JSON is rewritten after each model: a run cut short keeps what it measured
        results.append(run_child([sys.executable, "-m", "benchmarks.models", *argv, "--one", name], name,
                                 timeout=args.model_timeout))
        device = next((r["device"] for r in results if r.get("device")), None)
        result = summary(results, args, device=device, torch_version=torch.__version__,
                         complete=len(results) == len(args.models))
        if args.out:
            harness.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "models"}, default=str), flush=True)
    print(f"geo-mean speedup: training eager {result['train_geomean']:.2f}x, under CUDA graphs "
          f"{result['graphed_geomean']:.2f}x, inference {result['infer_geomean']:.2f}x")
    if args.plot:
        plot(results, args.plot, title=f"{device}, torch {torch.__version__}: AMP fp16, channels_last")
    print(table(results))
    return 1 if result["failed"] else 0


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser`'s arguments, --smoke's sizes applied over the defaults (not over a flag given), the default
    model list filled in."""
    args = parser.parse_args(argv)
    if args.smoke:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for key, value in SMOKE.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
        for flag in ("aa", "plans"):  # the two extra candidates stay off unless asked for
            if not {f"--{flag}", f"--no-{flag}"} & given:
                setattr(args, flag, False)
    if args.models is None:
        args.models = default_models()
    if not args.models and not (args.plot_from or args.table_from):
        parser.error("--models: name at least one model")
    return args


def _child(args) -> int:
    import torch

    torch.backends.cudnn.benchmark = True
    if args.policy == "autotune":  # the device's shared session made autotuning
        from cudnn_graphs.plan import session as sessions

        sessions._sessions[0] = sessions.Session(device=0, policy="autotune", autotune_limit=args.autotune_limit)
    bench_model(args.one, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
