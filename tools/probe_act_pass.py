"""Probe (GPU host): gemm_bias_act's forward pass over a 16-bit pre-activation, row kernel against flat variants.

    python3 tools/probe_act_pass.py --out act_pass.json

Where the GEMM already wrote the rounded pre-activation (exact gelu and the other activations cuBLASLt has no
epilogue for), the pass is y = act(pre), elementwise. Device us per pass (bench_fallback_calls' device time:
CUDA events around 20 back-to-back launches, median of 5 rounds) of `act_fwd_rows` as gemm_act launches it, of `act_fwd_flat<.., THREADS, ITEMS>`
for several block sizes and vectors per thread, and of torch's own activation on the same tensor; bf16, N(0, 1)
inputs, every variant's output checked bit-identical to the row kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fallback_calls import _device_ms  # noqa: E402  (tools/ is sys.path[0] when run as a script)

SHAPES = ((8192, 4096), (16384, 3072))
FLAT = ((128, 1), (128, 2), (128, 4), (256, 1), (256, 2), (256, 4), (512, 1), (512, 2))


def _device_us(fn) -> float:
    return round(_device_ms(fn) * 1e3, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--acts", nargs="*", default=["gelu", "silu"])
    args = ap.parse_args()

    import cupy
    import numpy as np
    import torch

    from fallback_kernels import compile as kc
    from fallback_kernels import gemm_act as ga

    t, v = ga.CTYPES["bfloat16"], ga.VEC["bfloat16"]
    torch_acts = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "tanh": torch.tanh}
    rows_out = []
    for act in args.acts:
        code = ga.ACT_CODES[act]
        rows_name = ga._fwd_name(t, t, v, code)
        flat_names = {f"flat {th}x{it}": f"act_fwd_flat<{t}, {v}, {code}, {th}, {it}>" for th, it in FLAT}
        module = kc.load_module("gemm_act.cu", (rows_name, *flat_names.values()), 0, ga.OPTIONS)
        cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream).use()
        for m, n in SHAPES:
            pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ref, out = torch.empty_like(pre), torch.empty_like(pre)
            rows_fn = module.get_function(rows_name)
            grid = (-(-n // (32 * v)), max(1, min(-(-m // (ga.WARPS * ga.UNROLL)), ga._sm_count(0) * 8)))
            rows_args = (pre.data_ptr(), 0, np.int64(0), 0, ref.data_ptr(), 0, np.int64(m), np.int32(n),
                         np.int32(0), np.float32(0.0))
            row = {"act": act, "shape": [m, n],
                   "rows": _device_us(lambda: rows_fn(grid, (ga.BLOCK,), rows_args)),
                   "torch": _device_us(lambda: torch_acts[act](pre))}
            vectors = m * n // v
            for label, name in flat_names.items():
                th, it = (int(x) for x in label.split()[1].split("x"))
                fn = module.get_function(name)
                blocks = (-(-vectors // (th * it)),)
                fargs = (pre.data_ptr(), out.data_ptr(), np.int64(vectors), np.float32(0.0))
                out.fill_(float("nan"))  # poisoned: a variant that skips elements shows
                fn(blocks, (th,), fargs)
                torch.cuda.synchronize()
                same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                row[label] = _device_us(lambda: fn(blocks, (th,), fargs)) if same else "differs from rows"
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
