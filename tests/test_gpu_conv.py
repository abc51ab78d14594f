"""GPU: every op family against a float64 torch reference, poisoned outputs, fresh random inputs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import cudnn_graphs as cg  # noqa: E402
from cudnn_graphs import BufferMismatchError, ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec  # noqa: E402

from fallback_kernels import epilogue  # noqa: E402

from . import gpu_reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

ACTS = ["relu", ("leaky_relu", 0.2), "elu", ("elu", 0.5), "gelu", "gelu_tanh", "silu", "sigmoid", "tanh",
        "softplus", ("softplus", 2.0), None]
DT_LAYOUTS = [(dt, lay) for dt in ("float16", "bfloat16", "float32", "float64")
              for lay in ("channels_first", "channels_last")]


@pytest.fixture(scope="module")
def session():
    return cg.Session(allow_tf32=False)


@pytest.fixture(scope="module")
def unfused():
    return cg.Session(allow_tf32=False, fuse=False)


def _run(session, spec, inputs_scale=1.0):
    plan = session.plan(spec)
    descs = spec.tensors()
    outputs = {"conv_fwd": ("y",), "conv_bwd_data": ("dx",), "conv_bwd_filter": ("dw", "db")}[spec.op]
    bufs = {r: (ref.poisoned(d) if r in outputs else ref.random(d, scale=inputs_scale)) for r, d in descs.items()}
    plan.execute(**bufs)
    torch.cuda.synchronize()
    return plan, bufs


def _check_fwd(session, spec):
    plan, bufs = _run(session, spec)
    err = ref.rel_err(bufs["y"], ref.fwd(spec, bufs))
    assert err < ref.TOLERANCE[spec.dtype], (err, plan.engines)
    return plan


def _fwd(nd=2, dtype="float16", layout="channels_last", c=16, k=32, size=12, ksize=3, **kw):
    x = (3, c) + (size,) * nd
    w = (k, c // kw.get("groups", 1)) + (ksize,) * nd
    kw.setdefault("padding", ksize // 2)
    return ConvFwdSpec(x, w, dtype=dtype, layout=layout, **kw)


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_fwd_bias_activation(session, act):
    plan = _check_fwd(session, _fwd(bias=True, activation=act))
    assert plan.accumulator_dtype == "float32"


@pytest.mark.parametrize("dtype, layout", DT_LAYOUTS)
def test_fwd_dtypes_layouts(session, dtype, layout):
    _check_fwd(session, _fwd(dtype=dtype, layout=layout))
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, bias=True, activation="relu"))


@pytest.mark.parametrize("nd", [1, 3])
@pytest.mark.parametrize("dtype, layout", [("float16", "channels_last"), ("float32", "channels_first")])
def test_fwd_1d_3d(session, nd, dtype, layout):
    _check_fwd(session, _fwd(nd=nd, dtype=dtype, layout=layout, size=9))
    _check_fwd(session, _fwd(nd=nd, dtype=dtype, layout=layout, size=9, bias=True, activation="relu"))


@pytest.mark.parametrize("kw", [
    dict(groups=4), dict(groups=16, k=16), dict(stride=2), dict(dilation=2, padding=2),
    dict(stride=(2, 1), padding=((1, 0), (0, 2))), dict(ksize=1, padding=0, stride=2), dict(padding="same", ksize=4),
], ids=["groups4", "depthwise", "stride2", "dilation2", "asym", "1x1s2", "same-even"])
@pytest.mark.parametrize("dtype, layout", [("float16", "channels_last"), ("float32", "channels_first")])
def test_fwd_geometry(session, kw, dtype, layout):
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, **kw))
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, bias=True, activation="relu", **kw))


@pytest.mark.parametrize("dtype, layout", [("float16", "channels_last"), ("bfloat16", "channels_last"),
                                           ("float32", "channels_first")])
def test_fwd_residual_alpha_beta(session, dtype, layout):
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, bias=True, residual=True, activation="relu"))
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, bias=True, residual=True, alpha=0.5, beta=2.0,
                             activation="relu"))
    _check_fwd(session, _fwd(dtype=dtype, layout=layout, alpha=0.25))


def _dgrad(nd=2, dtype="float16", layout="channels_last", stride=1, groups=1, padding=1, act=None, size=12):
    x = (3, 16) + (size,) * nd
    w = (32, 16 // groups) + (3,) * nd
    y = ConvFwdSpec(x, w, stride=stride, padding=padding, groups=groups).y_shape
    return ConvBwdDataSpec(y, w, x, stride=stride, padding=padding, groups=groups, dtype=dtype, layout=layout,
                           activation_backward=act)


def _check_dgrad(session, spec):
    plan, bufs = _run(session, spec)
    err = ref.rel_err(bufs["dx"], ref.dgrad(spec, bufs))
    assert err < ref.TOLERANCE[spec.dtype], (err, plan.engines)


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_dgrad_activation_backward(session, act):
    _check_dgrad(session, _dgrad(act=act))


@pytest.mark.parametrize("dtype, layout", DT_LAYOUTS)
def test_dgrad_dtypes_layouts(session, dtype, layout):
    _check_dgrad(session, _dgrad(dtype=dtype, layout=layout))


@pytest.mark.parametrize("kw", [dict(stride=2), dict(stride=2, padding=((1, 0), (0, 1))), dict(groups=4),
                                dict(nd=1), dict(nd=3, size=7), dict(stride=2, size=13)],
                         ids=["stride2", "asym", "groups4", "1d", "3d", "odd-x"])
def test_dgrad_geometry(session, kw):
    _check_dgrad(session, _dgrad(**kw))


def _check_wgrad(session, spec):
    plan, bufs = _run(session, spec)
    expected = ref.wgrad(spec, bufs)
    # wgrad sums over N*H*W products: a longer reduction, so a looser bound in half precision.
    tol = ref.TOLERANCE[spec.dtype] * (3 if spec.dtype in ("float16", "bfloat16") else 1)
    for role, value in expected.items():
        err = ref.rel_err(bufs[role], value)
        assert err < tol, (role, err, plan.engines)


def _wgrad(nd=2, dtype="float16", layout="channels_last", stride=1, groups=1, bias_grad=False, size=12):
    x = (3, 16) + (size,) * nd
    w = (32, 16 // groups) + (3,) * nd
    y = ConvFwdSpec(x, w, stride=stride, padding=1, groups=groups).y_shape
    return ConvBwdFilterSpec(x, y, w, stride=stride, padding=1, groups=groups, dtype=dtype, layout=layout,
                             bias_grad=bias_grad)


@pytest.mark.parametrize("dtype, layout", DT_LAYOUTS)
def test_wgrad_dtypes_layouts(session, dtype, layout):
    _check_wgrad(session, _wgrad(dtype=dtype, layout=layout))


@pytest.mark.parametrize("kw", [dict(stride=2), dict(groups=4), dict(nd=1), dict(nd=3, size=7), dict(bias_grad=True)],
                         ids=["stride2", "groups4", "1d", "3d", "bias_grad"])
def test_wgrad_geometry(session, kw):
    _check_wgrad(session, _wgrad(**kw))


def test_deterministic_mode_is_bit_identical():
    session = cg.Session(deterministic=True)
    spec = _wgrad(size=20)
    plan = session.plan(spec)
    assert plan.deterministic
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    results = []
    for _ in range(3):
        bufs["dw"].fill_(float("nan"))
        plan.execute(**bufs)
        torch.cuda.synchronize()
        results.append(bufs["dw"].clone())
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_tf32_allowed_is_close_and_recorded():
    spec = _fwd(dtype="float32", layout="channels_first", allow_tf32=True, c=64, k=64)
    plan, bufs = _run(cg.Session(allow_tf32=True), spec)
    assert ref.rel_err(bufs["y"], ref.fwd(spec, bufs)) < 5e-3


def test_cupy_buffers_and_raw_pointers(session):
    cupy = pytest.importorskip("cupy")
    spec = _fwd(dtype="float32", layout="channels_first", bias=True, activation="relu")
    plan = session.plan(spec)
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    bufs["y"].fill_(float("nan"))
    as_cupy = {r: cupy.from_dlpack(t) for r, t in bufs.items()}
    plan.execute(**as_cupy)
    cupy.cuda.get_current_stream().synchronize()
    assert ref.rel_err(bufs["y"], ref.fwd(spec, bufs)) < 1e-5
    bufs["y"].fill_(float("nan"))
    plan.execute(**{r: t.data_ptr() for r, t in bufs.items()})
    torch.cuda.synchronize()
    assert ref.rel_err(bufs["y"], ref.fwd(spec, bufs)) < 1e-5


def test_side_stream_and_bind_launch(session):
    spec = _fwd(bias=True, activation="silu")
    plan = session.plan(spec)
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    bufs["y"].fill_(float("nan"))
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        bound = plan.bind(**bufs)
        bound.launch()
        bound.launch()
    side.synchronize()
    assert bound.stream_ptr == side.cuda_stream
    assert ref.rel_err(bufs["y"], ref.fwd(spec, bufs)) < ref.TOLERANCE["float16"]


@pytest.mark.parametrize("role, change, what", [
    ("x", lambda t: t[:, :, :-1], "shape"),
    ("w", lambda t: t.float(), "dtype"),
    ("x", lambda t: t.contiguous(), "strides"),
    ("y", lambda t: t.cpu(), "device"),
    ("bias", lambda t: None, "buffer"),
], ids=["shape", "dtype", "strides", "device", "missing"])
def test_bad_buffers_rejected_before_launch(session, role, change, what):
    spec = _fwd(bias=True, activation="relu")  # channels_last f16
    plan = session.plan(spec)
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    bufs["y"].fill_(float("nan"))
    bufs[role] = change(bufs[role])
    with pytest.raises(BufferMismatchError) as err:
        plan.execute(**bufs)
    assert err.value.role == role and err.value.what == what
    if role != "y":
        assert torch.isnan(bufs["y"]).all()  # nothing launched


FALLBACK_DTYPES = [("float16", "channels_last"), ("bfloat16", "channels_first"), ("float32", "channels_first"),
                   ("float64", "channels_last")]


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("dtype, layout", FALLBACK_DTYPES)
def test_unfused_fwd_epilogue_kernel(unfused, act, dtype, layout):
    spec = _fwd(dtype=dtype, layout=layout, bias=True, residual=True, alpha=0.5, beta=1.5, activation=act)
    plan = _check_fwd(unfused, spec)
    assert not plan.fused and len(plan.parts) == 2


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("dtype, layout", FALLBACK_DTYPES)
def test_unfused_dgrad_act_backward_kernel(unfused, act, dtype, layout):
    _check_dgrad(unfused, _dgrad(dtype=dtype, layout=layout, act=act))


@pytest.mark.parametrize("dtype, layout", DT_LAYOUTS)
def test_bias_grad_any_path(session, dtype, layout):
    _check_wgrad(session, _wgrad(dtype=dtype, layout=layout, bias_grad=True))


def test_fallback_is_reported(session):
    plan = session.plan(_wgrad(bias_grad=True))
    assert plan.fused is False and plan.engines[-1].startswith("kernel:bias_grad")


@pytest.mark.parametrize("dtype, layout", [("float16", "channels_last"), ("bfloat16", "channels_last"),
                                           ("float32", "channels_first")])
def test_depthwise_fwd_with_an_epilogue_runs_the_plain_conv_then_our_epilogue(session, dtype, layout):
    """cuDNN's fused depthwise engines are ~15x slower than its plain depthwise conv (H100, cuDNN 9.19):
    the conv writes the io dtype (as torch's does), then the dense epilogue kernel adds bias, z, act."""
    spec = _fwd(dtype=dtype, layout=layout, c=24, k=24, groups=24, ksize=7, size=13, bias=True, residual=True,
                beta=0.5, activation="gelu")
    plan = _check_fwd(session, spec)
    assert not plan.fused and plan.acc_dtype == dtype, plan.engines
    assert plan.engines[-1].startswith("kernel:epilogue_fwd_dense<"), plan.engines


def test_unfused_epilogue_on_a_padded_output_takes_the_strided_kernel(unfused):
    size, k = 12, 32
    y_strides = (k * size * (size + 3), size * (size + 3), size + 3, 1)  # rows padded by 3: not dense
    spec = _fwd(dtype="float32", layout="channels_first", bias=True, activation="relu", strides={"y": y_strides})
    plan = _check_fwd(unfused, spec)
    assert plan.engines[-1].startswith("kernel:epilogue_fwd<"), plan.engines


BIAS_GRAD_SHAPES = {  # x, w, groups, padding, chunks of rows the channels-last kernel sums in
    "ragged": ((5, 8, 23, 23), (40, 8, 3, 3), 1, 1, 3),  # rows not a multiple of 128, channels of 32
    "one-chunk": ((2, 8, 12, 12), (40, 8, 3, 3), 1, 1, 1),
    "depthwise96": ((8, 96, 56, 56), (96, 1, 7, 7), 96, 3, 25),  # convnext's first stage, batch 8
}


@pytest.mark.parametrize("shape", BIAS_GRAD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype, layout, kernel", [("float16", "channels_last", "bias_grad_chunks"),
                                                   ("bfloat16", "channels_last", "bias_grad_chunks"),
                                                   ("float32", "channels_first", "bias_grad")])
def test_bias_grad_over_many_rows_and_a_ragged_channel_tile(unfused, dtype, layout, kernel, shape):
    """Rows not a multiple of the kernel's 128-row stride, channels not a multiple of its 32-channel tile,
    one chunk of rows or many; the same inputs give the same bits again (a fixed summation order)."""
    x, w, groups, padding, chunks = BIAS_GRAD_SHAPES[shape]
    y = ConvFwdSpec(x, w, padding=padding, groups=groups).y_shape
    spec = ConvBwdFilterSpec(x, y, w, padding=padding, groups=groups, dtype=dtype, layout=layout, bias_grad=True)
    assert epilogue.bias_chunks(math.prod(y) // y[1], y[1])[1] == chunks
    _check_wgrad(unfused, spec)
    plan, bufs = _run(unfused, spec)
    assert plan.engines[-1].startswith(f"kernel:{kernel}<"), plan.engines
    first = bufs["db"].clone()
    bufs["db"].fill_(float("nan"))
    plan.execute(**bufs)
    torch.cuda.synchronize()
    assert torch.equal(first, bufs["db"])
