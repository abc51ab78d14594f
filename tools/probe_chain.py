"""A ResNet-50 bottleneck body in training, fused (`cudnn_graphs.torch._chain`) against torch's modules.

AMP fp16 (fp32 parameters), channels_last, batch 64, torch with `cudnn.benchmark=True`; per block
geometry, interleaved rounds, medians of: wall ms of one forward + backward from an idle GPU, host ms of
N iterations queued behind a GPU sleep (what the host spends), device ms of those N (back to back).

    python tools/probe_chain.py --out probe_chain.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

from cudnn_graphs.torch._chain import Chain, Stage

CL = torch.channels_last
# (in, mid, out, spatial, stride) of resnet50's bottleneck bodies (stride on the 3x3, torchvision v1.5)
BLOCKS = [(256, 64, 256, 56, 1), (512, 128, 512, 28, 1), (1024, 256, 1024, 14, 1), (2048, 512, 2048, 7, 1)]


class Body(nn.Module):
    def __init__(self, c, mid, k):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, k, 1, bias=False), nn.BatchNorm2d(k)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x, residual=None):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if residual is None else residual))

    def chain(self):
        stages = [Stage(self.conv1, self.bn1, True), Stage(self.conv2, self.bn2, True), Stage(self.conv3, self.bn3, True)]
        return Chain(stages, final_relu=True)


def step(fn, x, g):
    with torch.autocast("cuda", dtype=torch.float16):
        out = fn(x)
    out.backward(g)


def measure(fn, x, g, n=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(fn, x, g)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    torch.cuda._sleep(int(3e9))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(n):
        step(fn, x, g)
    host = time.perf_counter() - t0
    b.record()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"wall_ms": wall * 1e3, "host_ms": host * 1e3 / n, "device_ms": a.elapsed_time(b) / n, "busy": busy}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe_chain.json")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for c, mid, k, hw, _ in BLOCKS:
        torch.manual_seed(0)
        body = Body(c, mid, k).cuda().to(memory_format=CL)
        ours = copy.deepcopy(body)
        chain = ours.chain()
        x = torch.randn(64, c, hw, hw, device="cuda").to(memory_format=CL).requires_grad_(True)
        g = torch.randn(64, k, hw, hw, device="cuda", dtype=torch.float16).to(memory_format=CL)
        for _ in range(3):
            step(body, x, g)
            step(lambda t: chain(t, t), x, g)
        res = {"torch": [], "ours": []}
        for _ in range(args.rounds):
            res["torch"].append(measure(body, x, g))
            res["ours"].append(measure(lambda t: chain(t, t), x, g))
        row = {"block": [c, mid, k, hw], "fused": all(v is not None for v in chain._plans.values())}
        for side, ms in res.items():
            row[side] = {key: statistics.median(m[key] for m in ms) for key in ("wall_ms", "host_ms", "device_ms")}
            row[side]["busy"] = all(m["busy"] for m in ms)
        for key in ("wall_ms", "host_ms", "device_ms"):
            row[f"ratio_{key}"] = row["torch"][key] / row["ours"][key]
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": 64}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
