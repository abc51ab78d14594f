"""LayerNorm and torchvision's ConvNeXt block: this library's paths against torch's.

Per row geometry (convnext_tiny's four stages at batch 32, a ViT-B/16's tokens at batch 32, wider rows) and
dtype: device us of torch's F.layer_norm and of our kernel (`cudnn_graphs.torch._layernorm.layer_norm_rows`),
the bandwidth ours reaches (read once, written once), and the error of each against float64. In AMP training
(convnext_tiny's stages at batch 64): forward and backward device us of torch's float32 LayerNorm with
autocast's casts, and of ours (float16 in and out). Per ConvNeXt
stage (batch 32, float16, channels-last): device us of torch's CNBlock and of the converted one. Device us
are CUDA-event times of 20 back-to-back calls queued behind a sleep (no host gaps), median of 3 rounds.

    python -m tools.probe_layernorm --out probe_layernorm.json
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from benchmarks import harness

ROWS = [(100352, 96), (25088, 192), (6272, 384), (1568, 768), (6304, 768), (8192, 1024), (4096, 2048), (4096, 100)]
STAGES = [(96, 56), (192, 28), (384, 14), (768, 7)]


def device_us(fn) -> float:
    return round(harness.device_ms(fn, calls=20, rounds=3, sleep_cycles=int(2e7), warmup=2) * 1000, 2)


def row_case(rows: int, c: int, dtype: torch.dtype) -> dict:
    from cudnn_graphs.torch._layernorm import layer_norm_rows

    x = (torch.randn(rows, c, device="cuda") * 2 + 1).to(dtype)
    w = (torch.rand(c, device="cuda") + 0.5).to(dtype)
    b = torch.randn(c, device="cuda").to(dtype)
    want = F.layer_norm(x.double(), (c,), w.double(), b.double(), 1e-6)
    ours = layer_norm_rows(x, w, b, 1e-6)
    theirs = F.layer_norm(x, (c,), w, b, 1e-6)
    out = {"rows": rows, "c": c, "dtype": str(dtype).replace("torch.", "")}
    if ours is None:  # rows wider than a warp holds: the modules run torch's LayerNorm there
        return {**out, "ours": "declined", "torch_us": device_us(lambda: F.layer_norm(x, (c,), w, b, 1e-6))}
    out |= {"err_torch": harness.rel_err(theirs, want), "err_ours": harness.rel_err(ours, want),
            "torch_us": device_us(lambda: F.layer_norm(x, (c,), w, b, 1e-6)),
            "ours_us": device_us(lambda: layer_norm_rows(x, w, b, 1e-6))}
    out["speedup"] = round(out["torch_us"] / out["ours_us"], 2)
    out["ours_tb_s"] = round(2 * x.numel() * x.element_size() / out["ours_us"] / 1e6, 2)
    return out


def train_case(rows: int, c: int) -> dict:
    """One AMP training LayerNorm, forward and backward: torch's (float32, with autocast's casts of its input
    and of its output for the next Linear) against ours (float16 in and out, float32 parameters)."""
    from cudnn_graphs.torch._layernorm import layer_norm_autograd

    x = (torch.randn(rows, c, device="cuda") * 2 + 1).half().requires_grad_()
    w = (torch.rand(c, device="cuda") + 0.5).requires_grad_()
    b = torch.randn(c, device="cuda").requires_grad_()
    dy = torch.randn(rows, c, device="cuda").half()

    def theirs():
        with torch.autocast("cuda", dtype=torch.float16):
            y = F.layer_norm(x, (c,), w, b, 1e-6).half()
        torch.autograd.backward(y, dy)

    def ours():
        torch.autograd.backward(layer_norm_autograd(x, w, b, 1e-6), dy)

    with torch.enable_grad():
        out = {"rows": rows, "c": c, "torch_us": device_us(theirs), "ours_us": device_us(ours)}
    out["speedup"] = round(out["torch_us"] / out["ours_us"], 2)
    return out


def block_case(dim: int, hw: int) -> dict:
    import torchvision

    import cudnn_graphs.torch as cgt

    model = torchvision.models.convnext_tiny()
    stage = {96: 1, 192: 3, 384: 5, 768: 7}[dim]
    block = model.features[stage][0].eval()
    for p in block.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    block = block.cuda().half().to(memory_format=torch.channels_last)
    ours = cgt.convert(torch.nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
    x = torch.randn(32, dim, hw, hw, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        out = {"dim": dim, "hw": hw, "err": harness.rel_err(ours(x), block(x)),
               "torch_us": device_us(lambda: block(x)), "ours_us": device_us(lambda: ours(x))}
    out["speedup"] = round(out["torch_us"] / out["ours_us"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="probe_layernorm.json")
    args = parser.parse_args()
    result = {"meta": harness.metadata(), "rows": [], "train": [], "blocks": []}
    with torch.no_grad():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for rows, c in ROWS:
                result["rows"].append(row_case(rows, c, dtype))
                print(result["rows"][-1], flush=True)
    for dim, hw in STAGES:  # training: batch 64
        result["train"].append(train_case(64 * hw * hw, dim))
        print(result["train"][-1], flush=True)
    for dim, hw in STAGES:
        result["blocks"].append(block_case(dim, hw))
        print(result["blocks"][-1], flush=True)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
