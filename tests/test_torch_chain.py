"""CPU: `convert` finds conv -> BatchNorm -> ReLU runs for training (torchvision-style blocks with their
residual, runs in a Sequential), keeps every module and state_dict key where it was, and computes what
the modules compute wherever the fused node cannot run (CPU tensors, eval mode)."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._chain import Chain  # noqa: E402

from .test_torch_convert import BasicBlock  # noqa: E402


class Bottleneck(nn.Module):
    """torchvision's Bottleneck, as its code reads."""

    def __init__(self, cin, mid, stride=1):
        super().__init__()
        cout = mid * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),    # a 2-stage run ...
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16),                          # ... a stage alone
        Bottleneck(16, 4), Bottleneck(16, 8, stride=2), BasicBlock(32, 32),
        nn.Sequential(nn.Conv2d(32, 8, 1, bias=True), nn.BatchNorm2d(8), nn.ReLU()),   # conv bias: not a run
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU()),
    ).double()


def _chain(net, where):
    """The fused run convert reported at `where`."""
    return dict(net.cudnn_graphs_report.chains)[where]


def _step(net, x):
    out = net(x)
    out.square().mean().backward()
    return out, {n: p.grad.clone() for n, p in net.named_parameters()}, {n: b.clone() for n, b in net.named_buffers()}


def _same_step(ours, theirs, x):
    """One step of each computes the same output, gradients and buffers (float64)."""
    out, grads, bufs = _step(ours, x)
    ref_out, ref_grads, ref_bufs = _step(theirs, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12)
    for name in ref_bufs:
        torch.testing.assert_close(bufs[name], ref_bufs[name], rtol=1e-12, atol=0)


def test_training_convert_finds_runs_and_keeps_paths():
    net = _net()
    keys = list(net.state_dict())
    cgt.convert(net)
    report = net.cudnn_graphs_report
    where = {w: len(c.stages) for w, c in report.chains}
    # single-stage runs (7, 13.0) stay unfused: they measured slower fused
    assert where == {"0": 2, "9": 3, "10": 3, "11": 2}
    # a block's downsample conv -> BatchNorm is its run's branch: the run computes the residual itself
    block = net[10]
    branch = _chain(net, "10").branch
    assert branch.conv is block.downsample[0] and branch.bn is block.downsample[1] and not branch.relu
    assert _chain(net, "9").branch is None  # no downsample: the identity is the residual
    assert "10 (3 convs + downsample)" in str(report)
    assert list(net.state_dict()) == keys
    assert all(c.status() == "not run in training yet" for _, c in report.chains)
    assert "runs, each one fused node in training" in str(report)
    why = dict(report.unchained)  # every conv -> BatchNorm pair left unfused, and why
    assert set(why) == {"7", "12.0", "13.0"}
    assert "a run of 1 stage" in why["7"] and "bias" in why["12.0"]
    assert "12.0: the conv has a bias" in str(report)
    assert cgt.convert(net) is net and net.cudnn_graphs_report is report  # converting again changes nothing


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_converted_runs_compute_what_the_modules_compute_on_cpu(train):
    net = _net().train(train)
    ours = cgt.convert(copy.deepcopy(net))
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    _same_step(ours, net, x)
    # CPU tensors never plan; the report says why nothing ran fused
    assert all(not c._plans for _, c in ours.cudnn_graphs_report.chains)


def test_copies_and_pickles_carry_chains_onto_their_own_modules():
    net = cgt.convert(_net())
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        chain = _chain(clone, "9")
        assert isinstance(chain, Chain) and chain.stages[0].conv is clone[9].conv1
        assert chain.stages[2].bn is clone[9].bn3 and chain._plans == {}
        ds = _chain(clone, "10")
        assert ds.branch.conv is clone[10].downsample[0] and ds.branch.bn is clone[10].downsample[1]
        assert chain.unfused_fn.root is clone[9]  # its unfused operations run on the copy's modules
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        torch.testing.assert_close(clone(x), net(x))


def test_fuse_batchnorm_false_keeps_torchs_batchnorm():
    net = cgt.convert(_net(), fuse_batchnorm=False)
    assert net.cudnn_graphs_report.chains == []
    with pytest.raises(TypeError, match="fuse_batchnorm"):
        cgt.convert(_net(), fuse_batchnorm="yes")


def test_inference_converted_blocks_pickle():
    """The replaced forward of a folded block pickles (a bound method of a module-level function did not)."""
    net = _net().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ours = cgt.convert(copy.deepcopy(net), inference=True)
    assert ours.cudnn_graphs_report.fused_residual
    torch.testing.assert_close(pickle.loads(pickle.dumps(ours))(x), ours(x))


def test_hooks_on_a_runs_modules_fire_and_keep_it_unfused():
    """A hook on a conv, BatchNorm or ReLU inside a run (or a global module hook) would be passed by the fused
    node: the run's modules compute instead, and every hook fires as in torch's model."""
    net = cgt.convert(_net())
    block = net[9]  # a Bottleneck: three stages, block.relu used after each
    chain = _chain(net, "9")
    assert not chain._hooked()
    calls = []
    handles = [block.conv2.register_forward_hook(lambda *a: calls.append("conv2")),
               block.bn3.register_forward_pre_hook(lambda *a: calls.append("bn3")),
               block.relu.register_forward_hook(lambda *a: calls.append("relu"))]
    assert chain._hooked()
    net(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert calls == ["relu", "conv2", "relu", "bn3", "relu"]  # in the order torchvision's forward calls them
    for h in handles:
        h.remove()
    assert not chain._hooked()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert chain._hooked()
    finally:
        handle.remove()
    assert not chain._hooked()


def test_hooks_on_a_downsample_fire_and_keep_its_run_unfused():
    """A block whose downsample is its run's branch: hooks on the downsample Sequential or its modules fire
    (the run computes through its modules, the downsample called as torchvision's forward calls it)."""
    net = cgt.convert(_net())
    block = net[10]
    chain = _chain(net, "10")
    calls = []
    handles = [block.downsample.register_forward_hook(lambda *a: calls.append("downsample")),
               block.downsample[1].register_forward_hook(lambda *a: calls.append("downsample.1"))]
    assert chain._hooked()
    net(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert calls == ["downsample.1", "downsample"]
    for h in handles:
        h.remove()
    assert not chain._hooked()
    with pytest.raises(ValueError, match="residual"):
        chain(torch.randn(2, 16, 4, 4, dtype=torch.float64), torch.randn(2, 32, 2, 2, dtype=torch.float64))
    assert not block.forward.variants[0].holds((torch.randn(1),), {}) or True  # guards read, never raise


def test_modules_replaced_after_convert_are_the_ones_that_run():
    """A fused node holds the modules convert found; one replaced afterwards (SyncBatchNorm's converter, a
    new downsample, another activation) must be the one that computes: the owner's own forward runs then."""
    base = _net()
    ours = cgt.convert(copy.deepcopy(base))
    torch.manual_seed(7)
    new = {"ds": nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32)),
           "bn": nn.BatchNorm2d(4), "seq_bn": nn.BatchNorm2d(16), "act": nn.ELU()}
    for m in new.values():
        m.double()
        for p in m.parameters():
            nn.init.uniform_(p, 0.5, 1.5)
    for net in (base, ours):
        twin = {k: copy.deepcopy(v) for k, v in new.items()}
        net[10].downsample = twin["ds"]     # a Bottleneck whose downsample was its run's branch
        net[9].bn1 = twin["bn"]             # a stage of a block's run
        net[1] = twin["seq_bn"]             # a stage of a Sequential run
        net[11].relu = twin["act"]          # the activation a BasicBlock's run applies
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _same_step(ours, base, x)
    status = {where: chain.status() for where, chain in ours.cudnn_graphs_report.chains}
    assert all("replaced after convert" in status[w] for w in ("0", "9", "10", "11")), status
    fresh = cgt.convert(_net())
    for clone in (copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))):  # copies watch their own modules
        held = clone[10].forward.variants[0].held  # the rewritten forward's guard watches the copy's slots
        assert any(modules is clone[10]._modules and name == "downsample" for modules, name, _ in held)
        assert all(modules.get(name) is m for modules, name, m in held)
        assert all(modules.get(name) is m for modules, name, m in _chain(clone, "10").held)


def test_torch_func_transforms_run_the_modules():
    """torch.func.grad and functional_call through a converted model's replaced forwards give torch's gradients
    (on a GPU the runs compute through their modules there: the fused node has no functorch rules)."""
    net = _net()
    for m in net.modules():  # BatchNorm without running statistics: torch.func cannot mutate buffers
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    ours = cgt.convert(copy.deepcopy(net))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)

    def loss(model):
        params = dict(model.named_parameters())
        return torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().mean())(params)

    got, want = loss(ours), loss(net)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
