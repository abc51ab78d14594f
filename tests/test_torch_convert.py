"""CPU: `convert` replaces torch's convs (sharing parameters), folds eval BatchNorm, fuses activations
and torchvision-style residual blocks, and lists what it keeps; the converted model computes the same."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import cudnn_graphs.torch as cgt  # noqa: E402


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, as its code reads (convert recognises it by its parts)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def _net():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()),
        BasicBlock(8, 8), BasicBlock(8, 16, stride=2),
        nn.Conv2d(16, 16, 1), nn.LeakyReLU(0.2), nn.ConvTranspose2d(16, 4, 2, stride=2), nn.Hardswish())
    for m in net.modules():  # BatchNorm with statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return net.double()


def test_training_convert_shares_parameters_and_lists_what_it_keeps():
    net = _net()
    before = {name: p for name, p in net.named_parameters()}
    out = cgt.convert(net)
    assert out is net
    report = net.cudnn_graphs_report
    assert len(report.replaced) == 7 and report.weights == "shared"
    assert [name for name, _ in report.kept] == ["5"] and "transposed" in report.kept[0][1]
    assert all(p is before[name] for name, p in net.named_parameters())
    assert isinstance(net[0][0], cgt.Conv2d) and isinstance(net[1].conv1, cgt.Conv2d)
    assert type(net[5]) is nn.ConvTranspose2d


def test_inference_convert_folds_batchnorm_fuses_epilogues_and_computes_the_same():
    net = _net().eval()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    want = net(x)
    cgt.convert(net, inference=True)
    report = net.cudnn_graphs_report
    assert report.weights == "copied" and len(report.folded_batchnorm) == 6
    assert report.fused_residual == ["1.conv2", "2.conv2"]  # each block's last conv adds the residual
    fused = dict(report.fused_activation)
    assert fused["0.0"] == "silu" and fused["1.conv2"] == "relu" and fused["3"] == "leaky_relu(negative_slope=0.2)"
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 6  # folded into copies, kept as they are
    torch.testing.assert_close(net(x), want)
    assert "7 convolutions converted (weights copied)" in str(report)


def test_inference_convert_needs_eval_mode():
    with pytest.raises(ValueError, match="eval"):
        cgt.convert(_net(), inference=True)
    with pytest.raises(TypeError, match="model"):
        cgt.convert("resnet")


def test_torchvision_models_convert():
    tv = pytest.importorskip("torchvision")
    for build in (tv.models.resnet18, tv.models.mobilenet_v3_small, tv.models.efficientnet_b0):
        net = build(weights=None).double().eval()
        convs = sum(type(m) is nn.Conv2d for m in net.modules())
        x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
        want = net(x)
        cgt.convert(net, inference=True)
        report = net.cudnn_graphs_report
        assert len(report.replaced) == convs and not report.kept, build.__name__
        assert report.folded_batchnorm, build.__name__
        torch.testing.assert_close(net(x), want)


def test_parametrized_and_shared_convs_are_converted_and_stay_what_they_were():
    import copy

    torch.manual_seed(2)
    shared = nn.Conv2d(6, 6, 3, padding=1)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 6, 3, padding=1)), nn.ReLU(),
                          shared, nn.ReLU(), shared)
    x = torch.randn(2, 4, 9, 9)
    want = model(x)
    cgt.convert(model)
    assert model.cudnn_graphs_report.replaced == ["0", "2"] and not model.cudnn_graphs_report.kept
    assert isinstance(model[0], cgt.Conv2d) and nn.utils.parametrize.is_parametrized(model[0], "weight")
    assert model[2] is model[4] and isinstance(model[4], cgt.Conv2d)  # one module, as before
    torch.testing.assert_close(model(x), want)
    model(x).sum().backward()
    assert model[0].parametrizations.weight.original1.grad is not None
    torch.testing.assert_close(copy.deepcopy(model)(x), want)
    nn.utils.parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is cgt.Conv2d
    torch.testing.assert_close(model(x), want)


def _grad_fn(y) -> str:
    return type(y.grad_fn).__name__


def test_convs_outside_fused_runs_train_through_torchs_own_node_by_default():
    net = cgt.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU()).double())
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    y = net[0](x)
    assert _grad_fn(y) == "ConvolutionBackward0"  # torch's C++ node, not our Python one
    ref = nn.functional.conv2d(nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"), net[0].weight, net[0].bias)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    with torch.no_grad():  # no gradient wanted: this library's path, the same numbers
        torch.testing.assert_close(net[0](x), ref)
    assert "train_convs='torch'" in str(net.cudnn_graphs_report)
    # an input needing no gradient (a network's first conv): this library's node, only the weight's gradient
    y0 = net[0](x.detach())
    assert _grad_fn(y0) == "_ConvFunctionBackward"
    torch.testing.assert_close(y0, ref)
    want = torch.autograd.grad(ref.sum(), net[0].weight)[0]
    net[0].weight.grad = None
    net[0](x.detach()).sum().backward()
    torch.testing.assert_close(net[0].weight.grad, want)


def test_train_convs_cudnn_graphs_keeps_this_librarys_autograd_node():
    net = cgt.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)).double(), train_convs="cudnn_graphs")
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    assert _grad_fn(net(x)) == "_ConvFunctionBackward"
    assert net.cudnn_graphs_report.train_convs == "cudnn_graphs"
    assert "train_convs='cudnn_graphs'" in str(net.cudnn_graphs_report)


@pytest.mark.parametrize("train_convs", ["torch", "cudnn_graphs"])
def test_forward_mode_ad_through_a_converted_conv(train_convs):
    """Inside a forward-AD level (dual tensors) a converted conv is torch's: our nodes have no jvp rule."""
    import torch.autograd.forward_ad as fwAD

    net = cgt.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)).double(), train_convs=train_convs)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    tangent = torch.randn_like(net[0].weight)
    with fwAD.dual_level():
        dual = fwAD.make_dual(net[0].weight.detach(), tangent)
        y = torch.func.functional_call(net, {"0.weight": dual}, (x,))
        got = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(got, nn.functional.conv2d(x, tangent, None, padding=1))


def test_torchs_training_path_keeps_a_fused_residual_and_activation():
    torch.manual_seed(0)
    conv = cgt.Conv2d(3, 4, 3, padding=1, activation="relu").double()
    conv.torch_when_training = True
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    y = conv(x, z)
    torch.testing.assert_close(y, torch.relu(nn.functional.conv2d(x, conv.weight, conv.bias, padding=1) + z))
    y.sum().backward()
    assert x.grad is not None and conv.weight.grad is not None


def test_train_convs_refuses_an_unknown_value_by_name():
    with pytest.raises(ValueError, match="train_convs.*'ours'"):
        cgt.convert(_net(), train_convs="ours")


def test_an_inference_conversion_has_no_training_route():
    net = cgt.convert(_net().eval(), inference=True)
    assert not any(getattr(m, "torch_when_training", False) for m in net.modules())
    assert "train_convs" not in str(net.cudnn_graphs_report)
