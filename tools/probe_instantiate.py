"""Probe (GPU host): when does cuGraphInstantiate wait for all queued GPU work?

    python -m tools.probe_instantiate [--case NAME ...] [--max-waits 4] [--out probe.json]
    python -m tools.probe_instantiate --list          # the cases, one line each

Each case runs in a fresh process (`python -m tools.probe_instantiate --child CASE`: a fresh context, whose
pool of executable slots has not grown yet). Its setup runs on an idle GPU; then, one step after another,
graphs are recorded (`gpu_launch.replay.record`) and instantiated (`gpu_launch.driver.GraphExec`) with
0.3-0.6 s of sleep kept queued on torch's stream ahead of each step. A step whose timed part took over
50 ms is a wait: the case reports the step, the live executables (ours, `driver.live_executables()`)
after it, its ms and whether the queue had drained (it waited for it). A case stops after `--max-waits`
waits or 20 s of steps, so a full run takes about 2-3 minutes.

Cases (`--list` says what each keeps): executables of one kind kept or destroyed (`<kind>_keep`,
`<kind>_destroy`: a memset node, a torch kernel, a cuBLASLt GEMM, all three); kept with 8 memset nodes, 8
or 32 torch kernels, a cat of 64 inputs; the first under CUDA_MODULE_LOADING=EAGER; after
`driver.reserve_executables(256)` / `(3000)`; after 300 / 1000 kept on an idle GPU and destroyed (does the
pool shrink again?); kept with `keep_graph=True`; bare graphs kept (captured, never instantiated) beside
one executable made and destroyed per step; ours kept beside 20 of torch's CUDA graphs; and the library's
grid_sample forward + backward over new geometries, every sight behind queued work or the first sight of
each on an idle GPU (where `replay.reserve_slots` reserves).

Found (H100, driver 580, the scratch version of these cases behind a queued 2-10 s sleep; docs/kernels.md,
"The intermittent 1 s wait"): instantiating graphs and keeping them, the 35th live executable waited for
the whole queue, then the 78th, 121st, 162nd, 205th ... (every ~43), with 1 or 8 memset nodes, a torch
kernel or a cuBLASLt GEMM alike; instantiating and destroying 3000 never waited. Slots freed by
cuGraphExecDestroy stay in the pool: 256 executables instantiated and destroyed on an idle GPU (12 ms of
host time) moved the first wait to the 291st live executable, 3000 (0.14 s) removed every wait up to 3000.
CUDA_MODULE_LOADING=EAGER did not change it (the wait is not lazy kernel loading). The count, not any
graph, is the cause; hence `replay.reserve_slots`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path

from benchmarks import harness

WAIT_MS = 50.0  # a step over this waited (a recording or an instantiation takes 0.1-2 ms)
CHUNK_MS = 300.0  # one queued sleep; two are kept queued, so a wait costs under 0.6 s
CASE_S = 20.0  # a case's steps stop after this much host time
CHILD_TIMEOUT_S = 120.0

CASES: dict = {}  # name -> (what it does, the child's function, extra environment)


# -- the queue and the loop ----------------------------------------------------------------------------

class _Queue:
    """Keeps one to two CHUNK_MS sleeps queued on torch's current stream: each top-up drops the chunks
    whose end event has passed and queues new ones, so every step starts behind queued work."""

    def __init__(self):
        import torch

        self._torch = torch
        self._cycles = harness.sleep_cycles_for(CHUNK_MS)
        self._ends: list = []

    def top_up(self) -> None:
        self._ends = [e for e in self._ends if not e.query()]
        while len(self._ends) < 2:
            harness.sleep(self._cycles)
            end = self._torch.cuda.Event()
            end.record()
            self._ends.append(end)

    def drained(self) -> bool:
        return self._torch.cuda.current_stream().query()


def _steps(step, *, count: int, max_waits: int, idle=None, batch: int = 1) -> dict:
    """`step(i)` for i < `count`, each behind queued work; it returns the ms of its timed part. With `idle`,
    every `batch` steps first run `idle(j)` for the batch's j on an idle GPU."""
    import torch

    from gpu_launch import driver

    torch.cuda.synchronize()
    queue, waits, done = _Queue(), [], 0
    start = time.perf_counter()
    for i in range(count):
        if idle is not None and i % batch == 0:
            torch.cuda.synchronize()
            for j in range(i, min(i + batch, count)):
                idle(j)
            torch.cuda.synchronize()
        queue.top_up()
        took = step(i)
        done = i + 1
        if took > WAIT_MS:
            waits.append({"step": done, "live": driver.live_executables(), "ms": round(took, 1),
                          "queue_drained": queue.drained()})
            if len(waits) >= max_waits:
                break
        if time.perf_counter() - start > CASE_S:
            break
    loop_s = time.perf_counter() - start
    torch.cuda.synchronize()
    return {"steps": done, "of": count, "loop_s": round(loop_s, 2), "waits": waits,
            "live_at_end": driver.live_executables()}


# -- what the graphs hold ------------------------------------------------------------------------------

BODIES = {  # kind -> the launches a recorded graph holds
    "memset": "one 4 KB memset node",
    "memset8": "8 memset nodes",
    "torch_kernel": "one torch kernel (x.mul_(1.0))",
    "kernel8": "8 torch kernels",
    "kernel32": "32 torch kernels",
    "cat64": "torch.cat of 64 tensors (one kernel, large parameters)",
    "gemm": "one cuBLASLt GEMM (f16 64x64x64)",
    "combo": "a memset, a torch kernel and a cuBLASLt GEMM",
}


def _body(kind: str):
    """`body(stream)` launching `kind`'s work on `stream` (what replay.record captures)."""
    import torch

    from gpu_launch import driver

    torch.zeros(1, device="cuda")
    buf = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
    x = torch.randn(256, device="cuda")
    parts = [torch.randn(4, device="cuda") for _ in range(64)]
    cat_out = torch.empty(256, device="cuda")
    a, w, d = (torch.randn(64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()

    def memsets(stream, nodes):
        for j in range(nodes):
            driver.memset_async(buf.data_ptr() + 4096 * j, 4096, stream)

    def on(stream):
        return torch.cuda.stream(torch.cuda.ExternalStream(stream))

    def kernels(stream, count):
        with on(stream):
            for _ in range(count):
                x.mul_(1.0)

    def gemm(stream):
        from cudnn_graphs.torch._mlp import _run

        with on(stream):
            _run(0, "float16", d, a, w, b_col=True)

    def cat(stream):
        with on(stream):
            torch.cat(parts, out=cat_out)

    parts_of = {"memset": [functools.partial(memsets, nodes=1)], "memset8": [functools.partial(memsets, nodes=8)],
                "torch_kernel": [functools.partial(kernels, count=1)], "kernel8": [functools.partial(kernels, count=8)],
                "kernel32": [functools.partial(kernels, count=32)], "cat64": [cat], "gemm": [gemm]}
    parts_of["combo"] = parts_of["memset"] + parts_of["torch_kernel"] + parts_of["gemm"]
    launches = parts_of[kind]

    def body(stream):
        for launch in launches:
            launch(stream)

    return body


# -- the cases -----------------------------------------------------------------------------------------

def _executables(kind: str = "memset", *, max_waits: int, keep: bool = True, count: int = 300, reserve: int = 0,
                 keep_first: int = 0, keep_graph: bool = False, torch_graphs: int = 0) -> dict:
    """Record and instantiate `kind`'s graph `count` times behind queued work, keeping the executables or
    destroying each at once; before that, on an idle GPU: `reserve` slots (driver.reserve_executables),
    `keep_first` executables made and destroyed, `torch_graphs` torch CUDA graphs captured and held."""
    import torch

    from gpu_launch import driver, replay

    body = _body(kind)
    for _ in range(3):  # first uses of kernels, handles and plans, on an idle GPU; destroyed at once
        driver.GraphExec(replay.record(body, 0))
    setup = {"kind": kind, "keep": keep, "keep_graph": keep_graph}
    if reserve:
        start = time.perf_counter()
        driver.reserve_executables(reserve)
        setup.update(reserve=reserve, reserve_ms=round((time.perf_counter() - start) * 1e3, 1))
    if keep_first:
        first = [driver.GraphExec(replay.record(body, 0)) for _ in range(keep_first)]  # all live at once
        setup["kept_then_destroyed"] = len(first)
        del first
        gc.collect()
    held = []
    if torch_graphs:
        buf, side = torch.zeros(1024, device="cuda"), torch.cuda.Stream()
        for _ in range(torch_graphs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):  # synchronises: captured on an idle GPU
                buf.add_(1)
            held.append(graph)
        setup["torch_graphs_held"] = torch_graphs
    kept = []

    def step(i: int) -> float:
        graph = replay.record(body, 0)
        start = time.perf_counter()
        executable = driver.GraphExec(graph, keep_graph=keep_graph)
        took = (time.perf_counter() - start) * 1e3
        if keep:
            kept.append(executable)
        return took  # an executable not kept is destroyed on return

    return setup | _steps(step, count=count, max_waits=max_waits)


def _bare_graphs(*, max_waits: int, count: int = 300) -> dict:
    """Captured graphs kept, never instantiated, beside one memset executable made and destroyed a step."""
    from gpu_launch import driver, replay

    body = _body("memset")
    driver.GraphExec(replay.record(body, 0))
    bare = []  # left to the driver at exit

    def step(i: int) -> float:
        bare.append(replay.record(body, 0))
        graph = replay.record(body, 0)
        start = time.perf_counter()
        driver.GraphExec(graph)
        return (time.perf_counter() - start) * 1e3

    return {"kind": "memset", "bare_graphs_kept": True} | _steps(step, count=count, max_waits=max_waits)


def _grid_sample(*, max_waits: int, first_sight_idle: bool, count: int = 150, batch: int = 25) -> dict:
    """The library's calls: grid_sample forward + backward over `count` new geometries, three sights each
    (direct, recorded, replayed), all behind queued work, or the first on an idle GPU in batches."""
    import torch

    from cudnn_graphs.torch import grid_sample
    from gpu_launch import replay

    def inputs(i: int):  # every i a geometry of its own
        n, h = 1 + i % 7, 8 + i // 7
        return (torch.randn(n, 4, h, 8, device="cuda", requires_grad=True),
                (torch.rand(n, 6, 6, 2, device="cuda") * 2 - 1).requires_grad_())

    def call(pair) -> None:
        grid_sample(*pair, align_corners=False).sum().backward()

    warm, queue = inputs(10**4), _Queue()
    for _ in range(3):  # kernels compiled and loaded first; behind queued work unless first sights are idle
        if not first_sight_idle:  # (a first sight on an idle stream reserves slots: replay.reserve_slots)
            queue.top_up()
        call(warm)
    made = {}

    def idle(j: int) -> None:
        made[j] = inputs(j)
        call(made[j])

    def step(i: int) -> float:
        pair = made.pop(i) if first_sight_idle else inputs(i)
        start = time.perf_counter()
        for _ in range(2 if first_sight_idle else 3):
            call(pair)
        return (time.perf_counter() - start) * 1e3

    result = {"first_sight_idle": first_sight_idle} | _steps(
        step, count=count, max_waits=max_waits, idle=idle if first_sight_idle else None, batch=batch)
    return result | {"recording_behind_work_still_on": replay._behind_work, "reserved": replay._reserved}


def _add(name: str, what: str, fn, **env) -> None:
    CASES[name] = (what, fn, env)


for _kind in ("memset", "torch_kernel", "gemm", "combo"):
    _add(f"{_kind}_keep", f"{BODIES[_kind]}: executables kept", functools.partial(_executables, _kind))
    _add(f"{_kind}_destroy", f"{BODIES[_kind]}: each executable destroyed at once",
         functools.partial(_executables, _kind, keep=False, count=3000))
for _kind in ("memset8", "kernel8", "kernel32", "cat64"):
    _add(f"{_kind}_keep", f"{BODIES[_kind]}: executables kept", functools.partial(_executables, _kind))
_add("memset_keep_eager", "memset_keep under CUDA_MODULE_LOADING=EAGER", functools.partial(_executables, "memset"),
     CUDA_MODULE_LOADING="EAGER")
for _count in (256, 3000):
    _add(f"reserve_{_count}", f"memset executables kept after driver.reserve_executables({_count})",
         functools.partial(_executables, reserve=_count, count=max(400, _count)))
for _count in (300, 1000):
    _add(f"keep_{_count}_then_destroy", f"{_count} kept on an idle GPU and destroyed, then memset executables kept",
         functools.partial(_executables, keep_first=_count, count=_count + 200))
_add("keep_graph", "memset executables kept with keep_graph=True (the graph held too)",
     functools.partial(_executables, keep_graph=True))
_add("bare_graphs", "captured graphs kept uninstantiated; one executable made and destroyed a step", _bare_graphs)
_add("torch_graphs_20", "memset executables kept after 20 torch CUDA graphs captured and held",
     functools.partial(_executables, torch_graphs=20))
_add("grid_sample_behind_work", "grid_sample calls over new geometries, every sight behind queued work",
     functools.partial(_grid_sample, first_sight_idle=False))
_add("grid_sample_first_sight_idle", "grid_sample calls over new geometries, first sights on an idle GPU",
     functools.partial(_grid_sample, first_sight_idle=True))


# -- the processes -------------------------------------------------------------------------------------

def _run_case(name: str, max_waits: int) -> dict:
    what, _, env = CASES[name]
    try:
        row = harness.run_fresh(["-m", "tools.probe_instantiate", "--child", name, "--max-waits", str(max_waits)],
                                env=harness.fresh_env(**env) if env else None, timeout=CHILD_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a failed or hung case is reported, the others still run
        row = {"error": str(exc)[-2000:]}
    return {"case": name, "what": what, **row}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), metavar="NAME",
                   help="a case to run (repeatable; default: all; --list names them)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--max-waits", type=int, default=4, help="a case stops after this many waits (default 4)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        for name, (what, _, _) in CASES.items():
            print(f"{name:30s} {what}")
        return 0
    if args.child:
        print(json.dumps(CASES[args.child][1](max_waits=args.max_waits)))
        return 0
    rows = []
    for name in args.case or CASES:
        rows.append(_run_case(name, args.max_waits))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:  # after every case: a cut-short run keeps what it measured
            harness.write_json(args.out, {"max_waits": args.max_waits, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
