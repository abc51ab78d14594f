"""Probe (GPU host): grid_sample forward device time, our kernel's lanes per point against torch's kernel.

    python -m tools.probe_grid_sample_forward --out probe_grid_sample_forward.json

Channels-first, the forward stages input planes in shared memory (gs_forward_plane; "gather" is the kernel
that reads taps from global memory, TUNING fwd_plane*). The gather kernel gives each output point L lanes; a lane computes the point's taps once and loops over channel
groups of 4 (ATen's kernel: one thread per point looping over every channel). Per shape, grid kind
(random over [-1.1, 1.1]: scattered reads; affine: a smooth rotation and scaling) and setting of
TUNING's forward knobs (SETTINGS; "one_per_group" is L = channel groups, the kernel before lanes looped), device us per call: the median of blocks of back-to-back calls
timed with CUDA events behind a GPU sleep, beside torch's F.grid_sample, and the largest difference from
torch's output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks import harness

SHAPES = (  # name, dtype, input shape, output spatial, layout, mode
    ("f32 (8,64,128,128)", "float32", (8, 64, 128, 128), (128, 128), "first", "bilinear"),
    ("f32 (8,64,128,128) NHWC", "float32", (8, 64, 128, 128), (128, 128), "last", "bilinear"),
    ("f16 (32,32,64,64)", "float16", (32, 32, 64, 64), (64, 64), "first", "bilinear"),
    ("f16 (32,32,64,64) NHWC", "float16", (32, 32, 64, 64), (64, 64), "last", "bilinear"),
    ("f32 3-D (2,16,32,32,32)", "float32", (2, 16, 32, 32, 32), (32, 32, 32), "first", "bilinear"),
    ("f32 bicubic (4,32,64,64)", "float32", (4, 32, 64, 64), (64, 64), "first", "bicubic"),
    ("f16 nearest (32,32,64,64)", "float16", (32, 32, 64, 64), (64, 64), "first", "nearest"),
    ("f32 (2,512,16,16) -> 8x8", "float32", (2, 512, 16, 16), (8, 8), "first", "bilinear"),
    ("bf16 (32,32,64,64)", "bfloat16", (32, 32, 64, 64), (64, 64), "first", "bilinear"),
    ("f16 3-D (4,16,32,32,32)", "float16", (4, 16, 32, 32, 32), (32, 32, 32), "first", "bilinear"),
    ("f32 3-D nearest (2,16,32,32,32)", "float32", (2, 16, 32, 32, 32), (32, 32, 32), "first", "nearest"),
    ("f32 3-D (4,32,32,64,64)", "float32", (4, 32, 32, 64, 64), (32, 64, 64), "first", "bilinear"),
    ("f32 bicubic (4,32,64,64) NHWC", "float32", (4, 32, 64, 64), (64, 64), "last", "bicubic"),
    ("f32 (8,3,256,256) -> 224x224", "float32", (8, 3, 256, 256), (224, 224), "first", "bilinear"),
)
SETTINGS = {  # TUNING overrides (see grid_sample.TUNING)
    "default": {},
    "vec_L1": {"fwd_threads": 1, "fwd_groups_per_lane": 1 << 20},
    "vec_L2": {"fwd_threads": 1, "fwd_groups_per_lane": 1 << 20, "fwd_lanes_log2": (1, 5)},
    "one_per_group": {"fwd_threads": 1 << 50},  # L = channel groups: the kernel before lanes looped
    # channels-first: the gather kernel (taps from global memory) against planes in shared memory
    "gather": {"fwd_plane": False},
    "plane_only": {"options": ("-DGS_PLANE_SPREAD=0",)},  # every warp counts as scattered: planes always
    **{f"plane_{kb}k": {"fwd_plane_bytes": kb * 1024} for kb in (16, 96)},
    **{f"fill_{n}": {"fwd_plane_fill": n} for n in (1, 2, 8, 16)},
    **{f"threads_{n}": {"fwd_plane_threads": n} for n in (256, 1024)},
    **{f"points_{n}": {"fwd_plane_points": n} for n in (1, 2, 8)},
    # channels-first with many points: gs_forward_cf (ATen's loop order) against gs_forward's lanes; channels an
    # iteration issues on smooth warps (u1: always one; spread0: every warp counts as scattered)
    "no_cf": {"fwd_cf": False},
    **{f"cf_u{n}": {"fwd_cf_unroll": n} for n in (1, 2, 8)},
    "cf_spread0": {"options": ("-DGS_CF_SPREAD=0",)},
    "cf_box_always": {"options": ("-DGS_CF_MIN_UNROLL_C=0",)},  # the box measured (and unrolled) at any C
    **{f"cf_bpsm{n}": {"fwd_cf_blocks_per_sm": n} for n in (1, 2, 3, 4, 6)},  # its grid capped: fewer warps an L1
    **{f"cf_split{n}": {"fwd_cf_split": n} for n in (2, 4)},  # n threads a point, a channel range each
    # registers as the compiler likes (1), or capped for n blocks of 256 per SM, every variant alike
    **{f"min_blocks_{n}": {"options": (f"-DGS_FWD_MIN_BLOCKS={n}",)} for n in (1, 2, 3, 4, 5)},
}


def _grid(torch, kind: str, n: int, out: tuple, dtype):
    nd = len(out)
    if kind == "random":
        return (torch.rand(n, *out, nd, device="cuda") * 2.2 - 1.1).to(dtype)
    angle = 0.3
    theta = torch.zeros(n, nd, nd + 1, device="cuda")
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = math.cos(angle), -math.sin(angle), math.sin(angle), math.cos(angle)
    if nd == 3:
        theta[:, 2, 2] = 1.0
    theta[:, :, :nd] *= 0.9
    return torch.nn.functional.affine_grid(theta, (n, 1, *out), align_corners=False).to(dtype)


def device_us(fn, *, cycles: int) -> float:
    """Median device us per call over 15 blocks of 20 back-to-back calls, each queued behind a ~20 ms sleep."""
    return round(harness.device_ms(fn, calls=20, rounds=15, sleep_cycles=cycles, warmup=3) * 1e3, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", default="default,vec_L1,vec_L2,one_per_group,min_blocks_1",
                    help=f"comma-separated, of: {', '.join(SETTINGS)}")
    ap.add_argument("--shapes", default="", help="only the shapes whose name contains this")
    args = ap.parse_args(argv)
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}

    import torch
    import torch.nn.functional as F

    from fallback_kernels import grid_sample as gs

    cycles = harness.sleep_cycles_for(20.0)
    rows, defaults = [], {k: v for k, v in gs.TUNING.items() if k.startswith("fwd_") or k == "options"}
    for name, dt, shape, out, layout, mode in (s for s in SHAPES if args.shapes in s[0]):
        dtype = getattr(torch, dt)
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if layout == "last":
            x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
        for kind in ("random", "affine"):
            grid = _grid(torch, kind, shape[0], out, dtype)
            row = {"shape": name, "grid": kind, "mode": mode}
            expected = F.grid_sample(x, grid, mode=mode, align_corners=False)
            row["torch_us"] = device_us(lambda: F.grid_sample(x, grid, mode=mode, align_corners=False),
                                         cycles=cycles)
            for setting, overrides in settings.items():
                gs.TUNING.update(overrides)
                try:
                    geo = gs.geometry(shape, grid.shape, dt, dt, mode=mode)
                    row[f"{setting}_lanes_log2"] = gs._forward_lanes_log2(geo, channels_last=layout == "last")
                    y = gs.grid_sample(x, grid, mode=mode)
                    torch.cuda.synchronize()
                    row[f"{setting}_max_diff"] = float((y.double() - expected.double()).abs().max())
                    row[f"{setting}_us"] = device_us(lambda: gs.grid_sample(x, grid, mode=mode), cycles=cycles)
                finally:
                    gs.TUNING.update(defaults)
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
