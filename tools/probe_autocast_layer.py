"""Probe (GPU host): what one training conv layer costs the host under autocast, piece by piece, ours
beside torch's (32x128x28x28 fp16 input, fp32 channels_last 3x3 weight as AMP training has it).

    python3 tools/probe_autocast_layer.py [--out probe.json]

Host us per call with the GPU held busy (tools/probe_call_path.host_us); the CUDA kernels one
fwd+bwd launches, ours and torch's; the layout of the weight gradient each leaves in .grad.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_call_path import host_us  # noqa: E402


def _kernels(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    import cudnn_graphs.torch as cgt

    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    xr = torch.randn(32, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl).requires_grad_(True)
    dy = torch.randn_like(xr)
    ours = cgt.Conv2d(128, 128, 3, padding=1, bias=False).cuda().to(memory_format=cl)
    theirs = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).cuda().to(memory_format=cl)
    ours16 = cgt.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    theirs16 = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)

    def amp(fn):
        def run():
            with torch.autocast("cuda", dtype=torch.float16):
                return fn()
        return run

    def fwd_bwd(module, *, autocast):
        def run():
            if autocast:
                with torch.autocast("cuda", dtype=torch.float16):
                    y = module(xr)
            else:
                y = module(xr)
            torch.autograd.backward(y, dy)
        return run

    def bwd_only(module):  # one graph, its backward repeated: the backward's host cost alone
        y = module(xr)

        def run():
            torch.autograd.backward(y, dy, retain_graph=True)
        return run

    w32 = ours.weight
    ws = [ours16.weight.detach().clone().requires_grad_(True) for _ in range(4)]
    turn = [0]

    def rotating(conv):  # a new weight pointer each call, as autocast's fresh cast gives
        def run():
            turn[0] = (turn[0] + 1) % len(ws)
            return conv(xr, ws[turn[0]], padding=1)
        return run

    from cudnn_graphs.torch import _conv

    cases = {
        "fwd, ours functional, one fp16 weight": lambda: cgt.conv2d(xr, ws[0], padding=1),
        "fwd, torch functional, one fp16 weight": lambda: torch.nn.functional.conv2d(xr, ws[0], padding=1),
        "fwd, ours functional, 4 fp16 weights rotating": rotating(cgt.conv2d),
        "fwd, torch functional, 4 fp16 weights rotating": rotating(torch.nn.functional.conv2d),
        "autocast fwd, ours (fp16 weight: no cast)": amp(lambda: ours16(xr)),
        "autocast: _autocast((xr, w32)) alone": amp(lambda: _conv._autocast((xr, w32, None, None), torch.float16)),
        "autocast enter+exit": amp(lambda: None),
        "w32.to(float16) (a parameter)": lambda: w32.to(torch.float16),
        "autocast fwd, ours": amp(lambda: ours(xr)),
        "autocast fwd, torch": amp(lambda: theirs(xr)),
        "fwd, ours (fp16 weight)": lambda: ours16(xr),
        "fwd, torch (fp16 weight)": lambda: theirs16(xr),
        "autocast fwd+bwd, ours": fwd_bwd(ours, autocast=True),
        "autocast fwd+bwd, torch": fwd_bwd(theirs, autocast=True),
        "fwd+bwd, ours (fp16 weight)": fwd_bwd(ours16, autocast=False),
        "fwd+bwd, torch (fp16 weight)": fwd_bwd(theirs16, autocast=False),
        "bwd only, ours (fp16 weight)": bwd_only(ours16),
        "bwd only, torch (fp16 weight)": bwd_only(theirs16),
    }
    out: dict = {"host_us": {}}
    for _ in range(2):  # two rounds: the second one's figures are kept
        for name, fn in cases.items():
            fn()
            fn()
            out["host_us"][name] = round(host_us(fn, calls=50), 2)
    for name, value in out["host_us"].items():
        print(f"{name:45s} {value:8.2f} us", flush=True)
    for m in (ours, theirs, ours16, theirs16):
        m.weight.grad = None
    out["kernels"] = {"ours": _kernels(fwd_bwd(ours, autocast=True)),
                      "torch": _kernels(fwd_bwd(theirs, autocast=True))}
    for m in (ours, theirs):
        m.weight.grad = None
        fwd_bwd(m, autocast=True)()
    out["grad_strides"] = {"ours": list(ours.weight.grad.stride()), "torch": list(theirs.weight.grad.stride()),
                           "param": list(ours.weight.stride())}
    print(json.dumps({k: out[k] for k in ("kernels", "grad_strides")}, indent=1), flush=True)
    out["device"] = torch.cuda.get_device_name()
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
