"""Benchmark: fresh-process time to a runnable plan, cold (empty cache) vs warm (disk hit).

Run on a GPU host:  python -m benchmarks.cache --out cache.json
Each measurement is a new Python process. CUDA_CACHE_DISABLE=1 in both, so the driver's own JIT cache
does not hide what a first run on a fresh machine pays.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks import harness


def specs():
    import cudnn_graphs as cg

    x, w = (32, 64, 56, 56), (64, 64, 3, 3)
    cl = dict(padding=1, layout="channels_last")
    return {
        "fwd+bias+add+relu f16": cg.ConvFwdSpec(x, w, dtype="float16", bias=True, residual=True, activation="relu", **cl),
        "fwd+bias+gelu bf16": cg.ConvFwdSpec(x, w, dtype="bfloat16", bias=True, activation="gelu", **cl),
        "fwd+bias+silu f16": cg.ConvFwdSpec(x, w, dtype="float16", bias=True, activation="silu", **cl),
        "dgrad+drelu f16": cg.ConvBwdDataSpec(x, w, x, dtype="float16", activation_backward="relu", **cl),
        "fwd+bias+relu f16": cg.ConvFwdSpec(x, w, dtype="float16", bias=True, activation="relu", **cl),
        "fwd f16": cg.ConvFwdSpec(x, w, dtype="float16", **cl),
        "dgrad f16": cg.ConvBwdDataSpec(x, w, x, dtype="float16", **cl),
        "wgrad f16": cg.ConvBwdFilterSpec(x, x, w, dtype="float16", **cl),
        "fwd f32 NCHW": cg.ConvFwdSpec(x, w, dtype="float32", padding=1, allow_tf32=False),
    }


def child() -> None:
    """One fresh process: time session setup, then each plan and its first execute."""
    t0 = time.perf_counter()
    import torch

    import cudnn_graphs as cg

    session = cg.Session()
    _ = session.handle
    torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - t0) * 1e3
    rows = {}
    for name, spec in specs().items():
        start = time.perf_counter()
        plan = session.plan(spec)
        planned = time.perf_counter()
        bufs = harness.spec_buffers(spec)
        plan.execute(**bufs)
        torch.cuda.synchronize()
        rows[name] = {"plan_ms": (planned - start) * 1e3, "first_execute_ms": (time.perf_counter() - planned) * 1e3,
                      "fused": plan.fused, "engines": list(plan.engines),
                      "runtime_compiled": any("RUNTIME_COMPILATION" in p.behavior_notes for p in plan.parts)}
    print(json.dumps({"setup_ms": setup_ms, "rows": rows, "stats": session.stats()}))


def run_child(cache_dir: str) -> dict:
    env = harness.fresh_env(CUDNN_GRAPHS_CACHE_DIR=cache_dir, CUDA_CACHE_DISABLE="1")
    return harness.run_fresh(["-m", "benchmarks.cache", "--child"], env=env, timeout=600)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm-runs", type=int, default=3, help="fresh warm processes (medians are reported)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache")
        cold = run_child(cache)
        warms = [run_child(cache) for _ in range(args.warm_runs)]
    assert all(w["stats"]["builds"] == 0 for w in warms), [w["stats"] for w in warms]
    table = {}
    for name, c in cold["rows"].items():
        warm = harness.median(w["rows"][name]["plan_ms"] for w in warms)
        table[name] = {"cold_ms": c["plan_ms"], "warm_ms": warm, "ratio": warm / c["plan_ms"],
                       "runtime_compiled": c["runtime_compiled"], "fused": c["fused"], "engines": c["engines"],
                       "cold_first_execute_ms": c["first_execute_ms"],
                       "warm_first_execute_ms": harness.median(w["rows"][name]["first_execute_ms"] for w in warms)}
    result = {"cold_setup_ms": cold["setup_ms"], "warm_setup_ms": harness.median(w["setup_ms"] for w in warms),
              "graphs": table, "cold_stats": cold["stats"], "warm_stats": warms[-1]["stats"]}
    if args.out:
        harness.write_json(args.out, result)
    print(f"{'graph':24s} {'cold ms':>9s} {'warm ms':>8s} {'warm/cold':>9s} {'rtc':>4s}  plan+first execute cold/warm ms")
    for name, r in table.items():
        print(f"{name:24s} {r['cold_ms']:9.1f} {r['warm_ms']:8.2f} {r['ratio']:9.4f} {'yes' if r['runtime_compiled'] else 'no':>4s}"
              f"  {r['cold_ms'] + r['cold_first_execute_ms']:.1f}/{r['warm_ms'] + r['warm_first_execute_ms']:.1f}")
    rtc = [r for r in table.values() if r["runtime_compiled"]]
    if rtc:
        print(f"runtime-compiled: worst warm/cold {max(r['ratio'] for r in rtc):.4f}, "
              f"median warm {harness.median(r['warm_ms'] for r in rtc):.2f} ms")
    print(f"all graphs: median warm {harness.median(r['warm_ms'] for r in table.values()):.2f} ms; "
          f"session setup cold {result['cold_setup_ms']:.0f} ms, warm {result['warm_setup_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
