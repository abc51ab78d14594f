"""GPU: gemm_bias_act forward and backward against torch autograd in float64, every activation x dtype x
layout (plain, transposed b, transposed a, batched, batched transposed a) x accumulate / out buffers,
odd sizes, poisoned outputs and fresh random data. Failures are collected per test into one short line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from cudnn_graphs.errors import BufferMismatchError  # noqa: E402
from gpu_launch.activations import as_activation  # noqa: E402
from fallback_kernels import gemm_act  # noqa: E402
from fallback_kernels.gemm_act import gemm_bias_act, gemm_bias_act_backward  # noqa: E402

from .gpu_reference import act_fn  # noqa: E402

pytestmark = pytest.mark.gpu

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOL = {"float16": 3e-3, "bfloat16": 1e-2, "float32": 1e-5}  # relative L2; float32 with TF32 off
ACTS = [None, "relu", ("leaky_relu", 0.2), "elu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh",
        ("softplus", 2.0)]


def rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def rand(shape, dtype, *, transposed=False, scale=1.0):
    """Fresh random data (never zeros); transposed: a transposed view of a contiguous buffer."""
    if transposed:
        return rand((*shape[:-2], shape[-1], shape[-2]), dtype, scale=scale).transpose(-1, -2)
    return (torch.randn(shape, dtype=torch.float64, device="cuda") * scale).to(DT[dtype])


def poison_allocator():
    """Leave NaNs in the caching allocator's free blocks so unwritten outputs show up."""
    junk = torch.full((1 << 22,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def nan_like(t):
    return torch.full_like(t, float("nan"))


EARLY_ROUNDING = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # unit roundoff of the io dtype


def reference(a, b, bias, act, dy, y_hint=None):
    """y and the grads in float64. For relu / leaky_relu, where |pre| < 1e-5 the sign is ambiguous at f32
    accumulation precision (a legit f32 GEMM may round 3e-9 to either side): the reference takes the
    sign of the y under test there. 16-bit relu rounds as torch's relu(addmm) does (cuBLASLt's epilogue
    rounds a @ b to the io dtype before adding the bias): its band is one such rounding of a @ b wide.
    leaky_relu rounds once, so a double-rounding bug there (signs flipped up to ~1e-3) still fails."""
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    bias64 = bias.detach().double().requires_grad_() if bias is not None else None
    pre = a64 @ b64 + (bias64 if bias64 is not None else 0)
    if y_hint is not None and act.name in ("relu", "leaky_relu"):
        band = 1e-5
        if act.name == "relu" and a.dtype in EARLY_ROUNDING:
            band = band + EARLY_ROUNDING[a.dtype] * (a64 @ b64).detach().abs()
        on = torch.where(pre.detach().abs() < band, y_hint.double() > 0, pre.detach() > 0)
        y = torch.where(on, pre, pre * (act.param if act.name == "leaky_relu" else 0.0))
    else:
        y = act_fn(act)(pre)
    wrt = [a64, b64] + ([bias64] if bias64 is not None else [])
    grads = torch.autograd.grad(y, wrt, dy.double())
    return y.detach(), grads[0], grads[1], grads[2] if bias64 is not None else pre.new_zeros(1)


def mask_words(y):
    """The expected bit mask: bit c % 32 of word c // 32 where y > 0 (= pre > 0 for relu, leaky_relu), rows
    padded to 128 bits (cuBLASLt's RELU_AUX pitch); and which bits are meaningful (the padding is not)."""
    *lead, m, n = y.shape
    words = gemm_act.mask_words(n)
    bits = torch.zeros((*lead, m, words * 32), dtype=torch.int64, device=y.device)
    valid = torch.zeros_like(bits)
    bits[..., :n] = (y > 0).long()
    valid[..., :n] = 1
    weights = 2 ** torch.arange(32, device=y.device, dtype=torch.int64)
    return tuple((t.view(*lead, m, words, 32) * weights).sum(-1) for t in (bits, valid))


def mask_matches(aux, y) -> bool:
    want, valid = mask_words(y)
    return aux.dtype == torch.int32 and aux.shape == want.shape and torch.equal(aux.long() & valid, want)


def run_case(dtype, act, *, m, k, n, batch=None, ta=False, tb=False, bias=True, accumulate=False,
             out_buffers=False, need=("a", "b", "bias"), chunks=None):
    """One forward + backward against the float64 reference; returns a list of failure strings."""
    act = as_activation("activation", act)
    lead = (batch,) if batch else ()
    a = rand((*lead, m, k), dtype, transposed=ta)
    b = rand((k, n), dtype, transposed=tb, scale=k ** -0.5)
    bv = rand((n,), dtype) if bias else None
    dy = rand((*lead, m, n), dtype)
    tag = (f"{dtype} {act} m{m} k{k} n{n} b{batch} ta{int(ta)} tb{int(tb)} bias{int(bias)} "
           f"acc{int(accumulate)} out{int(out_buffers)} need{''.join(x[0] for x in need)} ch{chunks}")
    tol = TOL[dtype]
    fails = []
    poison_allocator()
    y, aux = gemm_bias_act(a, b, bv, activation=act)
    torch.cuda.synchronize()
    ry, rda, rdb, rdbias = reference(a, b, bv, act, dy, y_hint=y)
    if (e := rel(y, ry)) > tol or not torch.isfinite(y).all():
        fails.append(f"{tag}: y err {e:.2e}")
    if act.name == "leaky_relu":
        if not mask_matches(aux, y):
            fails.append(f"{tag}: bit mask differs from y > 0")
    elif act.name == "relu":
        if aux is not y:
            fails.append(f"{tag}: relu's aux is not y itself")
    elif act.name != "identity" and (aux.dtype != y.dtype or rel(aux, a.double() @ b.double() +
                                                               (bv.double() if bias else 0)) > tol):
        fails.append(f"{tag}: saved pre-activation wrong")
    kw = {}
    base = {}
    if accumulate or out_buffers:
        for role, like in (("a", a), ("b", b), ("bias", rdbias.to(DT[dtype]) if bias else None)):
            if role not in need or like is None:
                continue
            # the same layout as the operand (a transposed view for a transposed operand)
            buf = torch.empty_strided(like.shape, like.stride(), dtype=DT[dtype], device="cuda")
            if accumulate:
                buf.copy_(rand(like.shape, dtype))
                base[role] = buf.clone()
            else:
                buf.fill_(float("nan"))
            kw[f"d{role}"] = buf
    poison_allocator()
    da, db, dbias = gemm_bias_act_backward(dy, a, b, aux, activation=act, need=need, accumulate=accumulate,
                                           chunks=chunks, **kw)
    torch.cuda.synchronize()
    for role, got, want, like in (("a", da, rda, a), ("b", db, rdb, b), ("bias", dbias, rdbias, None)):
        if role not in need:
            if got is not None:
                fails.append(f"{tag}: d{role} returned though not needed")
            continue
        if got is None:
            fails.append(f"{tag}: d{role} missing")
            continue
        if role in base:
            want = want + base[role].double()
        if f"d{role}" in kw and got.data_ptr() != kw[f"d{role}"].data_ptr():
            fails.append(f"{tag}: d{role} not written into the given buffer")
        if like is not None and got.shape != like.shape:
            fails.append(f"{tag}: d{role} shape {tuple(got.shape)}")
            continue
        if like is not None and not out_buffers and not accumulate and got.stride() != _dense(like):
            fails.append(f"{tag}: d{role} strides {got.stride()} vs {_dense(like)}")
        if (e := rel(got, want)) > tol or not torch.isfinite(got).all():
            fails.append(f"{tag}: d{role} err {e:.2e}")
    return fails


def _dense(t):
    """Dense strides in t's matrix order (what the backward allocates for a gradient of t)."""
    rows, cols = t.shape[-2:]
    col = t.stride(-2) == 1 and rows > 1 and cols > 1 and t.stride(-1) != 1
    inner = (1, rows) if col else (cols, 1)
    return ((rows * cols,) if t.dim() == 3 else ()) + inner


ODD = {"m": 37, "k": 29, "n": 53}  # no multiple of 8 or 16 anywhere: scalar path, one mask word per 32 cols
VEC = {"m": 300, "k": 24, "n": 272}  # 16-byte vectors, two column tiles, several row blocks and chunks


def cases():
    yield dict(**ODD)
    yield dict(**ODD, tb=True, out_buffers=True)  # b = W.T (nn.Linear), NaN-filled out buffers
    yield dict(**ODD, ta=True)
    yield dict(**ODD, batch=3, tb=True)  # contiguous batch: one GEMM over Bt*M rows
    yield dict(**ODD, batch=3, ta=True)  # per-batch transposed a: strided-batched dA, dB summed in f32
    yield dict(**ODD, bias=False, need=("a", "b"))
    yield dict(**ODD, need=("b",))
    yield dict(**ODD, need=("bias",))
    yield dict(**VEC, tb=True)
    yield dict(**VEC, tb=True, chunks=3)  # dA's row chunks on a side stream
    yield dict(m=64, k=40, n=96, batch=2, tb=True, accumulate=True)
    yield dict(m=64, k=40, n=96, ta=True, accumulate=True, chunks=2)


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_against_torch_float64(dtype, act):
    seed = torch.seed()  # fresh random data each run; the seed is in the failure message
    fails = []
    for case in cases():
        fails += run_case(dtype, act, **case)
    assert not fails, f"seed {seed}: {len(fails)} failing: " + " | ".join(fails[:6])


def test_cupy_arrays_in_cupy_arrays_out():
    cupy = pytest.importorskip("cupy")
    dtypes = ["float16", "float32"]  # torch bfloat16 tensors export no __cuda_array_interface__
    for dtype in dtypes:
        a, b, bias, dy = rand((45, 33), dtype), rand((33, 70), dtype, scale=0.2), rand((70,), dtype), rand((45, 70),
                                                                                                            dtype)
        ry, rda, rdb, rdbias = reference(a, b, bias, as_activation("a", "silu"), dy)
        ca, cb, cbias, cdy = (cupy.asarray(t) for t in (a, b, bias, dy))
        torch.cuda.synchronize()
        y, aux = gemm_bias_act(ca, cb, cbias, activation="silu")
        da, db, dbias = gemm_bias_act_backward(cdy, ca, cb, aux, activation="silu")
        cupy.cuda.get_current_stream().synchronize()
        assert all(isinstance(o, cupy.ndarray) for o in (y, aux, da, db, dbias))
        for got, want in ((y, ry), (da, rda), (db, rdb), (dbias, rdbias)):
            assert rel(torch.as_tensor(got, device="cuda"), want) < TOL[dtype], dtype


def test_deterministic_and_on_the_current_stream():
    a, b, dy = rand((2048, 64), "bfloat16"), rand((64, 512), "bfloat16", scale=0.125), rand((2048, 512), "bfloat16")
    bias = rand((512,), "bfloat16")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y, aux = gemm_bias_act(a, b, bias, activation="gelu")
        first = gemm_bias_act_backward(dy, a, b, aux, activation="gelu")
        second = gemm_bias_act_backward(dy, a, b, aux, activation="gelu")
        y2, aux2 = gemm_bias_act(a, b, bias, activation="gelu", save_for_backward=False)
        y3, aux3 = gemm_bias_act(a, b, bias, activation="relu", save_for_backward=False)
    side.synchronize()
    for x, z in zip(first, second):
        assert torch.equal(x, z)
    assert aux2 is None and aux3 is None and torch.equal(y, y2)
    assert rel(y3, torch.relu(a.double() @ b.double() + bias.double())) < TOL["bfloat16"]
    ry, rda, rdb, rdbias = reference(a, b, bias, as_activation("a", "gelu"), dy)
    assert rel(first[2], rdbias) < TOL["bfloat16"] and rel(first[1], rdb) < TOL["bfloat16"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_relu_rounds_as_torch_relu_addmm(dtype):
    """16-bit relu is cuBLASLt's RELU_BIAS epilogue, as torch's relu(addmm(bias, a, b)) rounds: y as torch's to
    one rounding with the same signs, its aux y itself, every gradient as torch autograd's through it."""
    a, b = rand((512, 384), dtype), rand((384, 640), dtype, scale=384 ** -0.5)
    bias, dy = rand((640,), dtype), rand((512, 640), dtype)
    poison_allocator()
    y, aux = gemm_bias_act(a, b, bias, activation="relu")
    ta, tb, tbias = (t.detach().clone().requires_grad_() for t in (a, b, bias))
    ty = torch.relu(torch.addmm(tbias, ta, tb))
    ty.backward(dy)
    da, db, dbias = gemm_bias_act_backward(dy, a, b, aux, activation="relu")
    torch.cuda.synchronize()
    assert aux is y
    assert rel(y, ty) < TOL[dtype] and float(((y > 0) != (ty > 0)).double().mean()) < 1e-3
    for got, want in ((da, ta.grad), (db, tb.grad), (dbias, tbias.grad)):
        assert rel(got, want) < TOL[dtype]


def test_errors_before_launch():
    a, b = rand((8, 4), "float16"), rand((4, 6), "float16")
    with pytest.raises(BufferMismatchError) as e:
        gemm_bias_act(rand((8, 8), "float16")[:, ::2], b, activation="relu")
    assert (e.value.role, e.value.what) == ("a", "strides")
    with pytest.raises(BufferMismatchError) as e:
        gemm_bias_act(a, b.float(), activation="relu")
    assert (e.value.role, e.value.what) == ("b", "dtype")
    with pytest.raises(BufferMismatchError) as e:
        gemm_bias_act(a.cpu(), b, activation="relu")
    assert (e.value.role, e.value.what) == ("a", "device")
    y, aux = gemm_bias_act(a, b, activation="gelu")
    with pytest.raises(BufferMismatchError) as e:
        gemm_bias_act_backward(rand((6, 8), "float16").t(), a, b, aux, activation="gelu")
    assert (e.value.role, e.value.what) == ("dy", "strides")


def test_linear_act_module_matches_nn_linear():
    from cudnn_graphs.torch import LinearAct, linear_act

    for dtype, act in (("bfloat16", "gelu"), ("float16", "relu"), ("float32", ("leaky_relu", 0.1))):
        mod = LinearAct(37, 53, activation=act, device="cuda", dtype=DT[dtype])
        ref = torch.nn.Linear(37, 53, device="cuda", dtype=torch.float64)
        ref.load_state_dict({k: v.double() for k, v in mod.state_dict().items()})
        assert set(mod.state_dict()) == {"weight", "bias"}
        x = rand((2, 5, 37), dtype).requires_grad_()
        dy = rand((2, 5, 53), dtype)
        y = mod(x)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        y64 = act_fn(as_activation("a", act))(ref(x64))
        y64.backward(dy.double())
        tol = TOL[dtype]
        assert y.shape == (2, 5, 53) and rel(y, y64) < tol
        assert rel(x.grad, x64.grad) < tol and rel(mod.weight.grad, ref.weight.grad) < tol
        assert rel(mod.bias.grad, ref.bias.grad) < tol
        assert mod.weight.grad.is_contiguous()
    # frozen weight, no bias, 2D transposed input, function form
    w = rand((24, 40), "float16")
    x = rand((40, 31), "float16").t().requires_grad_()
    y = linear_act(x, w, None, activation="tanh")
    y.backward(torch.ones_like(y))
    x64 = x.detach().double().requires_grad_()
    torch.tanh(x64 @ w.double().t()).backward(torch.ones_like(y).double())
    assert w.grad is None and rel(x.grad, x64.grad) < TOL["float16"]
    assert linear_act(rand((0, 40), "float16"), w, activation="relu").shape == (0, 24)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["gelu", "silu", "sigmoid", "elu"])
def test_forward_pass_matches_the_exact_formula_on_the_saved_pre_activation(dtype, act):
    """y against the activation of the very pre-activation the forward saved, in float64 then rounded: at
    most one ulp apart anywhere (16-bit outputs take SFU formulas a few 1e-7 off the exact ones; gelu's stays
    accurate in the negative tail, where torch's f32 1 + erf cancels), across [-12, 12] and the special
    values (as the bias of a zero product)."""
    # tiny: fp16's smallest subnormal; for bf16, results within a few binades of f32's subnormals may flush
    # to 0 (the SFU's exp flushes them; gelu(-13) ~ -1e-38), where torch's own f32 gelu returns 0 anyway
    eps, tiny = {"float16": (2.0 ** -10, 2.0 ** -24), "bfloat16": (2.0 ** -7, 2.0 ** -122)}[dtype]
    fn = act_fn(as_activation("a", act))
    if act == "gelu":  # 1 + erf cancels even in float64 below about -8: erfc keeps the tail's digits
        fn = lambda t: 0.5 * t * torch.special.erfc(-t * 2 ** -0.5)  # noqa: E731

    def check(y, pre):
        want = fn(pre.double()).to(DT[dtype]).float()
        got = y.float()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), (act, pre[torch.isnan(got) != nan])
        close = (got == want) | ((got - want).abs() <= want.abs() * eps + tiny)
        assert (close | nan).all(), (act, pre[~(close | nan)][:8].tolist(), got[~(close | nan)][:8].tolist())

    a = rand((512, 64), dtype, scale=3.0)
    b = rand((64, 264), dtype, scale=64 ** -0.5)
    check(*gemm_bias_act(a, b, rand((264,), dtype), activation=act))
    special = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 0.5, -0.5, 9.0, -9.0, 60.0, -60.0, float("inf"),
                            -float("inf"), float("nan")], device="cuda", dtype=DT[dtype])
    zeros = torch.zeros(4, 8, device="cuda", dtype=DT[dtype])
    check(*gemm_bias_act(zeros, rand((8, special.numel()), dtype), special, activation=act))
