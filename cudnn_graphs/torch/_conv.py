"""Convolutions for PyTorch models: `conv1d/2d/3d` and drop-in `Conv1d/2d/3d` modules on this
library's plans, forward (with a fused bias / residual / activation epilogue) and backward.

The three ops are registered with `torch.library` (namespace `cudnn_graphs`), with fake kernels and
autograd, so `torch.compile(fullgraph=True)` traces them as single nodes and `torch.cuda.graph` can
capture them (no synchronisation; memory from torch's caching allocator; torch's current stream):

    cudnn_graphs::conv_fwd(x, w, bias?, z?, stride, padding, dilation, groups, activation, act_param, beta)
    cudnn_graphs::conv_bwd_data(dy, w, x_shape, stride, padding, dilation, groups)
    cudnn_graphs::conv_bwd_filter(x, dy, w_shape, stride, padding, dilation, groups, bias_grad) -> (dw, db)

`padding` is flat (pre, post) per spatial dim. At run time the ops follow torch's flags:
`torch.backends.cudnn.allow_tf32` (float32 on tensor cores), `torch.use_deterministic_algorithms` /
`torch.backends.cudnn.deterministic` (a deterministic session). CPU tensors, empty tensors and
graphs cuDNN declines run through torch's own convolution, so a module never fails where torch's
would work. Backward: the activation's derivative is taken from the saved output (relu, leaky_relu,
elu, sigmoid, tanh); activations whose derivative needs the pre-activation (gelu, silu, softplus)
run unfused when a gradient is needed (the conv+bias+residual fused, the activation in torch).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpu_launch.activations import Activation, as_activation

from .. import api
from ..errors import UnsupportedGraphError
from ._activations import torch_activation

__all__ = ["conv1d", "conv2d", "conv3d", "Conv1d", "Conv2d", "Conv3d"]
log = logging.getLogger("cudnn_graphs")

# Activations whose derivative the backward reads off the output y = act(pre).
_FROM_OUTPUT = {"identity", "relu", "leaky_relu", "elu", "sigmoid", "tanh"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_lib = torch.library.Library("cudnn_graphs", "FRAGMENT")
_lib.define("conv_fwd(Tensor x, Tensor w, Tensor? bias, Tensor? z, int[] stride, int[] padding, int[] dilation, "
            "int groups, str activation, float act_param, float beta) -> Tensor")
_lib.define("conv_bwd_data(Tensor dy, Tensor w, SymInt[] x_shape, int[] stride, int[] padding, int[] dilation, "
            "int groups) -> Tensor")
_lib.define("conv_bwd_filter(Tensor x, Tensor dy, SymInt[] w_shape, int[] stride, int[] padding, "
            "int[] dilation, int groups, bool bias_grad) -> (Tensor, Tensor)")


# -- layouts: the fake kernels and the real ones agree on every output's strides ----------------------

def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last(_3d) where `t` is packed that way and not also plain contiguous, as torch suggests."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _packed(t: torch.Tensor | None, fmt: torch.memory_format) -> torch.Tensor | None:
    """`t` densely packed in `fmt` (a copy only when it is not): cuDNN's graphs take packed tensors,
    and autograd hands out expanded (stride-0) or transposed gradients."""
    if t is None or t.is_contiguous(memory_format=fmt):
        return t
    return t.contiguous(memory_format=fmt)


def _out_shape(x_shape: Sequence[int], k: int, w_spatial: Sequence[int], stride, padding, dilation) -> list[int]:
    spatial = [(i + padding[2 * d] + padding[2 * d + 1] - dilation[d] * (kk - 1) - 1) // stride[d] + 1
               for d, (i, kk) in enumerate(zip(x_shape[2:], w_spatial))]
    return [x_shape[0], k, *spatial]


def _pairs(padding: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((padding[i], padding[i + 1]) for i in range(0, len(padding), 2))


# -- when torch's own convolution serves ---------------------------------------------------------------

def _ours(*tensors: torch.Tensor | None) -> bool:
    """CUDA tensors of one supported dtype, none empty: what our plans take."""
    first = tensors[0]
    return (first.is_cuda and first.dtype in _DTYPES and first.numel() > 0
            and all(t is None or (t.is_cuda and t.dtype == first.dtype and t.numel() > 0) for t in tensors[1:]))


def _session(device: int):
    # torch's own getters: the torch.backends attributes cost ~1 us each, on every call
    if not (torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic()):
        return None  # the default session of the device
    from ..plan.session import Session

    session = _DETERMINISTIC.get(device)
    if session is None:
        session = _DETERMINISTIC.setdefault(device, Session(device=device, deterministic=True))
    return session


_DETERMINISTIC: dict[int, Any] = {}
_declined: set = set()


def _declined_once(what: str, err: Exception) -> None:
    if what not in _declined:
        _declined.add(what)
        log.warning("cudnn_graphs: %s runs through torch's convolution: %s", what, err)


def _torch_conv(x, w, bias, stride, padding, dilation, groups):
    pairs = _pairs(padding)
    if any(pre != post for pre, post in pairs):  # torch pads symmetrically: pad the difference first
        extra = [v for pre, post in reversed(pairs) for v in (0, post - pre)]
        x = F.pad(x, extra)
    sym = [pre for pre, _ in pairs]
    return torch.convolution(x, w, bias, list(stride), sym, list(dilation), False, [0] * len(sym), groups)


@functools.lru_cache(maxsize=256)
def _params(stride: tuple, padding: tuple, dilation: tuple, groups: int, activation: str, act_param: float,
            beta: float, residual: bool, allow_tf32: bool) -> dict:
    """The library's conv parameters for the ops' flat arguments, made once per distinct set."""
    act = Activation(activation, None if Activation(activation).param is None else act_param)
    return {"stride": stride, "padding": _pairs(padding), "dilation": dilation, "groups": groups,
            "activation": act, "residual": residual, "beta": beta if residual else 1.0, "allow_tf32": allow_tf32}


@functools.lru_cache(maxsize=256)
def _bwd_params(stride: tuple, padding: tuple, dilation: tuple, groups: int, allow_tf32: bool) -> dict:
    return {"stride": stride, "padding": _pairs(padding), "dilation": dilation, "groups": groups,
            "allow_tf32": allow_tf32}


# -- the op kernels ------------------------------------------------------------------------------------

def _conv_fwd_cuda(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    if _ours(x, w, bias, z):
        fmt = _memory_format(x)
        x, z = _packed(x, fmt), _packed(z, fmt)
        params = _params(tuple(stride), tuple(padding), tuple(dilation), groups, activation, act_param, beta,
                         z is not None, torch._C._get_cudnn_allow_tf32())
        try:
            y = api.conv_fwd(x, _packed(w, _memory_format(w)), bias, z=z, session=_session(x.get_device()), **params)
            return _packed(y, fmt)
        except UnsupportedGraphError as err:
            _declined_once(f"conv_fwd {tuple(x.shape)} x {tuple(w.shape)}", err)
    return _conv_fwd_torch(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta)


def _conv_fwd_torch(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    y = _torch_conv(x, w, bias, stride, padding, dilation, groups)
    if z is not None:
        y = y + beta * z
    return torch_activation(activation, act_param)(y)


def _conv_bwd_data_cuda(dy, w, x_shape, stride, padding, dilation, groups):
    if _ours(dy, w):
        fmt = _memory_format(dy)
        try:
            params = _bwd_params(tuple(stride), tuple(padding), tuple(dilation), groups,
                                 torch._C._get_cudnn_allow_tf32())
            dx = api.conv_bwd_data(_packed(dy, fmt), _packed(w, _memory_format(w)), x_shape=tuple(x_shape),
                                   session=_session(dy.get_device()), **params)
            return _packed(dx, fmt)
        except UnsupportedGraphError as err:
            _declined_once(f"conv_bwd_data {tuple(dy.shape)} x {tuple(w.shape)}", err)
    return _conv_bwd_data_torch(dy, w, x_shape, stride, padding, dilation, groups)


def _conv_bwd_data_torch(dy, w, x_shape, stride, padding, dilation, groups):
    x = dy.new_empty(x_shape)  # only its shape is read: torch's backward wants the forward input
    dx = _torch_backward(dy, x, w, stride, padding, dilation, groups, (True, False, False))[0]
    return dx.contiguous(memory_format=_memory_format(dy))


def _conv_bwd_filter_cuda(x, dy, w_shape, stride, padding, dilation, groups, bias_grad):
    if _ours(x, dy):
        fmt = _memory_format(x)
        try:
            params = _bwd_params(tuple(stride), tuple(padding), tuple(dilation), groups,
                                 torch._C._get_cudnn_allow_tf32())
            out = api.conv_bwd_filter(_packed(x, fmt), _packed(dy, fmt), w_shape=tuple(w_shape), bias_grad=bias_grad,
                                      session=_session(x.get_device()), **params)
            dw, db = out if bias_grad else (out, dy.new_empty(0))
            return _packed(dw, fmt), db
        except UnsupportedGraphError as err:
            _declined_once(f"conv_bwd_filter {tuple(x.shape)} -> {tuple(w_shape)}", err)
    return _conv_bwd_filter_torch(x, dy, w_shape, stride, padding, dilation, groups, bias_grad)


def _conv_bwd_filter_torch(x, dy, w_shape, stride, padding, dilation, groups, bias_grad):
    w = x.new_empty(w_shape)
    _, dw, db = _torch_backward(dy, x, w, stride, padding, dilation, groups, (False, True, bias_grad))
    return dw.contiguous(memory_format=_memory_format(x)), db if bias_grad else dy.new_empty(0)


def _torch_backward(dy, x, w, stride, padding, dilation, groups, mask):
    pairs = _pairs(padding)
    if any(pre != post for pre, post in pairs):  # asymmetric: through autograd of the padded conv
        x_ = x.detach().requires_grad_(mask[0])
        w_ = w.detach().requires_grad_(mask[1])
        b_ = dy.new_zeros(w.shape[0]).requires_grad_(mask[2])
        with torch.enable_grad():
            y = _torch_conv(x_, w_, b_, stride, padding, dilation, groups)
            wanted = [t for t, m in zip((x_, w_, b_), mask) if m]
            grads = iter(torch.autograd.grad(y, wanted, dy))
        return tuple(next(grads) if m else None for m in mask)
    return torch.ops.aten.convolution_backward(dy, x, w, [w.shape[0]], list(stride), [p for p, _ in pairs],
                                               list(dilation), False, [0] * len(pairs), groups, list(mask))


for _name, _cuda, _cpu in (("conv_fwd", _conv_fwd_cuda, _conv_fwd_torch),
                           ("conv_bwd_data", _conv_bwd_data_cuda, _conv_bwd_data_torch),
                           ("conv_bwd_filter", _conv_bwd_filter_cuda, _conv_bwd_filter_torch)):
    _lib.impl(_name, _cuda, "CUDA")
    _lib.impl(_name, _cpu, "CPU")


# -- fake kernels: shapes and strides without running anything -----------------------------------------

@torch.library.register_fake("cudnn_graphs::conv_fwd")
def _conv_fwd_fake(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    shape = _out_shape(x.shape, w.shape[0], w.shape[2:], stride, padding, dilation)
    return x.new_empty(shape).contiguous(memory_format=_memory_format(x))


@torch.library.register_fake("cudnn_graphs::conv_bwd_data")
def _conv_bwd_data_fake(dy, w, x_shape, stride, padding, dilation, groups):
    return dy.new_empty(list(x_shape)).contiguous(memory_format=_memory_format(dy))


@torch.library.register_fake("cudnn_graphs::conv_bwd_filter")
def _conv_bwd_filter_fake(x, dy, w_shape, stride, padding, dilation, groups, bias_grad):
    dw = x.new_empty(list(w_shape)).contiguous(memory_format=_memory_format(x))
    return dw, dy.new_empty(w_shape[0] if bias_grad else 0)


# -- autograd ------------------------------------------------------------------------------------------

def _setup_fwd(ctx, inputs, output):
    x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta = inputs
    need_x, need_w, need_b, need_z = ctx.needs_input_grad[:4]
    ctx.conv = (list(stride), list(padding), list(dilation), groups)
    ctx.act, ctx.beta = (activation, act_param), beta
    ctx.x_shape, ctx.w_shape, ctx.has_bias = list(x.shape), list(w.shape), bias is not None
    ctx.save_for_backward(x if need_w else None, w if need_x else None,
                          output if activation != "identity" and any((need_x, need_w, need_b, need_z)) else None)


def _act_grad(dy: torch.Tensor, y: torch.Tensor | None, name: str, param: float) -> torch.Tensor:
    """dy * act'(pre), read off y = act(pre)."""
    if name == "identity":
        return dy
    if name == "relu":
        return dy * (y > 0)
    if name == "leaky_relu":  # y > 0 exactly where pre > 0 for a non-negative slope
        return torch.where(y > 0, dy, dy * param)
    if name == "elu":
        return torch.where(y > 0, dy, dy * (y + param))
    if name == "sigmoid":
        return dy * y * (1 - y)
    if name == "tanh":
        return dy * (1 - y * y)
    raise AssertionError(f"{name}: its derivative needs the pre-activation")


def _backward_with(ctx, dy, bwd_data, bwd_filter):
    x, w, y = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    need_x, need_w, need_b, need_z = ctx.needs_input_grad[:4]
    g = _act_grad(dy, y, *ctx.act)
    dx = dw = db = dz = None
    if need_x:
        dx = bwd_data(g, w, ctx.x_shape, stride, padding, dilation, groups)
    if need_w:
        dw, db = bwd_filter(x, g, ctx.w_shape, stride, padding, dilation, groups, bool(need_b and ctx.has_bias))
        db = db if need_b and ctx.has_bias else None
    if need_b and ctx.has_bias and db is None:
        db = g.sum([0, *range(2, g.dim())])
    if need_z:
        dz = g * ctx.beta if ctx.beta != 1.0 else g
    return dx, dw, db, dz, None, None, None, None, None, None, None


def _backward_fwd(ctx, dy):  # traced by torch.compile: the registered ops, never our Python on fakes
    return _backward_with(ctx, dy, torch.ops.cudnn_graphs.conv_bwd_data, torch.ops.cudnn_graphs.conv_bwd_filter)


torch.library.register_autograd("cudnn_graphs::conv_fwd", _backward_fwd, setup_context=_setup_fwd)


def _setup_bwd_data(ctx, inputs, output):
    dy, w, x_shape, stride, padding, dilation, groups = inputs
    ctx.conv, ctx.x_shape = (list(stride), list(padding), list(dilation), groups), list(x_shape)
    ctx.save_for_backward(dy if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)


def _backward_bwd_data(ctx, ddx):  # dgrad is linear in dy and in w: double backward for gradgrad checks
    dy, w = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    ddy = dw = None
    if ctx.needs_input_grad[0]:
        ddy = torch.ops.cudnn_graphs.conv_fwd(ddx, w, None, None, stride, padding, dilation, groups, "identity",
                                              0.0, 1.0)
    if ctx.needs_input_grad[1]:
        dw, _ = torch.ops.cudnn_graphs.conv_bwd_filter(ddx, dy, list(w.shape), stride, padding, dilation, groups,
                                                       False)
    return ddy, dw, None, None, None, None, None


torch.library.register_autograd("cudnn_graphs::conv_bwd_data", _backward_bwd_data, setup_context=_setup_bwd_data)


def _setup_bwd_filter(ctx, inputs, output):
    x, dy, w_shape, stride, padding, dilation, groups, bias_grad = inputs
    ctx.conv, ctx.x_shape, ctx.bias_grad = (list(stride), list(padding), list(dilation), groups), list(x.shape), bias_grad
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, dy if ctx.needs_input_grad[0] else None)


def _backward_bwd_filter(ctx, ddw, ddb):  # wgrad is linear in x and in dy; db = sum(dy)
    x, dy = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    dx = ddy = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.cudnn_graphs.conv_bwd_data(dy, ddw, ctx.x_shape, stride, padding, dilation, groups)
    if ctx.needs_input_grad[1]:
        ddy = torch.ops.cudnn_graphs.conv_fwd(x, ddw, None, None, stride, padding, dilation, groups, "identity",
                                              0.0, 1.0)
        if ctx.bias_grad and ddb is not None:
            ddy = ddy + ddb.view(1, -1, *([1] * (ddy.dim() - 2)))
    return dx, ddy, None, None, None, None, None, None


torch.library.register_autograd("cudnn_graphs::conv_bwd_filter", _backward_bwd_filter,
                                setup_context=_setup_bwd_filter)


# -- eager calls: straight to the kernels --------------------------------------------------------------
# torch.library's Python autograd wrapper costs ~170 us a call and the dispatcher ~30 (H100 host,
# tools/probe_op_overhead.py), against ~25 us for the conv itself: eager calls skip both, through a
# plain autograd.Function; torch.compile traces the registered ops instead.

def _fwd_direct(x, *args):
    return (_conv_fwd_cuda if x.is_cuda else _conv_fwd_torch)(x, *args)


def _bwd_data_direct(dy, *args):
    return (_conv_bwd_data_cuda if dy.is_cuda else _conv_bwd_data_torch)(dy, *args)


def _bwd_filter_direct(x, *args):
    return (_conv_bwd_filter_cuda if x.is_cuda else _conv_bwd_filter_torch)(x, *args)


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
        y = _fwd_direct(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta)
        _setup_fwd(ctx, (x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph: gradients of gradients go through the registered ops
            return _backward_fwd(ctx, dy)
        return _backward_with(ctx, dy, _bwd_data_direct, _bwd_filter_direct)


# -- the functional API --------------------------------------------------------------------------------

def _conv(nd: int, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta):
    act = as_activation("activation", activation)
    stride, dilation = _per_dim("stride", stride, nd), _per_dim("dilation", dilation, nd)
    flat = _flat_padding(padding, nd, stride, dilation, weight.shape[2:])
    if torch.is_autocast_enabled("cuda") and input.is_cuda:  # as torch's conv: run in the autocast dtype
        input, weight, bias, residual = (_autocast(t) for t in (input, weight, bias, residual))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias, residual))
    if torch.compiler.is_compiling():
        op = torch.ops.cudnn_graphs.conv_fwd
    else:
        op = _ConvFunction.apply if grads else _fwd_direct
    if grads and not _derivative_from_output(act):  # the backward needs the pre-activation: keep it
        pre = op(input, weight, bias, residual, stride, flat, dilation, groups, "identity", 0.0, beta)
        return torch_activation(act.name, act.param)(pre)
    return op(input, weight, bias, residual, stride, flat, dilation, groups, act.name,
              0.0 if act.param is None else act.param, beta)


def _derivative_from_output(act: Activation) -> bool:
    """Whether act'(pre) can be read off y = act(pre): y > 0 must mean pre > 0 where the slope differs."""
    if act.name in ("leaky_relu", "elu"):
        return act.param >= 0
    return act.name in _FROM_OUTPUT


def _autocast(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor in the autocast dtype, as autocast casts conv inputs: float64 stays float64."""
    if t is None or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return t
    return t.to(torch.get_autocast_dtype("cuda"))


def _per_dim(name: str, value: Any, nd: int, *, minimum: int = 1) -> list[int]:
    values = [value] * nd if isinstance(value, int) else list(value)
    if len(values) == 1:
        values = values * nd
    if len(values) != nd or not all(isinstance(v, int) and v >= minimum for v in values):
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum} or {nd} of them")
    return values


def _flat_padding(padding: Any, nd: int, stride: list[int], dilation: list[int], kernel: Sequence[int]) -> list[int]:
    """(pre, post) per spatial dim, flat; 'same' pads as torch does (the odd element after)."""
    if isinstance(padding, str):
        if padding == "valid":
            return [0] * (2 * nd)
        if padding != "same":
            raise ValueError(f"padding={padding!r}: expected 'valid', 'same', an int or a tuple")
        if any(s != 1 for s in stride):
            raise ValueError("padding='same' is not supported for strided convolutions")
        out = []
        for d, k in zip(dilation, kernel):
            total = d * (int(k) - 1)
            out += [total // 2, total - total // 2]
        return out
    return [p for v in _per_dim("padding", padding, nd, minimum=0) for p in (v, v)]


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None,
           residual=None, beta: float = 1.0):
    """F.conv1d, then act(... + beta * residual): one fused kernel on CUDA where cuDNN plans it."""
    return _conv(1, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None,
           residual=None, beta: float = 1.0):
    """F.conv2d, then act(... + beta * residual): one fused kernel on CUDA where cuDNN plans it."""
    return _conv(2, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta)


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None,
           residual=None, beta: float = 1.0):
    """F.conv3d, then act(... + beta * residual): one fused kernel on CUDA where cuDNN plans it."""
    return _conv(3, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta)


# -- modules -------------------------------------------------------------------------------------------

class _ConvMixin:
    """What Conv1d/2d/3d add to torch's modules: the forward through our ops, an optional fused
    activation and residual. Parameters, buffers, initialisation and state_dict are torch's own."""

    _nd: int

    def _init_activation(self, activation: Any) -> None:
        self.activation = as_activation("activation", activation)

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":  # torch pads with the mode first, then convolves unpadded
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return _conv(self._nd, input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                     self.activation, residual, 1.0)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.activation.is_identity else f"{text}, activation={self.activation}"


class Conv1d(_ConvMixin, nn.Conv1d):
    """torch.nn.Conv1d on cuDNN graphs; `activation=` fuses an activation, `forward(x, residual)` an add."""

    _nd = 1

    def __init__(self, *args: Any, activation: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_activation(activation)


class Conv2d(_ConvMixin, nn.Conv2d):
    """torch.nn.Conv2d on cuDNN graphs; `activation=` fuses an activation, `forward(x, residual)` an add."""

    _nd = 2

    def __init__(self, *args: Any, activation: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_activation(activation)


class Conv3d(_ConvMixin, nn.Conv3d):
    """torch.nn.Conv3d on cuDNN graphs; `activation=` fuses an activation, `forward(x, residual)` an add."""

    _nd = 3

    def __init__(self, *args: Any, activation: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_activation(activation)

