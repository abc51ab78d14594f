"""`cudnn-graphs warmup --devices all` on every GPU of the host against the same warm-up on one GPU.

    python -m benchmarks.warmup_devices --out warmup_devices.json [--preset resnet50] [--batch 32]

Each run is a fresh process with an empty plan cache (`--autotune`), timed from the command's start to
its exit: what a job's warm-up step costs. The driver's JIT cache is on, as on a user's node, in a folder
of its own that one untimed run fills first, so both kinds of run find it equally warm (with it off the
one-GPU run of the resnet50 preset took 202 s on an H200: every runtime-compiled kernel compiled again;
`--jit-cache off` measures that). Runs alternate (one GPU, all GPUs) for --rounds rounds; the JSON holds
every run, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from benchmarks import harness


def run(devices: str | None, preset: str, batch: int, jit: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        cmd = ["-m", "cudnn_graphs", "warmup", "--preset", preset, "--batch", str(batch),
               "--autotune", "--no-progress", "--json", "--cache", cache]
        if devices:
            cmd += ["--devices", devices]
        start = time.perf_counter()
        summary = harness.run_fresh(cmd, env=harness.fresh_env(**jit), timeout=600, json_lines=False)
        seconds = time.perf_counter() - start
    return {"devices": devices or "one", "seconds": round(seconds, 2), "counts": summary.get("counts"),
            "by_device": summary.get("by_device"), "device_timing": summary.get("device_timing")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="warmup_devices.json")
    p.add_argument("--preset", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--jit-cache", choices=("warm", "off"), default="warm")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as jit_dir:
        jit = {"CUDA_CACHE_DISABLE": "1"} if args.jit_cache == "off" else {"CUDA_CACHE_PATH": jit_dir}
        if args.jit_cache == "warm":
            print(json.dumps({"untimed_jit_fill": run(None, args.preset, args.batch, jit)["seconds"]}), flush=True)
        runs = _rounds(args, jit)
    report(runs, args)
    return 0


def _rounds(args, jit: dict) -> list[dict]:
    runs = []
    for _ in range(args.rounds):
        for devices in (None, "all"):
            runs.append(run(devices, args.preset, args.batch, jit))
            print(json.dumps(runs[-1]), flush=True)
    return runs


def report(runs: list[dict], args) -> None:
    one = harness.median(r["seconds"] for r in runs if r["devices"] == "one")
    many = harness.median(r["seconds"] for r in runs if r["devices"] == "all")
    out = {"preset": args.preset, "batch": args.batch, "jit_cache": args.jit_cache, "runs": runs, "one_gpu_s": one, "all_gpus_s": many,
           "speedup": round(one / many, 3)}
    print(json.dumps({k: out[k] for k in ("one_gpu_s", "all_gpus_s", "speedup")}))
    harness.write_json(args.out, out)


if __name__ == "__main__":
    raise SystemExit(main())
