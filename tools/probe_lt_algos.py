"""Probe (GPU host): gemm_bias_act's forward device time with each of cuBLASLt's heuristic algorithms.

    python -m tools.probe_lt_algos [--algos 12] [--rounds 2] [--shapes 0,2] [--out probe.json]

Is there a faster cuBLASLt algorithm to autotune to? For each shape of `benchmarks/gemm_act.py`'s SHAPES,
`fallback_kernels.gemm_act.gemm_bias_act` (bias + activation, the forward that ships) is planned with the
heuristic's algorithm #i for i < `--algos` (#0: what ships; the plans and the call memo are cleared between
algorithms) and timed beside torch's act(F.linear(x, w, bias)). Device time: `harness.device_samples`,
blocks of `--calls` back-to-back calls queued behind a GPU sleep (launch gaps do not count), the median of
all blocks over `--rounds` rounds (each round times torch, then every algorithm). Each algorithm's output is
checked against torch's (largest absolute difference under 0.1, and the relative error); where the heuristic
offers fewer algorithms the row says how many.

Found (H100, one run, the first 12 algorithms; docs/kernels.md, "Can another cuBLASLt algorithm give the
gelu shapes 5 %?"): bf16 gelu 8192x4096x4096 #0 (what ships) 0.391 ms, the others 0.402-0.464, torch 0.3985
(1.019x); bf16 gelu 16384x768x3072 #0 0.182, the others 0.185-0.280, torch 0.189 (1.036x); fp16 relu
4096x1024x4096 #0 0.0558, #4 0.0533, torch 0.0799 (1.43x, 1.50x with #4). No algorithm gives the gelu
shapes 5 %: both sides do a GEMM writing the pre-activation, then one pass reading it and writing y.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.gemm_act import SHAPES

SLEEP_CYCLES = int(2e7)  # ~10 ms at ~1.9 GHz: longer than the host needs to queue one block's calls


@contextlib.contextmanager
def _algorithm(index: int):
    """cuBLASLt plans built with the heuristic's algorithm #`index` inside; plans and memo cleared on entry
    and exit. Yields the plans built, so that a refused geometry (fewer algorithms offered: the forward
    then falls back to cuBLAS) can be told."""
    from fallback_kernels import cublaslt, gemm_act

    base = cublaslt.LtGemm

    class Indexed(base):
        def __init__(self, geometry, *, algo_index=0):
            super().__init__(geometry, algo_index=index)

    def clear():
        cublaslt._PLANS.clear()
        gemm_act._memo.programs = {}

    clear()
    cublaslt.LtGemm = Indexed
    try:
        yield cublaslt._PLANS
    finally:
        cublaslt.LtGemm = base
        clear()


def probe_shape(name, dtype, act, m, k, n, *, algos: int, rounds: int, calls: int, blocks: int) -> dict:
    import torch
    import torch.nn.functional as F

    from fallback_kernels import cublaslt
    from fallback_kernels.gemm_act import gemm_bias_act

    tdt = getattr(torch, dtype)
    act_fn = {"gelu": F.gelu, "relu": F.relu}[act]
    x = torch.randn(m, k, device="cuda", dtype=tdt)
    w = torch.randn(n, k, device="cuda", dtype=tdt) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=tdt)
    ref = act_fn(F.linear(x, w, b))

    def torch_fwd():
        return act_fn(F.linear(x, w, b))

    def ours():
        return gemm_bias_act(x, w.t(), b, activation=act)

    def timed(fn) -> list[float]:
        samples, _ = harness.device_samples(fn, calls=calls, rounds=blocks, sleep_cycles=SLEEP_CYCLES, warmup=3)
        return samples

    row = {"shape": name, "dtype": dtype, "activation": act, "M": m, "K": k, "N": n}
    torch_samples, samples, checks, offered = [], {}, {}, algos
    for _ in range(rounds):
        torch_samples += timed(torch_fwd)
        for i in range(offered):
            with _algorithm(i) as plans:
                y, _ = ours()
                torch.cuda.synchronize()
                refused = [str(p) for p in plans.values() if isinstance(p, cublaslt.CublasLtError)]
                if refused or not plans:
                    offered = i
                    row["refused"] = refused[:1] or ["no cuBLASLt plan built"]
                    break
                checks[str(i)] = {"max_abs_diff": float((y.float() - ref.float()).abs().max()),
                                  "rel_err_vs_torch": harness.rel_err(y, ref)}
                samples.setdefault(str(i), []).extend(timed(ours))
    row["algorithms_offered"] = offered if offered < algos else f">= {algos}"
    row["torch_ms"] = harness.median(torch_samples)
    row["algos_ms"] = {i: harness.median(v) for i, v in samples.items()}
    row["ok"] = {i: c["max_abs_diff"] < 0.1 for i, c in checks.items()}
    row["checks"] = checks
    if row["algos_ms"]:
        best = min(row["algos_ms"], key=row["algos_ms"].get)
        row["best"] = best
        row["torch_over_algo0"] = harness.ratio(row["torch_ms"], row["algos_ms"].get("0"))
        row["torch_over_best"] = harness.ratio(row["torch_ms"], row["algos_ms"][best])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", type=int, default=12, help="the heuristic's first N algorithms (default 12)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over torch and every algorithm (default 2)")
    p.add_argument("--blocks", type=int, default=7, help="timed blocks per candidate and round (default 7)")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per block (default 10)")
    p.add_argument("--shapes", default="all", help="comma-separated indices into benchmarks.gemm_act.SHAPES")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    picked = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = []
    for name, dtype, act, m, k, n, *_ in picked:
        torch.manual_seed(0)
        rows.append(probe_shape(name, dtype, act, m, k, n, algos=args.algos, rounds=args.rounds, calls=args.calls,
                                blocks=args.blocks))
        r = rows[-1]
        print(f"{name}: torch {r['torch_ms']:.4f} ms, by algorithm "
              + ", ".join(f"#{i} {v:.4f}" + ("" if r["ok"][i] else " (WRONG)") for i, v in r["algos_ms"].items())
              + f"; torch/#0 {r.get('torch_over_algo0', float('nan')):.3f}, best #{r.get('best')} "
              f"torch/best {r.get('torch_over_best', float('nan')):.3f}", flush=True)
        if args.out:
            harness.write_json(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
