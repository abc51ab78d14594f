"""Probe (GPU host): how many roundings a bias epilogue makes into a 16-bit output.

    python3 tools/probe_bias_rounding.py [--out bias_rounding.json]

y = a @ b + bias three ways, against float64: cuBLASLt's BIAS epilogue (gemm_bias_act, identity), torch's
addmm (its own cuBLASLt bias epilogue), and one rounding of an f32 GEMM plus the bias added in f32. For each:
elements whose sign differs from float64's (where |pre| > 1e-4, beyond f32 accumulation noise) and elements
off by more than one ulp of the exact value. One rounding leaves neither; rounding a @ b before adding the
bias leaves both where the two nearly cancel, which is what breaks relu's derivative.
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    import torch

    from fallback_kernels.gemm_act import gemm_bias_act

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in ((37, 29, 53), (1024, 512, 1024), (4096, 1024, 4096)):
            a = torch.randn(m, k, device="cuda", dtype=torch.float64).to(dtype)
            b = (torch.randn(k, n, device="cuda", dtype=torch.float64) * k ** -0.5).to(dtype)
            bias = torch.randn(n, device="cuda", dtype=torch.float64).to(dtype)
            pre = a.double() @ b.double() + bias.double()
            exact = pre.to(dtype).double()  # the one correctly rounded value
            ulp = (exact.abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(1e-30)
            ours, _ = gemm_bias_act(a, b, bias, activation="identity")
            single = (a.float() @ b.float() + bias.float()).to(dtype)
            ways = {"cuBLASLt BIAS epilogue (ours, identity)": ours, "torch.addmm": torch.addmm(bias, a, b),
                    "f32 GEMM + bias in f32, one rounding": single}
            far = pre.abs() > 1e-4
            row = {"dtype": str(dtype).removeprefix("torch."), "m": m, "k": k, "n": n}
            for name, got in ways.items():
                g = got.double()
                row[name] = {"sign_flips": int(((g > 0) != (pre > 0))[far].sum()),
                             "beyond_1ulp": int(((g - exact).abs() > ulp).sum()), "elements": m * n}
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
