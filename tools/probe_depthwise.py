"""Probe (GPU host): convnext_tiny's 7x7 depthwise convs, torch (cudnn.benchmark) against our plans.

    python3 tools/probe_depthwise.py --out probe_depthwise.json [--batch 32] [--quick] [--ops fwd,dgrad]

convnext_tiny converted runs at 0.37x torch (inference) and 0.62x (training); the suspects are its
depthwise convs (7x7, padding 3, groups=C, bias; C x H in 96x56, 192x28, 384x14, 768x7), fp16
channels_last. Per shape and op (fwd, dgrad, wgrad, wgrad_db = wgrad + bias grad), for torch
(F.conv2d / aten.convolution_backward with an output_mask, cudnn.benchmark=True), ours with the
heuristic plan and ours autotuned with no candidate limit (every candidate's engine and time printed):
- us: device time per call, median of blocks of back-to-back calls timed with CUDA events, each
  block queued behind a GPU sleep so host overhead is hidden (`host_bound` counts blocks where the
  sleep ended before the host had queued the block: then the figure includes host gaps);
- kernels: the CUDA kernels one call launches (torch.profiler), with their mean device us;
- rel_err: against float64 torch on the same inputs, once.
Sessions use fresh cache directories under a tempdir (no user, system or remote cache).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((96, 56), (192, 28), (384, 14), (768, 7))  # (C, H) of convnext_tiny's depthwise stages
OPS = ("fwd", "dgrad", "wgrad", "wgrad_db")
K, PAD = 7, 3


def _sleep_cycles(torch, ms: float) -> int:
    """torch.cuda._sleep cycles lasting about `ms` on this GPU (calibrated once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10**6)
    end.record()
    end.synchronize()
    return int(10**6 * ms / max(start.elapsed_time(end), 1e-3))


def _device_us(torch, fn, *, blocks: int, calls: int, cycles: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples, host_bound = [], 0
    for _ in range(blocks):
        torch.cuda._sleep(cycles)  # the GPU waits while the host queues the block: device time alone
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host_bound += bool(start.query())  # the sleep was over before the block was queued
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return {"us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2), "host_bound": host_bound}


def _kernels(torch, fn, *, cycles: int, calls: int = 5) -> list:
    """[(kernel name, launches per call, mean device us)] of `fn`, profiled after a short sleep."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(cycles)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found: dict = {}
    for e in prof.events():
        if not str(e.device_type).endswith("CUDA") or "sleep" in e.name.lower():
            continue
        n, total = found.get(e.name, (0, 0.0))
        found[e.name] = (n + 1, total + e.time_range.elapsed_us())
    return [(name[:300], round(n / calls, 2), round(total / n, 2)) for name, (n, total) in found.items()]


def _rel(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm()) if ref.norm() > 0 else float((got - ref).abs().max())


def _plan_info(plan) -> list:  # fallback-kernel parts have no engine: getattr
    return [{"name": getattr(p, "name", "?"), "engine": getattr(p, "engine", type(p).__name__),
             "engine_id": getattr(p, "engine_id", None), "knobs": dict(getattr(p, "knobs", None) or {}),
             "workspace_size": getattr(p, "workspace_size", None), "tuning": getattr(p, "tuning", None)}
            for p in plan.parts]


def _case(torch, cg, op: str, c: int, h: int, batch: int) -> dict:
    """Inputs, torch's call, ours (session -> call), our request, float64 references, output picker."""
    F, cl = torch.nn.functional, torch.channels_last
    g = torch.Generator(device="cuda").manual_seed(c * 1000 + h)
    x = torch.randn(batch, c, h, h, device="cuda", generator=g).half().contiguous(memory_format=cl)
    w = (torch.randn(c, 1, K, K, device="cuda", generator=g) * 0.1).half().contiguous(memory_format=cl)
    b = torch.randn(c, device="cuda", generator=g).half()
    dy = torch.randn(batch, c, h, h, device="cuda", generator=g).half().contiguous(memory_format=cl)
    params = {"padding": PAD, "groups": c}
    bwd = torch.ops.aten.convolution_backward
    geo = ([1, 1], [PAD, PAD], [1, 1], False, [0, 0], c)
    if op == "fwd":
        return {"torch": lambda: F.conv2d(x, w, b, padding=PAD, groups=c),
                "ours": lambda s: cg.conv_fwd(x, w, b, session=s, **params),
                "request": cg.ConvFwdRequest(x, w, bias=b, **params),
                "ref": lambda: F.conv2d(x.double(), w.double(), b.double(), padding=PAD, groups=c),
                "pick": lambda out: [out]}
    if op == "dgrad":
        return {"torch": lambda: bwd(dy, x, w, None, *geo, [True, False, False]),
                "ours": lambda s: cg.conv_bwd_data(dy, w, x_shape=tuple(x.shape), session=s, **params),
                "request": cg.ConvBwdDataRequest(dy, w, x_shape=tuple(x.shape), **params),
                "ref": lambda: bwd(dy.double(), x.double(), w.double(), None, *geo, [True, False, False]),
                "pick": lambda out: [out[0]] if isinstance(out, (tuple, list)) else [out]}
    db = op == "wgrad_db"
    mask = [False, True, db]
    return {"torch": lambda: bwd(dy, x, w, [c] if db else None, *geo, mask),
            "ours": lambda s: cg.conv_bwd_filter(x, dy, w_shape=tuple(w.shape), bias_grad=db, session=s, **params),
            "request": cg.ConvBwdFilterRequest(x, dy, w_shape=tuple(w.shape), bias_grad=db, **params),
            "ref": lambda: bwd(dy.double(), x.double(), w.double(), [c] if db else None, *geo, mask),
            "pick": lambda out: [o for o in out if o is not None] if isinstance(out, (tuple, list)) else [out]}


def _run_one(torch, fn, ref, pick, args, cycles) -> dict:
    out = {"rel_err": [round(_rel(o, r), 6) for o, r in zip(pick(fn()), ref)]}
    out.update(_device_us(torch, fn, blocks=args.blocks, calls=args.calls, cycles=cycles))
    out["kernels"] = _kernels(torch, fn, cycles=cycles)
    out["kernel_us"] = round(sum(n * us for _, n, us in out["kernels"]), 2)
    return out


def _probe(torch, cg, op: str, c: int, h: int, args, sessions: dict, cycles: int) -> dict:
    """torch's and each session's figures for one case; a failure is recorded and the probe goes on."""
    try:
        case = _case(torch, cg, op, c, h, args.batch)
        ref = case["pick"](case["ref"]())
    except Exception as err:
        traceback.print_exc(limit=3)
        return {"error": f"{type(err).__name__}: {err}"[:1000]}
    row = {"torch": _safe(lambda: _run_one(torch, case["torch"], ref, case["pick"], args, cycles))}
    for label, session in sessions.items():
        def ours(session=session):
            t0 = time.perf_counter()
            plan = session.plan(case["request"].spec())  # the plan the calls below find in memory
            info = {"plan_s": round(time.perf_counter() - t0, 2), "parts": _plan_info(plan)}
            return {**_run_one(torch, functools.partial(case["ours"], session), ref, case["pick"], args, cycles),
                    **info}
        row[label] = _safe(ours)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON results")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="shapes 96x56 and 768x7 only, fewer and shorter blocks")
    p.add_argument("--shapes", help="comma-separated CxH, e.g. 96x56,768x7 (default: all four)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated of {','.join(OPS)}")
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--calls", type=int, default=50, help="calls per timed block")
    p.add_argument("--autotune-limit", type=int, default=0, help="0 (default): time every candidate")
    p.add_argument("--no-autotune", action="store_true")
    args = p.parse_args()
    shapes = (SHAPES[0], SHAPES[-1]) if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    if args.quick:
        args.blocks, args.calls = min(args.blocks, 3), min(args.calls, 20)
    ops = [o for o in args.ops.split(",") if o]
    if set(ops) - set(OPS):
        p.error(f"unknown ops {sorted(set(ops) - set(OPS))}")
    for var in ("CUDNN_GRAPHS_SYSTEM_CACHE_DIR", "CUDNN_GRAPHS_REMOTE_CACHE", "CUDNN_GRAPHS_RECORD",
                "CUDNN_GRAPHS_POLICY", "CUDNN_GRAPHS_DISABLE_CACHE"):
        os.environ.pop(var, None)  # this probe's plans come from its own fresh caches only
    import torch

    import cudnn_graphs as cg

    torch.backends.cudnn.benchmark = True
    tmp = tempfile.mkdtemp(prefix="cg-probe-depthwise-")
    # Heuristic first: a heuristic session would take an autotuned plan another session holds in-process.
    sessions = {"ours_heuristic": cg.Session(cache=os.path.join(tmp, "heuristic"), remote=False)}
    if not args.no_autotune:
        sessions["ours_autotune"] = cg.Session(cache=os.path.join(tmp, "autotune"), remote=False, policy="autotune",
                                               autotune_limit=args.autotune_limit or None)
    cycles = _sleep_cycles(torch, 20.0 if not args.quick else 10.0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "cudnn_graphs": cg.__version__, "batch": args.batch,
              "blocks": args.blocks, "calls": args.calls, "quick": args.quick, "autotune_limit": args.autotune_limit or None, "cases": {}}
    print(f"{result['device']}  torch {result['torch']}  cuDNN {result['cudnn']}  batch {args.batch}", flush=True)
    t_start = time.perf_counter()
    for c, h in shapes:
        for op in ops:
            name = f"{op} C{c} H{h}"
            result["cases"][name] = row = _probe(torch, cg, op, c, h, args, sessions, cycles)
            torch.cuda.empty_cache()
            _print_case(name, row)
            if args.out:  # after every case: a run cut short keeps what it measured
                args.out.write_text(json.dumps(result, indent=1, default=str))
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    shutil.rmtree(tmp, ignore_errors=True)
    _print_table(result["cases"])
    print(f"elapsed {result['elapsed_s']} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0


def _safe(fn) -> dict:
    try:
        return fn()
    except Exception as err:  # one failing variant is reported, the probe goes on
        traceback.print_exc(limit=3)
        return {"error": f"{type(err).__name__}: {err}"[:1000]}


def _print_case(name: str, row: dict) -> None:
    print(f"\n== {name}", flush=True)
    for label, r in row.items():
        if isinstance(r, str) or "error" in r:
            print(f"  {label:15s} ERROR {(r if isinstance(r, str) else r['error'])[:300]}")
            continue
        engines = ", ".join(f"{p['name']}={p['engine']}" for p in r.get("parts", []))
        print(f"  {label:15s} {r['us']:9.2f} us (kernels {r['kernel_us']:.2f}, host-bound blocks {r['host_bound']})"
              f"  rel_err {r['rel_err']}  {engines}")
        for kname, n, us in r["kernels"]:
            print(f"      {n:4g}x {us:9.2f} us  {kname[:150]}")
        for p in r.get("parts", []):
            tuning = p.get("tuning") or {}
            cands = tuning.get("candidates") or []
            if not cands:
                continue
            print(f"      autotune {p['name']}: {len(cands)} candidates, {tuning.get('tune_ms')} ms, winner "
                  f"{tuning.get('winner')}, heuristic choice {tuning.get('heuristic_choice')}")
            for cand in sorted(cands, key=lambda r: (r["median_ms"] is None, r["median_ms"] or 0)):
                ms = f"{cand['median_ms'] * 1e3:9.2f} us" if cand["median_ms"] is not None else " " * 12
                err = f" {cand.get('error', '')[:80]}" if cand.get("error") else ""
                print(f"        [{cand['index']:3d}] {ms}  {cand['status']:12s} {cand['engine']} "
                      f"ws={cand['workspace_size']}{err}")
    sys.stdout.flush()


def _print_table(cases: dict) -> None:
    print("\nspeedup = torch us / ours us (below 1: ours slower); device us per call")
    print(f"{'case':22s} {'torch us':>9s} {'heur us':>9s} {'tuned us':>9s} {'heur':>6s} {'tuned':>6s}  "
          "torch's longest kernel")
    for name, row in cases.items():
        us = {k: (row.get(k) or {}).get("us") for k in ("torch", "ours_heuristic", "ours_autotune")}
        fmt = {k: f"{v:9.2f}" if v else f"{'-':>9s}" for k, v in us.items()}
        ratio = {k: f"{us['torch'] / us[k]:.2f}x" if us["torch"] and us[k] else "-"
                 for k in ("ours_heuristic", "ours_autotune")}
        kernels = (row.get("torch") or {}).get("kernels") or []
        main = max(kernels, key=lambda k: k[1] * k[2])[0][:90] if kernels else str(row.get("error", ""))[:90]
        print(f"{name:22s} {fmt['torch']} {fmt['ours_heuristic']} {fmt['ours_autotune']} "
              f"{ratio['ours_heuristic']:>6s} {ratio['ours_autotune']:>6s}  {main}")


if __name__ == "__main__":
    raise SystemExit(main())
