"""Probe (GPU host): what cuBLASLt's RELU_AUX_BIAS epilogue writes, and which sign its bit mask is.

    python -m tools.probe_relu_mask [--seeds 4] [--dtypes float16,bfloat16] [--out probe.json]

For each dtype and shape (m, k, n) and `--seeds` seeds, a [m, k] @ w.T [k, n] / sqrt(k) + bias / 10 through
`RELU_AUX_BIAS` (y and a bit mask: little-endian bits, rows of aux_ld = relu_mask_ld(n) bits, in a buffer
poisoned with 0x5A5A5A5A past m * aux_ld bits), and the same GEMM with `RELU_BIAS` (what ships), `BIAS` and
no epilogue. The row counts, summed over seeds, the elements where the mask's bits differ from each
candidate sign: y > 0, RELU_BIAS's y > 0, BIAS's output > 0, the f32 accumulator + bias unrounded,
round(acc) + bias in f32, round(round(acc) + bias), float64; and the elements where RELU_AUX_BIAS's y
differs from RELU_BIAS's and from relu(BIAS's output). Kept from the first version of this probe: y's
relative error against float64, NaNs left in y, and whether the poisoned words past m * aux_ld bits are
untouched.

Found (H100, 4 seeds a shape; docs/kernels.md, the `RELU_AUX_BIAS` bullet): the mask is the sign of the
pre-activation before a @ b is rounded, where y is relu of the rounded one. On m1000 k29 n531 the bits
disagreed with their own y > 0 on 42 of 2.1 M elements (fp16) and 400 (bf16), exactly those 42 / 400 with
sign(round(round(acc) + bias)), while they agreed with the unrounded f32 accumulator + bias and with float64
up to 19 / 203 elements (f32 accumulation itself); on aligned 4096x1024x4096 y and bits disagreed on 0
(fp16) and 1 (bf16) of 67 M. RELU_AUX_BIAS's y differed from RELU_BIAS's in 14 % of m1000 k29 n531's
elements (cuBLASLt picks different kernels for the two epilogues there). So a backward reading the mask
would take relu's step from the unrounded pre-activation where torch's threshold_backward reads the
rounded y: gemm_bias_act's relu keeps y as its aux (one RELU_BIAS GEMM, no mask).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import harness

SHAPES = ((37, 29, 53), (37, 32, 56), (64, 64, 128), (1000, 29, 531), (4096, 1024, 4096))  # (m, k, n)
POISON = 0x5A5A5A5A


def probe(dtype: str, m: int, k: int, n: int, *, seeds: int) -> dict:
    import numpy as np
    import torch

    from cudnn_graphs.torch._mlp import _run
    from fallback_kernels import cublaslt

    dt = getattr(torch, dtype)
    counts: dict[str, int] = {}
    y_err, tail_untouched, y_nan = 0.0, True, 0

    def add(key: str, value: int) -> None:
        counts[key] = counts.get(key, 0) + int(value)

    def gemm(epilogue: str, a, w, **kw):
        d = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
        _run(0, dtype, d, a, w, b_col=True, epilogue=epilogue, **kw)
        return d

    for seed in range(seeds):
        torch.manual_seed(seed)
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=dt) * 0.1
        ld = cublaslt.relu_mask_ld(n)
        used = m * ld // 32  # int32 words the mask may write
        mask = torch.full((used + 1024,), POISON, device="cuda", dtype=torch.int32)
        y = gemm("RELU_AUX_BIAS", a, w, bias=b, aux=mask, aux_ld=ld)
        y_relu_bias = gemm("RELU_BIAS", a, w, bias=b)
        pre = gemm("BIAS", a, w, bias=b)  # the pre-activation the epilogue rounds
        acc = gemm("DEFAULT", a, w)  # a @ b rounded to the io dtype
        torch.cuda.synchronize()

        words = mask[:used].view(m, ld // 32).cpu().numpy().astype(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(m, ld)[:, :n].astype(bool)
        exact = a.double() @ w.double().t() + b.double()
        candidates = {
            "y>0": y > 0,
            "relu_bias_y>0": y_relu_bias > 0,
            "bias_epilogue>0": pre > 0,
            "f32acc+bias>0 (unrounded)": (a.float() @ w.float().t() + b.float()) > 0,
            "round(acc)+bias>0 (f32 add)": (acc.float() + b.float()) > 0,
            "round(round(acc)+bias)>0": (acc.float() + b.float()).to(dt) > 0,
            "float64>0": exact > 0,
        }
        for key, sign in candidates.items():
            add(f"bits_vs_{key}", (bits != sign.cpu().numpy()).sum())
        add("y_vs_relu_bias_y", (y != y_relu_bias).sum())
        add("y_vs_relu(bias_epilogue)", (y != torch.relu(pre)).sum())
        add("elements", m * n)
        y_err = max(y_err, harness.rel_err(y, torch.relu(exact)))
        tail_untouched &= bool((mask[used:] == POISON).all())
        y_nan += int(torch.isnan(y).sum())
    return {"dtype": dtype, "shape": [m, k, n], "seeds": seeds, "mismatches": counts,
            "y_rel_err_vs_float64_max": y_err, "y_nan": y_nan, "tail_untouched": tail_untouched}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=4, help="seeds a shape (default 4)")
    p.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated (float32 works too)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for dtype in args.dtypes.split(","):
        for m, k, n in SHAPES:
            rows.append(probe(dtype, m, k, n, seeds=args.seeds))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        harness.write_json(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
