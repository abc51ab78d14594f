"""Benchmark (GPU host): the cost of a call where users make it, side by side with torch in one run.

    python -m benchmarks.calls --out calls.json [--skip-warm] [--plot calls.png]
    python -m benchmarks.calls --plot-from benchmarks/results/h100/calls.json --plot calls.png   # no GPU

1. Every public conv entry point on 32x128x28x28, 3x3, fp16 channels_last, beside torch's equivalent:
   host us per call (GPU held busy by a queued sleep, so the host never waits), single-call latency
   from an idle GPU (events around one call), back-to-back device time (queue kept full). Ours and
   torch's alternate round by round; medians.
2. ResNet-50's 53 convs at batch 32, fp16 channels_last: forward (bias + relu) in order, then dgrad
   and wgrad in reverse, through the functional API, against torch eager (cudnn.benchmark=True):
   wall ms per step in steady state, alternating rounds.
3. Warm start: fresh processes with torch imported and CUDA up, the plan cache warm and the driver's
   JIT cache on, timed to the end of a first fwd (conv+bias+gelu), dgrad (relu') and wgrad (bias grad)
   on 16x128x28x28; beside torch with benchmark=False and benchmark=True (its second process).
Inputs are random (never zeros); outputs are checked against float64 torch once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


def _torch():
    import torch

    return torch


def entry_points(*, rounds: int, calls: int) -> dict:
    torch = _torch()
    import torch.nn.functional as F

    import cudnn_graphs as cg

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    x = torch.randn(32, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
    b, dy = torch.randn(128, device="cuda", dtype=torch.half), torch.randn_like(x)
    y = torch.empty_like(x)
    session = cg.default_session(0)
    spec = cg.ConvFwdSpec(x.shape, w.shape, padding=1, dtype="float16", layout="channels_last", bias=True,
                          activation="relu")
    plan = session.plan(spec)
    bound = plan.bind(x=x, w=w, bias=b, y=y)
    conv_bwd = torch.ops.aten.convolution_backward
    pairs = {
        "conv_fwd": (lambda: cg.conv_fwd(x, w, b, padding=1, activation="relu"),
                     lambda: F.relu(F.conv2d(x, w, b, padding=1))),
        "conv_fwd(y=y)": (lambda: cg.conv_fwd(x, w, b, y=y, padding=1, activation="relu"),
                          lambda: torch.relu_(torch.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))),
        "session.run(ConvFwdRequest)": (lambda: session.run(cg.ConvFwdRequest(x, w, bias=b, padding=1,
                                                                              activation="relu")),
                                        lambda: F.relu(F.conv2d(x, w, b, padding=1))),
        "plan.execute": (lambda: plan.execute(x=x, w=w, bias=b, y=y),
                         lambda: torch.relu_(torch.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))),
        "bound.launch": (bound.launch, lambda: F.relu(F.conv2d(x, w, b, padding=1))),
        "conv_bwd_data": (lambda: cg.conv_bwd_data(dy, w, x_shape=x.shape, padding=1),
                          lambda: conv_bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                           [True, False, False])),
        "conv_bwd_filter": (lambda: cg.conv_bwd_filter(x, dy, w_shape=w.shape, padding=1),
                            lambda: conv_bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                             [False, True, False])),
    }
    measures = {"host": lambda fn: harness.host_us(fn, calls=calls, sleep_cycles=int(1e9), nan_if_drained=True),
                "idle": lambda fn: harness.latency_ms(fn, reps=30) * 1e3,
                "dev": lambda fn: harness.device_ms(fn, calls=calls) * 1e3}
    rows = {}
    for name, (ours, theirs) in pairs.items():
        for fn in (ours, theirs):
            for _ in range(5):
                fn()
        medians = harness.interleaved({"ours": ours, "torch": theirs}, measures, rounds=rounds)
        rows[name] = r = {f"{m}_{side}": v for m, per in medians.items() for side, v in per.items()}
        print(f"{name:30s} host {r['host_ours']:7.2f} us (torch {r['host_torch']:6.2f})  idle "
              f"{r['idle_ours']:7.1f} us (torch {r['idle_torch']:6.1f})  device {r['dev_ours']:7.1f} us "
              f"(torch {r['dev_torch']:6.1f})", flush=True)
    rows["_check"] = _check_fwd(x, w, b, dy)
    rows["_launchers"] = [{"op": c.launcher.plan.spec.op, "engines": c.launcher.plan.engines,
                           "capture_enabled": c.launcher.capture_enabled, "graphs": len(c.launcher._graphs),
                           "repointed_graphs": len(c.launcher._patched), "replays": c.launcher.replays,
                           "patching": c.launcher.patching}
                          for c in session.calls.values()]
    print(rows["_launchers"])
    return rows


def _check_fwd(x, w, b, dy) -> dict:
    torch = _torch()

    import cudnn_graphs as cg

    x.copy_(torch.randn_like(x))
    got = {"y": cg.conv_fwd(x, w, b, padding=1, activation="relu"),
           "dx": cg.conv_bwd_data(dy, w, x_shape=x.shape, padding=1),
           "dw": cg.conv_bwd_filter(x, dy, w_shape=w.shape, padding=1)}
    want = harness.conv2d_reference(x, w, dy, bias=b, padding=1)
    return {k: harness.rel_err(got[k], want[k]) for k in got}


def resnet50_step(*, batch: int, rounds: int, policy: str | None = None) -> dict:
    torch = _torch()
    import torch.nn.functional as F

    import cudnn_graphs as cg
    from cudnn_graphs.presets import resnet_layers

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    layers = []
    for layer in resnet_layers("resnet50"):
        x = torch.randn(batch, layer.c, layer.hw, layer.hw, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
        w = (torch.randn(layer.k, layer.c, layer.r, layer.r, device="cuda", dtype=torch.half) * 0.05).contiguous(
            memory_format=cl)
        b = torch.randn(layer.k, device="cuda", dtype=torch.half)
        out_hw = (layer.hw + 2 * (layer.r // 2) - layer.r) // layer.stride + 1
        dy = torch.randn(batch, layer.k, out_hw, out_hw, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
        layers.append((x, w, b, dy, layer.stride, layer.r // 2))
    conv_bwd = torch.ops.aten.convolution_backward
    session = cg.Session(policy=policy) if policy else None  # None: each device's default session

    def ours():
        keep = [cg.conv_fwd(x, w, b, stride=s, padding=p, activation="relu", session=session)
                for x, w, b, _, s, p in layers]
        for x, w, _, dy, s, p in reversed(layers):
            keep.append(cg.conv_bwd_data(dy, w, x_shape=x.shape, stride=s, padding=p, session=session))
            keep.append(cg.conv_bwd_filter(x, dy, w_shape=w.shape, stride=s, padding=p, session=session))
        return keep

    def theirs():
        keep = [F.relu(F.conv2d(x, w, b, stride=s, padding=p)) for x, w, b, _, s, p in layers]
        for x, w, _, dy, s, p in reversed(layers):
            keep.append(conv_bwd(dy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [True, True, False]))
        return keep

    def steady(fn) -> list[float]:  # a step right after the other side's is not steady state: one untimed
        fn()
        return [harness.wall_ms(fn), harness.wall_ms(fn)]

    device = harness.DeviceTime(calls=1, sleep_cycles=int(5e8))  # the queue filled ahead: kernels alone
    for fn in (ours, theirs):
        for _ in range(3):
            fn()
    candidates = {"ours": ours, "torch": theirs}
    medians = harness.interleaved(candidates, {"wall": steady, "device": device}, rounds=rounds, by="candidate")
    out = {**medians["wall"], **{f"{side}_device": v for side, v in medians["device"].items()}}
    # a device figure above its own wall time, or from host-bound blocks, is no device time alone: flagged
    out["device_flags"] = {side: {**flags, "above_wall": harness.above_wall(out[f"{side}_device"], out[side])}
                           for side, flags in device.flags(candidates).items()}
    out["speedup"] = out["torch"] / out["ours"]
    out["convs"] = len(layers)
    from cudnn_graphs.plan import default_session

    launchers = [c.launcher for c in (session or default_session(0)).calls.values()]
    out["policy"] = policy or "heuristics"
    out["launchers_capturing"] = sum(la.capture_enabled for la in launchers)
    out["launchers"] = len(launchers)
    out["graphs"] = sum(len(la._graphs) for la in launchers)
    out["repointed_graphs"] = sum(len(la._patched) for la in launchers)  # each serves every pointer set
    print(f"ResNet-50 step ({len(layers)} convs, batch {batch}): ours {out['ours']:.2f} ms, torch eager "
          f"{out['torch']:.2f} ms: {out['speedup']:.2f}x; device time alone {out['ours_device']:.2f} ms vs "
          f"{out['torch_device']:.2f} ms; {out['launchers_capturing']}/{out['launchers']} launchers capturing, "
          f"{out['repointed_graphs']} re-pointed graphs, {out['graphs']} per pointer set", flush=True)
    return out


# -- 3. warm start, each measurement a fresh process ------------------------------------------------

def warm_child(mode: str, cache: str) -> dict:
    torch = _torch()
    import torch.nn.functional as F

    torch.zeros(1, device="cuda")
    cl = torch.channels_last
    x = torch.randn(16, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
    b, dy = torch.randn(128, device="cuda", dtype=torch.half), torch.randn_like(x)
    torch.cuda.synchronize()
    marks = {}
    t0 = time.perf_counter()
    if mode in ("ours", "ours_prefetch"):
        os.environ["CUDNN_GRAPHS_CACHE_DIR"] = cache
        import cudnn_graphs as cg

        marks["import"] = time.perf_counter() - t0
        session = cg.default_session(0)
        marks["session"] = time.perf_counter() - t0
        if mode == "ours_prefetch":  # the spec file record mode wrote in the cold run (warmup reads it too)
            session.prefetch(os.path.join(cache, "specs.jsonl"))
        session.handles.raw()
        marks["handle"] = time.perf_counter() - t0
        y = cg.conv_fwd(x, w, b, padding=1, activation="gelu")
        marks["fwd"] = time.perf_counter() - t0
        dx = cg.conv_bwd_data(dy, w, pre_act=x, padding=1, activation_backward="relu")
        marks["dgrad"] = time.perf_counter() - t0
        dw, db = cg.conv_bwd_filter(x, dy, w_shape=w.shape, padding=1, bias_grad=True)
        marks["wgrad"] = time.perf_counter() - t0
        marks["stats"] = cg.default_session(0).stats()
    else:
        torch.backends.cudnn.benchmark = mode == "torch_benchmark"
        y = F.gelu(F.conv2d(x, w, b, padding=1))
        conv_bwd = torch.ops.aten.convolution_backward
        dx = conv_bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])[0] * (x > 0)
        dw = conv_bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])[1]
        db = dy.sum((0, 2, 3))
    torch.cuda.synchronize()
    marks["total_ms"] = (time.perf_counter() - t0) * 1e3
    marks["modules"] = sorted(m for m in ("cupy", "cudnn", "cudnn_graphs") if m in sys.modules)
    del y, dx, dw, db
    return marks


def warm_start(*, rounds: int) -> dict:
    cache = tempfile.mkdtemp(prefix="cg-bench-")
    env = harness.fresh_env(os.path.join(cache, "pycache"))

    def child(mode: str) -> dict:
        return harness.run_fresh(["-m", "benchmarks.calls", "--warm-child", mode, cache], env=env)

    # Fill the plan cache (cold), recording the specs a job would hand to `warmup` and `prefetch`.
    env["CUDNN_GRAPHS_RECORD"] = os.path.join(cache, "specs.jsonl")
    child("ours")
    del env["CUDNN_GRAPHS_RECORD"]
    child("torch_benchmark")  # fills the driver's JIT cache for torch: what follows is its second process
    runs = {"ours": [], "ours_prefetch": [], "torch_no_benchmark": [], "torch_benchmark": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(child(mode))
    out = {mode: harness.median(r["total_ms"] for r in rs) for mode, rs in runs.items()}
    out["ours_runs"] = runs["ours"]
    out["ours_prefetch_runs"] = runs["ours_prefetch"]
    print(f"warm start to the end of fwd+dgrad+wgrad: ours {out['ours']:.1f} ms (with prefetch "
          f"{out['ours_prefetch']:.1f} ms), torch benchmark=False "
          f"{out['torch_no_benchmark']:.1f} ms, torch benchmark=True (2nd process) {out['torch_benchmark']:.1f} ms; "
          f"ours stats {runs['ours'][-1]['stats']}", flush=True)
    return out


def plot(result: dict, path) -> None:
    """Host us per call, GPU busy, of every entry point: ours beside torch's."""
    rows = {name: {"ours": r["host_ours"], "torch": r["host_torch"]}
            for name, r in result.get("entry_points", {}).items() if not name.startswith("_")}
    harness.bar_chart(path, rows, title=harness.title(result, "conv entry points, host us per call (GPU busy)"),
                      ylabel="host us per call")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="draw the entry points' host us as a PNG here")
    p.add_argument("--plot-from", type=Path, metavar="JSON", help="only draw --plot from a stored result (no GPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=100, help="calls per host/device sample (keep the queue < 1000)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--skip-warm", action="store_true")
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--step-policy", choices=("autotune",), default=None,
                   help="plan the step's convs with this session policy (default: heuristics), as a job whose "
                        "cache `warmup --autotune` filled")
    p.add_argument("--skip-entry", action="store_true")
    p.add_argument("--warm-child", nargs=2, metavar=("MODE", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_child:
        print(json.dumps(warm_child(*args.warm_child)))
        return 0
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), args.plot or args.plot_from.with_suffix(".png"))
        return 0
    import logging

    logging.basicConfig(level=logging.INFO)
    torch = _torch()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_warm:
        result["warm_start_ms"] = warm_start(rounds=args.rounds)
    if not args.skip_entry:
        result["entry_points"] = entry_points(rounds=args.rounds, calls=args.calls)
    if not args.skip_step:
        result["resnet50_step_ms"] = resnet50_step(batch=args.batch, rounds=max(args.rounds, 10),
                                                   policy=args.step_policy)
    import cudnn_graphs as cg

    result["env"] = cg.default_session(0).env.to_dict()
    if args.out:
        harness.write_json(args.out, result)
    if args.plot and "entry_points" in result:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
