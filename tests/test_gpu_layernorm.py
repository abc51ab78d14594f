"""The LayerNorm kernel against float64 over row widths, dtypes, alignments and optional operands, with the
memory it writes poisoned first; converted LayerNorm / LayerNorm2d / ConvNeXt blocks against torch's modules
(the kernel must have run), parameters changed after a call, a gradient wanted, capture, and torchvision's
convnext_tiny end to end."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch import _cnblock_train, _layernorm  # noqa: E402
from fallback_kernels import layernorm  # noqa: E402

from .gpu_reference import rel_err  # noqa: E402
from .test_torch_layernorm import CNBlock, tiny_convnext  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6}


def _poison(like: torch.Tensor) -> None:
    """Fill the allocator's next block of this size with NaN: a result left unwritten shows."""
    torch.empty_like(like).fill_(float("nan"))


def _reference(x, weight, bias, eps, add=None):
    v = x.double() + (0 if add is None else add.double())
    return F.layer_norm(v, v.shape[-1:], None if weight is None else weight.double(),
                        None if bias is None else bias.double(), eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c", [1, 3, 8, 24, 96, 100, 192, 300, 384, 768, 1000, 2048])
def test_the_kernel_matches_float64(dtype, c):
    torch.manual_seed(c)
    rows = 333
    x = (torch.randn(rows, c, device="cuda", dtype=torch.float64) * 3 + 5).to(dtype)  # a mean far from 0
    w = (torch.rand(c, device="cuda") + 0.5).to(dtype)
    b = torch.randn(c, device="cuda").to(dtype)
    add = torch.randn(c, device="cuda").to(dtype)
    if layernorm.layout(c, str(dtype).removeprefix("torch."), align=16) is None:  # wider than a warp holds
        assert _layernorm.layer_norm_rows(x, w, b, 1e-5) is None
        return
    for weight, bias, extra in ((w, b, None), (None, None, None), (w, None, add), (None, b, add)):
        _poison(x)
        got = _layernorm.layer_norm_rows(x, weight, bias, 1e-5, add=extra)
        assert got is not None and got.dtype == dtype and got.shape == x.shape and torch.isfinite(got).all()
        want = _reference(x, weight, bias, 1e-5, extra)
        if c == 1:  # one value a row normalises to 0: zeros or the bias, no relative error to take
            assert torch.allclose(got.double(), want, atol=TOL[dtype])
        else:
            assert rel_err(got, want) < TOL[dtype], (weight is None, bias is None, extra is None)


def test_rows_too_wide_and_views_that_are_not_rows_are_declined():
    x = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    assert _layernorm.layer_norm_rows(x, None, None, 1e-5) is None  # wider than a warp holds
    y = torch.randn(8, 96, device="cuda", dtype=torch.float16)
    assert _layernorm.layer_norm_rows(y.t(), None, None, 1e-5) is None  # not contiguous
    assert _layernorm.layer_norm_rows(y, torch.ones(96, device="cuda", dtype=torch.bfloat16), None, 1e-5) is None
    assert _layernorm.layer_norm_rows(y, torch.ones(96, device="cuda", dtype=torch.float64), None, 1e-5) is None


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_misaligned_views_use_narrower_vectors(offset):
    torch.manual_seed(offset)
    flat = torch.randn(offset + 50 * 96, device="cuda", dtype=torch.float16)
    x = flat[offset:].view(50, 96)
    w = torch.rand(96, device="cuda", dtype=torch.float16) + 0.5
    got = _layernorm.layer_norm_rows(x, w, None, 1e-6)
    assert rel_err(got, _reference(x, w, None, 1e-6)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_converted_layernorms_match_torchs_and_run_the_kernel(dtype, monkeypatch):
    torch.manual_seed(0)
    ln, ln2d = nn.LayerNorm(192, eps=1e-6), tiny_convnext(dim=64)[1]
    for m in (ln, ln2d):
        m.weight.data.uniform_(0.5, 1.5)
        m.bias.data.normal_()
    ours = cgt.convert(nn.Sequential(copy.deepcopy(ln), copy.deepcopy(ln2d))).to("cuda", dtype).eval()
    ln, ln2d = ln.to("cuda", dtype), ln2d.to("cuda", dtype)
    calls = []  # the kernel's runs (a declined call returns None)
    real = _layernorm.layer_norm_rows

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.extend([] if out is None else [1])
        return out

    monkeypatch.setattr(_layernorm, "layer_norm_rows", counted)
    x = torch.randn(4, 7, 192, device="cuda", dtype=dtype)
    m = torch.randn(3, 64, 9, 11, device="cuda", dtype=dtype).to(memory_format=CL)
    with torch.no_grad():
        assert rel_err(ours[0](x), ln(x)) < TOL[dtype]
        y = ours[1](m)
        assert rel_err(y, ln2d(m)) < TOL[dtype] and y.is_contiguous(memory_format=CL)
        assert len(calls) == 2
        assert torch.equal(ours[1](m.contiguous()), ln2d(m.contiguous()))  # NCHW in memory: torch's forward
        assert len(calls) == 2
    x.requires_grad_()
    ours[0](x).sum().backward()  # a gradient wanted: torch's forward and backward
    assert x.grad is not None and len(calls) == 2
    with torch.autocast("cuda", dtype=torch.float16), torch.no_grad():  # torch's float32 LayerNorm there
        assert ours[0](x).dtype == torch.float32 and len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k,n,offset", [(3136, 384, 96, 0), (100, 40, 24, 0), (77, 64, 32, 8)])
def test_a_cublaslt_gemm_reads_a_residual_in_its_epilogue(dtype, rows, k, n, offset):
    from fallback_kernels import cublaslt

    torch.manual_seed(rows)
    a = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    r = torch.randn(rows * n + offset, device="cuda").to(dtype)[offset:].view(rows, n)  # a view: less aligned
    d = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    plan = cublaslt.lt_gemm(cublaslt.Geometry(0, name, rows, n, k, ("row", k), ("col", k), n, "BIAS",
                                              align=(256, 256, min(256, cublaslt.alignment(r.data_ptr())))))
    ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device="cuda")
    plan.run(a=a.data_ptr(), b=w.data_ptr(), d=d.data_ptr(), c=r.data_ptr(), bias=b.data_ptr(),
             stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr())
    want = F.linear(a.double(), w.double(), b.double()) + r.double()
    assert rel_err(d, want) < 2 * TOL[dtype] + (1e-5 if dtype == torch.float32 else 0)


def _block(dim, dtype, seed=0):
    torch.manual_seed(seed)
    block = CNBlock(dim, layer_scale=0.5)
    for p in block.parameters():
        p.data.add_(torch.randn_like(p) * 0.2)
    return block.to("cuda", dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim,hw", [(96, 14), (40, 9), (8, 5)])
def test_a_converted_convnext_block_matches_torch_against_float64(dtype, dim, hw, monkeypatch):
    block = _block(dim, dtype)
    ours = cgt.convert(nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
    assert ours.cudnn_graphs_report.convnext_blocks == ["0"]
    ref = copy.deepcopy(block).double()
    fused = []  # the block's own launches ran
    real = _layernorm._BlockLaunches.__call__
    monkeypatch.setattr(_layernorm._BlockLaunches, "__call__", lambda *a: fused.append(True) or real(*a))
    x = torch.randn(4, dim, hw, hw + 2, device="cuda", dtype=dtype).to(memory_format=CL)
    _poison(x)
    with torch.no_grad():
        got, theirs, want = ours(x), block(x), ref(x.double())
    assert got.dtype == dtype and got.is_contiguous(memory_format=CL) and fused == [True]
    tol = 4 * rel_err(theirs, want) + TOL[dtype]  # the same roundings as torch's, in another order
    assert rel_err(got, want) < tol


def test_a_convnext_block_follows_its_parameters_and_takes_torchs_path_where_it_must():
    block = _block(64, torch.float16)
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
    x = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.float16).to(memory_format=CL)
    with torch.no_grad():
        first = model(x)
        for m in (model[0], block):  # an optimizer step's in-place update of the scale and fc2
            m.layer_scale.mul_(-2)
            m.block[5].weight.add_(0.01)
        second, want = model(x), block(x)
    assert not torch.allclose(first, second)
    assert rel_err(second, want) < 4e-3
    with torch.no_grad():  # NCHW in memory: the block's own forward (its converted conv and LayerNorm modules)
        assert rel_err(model(x.contiguous()), block(x.contiguous())) < 4e-3
    y = model(x.requires_grad_())  # a gradient wanted: torch's forward, whose backward runs
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_captured_convnext_block_replays_with_fresh_inputs(monkeypatch):
    model = cgt.convert(nn.Sequential(_block(96, torch.float16)).eval(), inference=True)
    fused = []
    real = _layernorm._BlockLaunches.__call__
    monkeypatch.setattr(_layernorm._BlockLaunches, "__call__",
                        lambda *a: fused.append(torch.cuda.is_current_stream_capturing()) or real(*a))
    static = torch.randn(2, 96, 14, 14, device="cuda", dtype=torch.float16).to(memory_format=CL)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            model(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    assert fused[-1] is True  # the block's own launches are in the graph
    for seed in range(3):
        torch.manual_seed(seed)
        static.copy_(torch.randn_like(static))
        graph.replay()
        with torch.no_grad():
            assert torch.equal(out, model(static))
    before = out.clone()
    with torch.no_grad():  # new weights: the eager path folds them again; the graph keeps its capture's, alive
        model[0].block[5].weight.mul_(2)
        changed = model(static)
    torch.cuda.synchronize()
    for _ in range(3):
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(255)  # reuse any freed block
    graph.replay()
    assert torch.equal(out, before) and not torch.equal(changed, before)


def test_torchvision_convnext_tiny_inference_matches_torch():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    base = torchvision.models.convnext_tiny().eval()
    for p in base.parameters():  # weights=None leaves the layer scale at 1e-6: blocks would add nothing
        p.data.add_(torch.randn_like(p) * 0.02)
    ref = copy.deepcopy(base).cuda().double()
    torch_model = copy.deepcopy(base).cuda().half().to(memory_format=CL)
    ours = cgt.convert(copy.deepcopy(torch_model), inference=True)
    report = ours.cudnn_graphs_report
    assert len(report.convnext_blocks) == 18 and len(report.layer_norms) == 18 + 5
    x = torch.randn(4, 3, 128, 128, device="cuda")
    with torch.no_grad():
        want = ref(x.double())
        theirs = torch_model(x.half().to(memory_format=CL))
        got = ours(x.half().to(memory_format=CL))
    assert rel_err(got, want) < 2 * rel_err(theirs, want) + 1e-3


# -- training: the LayerNorm's autograd node, the block's training path -------------------------------------

@pytest.mark.parametrize("dtype,pdtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
@pytest.mark.parametrize("c", [8, 96, 100, 128, 384, 512, 768])
def test_the_autograd_layernorm_matches_float64_and_sums_its_parameters_deterministically(dtype, pdtype, c):
    torch.manual_seed(c)
    rows = 1000
    x = (torch.randn(rows, c, device="cuda", dtype=torch.float64) * 2 + 3).to(dtype).requires_grad_()
    w = (torch.rand(c, device="cuda", dtype=torch.float64) + 0.5).to(pdtype).requires_grad_()
    b = torch.randn(c, device="cuda", dtype=torch.float64).to(pdtype).requires_grad_()
    dy = torch.randn(rows, c, device="cuda").to(dtype)
    if layernorm.layout(c, str(dtype).removeprefix("torch."), align=16, backward=True) is None:
        assert _layernorm.layer_norm_autograd(x, w, b, 1e-5) is None  # wider than the backward holds: torch's
        return
    grads = []
    for _ in range(2):
        y = _layernorm.layer_norm_autograd(x, w, b, 1e-5)
        assert y is not None and y.dtype == dtype
        grads.append(torch.autograd.grad(y, (x, w, b), dy))
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = F.layer_norm(ref_in[0], (c,), ref_in[1], ref_in[2], 1e-5)
    want = torch.autograd.grad(ref, ref_in, dy.double())
    tol = TOL[dtype] * 4
    assert rel_err(y, ref) < tol
    for got, expected, name in zip(grads[0], want, ("dx", "dgamma", "dbeta")):
        assert got.dtype == (dtype if name == "dx" else pdtype)
        assert rel_err(got, expected) < tol, name
    for first, second in zip(*grads):
        assert torch.equal(first, second)  # the parameters' sums in a fixed order


def test_the_autograd_layernorm_declines_rows_the_backward_cannot_hold():
    x = torch.randn(8, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
    assert _layernorm.layer_norm_autograd(x, None, None, 1e-5) is None


@pytest.mark.parametrize("amp", [True, False])
def test_a_captured_convnext_block_trains_as_torchs_with_our_layernorm(amp, monkeypatch):
    dtype = torch.float32 if amp else torch.float16
    block = _block(96, dtype).train()
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    ref = copy.deepcopy(block).double()
    ran = []
    for cls, tag in ((_layernorm.LayerNormFunction, "ln"), (_cnblock_train.CNBlockFunction, "node")):
        monkeypatch.setattr(cls, "forward", staticmethod(lambda *a, _r=cls.forward, _t=tag: ran.append(_t) or _r(*a)))
    x = torch.randn(4, 96, 14, 14, device="cuda", dtype=dtype).to(memory_format=CL)
    dy = torch.randn(4, 96, 14, 14, device="cuda", dtype=torch.float32 if amp else dtype).to(memory_format=CL)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        model(x.detach().clone().requires_grad_())  # eager: AMP's whole-block node, else torch's LayerNorm
        assert ran == (["node"] if amp else [])
        captured = cgt.capture(model, x.detach().clone().requires_grad_())
    assert set(ran) == ({"node"} if amp else {"ln"})  # the capture ran ours
    results = []
    for step in (captured, block):
        xi = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = step(xi)
        params = list((model if step is captured else block).parameters())
        grads = torch.autograd.grad(out, (xi, *params), dy.to(out.dtype))
        results.append((out.clone(), grads))
    xd = x.detach().double().requires_grad_()
    out = ref(xd)
    want = (out, torch.autograd.grad(out, (xd, *ref.parameters()), dy.double()))
    (got, got_g), (theirs, theirs_g) = results
    assert got.dtype == theirs.dtype
    assert rel_err(got, want[0]) < 2 * rel_err(theirs, want[0]) + 1e-3
    for g, t, w in zip(got_g, theirs_g, want[1]):
        assert rel_err(g, w) < 2 * rel_err(t, w) + 2e-3


def test_the_autograd_layernorm_takes_a_gradient_that_starts_anywhere():
    torch.manual_seed(3)
    x = torch.randn(50, 96, device="cuda", dtype=torch.float16, requires_grad=True)
    w = (torch.rand(96, device="cuda") + 0.5).requires_grad_()
    y = _layernorm.layer_norm_autograd(x, w, None, 1e-5)
    head = torch.zeros(3, device="cuda", dtype=torch.float16)
    weights = torch.randn(3 + y.numel(), device="cuda", dtype=torch.float16)
    (torch.cat([head, y.flatten()]) * weights).float().sum().backward()  # y's gradient: a view 6 bytes in
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (F.layer_norm(xd, (96,), wd, None, 1e-5).flatten() * weights[3:].double()).sum().backward()
    assert rel_err(x.grad, xd.grad) < 8e-3 and rel_err(w.grad, wd.grad) < 8e-3


def test_blocks_alike_but_for_their_activations_parameter_keep_their_own_launches():
    outs = []
    for slope in (0.1, 0.3):
        block = _block(32, torch.float16)
        block.block[4] = nn.LeakyReLU(slope)
        model = cgt.convert(nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
        assert model.cudnn_graphs_report.convnext_blocks == ["0"]
        x = torch.randn(2, 32, 9, 9, device="cuda", dtype=torch.float16).to(memory_format=CL)
        with torch.no_grad():
            got, want = model(x), copy.deepcopy(block).double()(x.double())
        outs.append(rel_err(got, want))
    assert max(outs) < 4e-3


def test_float32_parameters_aligned_to_16_bytes_only_take_narrower_vectors():
    torch.manual_seed(5)
    x = torch.randn(300, 96, device="cuda", dtype=torch.float16, requires_grad=True)
    store = (torch.rand(2 * 96 + 4, device="cuda") + 0.5)
    w = store[4:100].detach().requires_grad_()  # 16 bytes in: a float32 vector of 8 would need 32
    b = store[100:196].detach().requires_grad_()
    assert w.data_ptr() % 32 == 16
    y = _layernorm.layer_norm_autograd(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = F.layer_norm(ref_in[0], (96,), ref_in[1], ref_in[2], 1e-5)
    want = torch.autograd.grad(ref, ref_in, dy.double())
    assert rel_err(y, ref) < 8e-3
    for got, expected in zip(grads, want):
        assert rel_err(got, expected) < 8e-3


def test_a_block_with_a_transposed_weight_takes_torchs_path():
    block = _block(32, torch.float16)
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
    w = model[0].block[3].weight
    model[0].block[3].weight = nn.Parameter(w.detach().t().contiguous().t())  # same values, column-major
    assert not model[0].block[3].weight.is_contiguous()
    x = torch.randn(2, 32, 9, 9, device="cuda", dtype=torch.float16).to(memory_format=CL)
    with torch.no_grad():
        assert _layernorm._convnext_block(model[0], x) is None
        assert rel_err(model(x), block(x)) < 4e-3


def test_the_eval_blocks_replayed_launches_follow_fresh_pointers():
    block = _block(96, torch.float16)
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)).eval(), inference=True)
    for seed in range(4):
        torch.manual_seed(seed)
        keep = torch.empty(seed * 4096 + 1, device="cuda")  # noqa: F841 - shifts the allocator's next addresses
        x = torch.randn(2, 96, 14, 14, device="cuda", dtype=torch.float16).to(memory_format=CL)
        with torch.no_grad():
            assert rel_err(model(x), block(x)) < 4e-3
    launches = [v for v in _layernorm._blocks.values() if v is not None and v.geometry == (392, 96, 384, "float16")]
    assert launches and sum(r.replays for r in launches[0].replays.values()) >= 2
