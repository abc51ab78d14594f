"""Probe (GPU host): the channels-last bias gradient kernel against torch's reduction, device time.

    python3 tools/probe_bias_grad.py --out probe_bias_grad.json [--batch 64]

A channels-last wgrad's bias gradient (db[k] = sum of dy over N, H, W) is our kernel where cuDNN has no
fused reduction (convnext's depthwise convs). Per shape: our kernel as plans run it (rows cut into
chunks, two launches), the same kernel forced to one chunk (the single-pass kernel it replaced: one
block per 32 channels), and torch's `dy.sum((0, 2, 3))` on the same channels-last tensor, each in
device us per call (median of blocks of back-to-back calls timed with CUDA events behind a GPU sleep)
and its relative error against a float64 sum.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import probe_depthwise  # noqa: E402
from probe_depthwise import _sleep_cycles  # noqa: E402

SHAPES = ((96, 56), (192, 28), (384, 14), (768, 7), (256, 56), (2048, 7))  # (C, H): convnext's, then ResNet's


def _device_us(torch, fn, *, blocks: int = 15, calls: int = 20, cycles: int) -> float:
    """Median device us per call of fn over blocks of back-to-back calls queued behind a GPU sleep."""
    return probe_depthwise._device_us(torch, fn, blocks=blocks, calls=calls, cycles=cycles)["us"]


def _ours(torch, epilogue, spec, dy, db):
    part = epilogue.bias_grad(spec, torch.cuda.current_device())
    workspace = torch.empty(max(part.workspace_size, 1), dtype=torch.uint8, device="cuda")
    run = part.runner({"dy": 0, "db": 1}, {}, workspace.data_ptr(), torch.cuda.current_stream().cuda_stream, None)
    ptrs = (dy.data_ptr(), db.data_ptr())
    return part, lambda: run(ptrs), workspace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()

    import torch

    import cudnn_graphs as cg
    from fallback_kernels import epilogue

    dtype = getattr(torch, args.dtype)
    cycles = _sleep_cycles(torch, 20.0)
    rows_out = []
    for c, h in SHAPES:
        x = (args.batch, c, h, h)
        spec = cg.ConvBwdFilterSpec(x, x, (c, 1, 7, 7), padding=3, groups=c, dtype=args.dtype,
                                    layout="channels_last", bias_grad=True)
        dy = torch.randn(x, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        exact = dy.double().sum((0, 2, 3))
        row = {"shape": list(x), "dtype": args.dtype, "chunks": epilogue.bias_chunks(args.batch * h * h, c)}
        for name, min_rows in (("ours", epilogue.CHUNK_MIN_ROWS), ("one_chunk", 1 << 62)):
            saved, epilogue.CHUNK_MIN_ROWS = epilogue.CHUNK_MIN_ROWS, min_rows
            try:
                db = torch.full((c,), float("nan"), device="cuda", dtype=dtype)
                part, fn, _ws = _ours(torch, epilogue, spec, dy, db)
                fn()
                torch.cuda.synchronize()
                row[f"{name}_rel_err"] = float((db.double() - exact).norm() / exact.norm())
                row[f"{name}_us"] = _device_us(torch, fn, cycles=cycles)
            finally:
                epilogue.CHUNK_MIN_ROWS = saved
        ref = lambda: dy.sum((0, 2, 3))  # noqa: E731
        row["torch_rel_err"] = float((ref().double() - exact).norm() / exact.norm())
        row["torch_us"] = _device_us(torch, ref, cycles=cycles)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
