"""Probe (GPU host): what cuBLASLt's RELU_AUX_BIAS writes: y against float64, the bit mask against y > 0 and
pre > 0 (little-endian bit order, rows of aux_ld bits), and whether it writes past m * aux_ld bits.

    python -m tools.probe_relu_mask      # one JSON line per dtype and shape

Three shapes agreeing do not prove the mask (docs/kernels.md, "The forward": unaligned test shapes found
disagreements), which is why gemm_bias_act's relu keeps y as its aux.
"""

from __future__ import annotations

import argparse
import json

SHAPES = ((37, 32, 56), (64, 64, 128), (37, 29, 53))  # (m, k, n)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import numpy as np
    import torch

    from cudnn_graphs.torch._mlp import _run
    from fallback_kernels import cublaslt

    torch.manual_seed(0)
    for name in ("float16", "bfloat16", "float32"):
        dt = getattr(torch, name)
        for m, k, n in SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=dt)
            w = torch.randn(n, k, device="cuda", dtype=dt)
            b = torch.randn(n, device="cuda", dtype=dt)
            y = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            ld = cublaslt.relu_mask_ld(n)
            big = torch.full((m * ld // 32 + 4096,), 0x5A5A5A5A, device="cuda", dtype=torch.int32)
            _run(0, name, y, a, w, b_col=True, epilogue="RELU_AUX_BIAS", bias=b, aux=big, aux_ld=ld)
            torch.cuda.synchronize()
            pre = a.double() @ w.double().t() + b.double()
            ref = torch.relu(pre)
            err = float((y.double() - ref).norm() / ref.norm())
            used = m * ld // 32
            tail_ok = bool((big[used:] == 0x5A5A5A5A).all())
            words = big[:used].view(m, ld // 32).cpu().numpy().astype(np.uint32)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(m, ld)[:, :n]
            ypos = (y > 0).cpu().numpy()
            ppos = (pre > 0).cpu().numpy()
            print(json.dumps({"dtype": name, "shape": [m, k, n], "y_err": err, "tail_untouched": tail_ok,
                              "bits_vs_y_mismatch": int((bits != ypos).sum()),
                              "bits_vs_pre_mismatch": int((bits != ppos).sum()),
                              "first_row_words": [hex(v) for v in words[0][:4]], "y_nan": int(torch.isnan(y).sum())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
