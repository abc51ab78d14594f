"""Squeeze-excitation's scale (`cudnn_graphs/torch/_se.py`, `fallback_kernels/se_scale.cu`) without a GPU: the
kernels compile through NVRTC, the backward's grid, which modules convert and that CPU calls keep torch's
product, state_dict and deepcopy."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch import _se  # noqa: E402
from fallback_kernels import compile as kc  # noqa: E402
from fallback_kernels import se_scale  # noqa: E402


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation's code, under its module name (the CPU box has no torchvision)."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = nn.ReLU(), nn.Sigmoid()

    def _scale(self, x):
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))

    def forward(self, x):
        return self._scale(x) * x


SqueezeExcitation.__module__ = "torchvision.ops.misc"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.se = SqueezeExcitation(16, 4)
        self.head = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        return self.head(self.se(torch.relu(self.conv(x))))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_kernels_compile_without_spills(arch):
    found = kc.ptxas_resources("se_scale.cu", se_scale.name_expressions(), arch)
    assert set(found) == set(se_scale.name_expressions())
    assert all(r.get("stack_bytes", 0) == 0 and r.get("spill_stores", 0) == 0 for r in found.values()), found


def test_supported_rows_are_whole_16_byte_vectors():
    assert se_scale.supported(96, "float16") and se_scale.supported(4, "float32")
    assert not se_scale.supported(12, "float16") and not se_scale.supported(6, "float32")
    assert not se_scale.supported(96, "float64") and not se_scale.supported(0, "float16")
    with pytest.raises(ValueError, match="channels: 12 float16"):
        se_scale.SeScale(2, 4, 12, "float16", 0)


@pytest.mark.parametrize("samples, rows, channels, dtype, sms, want", [
    (64, 112 * 112, 96, "float16", 132, (1, 9, 64, 1394)),  # efficientnet_b0's first SE at batch 64, an H100
    (64, 49, 1152, "float16", 132, (1, 9, 64, 6)),  # its last: 144 vectors a row, one row at a time
    (2, 5, 4096, "float16", 132, (2, 5, 2, 1)),  # 512 vectors: two column chunks; never more splits than rows
    (1, 3, 8, "float32", 132, (1, 1, 1, 3)),  # 2 vectors a row, 128 rows at a time: one split holds them all
])
def test_the_backward_grid_covers_every_row_once(samples, rows, channels, dtype, sms, want):
    chunks, splits, n, per_split = se_scale.backward_grid(samples, rows, channels, dtype, sms)
    assert (chunks, splits, n, per_split) == want
    assert (splits - 1) * per_split < rows <= splits * per_split  # no empty split, none missing
    assert chunks * se_scale.THREADS >= channels // se_scale.vec(dtype)


def test_convert_points_squeeze_excitation_here_and_cpu_calls_keep_torchs_product():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    want = net(x)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    keys = list(net.state_dict())
    cgt.convert(net)
    assert net.cudnn_graphs_report.squeeze_excitations == ["se"]
    assert "1 squeeze-excitation scales" in str(net.cudnn_graphs_report) and "captures" in str(net.cudnn_graphs_report)
    assert list(net.state_dict()) == keys
    net.zero_grad()
    x.grad = None
    got = net(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    for g, w in zip([p.grad for p in net.parameters()] + [x.grad], want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(net)(x), want)  # pickling: the GPU test's real torchvision class


def test_only_torchvisions_class_with_its_own_forward_is_taken():
    plain = SqueezeExcitation(8, 2)
    assert _se.squeeze_excitation(plain)
    plain.forward = lambda x: x  # its owner's forward: left alone
    assert not _se.squeeze_excitation(plain)

    class Mine(SqueezeExcitation):
        pass

    Mine.__module__ = "mine"
    assert not _se.squeeze_excitation(Mine(8, 2))


def test_calls_our_kernels_do_not_take_run_torchs_product():
    x, s = torch.randn(2, 16, 4, 4), torch.rand(2, 16, 1, 1)
    assert _se.se_scale(x, s) is None  # CPU
    assert _se._launcher(x.half(), s) is None  # dtypes differ (and CPU)
