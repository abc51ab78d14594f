"""What `convert` finds in models people bring, and whether the converted model computes what torch's does.

    python -m tools.probe_convert_models [--device cuda] [--steps N]

For each model (torchvision, timm where it imports, a hand-written ResNet-18): the fused runs, folds and
prologues the rules found, then one training step's output and gradients and one eval forward against the
unconverted model (float64 on CPU; AMP float16 channels-last on CUDA), and on CUDA the step time of both,
interleaved rounds, medians."""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import cudnn_graphs.torch as cgt
from benchmarks.harness import wall_ms


class HandBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.BatchNorm2d(cout)
        self.short = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        y = self.n2(self.c2(y))
        s = x if self.short is None else self.short(x)
        return torch.relu(y + s)


class HandResNet18(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [HandBlock(cin, cout, stride), HandBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(self.bn(self.stem(x)).relu_(), 3, 2, 1)
        for layer in self.layers:
            x = layer(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def models(names):
    import torchvision
    out = {}
    for name in names:
        if name == "hand_resnet18":
            out[name] = HandResNet18
        elif name.startswith("timm_"):
            try:
                import timm
            except ImportError:
                continue
            out[name] = (lambda n: lambda: timm.create_model(n, pretrained=False))(name[5:])
        else:
            out[name] = getattr(torchvision.models, name)
    return out


def summary(report) -> str:
    return (f"runs {len(report.chains)}, folds {len(report.folded_batchnorm)}, prologues {len(report.prologues)}, "
            f"untraced {len(report.untraced)}, rewritten {len(report.rewritten)}")


def check_cpu(name, make):
    torch.manual_seed(0)
    ref = make().double().train()
    ours = cgt.convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    a, b = ref(x), ours(x)
    a.square().mean().backward()
    b.square().mean().backward()
    err = max((p.grad - q.grad).abs().max().item() for p, q in zip(ref.parameters(), ours.parameters()))
    ev = cgt.convert(copy.deepcopy(ref).eval(), inference=True)
    with torch.no_grad():
        e = (ev(x) - ref.eval()(x)).abs().max().item()
    print(f"{name}: {summary(ours.cudnn_graphs_report)}; train out {(a - b).abs().max().item():.2e} grad {err:.2e}; "
          f"infer {summary(ev.cudnn_graphs_report)} err {e:.2e}", flush=True)


def _timed(one, rounds: int, steps: int) -> list:
    """ms per call of `one()`, one figure per round of `steps` calls (the harness's wall_ms, a round at a time)."""
    return [wall_ms(one, calls=steps) for _ in range(rounds)]


def step_ms(model, x, opt, rounds=5, steps=5):
    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _timed(step, rounds, steps)


def _grad_err(a, b):
    """(relative error of all gradients together, (worst parameter, its relative error)) of b against a."""
    pairs = [(n, p.grad.float(), q.grad.float()) for (n, p), q in zip(a.named_parameters(), b.parameters())]
    num = sum((g - h).square().sum() for _, g, h in pairs).sqrt()
    den = sum(g.square().sum() for _, g, _ in pairs).sqrt()
    worst = max(((n, ((g - h).norm() / (g.norm() + 1e-12)).item()) for n, g, h in pairs), key=lambda t: t[1])
    return (num / den).item(), (worst[0], round(worst[1], 3))


def check_cuda(name, make, batch):
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    ref = make().cuda().to(memory_format=torch.channels_last).train()
    twin, ours = copy.deepcopy(ref), cgt.convert(copy.deepcopy(ref))
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    losses = []
    for m in (ref, twin, ours):  # one step each from the same weights: the same loss
        with torch.autocast("cuda", dtype=torch.float16):
            losses.append(m(x).float().square().mean())
        losses[-1].backward()
    la, lb = losses[0], losses[2]
    rel, aa = _grad_err(ref, ours), _grad_err(ref, twin)  # ours against torch; torch against itself
    status = {c.status() for _, c in ours.cudnn_graphs_report.chains}
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (ref, ours)]
    for m, o in zip((ref, ours), opts):  # warm up (plans, autotuning)
        step_ms(m, x, o, rounds=1, steps=3)
    a, b = [], []
    for _ in range(5):  # interleaved rounds
        a += step_ms(ref, x, opts[0], rounds=1)
        b += step_ms(ours, x, opts[1], rounds=1)
    ta, tb = statistics.median(a), statistics.median(b)
    print(f"{name}: {summary(ours.cudnn_graphs_report)} {status}; loss {la.item():.5f} vs {lb.item():.5f}, "
          f"grad rel err (global, worst param) ours {rel[0]:.2e} {rel[1]}, torch-vs-torch {aa[0]:.2e} {aa[1]}; step torch {ta:.2f} ms, ours {tb:.2f} ms ({ta / tb:.2f}x)", flush=True)


def forward_ms(model, x, autocast, rounds=1, steps=10):
    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            model(x)
    return _timed(forward, rounds, steps)


def check_infer(name, make, batch):
    """Inference, torch eval against convert(inference=True): float32 weights under autocast, and .half()."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    out = []
    for mode in ("autocast", "half"):
        ref = make().cuda().eval().to(memory_format=torch.channels_last)
        ref = ref.half() if mode == "half" else ref
        ours = cgt.convert(copy.deepcopy(ref), inference=True)
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16 if mode == "half" else torch.float32)
        x = x.to(memory_format=torch.channels_last)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=mode == "autocast"):
            err = ((ours(x).float() - ref(x).float()).norm() / ref(x).float().norm()).item()
        for m in (ref, ours):
            forward_ms(m, x, mode == "autocast", steps=3)
        a, b = [], []
        for _ in range(7):
            a += forward_ms(ref, x, mode == "autocast")
            b += forward_ms(ours, x, mode == "autocast")
        ta, tb = statistics.median(a), statistics.median(b)
        out.append(f"{mode} torch {ta:.2f} ms ours {tb:.2f} ms ({ta / tb:.2f}x, rel err {err:.1e})")
    print(f"{name} inference (batch {batch}): " + "; ".join(out), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--infer", action="store_true", help="on CUDA: inference timings instead of a training step")
    p.add_argument("--models", default="resnet18,resnet50,densenet121,mobilenet_v3_large,hand_resnet18,"
                                       "timm_resnet50,timm_resnet18,timm_efficientnet_b0,timm_convnext_tiny")
    args = p.parse_args(argv)
    for name, make in models(args.models.split(",")).items():
        try:
            if args.device != "cuda":
                check_cpu(name, make)
            else:
                (check_infer if args.infer else check_cuda)(name, make, args.batch)
        except Exception as err:  # a probe: say what broke and go on
            print(f"{name}: FAILED {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
