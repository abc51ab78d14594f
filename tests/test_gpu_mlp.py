"""GPU: cudnn_graphs.torch.MLP against torch autograd in float64: forward and every gradient (input,
weights, biases), fused cuBLASLt path (relu, gelu_tanh) and the linear_act chain (exact gelu, silu,
unaligned widths), every dtype, leading batch dims, no bias; poisoned allocator, fresh random data."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cudnn_graphs.torch import MLP  # noqa: E402
from cudnn_graphs.torch._mlp import _fusable  # noqa: E402
from fallback_kernels import cublaslt  # noqa: E402

from .gpu_reference import act_fn  # noqa: E402

pytestmark = pytest.mark.gpu

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOL = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 1e-5}  # relative L2; float32 with TF32 off


def rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def poison_allocator():
    junk = torch.full((1 << 24,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def reference(x, module, dy):
    """y and the gradients in float64, from the module's own parameters; each layer's output is rounded to
    the io dtype, as the layer under test stores it (else relu's sign flips where the next layer's pre is
    within one rounding of 0, and bf16's rounding is 0.4 %)."""
    params = [p.detach().double().requires_grad_() for p in module.parameters()]
    x64 = x.detach().double().requires_grad_()
    h, it = x64, iter(params)
    layers = list(module.layers)
    for i, layer in enumerate(layers):
        w = next(it)
        b = next(it) if layer.bias is not None else None
        h = torch.nn.functional.linear(h, w, b)
        if i < len(layers) - 1:
            h = act_fn(module.activation)(h).to(x.dtype).double()
    grads = torch.autograd.grad(h, [x64, *params], dy.double())
    return h.detach(), grads


def run_case(dtype, act, sizes, lead, *, bias=True):
    torch.manual_seed(hash((dtype, str(act), tuple(sizes), lead, bias)) % 2**31)
    module = MLP(sizes, activation=act, bias=bias, device="cuda", dtype=DT[dtype])
    x = torch.randn(*lead, sizes[0], device="cuda", dtype=DT[dtype]).requires_grad_()
    dy = torch.randn(*lead, sizes[-1], device="cuda", dtype=DT[dtype])
    poison_allocator()
    y = module(x)
    y.backward(dy)
    torch.cuda.synchronize()
    ry, rgrads = reference(x, module, dy)
    tag = f"{dtype} {act} {sizes} lead{lead} bias{int(bias)}"
    fails = []
    if (e := rel(y, ry)) > TOL[dtype] or not torch.isfinite(y).all():
        fails.append(f"{tag}: y err {e:.2e}")
    got = [x.grad, *(p.grad for p in module.parameters())]
    names = ["x"] + [n for n, _ in module.named_parameters()]
    for name, g, want in zip(names, got, rgrads):
        if g is None:
            fails.append(f"{tag}: d{name} missing")
        elif (e := rel(g, want)) > TOL[dtype] or not torch.isfinite(g).all():
            fails.append(f"{tag}: d{name} err {e:.2e}")
    return fails


@pytest.mark.parametrize("dtype", list(DT))
def test_mlp_matches_torch_float64(dtype):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fails = []
        for act in ("relu", "gelu_tanh", "gelu", "silu"):
            fails += run_case(dtype, act, [64, 128, 96, 40], (37,))
            fails += run_case(dtype, act, [48, 256, 24], (2, 19))
        fails += run_case(dtype, "gelu_tanh", [64, 128, 40], (33,), bias=False)
        fails += run_case(dtype, "relu", [64, 136, 40], (33,), bias=False)
        fails += run_case(dtype, "relu", [36, 44, 20], (17,))  # widths not multiples of 8: the chain path
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert not fails, "\n".join(fails)


def test_fused_path_taken_where_expected():
    assert cublaslt.available(), "nvmath-python's cuBLASLt binding is expected on the GPU host"
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    m = MLP([64, 128, 64], activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    weights, biases = [l.weight for l in m.layers], [l.bias for l in m.layers]
    assert _fusable(x, weights, biases, m.activation)
    assert not _fusable(x, weights, biases, MLP([64, 128, 64], activation="gelu").activation)


def test_backward_is_bit_identical_run_to_run():
    m = MLP([256, 1024, 256], activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x).backward(dy)
        runs.append([x.grad.clone(), *(p.grad.clone() for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
