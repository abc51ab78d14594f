"""Probe (GPU host): host cost of the pieces a conv call is made of, and where a warm start goes.

  python3 tools/probe_call_path.py --out probe.json          # parts A and B
  python3 tools/probe_call_path.py --warm-child CACHE MODE   # (internal) one fresh warm-start process

A: host us per call of each primitive with the GPU held busy by a sleep kernel (torch imported).
B: a fresh torch process with a warm cache, timed step by step to the end of its first fwd (conv +
bias + gelu), dgrad (relu') and wgrad (bias grad), 16x128x28x28 3x3 fp16 NHWC; MODE "backend" loads
plans as the library does (cuDNN's JSON through the backend, no frontend import), "fe" through the
frontend's deserialize; one more child runs under cProfile, one with -X importtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(x=(16, 128, 28, 28), w=(128, 128, 3, 3))


def host_us(fn, calls=200, rounds=7) -> float:
    import torch

    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def profile_calls(cases: dict, *, calls: int = 200, top: int = 14) -> None:
    """Print a cProfile table (by own time) of `calls` calls of each case, the GPU held busy by a sleep."""
    import cProfile
    import io
    import pstats

    import torch

    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(f"== {name}, {calls} calls\n" + text.getvalue()[-4000:], flush=True)


def part_a(cache: str) -> dict:
    import torch
    import torch.nn.functional as F

    import cudnn_graphs as cg
    from gpu_launch import driver

    cl = torch.channels_last
    x = torch.randn(32, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
    b = torch.randn(128, device="cuda", dtype=torch.half)
    y = torch.empty_like(x)
    dev = x.device
    shape, strides = tuple(x.shape), x.stride()
    s = torch.cuda.current_stream().cuda_stream
    session = cg.Session(cache=cache)
    spec = cg.ConvFwdSpec(x.shape, w.shape, padding=1, dtype="float16", layout="channels_last", bias=True,
                          activation="relu")
    plan = session.plan(spec)
    direct = plan.bind(x=x, w=w, bias=b, y=y, cuda_graph=False)
    graph = plan.bind(x=x, w=w, bias=b, y=y)
    graph.launch(), graph.launch()
    from cudnn_graphs import requests
    from gpu_launch import buffers, streams

    cg.conv_fwd(x, w, b, padding=1, activation="relu", session=session)
    call = next(iter(session.calls.values()))
    launcher = call.launcher
    ptrs3 = (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr())
    launcher.launch(ptrs3, s, lambda _: False), launcher.launch(ptrs3, s, lambda _: False)
    graph_exec = next(iter(launcher._graphs.values()))
    probe = streams.capture_probe("torch", None)
    params = {"padding": 1, "activation": "relu"}
    roles = requests.ConvFwdRequest.roles
    objs = (x, w, b, None, None)
    key_parts = buffers.read_all(roles, objs, s)[0]
    res = {}
    cases = {
        "torch.empty_strided": lambda: torch.empty_strided(shape, strides, dtype=torch.half, device=dev),
        "x.new_empty_strided": lambda: x.new_empty_strided(shape, strides),
        "torch.empty(memory_format)": lambda: torch.empty(shape, dtype=torch.half, device=dev, memory_format=cl),
        "torch.empty_like": lambda: torch.empty_like(x),
        "_cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "read 4 tensors (shape,stride,dtype,dev,ptr)": lambda: [(t.shape, t.stride(), t.dtype, t.get_device(),
                                                                 t.data_ptr()) for t in (x, w, b, y)],
        "driver.is_capturing": lambda: driver.is_capturing(s),
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "stream_pointer(None, torch)": lambda: streams.stream_pointer(None, "torch", 0),
        "capture_probe torch (probe(s))": lambda: probe(s),
        "read_all(conv_fwd roles)": lambda: buffers.read_all(roles, objs, s),
        "memo key + get": lambda: session.calls.get((requests.ConvFwdRequest, key_parts, tuple(params.items()),
                                                      tuple(map(type, params.values())), (), ())),
        "call.allocators[0]()": call.allocators[0],
        "launcher.launch (replay)": lambda: launcher.launch(ptrs3, s, probe),
        "GraphExec.launch": lambda: graph_exec.launch(s),
        "session.handles.on_stream(same)": lambda: session.handles.on_stream(s),
        "bound.launch direct": direct.launch,
        "bound.launch graph": graph.launch,
        "plan.execute": lambda: plan.execute(x=x, w=w, bias=b, y=y),
        "cg.conv_fwd": lambda: cg.conv_fwd(x, w, b, padding=1, activation="relu", session=session),
        "torch relu(conv2d)": lambda: F.relu(F.conv2d(x, w, b, padding=1)),
        "torch conv2d": lambda: F.conv2d(x, w, b, padding=1),
        "torch convolution_backward dx": lambda: torch.ops.aten.convolution_backward(
            x, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]),
    }
    torch.backends.cudnn.benchmark = True
    for name, fn in cases.items():
        fn()
        res[name] = host_us(fn)
        print(f"{name:45s} {res[name]:8.2f} us", flush=True)
    return res


def warm_child(cache: str, mode: str) -> dict:
    marks = {"process_start_to_main": time.perf_counter() - T0}
    t = time.perf_counter()

    def mark(name):
        nonlocal t
        now = time.perf_counter()
        marks[name] = (now - t) * 1e3
        t = now

    import torch

    torch.zeros(1, device="cuda")
    cl = torch.channels_last
    x = torch.randn(*SHAPE["x"], device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = torch.randn(*SHAPE["w"], device="cuda", dtype=torch.half).contiguous(memory_format=cl) * 0.05
    b = torch.randn(128, device="cuda", dtype=torch.half)
    dy = torch.randn_like(x)
    torch.cuda.synchronize()
    mark("torch_ready")
    if mode == "torch":  # torch's own first calls, benchmark=False, one op at a time
        import torch.nn.functional as F

        bwd = torch.ops.aten.convolution_backward
        F.gelu(F.conv2d(x, w, b, padding=1))
        torch.cuda.synchronize()
        mark("torch_fwd")
        bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])
        torch.cuda.synchronize()
        mark("torch_dgrad")
        bwd(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
        torch.cuda.synchronize()
        mark("torch_wgrad")
        return marks
    if mode == "preload":  # which engine library the loads wait for: dlopen each first, timed
        import ctypes
        import glob
        import os
        import sysconfig

        lib_dir = os.path.join(sysconfig.get_path("purelib"), "nvidia", "cudnn", "lib")
        for path in sorted(glob.glob(os.path.join(lib_dir, "libcudnn*.so.9"))):
            ctypes.CDLL(path)
            mark("dlopen_" + os.path.basename(path).split(".")[0])
    profiler = None
    if mode == "profile":
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if mode == "fe":
        import cudnn  # noqa: F401
        mark("import_cudnn")
    import cudnn_graphs as cg
    mark("import_cudnn_graphs")
    from cudnn_graphs.plan import restore
    restore._BACKEND_LOADS = mode != "fe"
    session = cg.Session(cache=cache)
    mark("Session()")
    session.handles.raw()
    mark("handle")
    common = dict(padding=1, dtype="float16", layout="channels_last")
    specs = {"fwd": cg.ConvFwdSpec(x.shape, w.shape, bias=True, activation="gelu", **common),
             "dgrad": cg.ConvBwdDataSpec(x.shape, w.shape, x.shape, activation_backward="relu", **common),
             "wgrad": cg.ConvBwdFilterSpec(x.shape, x.shape, w.shape, bias_grad=True, **common)}
    plans = {}
    for k, spec in specs.items():
        plans[k] = session.plan(spec)
        mark(f"load_{k}")
    y = torch.empty_like(x)
    plans["fwd"].execute(x=x, w=w, bias=b, y=y)
    mark("exec_fwd")
    plans["dgrad"].execute(dy=dy, w=w, pre_act=x, dx=torch.empty_like(x))
    mark("exec_dgrad")
    plans["wgrad"].execute(x=x, dy=dy, dw=torch.empty_like(w), db=torch.empty_like(b))
    mark("exec_wgrad")
    torch.cuda.synchronize()
    mark("sync")
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        print(text.getvalue(), file=sys.stderr)
    if mode == "backend":  # each stored plan finalized again in this process: one-time costs drop out
        from cudnn_graphs.execute import cudnn_backend

        for k, plan in plans.items():
            for part in plan.parts:
                marks.setdefault("parts", []).append({"plan": k, "engine": part.engine,
                                                      "notes": list(part.behavior_notes),
                                                      "blob": len(getattr(part, "serialized", None) or b"")})
                if getattr(part, "backend", None) is not None:
                    mark("-")
                    from cudnn_graphs.graph import serialized

                    cudnn_backend.ExecutionPlan(session.handles.raw(), serialized.backend_plan(part.serialized).plan_json)
                    mark(f"again_{k}_{part.name}")
    marks["stats"] = session.stats()
    marks["modules"] = sorted(m for m in ("cupy", "cudnn", "numpy", "msgpack") if m in sys.modules)
    return marks


def child_env(cache: str) -> dict:
    """Children write and reuse bytecode, as an installed package has it (see bench_calls.warm_start)."""
    import os

    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(cache, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def importtime(cache: str) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, name) of every module `import cudnn_graphs` loaded in a warm child,
    from -X importtime (torch already imported, as in a user's process)."""
    r = subprocess.run([sys.executable, "-X", "importtime", __file__, "--warm-child", cache, "backend"],
                       capture_output=True, text=True, check=True, env=child_env(cache))
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    top = next(i for i, row in enumerate(rows) if row[2].strip() == "cudnn_graphs")
    indent = len(rows[top][2]) - len(rows[top][2].lstrip())
    start = top
    while start > 0 and len(rows[start - 1][2]) - len(rows[start - 1][2].lstrip()) > indent:
        start -= 1
    return rows[start:top + 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--warm-child", nargs=2)
    p.add_argument("--skip-a", action="store_true")
    p.add_argument("--skip-warm", action="store_true")
    p.add_argument("--modes", nargs="*", help="warm-start modes to time (backend, fe)")
    args = p.parse_args(argv)
    if args.warm_child:
        print(json.dumps(warm_child(*args.warm_child)))
        return 0
    import tempfile

    cache = tempfile.mkdtemp()
    out = {}
    if args.skip_warm:
        out["host_us"] = part_a(cache)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
        return 0
    # fill the cache (cold) in a child, then time fresh warm children of each mode, interleaved
    subprocess.run([sys.executable, __file__, "--warm-child", cache, "backend"], check=True, capture_output=True,
                   env=child_env(cache))
    runs = {"backend": [], "fe": [], "torch": []} if not args.modes else {m: [] for m in args.modes}
    for _ in range(3):
        for mode in runs:
            r = subprocess.run([sys.executable, __file__, "--warm-child", cache, mode], check=True,
                               capture_output=True, text=True, env=child_env(cache))
            runs[mode].append(json.loads(r.stdout.strip().splitlines()[-1]))
    out["warm"] = runs
    for mode, rs in runs.items():
        keys = [k for k, v in rs[0].items() if isinstance(v, float)]
        print(mode, {k: round(statistics.median(r[k] for r in rs), 1) for k in keys}, rs[0].get("modules"))
        if "parts" in rs[0]:
            print(rs[0]["parts"])
    out["importtime"] = importtime(cache)
    for cumulative, own, name in out["importtime"]:
        if cumulative >= 1000 or own >= 500:
            print(f"{cumulative / 1e3:8.1f} ms {own / 1e3:6.1f} ms {name}")
    r = subprocess.run([sys.executable, __file__, "--warm-child", cache, "profile"], capture_output=True, text=True,
                       check=True, env=child_env(cache))
    print(r.stderr[-12000:])
    if not args.skip_a:
        out["host_us"] = part_a(cache)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
