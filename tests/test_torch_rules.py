"""CPU: `convert` finds what to fuse on the traced graph -- operations, not class or attribute names -- and
leaves as torch wrote it, with the reason, whatever it cannot take exactly. Every converted model here is
compared with the unconverted one in float64: outputs, gradients and running statistics."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._graph import GraphForward  # noqa: E402


def _randomise(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.2)
    return model.double()


def _step(net, x):
    out = net(x)
    out.square().mean().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}
    return out, grads, {n: b.clone() for n, b in net.named_buffers()}


def _same_training_step(ours, theirs, x):
    out, grads, bufs = _step(ours, x)
    ref_out, ref_grads, ref_bufs = _step(theirs, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    for name, b in ref_bufs.items():
        torch.testing.assert_close(bufs[name], b, rtol=1e-12, atol=0, msg=name)


def _same_eval(ours, theirs, x):
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-10)


class FunctionalBlock(nn.Module):
    """A hand-written residual block: activations as F.relu, torch.relu, .relu_(), and `+=`."""

    def __init__(self, c, stride=1):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, stride, 1, bias=False)
        self.na = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.nb = nn.BatchNorm2d(c)
        self.skip = None if stride == 1 else nn.Sequential(nn.Conv2d(c, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        y = F.relu(self.na(self.a(x)))
        y = self.nb(self.b(y))
        y += x if self.skip is None else self.skip(x)
        return y.relu_()


class Bottleneck(nn.Module):
    """Named and laid out as torchvision's, but pre-activation: BatchNorm -> ReLU -> conv, and an SE gate."""

    def __init__(self, c):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.se = nn.Conv2d(c, c, 1)
        self.downsample = None

    def forward(self, x):
        out = self.conv1(self.relu(self.bn1(x)))
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return x + out * torch.sigmoid(self.se(F.adaptive_avg_pool2d(out, 1)))


def test_a_hand_written_block_with_functional_activations_is_a_fused_run():
    torch.manual_seed(0)
    class Net(nn.Module):  # its blocks in a ModuleList, which has no forward to trace
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.blocks = nn.ModuleList([FunctionalBlock(8), FunctionalBlock(8, stride=2)])

        def forward(self, x):
            x = self.stem(x)
            for block in self.blocks:
                x = block(x)
            return x

    net = _randomise(Net())
    ours = cgt.convert(copy.deepcopy(net))
    chains = dict(ours.cudnn_graphs_report.chains)
    assert sorted(chains) == ["blocks.0", "blocks.1"] and chains["blocks.1"].branch is not None
    assert chains["blocks.0"].branch is None and ours.cudnn_graphs_report.untraced == []
    block = ours.blocks[0]
    assert type(block) is FunctionalBlock and isinstance(vars(block)["forward"], GraphForward)
    _same_training_step(ours, net, torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_a_block_named_like_torchvisions_is_taken_for_what_it_computes():
    """A pre-activation `Bottleneck` with torchvision's attribute names: what its operations are decides --
    conv1 -> bn2 -> relu -> conv2 -> bn3 -> relu is a two-stage run (conv3's output feeds the SE gate and the
    product, so the run stops there), the residual is not part of it, and in eval each BatchNorm -> ReLU ->
    conv is a prologue site. The SE gate keeps its gradients."""
    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), Bottleneck(8)))
    ours = cgt.convert(copy.deepcopy(net))
    report = ours.cudnn_graphs_report
    assert [(w, len(c.stages), c.final_relu, c.branch) for w, c in report.chains] == [("1.conv1", 2, True, None)]
    assert [w for w, _ in report.prologues] == ["1.conv1", "1.conv2", "1.conv3"]
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _same_training_step(ours, net, x)
    assert ours[1].se.weight.grad is not None
    _same_eval(ours.eval(), net.eval(), x)


def test_inference_leaves_a_conv_called_from_two_places_as_it_is_elsewhere():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x):
            return F.relu(self.bn(self.conv(x))) + self.conv(x)  # the second call has no BatchNorm

    net = _randomise(Twice()).eval()
    ours = cgt.convert(copy.deepcopy(net), inference=True)
    assert ours.cudnn_graphs_report.folded_batchnorm == ["bn"]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), net.state_dict().values()))
    _same_eval(ours, net, torch.randn(2, 4, 6, 6, dtype=torch.float64))


def test_a_sequential_subclass_with_its_own_forward_is_taken_as_its_forward_computes():
    class Gated(nn.Sequential):
        def forward(self, x):
            return self[1](self[0](x)) * 0.5 + x  # skips the ReLU slot, halves the BatchNorm

    net = _randomise(Gated(nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU())).eval()
    ours = cgt.convert(copy.deepcopy(net), inference=True)
    assert ours.cudnn_graphs_report.fused_activation == []  # no ReLU follows the BatchNorm in its forward
    _same_eval(ours, net, torch.randn(2, 4, 5, 5, dtype=torch.float64))


@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference"])
def test_hooks_on_a_batchnorm_or_relu_keep_firing(inference):
    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), FunctionalBlock(8)))
    net[0].register_forward_hook(lambda *a: None)
    ours = cgt.convert(copy.deepcopy(net).train(not inference), inference=inference)
    calls = []
    ours[1].na.register_forward_hook(lambda *a: calls.append("na"))
    ours[1].nb.register_forward_pre_hook(lambda *a: calls.append("nb"))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        ours(x)
    assert calls == ["na", "nb"]


def test_a_scripted_model_is_returned_as_it_is_with_the_reason():
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()).eval()
    scripted = torch.jit.script(net)
    out = cgt.convert(scripted, inference=True)
    assert out is scripted and "TorchScript" in str(out.cudnn_graphs_report)
    holder = nn.Sequential(scripted, nn.Conv2d(4, 4, 1))
    cgt.convert(holder)
    assert dict(holder.cudnn_graphs_report.kept)["0"].startswith("a TorchScript module")


def test_a_forward_that_does_not_trace_keeps_running_with_the_reason():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: fx cannot trace it
                x = -x
            return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))

    net = _randomise(Branchy())
    ours = cgt.convert(copy.deepcopy(net))
    assert [name for name, _ in ours.cudnn_graphs_report.untraced] == ["Branchy"]
    assert "could not trace" in str(ours.cudnn_graphs_report)
    _same_training_step(ours, net, torch.randn(2, 4, 6, 6, dtype=torch.float64))


def test_a_forward_that_counts_its_calls_keeps_its_own_forward():
    class Counting(FunctionalBlock):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), Counting(4)))
    ours = cgt.convert(copy.deepcopy(net))
    assert ours[1].calls == 0 and "changes the attribute 'calls'" in dict(ours.cudnn_graphs_report.untraced)["1"]
    _same_training_step(ours, net, torch.randn(2, 3, 6, 6, dtype=torch.float64))
    assert ours[1].calls == net[1].calls == 1


def test_a_plain_attribute_changed_after_convert_runs_the_modules_own_forward():
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.use_block = FunctionalBlock(4), True

        def forward(self, x):
            return self.block(x) if self.use_block else x * 2

    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                   nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), Optional()))
    ours = cgt.convert(copy.deepcopy(net))
    assert len(ours.cudnn_graphs_report.chains) == 2  # the Sequential's run and the block's
    for m in (net, ours):
        m[6].use_block = False
    _same_training_step(ours, net, torch.randn(2, 3, 6, 6, dtype=torch.float64))


def test_a_module_called_with_a_list_is_rewritten_by_its_caller():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.conv = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1, bias=False)

        def forward(self, xs):
            x = torch.cat(xs, 1) if not isinstance(xs, torch.Tensor) else xs
            return self.conv(F.relu(self.bn(x)))

    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Cat()

        def forward(self, x):
            return self.layer([x, x])

    net = _randomise(Caller()).eval()
    ours = cgt.convert(copy.deepcopy(net))
    assert "forward" not in vars(ours.layer) and isinstance(vars(ours)["forward"], GraphForward)
    assert [w for w, _ in ours.cudnn_graphs_report.prologues] == ["layer.conv"]
    _same_eval(ours, net, torch.randn(2, 4, 5, 5, dtype=torch.float64))


def test_a_residual_torch_would_broadcast_or_promote_runs_as_torch_adds_it():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.bias = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Parameter(torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)) + self.bias)  # (1, C, 1, 1): torch broadcasts it

    net = _randomise(Broadcast()).eval()
    ours = cgt.convert(copy.deepcopy(net), inference=True)
    assert ours.cudnn_graphs_report.fused_residual == ["conv"]
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    _same_eval(ours, net, x)
    for m in (net, ours):  # a float32 residual beside a float64 conv: torch promotes, the epilogue would not
        m.bias.data = m.bias.data.float()
    with torch.no_grad():
        got, want = ours(x), net(x)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)


def test_folded_weights_follow_the_modules_tensors():
    net = _randomise(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())).eval()
    ours = cgt.convert(copy.deepcopy(net), inference=True)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    _same_eval(ours, net, x)
    changed = _randomise(copy.deepcopy(net))
    with torch.no_grad():
        changed[0].weight.mul_(1.5)
    for m in (net, ours):
        m.load_state_dict(changed.state_dict())
    _same_eval(ours, net, x)  # the folded copy was made again from the loaded tensors
    with torch.no_grad():
        for m in (net, ours):
            m[1].running_var.add_(0.25)
    _same_eval(ours, net, x)


def test_copies_and_pickles_run_their_own_rewritten_forward():
    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), FunctionalBlock(8, stride=2)))
    ours = cgt.convert(copy.deepcopy(net))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        fwd = vars(clone[1])["forward"]
        assert fwd.module is clone[1] and all(m.get(n) is mod for v in fwd.variants for m, n, mod in v.held)
        _same_training_step(clone, copy.deepcopy(net), x)


def test_under_compile_fused_nodes_run_outside_its_graphs():
    """convert(under_compile="fused"): torch.compile calls a fused node eagerly at a graph break (it runs
    fused on a GPU), not traced: here on the CPU its unfused operations run, outside the compiled graph."""
    torch.manual_seed(0)
    net = _randomise(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), FunctionalBlock(8)))
    with pytest.raises(ValueError, match="under_compile"):
        cgt.convert(copy.deepcopy(net), under_compile="yes")
    ours = cgt.convert(copy.deepcopy(net), under_compile="fused")
    chain = dict(ours.cudnn_graphs_report.chains)["1"]
    seen, unfused = [], chain.unfused

    def spy(x, residual=None):
        seen.append(torch.compiler.is_compiling())
        return unfused(x, residual)

    chain.unfused = spy
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(ours, backend="eager")(x), net(x))
    assert seen and not any(seen)


@pytest.mark.parametrize("name", ["resnet50", "efficientnet_b0"])
def test_timm_models_convert_by_their_operations(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    net = _randomise(timm.create_model(name, pretrained=False, num_classes=10))
    ours = cgt.convert(copy.deepcopy(net))
    runs = len(ours.cudnn_graphs_report.chains)
    assert runs == (16 if name == "resnet50" else 0)  # efficientnet's SiLU runs are declined, with the reason
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    _same_training_step(ours, net, x)
    served = cgt.convert(copy.deepcopy(net).eval(), inference=True)
    assert len(served.cudnn_graphs_report.folded_batchnorm) >= 49
    _same_eval(served, net.eval(), x)
