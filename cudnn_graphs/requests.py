"""Request objects: buffers plus conv parameters; the spec is inferred from the buffers.

A request reads shape, dtype, device and layout (from strides) off its buffers, builds the matching
spec, and allocates any missing output in the inputs' framework (torch for torch tensors, CuPy
otherwise). `Session.run(request)` plans and executes it.
"""

from __future__ import annotations

from typing import Any

from .errors import BufferMismatchError, SpecError
from .execute import buffers as _buffers
from .execute.streams import allocate_like
from .spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, geometry
from .spec.specs import _ConvSpec


_SPECS: dict[tuple, _ConvSpec] = {}
_SPECS_SIZE = 512


class _ConvRequest:
    """Shared machinery: describe buffers, infer layout and strides, allocate outputs."""

    spec_type: type
    primary: str  # the input whose dtype, device and layout set the spec's
    output_roles: tuple[str, ...]

    def __init__(self, buffers: dict[str, Any], params: dict[str, Any]):
        self.buffers = buffers
        self.params = params
        self.infos = {role: self._describe(role, obj) for role, obj in buffers.items() if obj is not None}

    @staticmethod
    def _describe(role: str, obj: Any) -> _buffers.BufferInfo:
        info = _buffers.describe(obj, role)
        if info.framework == "pointer":
            raise BufferMismatchError(role, "type", "a buffer with a shape (tensor or array); raw pointers "
                                      "need an explicit spec and Plan.execute", "int")
        return info

    @property
    def device(self) -> int:
        return self.infos[self.primary].device or 0

    @property
    def framework(self) -> str:
        return self.infos[self.primary].framework

    def spec(self) -> _ConvSpec:
        """The spec these buffers describe (explicit strides where a buffer is not densely packed)."""
        geometry_key = tuple((role, i.shape, i.strides, i.dtype) for role, i in self.infos.items())
        key = (type(self), geometry_key, repr(sorted(self.params.items())), repr(self._extra()))
        spec = _SPECS.get(key)
        if spec is None:
            spec = self._infer_spec()
            if len(_SPECS) >= _SPECS_SIZE:
                _SPECS.clear()  # a training loop repeats a few geometries: a small memo, not a leak
            _SPECS[key] = spec
        return spec

    def _extra(self) -> tuple:
        """Constructor arguments besides buffers and conv params that shape the spec."""
        return ()

    def _infer_spec(self) -> _ConvSpec:
        fields = self._fields()
        info = self.infos[self.primary]
        layout = _layout_of(info.shape, info.strides) or geometry.CHANNELS_FIRST
        strides = {}
        for role, other in self.infos.items():
            if role in self.spec_type.stride_roles and _layout_of(other.shape, other.strides) != layout:
                strides[role] = _explicit(other.shape, other.strides, layout)
        kwargs = {**self.params, **fields, "dtype": info.dtype, "layout": layout, "strides": strides or None}
        return self.spec_type(**kwargs)

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def outputs(self, spec: _ConvSpec) -> dict[str, Any]:
        """Every output buffer: the caller's, else a new one shaped and laid out as the spec says."""
        descs = spec.tensors()
        like = self.buffers[self.primary]
        return {role: self.buffers.get(role) if self.buffers.get(role) is not None
                else allocate_like(descs[role], like=like, framework=self.framework, device=self.device)
                for role in self.output_roles if role in descs}

    def result(self, outputs: dict[str, Any]) -> Any:
        """What `run` returns: the one output, or a tuple in role order."""
        values = tuple(outputs.values())
        return values[0] if len(values) == 1 else values

    def _groups(self, c: int, w_c: int | None) -> dict[str, Any]:
        """groups as given, else C // (C per group) as PyTorch's weight shape implies."""
        if self.params.get("groups") is None and w_c and c % w_c == 0:
            return {"groups": c // w_c}
        return {}


class ConvFwdRequest(_ConvRequest):
    """y = act(alpha * conv(x, w) + bias + beta * z); `groups` defaults to C // w.shape[1]."""

    spec_type = ConvFwdSpec
    primary = "x"
    output_roles = ("y",)

    def __init__(self, x: Any, w: Any, y: Any = None, bias: Any = None, z: Any = None, **conv_params: Any):
        super().__init__({"x": x, "w": w, "bias": bias, "z": z, "y": y}, dict(conv_params))

    def _fields(self) -> dict[str, Any]:
        x, w = self.infos["x"].shape, self.infos["w"].shape
        extra = {"bias": "bias" in self.infos, "residual": "z" in self.infos}
        return {"x_shape": x, "w_shape": w, **self._groups(x[1], w[1] if len(w) > 1 else None), **extra}


class ConvBwdDataRequest(_ConvRequest):
    """dx = dgrad(dy, w) [* act'(pre_act)]; the input size comes from dx, pre_act, x_shape, or the
    smallest input that gives dy (pass `x_shape` when a stride makes it ambiguous)."""

    spec_type = ConvBwdDataSpec
    primary = "dy"
    output_roles = ("dx",)

    def __init__(self, dy: Any, w: Any, dx: Any = None, *, pre_act: Any = None, x_shape: Any = None,
                 **conv_params: Any):
        self.x_shape = x_shape
        super().__init__({"dy": dy, "w": w, "pre_act": pre_act, "dx": dx}, dict(conv_params))

    def _extra(self) -> tuple:
        return (self.x_shape,)

    def _fields(self) -> dict[str, Any]:
        dy, w = self.infos["dy"].shape, self.infos["w"].shape
        x = next((self.infos[r].shape for r in ("dx", "pre_act") if r in self.infos), None) or self.x_shape
        if x is None:
            channels = w[1] * (self.params.get("groups") or 1)  # C = groups * (C per group)
            x = _smallest_input(dy, w, self.params, channels=channels)
        x = geometry.shape("x_shape", x, rank=len(dy))
        return {"dy_shape": dy, "w_shape": w, "x_shape": x, **self._groups(x[1], w[1])}


class ConvBwdFilterRequest(_ConvRequest):
    """dw = wgrad(x, dy) [and db = sum(dy)]; the filter shape comes from dw, w_shape, or (stride 1,
    numeric padding) from x and dy."""

    spec_type = ConvBwdFilterSpec
    primary = "x"
    output_roles = ("dw", "db")

    def __init__(self, x: Any, dy: Any, dw: Any = None, db: Any = None, *, w_shape: Any = None,
                 bias_grad: bool | None = None, **conv_params: Any):
        self.w_shape = w_shape
        self.bias_grad = bias_grad
        super().__init__({"x": x, "dy": dy, "dw": dw, "db": db}, dict(conv_params))

    def _extra(self) -> tuple:
        return (self.w_shape, self.bias_grad)

    def _fields(self) -> dict[str, Any]:
        x, dy = self.infos["x"].shape, self.infos["dy"].shape
        w = self.infos["dw"].shape if "dw" in self.infos else self.w_shape
        if w is None:
            w = _filter_from_sizes(x, dy, self.params)
        w = geometry.shape("w_shape", w, rank=len(x))
        bias_grad = ("db" in self.infos) if self.bias_grad is None else self.bias_grad
        return {"x_shape": x, "dy_shape": dy, "w_shape": w, "bias_grad": bias_grad, **self._groups(x[1], w[1])}


def _layout_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    """channels_first or channels_last when densely packed that way, else None."""
    for layout in (geometry.CHANNELS_FIRST, geometry.CHANNELS_LAST):
        if _buffers.same_layout(strides, geometry.packed_strides(shape, layout), shape):
            return layout
    return None


def _explicit(shape: tuple[int, ...], strides: tuple[int, ...], layout: str) -> tuple[int, ...]:
    packed = geometry.packed_strides(shape, layout)
    return tuple(p if d == 1 else s for s, p, d in zip(strides, packed, shape))


def _smallest_input(dy, w, params: dict[str, Any], *, channels: int) -> tuple[int, ...]:
    nd = len(dy) - 2
    stride = geometry.per_dim("stride", params.get("stride", 1), nd, minimum=1)
    dilation = geometry.per_dim("dilation", params.get("dilation", 1), nd, minimum=1)
    pads = geometry.padding(params.get("padding", 0), nd=nd, stride=stride, dilation=dilation, filter_dims=w[2:])
    spatial = tuple((o - 1) * s - pre - post + d * (k - 1) + 1
                    for o, s, (pre, post), d, k in zip(dy[2:], stride, pads, dilation, w[2:]))
    if any(v <= 0 for v in spatial):
        raise SpecError("x_shape", None, f"no input size gives dy_shape={dy} with these parameters; pass x_shape")
    return (dy[0], channels, *spatial)


def _filter_from_sizes(x, dy, params: dict[str, Any]) -> tuple[int, ...]:
    nd = len(x) - 2
    stride = geometry.per_dim("stride", params.get("stride", 1), nd, minimum=1)
    dilation = geometry.per_dim("dilation", params.get("dilation", 1), nd, minimum=1)
    padding = params.get("padding", 0)
    if any(s != 1 for s in stride) or isinstance(padding, str):
        raise SpecError("w_shape", None, "the filter size is ambiguous from x and dy with a stride or string "
                        "padding; pass dw or w_shape")
    pads = geometry.padding(padding, nd=nd, stride=stride, dilation=dilation, filter_dims=(1,) * nd)
    span = [i + pre + post - o + 1 for i, o, (pre, post) in zip(x[2:], dy[2:], pads)]
    if any(v < 1 or (v - 1) % d for v, d in zip(span, dilation)):
        raise SpecError("w_shape", None, f"no filter maps x_shape={x} to dy_shape={dy}; pass dw or w_shape")
    groups = params.get("groups") or 1
    return (dy[1], x[1] // groups, *((v - 1) // d + 1 for v, d in zip(span, dilation)))
