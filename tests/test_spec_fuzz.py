"""Hypothesis fuzz of the conv specs against an independent oracle.

The oracle below re-derives validity and the output size from the raw constructor arguments,
without calling `cudnn_graphs.spec.geometry`: every invalid combination must raise `SpecError`
naming a field that is really at fault, every valid one must construct with the textbook shapes.
A second property checks the dict form round-trips exactly through JSON and msgpack.
"""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cudnn_graphs import (Activation, ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, SpecError,
                          spec_from_dict)

FAMILIES = {"fwd": ConvFwdSpec, "bwd_data": ConvBwdDataSpec, "bwd_filter": ConvBwdFilterSpec}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Spellings the library documents as dtypes, and names it must refuse.
GOOD_DTYPES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16", "FP16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64", "f64": "float64",
    "torch.float16": "float16",
}
BAD_DTYPES = ["int8", "uint8", "int32", "int64", "float8", "fp8", "complex64", "bool", "tf32", "", "floaty"]

LAYOUT_ALIASES = {3: ["NCW", "NWC"], 4: ["NCHW", "NHWC"], 5: ["NCDHW", "NDHWC"]}


# -- the oracle ------------------------------------------------------------------------------

def _is_plain_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _oracle_shape(v, rank=None):
    """The dims if `v` is a well-formed conv shape (of `rank` when given), else None."""
    if not isinstance(v, (tuple, list)) or not all(_is_plain_int(d) for d in v):
        return None
    if rank is None and not 3 <= len(v) <= 5:
        return None
    if rank is not None and len(v) != rank:
        return None
    if any(d < 1 for d in v):
        return None
    return tuple(v)


def _oracle_per_dim(v, nd):
    """stride/dilation: an int or nd ints; None if malformed."""
    if _is_plain_int(v):
        return (v,) * nd
    if isinstance(v, (tuple, list)) and len(v) == nd and all(_is_plain_int(e) for e in v):
        return tuple(v)
    return None


def _oracle_padding(v, nd):
    """(pre, post) per dim from an int, nd ints, or nd ints-or-pairs; None if malformed."""
    if _is_plain_int(v):
        return ((v, v),) * nd
    if not isinstance(v, (tuple, list)) or len(v) != nd:
        return None
    out = []
    for e in v:
        if _is_plain_int(e):
            out.append((e, e))
        elif isinstance(e, (tuple, list)) and len(e) == 2 and all(_is_plain_int(p) for p in e):
            out.append((e[0], e[1]))
        else:
            return None
    return tuple(out)


@dataclasses.dataclass
class Verdict:
    faults: dict  # reason -> set of field names the library may blame for it
    pads: tuple | None = None
    stride: tuple | None = None
    dilation: tuple | None = None
    out_spatial: tuple | None = None  # textbook output size, when the geometry is computable

    @property
    def valid(self) -> bool:
        return not self.faults

    def blamable(self) -> set:
        return set().union(*self.faults.values()) if self.faults else set()


def oracle(x_shape, w_shape, padding, stride, dilation, groups, dtype) -> Verdict:
    faults: dict = {}
    v = Verdict(faults)
    x = _oracle_shape(x_shape)
    if x is None:
        faults["x_shape malformed"] = {"x_shape"}
        return v  # nothing else is meaningful without x
    nd = len(x) - 2
    w = _oracle_shape(w_shape, rank=len(x))
    if w is None:
        faults["w_shape malformed"] = {"w_shape"}
    v.stride = s = _oracle_per_dim(stride, nd)
    if s is None or any(e < 1 for e in s):
        faults["stride"] = {"stride"}
    v.dilation = d = _oracle_per_dim(dilation, nd)
    if d is None or any(e < 1 for e in d):
        faults["dilation"] = {"dilation"}
    v.pads = pads = _oracle_padding(padding, nd)
    if pads is None or any(p < 0 for pair in pads for p in pair):
        faults["padding"] = {"padding"}
    if not _is_plain_int(groups) or groups < 1:
        faults["groups < 1"] = {"groups"}
    elif w is not None:
        c, k, cpg = x[1], w[0], w[1]
        if c % groups:
            faults["groups does not divide C"] = {"groups", "x_shape"}
        if k % groups:
            faults["groups does not divide K"] = {"groups", "w_shape"}
        if cpg * groups != c:
            faults["w_shape[1] != C/groups"] = {"groups", "w_shape", "x_shape"}
    if dtype not in GOOD_DTYPES:
        faults["dtype"] = {"dtype"}
    if (w is not None and s is not None and d is not None and pads is not None
            and all(e >= 1 for e in s) and all(e >= 1 for e in d)):
        v.out_spatial = out = tuple((i + pre + post - dd * (kk - 1) - 1) // ss + 1
                                    for i, kk, (pre, post), ss, dd in zip(x[2:], w[2:], pads, s, d))
        if any(o < 1 for o in out):
            faults["empty output"] = {"x_shape", "w_shape", "padding", "stride", "dilation"}
    return v


# -- strategies ------------------------------------------------------------------------------

@st.composite
def conv_args(draw, valid_only: bool = False):
    """Raw constructor arguments for a conv, mostly valid, with faults injected now and then."""

    def fault() -> bool:
        return not valid_only and draw(st.integers(0, 13)) == 0

    rank = draw(st.integers(3, 5))
    if fault():
        rank = draw(st.sampled_from([1, 2, 6]))
    nd = max(rank - 2, 1)
    g = draw(st.integers(1, 3))
    c = g * draw(st.integers(1, 3))
    k = g * draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 4)) for _ in range(nd)]
    dil = [draw(st.integers(1, 3)) for _ in range(nd)]
    strd = [draw(st.integers(1, 3)) for _ in range(nd)]
    pads = [(draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(nd)]
    fit = valid_only or draw(st.integers(0, 4)) > 0  # otherwise the output may come out empty
    pad_fault = draw(st.sampled_from(["negative_int", "negative_pair", "length"])) if fault() else None
    margin = 2 if pad_fault else 0  # room for a -1 pad, so only the sign of the padding is wrong
    spatial = []
    for kk, dd, (pre, post) in zip(kernel, dil, pads):
        need = max(1, dd * (kk - 1) + 1 - pre - post)
        spatial.append(need + margin + draw(st.integers(0, 6)) if fit else draw(st.integers(1, 6)))
    n = draw(st.integers(1, 3))

    x_shape = [n, c, *spatial][:rank]
    if fault():
        x_shape[draw(st.integers(0, len(x_shape) - 1))] = draw(st.integers(-2, 0))
    w_shape = [k, c // g, *kernel][:rank]
    if fault():
        w_shape = w_shape + [1] if draw(st.booleans()) else w_shape[:-1]  # wrong rank
    if len(w_shape) > 1 and fault():
        w_shape[1] += draw(st.sampled_from([-1, 1]))  # wrong C/groups (maybe 0)
    if w_shape and fault():
        w_shape[draw(st.integers(0, len(w_shape) - 1))] = draw(st.integers(-2, 0))

    groups = g
    if fault():
        groups = draw(st.sampled_from([0, -1, g + 1, 2 * g, 4]))

    seq = draw(st.sampled_from([list, tuple]))
    stride = strd[0] if len(set(strd)) == 1 and draw(st.booleans()) else seq(strd)
    if fault():
        stride = draw(st.sampled_from([0, -1, seq([0] * nd), seq([1] * (nd - 1) + [0])]))
    dilation = dil[0] if len(set(dil)) == 1 and draw(st.booleans()) else seq(dil)
    if fault():
        dilation = draw(st.sampled_from([0, -2, seq([1] * (nd - 1) + [0])]))

    form = draw(st.sampled_from(["int", "per_dim", "pairs", "mixed"]))
    symmetric = all(pre == post for pre, post in pads)
    if form == "int" and symmetric and len(set(pads)) == 1:
        padding = pads[0][0]
    elif form in ("int", "per_dim") and symmetric:
        padding = seq(pre for pre, _ in pads)
    elif form == "mixed":
        padding = seq(pre if pre == post and draw(st.booleans()) else seq((pre, post)) for pre, post in pads)
    else:
        padding = seq(seq(pair) for pair in pads)
    if pad_fault == "negative_int":
        padding = -1
    elif pad_fault == "negative_pair":
        padding = [list(pair) for pair in pads]
        padding[draw(st.integers(0, nd - 1))][draw(st.integers(0, 1))] = -1
    elif pad_fault == "length":
        padding = [0] * (nd + 1)

    dtype = draw(st.sampled_from(sorted(GOOD_DTYPES) + ([] if valid_only else BAD_DTYPES[:3])))
    if fault():
        dtype = draw(st.sampled_from(BAD_DTYPES))
    return dict(x_shape=x_shape, w_shape=w_shape, padding=padding, stride=stride, dilation=dilation,
                groups=groups, dtype=dtype)


def _dy_for(args, verdict: Verdict):
    """The dy the forward conv produces, or a well-formed placeholder when there is none."""
    if verdict.out_spatial is not None and all(o >= 1 for o in verdict.out_spatial):
        return [args["x_shape"][0], args["w_shape"][0], *verdict.out_spatial], False
    return [1] * max(len(args["x_shape"]), 3), True


def build(family: str, args: dict, dy=None, **extra):
    common = {k: args[k] for k in ("padding", "stride", "dilation", "groups", "dtype")}
    common.update(extra)
    if family == "fwd":
        return ConvFwdSpec(args["x_shape"], args["w_shape"], **common)
    if family == "bwd_data":
        return ConvBwdDataSpec(dy, args["w_shape"], args["x_shape"], **common)
    return ConvBwdFilterSpec(args["x_shape"], dy, args["w_shape"], **common)


def _init_fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _base_field(name: str) -> str:
    """'strides['x']' -> 'strides', 'activation.beta' -> 'activation'."""
    return name.split("[")[0].split(".")[0]


# -- validity vs the oracle --------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
@FUZZ
@given(args=conv_args(), data=st.data())
def test_spec_validity_matches_oracle(family, args, data):
    verdict = oracle(**args)
    dy, placeholder = _dy_for(args, verdict)
    event("valid" if verdict.valid else f"invalid ({len(verdict.faults)} faults)")
    for reason in verdict.faults:
        event(f"fault: {reason}")
    if not verdict.valid:
        with pytest.raises(SpecError) as info:
            build(family, args, dy)
        err = info.value
        assert isinstance(err, ValueError)
        assert _base_field(err.field) in _init_fields(FAMILIES[family]), err
        blamable = verdict.blamable() | ({"dy_shape"} if family != "fwd" and placeholder else set())
        assert err.field in blamable, f"{err} (oracle faults: {verdict.faults})"
        return

    spec = build(family, args, dy)
    expected_out = (args["x_shape"][0], args["w_shape"][0], *verdict.out_spatial)
    assert spec.padding == verdict.pads
    assert spec.stride == verdict.stride
    assert spec.dilation == verdict.dilation
    assert spec.groups == args["groups"]
    assert spec.dtype == GOOD_DTYPES[args["dtype"]]
    assert spec.x_shape == tuple(args["x_shape"])
    assert spec.w_shape == tuple(args["w_shape"])
    if family == "fwd":
        assert spec.y_shape == expected_out
        return
    assert spec.dy_shape == expected_out
    # dy off by one in one spatial dim (down to 0 included) is refused, naming dy_shape.
    bad_dy = list(expected_out)
    axis = data.draw(st.integers(2, len(bad_dy) - 1), label="axis")
    bad_dy[axis] += data.draw(st.sampled_from([-1, 1]), label="delta")
    with pytest.raises(SpecError) as info:
        build(family, args, bad_dy)
    assert info.value.field == "dy_shape", info.value


# -- dict round trips ----------------------------------------------------------------------------

def _dense_strides(dims, order):
    """Packed strides with axes laid out slowest to fastest in `order`."""
    strides = [0] * len(dims)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims[axis]
    return strides


finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def activations(draw):
    name = draw(st.sampled_from(["identity", "relu", "gelu", "gelu_tanh", "silu", "swish", "sigmoid", "tanh",
                                 "leaky_relu", "elu", "softplus", "none"]))
    param = None
    if name in ("leaky_relu", "elu"):
        param = draw(st.none() | finite)
    elif name == "softplus":
        param = draw(st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False))
    form = draw(st.sampled_from(["plain", "pair", "dict", "object"]))
    if form == "pair" and param is not None:
        return (name, param)
    if form == "dict":
        key = {"leaky_relu": "negative_slope", "elu": "alpha", "softplus": "beta"}.get(name)
        return {"name": name, key: param} if key and param is not None else {"name": name}
    if form == "object":
        return Activation(name, param)
    return None if name == "identity" and draw(st.booleans()) else name if param is None else (name, param)


@st.composite
def valid_specs(draw, family: str):
    args = draw(conv_args(valid_only=True))
    verdict = oracle(**args)
    assert verdict.valid, verdict.faults
    dy = [args["x_shape"][0], args["w_shape"][0], *verdict.out_spatial]
    rank = len(args["x_shape"])
    canonical = GOOD_DTYPES[args["dtype"]]
    extra = dict(
        allow_tf32=draw(st.booleans()),
        layout=draw(st.sampled_from(["channels_first", "channels_last", *LAYOUT_ALIASES[rank]])),
    )
    if draw(st.booleans()):
        extra["compute_dtype"] = draw(st.sampled_from(
            ["float64", "fp64"] if canonical == "float64" else ["float32", "fp32"]))
    shapes = {"x": args["x_shape"], "w": args["w_shape"], "y": dy, "z": dy,
              "dy": dy, "dx": args["x_shape"], "pre_act": args["x_shape"], "dw": args["w_shape"]}
    if family == "fwd":
        extra["bias"] = draw(st.booleans())
        extra["activation"] = draw(activations())
        extra["residual"] = draw(st.booleans())
        extra["alpha"] = draw(finite)
        extra["beta"] = draw(finite) if extra["residual"] else 1.0
        present = ["x", "w", "y"] + (["z"] if extra["residual"] else [])
    elif family == "bwd_data":
        extra["activation_backward"] = draw(activations())
        present = ["dy", "w", "dx"]
        if not Activation(*_act_args(extra["activation_backward"])).is_identity:
            present.append("pre_act")
    else:
        extra["bias_grad"] = draw(st.booleans())
        present = ["x", "dy", "dw"]
    if draw(st.booleans()):
        roles = draw(st.lists(st.sampled_from(present), min_size=1, max_size=2, unique=True))
        extra["strides"] = {
            role: _dense_strides(shapes[role], draw(st.permutations(list(range(rank))))) for role in roles
        }
    return build(family, args, dy, **extra)


def _act_args(value):
    if value is None:
        return ("identity",)
    if isinstance(value, Activation):
        return (value.name, value.param)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, dict):
        return (value["name"], *[v for k, v in value.items() if k != "name"])
    return tuple(value)


def _canonical(d) -> str:
    return json.dumps(d, sort_keys=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@FUZZ
@given(data=st.data())
def test_dict_round_trip(family, data):
    spec = data.draw(valid_specs(family), label="spec")
    d = spec.to_dict()
    again = spec_from_dict(d)
    assert again == spec and hash(again) == hash(spec)
    assert again.to_dict() == d
    if family == "fwd":
        assert again.y_shape == spec.y_shape

    via_json = json.loads(json.dumps(d))
    assert via_json == d and _canonical(via_json) == _canonical(d)  # no int/float or list/tuple drift
    from_json = spec_from_dict(via_json)
    assert from_json == spec and hash(from_json) == hash(spec)

    via_msgpack = msgpack.unpackb(msgpack.packb(d))
    assert via_msgpack == d and _canonical(via_msgpack) == _canonical(d)
    from_msgpack = spec_from_dict(via_msgpack)
    assert from_msgpack == spec and hash(from_msgpack) == hash(spec)

    # Re-spelling the normalised fields builds an equal spec with an equal hash.
    respelled = dataclasses.replace(spec, padding=[list(p) for p in spec.padding], stride=list(spec.stride),
                                    dilation=list(spec.dilation))
    assert respelled == spec and hash(respelled) == hash(spec)
