"""Probe (GPU host): where the host time of a converted model's training step goes.

    python3 tools/probe_train_step.py [--model resnet50] [--batch 64] [--out probe.json]

Part 1, one conv layer (32x128x28x28, 3x3, fp16 channels_last): host us per call (GPU held busy by a
queued sleep, 100 calls, so the launch queue never fills) of each layer between a module's forward and
the launch, beside torch's equivalents.
Part 2, the model's AMP training step after warm-up: per step, memo misses (`prepare_call`), direct runs,
graph replays, copies made to pack gradients, calls declined to torch; host ms of one step, ours and
torch (sync before, no sync inside); host us spent inside each entry point; a cProfile of ours.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import train_setup  # noqa: E402
from probe_call_path import host_us  # noqa: E402  (100 calls: a fwd+bwd's launches must not fill the queue)


def part_layer() -> dict:
    import torch
    import torch.nn.functional as F

    import cudnn_graphs as cg
    import cudnn_graphs.torch as cgt
    from cudnn_graphs.torch import _conv

    cl = torch.channels_last
    x = torch.randn(32, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
    wr = w.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)
    conv = cgt.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    tconv = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    flat = ([1, 1], [1, 1, 1, 1], [1, 1], 1)
    cfg = _conv._config(2, 1, 1, 1, 1, None, 1.0, ())

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, *rest):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return (g,) + (None,) * 10

    conv32 = cgt.Conv2d(128, 128, 3, padding=1, bias=False).cuda().to(memory_format=cl)
    tconv32 = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).cuda().to(memory_format=cl)

    def amp_fwd_bwd(module):
        def run():
            with torch.autocast("cuda", dtype=torch.float16):
                y = module(xr)
            torch.autograd.backward(y, dy)
        return run

    y_mod = conv(xr)
    y_t = tconv(xr)
    cases = {
        "cg.conv_fwd": lambda: cg.conv_fwd(x, w, padding=1),
        "_conv_fwd_cuda": lambda: _conv._conv_fwd_cuda(x, w, None, None, *flat, "identity", 0.0, 1.0),
        "_fwd_eager": lambda: _conv._fwd_eager(cfg, x, w, None, None),
        "noop autograd.Function.apply (11 args)": lambda: Noop.apply(x, wr, None, None, *flat, "identity", 0.0, 1.0),
        "_ConvFunction (C apply)": lambda: _conv._function(x, wr, None, None, cfg),
        "_ConvFunction.apply": lambda: _conv._ConvFunction.apply(x, wr, None, None, cfg),
        "cgt.conv2d (w requires grad)": lambda: cgt.conv2d(x, wr, padding=1),
        "Conv2d module forward (training)": lambda: conv(x),
        "torch F.conv2d (w requires grad)": lambda: F.conv2d(x, wr, padding=1),
        "torch F.conv2d (no grad)": lambda: F.conv2d(x, w, padding=1),
        "_conv_bwd_data_cuda": lambda: _conv._conv_bwd_data_cuda(dy, w, [32, 128, 28, 28], *flat),
        "_dgrad_eager": lambda: _conv._dgrad_eager(cfg, dy, w, x.shape),
        "_wgrad_eager": lambda: _conv._wgrad_eager(cfg, x, dy, w.shape, False),
        "cg.conv_bwd_data": lambda: cg.conv_bwd_data(dy, w, x_shape=x.shape, padding=1),
        "torch convolution_backward dx": lambda: torch.ops.aten.convolution_backward(
            dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]),
        "_conv_bwd_filter_cuda": lambda: _conv._conv_bwd_filter_cuda(x, dy, [128, 128, 3, 3], *flat, False),
        "torch convolution_backward dw": lambda: torch.ops.aten.convolution_backward(
            dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]),
        "module fwd+bwd (ours)": lambda: torch.autograd.backward(conv(xr), dy),
        "autocast module fwd+bwd (ours)": amp_fwd_bwd(conv32),
        "autocast module fwd+bwd (torch)": amp_fwd_bwd(tconv32),
        "module fwd+bwd (torch)": lambda: torch.autograd.backward(tconv(xr), dy),
        "piece: torch.empty_strided": lambda: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device),
        "piece: read x (shape, stride, dtype, get_device, data_ptr)": lambda: (
            x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr()),
        "piece: torch.is_autocast_enabled('cuda')": lambda: torch.is_autocast_enabled("cuda"),
        "piece: torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "piece: _memory_format(x)": lambda: _conv._memory_format(x),
    }
    del y_mod, y_t
    torch.backends.cudnn.benchmark = True
    out = {}
    for name, fn in cases.items():
        fn()
        fn()
        out[name] = host_us(fn, calls=50 if "fwd+bwd" in name else 100)
        print(f"{name:60s} {out[name]:8.2f} us", flush=True)
    return out


class _Counts:
    def __init__(self):
        self.c = collections.Counter()
        self.t = collections.Counter()

    def count(self, owner, name, label, *, timed=False):
        original = getattr(owner, name)
        counts = self

        def wrapper(*args, **kwargs):
            counts.c[label] += 1
            if not timed:
                return original(*args, **kwargs)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                counts.t[label] += time.perf_counter() - t

        setattr(owner, name, wrapper)


def _op_tables(steps: dict) -> None:
    """torch's operators by host time (self), 3 steps of each: what our step adds or changes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
        print(f"== {name}: operators by self host time, 3 steps\n{table}", flush=True)


def part_model(model_name: str, batch: int, ops: bool = False) -> dict:
    import torch

    from cudnn_graphs import api, requests
    from cudnn_graphs.plan import launcher
    from cudnn_graphs.torch import _conv
    from gpu_launch import driver

    setup = train_setup(model_name, batch)
    steps, theirs, ours, x, target = setup.steps, setup.theirs, setup.ours, setup.x, setup.target
    for _ in range(4):
        for step in steps.values():
            step()
    torch.cuda.synchronize()
    host = {}
    for _ in range(5):
        for name, step in steps.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            h = time.perf_counter() - t
            torch.cuda.synchronize()
            w_ = time.perf_counter() - t
            host.setdefault(name, []).append((h * 1e3, w_ * 1e3))
    result = {"host_ms": {n: round(statistics.median(h for h, _ in v), 2) for n, v in host.items()},
              "wall_ms": {n: round(statistics.median(w for _, w in v), 2) for n, v in host.items()},
              "host_ms_forward_backward_step": {n: _split_ms(m, x, target) for n, m in (("torch", theirs),
                                                                                          ("ours", ours))}}
    print(json.dumps(result, indent=1), flush=True)
    counts = _Counts()
    counts.count(requests, "prepare_call", "memo misses (prepare_call)")
    counts.count(launcher._Prepared, "__call__", "direct runs")
    counts.count(driver.GraphExec, "launch", "graph replays")
    counts.count(launcher.Launcher, "_record", "graph captures")
    counts.count(_conv, "_declined_once", "declined to torch")
    for name in ("conv_fwd", "conv_bwd_data", "conv_bwd_filter"):
        counts.count(api, name, f"api.{name}", timed=True)
    for name in ("_fwd_eager", "_dgrad_eager", "_wgrad_eager", "_conv_fwd_cuda", "_conv_bwd_data_cuda",
                 "_conv_bwd_filter_cuda", "_backward", "_conv"):
        counts.count(_conv, name, f"_conv.{name}", timed=True)
    original_packed = _conv._packed

    def packed(t, fmt):
        if t is not None and not t.is_contiguous(memory_format=fmt):
            counts.c[f"packing copies of {tuple(t.shape)} {t.stride()}"] += 1
        return original_packed(t, fmt)

    _conv._packed = packed
    torch.cuda.synchronize()
    steps["ours"]()
    torch.cuda.synchronize()
    result["per_step_counts"] = dict(counts.c)
    result["pointer_repeats"] = _pointer_repeats(steps["ours"], launcher.Launcher)
    result["per_step_us_inside"] = {k: round(v * 1e6) for k, v in counts.t.items()}
    print(json.dumps(result, indent=1), flush=True)
    _conv._packed = original_packed
    result["steady"] = _steady_state(steps, counts, _conv)
    print(json.dumps(result["steady"], indent=1), flush=True)
    if ops:
        _op_tables(steps)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    steps["ours"]()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        print(f"== one step of ours by {key}\n" + text.getvalue()[-7000:], flush=True)
    return result


def _split_ms(model, x, target, rounds: int = 5) -> list[float]:
    """Host ms of the forward (with the loss), the backward and the optimizer step, each from a synced GPU."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3))
    return [round(statistics.median(s[i] for s in samples), 2) for i in range(2)]


def _host_ms(steps: dict, rounds: int = 5) -> dict:
    import torch

    host: dict = {}
    for _ in range(rounds):
        for name, step in steps.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            host.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return {n: round(statistics.median(v), 2) for n, v in host.items()}


def _steady_state(steps: dict, counts, conv_module, warm: int = 60) -> dict:
    """Host ms per step after `warm` more steps (the launchers' capture budget spent), then with every
    launcher's graphs dropped and capture off (direct runs only)."""
    import torch

    for _ in range(warm):
        steps["ours"]()
    torch.cuda.synchronize()
    counts.c.clear()
    steps["ours"]()
    torch.cuda.synchronize()
    out = {"after_warm": _host_ms(steps), "after_warm_counts": dict(counts.c)}
    launchers = {id(c.launcher): c.launcher for cfg in conv_module._CANONICAL.values()
                 for memo in (cfg.fwd, cfg.dgrad, cfg.wgrad) for c in memo.values() if hasattr(c, "launcher")}
    out["launchers"] = len(launchers)
    out["graphs_held"] = sum(len(la._graphs) for la in launchers.values())
    for la in launchers.values():
        la.capture_enabled = False
        la._graphs.clear()
    out["capture_off"] = _host_ms(steps)
    return out


def _pointer_repeats(step, launcher_type, n: int = 6) -> list[dict]:
    """Per step: launches, distinct (launcher, pointers) sets, and how many were also seen 1 and 2
    steps before: whether a training loop's buffers repeat, and with which period."""
    import torch

    seen: list[set] = []
    original = launcher_type.launch

    def launch(self, ptrs, stream, capturing):
        seen[-1].add((id(self), ptrs))
        calls[0] += 1
        return original(self, ptrs, stream, capturing)

    launcher_type.launch = launch
    out = []
    try:
        for _ in range(n):
            calls = [0]
            seen.append(set())
            step()
            torch.cuda.synchronize()
            row = {"launches": calls[0], "distinct": len(seen[-1])}
            for back in (1, 2):
                if len(seen) > back:
                    row[f"also_{back}_before"] = len(seen[-1] & seen[-1 - back])
            out.append(row)
    finally:
        launcher_type.launch = original
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--ops", action="store_true", help="tables of torch's operators by host time, ours and torch's")
    args = p.parse_args()
    result = {} if args.skip_layer else {"layer_host_us": part_layer()}
    result["model"] = {args.model: part_model(args.model, args.batch, args.ops)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
