"""CPU: `convert` finds BatchNorm -> ReLU -> conv (pre-activation networks: DenseNet's layers and
transitions, such slots in an nn.Sequential), says which run as one graph in eval and why the others
do not, keeps modules and state_dict keys, and computes what the modules compute wherever the graph
cannot run (here: CPU tensors, training mode, a gradient wanted)."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._activations import Act  # noqa: E402
from cudnn_graphs.torch._preact import PreActivation, why_not_site  # noqa: E402


class _DenseLayer(nn.Module):
    """torchvision's DenseNet layer, as its code reads (checkpointing where memory_efficient)."""

    def __init__(self, cin, growth=8, bn_size=2, drop_rate=0.0, memory_efficient=False):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)
        self.drop_rate, self.memory_efficient = float(drop_rate), memory_efficient
        self.checkpointed = 0

    def bn_function(self, inputs):
        return self.conv1(self.relu1(self.norm1(torch.cat(inputs, 1))))

    def forward(self, input):
        prev = [input] if isinstance(input, torch.Tensor) else input
        if self.memory_efficient and any(t.requires_grad for t in prev):
            self.checkpointed += 1
            out = torch.utils.checkpoint.checkpoint(lambda *x: self.bn_function(list(x)), *prev, use_reentrant=False)
        else:
            out = self.bn_function(prev)
        out = self.conv2(self.relu2(self.norm2(out)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


class _Transition(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm, self.relu = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers, cin, growth=8, **kw):
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", _DenseLayer(cin + i * growth, growth, **kw))

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class TinyDenseNet(nn.Module):
    def __init__(self, growth=8, **kw):
        super().__init__()
        mid = 16 + 3 * growth
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, 16, 3, padding=1, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(16))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("denseblock1", DenseBlock(3, 16, growth, **kw))
        self.features.add_module("transition1", _Transition(mid, 16))
        self.features.add_module("denseblock2", DenseBlock(2, 16, growth, **kw))
        self.features.add_module("norm5", nn.BatchNorm2d(16 + 2 * growth))

    def forward(self, x):
        return F.adaptive_avg_pool2d(F.relu(self.features(x)), 1).flatten(1)


def _randomise(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return model


def _pair(**kw):
    torch.manual_seed(0)
    ref = _randomise(TinyDenseNet(**kw)).eval()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("inference", [False, True])
def test_densenet_sites_found_and_reported(inference):
    ref, model = _pair()
    keys = list(model.state_dict())
    cgt.convert(model, inference=inference)
    report = model.cudnn_graphs_report
    where = [w for w, _ in report.prologues]
    block1 = [f"features.denseblock1.denselayer{i}.conv{c}" for i in (1, 2, 3) for c in (1, 2)]
    block2 = [f"features.denseblock2.denselayer{i}.conv{c}" for i in (1, 2) for c in (1, 2)]
    assert where == block1 + ["features.transition1.conv"] + block2
    assert all(isinstance(s, PreActivation) for _, s in report.prologues)
    assert "11 BatchNorm -> ReLU -> conv, each one graph in eval" in str(report)
    assert all(s.status() == "not run in eval yet" for _, s in report.prologues)
    if not inference:
        assert list(model.state_dict()) == keys  # nothing moved: checkpoints load both ways
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        tol = dict(rtol=1e-5, atol=1e-5) if inference else dict(rtol=0, atol=0)  # inference folds conv0's BatchNorm
        torch.testing.assert_close(model(x), ref(x), **tol)  # CPU: the modules themselves


def test_sequential_site_and_reasons():
    seq = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1, bias=False),  # site
                        nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 1, bias=True),  # bias: no
                        nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=2, bias=False),
                        nn.BatchNorm2d(16), nn.ReLU6(), nn.Conv2d(16, 16, 1, bias=False))  # ReLU6: not a site
    _randomise(seq).eval()
    ref = copy.deepcopy(seq)
    cgt.convert(seq)
    r = seq.cudnn_graphs_report
    assert [w for w, _ in r.prologues] == ["2"]
    assert dict(r.no_prologue) == {"5": "the conv has a bias (cuDNN fuses no epilogue with the prologue)",
                                   "8": "a grouped conv (cuDNN fuses no per-channel prologue there)",
                                   "11": "relu6 is not a ReLU (cuDNN's prologue is relu(x * scale + shift))"}
    assert "BatchNorm -> ReLU -> 5 stays three kernels in eval: the conv has a bias" in str(r)
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), ref(x), rtol=0, atol=0)


def test_why_not_site():
    relu, gelu_act = Act("relu"), Act("gelu")
    conv = cgt.Conv2d(8, 8, 1, bias=False)
    assert why_not_site(nn.BatchNorm2d(8), relu, conv) is None
    assert "BatchNorm1d" in why_not_site(nn.BatchNorm1d(8), relu, conv)
    assert "not a ReLU" in why_not_site(nn.BatchNorm2d(8), gelu_act, conv)
    assert why_not_site(nn.BatchNorm2d(4), relu, conv) == "the BatchNorm is not of the conv's input channels"
    assert why_not_site(nn.BatchNorm2d(8), relu, nn.Conv2d(8, 8, 1)) == "the conv is not converted (see 'kept')"
    assert why_not_site(nn.BatchNorm2d(8), relu, nn.Linear(8, 8)) == "no Conv2d after it"
    reflect = cgt.Conv2d(8, 8, 3, padding=1, padding_mode="reflect", bias=False)
    assert why_not_site(nn.BatchNorm2d(8), relu, reflect) == "padding_mode='reflect'"
    gelu = cgt.Conv2d(8, 8, 1, bias=False, activation="gelu")
    assert why_not_site(nn.BatchNorm2d(8), relu, gelu) == "the conv has a fused activation"


def test_training_and_gradients_run_the_modules():
    ref, model = _pair(drop_rate=0.2, memory_efficient=True)
    cgt.convert(model)
    calls = []
    layer = model.features.denseblock1.denselayer1
    layer.norm1.register_forward_hook(lambda *a: calls.append("norm1"))
    ref.train(), model.train()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    torch.manual_seed(3)
    a = ref(x)
    torch.manual_seed(3)
    b = model(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # dropout draws alike: the same module calls
    assert calls == ["norm1"] and layer.checkpointed == 1  # memory-efficient checkpointing kept
    b.sum().backward()
    assert model.features.conv0.weight.grad is not None
    assert all(s.status() == "not run in eval yet" for _, s in model.cudnn_graphs_report.prologues)


def test_copies_and_pickles_drop_plans():
    _, model = _pair()
    cgt.convert(model)
    twin = copy.deepcopy(model)
    layer = twin.features.denseblock1.denselayer1
    sites = dict(twin.cudnn_graphs_report.prologues)
    first, second = (sites[f"features.denseblock1.denselayer1.conv{i}"] for i in (1, 2))
    assert first.bn is layer.norm1 and first.conv is layer.conv1 and second.conv is layer.conv2
    assert first._plans == {}
    loaded = pickle.loads(pickle.dumps(model))
    site = dict(loaded.cudnn_graphs_report.prologues)["features.transition1.conv"]
    assert isinstance(site, PreActivation) and site.conv is loaded.features.transition1.conv
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_modules_replaced_after_convert_are_the_ones_that_run():
    """A site holds the modules convert found; a BatchNorm or conv replaced afterwards computes instead."""
    ref, model = _pair()
    cgt.convert(model)
    torch.manual_seed(3)
    layer_bn, trans_conv = nn.BatchNorm2d(16), nn.Conv2d(40, 16, 1, bias=False)
    _randomise(layer_bn.eval())
    for net in (ref, model):
        net.features.denseblock1.denselayer1.norm1 = copy.deepcopy(layer_bn)
        net.features.transition1.conv = copy.deepcopy(trans_conv)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    status = dict(model.cudnn_graphs_report.prologues)
    moved = [w for w, site in status.items() if "replaced after convert" in site.status()]
    # the sites holding a replaced module say so (the block's rewritten forward runs its own code then)
    assert moved == ["features.denseblock1.denselayer1.conv1", "features.transition1.conv"], moved


def test_convert_twice_is_a_no_op():
    _, model = _pair()
    cgt.convert(model)
    sites = [s for _, s in model.cudnn_graphs_report.prologues]
    cgt.convert(model)
    assert [s for _, s in model.cudnn_graphs_report.prologues] == sites


def test_fuse_batchnorm_false_keeps_three_modules():
    _, model = _pair()
    cgt.convert(model, fuse_batchnorm=False)
    assert model.cudnn_graphs_report.prologues == []
    assert "forward" not in vars(model.features.transition1)
