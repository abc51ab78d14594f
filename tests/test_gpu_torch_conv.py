"""GPU: cudnn_graphs.torch's Conv1d/2d/3d against torch.nn.Conv* (forward and every gradient, against a
float64 reference), gradcheck, opcheck, torch.compile, CUDA-graph capture, autocast, determinism."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch import _conv  # noqa: E402

from . import gpu_reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}
OURS = {1: cgt.Conv1d, 2: cgt.Conv2d, 3: cgt.Conv3d}
THEIRS = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 is compared at 1e-5
    yield
    torch.backends.cudnn.allow_tf32 = saved


def _pair(nd, cin, cout, k, dtype, channels_last, *, spatial=None, batch=3, **kwargs):
    """Our module in `dtype` and torch's in float64 with the same (dtype-rounded) state, and an input
    for each: the reference sees exactly the values ours does."""
    theirs = THEIRS[nd](cin, cout, k, **kwargs).to("cuda", torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(p.to(dtype).double())
    ours = OURS[nd](cin, cout, k, **kwargs).to("cuda", dtype)
    ours.load_state_dict({name: t.to(dtype) for name, t in theirs.state_dict().items()})
    spatial = spatial or {1: (19,), 2: (11, 13), 3: (7, 6, 5)}[nd]
    x_ours = torch.randn(batch, cin, *spatial, device="cuda", dtype=torch.float64).to(dtype)
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(nd) if channels_last else None
    if fmt is not None:
        x_ours, ours = x_ours.contiguous(memory_format=fmt), ours.to(memory_format=fmt)
    return ours, theirs, x_ours, x_ours.double()


def _check(ours, theirs, x_ours, x, dtype):
    x_ours = x_ours.detach().requires_grad_(True)
    x = x.detach().requires_grad_(True)
    y = ours(x_ours)
    want = theirs(x)
    assert not _conv._declined, "a case ran through torch's convolution, not ours"
    assert y.dtype == dtype and y.shape == want.shape
    assert ref.rel_err(y, want) < TOL[dtype], "forward"
    gy = torch.randn_like(want).to(dtype)
    y.backward(gy)
    want.backward(gy.double())
    assert ref.rel_err(x_ours.grad, x.grad) < TOL[dtype], "input gradient"
    assert ref.rel_err(ours.weight.grad, theirs.weight.grad) < TOL[dtype], "weight gradient"
    if theirs.bias is not None:
        assert ref.rel_err(ours.bias.grad, theirs.bias.grad) < TOL[dtype], "bias gradient"


CASES = [
    dict(nd=2, cin=8, cout=16, k=3, padding=1),
    dict(nd=2, cin=8, cout=16, k=3, padding=1, bias=False),
    dict(nd=2, cin=8, cout=16, k=3, stride=2, padding=(1, 0)),
    dict(nd=2, cin=8, cout=8, k=3, padding="same", dilation=2),
    dict(nd=2, cin=8, cout=8, k=4, padding="same"),  # even kernel: torch pads the odd element after
    dict(nd=2, cin=8, cout=16, k=3, padding="valid", groups=4),
    dict(nd=2, cin=16, cout=16, k=3, padding=1, groups=16),  # depthwise
    dict(nd=2, cin=8, cout=16, k=1),
    dict(nd=2, cin=8, cout=8, k=3, padding=1, padding_mode="reflect"),
    dict(nd=2, cin=8, cout=8, k=3, padding=2, padding_mode="replicate"),
    dict(nd=2, cin=8, cout=8, k=3, padding=1, padding_mode="circular"),
    dict(nd=1, cin=8, cout=16, k=5, padding=2, stride=2),
    dict(nd=3, cin=4, cout=8, k=3, padding=1),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_modules_match_torch(case, dtype):
    case = dict(case)
    nd, cin, cout, k = case.pop("nd"), case.pop("cin"), case.pop("cout"), case.pop("k")
    ours, theirs, x_ours, x = _pair(nd, cin, cout, k, dtype, channels_last=True, **case)
    _check(ours, theirs, x_ours, x, dtype)


@pytest.mark.parametrize("channels_last", [False, True])
def test_float64_and_both_layouts(channels_last):
    ours, theirs, x_ours, x = _pair(2, 6, 10, 3, torch.float64, channels_last, padding=1, stride=(1, 2))
    _check(ours, theirs, x_ours, x, torch.float64)


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", ("leaky_relu", 0.2), "sigmoid", "tanh", ("elu", 0.5)])
def test_fused_activation_and_residual_forward_and_gradients(act):
    dtype = torch.float32
    conv = cgt.Conv2d(8, 8, 3, padding=1, activation=act).to("cuda")
    w = conv.weight.detach().double().requires_grad_(True)
    b = conv.bias.detach().double().requires_grad_(True)
    x = torch.randn(2, 8, 9, 9, device="cuda", dtype=torch.float64)
    z = torch.randn(2, 8, 9, 9, device="cuda", dtype=torch.float64)
    xo, zo = x.to(dtype).requires_grad_(True), z.to(dtype).requires_grad_(True)
    x, z = x.requires_grad_(True), z.requires_grad_(True)
    y = conv(xo, zo)
    want = ref.act_fn(conv.activation)(F.conv2d(x, w, b, padding=1) + z)
    assert ref.rel_err(y, want) < TOL[dtype]
    gy = torch.randn_like(want)
    y.backward(gy.to(dtype))
    want.backward(gy)
    for got, exp in ((xo.grad, x.grad), (zo.grad, z.grad), (conv.weight.grad, w.grad), (conv.bias.grad, b.grad)):
        assert ref.rel_err(got, exp) < 1e-4


def test_repeated_module_calls_take_fresh_data_offset_views_and_torchs_flags():
    """The eager memo (a key of the tensors and torch's flags -> the prepared call) on every path: memo
    hits with new data, a view at an odd offset (realigned copies), a new entry per flag setting."""
    cl = torch.channels_last
    conv = cgt.Conv2d(16, 24, 3, padding=1, activation="relu").cuda().half().to(memory_format=cl)
    theirs = torch.nn.Conv2d(16, 24, 3, padding=1).cuda().double()
    theirs.load_state_dict(conv.state_dict())
    tol = TOL[torch.float16]

    def check(x):
        x = x.detach().requires_grad_(True)
        y = conv(x)
        xd = x.detach().double().requires_grad_(True)
        want = F.relu(theirs(xd))
        assert ref.rel_err(y, want) < tol, "forward"
        gy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, conv.weight, conv.bias), gy)
        exp = torch.autograd.grad(want, (xd, theirs.weight, theirs.bias), gy.double())
        for name, g, e in zip(("input", "weight", "bias"), got, exp):
            assert ref.rel_err(g, e) < tol, f"{name} gradient"

    for _ in range(4):  # first sight prepares; then memo hits, direct, captured and replayed
        check(torch.randn(4, 16, 12, 12, device="cuda", dtype=torch.half).contiguous(memory_format=cl))
    flat = torch.randn(4 * 16 * 12 * 12 + 8, device="cuda", dtype=torch.half)
    check(flat[1:1 + 4 * 16 * 12 * 12].view(4, 12, 12, 16).permute(0, 3, 1, 2))  # 2 bytes off: realigned copies
    cfg = _conv._config(2, conv.stride, conv.padding, conv.dilation, conv.groups, conv.activation, 1.0, ())
    entries = len(cfg.fwd)
    torch.use_deterministic_algorithms(True)
    try:
        check(torch.randn(4, 16, 12, 12, device="cuda", dtype=torch.half).contiguous(memory_format=cl))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(cfg.fwd) == entries + 1, "the deterministic flag must select its own prepared call"
    assert not _conv._declined


def test_only_the_needed_gradients_are_computed():
    conv = cgt.Conv2d(4, 4, 3, padding=1).to("cuda").requires_grad_(False)
    x = torch.randn(2, 4, 8, 8, device="cuda", requires_grad=True)
    conv(x).sum().backward()
    assert x.grad is not None and conv.weight.grad is None
    inference = conv(torch.randn(2, 4, 8, 8, device="cuda"))
    assert inference.grad_fn is None


def test_gradcheck_float64():
    x = torch.randn(2, 4, 7, 6, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 2, 3, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device="cuda", dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 6, 4, 3, device="cuda", dtype=torch.float64, requires_grad=True)

    def fn(x, w, b, z):
        return cgt.conv2d(x, w, b, stride=2, padding=(1, 1), groups=2, activation="tanh", residual=z)

    assert torch.autograd.gradcheck(fn, (x, w, b, z), eps=1e-6, atol=1e-5)
    w2 = torch.randn(5, 4, 3, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w: cgt.conv2d(x, w, padding=1, stride=(1, 2)), (x, w2))


def test_opcheck_all_three_ops():
    x = torch.randn(2, 4, 8, 8, device="cuda")
    w = torch.randn(6, 4, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(6, device="cuda", requires_grad=True)
    conv = [[1, 1], [1, 1, 1, 1], [1, 1], 1]
    torch.library.opcheck(torch.ops.cudnn_graphs.conv_fwd.default,
                          (x.requires_grad_(True), w, b, None, *conv, "relu", 0.0, 1.0))
    dy = torch.randn(2, 6, 8, 8, device="cuda")
    torch.library.opcheck(torch.ops.cudnn_graphs.conv_bwd_data.default, (dy, w.detach(), [2, 4, 8, 8], *conv))
    torch.library.opcheck(torch.ops.cudnn_graphs.conv_bwd_filter.default,
                          (x.detach(), dy, [6, 4, 3, 3], *conv, True))


class _Block(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.a = conv(8, 16, 3, padding=1)
        self.b = conv(16, 8, 3, padding=1, stride=2)

    def forward(self, x):
        return self.b(F.relu(self.a(x))).sum()


def test_torch_compile_fullgraph_matches_eager():
    model = _Block(cgt.Conv2d).cuda()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
    x = torch.randn(4, 8, 16, 16, device="cuda")
    eager, graph = model(x), compiled(x)
    eager.backward()
    graph.backward()
    assert ref.rel_err(graph, eager.double()) < 1e-5
    for p, q in zip(model.parameters(), compiled.parameters()):
        assert ref.rel_err(q.grad, p.grad.double()) < 1e-5


def test_a_captured_training_step_replays_with_fresh_data():
    torch.manual_seed(0)
    model = _Block(cgt.Conv2d).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every replay sees the same weights
    static_x = torch.randn(4, 8, 16, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream, as torch's docs ask
            opt.zero_grad(set_to_none=True)
            model(static_x).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model(static_x)
        static_loss.backward()
    params = list(model.parameters())
    static_grads = [p.grad for p in params]
    for _ in range(3):
        fresh = torch.randn_like(static_x)
        static_x.copy_(fresh)
        graph.replay()
        loss = model(fresh)
        eager_grads = torch.autograd.grad(loss, params)
        torch.cuda.synchronize()
        assert ref.rel_err(static_loss, loss.double()) < 1e-5
        for got, want in zip(static_grads, eager_grads):
            assert ref.rel_err(got, want.double()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_runs_in_the_autocast_dtype_like_torch(dtype):
    ours = cgt.Conv2d(8, 8, 3, padding=1).cuda()
    theirs = torch.nn.Conv2d(8, 8, 3, padding=1).cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 10, 10, device="cuda")
    xo, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=dtype):
        y, want = ours(xo), theirs(xt)
    assert y.dtype == want.dtype == dtype
    assert ref.rel_err(y, want.double()) < TOL[dtype]
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    # Each gradient comes back in its input's dtype, through the casts' own autograd nodes, as torch's.
    for got, expect in ((xo.grad, xt.grad), (ours.weight.grad, theirs.weight.grad), (ours.bias.grad, theirs.bias.grad)):
        assert got.dtype == expect.dtype == torch.float32
        assert ref.rel_err(got, expect.double()) < TOL[dtype]
    z = torch.randn(2, 8, 10, 10, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        y = ours(x, residual=z)
    y.backward(dy)
    assert z.grad.dtype == torch.float32 and ref.rel_err(z.grad, dy.double()) < TOL[dtype]


def test_deterministic_mode_is_bit_identical():
    x = torch.randn(16, 32, 28, 28, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    conv = cgt.Conv2d(32, 32, 3, padding=1).cuda().half().to(memory_format=torch.channels_last)
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(3):
            conv.weight.grad = None
            conv(x).float().square().sum().backward()
            grads.append(conv.weight.grad.clone())
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_unbatched_input_on_cuda(nd):
    ours, theirs, x_ours, x = _pair(nd, 4, 6, 3, torch.float32, channels_last=False, padding=1)
    x_ours, x = x_ours[0].requires_grad_(True), x[0].requires_grad_(True)
    y, want = ours(x_ours), theirs(x)
    assert y.shape == want.shape == (6, *x.shape[1:])
    assert ref.rel_err(y, want) < TOL[torch.float32]
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x_ours, gy)
    (wx,) = torch.autograd.grad(want, x, gy.double())
    assert ref.rel_err(gx, wx) < TOL[torch.float32]


@pytest.mark.parametrize("x_shape, w_shape, field", [((2, 4, 8, 8), (6, 3, 3, 3), "input"),
                                                     ((2, 4, 2, 2), (6, 4, 3, 3), "input"),
                                                     ((8, 8), (6, 4, 3, 3), "input")])
def test_shapes_torch_refuses_raise_its_runtime_error_on_cuda_too(x_shape, w_shape, field):
    from cudnn_graphs import ShapeError

    x = torch.randn(x_shape, device="cuda", dtype=torch.half)
    w = torch.randn(w_shape, device="cuda", dtype=torch.half, requires_grad=True)
    for _ in range(2):  # the second call meets the memo, which must not have remembered a bad geometry
        with pytest.raises(ShapeError) as err:
            cgt.conv2d(x, w)
        assert err.value.field == field and isinstance(err.value, RuntimeError)


LAYOUTS = [  # (x, w) memory formats torch's cuDNN conv reads; the output's layout is torch's rule
    ((2, 8, 9, 9), (16, 8, 3, 3), None, torch.channels_last),
    ((2, 8, 9, 9), (16, 8, 3, 3), torch.channels_last, None),
    ((2, 1, 9, 9), (16, 1, 3, 3), None, torch.channels_last),  # grayscale: the weight's strides decide
    ((2, 8, 9, 9), (16, 8, 1, 1), None, torch.channels_last),
    ((2, 4, 5, 6, 7), (8, 4, 3, 3, 3), None, torch.channels_last_3d),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("x_shape, w_shape, x_fmt, w_fmt", LAYOUTS)
def test_output_layout_and_values_follow_torch_for_mixed_layouts(x_shape, w_shape, x_fmt, w_fmt, dtype):
    x = torch.randn(x_shape, device="cuda", dtype=dtype)
    w = torch.randn(w_shape, device="cuda", dtype=dtype)
    x = x if x_fmt is None else x.to(memory_format=x_fmt)
    w = w if w_fmt is None else w.to(memory_format=w_fmt)
    conv = {4: F.conv2d, 5: F.conv3d}[x.dim()]
    ours = {4: cgt.conv2d, 5: cgt.conv3d}[x.dim()]
    for _ in range(2):  # first sight, then the memo's call
        y, want = ours(x, w, padding=w_shape[-1] // 2), conv(x, w, padding=w_shape[-1] // 2)
        assert y.stride() == want.stride(), (y.stride(), want.stride())
        assert ref.rel_err(y, conv(x.double(), w.double(), padding=w_shape[-1] // 2)) < 2 * TOL[dtype]
    assert not _conv._declined


def test_torch_func_per_sample_gradients_on_cuda():
    x = torch.randn(4, 8, 9, 9, device="cuda", dtype=torch.float64)
    w = torch.randn(6, 8, 3, 3, device="cuda", dtype=torch.float64)

    def per_sample(conv):
        loss = lambda w, xi: conv(xi[None], w, padding=1, stride=2).tanh().sum()  # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)

    assert ref.rel_err(per_sample(cgt.conv2d), per_sample(F.conv2d)) < 1e-12
    assert ref.rel_err(torch.func.vmap(lambda xi: cgt.conv2d(xi, w, padding=1))(x), F.conv2d(x, w, padding=1)) < 1e-12


def _odd_cases(n: int, seed: int = 17) -> list[dict]:
    """Odd module configurations: few or prime channel counts, groups, every kernel size to 7, strides
    to 3, dilation, asymmetric and string padding, non-zero padding modes, 1d / 2d / 3d."""
    import random

    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        nd = rng.choice([1, 2, 2, 2, 3])
        groups = rng.choice([1, 1, 1, 2, 3])
        cin, cout = groups * rng.choice([1, 2, 3, 5, 8]), groups * rng.choice([1, 3, 4, 7])
        kernel = tuple(rng.choice([1, 2, 3, 5, 7] if nd < 3 else [1, 2, 3]) for _ in range(nd))
        stride = tuple(rng.choice([1, 1, 2, 3]) for _ in range(nd))
        dilation = tuple(rng.choice([1, 1, 2]) for _ in range(nd))
        padding = rng.choice(["same", "valid", 0, 1, tuple(rng.choice([0, 1, 2]) for _ in range(nd))])
        if padding == "same" and any(s != 1 for s in stride):
            padding = 1
        modes = ["zeros", "zeros", "reflect", "circular", "replicate"]
        mode = rng.choice(modes) if padding not in ("valid", 0) else "zeros"
        size = tuple(rng.choice([5, 7, 9, 12, 16]) + (k - 1) * d for k, d in zip(kernel, dilation))
        cases.append(dict(nd=nd, cin=cin, cout=cout, kernel=kernel, stride=stride, dilation=dilation, padding=padding,
                          groups=groups, bias=rng.random() < 0.7, padding_mode=mode, size=size,
                          batch=rng.choice([1, 2, 3]), dtype=rng.choice(["float16", "bfloat16", "float32"]),
                          channels_last=rng.random() < 0.5))
    return cases


@pytest.mark.parametrize("case", _odd_cases(40), ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_odd_module_configurations_match_torch(case):
    """Forward and every gradient against torch in float64 (torch's convolution serving a graph cuDNN
    declines is allowed: the values must match either way)."""
    case = dict(case)
    nd, dtype = case.pop("nd"), getattr(torch, case.pop("dtype"))
    cin, cout, kernel = case.pop("cin"), case.pop("cout"), case.pop("kernel")
    ours, theirs, x, _ = _pair(nd, cin, cout, kernel, dtype, case.pop("channels_last"), spatial=case.pop("size"),
                               batch=case.pop("batch"), **case)
    xo, xd = x.detach().requires_grad_(True), x.detach().double().requires_grad_(True)
    y, want = ours(xo), theirs(xd)
    assert y.shape == want.shape and y.dtype == dtype
    tol = 2 * TOL[dtype]
    assert ref.rel_err(y, want) < tol, "forward"
    gy = torch.randn_like(want).to(dtype)
    y.backward(gy)
    want.backward(gy.double())
    assert ref.rel_err(xo.grad, xd.grad) < tol, "input gradient"
    assert ref.rel_err(ours.weight.grad, theirs.weight.grad) < tol, "weight gradient"
    if theirs.bias is not None:
        assert ref.rel_err(ours.bias.grad, theirs.bias.grad) < tol, "bias gradient"
