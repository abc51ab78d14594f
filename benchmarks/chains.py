"""Benchmark (GPU host): each kind of block `convert` fuses for training, against torch's own block.

    python -m benchmarks.chains --out chains.json [--plot chains.png]

Kinds (AMP float16, channels-last, batch 64, torch with `cudnn.benchmark=True`): torchvision ResNet-50's
Bottleneck with its identity and with its downsample, one of each per stage (one fused conv -> BatchNorm
-> ReLU node each); ResNet-18's BasicBlock likewise at its first two stages; ConvNeXt-T's CNBlock at each
stage (one node each). Per block, ours (the block inside `convert`) against torch's, in the same
interleaved rounds (`harness.interleaved`):

- host us of the forward, and of forward + backward, the GPU held busy by a queued sleep (what a host-bound
  training step pays: torch's C++ autograd nodes against our one Python node a block);
- device us of forward + backward, blocks of back-to-back calls behind a sleep (no launch gaps);
- the block's output and input gradient checked against torch's first (relative error; NaN inputs never).

Where each fused piece's time goes against the torch ops it replaces (per ResNet-50 layer: device us, bytes
moved, bandwidth against the GPU's peak): `benchmarks/fused_graphs.py`. The maintainers' probes behind it,
for what it does not cover (bf16 and float32 operands, other plans, another version of the kernels):
`tools/probe_bn_fusions.py` and `tools/probe_bn_kernels.py`.
"""

from __future__ import annotations

import argparse
import copy

from benchmarks import harness

BATCH = 64


def blocks():
    """(name, block, input shape): the kinds above, torch's modules with random weights."""
    import torchvision

    r50, r18 = torchvision.models.resnet50(), torchvision.models.resnet18()
    cnx = torchvision.models.convnext_tiny()
    out = []
    for i, (stage, hw) in enumerate(((r50.layer1, 56), (r50.layer2, 56), (r50.layer3, 28), (r50.layer4, 14))):
        cin = stage[0].conv1.in_channels
        out.append((f"bottleneck+down l{i + 1}", stage[0], (BATCH, cin, hw, hw)))
        c = stage[1].conv1.in_channels
        out.append((f"bottleneck l{i + 1}", stage[1], (BATCH, c, hw // (2 if i else 1), hw // (2 if i else 1))))
    out.append(("basicblock l1", r18.layer1[1], (BATCH, 64, 56, 56)))
    out.append(("basicblock+down l2", r18.layer2[0], (BATCH, 64, 56, 56)))
    for i, (idx, hw) in enumerate(((1, 56), (3, 28), (5, 14), (7, 7))):
        block = cnx.features[idx][1]
        out.append((f"cnblock s{i + 1}", block, (BATCH, block.block[0].in_channels, hw, hw)))
    return out


def bench(name, block, shape, rounds: int) -> dict:
    import torch

    import cudnn_graphs.torch as cgt

    cl = torch.channels_last
    theirs = torch.nn.Sequential(copy.deepcopy(block)).cuda().to(memory_format=cl).train()
    ours = cgt.convert(copy.deepcopy(theirs))
    x = torch.randn(shape, device="cuda").half().contiguous(memory_format=cl).requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        probe = theirs(x)
    dy = torch.randn_like(probe).contiguous(memory_format=cl)

    def forward(model):
        def call():
            with torch.autocast("cuda", dtype=torch.float16):
                return model(x)
        return call

    def step(model):
        fwd = forward(model)

        def call():
            fwd().backward(dy)
        return call

    row = {"block": name, "input": list(shape)}
    checks = []
    for model in (ours, theirs):
        x.grad = None
        torch.manual_seed(0)
        out = forward(model)()
        out.backward(dy)
        checks.append((out.detach().float(), x.grad.float()))
    (o, g), (to, tg) = checks
    row["rel_err_out"], row["rel_err_dx"] = harness.rel_err(o, to), harness.rel_err(g, tg)
    for model in (ours, theirs):  # plans, recordings, torch's autotuning: done before timing
        for _ in range(3):
            step(model)()
    torch.cuda.synchronize()
    cands = {"ours": ours, "torch": theirs}
    sleep = harness.sleep_cycles_for(100)  # a few ms of calls queue behind it: the host never waits
    measures = {
        "host_fwd_us": lambda m: harness.host_us(forward(m), calls=10, sleep_cycles=sleep, nan_if_drained=True),
        "host_step_us": lambda m: harness.host_us(step(m), calls=5, sleep_cycles=2 * sleep, nan_if_drained=True),
        "device_step_us": lambda m: harness.device_ms(step(m), calls=10, rounds=1,
                                                      sleep_cycles=sleep) * 1e3,
    }
    got = harness.interleaved(cands, measures, rounds=rounds)
    for measure, per in got.items():
        row[measure] = {k: round(v, 2) for k, v in per.items()}
        row[measure]["ratio"] = round(harness.ratio(per["torch"], per["ours"]), 3)
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    torch.backends.cudnn.benchmark = True
    rows = [bench(name, block, shape, args.rounds) for name, block, shape in blocks()]
    result = {"device": torch.cuda.get_device_name(), "batch": BATCH, "rows": rows}
    harness.write_json(args.out, result)
    if args.plot:
        groups = {r["block"]: {m: r[m]["ratio"] for m in ("host_step_us", "device_step_us")} for r in rows}
        titled = {**result, "meta": harness.metadata()}
        harness.bar_chart(args.plot, groups, title=harness.title(titled, "training blocks, torch / ours"),
                          ylabel="speed-up (torch / ours)", baseline=1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
