"""Benchmark (two GPUs): DistributedDataParallel training, torch's model against `convert(model)`, one process a GPU.

    python -m benchmarks.ddp --out ddp.json [--model resnet50] [--batch 64] [--steps 20] [--rounds 5]
                             [--no-captured] [--gpus 2]

The parent starts one process per GPU (NCCL, MASTER_ADDR 127.0.0.1, a free port, NVLink multicast off,
as tests/gpu_ddp_worker.py is started) and exits non-zero if any fails or there are fewer GPUs than
--gpus (2). A rank that raises prints its traceback and leaves at once (no NCCL teardown, which can hang
while a peer waits in a collective); the parent names it, stops the others and exits with its status;
at --timeout (480 s, under a 10-minute command limit) it stops them all and exits 124.
Each rank, AMP fp16 autocast, channels_last, `cudnn.benchmark=True` (torch autotunes; ours plans with
the autotune policy, kept in the plan cache), --batch images per GPU, SGD with momentum:
  torch          DDP(model), torchvision's model from one seed;
  ours           DDP(convert(model)), the same initialisation;
  ours_captured  DDP(capture(convert(model), (x,))): the inner module captured, then wrapped, as
                 `cudnn_graphs.torch.capture`'s docstring says (--no-captured leaves it out).
Every rank builds the candidates from the same seed and trains each on the same batches (its own shard:
--data-batches random batches per rank, cycled), --warmup steps first (plans built and autotuned, DDP's
buckets rebuilt in the second; 11 by default: DDP's runtime statistics synchronise the host on the
previous step's CUDA events at the start of its forwards 2 to 11, and of every 100th), then --rounds
rounds of one block of --steps steps per candidate (`harness.interleaved`: each round starts one candidate
later), a barrier before each block; rank 0 times each block with CUDA events. Every candidate runs the same steps from the same initialisation, so the losses
compare: the first step's, and rank 0's at the end of each block. Rank 0 prints one JSON line after the
setup, after each round and at the end (the medians, the ratios torch / ours), and rewrites --out as it
goes.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks import harness, models

# NVLink multicast stays off on shared hosts: a program using it can take the GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON result (rank 0 rewrites it after each round)")
    p.add_argument("--model", default="resnet50", help="a torchvision.models constructor")
    p.add_argument("--batch", type=int, default=64, help="images per GPU")
    p.add_argument("--gpus", type=int, default=2, help="processes, one per GPU (at least 2)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5, help="rounds of one block per candidate")
    p.add_argument("--warmup", type=int, default=11, help="untimed steps per candidate first (at least 2; 11 "
                   "covers DDP's synchronising runtime statistics of its first steps)")
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--data-batches", type=int, default=4, help="random batches per rank, cycled")
    p.add_argument("--captured", action=argparse.BooleanOptionalAction, default=True,
                   help="add DDP around capture(convert(model)) (default on)")
    p.add_argument("--timeout", type=float, default=480, help="seconds before the ranks are stopped (expected "
                   "run: 1-3 minutes on two H100s, not yet measured)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank; its environment says which
    args = p.parse_args(argv)
    for name in ("batch", "steps", "rounds", "data_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: at least 1")
    if args.warmup < 2:
        p.error("--warmup: at least 2 (DDP rebuilds its buckets after the first step)")
    if args.gpus < 2:
        p.error("--gpus: at least 2")
    return args


# -- the parent ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict | None = None) -> dict:
    """The environment of rank `rank` of `world` (torchrun's variables), NVLink multicast off."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST,
               PYTHONPATH=os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p))
    return env


def gpus_missing(wanted: int) -> str | None:
    """Why this host cannot run `wanted` ranks (None where it can)."""
    try:
        import torch
    except ImportError:
        return "benchmarks.ddp needs torch"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0  # no CUDA context here
    if have < wanted:
        return f"benchmarks.ddp needs {wanted} CUDA GPUs (--gpus {wanted}); this host has {have}"
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return "benchmarks.ddp needs torch.distributed with NCCL"
    return None


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through launch, which stops the ranks


def worker_command(argv: list[str], rank: int) -> list[str]:
    """The command line of rank `rank` (its environment, `rank_env`, says which rank it is)."""
    return [sys.executable, "-m", "benchmarks.ddp", *argv, "--worker"]


def launch(argv: list[str], args) -> int:
    """Start the ranks (rank 0's stdout is ours), wait for them; stop them all when one fails, at
    --timeout, or when this process is stopped. Returns the exit status of the rank that failed first
    (128 + N for one killed by signal N; 124 at --timeout), else 0."""
    port = free_port()
    # this directory (a relative --out lands where it would without the ranks); the repository is on PYTHONPATH
    procs = [subprocess.Popen(worker_command(argv, rank), env=rank_env(rank, args.gpus, port),
                              preexec_fn=harness.die_with_parent, stdout=None if rank == 0 else subprocess.DEVNULL)
             for rank in range(args.gpus)]
    deadline, failure = time.monotonic() + args.timeout, 0
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one polled: a failed rank is seen at once
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                failure = code if code > 0 else 128 - code  # -N: killed by signal N
                others = ": stopping the others" if None in codes else ""
                print(f"benchmarks.ddp: rank {rank} exited {code}{others}", file=sys.stderr, flush=True)
                break
            if None not in codes:
                break
            if time.monotonic() > deadline:
                print(f"benchmarks.ddp: --timeout {args.timeout:g} s passed: stopping the ranks", file=sys.stderr,
                      flush=True)
                failure = 124
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return failure


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        return run_worker(args)
    why = gpus_missing(args.gpus)
    if why:
        print(why, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    return launch(argv, args)


# -- one rank -----------------------------------------------------------------------------------------

def run_worker(args) -> int:
    """`worker`, but a rank that raises leaves at once with status 1 after its traceback: a normal exit
    would destroy the NCCL process group, which can hang while a peer still waits in a collective. The
    parent sees the exit and stops the other ranks."""
    try:
        return worker(args)
    except BaseException as err:  # noqa: BLE001 - every failure ends this rank the same way
        traceback.print_exc()
        print(f"benchmarks.ddp: rank {os.environ.get('RANK', '?')} failed: {type(err).__name__}: {err}"[:2000],
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def make_step(model, batches: list, lr: float):
    """One training step of `model` on the next of `batches` (`models.train_step`: AMP fp16 forward,
    cross-entropy, backward, the optimizer), SGD with momentum; returns the loss tensor (no host
    synchronisation)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    steps = itertools.cycle([models.train_step(model, opt, x, y) for x, y in batches])
    return lambda: next(steps)()


def summary(ms: dict[str, list[float]], block_losses: dict[str, list[float]]) -> dict:
    """Medians of the blocks' ms per step, torch / ours ratios, each candidate's last loss."""
    med = {k: harness.median(v) for k, v in ms.items()}
    return {"ms_per_step": med, "ratio": harness.ratio(med.get("torch"), med.get("ours")),
            "ratio_captured": harness.ratio(med.get("torch"), med.get("ours_captured")),
            "loss_after": {k: v[-1] if v else None for k, v in block_losses.items()}}


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cudnn_graphs.torch as cgt

    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    began = time.perf_counter()
    result: dict = {"model": args.model, "batch_per_gpu": args.batch, "world": world, "steps": args.steps,
                    "rounds": args.rounds, "warmup": args.warmup, "lr": args.lr, "errors": {},
                    "device": torch.cuda.get_device_name(device), "torch": torch.__version__}

    def report(phase: str, **extra) -> None:
        if rank == 0:
            line = {"phase": phase, **extra}
            print(json.dumps(line, default=str), flush=True)
            result.update(extra)
            if args.out:
                harness.write_json(args.out, result)

    torch.manual_seed(0)  # the same initialisation on every rank and for every candidate
    base = getattr(torchvision.models, args.model)(weights=None).to(device).to(memory_format=cl)
    gen = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own shard
    batches = [(torch.randn(args.batch, 3, 224, 224, device=device, generator=gen).contiguous(memory_format=cl),
                torch.randint(0, 1000, (args.batch,), device=device, generator=gen))
               for _ in range(args.data_batches)]
    modules = {"torch": copy.deepcopy(base), "ours": cgt.convert(copy.deepcopy(base))}
    if args.captured:
        captured, ok = None, 1
        try:  # the inner module captured, then wrapped (capture refuses a DDP wrapper)
            with torch.autocast("cuda", dtype=torch.float16):
                captured = cgt.capture(cgt.convert(copy.deepcopy(base)), (batches[0][0],))
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - reported; the others still run
            ok = 0
            result["errors"]["ours_captured"] = f"rank {rank}: {type(err).__name__}: {err}"[:1000]
        agreed = torch.tensor([ok], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank wraps the same candidates, or none hangs
        if int(agreed.item()):
            modules["ours_captured"] = captured
        elif "ours_captured" not in result["errors"]:
            result["errors"]["ours_captured"] = "failed on another rank"
        del captured  # where not kept: its graphs' memory pool goes now
    ddps = {k: DDP(m, device_ids=[local]) for k, m in modules.items()}
    steps = {k: make_step(m, batches, args.lr) for k, m in ddps.items()}
    first_loss = {}
    for k, step in steps.items():  # plans built (and autotuned), buckets rebuilt after the first step
        first_loss[k] = step()
        for _ in range(args.warmup - 1):
            step()
    torch.cuda.synchronize()
    dist.barrier(device_ids=[local])
    report("setup", setup_s=round(time.perf_counter() - began, 1), candidates=list(steps),
           first_loss={k: float(v.detach()) for k, v in first_loss.items()}, errors=result["errors"],
           converted=len(modules["ours"].cudnn_graphs_report.replaced))

    ms: dict[str, list[float]] = {k: [] for k in steps}
    block_losses: dict[str, list[float]] = {k: [] for k in steps}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = {step: k for k, step in steps.items()}

    def block(step) -> float:
        """One block of --steps steps after a barrier, rank 0's CUDA events around it; the round is reported
        after its last candidate."""
        dist.barrier(device_ids=[local])
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            loss = step()
        end.record()
        end.synchronize()
        k = names[step]
        ms[k].append(start.elapsed_time(end) / args.steps)
        block_losses[k].append(float(loss.detach()))
        if all(len(v) == len(ms[k]) for v in ms.values()):
            report("round", round=len(ms[k]) - 1, round_ms={c: v[-1] for c, v in ms.items()}, ms_blocks=ms,
                   losses=block_losses)
        return ms[k][-1]

    # the candidates alternate round by round, each round starting one later (every rank in the same order)
    harness.interleaved(steps, {"ms": block}, rounds=args.rounds)

    # the last losses averaged over the ranks too: each rank's shard differs
    last = torch.tensor([block_losses[k][-1] for k in steps], device=device)
    dist.all_reduce(last)
    report("done", **summary(ms, block_losses), steps_per_candidate=args.warmup + args.rounds * args.steps,
           loss_after_mean_over_ranks={k: float(v) / world for k, v in zip(steps, last.tolist())},
           seconds=round(time.perf_counter() - began, 1))
    dist.barrier(device_ids=[local])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
