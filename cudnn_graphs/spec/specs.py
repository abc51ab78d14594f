"""Op specs: frozen, hashable descriptions of one convolution and its fused epilogue.

Constructors normalise every field to one canonical form (padding as (pre, post) pairs, dtypes by
canonical name, activations as `Activation`), so equal convolutions compare and hash equal and
their signatures match.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from gpu_launch.activations import as_activation, finite_number

from ..errors import SpecError
from . import dtypes, geometry


class TensorDesc(NamedTuple):
    """One tensor of an op: logical shape, memory strides (in elements) and dtype."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, kw_only=True)
class _ConvSpec:
    """Fields every conv op family shares; subclasses add their shapes and epilogue."""

    op: ClassVar[str]
    stride_roles: ClassVar[tuple[str, ...]]

    padding: Any = 0
    stride: Any = 1
    dilation: Any = 1
    groups: int = 1
    dtype: Any = dtypes.FLOAT32
    compute_dtype: Any = None
    allow_tf32: bool = True
    layout: str = geometry.CHANNELS_FIRST
    strides: Any = None

    # -- normalisation -----------------------------------------------------------------------
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _normalize_common(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
        nd = len(x_shape) - 2
        stride, padding, dilation = geometry.conv_arguments(nd, self.stride, self.padding, self.dilation,
                                                            filter_dims=w_shape[2:])
        self._set("stride", stride)
        self._set("dilation", dilation)
        self._set("padding", padding)
        self._normalize_groups(x_shape, w_shape)
        self._normalize_dtypes()
        self._set("layout", geometry.canonical_layout(self.layout, len(x_shape)))

    def _normalize_groups(self, x_shape, w_shape) -> None:
        g = geometry.groups(self.groups)
        self._set("groups", g)
        if x_shape[1] % g:
            raise SpecError("groups", g, f"input channels C={x_shape[1]} do not divide by groups")
        if w_shape[0] % g:
            raise SpecError("groups", g, f"output channels K={w_shape[0]} do not divide by groups")
        if w_shape[1] * g != x_shape[1]:
            hint = ""
            if x_shape[-1] == w_shape[1] * g:  # channels in the last place: the shape was written in NHWC order
                hint = (f"; shapes are logical (N, C, *spatial) whatever the layout: x_shape {x_shape} looks like "
                        f"it is in channels-last order, try {(x_shape[0], x_shape[-1], *x_shape[1:-1])}")
            raise SpecError("w_shape", w_shape,
                            f"w_shape[1] must be C/groups = {x_shape[1]}/{g} = {x_shape[1] // g}{hint}")

    def _normalize_dtypes(self) -> None:
        dtype = dtypes.canonical_dtype("dtype", self.dtype)
        compute = (dtypes.default_compute_dtype(dtype) if self.compute_dtype is None
                   else dtypes.canonical_dtype("compute_dtype", self.compute_dtype))
        dtypes.check_compute_dtype(dtype, compute)
        if not isinstance(self.allow_tf32, bool):
            raise SpecError("allow_tf32", self.allow_tf32, "expected True or False")
        self._set("dtype", dtype)
        self._set("compute_dtype", compute)
        # TF32 only exists for float32 data; one canonical value elsewhere keeps signatures equal.
        self._set("allow_tf32", self.allow_tf32 and dtype == dtypes.FLOAT32)

    def _normalize_strides(self, ranks: dict[str, int]) -> None:
        self._set("strides", geometry.explicit_strides(self.strides, ranks))

    # -- shared views --------------------------------------------------------------------------
    @property
    def nd(self) -> int:
        """Number of spatial dims (1, 2 or 3)."""
        return len(self.padding)

    def _desc(self, role: str, dims: tuple[int, ...]) -> TensorDesc:
        explicit = dict(self.strides).get(role)
        strides = explicit or geometry.packed_strides(dims, self.layout)
        return TensorDesc(dims, strides, self.dtype)

    def _check_explicit_strides(self, descs: dict[str, TensorDesc]) -> None:
        for role, strides in self.strides:
            if role not in descs:
                raise SpecError("strides", dict(self.strides), f"this spec has no {role!r} tensor")
            geometry.check_no_overlap(f"strides[{role!r}]", descs[role].shape, strides)

    def tensors(self) -> dict[str, TensorDesc]:
        """Every tensor the op reads or writes, by role name."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        from .serialize import spec_to_dict

        return spec_to_dict(self)

    def replace(self, **changes: Any):
        """A copy with some fields changed (and re-validated)."""
        return dataclasses.replace(self, **changes)


def flag(field_name: str, value: Any) -> bool:
    """`value` if it is True or False, else SpecError naming the field (bool("no") is True: never cast)."""
    if not isinstance(value, bool):
        raise SpecError(field_name, value, "expected True or False")
    return value


@dataclass(frozen=True)
class ConvFwdSpec(_ConvSpec):
    """Forward conv with the epilogue y = act(alpha * conv(x, w) + bias + beta * z)."""

    op: ClassVar[str] = "conv_fwd"
    stride_roles: ClassVar[tuple[str, ...]] = ("x", "w", "z", "y")

    x_shape: Any
    w_shape: Any
    bias: bool = field(default=False, kw_only=True)
    activation: Any = field(default=None, kw_only=True)
    residual: bool = field(default=False, kw_only=True)
    alpha: float = field(default=1.0, kw_only=True)
    beta: float = field(default=1.0, kw_only=True)
    prologue: Any = field(default=None, kw_only=True)
    stats: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        x = geometry.shape("x_shape", self.x_shape)
        w = geometry.shape("w_shape", self.w_shape, rank=len(x))
        self._set("x_shape", x)
        self._set("w_shape", w)
        self._normalize_common(x, w)
        self._set("bias", flag("bias", self.bias))
        self._set("residual", flag("residual", self.residual))
        self._set("activation", as_activation("activation", self.activation))
        self._set("alpha", finite_number("alpha", self.alpha))
        self._set("beta", finite_number("beta", self.beta))
        if not self.residual and self.beta != 1.0:
            raise SpecError("beta", self.beta, "beta scales the residual z: set residual=True or leave beta=1.0")
        self._set("prologue", _prologue(self.prologue))
        self._set("stats", flag("stats", self.stats))
        if self.stats and self.has_epilogue:  # the unfused build's epilogue part has no statistics
            raise SpecError("stats", True, "statistics are of the plain conv output: use them without bias, "
                            "residual, activation or alpha")
        self._set("y_shape", _output_shape(self, x, w, "x_shape"))
        self._normalize_strides({role: len(x) for role in self.stride_roles})
        self._check_explicit_strides(self.tensors())

    y_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)

    @property
    def bias_shape(self) -> tuple[int]:
        return (self.w_shape[0],)

    @property
    def has_epilogue(self) -> bool:
        return self.bias or self.residual or self.alpha != 1.0 or not self.activation.is_identity

    def tensors(self) -> dict[str, TensorDesc]:
        out = {"x": self._desc("x", self.x_shape), "w": self._desc("w", self.w_shape)}
        if self.bias:
            out["bias"] = TensorDesc(self.bias_shape, (1,), self.dtype)
        if self.residual:
            out["z"] = self._desc("z", self.y_shape)
        out.update(_prologue_operands(self))
        out["y"] = self._desc("y", self.y_shape)
        if self.stats:
            out.update({role: TensorDesc(self.bias_shape, (1,), dtypes.FLOAT32) for role in STATS_ROLES})
        return out


@dataclass(frozen=True)
class ConvBwdDataSpec(_ConvSpec):
    """Data gradient dx = dgrad(dy, w), optionally times act'(pre_act) of the forward activation, optionally
    plus z: the gradient x also receives by another path (a residual connection's), added in the epilogue."""

    op: ClassVar[str] = "conv_bwd_data"
    stride_roles: ClassVar[tuple[str, ...]] = ("dy", "w", "dx", "pre_act", "z")

    dy_shape: Any
    w_shape: Any
    x_shape: Any
    activation_backward: Any = field(default=None, kw_only=True)
    residual: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        x = geometry.shape("x_shape", self.x_shape)
        w = geometry.shape("w_shape", self.w_shape, rank=len(x))
        dy = geometry.shape("dy_shape", self.dy_shape, rank=len(x))
        for name, value in (("x_shape", x), ("w_shape", w), ("dy_shape", dy)):
            self._set(name, value)
        self._normalize_common(x, w)
        self._set("activation_backward", as_activation("activation_backward", self.activation_backward))
        self._set("residual", flag("residual", self.residual))
        _check_dy(self, dy, _output_shape(self, x, w, "x_shape"))
        self._normalize_strides({role: len(x) for role in self.stride_roles})
        self._check_explicit_strides(self.tensors())

    @property
    def dx_shape(self) -> tuple[int, ...]:
        return self.x_shape

    @property
    def has_epilogue(self) -> bool:
        return not self.activation_backward.is_identity or self.residual

    def tensors(self) -> dict[str, TensorDesc]:
        out = {"dy": self._desc("dy", self.dy_shape), "w": self._desc("w", self.w_shape)}
        if not self.activation_backward.is_identity:
            out["pre_act"] = self._desc("pre_act", self.x_shape)
        if self.residual:
            out["z"] = self._desc("z", self.x_shape)
        out["dx"] = self._desc("dx", self.x_shape)
        return out


@dataclass(frozen=True)
class ConvBwdFilterSpec(_ConvSpec):
    """Filter gradient dw = wgrad(x, dy), optionally also the bias gradient db = sum(dy)."""

    op: ClassVar[str] = "conv_bwd_filter"
    stride_roles: ClassVar[tuple[str, ...]] = ("x", "dy", "dw")

    x_shape: Any
    dy_shape: Any
    w_shape: Any
    bias_grad: bool = field(default=False, kw_only=True)
    prologue: Any = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        x = geometry.shape("x_shape", self.x_shape)
        dy = geometry.shape("dy_shape", self.dy_shape, rank=len(x))
        w = geometry.shape("w_shape", self.w_shape, rank=len(x))
        for name, value in (("x_shape", x), ("w_shape", w), ("dy_shape", dy)):
            self._set(name, value)
        self._normalize_common(x, w)
        self._set("bias_grad", flag("bias_grad", self.bias_grad))
        self._set("prologue", _prologue(self.prologue))
        _check_dy(self, dy, _output_shape(self, x, w, "x_shape"))
        self._normalize_strides({role: len(x) for role in self.stride_roles})
        self._check_explicit_strides(self.tensors())

    @property
    def dw_shape(self) -> tuple[int, ...]:
        return self.w_shape

    @property
    def db_shape(self) -> tuple[int]:
        return (self.w_shape[0],)

    @property
    def has_epilogue(self) -> bool:
        return self.bias_grad

    def tensors(self) -> dict[str, TensorDesc]:
        out = {"x": self._desc("x", self.x_shape), "dy": self._desc("dy", self.dy_shape),
               **_prologue_operands(self), "dw": self._desc("dw", self.w_shape)}
        if self.bias_grad:
            out["db"] = TensorDesc(self.db_shape, (1,), self.dtype)
        return out


# The per-channel input transform a conv may apply first: relu(x * scale + shift), a BatchNorm's apply
# and ReLU folded into the next conv, so the normalised activation is never written.
PROLOGUES = ("scale_bias_relu",)
PROLOGUE_ROLES = ("scale", "shift")  # (C,) each, in the io dtype (cuDNN declines float32 operands there)
STATS_ROLES = ("sum", "sq_sum")  # (K,) float32: the conv output's per-channel sum and sum of squares


def _prologue(value: Any) -> str | None:
    if value is None or value in PROLOGUES:
        return value
    raise SpecError("prologue", value, f"expected None or one of {list(PROLOGUES)}")


def _prologue_operands(spec: _ConvSpec) -> dict[str, TensorDesc]:
    if spec.prologue is None:
        return {}
    return {role: TensorDesc((spec.x_shape[1],), (1,), spec.dtype) for role in PROLOGUE_ROLES}


def _output_shape(spec: _ConvSpec, x, w, field_name: str) -> tuple[int, ...]:
    """The forward conv's output shape (y, or the dy a gradient takes), within the bounds every given shape
    has: a padding of 2**31-1 passes its own check but makes an output no tensor descriptor can hold."""
    spatial = geometry.conv_output_dims(x[2:], w[2:], spec.padding, spec.stride, spec.dilation)
    inputs = f"w_shape={w}, padding={spec.padding}, stride={spec.stride}, dilation={spec.dilation}"
    if any(d <= 0 for d in spatial):
        raise SpecError(field_name, x, f"the output would be empty (spatial dims {spatial}) with {inputs}")
    out = (x[0], w[0], *spatial)
    output = "y_shape" if spec.op == "conv_fwd" else "dy_shape"
    try:
        geometry.shape(output, out)
    except SpecError as err:  # the derived shape: the error names what it is derived from
        raise SpecError(output, out, f"the forward conv's output, derived from x_shape={x}, {inputs}: "
                        f"{err.reason}") from None
    return out


def _check_dy(spec: _ConvSpec, dy: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if dy != expected:
        raise SpecError("dy_shape", dy, f"the forward conv of x_shape={spec.x_shape} with "
                        f"w_shape={spec.w_shape} produces {expected}")


ConvSpec = ConvFwdSpec | ConvBwdDataSpec | ConvBwdFilterSpec
SPEC_TYPES: dict[str, type] = {cls.op: cls for cls in (ConvFwdSpec, ConvBwdDataSpec, ConvBwdFilterSpec)}
