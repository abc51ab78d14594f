"""Benchmark: cudnn-graphs plans vs PyTorch on ResNet-50's conv layers, and host overhead per call.

Run on a GPU host (torch is the comparison):  python -m benchmarks.conv_layers --out conv_layers.json
Per layer and op (fwd + bias + relu, dgrad, wgrad), bound plans launched directly against torch's op, and
both replayed from CUDA graphs (device time alone): ms per call, medians of CUDA-event timings over
batches of back-to-back launches (launch gaps included where the host is slower), 3 interleaved rounds.
Host overhead: host us per call of a tiny conv through each entry point, the GPU idle at the start.
Inputs are random, never zeros; outputs start as NaN and are checked against float64 torch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import harness

# (name, C, K, kernel, stride, input spatial) for ResNet-50 v1.5 (stride on the 3x3), unique shapes.
RESNET50 = [
    ("conv1", 3, 64, 7, 2, 224),
    ("l1.1x1a", 64, 64, 1, 1, 56), ("l1.3x3", 64, 64, 3, 1, 56), ("l1.1x1b", 64, 256, 1, 1, 56),
    ("l1.1x1c", 256, 64, 1, 1, 56),
    ("l2.1x1a", 256, 128, 1, 1, 56), ("l2.3x3s2", 128, 128, 3, 2, 56), ("l2.1x1b", 128, 512, 1, 1, 28),
    ("l2.down", 256, 512, 1, 2, 56), ("l2.1x1c", 512, 128, 1, 1, 28), ("l2.3x3", 128, 128, 3, 1, 28),
    ("l3.1x1a", 512, 256, 1, 1, 28), ("l3.3x3s2", 256, 256, 3, 2, 28), ("l3.1x1b", 256, 1024, 1, 1, 14),
    ("l3.down", 512, 1024, 1, 2, 28), ("l3.1x1c", 1024, 256, 1, 1, 14), ("l3.3x3", 256, 256, 3, 1, 14),
    ("l4.1x1a", 1024, 512, 1, 1, 14), ("l4.3x3s2", 512, 512, 3, 2, 14), ("l4.1x1b", 512, 2048, 1, 1, 7),
    ("l4.down", 1024, 2048, 1, 2, 14), ("l4.1x1c", 2048, 512, 1, 1, 7), ("l4.3x3", 512, 512, 3, 1, 7),
]


def pair(ours, theirs, *, inner: int, reps: int) -> tuple[float, float]:
    """Median ms per call of each, `reps` batches of `inner` back-to-back calls (no sleep ahead), the two
    interleaved over 3 rounds so clock drift hits both alike."""
    measure = {"ms": lambda fn: harness.device_ms(fn, calls=inner, rounds=reps, sleep_cycles=0, warmup=3)}
    ms = harness.interleaved({"ours": ours, "torch": theirs}, measure, rounds=3)["ms"]
    return ms["ours"], ms["torch"]


def layer_cases(batch: int):
    import cudnn_graphs as cg

    for name, c, k, r, s, hw in RESNET50:
        pad = r // 2
        x = (batch, c, hw, hw)
        w = (k, c, r, r)
        common = dict(padding=pad, stride=s, dtype="float16", layout="channels_last")
        fwd = cg.ConvFwdSpec(x, w, bias=True, activation="relu", **common)
        yield name, fwd, cg.ConvBwdDataSpec(fwd.y_shape, w, x, **common), cg.ConvBwdFilterSpec(x, fwd.y_shape, w, **common)


def bench_layers(session, *, batch: int, inner: int, reps: int, check: bool):
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    rows = []
    for name, fwd, dgrad, wgrad in layer_cases(batch):
        x = torch.randn(fwd.x_shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(fwd.w_shape, device="cuda", dtype=torch.float16) * 0.05).contiguous(memory_format=torch.channels_last)
        b = torch.randn(fwd.w_shape[0], device="cuda", dtype=torch.float16)
        dy = torch.randn(fwd.y_shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        y, dx, dw = harness.poisoned_like(dy), harness.poisoned_like(x), harness.poisoned_like(w)
        stride, pad = fwd.stride, [p for p, _ in fwd.padding]
        row = {"layer": name, "x": list(fwd.x_shape), "w": list(fwd.w_shape), "stride": fwd.stride[0]}

        f_plan, d_plan, w_plan = session.plan(fwd), session.plan(dgrad), session.plan(wgrad)
        # Launched directly, as torch launches: graph replays are timed separately below.
        f_bound = f_plan.bind(x=x, w=w, bias=b, y=y, cuda_graph=False)
        d_bound = d_plan.bind(dy=dy, w=w, dx=dx, cuda_graph=False)
        w_bound = w_plan.bind(x=x, dy=dy, dw=dw, cuda_graph=False)

        def torch_fwd():
            F.relu(F.conv2d(x, w, b, stride=stride, padding=pad), inplace=True)

        def torch_dgrad():
            torch.ops.aten.convolution_backward(dy, x, w, None, stride, pad, [1, 1], False, [0, 0], 1,
                                                [True, False, False])

        def torch_wgrad():
            torch.ops.aten.convolution_backward(dy, x, w, None, stride, pad, [1, 1], False, [0, 0], 1,
                                                [False, True, False])

        for kind, bound, theirs, plan in (("fwd", f_bound, torch_fwd, f_plan), ("dgrad", d_bound, torch_dgrad, d_plan),
                                          ("wgrad", w_bound, torch_wgrad, w_plan)):
            t_ours, t_torch = pair(bound.launch, theirs, inner=inner, reps=reps)
            # Device time alone: both sides replayed from CUDA graphs, so launch gaps do not count.
            g_ours, g_torch = pair(bound.capture().replay, _torch_graph(theirs), inner=inner, reps=reps)
            row[kind] = {"ours_ms": t_ours, "torch_ms": t_torch, "speedup": t_torch / t_ours,
                         "graph_ours_ms": g_ours, "graph_torch_ms": g_torch, "graph_speedup": g_torch / g_ours,
                         "engines": list(plan.engines), "fused": plan.fused}
        if check:
            row["rel_err"] = _check(x, w, b, y, dy, dx, dw, stride, pad)
        rows.append(row)
        print(f"{name:10s} " + "  ".join(f"{k} {row[k]['speedup']:.2f}x (graph {row[k]['graph_speedup']:.2f}x)"
                                          for k in ("fwd", "dgrad", "wgrad")), flush=True)
    return rows


def _torch_graph(fn):
    """`fn` captured into a torch CUDA graph after a warm-up on a side stream; returns its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _check(x, w, b, y, dy, dx, dw, stride, pad) -> dict:
    """Errors of the last timed outputs against float64 torch (they ran on random inputs)."""
    import torch

    torch.cuda.synchronize()
    want = harness.conv2d_reference(x, w, dy, bias=b, stride=stride, padding=pad)
    return {"y": harness.rel_err(y, want["y"]), "dx": harness.rel_err(dx, want["dx"]),
            "dw": harness.rel_err(dw, want["dw"])}


def bench_host_overhead(session, *, calls: int) -> dict:
    """Host time per call for a tiny conv: the GPU never becomes the bottleneck."""
    import torch
    import torch.nn.functional as F

    import cudnn_graphs as cg
    from cudnn_graphs.graph import frontend

    spec = cg.ConvFwdSpec((1, 8, 8, 8), (8, 8, 3, 3), padding=1, dtype="float16", layout="channels_last",
                          bias=True, activation="relu")
    x = torch.randn(spec.x_shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(spec.w_shape, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    b = torch.randn(8, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    plan = session.plan(spec)
    bound = plan.bind(x=x, w=w, bias=b, y=y)  # cuda_graph="auto": replays a graph from the second launch
    direct = plan.bind(x=x, w=w, bias=b, y=y, cuda_graph=False)
    part = plan.parts[0]
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    pack = {1: x, 2: w, 3: b, 5: y}
    handle = session.handle
    frontend.cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def fe_execute():
        part.graph.execute_plan_at_index(pack, ws, part.index, handle=handle)

    request = cg.ConvFwdRequest(x, w, y=y, bias=b, padding=1, activation="relu")
    captured = plan.bind(x=x, w=w, bias=b, y=y).capture()
    variants = {
        "bound_launch": bound.launch,
        "bound_launch_direct": direct.launch,
        "bound_capture_replay": captured.replay,
        "frontend_execute_plan_at_index": fe_execute,
        "plan_execute": lambda: plan.execute(x=x, w=w, bias=b, y=y),
        "session_run_request": lambda: session.run(request),
        "torch_conv2d_relu": lambda: F.relu(F.conv2d(x, w, b, padding=1), inplace=True),
    }
    return {name: harness.host_us(fn, calls=calls, rounds=7, sleep_cycles=0) for name, fn in variants.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--inner", type=int, default=10, help="launches per timed batch")
    parser.add_argument("--reps", type=int, default=10, help="timed batches per measurement")
    parser.add_argument("--calls", type=int, default=2000, help="calls per host-overhead sample")
    parser.add_argument("--out", type=Path, default=None, help="write the full results as JSON here")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    parser.add_argument("--policy", choices=("heuristic", "autotune"), default="heuristic",
                        help="how our plans are chosen (autotune times every candidate first)")
    parser.add_argument("--autotune-limit", type=int, default=None, help="candidates timed per graph")
    args = parser.parse_args(argv)

    import torch

    import cudnn_graphs as cg

    session = cg.Session(policy=args.policy, autotune_limit=args.autotune_limit, cache=False)
    t0 = time.perf_counter()
    rows = bench_layers(session, batch=args.batch, inner=args.inner, reps=args.reps, check=not args.no_check)
    host = bench_host_overhead(session, calls=args.calls)
    summary = {}
    for k in ("fwd", "dgrad", "wgrad"):
        for metric in ("speedup", "graph_speedup"):
            summary[f"{k}_{metric}_geomean"] = harness.geomean(r[k][metric] for r in rows)
            summary[f"{k}_{metric}_min"] = min(r[k][metric] for r in rows)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "env": session.env.to_dict(),
              "policy": args.policy, "autotune_limit": args.autotune_limit,
              "batch": args.batch, "layers": rows, "host_overhead_us": host, "summary": summary,
              "seconds": time.perf_counter() - t0}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{'layer':10s} {'fwd ms':>8s} {'torch':>8s} {'x':>5s} {'dgrad':>8s} {'torch':>8s} {'x':>5s} "
          f"{'wgrad':>8s} {'torch':>8s} {'x':>5s}  max rel err")
    for r in rows:
        cells = " ".join(f"{r[k]['ours_ms']:8.4f} {r[k]['torch_ms']:8.4f} {r[k]['speedup']:5.2f}"
                         for k in ("fwd", "dgrad", "wgrad"))
        err = max(r.get("rel_err", {"-": 0}).values())
        print(f"{r['layer']:10s} {cells}  {err:.1e}")
    for metric, label in (("speedup", "launched"), ("graph_speedup", "CUDA-graph replay")):
        print(f"geo-mean speedup vs torch, {label}: " + ", ".join(
            f"{k} {summary[f'{k}_{metric}_geomean']:.3f}x (min {summary[f'{k}_{metric}_min']:.2f}x)"
            for k in ("fwd", "dgrad", "wgrad")))
    print("host us/call: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
