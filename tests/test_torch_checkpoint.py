"""CPU: checkpoints round-trip between a torch model and its converted twin (strict state_dict, optimizer
state), an optimizer made before `convert` keeps stepping the model, and converting twice is a no-op."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import cudnn_graphs.torch as cgt  # noqa: E402

from .test_torch_chain import _net  # noqa: E402  (convs, BatchNorm runs, Bottleneck and BasicBlock bodies)


def _fresh(seed: int) -> nn.Module:
    net = _net()
    torch.manual_seed(seed)  # other weights than _net's: a load must overwrite every one of them
    with torch.no_grad():
        for p in net.parameters():
            p.uniform_(-0.3, 0.3)
    return net


def _x(seed: int = 5) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _saved(obj) -> dict:
    """`obj` through torch.save / torch.load(weights_only=True), as a checkpoint file goes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    losses = []
    for i in range(steps):
        loss = net(_x(seed + i)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=1e-12, atol=1e-12, msg=name)


def test_torch_state_dict_loads_into_the_converted_model_and_back_strictly():
    theirs = _net()
    ours = cgt.convert(_fresh(1))
    assert ours.cudnn_graphs_report.chains  # fused runs hold no state of their own: keys are torch's
    ours.load_state_dict(_saved(theirs.state_dict()), strict=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for mode in (True, False):
        theirs.train(mode), ours.train(mode)
        torch.testing.assert_close(ours(_x()), theirs(_x()))
    back = _fresh(2)
    back.load_state_dict(_saved(ours.state_dict()), strict=True)
    _same_state(back, theirs)


def test_an_optimizer_made_before_convert_keeps_stepping_the_converted_model():
    theirs = _net()
    ours = copy.deepcopy(theirs)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    cgt.convert(ours)  # after the optimizer: the Parameter objects it holds are the model's still
    assert [id(p) for p in opt_ours.param_groups[0]["params"]] == [id(p) for p in ours.parameters()]
    torch.testing.assert_close(_train(ours, opt_ours, 3, seed=10), _train(theirs, opt_theirs, 3, seed=10))
    _same_state(ours, theirs)  # parameters stepped, BatchNorm statistics and counters updated alike


@pytest.mark.parametrize("convert_first", [False, True], ids=["torch-to-ours", "ours-to-torch"])
def test_model_and_optimizer_checkpoints_resume_across_conversion(convert_first):
    source = _net()
    if convert_first:
        cgt.convert(source)
    opt = torch.optim.Adam(source.parameters(), lr=1e-2)
    _train(source, opt, 2, seed=20)
    checkpoint = _saved({"model": source.state_dict(), "optimizer": opt.state_dict()})

    resumed = _fresh(3)
    if not convert_first:
        cgt.convert(resumed)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(checkpoint["model"], strict=True)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert all(s["step"].item() == 2 for s in resumed_opt.state.values())  # Adam's moments came along
    torch.testing.assert_close(_train(resumed, resumed_opt, 2, seed=30), _train(source, opt, 2, seed=30))
    _same_state(resumed, source)


@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference"])
def test_converting_a_converted_model_again_is_a_no_op(inference):
    net = _net().train(not inference)
    cgt.convert(net, inference=inference)
    report, modules, keys = net.cudnn_graphs_report, list(net.modules()), list(net.state_dict())
    want = net(_x())
    again = [inference] if not inference else [True, False]  # a folded model: either kind of call
    for kind in again:
        assert cgt.convert(net, inference=kind) is net
    assert net.cudnn_graphs_report is report and report.replaced and report.inference == inference
    assert list(net.modules()) == modules and list(net.state_dict()) == keys
    torch.testing.assert_close(net(_x()), want)


def test_a_training_converted_model_converted_again_keeps_its_report():
    net = cgt.convert(_net())
    report = net.cudnn_graphs_report
    assert cgt.convert(net, fuse_batchnorm=False) is net and net.cudnn_graphs_report is report
    assert not report.inference and cgt.convert(_net().eval(), inference=True).cudnn_graphs_report.inference
