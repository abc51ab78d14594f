"""Request objects: buffers plus conv parameters; the spec is inferred from the buffers.

A request reads shape, dtype, device and layout (from strides) off its buffers, builds the matching
spec, and allocates any missing output in the inputs' framework (torch for torch tensors, CuPy
otherwise). `Session.run(request)` plans and executes it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from gpu_launch import buffers as _buffers
from gpu_launch.memo import CallMemo
from gpu_launch.streams import allocate_like, capture_probe, stream_pointer, torch_allocator

from .errors import BufferMismatchError, SpecError
from .plan import default_session
from .spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, geometry
from .spec.specs import _ConvSpec


_SPECS = CallMemo(512)  # a training loop repeats a few geometries: a small memo, not a leak


class _ConvRequest:
    """Shared machinery: describe buffers, infer layout and strides, allocate outputs."""

    spec_type: type
    primary: str  # the input whose dtype, device and layout set the spec's
    output_roles: tuple[str, ...]
    roles: tuple[str, ...]  # every buffer role in constructor order: the fast path's positional order

    def __init__(self, objs: tuple, params: dict[str, Any]):
        self._objs = objs  # in `roles` order: what the call path takes as is
        self.params = params
        tensor = _buffers.torch_tensor_type()
        for role, obj in zip(self.roles, objs):  # refuse what is no buffer now; torch tensors are checked at run
            if obj is not None and not (tensor is not None and isinstance(obj, tensor)):
                self._describe(role, obj)

    @functools.cached_property
    def buffers(self) -> dict[str, Any]:
        return dict(zip(self.roles, self._objs))

    @functools.cached_property
    def infos(self) -> dict[str, _buffers.BufferInfo]:
        return {role: self._describe(role, obj) for role, obj in self.buffers.items() if obj is not None}

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
            spec = _SPECS.put(key, self._infer_spec())
        return spec

    def _extra(self) -> tuple:
        """Constructor arguments besides buffers and conv params that shape the spec."""
        return ()

    @classmethod
    def _from_parts(cls, objs: tuple, params: dict[str, Any], extra: tuple) -> "_ConvRequest":
        raise NotImplementedError

    def _infer_spec(self) -> _ConvSpec:
        fields = self._fields()
        info = self.infos[self.primary]
        layout = self._layout(info)
        strides = {}
        for role, other in self.infos.items():
            if role in self.spec_type.stride_roles and layout not in _layouts_of(other.shape, other.strides):
                strides[role] = _explicit(other.shape, other.strides, layout)
        kwargs = {**self.params, **fields, "dtype": info.dtype, "layout": layout, "strides": strides or None}
        return self.spec_type(**kwargs)

    def _layout(self, info: _buffers.BufferInfo) -> str:
        """The primary buffer's layout. Where it is packed both ways (one channel, or every spatial dim 1)
        torch's rule decides: channels_last where it or a buffer beside it (the weight) has such strides,
        never for float64."""
        layouts = _layouts_of(info.shape, info.strides)
        if len(layouts) != 2:
            return layouts[0] if layouts else geometry.CHANNELS_FIRST
        if info.dtype == "float64":
            return geometry.CHANNELS_FIRST
        if any(geometry.strides_like_channels_last(i.shape, i.strides) for i in self.infos.values()):
            return geometry.CHANNELS_LAST
        return geometry.CHANNELS_FIRST

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def _groups(self, c: int, w_c: int | None) -> dict[str, Any]:
        """groups as given, else C // (C per group) as PyTorch's weight shape implies."""
        if self.params.get("groups") is None and w_c and c % w_c == 0:
            return {"groups": c // w_c}
        return {}

    def _run(self, session, stream: Any) -> Any:
        return run_buffers(type(self), self._objs, self.params, self._extra(), session=session, stream=stream)


class ConvFwdRequest(_ConvRequest):
    """y = act(alpha * conv(x, w) + bias + beta * z); `groups` defaults to C // w.shape[1]."""

    spec_type = ConvFwdSpec
    primary = "x"
    output_roles = ("y",)
    roles = ("x", "w", "bias", "z", "y")

    def __init__(self, x: Any, w: Any, y: Any = None, bias: Any = None, z: Any = None, **conv_params: Any):
        super().__init__((x, w, bias, z, y), conv_params)

    @classmethod
    def _from_parts(cls, objs: tuple, params: dict[str, Any], extra: tuple) -> "ConvFwdRequest":
        x, w, bias, z, y = objs
        return cls(x, w, y=y, bias=bias, z=z, **params)

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
    roles = ("dy", "w", "pre_act", "dx")

    def __init__(self, dy: Any, w: Any, dx: Any = None, *, pre_act: Any = None, x_shape: Any = None,
                 **conv_params: Any):
        self.x_shape = x_shape
        super().__init__((dy, w, pre_act, dx), conv_params)

    def _extra(self) -> tuple:
        return (self.x_shape,)

    @classmethod
    def _from_parts(cls, objs: tuple, params: dict[str, Any], extra: tuple) -> "ConvBwdDataRequest":
        dy, w, pre_act, dx = objs
        return cls(dy, w, dx=dx, pre_act=pre_act, x_shape=extra[0], **params)

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
    roles = ("x", "dy", "dw", "db")

    def __init__(self, x: Any, dy: Any, dw: Any = None, db: Any = None, *, w_shape: Any = None,
                 bias_grad: bool | None = None, **conv_params: Any):
        self.w_shape = w_shape
        self.bias_grad = bias_grad
        super().__init__((x, dy, dw, db), conv_params)

    def _extra(self) -> tuple:
        return (self.w_shape, self.bias_grad)

    @classmethod
    def _from_parts(cls, objs: tuple, params: dict[str, Any], extra: tuple) -> "ConvBwdFilterRequest":
        x, dy, dw, db = objs
        return cls(x, dy, dw=dw, db=db, w_shape=extra[0], bias_grad=extra[1], **params)

    def _fields(self) -> dict[str, Any]:
        x, dy = self.infos["x"].shape, self.infos["dy"].shape
        w = self.infos["dw"].shape if "dw" in self.infos else self.w_shape
        if w is None:
            w = _filter_from_sizes(x, dy, self.params)
        w = geometry.shape("w_shape", w, rank=len(x))
        bias_grad = ("db" in self.infos) if self.bias_grad is None else self.bias_grad
        return {"x_shape": x, "dy_shape": dy, "w_shape": w, "bias_grad": bias_grad, **self._groups(x[1], w[1])}


def _layout_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    """channels_first or channels_last when densely packed that way (channels_first where both), else None."""
    layouts = _layouts_of(shape, strides)
    return layouts[0] if layouts else None


def _layouts_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(layout for layout in (geometry.CHANNELS_FIRST, geometry.CHANNELS_LAST)
                 if _buffers.same_layout(strides, geometry.packed_strides(shape, layout), shape))


def _explicit(shape: tuple[int, ...], strides: tuple[int, ...], layout: str) -> tuple[int, ...]:
    packed = geometry.packed_strides(shape, layout)
    return tuple(p if d == 1 else s for s, p, d in zip(strides, packed, shape))


def _smallest_input(dy, w, params: dict[str, Any], *, channels: int) -> tuple[int, ...]:
    stride, pads, dilation = geometry.conv_arguments(len(dy) - 2, params.get("stride", 1), params.get("padding", 0),
                                                     params.get("dilation", 1), filter_dims=w[2:])
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
    pads = geometry.padding_pairs(padding, nd=nd, stride=stride, dilation=dilation, filter_dims=(1,) * nd)
    span = [i + pre + post - o + 1 for i, o, (pre, post) in zip(x[2:], dy[2:], pads)]
    if any(v < 1 or (v - 1) % d for v, d in zip(span, dilation)):
        raise SpecError("w_shape", None, f"no filter maps x_shape={x} to dy_shape={dy}; pass dw or w_shape")
    groups = params.get("groups") or 1
    return (dy[1], x[1] // groups, *((v - 1) // d + 1 for v, d in zip(span, dilation)))


# -- the call path: requests and the functional helpers end here -------------------------------------

class _Call(NamedTuple):
    """A prepared call for one memo key: the launcher, how to make the missing outputs, what to return."""

    launcher: Any
    allocators: tuple[Callable[[], Any], ...]  # one per output the caller did not pass
    pointer_of: Callable[[Any], int]
    sources: tuple[tuple[bool, int], ...]  # per returned output: (allocated here?, index)


_ONE_NEW = ((True, 0),)  # the common result: one output, allocated here


def run_buffers(kind: type, objs: tuple, params: dict[str, Any], extra: tuple, *, session=None,
                stream: Any = None) -> Any:
    """Run the request of type `kind` made of `objs` (in `kind.roles` order): plan it on first sight,
    then, for a repeated geometry, one dict lookup, the outputs' allocations and a launch."""
    primary = objs[0]
    tensor = _buffers.torch_tensor_type()
    is_torch = tensor is not None and isinstance(primary, tensor)
    device = primary.get_device() if is_torch else (_buffers.describe(primary, kind.primary).device or 0)
    if device < 0:  # a CPU tensor: the slow path refuses it with a typed error
        kind._from_parts(objs, params, extra).spec()
    if session is None:
        session = default_session(device)
    elif device != session.device:
        raise BufferMismatchError(kind.primary, "device", session.device, device)
    framework = "torch" if is_torch else _buffers.framework_of(primary)
    stream_ptr = stream_pointer(stream, framework, device)
    key_parts, ptrs, owners = _buffers.read_all(kind.roles, objs, stream_ptr)
    if is_torch and not key_parts[-1]:  # a view at an offset cuDNN's 16-byte alignment does not allow
        return _realigned(kind, objs, params, extra, session=session, stream=stream, stream_ptr=stream_ptr)
    calls = session.calls  # the session's memo: its plans are in the prepared calls
    try:  # the values' types ride along: a memo hit must not let 1.0 or True pass where 1 was checked
        key = (kind, key_parts, tuple(params.items()), tuple(map(type, params.values())), extra,
               tuple(map(type, extra)))
        call = calls.get(key)
    except TypeError:  # an unhashable value (a list, a dict): the same key, spelled hashably
        key = (kind, key_parts, _hashable(params), _hashable(extra))
        call = calls.get(key)
    new: list = []
    if call is None:
        call, new = prepare_call(session, kind, objs, params, extra, stream_ptr)
        calls.put(key, call)
    else:
        new = [allocate() for allocate in call.allocators]
    if new:
        pointer_of = call.pointer_of
        ptrs += tuple([pointer_of(t) for t in new])
    call.launcher.launch(ptrs, stream_ptr, capture_probe(framework, stream))
    del owners  # DLPack exports stay alive until the work is queued
    if call.sources == _ONE_NEW:
        return new[0]
    values = [new[i] if made else objs[i] for made, i in call.sources]
    return values[0] if len(values) == 1 else tuple(values)


def _realigned(kind: type, objs: tuple, params: dict[str, Any], extra: tuple, *, session, stream: Any,
               stream_ptr: int) -> Any:
    """torch takes views at any offset; our cuDNN graphs need 16-byte aligned pointers. Run on aligned
    copies of the misaligned inputs and into aligned outputs copied back, in stream order."""
    import contextlib

    import torch

    roles_out = set(kind.output_roles)
    fixed, copy_back = [], []
    # The copies go where the conv goes: the caller's stream when one was given, else torch's current one.
    on_stream = contextlib.nullcontext() if stream is None else torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr))
    with on_stream:
        for role, obj in zip(kind.roles, objs):
            if not isinstance(obj, torch.Tensor) or obj.data_ptr() % _buffers.ALIGNMENT == 0:
                fixed.append(obj)
                continue
            aligned = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=obj.device)
            if role in roles_out:
                copy_back.append((obj, aligned))
            else:
                aligned.copy_(obj)
            fixed.append(aligned)
        result = run_buffers(kind, tuple(fixed), params, extra, session=session, stream=stream_ptr)
        for obj, aligned in copy_back:
            obj.copy_(aligned)
    originals = {id(aligned): obj for obj, aligned in copy_back}
    if isinstance(result, tuple):
        return tuple(originals.get(id(r), r) for r in result)
    return originals.get(id(result), result)


def prepare_call(session, kind: type, objs: tuple, params: dict[str, Any], extra: tuple,
                 stream_ptr: int) -> tuple[_Call, list]:
    """The slow path of a new geometry: infer and check the spec, plan it, allocate the missing
    outputs, check every buffer against the plan. Returns the prepared call and this call's outputs.
    A caller that memoises the call must key it on everything the checks read (see `read_all`)."""
    request = kind._from_parts(objs, params, extra)
    spec = request.spec()
    descs = spec.tensors()
    missing = [r for r in kind.output_roles if r in descs and request.buffers.get(r) is None]
    allocators = tuple(_allocator(request, descs[r]) for r in missing)
    new = [allocate() for allocate in allocators]
    buffers = {role: b for role, b in request.buffers.items() if b is not None}
    buffers.update(zip(missing, new))
    plan = session.plan(spec, buffers=buffers if session.autotune_inputs == "request" else None)
    framework = plan.check_buffers(buffers, stream_ptr)
    roles = tuple(r for r in kind.roles if request.buffers.get(r) is not None) + tuple(missing)
    sources = tuple((True, missing.index(r)) if r in missing else (False, kind.roles.index(r))
                    for r in kind.output_roles if r in descs)
    pointer_of = _torch_pointer if framework == "torch" else _array_pointer
    return _Call(plan.launcher(roles, framework), allocators, pointer_of, sources), new


def _allocator(request: _ConvRequest, desc) -> Callable[[], Any]:
    if request.framework == "torch":
        return torch_allocator(desc, request.buffers[request.primary].device)
    return functools.partial(allocate_like, desc, like=request.buffers[request.primary],
                             framework=request.framework, device=request.device)


def _torch_pointer(t: Any) -> int:
    return t.data_ptr()


def _array_pointer(a: Any) -> int:
    return _buffers.describe(a, "output").ptr


def _hashable(value: Any) -> Any:
    """`value` as a memo key part with every leaf's type: lists as tuples, dicts as sorted pairs."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _hashable(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", type(value).__name__, tuple(_hashable(v) for v in value))
    try:
        hash(value)
        return (type(value), value)
    except TypeError:
        return ("repr", type(value).__name__, repr(value))
