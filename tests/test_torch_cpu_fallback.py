"""CPU: every error the library raises is importable from `cudnn_graphs`; the torch layer runs CPU tensors
through torch's own ops everywhere (`LinearAct` raised where `MLP`, `Conv2d` and `grid_sample` fell back),
with one warning per process (once per geometry said it 41 times for one mobilenet forward)."""

from __future__ import annotations

import logging
import sys

import pytest

import cudnn_graphs
from cudnn_graphs import errors

torch = pytest.importorskip("torch")

import cudnn_graphs.torch as cgt  # noqa: E402


def test_every_error_class_is_importable_from_the_package():
    classes = [name for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    assert "NoGpuError" in classes
    for name in classes:
        assert getattr(cudnn_graphs, name) is getattr(errors, name) and name in cudnn_graphs.__all__


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test starts with nothing said yet (another test may have run the same geometry)."""
    said = getattr(sys.modules.get("cudnn_graphs.torch._fallback"), "_said", set())
    said.clear()
    yield
    said.clear()


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8), (8,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "identity"])
def test_linear_act_on_cpu_tensors_is_torchs_linear_and_activation(shape, activation):
    torch.manual_seed(0)
    ours = cgt.LinearAct(8, 4, activation=activation).double()
    theirs = torch.nn.Linear(8, 4).double()
    theirs.load_state_dict(ours.state_dict())
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "identity": lambda t: t}[activation]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), act(theirs(x_ref))
    assert y.shape == y_ref.shape and torch.allclose(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.allclose(x.grad, x_ref.grad) and torch.allclose(ours.weight.grad, theirs.weight.grad)
    assert torch.allclose(ours.bias.grad, theirs.bias.grad)


def _cpu_calls():
    conv = cgt.Conv2d(3, 4, 3)
    linear = cgt.LinearAct(8, 4)
    mlp = cgt.MLP([8, 16, 4])
    return {
        "conv_fwd": lambda n: conv(torch.randn(n, 3, 8, 8)),
        "linear_act": lambda n: linear(torch.randn(n, 8)),
        "mlp": lambda n: mlp(torch.randn(n, 8)),
        "grid_sample": lambda n: cgt.grid_sample(torch.randn(n, 2, 5, 5), torch.rand(n, 3, 3, 2) * 2 - 1,
                                                 align_corners=False),
    }


@pytest.mark.parametrize("op", ["conv_fwd", "linear_act", "mlp", "grid_sample"])
def test_cpu_tensors_warn_once_per_process(caplog, op):
    calls = _cpu_calls()
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"):
        for batch in (2, 2, 2, 3, 3):
            calls[op](batch)
        for other in calls.values():  # other ops, other shapes: nothing more is said
            other(4)
    said = [r.getMessage() for r in caplog.records if "CPU tensors" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"cudnn_graphs: {op} ("), said
    assert "(2," in said[0]
