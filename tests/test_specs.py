"""Spec construction: canonical forms, inferred shapes, and a SpecError naming field and value."""

from __future__ import annotations

import pytest

from cudnn_graphs import (Activation, ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, SpecError,
                          spec_from_dict)

X2, W2 = (2, 8, 9, 9), (4, 8, 3, 3)


@pytest.mark.parametrize("padding, expected", [
    (1, ((1, 1), (1, 1))),
    ((1, 2), ((1, 1), (2, 2))),
    (((0, 1), (2, 3)), ((0, 1), (2, 3))),
    ([[0, 1], 2], ((0, 1), (2, 2))),
    ("valid", ((0, 0), (0, 0))),
    ("same", ((1, 1), (1, 1))),
], ids=["int", "per-dim", "pairs", "mixed", "valid", "same"])
def test_padding_forms(padding, expected):
    assert ConvFwdSpec(X2, W2, padding=padding).padding == expected


def test_same_padding_follows_pytorch_for_even_kernels():
    # PyTorch: total = d*(k-1), left = total // 2, the odd pixel goes to the end.
    spec = ConvFwdSpec((1, 2, 10), (3, 2, 4), padding="same", dilation=1)
    assert spec.padding == ((1, 2),)
    assert spec.y_shape == (1, 3, 10)
    spec = ConvFwdSpec((1, 2, 10), (3, 2, 4), padding="same", dilation=3)
    assert spec.padding == ((4, 5),) and spec.y_shape == (1, 3, 10)


def test_same_padding_rejects_stride():
    with pytest.raises(SpecError) as err:
        ConvFwdSpec(X2, W2, padding="same", stride=2)
    assert err.value.field == "padding"


@pytest.mark.parametrize("x, w, kw, y", [
    ((2, 8, 9, 9), (4, 8, 3, 3), {}, (2, 4, 7, 7)),
    ((2, 8, 9, 9), (4, 8, 3, 3), dict(stride=2, padding=1), (2, 4, 5, 5)),
    ((2, 8, 9, 9), (4, 8, 3, 3), dict(dilation=2, padding=2), (2, 4, 9, 9)),
    ((2, 8, 9, 10), (4, 8, 3, 3), dict(stride=(2, 3), padding=((1, 0), (0, 2))), (2, 4, 4, 4)),
    ((2, 8, 17), (16, 1, 5), dict(groups=8, padding=2), (2, 16, 17)),
    ((1, 4, 5, 6, 7), (8, 2, 3, 3, 3), dict(groups=2, padding=1, stride=(1, 2, 2)), (1, 8, 5, 3, 4)),
    ((3, 32, 7, 7), (32, 1, 3, 3), dict(groups=32, padding=1), (3, 32, 7, 7)),
    ((1, 3, 224, 224), (64, 3, 7, 7), dict(stride=2, padding=3), (1, 64, 112, 112)),
], ids=["plain", "stride", "dilation", "asym", "1d-grouped", "3d", "depthwise", "resnet-stem"])
def test_output_shape(x, w, kw, y):
    assert ConvFwdSpec(x, w, **kw).y_shape == y


@pytest.mark.parametrize("kw, field", [
    (dict(x_shape=(2, 8, 9), w_shape=W2), "w_shape"),
    (dict(x_shape=(2, 8), w_shape=(4, 8)), "x_shape"),
    (dict(x_shape=(2, 8, 1, 1, 1, 1), w_shape=(4, 8, 1, 1, 1, 1)), "x_shape"),
    (dict(x_shape=(2, 0, 9, 9), w_shape=W2), "x_shape"),
    (dict(x_shape=(2, 8, 9, 9.0), w_shape=W2), "x_shape"),
    (dict(x_shape=(2, 8, 9, 9), w_shape=(4, 8, 3, -3)), "w_shape"),
    (dict(x_shape=(2, 8, 2, 2), w_shape=W2), "x_shape"),
    (dict(x_shape=X2, w_shape=(4, 4, 3, 3)), "w_shape"),
    (dict(x_shape=X2, w_shape=(4, 8, 3, 3), groups=3), "groups"),
    (dict(x_shape=X2, w_shape=(6, 2, 3, 3), groups=4), "groups"),
    (dict(x_shape=X2, w_shape=W2, groups=0), "groups"),
    (dict(x_shape=X2, w_shape=W2, stride=0), "stride"),
    (dict(x_shape=X2, w_shape=W2, stride=(1, 1, 1)), "stride"),
    (dict(x_shape=X2, w_shape=W2, dilation=(1, 0)), "dilation"),
    (dict(x_shape=X2, w_shape=W2, padding=-1), "padding"),
    (dict(x_shape=X2, w_shape=W2, padding=(1, 2, 3)), "padding"),
    (dict(x_shape=X2, w_shape=W2, padding=((1, 2, 3), 1)), "padding"),
    (dict(x_shape=X2, w_shape=W2, padding="full"), "padding"),
    (dict(x_shape=X2, w_shape=W2, dtype="int8"), "dtype"),
    (dict(x_shape=X2, w_shape=W2, dtype="float16", compute_dtype="float16"), "compute_dtype"),
    (dict(x_shape=X2, w_shape=W2, dtype="float16", compute_dtype="float64"), "compute_dtype"),
    (dict(x_shape=X2, w_shape=W2, layout="NCDHW"), "layout"),
    (dict(x_shape=X2, w_shape=W2, layout="CHWN"), "layout"),
    (dict(x_shape=X2, w_shape=W2, activation="relu6"), "activation"),
    (dict(x_shape=X2, w_shape=W2, activation=("relu", 0.1)), "activation"),
    (dict(x_shape=X2, w_shape=W2, activation=("softplus", 0.0)), "activation"),
    (dict(x_shape=X2, w_shape=W2, activation=("leaky_relu", float("nan"))), "activation"),
    (dict(x_shape=X2, w_shape=W2, alpha=float("inf")), "alpha"),
    (dict(x_shape=X2, w_shape=W2, beta=0.5), "beta"),
    (dict(x_shape=X2, w_shape=W2, bias=1), "bias"),
    (dict(x_shape=X2, w_shape=W2, strides={"q": (1, 1, 1, 1)}), "strides"),
    (dict(x_shape=X2, w_shape=W2, strides={"x": (1, 1, 1)}), "strides['x']"),
    (dict(x_shape=X2, w_shape=W2, strides={"x": (1, 1, 1, 1)}), "strides['x']"),
    (dict(x_shape=X2, w_shape=W2, strides={"z": (648, 81, 9, 1)}), "strides"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_invalid_fwd_spec_names_field(kw, field):
    with pytest.raises(SpecError) as err:
        ConvFwdSpec(**kw)
    assert err.value.field.startswith(field.split("[")[0])
    assert isinstance(err.value, ValueError)
    assert field.split("[")[0] in str(err.value)


def test_dtype_aliases_and_framework_dtypes():
    np = pytest.importorskip("numpy")
    assert ConvFwdSpec(X2, W2, dtype="half").dtype == "float16"
    assert ConvFwdSpec(X2, W2, dtype=np.float32).dtype == "float32"
    assert ConvFwdSpec(X2, W2, dtype=np.dtype("float64")).dtype == "float64"
    assert ConvFwdSpec(X2, W2, dtype="torch.bfloat16").dtype == "bfloat16"


def test_float64_defaults_to_float64_compute():
    assert ConvFwdSpec(X2, W2, dtype="float64").compute_dtype == "float64"
    assert ConvFwdSpec(X2, W2, dtype="bf16").compute_dtype == "float32"


def test_tf32_flag_only_kept_for_float32():
    assert ConvFwdSpec(X2, W2, allow_tf32=True).allow_tf32 is True
    assert ConvFwdSpec(X2, W2, allow_tf32=False).allow_tf32 is False
    assert ConvFwdSpec(X2, W2, dtype="float16", allow_tf32=True).allow_tf32 is False


@pytest.mark.parametrize("value, expected", [
    (None, Activation("identity")),
    ("swish", Activation("silu")),
    ("gelu_approx_tanh", Activation("gelu_tanh")),
    ("leaky_relu", Activation("leaky_relu", 0.01)),
    (("leaky_relu", 0.2), Activation("leaky_relu", 0.2)),
    ({"name": "elu", "alpha": 0.5}, Activation("elu", 0.5)),
    ("elu", Activation("elu", 1.0)),
    ("softplus", Activation("softplus", 1.0)),
])
def test_activation_forms(value, expected):
    assert ConvFwdSpec(X2, W2, activation=value).activation == expected


def test_layout_strides():
    cf = ConvFwdSpec((2, 3, 4, 5), (6, 3, 1, 1)).tensors()
    cl = ConvFwdSpec((2, 3, 4, 5), (6, 3, 1, 1), layout="NHWC").tensors()
    assert cf["x"].strides == (60, 20, 5, 1)
    assert cl["x"].strides == (60, 1, 15, 3)
    assert cl["w"].strides == (3, 1, 3, 3)
    assert cl["y"].shape == (2, 6, 4, 5) and cl["y"].strides == (120, 1, 30, 6)


def test_explicit_strides_override_one_role():
    # x lives inside a larger allocation (rows padded to 16 elements); the other tensors keep the layout.
    spec = ConvFwdSpec((2, 2, 5, 5), (4, 2, 3, 3), strides={"x": (64 * 16 * 2, 64 * 16, 16, 1)})
    assert spec.tensors()["x"].strides == (2048, 1024, 16, 1)
    assert spec.tensors()["w"].strides == (18, 9, 3, 1)
    assert spec.strides == (("x", (2048, 1024, 16, 1)),)


def test_tensors_by_family():
    fwd = ConvFwdSpec(X2, W2, bias=True, residual=True, activation="relu")
    assert set(fwd.tensors()) == {"x", "w", "bias", "z", "y"}
    assert fwd.tensors()["bias"].shape == (4,)
    dgrad = ConvBwdDataSpec((2, 4, 7, 7), W2, X2, activation_backward="gelu")
    assert set(dgrad.tensors()) == {"dy", "w", "pre_act", "dx"}
    assert dgrad.dx_shape == X2
    wgrad = ConvBwdFilterSpec(X2, (2, 4, 7, 7), W2, bias_grad=True)
    assert set(wgrad.tensors()) == {"x", "dy", "dw", "db"}
    assert wgrad.dw_shape == W2 and wgrad.db_shape == (4,)


def test_bwd_specs_check_dy_against_x():
    with pytest.raises(SpecError) as err:
        ConvBwdDataSpec((2, 4, 8, 8), W2, X2)
    assert err.value.field == "dy_shape"
    with pytest.raises(SpecError) as err:
        ConvBwdFilterSpec(X2, (2, 5, 7, 7), W2)
    assert err.value.field == "dy_shape"
    # Strided convs map several x sizes to one dy: x_shape picks which (PyTorch's output_padding).
    for x in ((2, 8, 9, 9), (2, 8, 10, 10)):
        assert ConvBwdDataSpec((2, 4, 4, 4), W2, x, stride=2).dx_shape == x


def test_specs_are_frozen_and_hashable():
    a = ConvFwdSpec(X2, W2, padding=1, dtype="fp16")
    b = ConvFwdSpec(list(X2), list(W2), padding=[(1, 1), (1, 1)], dtype="float16")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.groups = 2  # type: ignore[misc]


def test_replace_revalidates():
    spec = ConvFwdSpec(X2, W2)
    assert spec.replace(stride=2).y_shape == (2, 4, 4, 4)
    with pytest.raises(SpecError):
        spec.replace(groups=3)


@pytest.mark.parametrize("data, field", [
    ({"schema": 2, "op": "conv_fwd"}, "schema"),
    ({"op": "conv_fwd"}, "schema"),
    ({"schema": 1, "op": "conv_transpose"}, "op"),
    ({"schema": 1, "op": "conv_fwd", "x_shape": [2, 8, 9, 9]}, "w_shape"),
    ({"schema": 1, "op": "conv_fwd", "x_shape": [2, 8, 9, 9], "w_shape": [4, 8, 3, 3], "colour": 1}, "colour"),
    ({"schema": 1, "op": "conv_fwd", "x_shape": [2, 8, 9, 9], "w_shape": [4, 8, 3, 3], "y_shape": [1]}, "y_shape"),
    ({"schema": 1, "op": "conv_fwd", "x_shape": [2, 8, 9, 9], "w_shape": [4, 8, 3, 3],
      "activation": {"name": "elu", "slope": 1}}, "activation"),
    ([1, 2], "spec"),
])
def test_spec_from_dict_rejects(data, field):
    with pytest.raises(SpecError) as err:
        spec_from_dict(data)
    assert err.value.field == field


def test_prologue_and_stats_fields():
    spec = ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1, dtype="float16", prologue="scale_bias_relu", stats=True)
    t = spec.tensors()
    assert t["scale"] == t["shift"] == ((8,), (1,), "float16")  # per input channel, io dtype
    assert t["sum"] == t["sq_sum"] == ((4,), (1,), "float32")  # per output channel
    wgrad = ConvBwdFilterSpec((2, 8, 9, 9), (2, 4, 9, 9), (4, 8, 3, 3), padding=1, prologue="scale_bias_relu")
    assert {"scale", "shift"} <= set(wgrad.tensors())
    with pytest.raises(SpecError) as err:
        ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), prologue="relu")
    assert err.value.field == "prologue" and err.value.value == "relu"
    with pytest.raises(SpecError) as err:
        ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), stats="yes")
    assert err.value.field == "stats"
    with pytest.raises(SpecError, match="plain conv output") as err:  # the unfused epilogue has no statistics
        ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), stats=True, bias=True)
    assert err.value.field == "stats"
