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
`torch.backends.cudnn.deterministic` (deterministic plans only), `torch.backends.cudnn.benchmark`
(a geometry first seen is autotuned: every candidate plan timed once, the winner kept in the plan
cache, so later processes and machines sharing the cache reuse it instead of timing again; off, plans
come from cuDNN's heuristics or $CUDNN_GRAPHS_POLICY) and `torch.backends.cudnn.enabled` (off: torch's
own convolution, which then takes its non-cuDNN path). CPU tensors, empty tensors and graphs cuDNN
declines run through torch's own convolution, so a module never fails where torch's would work. Backward: the activation's derivative is taken from the saved output (relu, leaky_relu,
elu, sigmoid, tanh); activations whose derivative needs the pre-activation (gelu, silu, softplus)
run unfused when a gradient is needed (the conv+bias+residual fused, the activation in torch).
"""

from __future__ import annotations

import functools
import logging
import numbers
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad as _fwAD

from gpu_launch.activations import Activation, as_activation
from gpu_launch.memo import CallMemo
from gpu_launch.streams import capture_probe

from .. import api
from .. import requests as _requests
from ..errors import ShapeError, SpecError, UnsupportedGraphError
from ..plan import default_session
from ..spec import geometry
from ..spec.geometry import strides_like_channels_last
from ._activations import torch_activation
from ._fallback import cpu_once

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
    """torch's `suggest_memory_format`: channels_last(_3d) where `t`'s strides order it that way, the
    cases packed both ways decided by the strides of the size-1 dims, as torch does."""
    if not strides_like_channels_last(t.shape, t.stride()):
        return torch.contiguous_format
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def _conv_format(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """The layout torch's cuDNN conv gives its output (cudnn_conv_suggest_memory_format): channels_last
    where the input or the weight suggests it, contiguous for float64."""
    if x.dtype == torch.float64:
        return torch.contiguous_format
    fmt = _memory_format(x)
    return fmt if fmt != torch.contiguous_format or w.dim() != x.dim() else _memory_format(w)


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


def _check_fwd_shapes(x, w, bias, z, stride, padding, dilation, groups) -> None:
    """What torch's check_shape_forward checks, as a ShapeError (also a RuntimeError, as torch's)
    naming the tensor: run once per new geometry, never per call."""
    if w.dim() != x.dim():
        raise ShapeError("input", tuple(x.shape), f"expected {w.dim()}-dimensional input for "
                         f"{w.dim()}-dimensional weight {list(w.shape)}, but got {x.dim()}-dimensional input")
    if w.shape[0] % groups:
        raise ShapeError("weight", tuple(w.shape), f"groups={groups}: expected weight.shape[0] divisible by it")
    if x.shape[1] != w.shape[1] * groups:
        raise ShapeError("input", tuple(x.shape), f"given groups={groups}, weight of size {list(w.shape)}, expected "
                         f"input to have {w.shape[1] * groups} channels, but got {x.shape[1]} channels instead")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ShapeError("bias", tuple(bias.shape), f"given weight of size {list(w.shape)}, expected bias to be "
                         f"1-dimensional with {w.shape[0]} elements")
    padded = [i + padding[2 * d] + padding[2 * d + 1] for d, i in enumerate(x.shape[2:])]
    kernel = [dilation[d] * (k - 1) + 1 for d, k in enumerate(w.shape[2:])]
    if any(p < k for p, k in zip(padded, kernel)):
        raise ShapeError("input", tuple(x.shape), f"calculated padded input size per channel {tuple(padded)} is "
                         f"smaller than the (dilated) kernel {tuple(kernel)}")
    if z is not None and list(z.shape) != _out_shape(x.shape, w.shape[0], w.shape[2:], stride, padding, dilation):
        raise ShapeError("residual", tuple(z.shape), "expected the conv's output shape "
                         f"{tuple(_out_shape(x.shape, w.shape[0], w.shape[2:], stride, padding, dilation))}")


# -- when torch's own convolution serves ---------------------------------------------------------------

def _ours(*tensors: torch.Tensor | None) -> bool:
    """CUDA tensors of one supported dtype, none empty, with torch's cuDNN enabled: what our plans take."""
    first = tensors[0]
    return (first.is_cuda and first.dtype in _DTYPES and first.numel() > 0 and torch._C._get_cudnn_enabled()
            and all(t is None or (t.is_cuda and t.dtype == first.dtype and t.numel() > 0) for t in tensors[1:]))


def _session(device: int, *, benchmark: bool | None = None):
    """The session torch's flags ask for: None (the device's default session) unless
    `torch.backends.cudnn.benchmark` (plans autotuned once, kept in the plan cache) or determinism
    (`torch.use_deterministic_algorithms`, `cudnn.deterministic`: deterministic plans only) is on.
    `benchmark` overrides torch's flag."""
    # torch's own getters: the torch.backends attributes cost ~1 us each, on every call
    deterministic = torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic()
    benchmark = torch._C._get_cudnn_benchmark() if benchmark is None else benchmark
    if not (deterministic or benchmark):
        return None
    key = (device, deterministic, benchmark)
    session = _SESSIONS.get(key)
    if session is None:
        from ..plan.session import Session

        # benchmark off: the configured policy ($CUDNN_GRAPHS_POLICY), as the default session's
        session = _SESSIONS.setdefault(key, Session(device=device, deterministic=deterministic,
                                                    policy="autotune" if benchmark else None))
    return session


def planning_session(device: int) -> tuple[Any, bool]:
    """(session, provisional): the session to plan a new call with, torch's flags' or the device's default.
    Inside a CUDA-graph capture, where that session would autotune (benchmark=True, or
    $CUDNN_GRAPHS_POLICY=autotune), a heuristic one with the same determinism: timing synchronises, which
    a capture cannot hold. provisional: that plan is for this capture only (keep it out of memos, so the
    next eager first sight tunes)."""
    session = _session(device) or default_session(device)
    if session.policy != "autotune" or not torch.cuda.is_current_stream_capturing():
        return session, False
    key = (device, session.deterministic, "heuristic")
    heuristic = _SESSIONS.get(key)
    if heuristic is None:
        from ..plan.session import Session

        heuristic = _SESSIONS.setdefault(key, Session(device=device, deterministic=session.deterministic,
                                                      policy="heuristic"))
    return heuristic, True


_SESSIONS: dict[tuple, Any] = {}  # (device, deterministic, benchmark) -> the session for those flags
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
    _check_fwd_shapes(x, w, bias, z, stride, padding, dilation, groups)
    if _ours(x, w, bias, z):
        fmt = _conv_format(x, w)
        x, z = _packed(x, fmt), _packed(z, fmt)
        params = _params(tuple(stride), tuple(padding), tuple(dilation), groups, activation, act_param, beta,
                         z is not None, torch._C._get_cudnn_allow_tf32())
        try:
            # the weight in the input's layout, as torch hands cuDNN: one layout has engines everywhere
            y = api.conv_fwd(x, _packed(w, fmt), bias, z=z, session=_session(x.get_device()), **params)
            return _packed(y, fmt)
        except UnsupportedGraphError as err:
            _declined_once(f"conv_fwd {tuple(x.shape)} x {tuple(w.shape)}", err)
    return _conv_fwd_torch(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta)


def _conv_fwd_torch(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    _check_fwd_shapes(x, w, bias, z, stride, padding, dilation, groups)  # CPU raises as CUDA does
    if x.device.type == "cpu":  # every CPU forward comes here (eager, autograd, the op torch.compile calls)
        cpu_once("conv_fwd", x, w, by="torch's convolution")
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


# The registered CUDA kernels (what torch.compile's graphs and double backward call) take the eager
# memos too, through the config of their flat arguments.

def _conv_fwd_op(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    return _fwd_eager(_op_config(stride, padding, dilation, groups, activation, act_param, beta), x, w, bias, z)


def _conv_bwd_data_op(dy, w, x_shape, stride, padding, dilation, groups):
    return _dgrad_eager(_op_config(stride, padding, dilation, groups, "identity", 0.0, 1.0), dy, w, tuple(x_shape))


def _conv_bwd_filter_op(x, dy, w_shape, stride, padding, dilation, groups, bias_grad):
    cfg = _op_config(stride, padding, dilation, groups, "identity", 0.0, 1.0)
    dw, db = _wgrad_eager(cfg, x, dy, tuple(w_shape), bias_grad)
    return dw, dy.new_empty(0) if db is None else db


def _op_config(stride, padding, dilation, groups, activation: str, act_param: float, beta: float) -> "_Config":
    return _flat_config_cached(tuple(stride), tuple(padding), tuple(dilation), groups, activation, act_param, beta)


for _name, _cuda, _cpu in (("conv_fwd", _conv_fwd_op, _conv_fwd_torch),
                           ("conv_bwd_data", _conv_bwd_data_op, _conv_bwd_data_torch),
                           ("conv_bwd_filter", _conv_bwd_filter_op, _conv_bwd_filter_torch)):
    _lib.impl(_name, _cuda, "CUDA")
    _lib.impl(_name, _cpu, "CPU")


# -- fake kernels: shapes and strides without running anything -----------------------------------------

@torch.library.register_fake("cudnn_graphs::conv_fwd")
def _conv_fwd_fake(x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta):
    _check_fwd_shapes(x, w, bias, z, stride, padding, dilation, groups)
    shape = _out_shape(x.shape, w.shape[0], w.shape[2:], stride, padding, dilation)
    return x.new_empty(shape).contiguous(memory_format=_conv_format(x, w))


@torch.library.register_fake("cudnn_graphs::conv_bwd_data")
def _conv_bwd_data_fake(dy, w, x_shape, stride, padding, dilation, groups):
    return dy.new_empty(list(x_shape)).contiguous(memory_format=_memory_format(dy))


@torch.library.register_fake("cudnn_graphs::conv_bwd_filter")
def _conv_bwd_filter_fake(x, dy, w_shape, stride, padding, dilation, groups, bias_grad):
    dw = x.new_empty(list(w_shape)).contiguous(memory_format=_memory_format(x))
    return dw, dy.new_empty(w_shape[0] if bias_grad else 0)


# -- one conv's non-tensor arguments, normalised once -------------------------------------------------

class _Config:
    """stride, padding (flat pre/post), dilation, groups, activation and beta of one conv, checked and
    normalised once, with the memos of its eager calls: a cheap key of the tensors and torch's flags ->
    the prepared call (see `_MEMO_SIZE`). Shared by every call with equal arguments (`_config`)."""

    __slots__ = ("stride", "padding", "dilation", "groups", "act", "act_param", "beta", "flat", "op_act",
                 "activate", "pre", "fwd", "dgrad", "wgrad")

    def __init__(self, stride: tuple, padding: tuple, dilation: tuple, groups: int, act: Activation, beta: float):
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.act, self.act_param, self.beta = act.name, act.param, beta
        self.flat = (list(stride), list(padding), list(dilation), groups)  # the registered ops' int[] arguments
        self.op_act = (act.name, 0.0 if act.param is None else act.param, beta)
        self.activate = torch_activation(act.name, act.param)
        # Where act'(pre) cannot be read off the output, a gradient needs the conv without its activation.
        self.pre = None if _derivative_from_output(act) else _canonical(stride, padding, dilation, groups,
                                                                           Activation("identity"), beta)
        self.fwd, self.dgrad, self.wgrad = CallMemo(_MEMO_SIZE), CallMemo(_MEMO_SIZE), CallMemo(_MEMO_SIZE)

    def fwd_params(self, residual: bool, tf32: bool) -> dict:
        return _params(self.stride, self.padding, self.dilation, self.groups, self.act, self.op_act[1], self.beta,
                       residual, tf32)

    def bwd_params(self, tf32: bool) -> dict:
        return _bwd_params(self.stride, self.padding, self.dilation, self.groups, tf32)


_CANONICAL = CallMemo(4096)  # a model has tens of distinct convs: a bound, not a working set


def _canonical(stride: tuple, padding: tuple, dilation: tuple, groups: int, act: Activation, beta: float) -> _Config:
    key = (stride, padding, dilation, groups, act, beta)
    cfg = _CANONICAL.get(key)
    if cfg is None:
        cfg = _CANONICAL.put(key, _Config(stride, padding, dilation, groups, act, beta))
    return cfg


def _config(nd: int, stride: Any, padding: Any, dilation: Any, groups: Any, activation: Any, beta: Any,
            kernel: Sequence[int]) -> _Config:
    """The config of a call's arguments (torch's spellings: ints, tuples, lists, 'same' / 'valid'),
    checked with errors naming the argument; repeated arguments cost one cache lookup."""
    try:
        return _config_cached(nd, stride, padding, dilation, groups, activation, beta, tuple(kernel))
    except TypeError:  # an unhashable spelling (a list): through the cache as tuples, which normalise alike
        try:
            return _config_cached(nd, _tupled(stride), _tupled(padding), _tupled(dilation), groups, activation, beta,
                                  tuple(kernel))
        except (TypeError, SpecError):  # normalised as spelled: the error names the value the caller passed
            return _make_config(nd, stride, padding, dilation, groups, activation, beta, tuple(kernel))


def _tupled(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _make_config(nd, stride, padding, dilation, groups, activation, beta, kernel) -> _Config:
    return _canonical(*_normalise(nd, stride, padding, dilation, groups, activation, beta, kernel))


def _normalise(nd, stride, padding, dilation, groups, activation, beta, kernel) -> tuple:
    """(stride, flat padding, dilation, groups, Activation, beta), checked, as tuples of ints: the specs'
    normaliser (`spec.geometry.conv_arguments`) under torch's rules, so both say the same of a bad value."""
    act = as_activation("activation", activation)
    stride, pairs, dilation = geometry.conv_arguments(nd, stride, padding, dilation, filter_dims=kernel,
                                                      torch_rules=True)
    count = geometry.groups(groups, torch_rules=True)
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise SpecError("beta", beta, "expected a number")
    return stride, tuple(p for pair in pairs for p in pair), dilation, count, act, float(beta)


# typed: 2 and 2.0 hash alike, but only the int passed the checks
_config_cached = functools.lru_cache(maxsize=1024, typed=True)(_make_config)


def _flat_config(stride, padding, dilation, groups, activation: str, act_param: float, beta: float) -> _Config:
    """The config of the registered ops' flat arguments."""
    act = Activation(activation, None if Activation(activation).param is None else act_param)
    return _canonical(tuple(stride), tuple(padding), tuple(dilation), groups, act, float(beta))


_flat_config_cached = functools.lru_cache(maxsize=1024, typed=True)(_flat_config)


# -- eager calls on CUDA: a memo from a cheap key straight to the prepared call -------------------------

_SLOW = "slow"  # a memo entry: the general path (packing copies, realigned views, typed errors)
_TORCH = "torch"  # a memo entry: cuDNN declined this graph; torch's convolution serves
_ALIGN = 15  # cuDNN graphs declare 16-byte aligned tensors


# A config's memos (fwd, dgrad, wgrad): key -> a prepared call (`requests._Call`), _SLOW or _TORCH. The
# key holds each tensor's shape, strides, dtype and device, the extra shapes, and torch's TF32 and
# determinism flags: everything the first call's checks read, so an equal key passes them alike
# (pointers' alignment is checked per call). A layer sees a few geometries: 64 entries, cleared when full.
_MEMO_SIZE = 64


def _flags() -> tuple[bool, bool, bool, bool]:
    """torch's flags a prepared call depends on: TF32, determinism, cuDNN benchmark (autotuned plans),
    cuDNN enabled (else torch's own convolution)."""
    # torch's own getters: the torch.backends attributes cost ~1 us each, on every call
    return (torch._C._get_cudnn_allow_tf32(),
            torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic(),
            torch._C._get_cudnn_benchmark(), torch._C._get_cudnn_enabled())


def _geometry(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _prepared(memo: CallMemo, key: tuple, kind: type, objs: tuple, params: dict, extra: tuple, packed: bool,
              what: str) -> Any:
    """The memo entry for a new key: the library's call (planned, buffers checked) where every tensor is
    a packed CUDA tensor of a supported dtype, else the general path, or torch's conv where cuDNN declines
    or torch's cuDNN is disabled."""
    if not torch._C._get_cudnn_enabled():  # torch.backends.cudnn.enabled = False: torch's non-cuDNN path
        return memo.put(key, _TORCH)
    if not (packed and _ours(*(t for t in objs if t is not None))):
        return memo.put(key, _SLOW)
    device = objs[0].get_device()
    session, tuning_in_capture = planning_session(device)
    try:
        call, _ = _requests.prepare_call(session, kind, objs, params, extra, torch._C._cuda_getCurrentRawStream(device))
    except UnsupportedGraphError as err:
        _declined_once(what, err)
        return memo.put(key, _TORCH)
    return call if tuning_in_capture else memo.put(key, call)


def _launch(call, ptrs: tuple, device: int) -> list:
    """Allocate the call's outputs through torch and launch on torch's current stream of `device`: no
    checks (the memo key proved them), no synchronisation."""
    new = [allocate() for allocate in call.allocators]
    call.launcher.launch(ptrs + tuple([t.data_ptr() for t in new]), torch._C._cuda_getCurrentRawStream(device),
                         capture_probe("torch", None))
    return new


def _fwd_eager(cfg: _Config, x, w, bias, z):
    if not x.is_cuda:
        return _conv_fwd_torch(x, w, bias, z, *cfg.flat, *cfg.op_act)
    ptrs = tuple([t.data_ptr() for t in (x, w, bias, z) if t is not None])
    if _misaligned(ptrs):  # a view at an offset: the general path runs it on aligned copies
        return _conv_fwd_cuda(x, w, bias, z, *cfg.flat, *cfg.op_act)
    key = (_geometry(x), _geometry(w), _geometry(bias), _geometry(z), _flags())
    call = cfg.fwd.get(key)
    if call is None:
        _check_fwd_shapes(x, w, bias, z, cfg.stride, cfg.padding, cfg.dilation, cfg.groups)
        fmt = _conv_format(x, w)
        packed = all(t is None or t.is_contiguous(memory_format=fmt) for t in (x, z, w))
        call = _prepared(cfg.fwd, key, _requests.ConvFwdRequest, (x, w, bias, z, None),
                         cfg.fwd_params(z is not None, key[-1][0]), (), packed,
                         f"conv_fwd {tuple(x.shape)} x {tuple(w.shape)}")
    if call is _SLOW:
        return _conv_fwd_cuda(x, w, bias, z, *cfg.flat, *cfg.op_act)
    if call is _TORCH:
        return _conv_fwd_torch(x, w, bias, z, *cfg.flat, *cfg.op_act)
    return _launch(call, ptrs, x.get_device())[0]


def _dgrad_eager(cfg: _Config, dy, w, x_shape):
    if not dy.is_cuda:
        return _conv_bwd_data_torch(dy, w, x_shape, *cfg.flat)
    ptrs = (dy.data_ptr(), w.data_ptr())
    if _misaligned(ptrs):
        return _conv_bwd_data_cuda(dy, w, x_shape, *cfg.flat)
    key = (_geometry(dy), _geometry(w), x_shape, _flags())
    call = cfg.dgrad.get(key)
    if call is None:
        packed = dy.is_contiguous(memory_format=_memory_format(dy)) and w.is_contiguous(memory_format=_memory_format(w))
        call = _prepared(cfg.dgrad, key, _requests.ConvBwdDataRequest, (dy, w, None, None), cfg.bwd_params(key[-1][0]),
                         (tuple(x_shape),), packed, f"conv_bwd_data {tuple(dy.shape)} x {tuple(w.shape)}")
    if call is _SLOW:
        return _conv_bwd_data_cuda(dy, w, x_shape, *cfg.flat)
    if call is _TORCH:
        return _conv_bwd_data_torch(dy, w, x_shape, *cfg.flat)
    return _launch(call, ptrs, dy.get_device())[0]


def _wgrad_eager(cfg: _Config, x, dy, w_shape, bias_grad: bool):
    """(dw, db): db is None without bias_grad."""
    if not x.is_cuda:
        return _wgrad_general(_conv_bwd_filter_torch, cfg, x, dy, w_shape, bias_grad)
    ptrs = (x.data_ptr(), dy.data_ptr())
    if _misaligned(ptrs):
        return _wgrad_general(_conv_bwd_filter_cuda, cfg, x, dy, w_shape, bias_grad)
    key = (_geometry(x), _geometry(dy), w_shape, bias_grad, _flags())
    call = cfg.wgrad.get(key)
    if call is None:
        fmt = _memory_format(x)
        packed = x.is_contiguous(memory_format=fmt) and dy.is_contiguous(memory_format=fmt)
        call = _prepared(cfg.wgrad, key, _requests.ConvBwdFilterRequest, (x, dy, None, None), cfg.bwd_params(key[-1][0]),
                         (tuple(w_shape), bias_grad), packed, f"conv_bwd_filter {tuple(x.shape)} -> {tuple(w_shape)}")
    if call is _SLOW or call is _TORCH:
        run = _conv_bwd_filter_torch if call is _TORCH else _conv_bwd_filter_cuda
        return _wgrad_general(run, cfg, x, dy, w_shape, bias_grad)
    new = _launch(call, ptrs, x.get_device())
    return (new[0], new[1]) if bias_grad else (new[0], None)


def _wgrad_general(run, cfg: _Config, x, dy, w_shape, bias_grad: bool):
    dw, db = run(x, dy, w_shape, *cfg.flat, bias_grad)
    return dw, db if bias_grad else None


def _misaligned(ptrs: tuple) -> bool:
    for p in ptrs:
        if p & _ALIGN:
            return True
    return False


# -- autograd ------------------------------------------------------------------------------------------

def _save(ctx, cfg: _Config, x, w, bias, output) -> None:
    need_x, need_w, need_b, need_z = ctx.needs_input_grad[:4]
    ctx.cfg, ctx.x_shape, ctx.w_shape, ctx.has_bias = cfg, x.shape, w.shape, bias is not None
    ctx.save_for_backward(x if need_w else None, w if need_x else None,
                          output if cfg.act != "identity" and (need_x or need_w or need_b or need_z) else None)


def _setup_fwd(ctx, inputs, output):
    x, w, bias, z, stride, padding, dilation, groups, activation, act_param, beta = inputs
    _save(ctx, _flat_config(stride, padding, dilation, groups, activation, act_param, beta), x, w, bias, output)


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


def _backward(ctx, dy, dgrad, wgrad) -> tuple:
    """(dx, dw, db, dz), only those needed; `dgrad(cfg, dy, w, x_shape)` and
    `wgrad(cfg, x, dy, w_shape, bias_grad) -> (dw, db or None)` run the convs."""
    x, w, y = ctx.saved_tensors
    cfg = ctx.cfg
    need_x, need_w, need_b, need_z = ctx.needs_input_grad[:4]
    g = _act_grad(dy, y, cfg.act, cfg.act_param)
    dx = dw = db = dz = None
    bias_grad = need_b and ctx.has_bias
    if need_x:
        dx = dgrad(cfg, g, w, ctx.x_shape)
    if need_w:
        dw, db = wgrad(cfg, x, g, ctx.w_shape, bias_grad)
    if bias_grad and db is None:
        db = g.sum([0, *range(2, g.dim())])
    if need_z:
        dz = g * cfg.beta if cfg.beta != 1.0 else g
    return dx, dw, db, dz


def _dgrad_op(cfg: _Config, dy, w, x_shape):
    return torch.ops.cudnn_graphs.conv_bwd_data(dy, w, list(x_shape), *cfg.flat)


def _wgrad_op(cfg: _Config, x, dy, w_shape, bias_grad: bool):
    dw, db = torch.ops.cudnn_graphs.conv_bwd_filter(x, dy, list(w_shape), *cfg.flat, bias_grad)
    return dw, db if bias_grad else None


def _backward_fwd(ctx, dy):  # traced by torch.compile: the registered ops, never our Python on fakes
    return *_backward(ctx, dy, _dgrad_op, _wgrad_op), None, None, None, None, None, None, None


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


# -- eager autograd: a plain autograd.Function on the memoised calls -----------------------------------
# torch.library's Python autograd wrapper costs ~170 us a call and the dispatcher ~30 (H100 host,
# tools/probe_op_overhead.py), against ~25 us for the conv itself: eager calls skip both; torch.compile
# traces the registered ops instead.

class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, z, cfg):
        y = _fwd_eager(cfg, x, w, bias, z)
        _save(ctx, cfg, x, w, bias, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph: gradients of gradients go through the registered ops
            return *_backward(ctx, dy, _dgrad_op, _wgrad_op), None
        return *_backward(ctx, dy, _dgrad_eager, _wgrad_eager), None


# Function.apply's Python layer (functorch checks, then unwrapping dead functorch wrappers) costs as much
# as the C++ apply under it with no transform active: call the C++ apply then, unwrapping as it would.
_apply_c = super(torch.autograd.Function, _ConvFunction).apply
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", None)


def _function(x, w, bias, z, cfg: _Config):
    if _unwrap_if_dead is None:
        return _ConvFunction.apply(x, w, bias, z, cfg)
    return _apply_c(_unwrap_if_dead(x), _unwrap_if_dead(w), None if bias is None else _unwrap_if_dead(bias),
                    None if z is None else _unwrap_if_dead(z), cfg)


# -- the functional API --------------------------------------------------------------------------------

def _conv(nd: int, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta):
    if input.dim() != nd + 2:  # torch's convs also take one sample without its batch dim
        return _unbatched(nd, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta)
    kernel = weight.shape[2:] if isinstance(padding, str) else ()  # only 'same' reads the kernel's size
    if torch.compiler.is_compiling():
        return _traced(input, weight, bias, residual,
                       *_normalise(nd, stride, padding, dilation, groups, activation, beta, tuple(kernel)))
    return _run(_config(nd, stride, padding, dilation, groups, activation, beta, kernel), input, weight, bias,
                residual)


def _unbatched(nd: int, input, weight, bias, stride, padding, dilation, groups, activation, residual, beta):
    if input.dim() != nd + 1:
        raise ShapeError("input", tuple(input.shape),
                         f"expected {nd + 1}D (unbatched) or {nd + 2}D (batched) input to conv{nd}d")
    z = None if residual is None else residual.unsqueeze(0)
    y = _conv(nd, input.unsqueeze(0), weight, bias, stride, padding, dilation, groups, activation, z, beta)
    return y.squeeze(0)


def _run(cfg: _Config, x, w, bias, z):
    """act(conv(x, w) + bias + beta * z) eagerly: our autograd Function where a gradient is needed,
    else straight to the kernels."""
    if torch._C._are_functorch_transforms_active():  # torch.func (grad, vmap, jacrev ...): torch's conv,
        return _conv_fwd_torch(x, w, bias, z, *cfg.flat, *cfg.op_act)  # which every transform knows
    x, w, bias, z = _in_autocast_dtype(x, w, bias, z)
    if not _wants_grad(x, w, bias, z):
        return _fwd_eager(cfg, x, w, bias, z)
    conv = cfg.pre if cfg.pre is not None else cfg  # the backward needs the pre-activation: keep it
    y = _function(x, w, bias, z, conv)
    return y if conv is cfg else cfg.activate(y)


def _traced(x, w, bias, z, stride, padding, dilation, groups, act, beta):
    """What torch.compile traces: the registered op on normalised arguments. No config tables or memos
    (dynamo would guard on their contents and recompile as they grow)."""
    x, w, bias, z = _in_autocast_dtype(x, w, bias, z)
    pre = _wants_grad(x, w, bias, z) and not _derivative_from_output(act)
    name, param = ("identity", 0.0) if pre else (act.name, 0.0 if act.param is None else act.param)
    y = torch.ops.cudnn_graphs.conv_fwd(x, w, bias, z, list(stride), list(padding), list(dilation), groups, name,
                                        param, beta)
    return torch_activation(act.name, act.param)(y) if pre else y


def _in_autocast_dtype(x, w, bias, z) -> tuple:
    """As torch's conv: in the autocast dtype of the input's device where autocast is on (cast as their
    own autograd nodes: casting inside our Function would cut the casts out of a double backward)."""
    if x.is_cuda:
        if torch.is_autocast_enabled("cuda"):
            return _autocast((x, w, bias, z), torch.get_autocast_dtype("cuda"))
    elif torch.is_autocast_enabled(x.device.type):  # CPU autocast (bfloat16) as well
        return _autocast((x, w, bias, z), torch.get_autocast_dtype(x.device.type))
    return x, w, bias, z


def _wants_grad(x, w, bias, z) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)
                                        or (z is not None and z.requires_grad))


def _derivative_from_output(act: Activation) -> bool:
    """Whether act'(pre) can be read off y = act(pre): y > 0 must mean pre > 0 where the slope differs."""
    if act.name in ("leaky_relu", "elu"):
        return act.param >= 0
    return act.name in _FROM_OUTPUT


_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def _autocast(tensors: tuple, dtype: torch.dtype) -> tuple:
    """The tensors in the autocast dtype, as autocast casts conv inputs: float64 stays float64. One
    already in it passes as is: `.to` calls that changed nothing took ~11 us of a layer's forward (H100
    host, tools/probe_autocast_layer.py)."""
    return tuple(t if t is None or t.dtype is dtype or t.dtype not in _CASTABLE else t.to(dtype) for t in tensors)


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

_TORCH_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class _ConvMixin:
    """What Conv1d/2d/3d add to torch's modules: the forward through our ops, an optional fused
    activation and residual. Parameters, buffers, initialisation and state_dict are torch's own."""

    _nd: int
    # convert(train_convs="torch") sets it: where the input's gradient is wanted, torch's own conv (one C++
    # autograd node); our Python node costs a host-bound step more than it saves outside fused runs. A conv
    # whose input needs no gradient (a network's input conv) keeps our plans: one node a step, and under
    # cudnn.benchmark torch would time it again in every process (0.19 s of resnet50's first step, H100)
    torch_when_training: bool = False

    def _init_activation(self, activation: Any) -> None:
        self.activation = as_activation("activation", activation)

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._conv_forward(input, self.weight, self.bias, residual)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        # torch's own hook, which subclasses (weight standardisation, LoRA ...) call with their weight
        # inside a forward-mode AD level (dual tensors) torch's conv too: our nodes have no jvp rule
        if self.torch_when_training and torch.is_grad_enabled() and input.requires_grad or _fwAD._current_level >= 0:
            return self._torch_forward(input, weight, bias, residual)
        padding = self.padding
        if self.padding_mode != "zeros":  # torch pads with the mode first, then convolves unpadded
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return _conv(self._nd, input, weight, bias, self.stride, padding, self.dilation, self.groups,
                     self.activation, residual, 1.0)

    def _torch_forward(self, input, weight, bias, residual):
        """What torch's module computes (its padding modes included), then our residual and activation."""
        # torch's class named, not super(): dynamo breaks the graph on a zero-argument super() in a mixin
        y = _TORCH_CONVS[self._nd]._conv_forward(self, input, weight, bias)
        if residual is not None:
            y = y + residual
        return y if self.activation.is_identity else torch_activation(self.activation.name, self.activation.param)(y)

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

