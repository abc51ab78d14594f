"""Squeeze-excitation's scale on our kernels (GPU): the forward and dx bit-identical to torch's products, ds
against float64 at least as close as torch's and the same bits run to run, every gradient combination, odd
gradient layouts, and torchvision's SE models converted: a training step and a loss curve against torch's."""

from __future__ import annotations

import copy
import io

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from cudnn_graphs.torch import _se  # noqa: E402
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

CL = torch.channels_last


def _inputs(n, c, h, w, dtype, *, grad=(True, True)):
    x = torch.randn(n, c, h, w, device="cuda").to(dtype).contiguous(memory_format=CL).requires_grad_(grad[0])
    s = torch.rand(n, c, 1, 1, device="cuda").to(dtype).contiguous(memory_format=CL).requires_grad_(grad[1])
    return x, s


def _err(got, want64):
    return float((got.double() - want64).norm() / want64.norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8, 3, 5), (3, 96, 17, 19), (64, 1152, 7, 7), (2, 4096, 5, 3)])
def test_forward_and_dx_are_torchs_bits_and_ds_is_as_close_to_float64(dtype, shape):
    torch.manual_seed(sum(shape))
    x, s = _inputs(*shape, dtype)
    assert _se._launcher(x, s) is not None
    out = _se.se_scale(x, s)
    want = s * x
    assert torch.equal(out, want) and out.is_contiguous(memory_format=CL)
    dy = torch.randn_like(out)
    dx, ds = torch.autograd.grad(out, (x, s), dy)
    tdx, tds = torch.autograd.grad(want, (x, s), dy)
    assert torch.equal(dx, tdx)
    ds64 = (dy.double() * x.double()).sum((2, 3), keepdim=True)
    assert _err(ds, ds64) <= max(_err(tds, ds64), 1e-6), (_err(ds, ds64), _err(tds, ds64))
    again = [torch.autograd.grad(_se.se_scale(x, s), s, dy)[0] for _ in range(3)]
    assert all(torch.equal(a, ds) for a in again)


def test_each_gradient_alone_and_an_expanded_gradient():
    torch.manual_seed(1)
    for grad in ((True, False), (False, True)):
        x, s = _inputs(4, 64, 9, 9, torch.float16, grad=grad)
        out = _se.se_scale(x, s)
        want = s * x
        wanted = [t for t in (x, s) if t.requires_grad]
        for g, w in zip(torch.autograd.grad(out.sum(), wanted), torch.autograd.grad(want.sum(), wanted)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=2e-3, atol=1e-2)  # out.sum()'s gradient: an expanded one
    x, s = _inputs(4, 64, 9, 9, torch.float16)
    dy = torch.randn(4, 9, 9, 64, device="cuda").half().permute(0, 3, 1, 2)[:, :, 1:, :]  # a channels-last view
    out = _se.se_scale(x[:, :, 1:, :].contiguous(memory_format=CL), s)
    dx = torch.autograd.grad(out, x, dy)[0]
    assert torch.equal(dx[:, :, 1:], (dy * s).detach()) and not dx[:, :, :1].any()


def test_calls_outside_the_kernels_reach_torch():
    x, s = _inputs(2, 12, 4, 4, torch.float16)  # 12 channels: not whole 16-byte vectors
    assert _se._launcher(x, s) is None
    x, s = _inputs(2, 16, 4, 4, torch.float16)
    assert _se._launcher(x.contiguous(), s) is None  # NCHW
    assert _se._launcher(x, s.float()) is None
    assert _se._launcher(x[:, :, :, 1:], s) is None  # not dense channels-last


def _train(forward, params, x, y, steps):
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(forward(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _se_grads(forward, model, x, y):
    """One step's gradients of every SE module's parameters (then cleared)."""
    with torch.autocast("cuda", dtype=torch.float16):
        torch.nn.functional.cross_entropy(forward(x).float(), y).backward()
    grads = [p.grad.clone() for m in model.modules() if type(m).__name__ == "SqueezeExcitation"
             for p in m.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("name", ["efficientnet_b0", "mobilenet_v3_small", "regnet_y_400mf"])
def test_captured_se_models_train_like_torch(name, monkeypatch):
    """Inside `capture` the SE scales run on our node (eager steps keep torch's product): a captured step's
    SE gradients match torch's eager ones, the captured steps' losses track torch's on a fixed batch, and the
    model pickles with its replaced forwards. Dropout and stochastic depth off: the captured steps draw other
    random masks than the eager ones."""
    tv = pytest.importorskip("torchvision")
    import cudnn_graphs.torch as cgt

    calls = []
    real = _se.SeScaleFunction.apply
    monkeypatch.setattr(_se.SeScaleFunction, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(3)
    base = getattr(tv.models, name)(num_classes=10).cuda().to(memory_format=CL)
    for m in base.modules():
        if type(m).__name__ in ("Dropout", "StochasticDepth"):
            m.p = 0.0
    ours = cgt.convert(copy.deepcopy(base))
    assert ours.cudnn_graphs_report.squeeze_excitations, name
    x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=CL)
    y = torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        step = cgt.capture(ours, (x.clone(),))
    assert calls, "no SE scale ran on our node inside the capture"
    for g, w in zip(_se_grads(step, ours, x, y), _se_grads(base, base, x, y)):
        assert _err(g.float(), w.double()) <= 2e-2, (_err(g.float(), w.double()), g.shape)
    want = _train(base, base.parameters(), x, y, 8)
    got = _train(step, ours.parameters(), x, y, 8)
    assert want[-1] < want[0] and got[-1] < got[0], (got, want)
    # the first step to float16 rounding; after it, ds's float32 sums (torch sums float16 products) move the
    # weights a little differently each step
    assert abs(got[0] - want[0]) <= 1e-3 * abs(want[0]), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 5e-2 * max(1.0, abs(b)), (got, want)
    buf = io.BytesIO()
    torch.save(ours, buf)  # the replaced forwards pickle with the module
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        torch.testing.assert_close(loaded.eval()(x), ours.eval()(x))
