"""BatchNorm -> ReLU -> conv as one cuDNN graph in eval (pre-activation networks): outputs against float64
with fresh random running statistics and poisoned memory, the graph must have run (the BatchNorm module
never called), coefficients follow the running statistics, AMP, capture, declines, and torchvision's
DenseNet-121 end to end."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._preact import PreActivation  # noqa: E402

from .gpu_reference import rel_err  # noqa: E402
from .test_torch_preact import TinyDenseNet  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last
# Beyond twice torch's own float16 error against float64: cuDNN reads scale and shift as float16 (it
# declines float32 operands in the prologue), one more rounding of each per-channel coefficient.
SLACK = 2e-3


def _bn(c: int, seed: int) -> nn.BatchNorm2d:
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(c)
    bn.running_mean.copy_(torch.randn(c, generator=g))
    bn.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
    bn.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
    bn.bias.data.copy_(torch.randn(c, generator=g) * 0.5)
    return bn


def _site(c, k, r, stride=1, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    bn, relu = _bn(c, seed).eval(), nn.ReLU(inplace=True)
    conv = cgt.Conv2d(c, k, r, stride=stride, padding=r // 2, bias=False)
    for m in (bn, conv):
        m.cuda().to(dtype=dtype, memory_format=CL)
    return PreActivation(bn, relu, conv)


def _calibrated(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Running statistics of the model's own activations (random ones blow a deep net up in float16)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(x)
    return model.eval()


def _reference(site: PreActivation, x: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    bn, conv = copy.deepcopy(site.bn).to(dtype), copy.deepcopy(site.conv).to(dtype)
    with torch.no_grad():
        return nn.functional.conv2d(torch.relu(bn(x.to(dtype))), conv.weight.to(dtype), None, conv.stride,
                                    conv.padding)


def _poison():
    """Leave NaN in the caching allocator's free blocks, so an output the graph does not write shows."""
    junk = torch.full((1 << 26,), float("nan"), device="cuda", dtype=torch.float16)
    del junk


def _never_called(site: PreActivation):
    def fail(*_):
        raise AssertionError("the BatchNorm module ran: the graph did not")
    site.bn.forward = fail


@pytest.mark.parametrize("c,k,r,stride,hw", [(64, 32, 1, 1, 14), (32, 16, 3, 1, 14), (64, 32, 3, 2, 15),
                                              (128, 64, 1, 1, 7), (24, 8, 3, 1, 9)])
def test_fused_against_float64(c, k, r, stride, hw):
    site = _site(c, k, r, stride)
    x = torch.randn(4, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    ref = _reference(site, x)
    with torch.no_grad():
        torch_err = rel_err(site.conv(torch.relu(site.bn(x))).double(), ref)
    _never_called(site)
    for _ in range(3):  # direct, recorded, replayed
        _poison()
        with torch.no_grad():
            y = site(x)
        assert site.status() == "fused", site.status()
        assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL) and y.shape == ref.shape
        assert torch.isfinite(y).all()
        assert rel_err(y.double(), ref) <= 2 * torch_err + SLACK, (rel_err(y.double(), ref), torch_err)


def test_coefficients_follow_the_running_statistics():
    site = _site(32, 32, 1)
    x = torch.randn(2, 32, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    with torch.no_grad():
        first = site(x)
        site.bn.running_var.mul_(4.0)  # in place: a new version, as load_state_dict's copy_ makes
        site.bn.bias.data.add_(1.0)
        second = site(x)
    assert site.status() == "fused"
    assert rel_err(second.double(), _reference(site, x)) < SLACK
    assert rel_err(first.double(), second.double()) > 0.05


def test_amp_float32_module():
    site = _site(64, 32, 3, dtype=torch.float32)
    x = torch.randn(2, 64, 10, 10, device="cuda").contiguous(memory_format=CL)
    ref = _reference(site, x)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        y = site(x)
        theirs = site.conv(torch.relu(site.bn(x)))
    assert site.status() == "fused" and y.dtype == torch.float16
    assert rel_err(y.double(), ref) <= 2 * rel_err(theirs.double(), ref) + SLACK


def test_first_call_inside_a_capture_runs_the_modules():
    """Coefficients made inside a capture would hold values only once the graph replays: the first call
    there runs the modules (captured as they are); eager calls after it run the graph path."""
    site = _site(32, 16, 3)
    x = torch.randn(2, 32, 9, 9, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = site(x)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    ref = _reference(site, x)
    assert rel_err(out.double(), ref) < SLACK
    with torch.no_grad():
        eager = site(x)
    assert site.status() == "fused" and rel_err(eager.double(), ref) < SLACK


@pytest.mark.parametrize("why", ["float32", "contiguous", "grad", "train", "channels"])
def test_declined_calls_run_the_modules(why):
    c = 20 if why == "channels" else 32  # 20 channels of float16: rows cuDNN's prologue declines
    site = _site(c, 16, 3, dtype=torch.float32 if why == "float32" else torch.float16)
    dtype = site.conv.weight.dtype
    x = torch.randn(2, c, 9, 9, device="cuda", dtype=dtype)
    x = x if why == "contiguous" else x.contiguous(memory_format=CL)
    if why == "train":
        site.bn.train()
    ref = copy.deepcopy(site.bn), copy.deepcopy(site.conv)
    with torch.set_grad_enabled(why == "grad"):
        if why == "grad":
            x.requires_grad_(True)
        y = site(x)
        expect = ref[1](torch.relu(ref[0](x)))
    if why == "channels":  # fused where cuDNN takes 20 channels, else the modules: right either way
        assert rel_err(y.double(), _reference(site, x)) < SLACK + 2e-3, site.status()
    else:
        torch.testing.assert_close(y, expect, rtol=1e-3, atol=1e-3)
        assert site.status() != "fused"


def test_tiny_densenet_converted_and_captured():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, device="cuda")
    ref = _calibrated(TinyDenseNet(growth=16).cuda().double(), x.double()).half().to(memory_format=CL)
    model = cgt.convert(copy.deepcopy(ref), inference=True)
    x = x.half().contiguous(memory_format=CL)
    f64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        expect = f64(x.double())
        theirs = ref(x)
        eager = model(x)
        sites = model.cudnn_graphs_report.prologues
        assert sites and all(s.status() == "fused" for _, s in sites), str(model.cudnn_graphs_report)
        assert rel_err(eager.double(), expect) <= 2 * rel_err(theirs.double(), expect) + SLACK
        static = x.clone()
        model(static)  # warm on the capturing stream's pool: plans made before capture
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static)
            with torch.cuda.graph(graph):
                out = model(static)
        torch.cuda.current_stream().wait_stream(s)
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.testing.assert_close(out, model(static), rtol=0, atol=0)


def test_torchvision_densenet121():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64, device="cuda")
    f64 = _calibrated(torchvision.models.densenet121(weights=None).cuda().double(), x.double())
    ref = copy.deepcopy(f64).half().to(memory_format=CL)
    model = cgt.convert(copy.deepcopy(ref), inference=True)
    x = x.half().contiguous(memory_format=CL)
    with torch.no_grad():
        expect = f64(x.double())
        theirs, ours = ref(x), model(x)
    sites = model.cudnn_graphs_report.prologues
    assert len(sites) == 2 * 58 + 3, len(sites)
    assert all(s.status() == "fused" for _, s in sites), str(model.cudnn_graphs_report)
    assert rel_err(ours.double(), expect) <= 2 * rel_err(theirs.double(), expect) + SLACK
