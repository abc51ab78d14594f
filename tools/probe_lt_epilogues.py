"""Probe (GPU host): what each cuBLASLt epilogue costs on the MLP's GEMMs, beside the plain GEMM.

    python3 tools/probe_lt_epilogues.py [--tokens 8192 --sizes 4096 16384 4096]

Device ms per GEMM (20 back to back behind a sleep, median of 5) for the forward's GELU_AUX_BIAS and BIAS,
the backward's wgrad with and without BGRADB and dgrad with and without DGELU_BGRAD, and torch.matmul of
the same shapes; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fallback_calls import _device_ms as device_ms  # noqa: E402


def main() -> None:
    import torch

    from cudnn_graphs.torch._mlp import _run

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sizes", type=int, nargs=3, default=[4096, 16384, 4096])
    args = p.parse_args()
    t, (c, h, o) = args.tokens, args.sizes
    bf = torch.bfloat16
    x = torch.randn(t, c, device="cuda", dtype=bf)
    w1 = torch.randn(h, c, device="cuda", dtype=bf) * c ** -0.5
    w2 = torch.randn(o, h, device="cuda", dtype=bf) * h ** -0.5
    b1, b2 = torch.randn(h, device="cuda", dtype=bf), torch.randn(o, device="cuda", dtype=bf)
    hid, pre = torch.empty(t, h, device="cuda", dtype=bf), torch.empty(t, h, device="cuda", dtype=bf)
    y, dy = torch.empty(t, o, device="cuda", dtype=bf), torch.randn(t, o, device="cuda", dtype=bf)
    dw2, db2 = torch.empty_like(w2), torch.empty_like(b2)
    dpre, db1 = torch.empty(t, h, device="cuda", dtype=bf), torch.empty_like(b1)
    dev = 0
    cases = {
        "fwd1 GELU_AUX_BIAS": lambda: _run(dev, "bfloat16", hid, x, w1, b_col=True, epilogue="GELU_AUX_BIAS",
                                           bias=b1, aux=pre, aux_ld=h),
        "fwd1 DEFAULT": lambda: _run(dev, "bfloat16", hid, x, w1, b_col=True),
        "fwd1 torch": lambda: torch.matmul(x, w1.t()),
        "fwd2 BIAS": lambda: _run(dev, "bfloat16", y, hid, w2, b_col=True, epilogue="BIAS", bias=b2),
        "wgrad2 BGRADB": lambda: _run(dev, "bfloat16", dw2, dy, hid, a_col=True, epilogue="BGRADB", bias=db2),
        "wgrad2 DEFAULT": lambda: _run(dev, "bfloat16", dw2, dy, hid, a_col=True),
        "wgrad2 torch": lambda: torch.matmul(dy.t(), hid),
        "dgrad2 DGELU_BGRAD": lambda: _run(dev, "bfloat16", dpre, dy, w2, epilogue="DGELU_BGRAD", bias=db1,
                                           aux=pre, aux_ld=h),
        "dgrad2 DEFAULT": lambda: _run(dev, "bfloat16", dpre, dy, w2),
        "dgrad2 torch": lambda: torch.matmul(dy, w2),
        "wgrad1 DEFAULT": lambda: _run(dev, "bfloat16", torch.empty_like(w1), dpre, x, a_col=True),
        "wgrad1 torch": lambda: torch.matmul(dpre.t(), x),
        "dgrad1 DEFAULT": lambda: _run(dev, "bfloat16", torch.empty_like(x), dpre, w1),
        "dgrad1 torch": lambda: torch.matmul(dpre, w1),
    }
    for name, fn in cases.items():
        print(json.dumps({"case": name, "device_ms": device_ms(fn, calls=10)}), flush=True)
    # the dgrad epilogues by the heuristic's rank: is a later algorithm faster than its first choice?
    from fallback_kernels import cublaslt

    for epilogue in ("DGELU_BGRAD", "DGELU"):
        g = cublaslt.Geometry(dev, "bfloat16", t, h, o, ("row", o), ("row", h), h, epilogue, h, False,
                              (256, 256, 256))
        for index in range(8):
            try:
                plan = cublaslt.LtGemm(g, algo_index=index)
            except cublaslt.CublasLtError as exc:
                print(json.dumps({"case": f"dgrad2 {epilogue} #{index}", "error": str(exc)[:120]}))
                break
            ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream

            def run(plan=plan, ws=ws, stream=stream):
                plan.run(a=dy.data_ptr(), b=w2.data_ptr(), d=dpre.data_ptr(), stream=stream,
                         bias=db1.data_ptr() if "BGRAD" in epilogue else 0, aux=pre.data_ptr(),
                         workspace=ws.data_ptr())
            print(json.dumps({"case": f"dgrad2 {epilogue} #{index}", "workspace": plan.workspace,
                              "device_ms": device_ms(run, calls=10)}), flush=True)


if __name__ == "__main__":
    main()
