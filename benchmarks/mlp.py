"""Benchmark (GPU host): cudnn_graphs.torch.MLP forward + backward beside torch autograd, in one run.

    python -m benchmarks.mlp --out mlp.json [--tokens 8192 --sizes 4096 16384 4096]

bf16, x [tokens, 4096] -> 16384 -> 4096 (a transformer block's feed-forward). For gelu_tanh (cuBLASLt's
GELU: the fused path, four GEMMs and no elementwise pass in the backward) against torch's
Linear-GELU(tanh)-Linear, and exact gelu (our linear_act chain) against nn.GELU():
* fwd_bwd latency_ms from an idle GPU (events around one forward + backward, median of 15);
* device_ms back to back (20 steps queued behind a sleep, per step, median of 5);
* host_us per forward + backward with the GPU held busy;
* the backward alone, and the four bare GEMMs of the backward (torch.matmul, same shapes) beside it.
Inputs are fresh N(0, 1) data; outputs are checked against torch's once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness


def latency_ms(fn, reps=25) -> float:
    return round(harness.latency_ms(fn, reps=reps), 4)


def device_ms(fn, calls=20, rounds=5) -> float:
    return round(harness.device_ms(fn, calls=calls, rounds=rounds), 4)


def host_us(fn, calls=10, rounds=7) -> float:
    """Host us per forward + backward, each round queued behind ~1 s of GPU sleep (longer than the host
    needs for `calls` steps)."""
    return round(harness.host_us(fn, calls=calls, rounds=rounds, sleep_cycles=int(2e9)), 1)


def case(act: str, tokens: int, sizes: list[int], dtype) -> dict:
    import torch

    from cudnn_graphs.torch import MLP

    torch.manual_seed(0)
    ours = MLP(sizes, activation=act, device="cuda", dtype=dtype)
    torch_act = torch.nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
    layers = []
    for i, layer in enumerate(ours.layers):
        ref = torch.nn.Linear(layer.in_features, layer.out_features, device="cuda", dtype=dtype)
        ref.load_state_dict(layer.state_dict())
        layers += [ref] + ([torch_act] if i < len(ours.layers) - 1 else [])
    theirs = torch.nn.Sequential(*layers)
    x = torch.randn(tokens, sizes[0], device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, sizes[-1], device="cuda", dtype=dtype)
    y0, y1 = ours(x), theirs(x)
    check = float((y0.double() - y1.double()).norm() / y1.double().norm())

    def step(model):
        return lambda: torch.autograd.backward(model(x), dy)

    def backward_only(model):
        def run():
            y = model(x)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.autograd.backward(y, dy)
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        return lambda: harness.median(run() for _ in range(9))

    h = torch.randn(tokens, sizes[1], device="cuda", dtype=dtype)
    w1, w2 = ours.layers[0].weight, ours.layers[1].weight

    def bare():  # the backward's four GEMMs: dW2 = dy.T @ h, dh = dy @ W2, dW1 = dh.T @ x, dx = dh @ W1
        torch.matmul(dy.t(), h)
        g = torch.matmul(dy, w2)
        torch.matmul(g.t(), x.detach())
        torch.matmul(g, w1)

    out = {"check_rel_err_vs_torch": check}
    for name, model in (("ours", ours), ("torch", theirs)):
        out[name] = {"latency_ms": latency_ms(step(model), reps=15), "device_ms": device_ms(step(model), calls=10),
                     "host_us": host_us(step(model)), "backward_ms": round(backward_only(model)(), 4)}
    out["bare_gemms_ms"] = device_ms(bare, calls=10)
    out["speedup_latency"] = round(out["torch"]["latency_ms"] / out["ours"]["latency_ms"], 3)
    out["speedup_device"] = round(out["torch"]["device_ms"] / out["ours"]["device_ms"], 3)
    out["backward_over_bare"] = round(out["ours"]["backward_ms"] / out["bare_gemms_ms"], 3)
    print(act, json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 4096])
    args = p.parse_args(argv)
    import torch

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "sizes": args.sizes, "dtype": "bfloat16"}
    for act in ("gelu_tanh", "gelu"):
        result[act] = case(act, args.tokens, args.sizes, torch.bfloat16)
    if args.out:
        harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
