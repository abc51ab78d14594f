"""Probe (GPU host): which first-time driver work makes the host wait for a queued ~1 s sleep?

    python -m tools.probe_stall_sources [--out probe.json] [--only NAME ...]

A recording behind queued work was seen to wait ~1 s for the GPU once in a few runs of
`test_no_device_synchronisation` (the queue was a 1 s sleep). Each case here runs in a fresh process
(a fresh context: what a context has done before decides whether it must grow something): the case's
setup runs on an idle GPU, then a ~1 s sleep is queued and the step under test is timed on the host,
with whether the GPU was still busy after it. A step that took ~1 s waited (a direct launch that waited
leaves its own kernel running, so "gpu_busy_after" alone does not tell).

Cases, each under CUDA_MODULE_LOADING=LAZY (torch's default) and EAGER: the first launch of a kernel with
a local-memory frame of 256 B to 32 KB (the context's local memory may have to grow), the same kernel first
seen inside a captured and instantiated CUDA graph, a graph captured and instantiated while 0-5000 others
are held, a function fetched from a loaded module (lazy loading loads it then), a torch kernel first used
behind the sleep, a new block for torch's caching allocator (cudaMalloc), and our grid_sample f16 calls'
recordings in a fresh process.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import harness

KERNEL = r"""
extern "C" __global__ void frame(float* out, int n, int k) {
    volatile float buf[FRAME / 4];  // volatile + a run-time index: the array lives in local memory
    for (int i = 0; i < FRAME / 4; ++i) buf[i] = out[(i * k) % n];
    out[threadIdx.x % n] = buf[(threadIdx.x * k) % (FRAME / 4)];
}
"""

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _frame_kernel(frame: int):
    import cupy

    module = cupy.RawModule(code=KERNEL, options=(f"-DFRAME={frame}",))
    return module.get_function("frame")


def _behind_sleep(step) -> dict:
    return harness.behind_sleep(step, cycles=harness.SLEEP_STALL)  # about a second of an H100's clock


def _launch_frame(fn, out, stream_ptr: int) -> None:
    import cupy
    import numpy as np

    with cupy.cuda.ExternalStream(stream_ptr):
        fn((1024,), (256,), (out, np.int32(out.size), np.int32(7)))


def _frame_direct(frame: int) -> dict:
    import cupy
    import torch

    torch.zeros(1, device="cuda")
    out = cupy.ones(4096, dtype=cupy.float32)
    fn = _frame_kernel(frame)  # compiled, loaded and fetched on an idle GPU
    fn.attributes  # noqa: B018 - makes sure the function is fetched
    return {"local_bytes": fn.local_size_bytes,
            **_behind_sleep(lambda: _launch_frame(fn, out, torch.cuda.current_stream().cuda_stream))}


def _frame_graph(frame: int) -> dict:
    import cupy
    import torch

    torch.zeros(1, device="cuda")
    out = cupy.ones(4096, dtype=cupy.float32)
    fn = _frame_kernel(frame)
    fn.attributes  # noqa: B018
    side = cupy.cuda.Stream(non_blocking=True)
    holder = {}

    def capture_and_instantiate():
        side.begin_capture()
        _launch_frame(fn, out, side.ptr)
        holder["graph"] = side.end_capture()  # CuPy instantiates the graph here

    result = {"local_bytes": fn.local_size_bytes, "capture+instantiate": _behind_sleep(capture_and_instantiate)}
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    result["graph launch"] = _behind_sleep(lambda: holder["graph"].launch(stream))
    return result


for _frame in (256, 1024, 2048, 4096, 32768):  # the default stack limit (CU_LIMIT_STACK_SIZE) is 1024 bytes
    CASES[f"frame_{_frame}_direct"] = functools.partial(_frame_direct, _frame)
for _frame in (256, 2048, 32768):
    CASES[f"frame_{_frame}_graph"] = functools.partial(_frame_graph, _frame)


def _many_graphs(count: int) -> dict:
    """`count` instantiated one-kernel graphs held, then one more captured, instantiated and launched behind
    the sleep (a process that has recorded many calls' graphs)."""
    import cupy
    import numpy as np
    import torch

    torch.zeros(1, device="cuda")
    out = cupy.ones(4096, dtype=cupy.float32)
    fn = _frame_kernel(16)
    side = cupy.cuda.Stream(non_blocking=True)

    def one():
        side.begin_capture()
        fn((1,), (32,), (out, np.int32(out.size), np.int32(7)), stream=side)
        return side.end_capture()

    held = [one() for _ in range(count)]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for graph in held[-4:]:
        graph.launch(stream)
    result = {"held": len(held), "capture+instantiate+launch": _behind_sleep(lambda: one().launch(stream))}
    return result


for _count in (0, 1000, 5000):
    CASES[f"graphs_{_count}_held"] = functools.partial(_many_graphs, _count)


@case
def get_function_after_load():
    import cupy
    import torch

    torch.zeros(1, device="cuda")
    module = cupy.RawModule(code=KERNEL, options=("-DFRAME=64",))
    module.compile()  # loaded, nothing fetched
    return _behind_sleep(lambda: module.get_function("frame"))


@case
def first_torch_kernel():
    import torch

    x = torch.rand(1 << 16, device="cuda")
    return _behind_sleep(lambda: torch.special.erfcx(x))


@case
def torch_new_allocation():
    """A block torch's caching allocator has not got yet: cudaMalloc behind the sleep."""
    import torch

    torch.zeros(1, device="cuda")
    return _behind_sleep(lambda: torch.empty(1 << 31, dtype=torch.uint8, device="cuda"))


@case
def our_grid_sample_f16_first_recording():
    """The failing test's sequence: each call once on an idle GPU, then the second call (the recording)."""
    import torch

    from fallback_kernels import grid_sample as gs
    from gpu_launch import replay

    x = torch.randn(32, 32, 64, 64, device="cuda", dtype=torch.float16)
    grid = (torch.rand(32, 64, 64, 2, device="cuda", dtype=torch.float16) * 2.2 - 1.1)
    go = torch.randn(32, 32, 64, 64, device="cuda", dtype=torch.float16)
    calls = {"forward": lambda: gs.grid_sample(x, grid),
             "backward fast": lambda: gs.grid_sample_backward(go, x, grid),
             "backward deterministic": lambda: gs.grid_sample_backward(go, x, grid, deterministic=True)}
    for fn in calls.values():
        fn()
    return {name: _behind_sleep(fn) for name, fn in calls.items()} | {"behind_work_kept": replay._behind_work}


def _child(name: str) -> None:
    print(json.dumps(CASES[name]()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--only", nargs="*")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    rows = {}
    for name in args.only or CASES:
        for loading in ("LAZY", "EAGER"):
            env = dict(os.environ, CUDA_MODULE_LOADING=loading)
            done = subprocess.run([sys.executable, "-m", "tools.probe_stall_sources", "--child", name], env=env,
                                  cwd=harness.ROOT, capture_output=True, text=True, timeout=300)
            row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                {"error": done.stderr[-2000:]}
            rows[f"{name} {loading}"] = row
            print(f"{name} {loading}: {json.dumps(row)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
