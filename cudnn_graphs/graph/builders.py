"""One builder per op family: spec -> validated cuDNN pygraph(s) with fixed tensor uids.

A fused build is one graph (conv + epilogue). An unfused build splits it where cuDNN may lack a
fused engine: the conv writes an `acc` tensor in the compute dtype, then a pointwise or reduction
graph finishes the epilogue; results match the fused graph up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UnsupportedGraphError
from ..spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, TensorDesc
from ..spec import geometry
from . import frontend
from .activations import activation_backward, activation_forward

# Stable uids per tensor role: plans serialized by one version bind buffers in any later one.
ROLE_UIDS = {"x": 1, "w": 2, "bias": 3, "z": 4, "y": 5, "dy": 6, "dx": 7, "dw": 8, "db": 9,
             "pre_act": 10, "acc": 11, "scale": 12, "shift": 13, "sum": 14, "sq_sum": 15}
SCALAR_UID_BASE = 100


@dataclass
class Scalars:
    """Pass-by-value scalars of one graph: uid -> value, supplied at every execute."""

    dtype: str
    values: dict[int, float] = field(default_factory=dict)

    def const(self, graph: Any, value: float, name: str) -> Any:
        uid = SCALAR_UID_BASE + len(self.values)
        self.values[uid] = float(value)
        return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                            data_type=frontend.data_type(self.dtype), is_pass_by_value=True, uid=uid)


@dataclass
class GraphPart:
    """One cuDNN graph of a build, the roles it binds and the scalars it needs."""

    name: str
    graph: Any = field(repr=False)
    roles: tuple[str, ...]
    scalars: dict[int, float]

    @property
    def uids(self) -> dict[str, int]:
        return {role: ROLE_UIDS[role] for role in self.roles}


@dataclass
class GraphBuild:
    """A spec's graphs, in execution order; `intermediates` are buffers passed between parts."""

    spec: Any
    fused: bool
    parts: tuple[GraphPart, ...]
    intermediates: dict[str, TensorDesc]


def build_graph(spec, *, fused: bool = True, handle: Any = None, acc_dtype: str | None = None) -> GraphBuild:
    """Build and validate the graph(s) of `spec`; `handle=None` builds on the CPU for inspection.

    `acc_dtype` is the dtype of the `acc` intermediate of an unfused build (default: compute dtype).
    """
    builder = _BUILDERS.get(type(spec))
    if builder is None:
        raise TypeError(f"no graph builder for {type(spec).__name__}")
    build = builder(spec, fused=fused or not spec.has_epilogue, handle=handle, acc_dtype=acc_dtype or spec.compute_dtype)
    for part in build.parts:
        try:
            part.graph.validate()
        except Exception as err:  # the frontend raises its own types; keep its message
            raise UnsupportedGraphError(spec, f"{part.name}: {err}") from err
    return build


# -- tensor descriptions in cuDNN's terms --------------------------------------------------------

def cudnn_dims(desc: TensorDesc) -> tuple[list[int], list[int]]:
    """cuDNN needs >= 4-D tensors: a 1-D conv runs as 2-D with H = 1 (as PyTorch does)."""
    dims, strides = list(desc.shape), list(desc.strides)
    if len(dims) == 3:
        dims.insert(2, 1)
        strides.insert(2, strides[2] * dims[3])
    return dims, strides


def _conv_params(spec) -> dict[str, list[int]]:
    pre = [p for p, _ in spec.padding]
    post = [p for _, p in spec.padding]
    stride, dilation = list(spec.stride), list(spec.dilation)
    if spec.nd == 1:
        pre, post, stride, dilation = [0, *pre], [0, *post], [1, *stride], [1, *dilation]
    return {"pre_padding": pre, "post_padding": post, "stride": stride, "dilation": dilation}


def _channel_dims(spec, k: int) -> tuple[list[int], list[int]]:
    rank = max(4, spec.nd + 2)
    return [1, k] + [1] * (rank - 2), [k, 1] + [k] * (rank - 2)


class _Builder:
    """Creates one graph and its io tensors with uids, names and dtypes set."""

    def __init__(self, spec, name: str, handle: Any, io_dtype: str | None = None):
        self.spec = spec
        self.name = name
        self.graph = frontend.new_graph(io_dtype=io_dtype or spec.dtype, compute_dtype=spec.compute_dtype,
                                        handle=handle, name=name)
        self.scalars = Scalars(spec.compute_dtype)
        self.roles: list[str] = []

    def input(self, role: str, desc: TensorDesc) -> Any:
        dims, strides = cudnn_dims(desc)
        return self._tensor(role, dims, strides, desc.dtype)

    def channel_input(self, role: str, k: int) -> Any:
        dims, strides = _channel_dims(self.spec, k)
        return self._tensor(role, dims, strides, self.spec.dtype)

    def _tensor(self, role, dims, strides, dtype) -> Any:
        self.roles.append(role)
        return self.graph.tensor(name=role, dim=dims, stride=strides,
                                 data_type=frontend.data_type(dtype), uid=ROLE_UIDS[role])

    def output(self, tensor: Any, role: str, desc: TensorDesc | None = None, *, dims=None, strides=None,
               dtype: str | None = None) -> None:
        if desc is not None:
            dims, strides = cudnn_dims(desc)
            dtype = desc.dtype
        else:
            dtype = dtype or self.spec.dtype
        # Always explicit: FE versions infer different output strides (NCHW vs NHWC) otherwise.
        tensor.set_output(True).set_name(role).set_uid(ROLE_UIDS[role])
        tensor.set_data_type(frontend.data_type(dtype)).set_dim(list(dims)).set_stride(list(strides))
        self.roles.append(role)

    def prologue(self, x: Any) -> Any:
        """relu(x * scale + shift) per input channel, as the spec's prologue says, else x."""
        if self.spec.prologue is None:
            return x
        c = self.spec.x_shape[1]
        g = self.graph
        scaled = g.scale(input=x, scale=self.channel_input("scale", c), name="prologue_scale")
        return g.relu(input=g.bias(input=scaled, bias=self.channel_input("shift", c), name="prologue_shift"),
                      name="prologue_relu")

    def part(self) -> GraphPart:
        return GraphPart(self.name, self.graph, tuple(self.roles), dict(self.scalars.values))


def _acc_desc(spec, desc: TensorDesc, acc_dtype: str) -> TensorDesc:
    """The intermediate between unfused parts: same shape, the layout's packed strides."""
    return TensorDesc(desc.shape, geometry.packed_strides(desc.shape, spec.layout), acc_dtype)


def _compute(spec) -> Any:
    return frontend.data_type(spec.compute_dtype)


# -- forward ---------------------------------------------------------------------------------------

def _fwd(spec: ConvFwdSpec, *, fused: bool, handle: Any, acc_dtype: str) -> GraphBuild:
    t = spec.tensors()
    conv = _Builder(spec, "conv_fwd" + ("+epilogue" if fused and spec.has_epilogue else ""), handle)
    out = conv.graph.conv_fprop(image=conv.prologue(conv.input("x", t["x"])), weight=conv.input("w", t["w"]),
                                compute_data_type=_compute(spec), name="conv", **_conv_params(spec))
    if fused:
        y = _fwd_epilogue(conv, spec, out, t)
        conv.output(y, "y", t["y"])
        if spec.stats:
            _genstats(conv, spec, y)
        return GraphBuild(spec, True, (conv.part(),), {})
    acc = _acc_desc(spec, t["y"], acc_dtype)
    conv.output(out, "acc", acc)
    epi = _Builder(spec, "fwd_epilogue", handle)
    epi.output(_fwd_epilogue(epi, spec, epi.input("acc", acc), t), "y", t["y"])
    return GraphBuild(spec, False, (conv.part(), epi.part()), {"acc": acc})


def _fwd_epilogue(b: _Builder, spec: ConvFwdSpec, value: Any, t: dict[str, TensorDesc]) -> Any:
    g = b.graph
    if spec.alpha != 1.0:
        value = g.scale(input=value, scale=b.scalars.const(g, spec.alpha, "alpha"), name="alpha")
    if spec.bias:
        value = g.bias(input=value, bias=b.channel_input("bias", spec.w_shape[0]), name="bias")
    if spec.residual:
        z = b.input("z", t["z"])
        if spec.beta != 1.0:
            z = g.scale(input=z, scale=b.scalars.const(g, spec.beta, "beta"), name="beta")
        value = g.add(a=value, b=z, name="residual")
    return activation_forward(g, value, spec.activation, b.scalars)


def _genstats(b: _Builder, spec: ConvFwdSpec, y: Any) -> None:
    """The per-channel sum and sum of squares of y, in float32, from the conv's own epilogue."""
    total, squares = b.graph.genstats(input=y, name="stats")
    dims, strides = _channel_dims(spec, spec.w_shape[0])
    for tensor, role in ((total, "sum"), (squares, "sq_sum")):
        b.output(tensor, role, dims=dims, strides=strides, dtype="float32")


# -- backward data ---------------------------------------------------------------------------------

def _dgrad(spec: ConvBwdDataSpec, *, fused: bool, handle: Any, acc_dtype: str) -> GraphBuild:
    t = spec.tensors()
    epilogue = _DGRAD_EPILOGUE[(not spec.activation_backward.is_identity, spec.residual)]
    conv = _Builder(spec, "conv_bwd_data" + (f"+{epilogue}" if fused and spec.has_epilogue else ""), handle)
    dx = conv.graph.conv_dgrad(loss=conv.input("dy", t["dy"]), filter=conv.input("w", t["w"]),
                               compute_data_type=_compute(spec), name="dgrad", **_conv_params(spec))
    if not spec.has_epilogue:
        conv.output(dx, "dx", t["dx"])
        return GraphBuild(spec, True, (conv.part(),), {})
    acc = _acc_desc(spec, t["dx"], acc_dtype)
    if fused:
        dims, strides = cudnn_dims(acc)
        dx.set_dim(dims).set_stride(strides)  # virtual, but dgrad cannot infer dx's extent alone
        conv.output(_dgrad_epilogue(conv, spec, t, dx), "dx", t["dx"])
        return GraphBuild(spec, True, (conv.part(),), {})
    conv.output(dx, "acc", acc)
    epi = _Builder(spec, epilogue, handle)
    epi.output(_dgrad_epilogue(epi, spec, t, epi.input("acc", acc)), "dx", t["dx"])
    return GraphBuild(spec, False, (conv.part(), epi.part()), {"acc": acc})


# The epilogue part's name by (activation backward, residual): "act_backward" names the fallback kernel of
# the first (plan/parts.py); the others have none, so an unfused build with an io-dtype acc is declined.
_DGRAD_EPILOGUE = {(False, False): "", (True, False): "act_backward", (False, True): "residual_backward",
                   (True, True): "act_residual_backward"}


def _dgrad_epilogue(b: "_Builder", spec: ConvBwdDataSpec, t: dict, dx: Any) -> Any:
    """dx [* act'(pre_act)] [+ z] in graph b."""
    if not spec.activation_backward.is_identity:
        dx = activation_backward(b.graph, dx, b.input("pre_act", t["pre_act"]), spec.activation_backward, b.scalars)
    if spec.residual:
        dx = b.graph.add(a=dx, b=b.input("z", t["z"]), name="residual")
    return dx


# -- backward filter -------------------------------------------------------------------------------

def _wgrad(spec: ConvBwdFilterSpec, *, fused: bool, handle: Any, acc_dtype: str) -> GraphBuild:
    t = spec.tensors()
    conv = _Builder(spec, "conv_bwd_filter" + ("+bias_grad" if fused and spec.bias_grad else ""), handle)
    dy = conv.input("dy", t["dy"])
    dw = conv.graph.conv_wgrad(image=conv.prologue(conv.input("x", t["x"])), loss=dy,
                               compute_data_type=_compute(spec), name="wgrad", **_conv_params(spec))
    conv.output(dw, "dw", t["dw"])
    if not spec.bias_grad:
        return GraphBuild(spec, True, (conv.part(),), {})
    if fused:
        _bias_grad(conv, spec, dy)
        return GraphBuild(spec, True, (conv.part(),), {})
    red = _Builder(spec, "bias_grad", handle)
    _bias_grad(red, spec, red.input("dy", t["dy"]))
    return GraphBuild(spec, False, (conv.part(), red.part()), {})


def _bias_grad(b: _Builder, spec: ConvBwdFilterSpec, dy: Any) -> None:
    fe = frontend.cudnn()
    db = b.graph.reduction(input=dy, mode=fe.reduction_mode.ADD, compute_data_type=_compute(spec), name="bias_grad")
    dims, strides = _channel_dims(spec, spec.w_shape[0])
    b.output(db, "db", dims=dims, strides=strides)


_BUILDERS: dict[type, Callable[..., GraphBuild]] = {
    ConvFwdSpec: _fwd, ConvBwdDataSpec: _dgrad, ConvBwdFilterSpec: _wgrad,
}
