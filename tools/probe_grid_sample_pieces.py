"""Probe (GPU host): the pieces of a grid_sample forward call's host time, GPU held busy.

    python3 tools/probe_grid_sample_pieces.py --out pieces.json

f32 (8,64,128,128) and f16 (32,32,64,64), bilinear, zeros, random grids; host us per call
(probe_call_path.host_us: median of 7 rounds of 200 calls behind a queued sleep) of the whole call, of
each piece alone (memo key + lookup; allocating the output; the kernel's launch with the output made
once; the driver's launch alone) and of torch's F.grid_sample beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_call_path import host_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from fallback_kernels import grid_sample as gs

    rows = []
    for name, dtype, shape in (("f32 (8,64,128,128)", torch.float32, (8, 64, 128, 128)),
                               ("f16 (32,32,64,64)", torch.float16, (32, 32, 64, 64))):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        grid = (torch.rand(shape[0], *shape[2:], 2, device="cuda") * 2.2 - 1.1).to(dtype)
        gs.grid_sample(x, grid)
        options = ("forward", "bilinear", "zeros", False)
        key, _ = gs._memo_key((x, grid), options)
        prep = gs._memo.get(key)
        (role, allocate), = prep.outputs
        out = allocate()
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        prog = gs._program(prep.plan, prep.device)
        ptrs = (x.data_ptr(), grid.data_ptr(), out.data_ptr())
        step, = prog.steps
        cases = {
            "call": lambda: gs.grid_sample(x, grid),
            "torch F.grid_sample": lambda: F.grid_sample(x, grid, align_corners=False),
            "memo key + lookup": lambda: gs._memo.get(gs._memo_key((x, grid), options)[0]),
            "allocate the output": allocate,
            "_launch (allocate + run)": lambda: gs._launch(prep, (x.data_ptr(), grid.data_ptr())),
            "_run (output made once)": lambda: gs._run(prep.plan, prep.framework, prep.device, ptrs),
            "step (patch + launch)": lambda: step(ptrs, stream),
            "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        }
        row = {"shape": name, **{k: round(host_us(fn), 2) for k, fn in cases.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
