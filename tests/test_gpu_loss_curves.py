"""300 AMP training steps of a converted model on a learnable synthetic task track torch's own run: a
ResNet (its BasicBlocks as fused conv -> BatchNorm -> ReLU runs) and a small ConvNeXt (its CNBlocks as
one node each, stochastic depth on), same data, seeds and optimizer on both sides."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
nn = torch.nn

import cudnn_graphs.torch as cgt  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last
STEPS = 300


def _task(n=1024, classes=10, seed=0):
    """Noisy images around one fixed random template a class: learnable in a few hundred steps, not at once."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    templates = torch.randn(classes, 3, 32, 32, device="cuda", generator=g)
    y = torch.randint(0, classes, (n,), device="cuda", generator=g)
    x = 0.3 * templates[y] + torch.randn(n, 3, 32, 32, device="cuda", generator=g)
    return x.contiguous(memory_format=CL), y


def _convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)], stochastic_depth_prob=0.2,
                    layer_scale=0.1, num_classes=10)


def _curve(model, x, y, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler()
    torch.manual_seed(seed)  # stochastic depth's draws: the same sequence on both sides
    losses = []
    for step in range(STEPS):
        i = (step * 64) % x.shape[0]
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x[i:i + 64]).float(), y[i:i + 64])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return torch.stack(losses).cpu()


def _smoothed(curve, width=20):
    return curve.unfold(0, width, 1).mean(1)


@pytest.mark.parametrize("make", [lambda: torchvision.models.resnet18(num_classes=10), _convnext],
                         ids=["resnet18", "convnext"])
def test_300_amp_steps_track_torchs_loss_curve(make):
    torch.manual_seed(0)
    base = make().cuda().to(memory_format=CL)
    ours = cgt.convert(copy.deepcopy(base))
    report = ours.cudnn_graphs_report
    assert report.convnext_blocks or report.chains, str(report)  # something of ours trains
    x, y = _task()
    if report.convnext_blocks:  # the node trains, not the block's own forward (stage 1's first block: no draw)
        with torch.autocast("cuda", dtype=torch.float16):
            first = ours.features[1][0](ours.features[0](x[:64]))
        assert type(first.grad_fn).__name__ == "CNBlockFunctionBackward"
    theirs, got = _curve(base, x, y), _curve(ours, x, y)
    assert torch.isfinite(got).all()
    start = float(theirs[:20].mean())
    ends = (float(_smoothed(theirs)[-1]), float(_smoothed(got)[-1]))
    assert max(ends) < 0.3 * start, (start, ends)  # both learn
    gap = (_smoothed(got) - _smoothed(theirs)).abs()
    # the curves stay together all along, not only at their ends
    assert float(gap.mean()) < 0.05 * start and float(gap.max()) < 0.2 * start, (start, ends, gap.mean(), gap.max())
