"""Probe (GPU host): which teardown makes the host wait for the GPU.

  python3 tools/probe_sync_sources.py --out sync.json

Each case builds a session (or a graph), runs it, queues ~1 s of GPU sleep, then lets the object go
(del + gc.collect) and reports the host ms that took and whether the GPU was still busy afterwards.
A teardown that synchronises shows ~1000 ms and busy=False: in a training loop that is a stall at
whatever moment the garbage collector picks. Cases run twice: with the process keeping its plans
(`resident.py`, the library's behaviour) and with `resident.forget()` after each session, so the
session's plans are destroyed with it (what the library did before).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed_drop(holder: list, name: str) -> dict:
    """Let go of the only reference to holder[0] with the GPU busy; holder must hold the last one."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    t = time.perf_counter()
    holder.clear()
    gc.collect()
    ms = (time.perf_counter() - t) * 1e3
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    row = {"case": name, "drop_ms": round(ms, 2), "gpu_still_busy": busy}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sync.json")
    args = ap.parse_args()
    import torch

    import cudnn_graphs as cg
    from gpu_launch import driver
    from cudnn_graphs.plan import resident

    cl = torch.channels_last
    x = torch.randn(8, 32, 14, 14, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(32, 32, 3, 3, device="cuda", dtype=torch.half) * 0.1).contiguous(memory_format=cl)
    dy = torch.randn_like(x)
    rows = [_timed_drop([], "nothing (baseline: gc.collect alone)")]

    def drelu(s):
        return cg.conv_bwd_data(dy, w, pre_act=x, padding=1, activation_backward="relu", session=s)

    def fwd(s):
        return cg.conv_fwd(x, w, padding=1, session=s)

    for keep in (True, False):
        cache = tempfile.mkdtemp()
        for label, fn in [("dgrad+drelu", drelu), ("fwd plain", fwd)]:
            for source in ("built", "loaded"):
                resident.forget()  # the second session loads from disk
                gc.collect()
                holder = [cg.Session(cache=cache)]
                for _ in range(3):  # the third call replays a captured CUDA graph
                    fn(holder[0])
                if not keep:
                    resident.forget()  # the session's plans now die with it
                rows.append(_timed_drop(holder, f"{label} {source}, process keeps plans={keep}"))

    side = driver.new_stream()
    driver.begin_capture(side)
    with torch.cuda.stream(torch.cuda.ExternalStream(side)):
        x.add_(0)
    holder = [driver.GraphExec(driver.end_capture(side))]
    rows.append(_timed_drop(holder, "GraphExec of a torch kernel"))
    Path(args.out).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
