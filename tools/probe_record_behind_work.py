"""Probe (GPU host): does recording a conv plan's CUDA graph behind queued work hold the host?

    python3 tools/probe_record_behind_work.py [--out probe.json]

`plan/launcher.py` records behind queued work unless one such recording was seen to wait for it
(`gpu_launch.replay.watch`), since a training loop's stream is never idle. Here each case (ResNet-50
layers, forward / dgrad / wgrad, fp16 channels_last, batch 32) runs once (plans, first direct run), then,
behind a queued ~1 s sleep, its second call records: the host time of that call, whether the GPU was
still busy after it, and whether the watch turned recording behind work off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = {  # (C, K, H, kernel, stride)
    "conv1 7x7/2": (3, 64, 224, 7, 2), "3x3 64 56": (64, 64, 56, 3, 1), "1x1 64->256 56": (64, 256, 56, 1, 1),
    "3x3/2 128 56": (128, 128, 56, 3, 2), "1x1 1024->256 14": (1024, 256, 14, 1, 1), "3x3 512 7": (512, 512, 7, 3, 1),
}


def _cases(torch, cg):
    cl = torch.channels_last
    for name, (c, k, h, r, s) in LAYERS.items():
        pad = r // 2
        x = torch.randn(32, c, h, h, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
        w = (torch.randn(k, c, r, r, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
        b = torch.randn(k, device="cuda", dtype=torch.half)
        ho = (h + 2 * pad - r) // s + 1  # not planned here: each case's first call is its first sight
        dy = torch.randn(32, k, ho, ho, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
        yield f"fwd {name}", lambda x=x, w=w, b=b, s=s, pad=pad: cg.conv_fwd(x, w, b, stride=s, padding=pad,
                                                                              activation="relu")
        yield f"dgrad {name}", lambda dy=dy, w=w, x=x, s=s, pad=pad: cg.conv_bwd_data(dy, w, x_shape=x.shape,
                                                                                       stride=s, padding=pad)
        yield f"wgrad {name}", lambda x=x, dy=dy, w=w, s=s, pad=pad: cg.conv_bwd_filter(x, dy, w_shape=w.shape,
                                                                                         stride=s, padding=pad)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    import cudnn_graphs as cg
    from gpu_launch import replay

    rows = {}
    for name, fn in _cases(torch, cg):
        fn()
        torch.cuda.synchronize()
        captures = sum(c.launcher.captures for c in cg.default_session(0).calls.values())
        torch.cuda._sleep(int(2e9))  # about a second of GPU time
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        recorded = sum(c.launcher.captures for c in cg.default_session(0).calls.values()) - captures
        allowed = replay._behind_work
        rows[name] = {"host_ms": round(took * 1e3, 2), "gpu_busy_after": busy, "recorded": recorded,
                      "behind_work_still_allowed": allowed}
        print(f"{name:28s} {took * 1e3:9.2f} ms  GPU busy after: {busy}  graphs recorded: {recorded}"
              f"  behind work allowed: {allowed}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
