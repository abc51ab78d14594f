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
import time

import torch
import torch.nn.functional as F
from torch import nn

import cudnn_graphs.torch as cgt


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


def step_ms(model, x, opt, rounds=5, steps=5):
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / steps * 1e3)
    return times


def check_cuda(name, make, batch):
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    ref = make().cuda().to(memory_format=torch.channels_last).train()
    ours = cgt.convert(copy.deepcopy(ref))
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.float16):  # one step each from the same weights: the same loss
        la = ref(x).float().square().mean()
        lb = ours(x).float().square().mean()
    la.backward()
    lb.backward()
    rel = max(((p.grad.float() - q.grad.float()).norm() / (p.grad.float().norm() + 1e-12)).item()
              for p, q in zip(ref.parameters(), ours.parameters()))
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
          f"max grad rel err {rel:.2e}; step torch {ta:.2f} ms, ours {tb:.2f} ms ({ta / tb:.2f}x)", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--models", default="resnet18,resnet50,densenet121,mobilenet_v3_large,hand_resnet18,"
                                       "timm_resnet50,timm_resnet18,timm_efficientnet_b0,timm_convnext_tiny")
    args = p.parse_args(argv)
    for name, make in models(args.models.split(",")).items():
        try:
            (check_cuda if args.device == "cuda" else check_cpu)(name, make, *([args.batch] if args.device == "cuda" else []))
        except Exception as err:  # a probe: say what broke and go on
            print(f"{name}: FAILED {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
