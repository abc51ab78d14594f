"""Benchmark (GPU host): cudnn_graphs.torch.MLP forward + backward beside torch autograd, in one run.

    python -m benchmarks.mlp --out mlp.json [--tokens 8192 --sizes 4096 16384 4096]

bf16, x [tokens, 4096] -> 16384 -> 4096 (a transformer block's feed-forward). For gelu_tanh (cuBLASLt's
GELU: the fused path, four GEMMs and no elementwise pass in the backward) against torch's
Linear-GELU(tanh)-Linear, and exact gelu (our linear_act chain) against nn.GELU(), ours and torch's in the
same interleaved rounds (`harness.interleaved`, --rounds 5), medians:
* fwd_bwd latency_ms from an idle GPU (events around one forward + backward, 3 a round);
* device_ms back to back (10 steps queued behind a sleep, per step, one block a round; the blocks whose
  sleep ended first are counted in device_host_bound_blocks);
* host_us per forward + backward with the GPU held busy;
* the backward alone (3 a round), and the four bare GEMMs of the backward (torch.matmul, same shapes) beside it.
Inputs are fresh N(0, 1) data; outputs are checked against torch's once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness


ROUNDS = 5


def host_us(fn, calls=10) -> float:
    """Host us per forward + backward, queued behind ~1 s of GPU sleep (longer than the host needs for
    `calls` steps)."""
    return harness.host_us(fn, calls=calls, sleep_cycles=int(2e9))


def case(act: str, tokens: int, sizes: list[int], dtype, *, rounds: int = ROUNDS) -> dict:
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
        def run():
            torch.autograd.backward(model(x), dy)
        run.model = model  # DeviceTime keys its counts by function: this says whose they are
        return run

    def backward_ms(model) -> float:
        """One backward from an idle GPU, its forward run (untimed) just before."""
        y = model(x)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.backward(y, dy)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    h = torch.randn(tokens, sizes[1], device="cuda", dtype=dtype)
    w1, w2 = ours.layers[0].weight, ours.layers[1].weight

    def bare():  # the backward's four GEMMs: dW2 = dy.T @ h, dh = dy @ W2, dW1 = dh.T @ x, dx = dh @ W1
        torch.matmul(dy.t(), h)
        g = torch.matmul(dy, w2)
        torch.matmul(g.t(), x.detach())
        torch.matmul(g, w1)

    out = {"check_rel_err_vs_torch": check}
    models = {"ours": ours, "torch": theirs}
    device = harness.DeviceTime(calls=10)
    got = harness.interleaved(models, {"latency_ms": lambda m: harness.latency_ms(step(m), reps=3),
                                       "device_ms": lambda m: device(step(m)),
                                       "host_us": lambda m: host_us(step(m)),
                                       "backward_ms": lambda m: [backward_ms(m) for _ in range(3)]}, rounds=rounds)
    for name in models:
        out[name] = {figure: round(got[figure][name], 4) for figure in got}
        out[name]["device_host_bound_blocks"] = sum(n for fn, n in device.host_bound.items()
                                                    if getattr(fn, "model", None) is models[name])
    out["bare_gemms_ms"] = round(harness.device_ms(bare, calls=10, rounds=rounds), 4)
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
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of ours and torch's")
    args = p.parse_args(argv)
    import torch

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "sizes": args.sizes, "dtype": "bfloat16", "rounds": args.rounds}
    for act in ("gelu_tanh", "gelu"):
        result[act] = case(act, args.tokens, args.sizes, torch.bfloat16, rounds=args.rounds)
    if args.out:
        harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
