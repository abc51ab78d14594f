"""`cudnn-graphs warmup --devices all` on every GPU of the host against the same warm-up on one GPU.

    python3 tools/bench_warmup_devices.py --out warmup_devices.json [--preset resnet50] [--batch 32]

Each run is a fresh process with an empty cache (`--autotune`, the driver's JIT cache off so neither run
inherits the other's compiled kernels), timed from the command's start to its exit: what a job's
warm-up step costs. Runs alternate (one GPU, all GPUs) for --rounds rounds; the JSON holds every run,
the medians and their ratio. With the JIT cache off the one-GPU run of the resnet50 preset took 202 s on
an H200 (every runtime-compiled fused kernel compiled again): plan ~6 minutes of a two-GPU machine a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def run(devices: str | None, preset: str, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, "-m", "cudnn_graphs", "warmup", "--preset", preset, "--batch", str(batch),
               "--autotune", "--no-progress", "--json", "--cache", cache]
        if devices:
            cmd += ["--devices", devices]
        env = {**os.environ, "CUDA_CACHE_DISABLE": "1"}
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout)
    return {"devices": devices or "one", "seconds": round(seconds, 2), "counts": summary.get("counts"),
            "by_device": summary.get("by_device")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="warmup_devices.json")
    p.add_argument("--preset", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    runs = []
    for _ in range(args.rounds):
        for devices in (None, "all"):
            runs.append(run(devices, args.preset, args.batch))
            print(json.dumps(runs[-1]), flush=True)
    one = statistics.median(r["seconds"] for r in runs if r["devices"] == "one")
    many = statistics.median(r["seconds"] for r in runs if r["devices"] == "all")
    out = {"preset": args.preset, "batch": args.batch, "runs": runs, "one_gpu_s": one, "all_gpus_s": many,
           "speedup": round(one / many, 3)}
    print(json.dumps({k: out[k] for k in ("one_gpu_s", "all_gpus_s", "speedup")}))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
