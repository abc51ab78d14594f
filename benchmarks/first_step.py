"""Benchmark: time from process start to the first completed ResNet-50 conv step, four ways.

    python -m benchmarks.first_step --out first_step.json      (on a GPU host; torch is the comparison)

One step = every conv layer of ResNet-50 forward (bias+relu epilogues, residual adds), then dgrad (with
relu') and wgrad (with the bias gradient) in reverse order, at batch 32, fp16 channels_last. Each way
runs in a fresh process, timed from just before the process is started to the end of its step:
  a) torch, cudnn.benchmark=True       b) ours, cold cache, heuristic plans
  c) ours, cold cache, autotuned       d) ours, warm cache after (c)
"Ours" is a process of this library and CuPy alone (buffers from CuPy): the library needs no torch.
(d) runs a second time in a process that imports torch and allocates with it, as a training job
would; torch's own import (seconds) is then in both (a) and (d) and bounds their ratio.
--jit-cache off (default): CUDA_CACHE_DISABLE=1 keeps the driver's JIT cache from carrying compiled
kernels between processes (a fresh node). --jit-cache on: the way real jobs run, the driver's JIT
cache on (in a private directory, empty at the start), torch run twice and its second process
reported as (a); --warm-from heuristic warms the cache with (b) instead of the long autotune (c).
Run `python3 -m compileall` over the library first: an installed package has its bytecode.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


def child(mode: str, batch: int, limit: int | None, framework: str) -> dict:
    marks = {"python_started": time.time()}
    xp = _framework(framework)
    marks["framework_imported"] = time.time()
    xp.empty(1, device="cuda") if framework == "torch" else xp.cuda.runtime.free(0)  # creates the CUDA context
    marks["cuda_context"] = time.time()
    from cudnn_graphs.presets import layer_specs, resnet_layers

    layers = [(layer, list(layer_specs(layer, batch=batch, dtype="float16", layout="channels_last")))
              for layer in resnet_layers("resnet50")]
    bufs = [[harness.spec_buffers(spec, framework) for spec in specs] for _, specs in layers]
    _synchronize(xp, framework)
    ready = marks["buffers_ready"] = time.time()
    if mode == "torch":
        xp.backends.cudnn.benchmark = True
        _torch_step(layers, bufs, xp)
        stats = {}
    else:
        import cudnn

        import cudnn_graphs as cg

        cudnn.backend_version()  # loads libcudnn
        marks["cudnn_loaded"] = time.time()
        session = cg.Session(policy="autotune" if mode in ("autotune", "warm") else "heuristic",
                             autotune_limit=limit)
        for (layer, specs), layer_bufs in zip(layers, bufs):
            for spec, b in zip(specs, layer_bufs):
                if spec.op == "conv_fwd":
                    session.plan(spec).execute(**b)
        for (layer, specs), layer_bufs in reversed(list(zip(layers, bufs))):
            for spec, b in zip(specs, layer_bufs):
                if spec.op != "conv_fwd":
                    session.plan(spec).execute(**b)
        stats = session.stats()
        stats["chosen_by"] = sorted({session.plan(s).chosen_by for _, specs in layers for s in specs})
    _synchronize(xp, framework)
    return {"done": time.time(), "ready": ready, "stats": stats, "marks": marks,
            "torch_in_process": "torch" in sys.modules}


def _framework(name: str):
    if name == "torch":
        import torch

        return torch
    import cupy

    return cupy


def _synchronize(xp, framework: str) -> None:
    xp.cuda.synchronize() if framework == "torch" else xp.cuda.Device().synchronize()


def _torch_step(layers, bufs, torch) -> None:
    """What autograd runs for these layers: conv(+bias)(+z) -> relu; convolution_backward; relu' mask."""
    F = torch.nn.functional
    for (layer, specs), layer_bufs in zip(layers, bufs):
        spec, b = specs[0], layer_bufs[0]
        pre = F.conv2d(b["x"], b["w"], b["bias"], stride=spec.stride, padding=spec.padding[0][0])
        if spec.residual:
            pre = pre + b["z"]
        b["y"].copy_(torch.relu(pre) if layer.relu else pre)
    for (layer, specs), layer_bufs in reversed(list(zip(layers, bufs))):
        for spec, b in zip(specs[1:], layer_bufs[1:]):
            if spec.op == "conv_bwd_data":
                dx, _, _ = torch.ops.aten.convolution_backward(
                    b["dy"], b["dx"], b["w"], None, list(spec.stride), [spec.padding[0][0]] * 2, [1, 1], False,
                    [0, 0], 1, [True, False, False])
                b["dx"].copy_(dx * (b["pre_act"] > 0))
            else:
                _, dw, db = torch.ops.aten.convolution_backward(
                    b["dy"], b["x"], b["dw"], [spec.w_shape[0]], list(spec.stride), [spec.padding[0][0]] * 2,
                    [1, 1], False, [0, 0], 1, [False, True, True])
                b["dw"].copy_(dw)
                b["db"].copy_(db)


def run_child(mode: str, cache: Path, args, framework: str = "cupy") -> dict:
    jit = {"CUDA_CACHE_DISABLE": "1"} if args.jit_cache == "off" else {"CUDA_CACHE_PATH": str(args.jit_cache_dir)}
    env = harness.fresh_env(args.pycache_dir, CUDNN_GRAPHS_CACHE_DIR=cache, **jit)
    if args.jit_cache == "on":
        env.pop("CUDA_CACHE_DISABLE", None)
    cmd = ["-m", "benchmarks.first_step", "--child", mode, "--framework", framework, "--batch", str(args.batch)]
    if args.autotune_limit:
        cmd += ["--autotune-limit", str(args.autotune_limit)]
    start = time.time()
    out = harness.run_fresh(cmd, env=env, timeout=900)
    out["seconds"] = out["done"] - start
    out["setup_seconds"] = out["ready"] - start  # interpreter, framework import, CUDA context, buffers
    out["marks"] = {name: round(t - start, 3) for name, t in out["marks"].items()}  # seconds since the spawn
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--framework", choices=("cupy", "torch"), default="cupy", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--autotune-limit", type=int, default=None,
                   help="candidates timed per graph in (c) (default: all; torch's benchmark_limit is 10)")
    p.add_argument("--jit-cache", choices=("off", "on"), default="off",
                   help="off: CUDA_CACHE_DISABLE=1 (a fresh node); on: the driver's JIT cache kept, torch timed in "
                        "its second process")
    p.add_argument("--warm-from", choices=("autotune", "heuristic"), default="autotune",
                   help="which cold run fills the cache that (d) starts from")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.autotune_limit, args.framework)))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.jit_cache_dir = Path(tmp, "jit-cache")
        args.pycache_dir = Path(tmp, "pycache")  # bytecode as an installed package has it, after the first child
        heur, tuned = Path(tmp, "heuristic"), Path(tmp, "autotune")
        warm_cache = tuned if args.warm_from == "autotune" else heur
        runs = [("a_torch_benchmark", "torch", Path(tmp, "unused"), "torch")]
        if args.jit_cache == "on":  # the first torch process fills the JIT cache; the second is what jobs see
            runs = [("a_torch_benchmark_first_process", "torch", Path(tmp, "unused"), "torch"), *runs]
        runs += [("b_cold_heuristic", "heuristic", heur, "cupy")]
        if args.warm_from == "autotune":
            runs += [("c_cold_autotune", "autotune", tuned, "cupy")]
        runs += [("d_warm", "warm" if args.warm_from == "autotune" else "heuristic", warm_cache, "cupy"),
                 ("d_warm_torch_process", "warm" if args.warm_from == "autotune" else "heuristic", warm_cache,
                  "torch")]
        for name, mode, cache, framework in runs:
            results[name] = run_child(mode, cache, args, framework)
            print(f"{name:36s} {results[name]['seconds']:8.2f} s   (setup {results[name]['setup_seconds']:.2f} s)  "
                  f"{results[name]['marks']} {results[name]['stats']}", flush=True)
    a, d, dt = (results[k]["seconds"] for k in ("a_torch_benchmark", "d_warm", "d_warm_torch_process"))
    step = {k: r["seconds"] - r["setup_seconds"] for k, r in results.items()}
    warm = results["d_warm"]["stats"]
    summary = {"jit_cache": args.jit_cache, "warm_from": args.warm_from, "warm_vs_torch": a / d,
               "warm_in_torch_process_vs_torch": a / dt,
               "step_only_warm_vs_torch": step["a_torch_benchmark"] / step["d_warm"],
               "step_only_warm_torch_process_vs_torch": step["a_torch_benchmark"] / step["d_warm_torch_process"],
               "warm_plans": warm.get("chosen_by"),
               "warm_builds_and_timings": [warm.get(k) for k in ("builds", "autotuned", "timings")]}
    if "c_cold_autotune" in results:
        summary["warm_vs_cold_autotune"] = results["c_cold_autotune"]["seconds"] / d
    print(json.dumps(summary, indent=1))
    if args.out:
        harness.write_json(args.out, {"batch": args.batch, "autotune_limit": args.autotune_limit,
                                      "results": results, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
