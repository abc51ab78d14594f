"""Squeeze-excitation's scale on this library's kernels: torchvision's `SqueezeExcitation` (MobileNetV3,
EfficientNet, RegNetY) computes `scale * input`, a (N, C, 1, 1) scale broadcast over the map.

`convert` (both modes) points the module's forward here: its own `_scale` (pool, fc1, activation, fc2, scale
activation: torch's modules, hooks and all), then, inside a CUDA-graph capture, where the map is a
channels-last CUDA tensor of float16, bfloat16 or float32 with the scale in its dtype and C a whole number of
16-byte vectors, one autograd node
(`SeScaleFunction`, `fallback_kernels/se_scale.cu`): the forward one pass (the same bits as torch's product),
the backward one pass that reads dy and the map once, writes dx and sums dy * x per (sample, channel) in
float32 in a fixed order, plus a small kernel adding the blocks' sums. torch runs the product and its
backward's two through TensorIterator's non-vectorised kernel and sums in a separate reduction. Anything else
(eager calls, NCHW, another dtype mix, torch.compile or torch.func tracing, a capture before the kernels were
loaded: `capture`'s warm-up loads them) runs torch's product. A second-order gradient through the node raises.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from fallback_kernels.se_scale import SeScale, load, supported

from ._layernorm import _DTYPES  # torch dtype -> the kernels' name: float16, bfloat16, float32

_lock = threading.Lock()  # a launch patches its argument slots in place
_MAX_LAUNCHERS = 256  # geometries kept (a model has a few dozen); past it the memo starts again
_MAX_SAMPLES = 65535  # the backward grid's third dimension
_launchers: dict[tuple, SeScale] = {}
_loaded: set[tuple[str, int]] = set()  # (dtype, device) whose kernels are loaded


def squeeze_excitation(module: nn.Module) -> bool:
    """torchvision's SqueezeExcitation, recognised by its class, its forward not replaced by its owner."""
    kind = type(module)
    return (kind.__name__ == "SqueezeExcitation" and kind.__module__.startswith("torchvision.")
            and "forward" not in vars(module) and callable(getattr(module, "_scale", None)))


def squeeze_excitation_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    scale = self._scale(input)
    # Only inside a CUDA-graph capture (`capture`, make_graphed_callables, torch.cuda.graph): eager steps of
    # these models are host-bound, and the Python node's host time outweighed the device time it saved
    # (efficientnet_b0, H100: device 13.75 -> 12.96 ms a step, eager wall 0.90x torch's, inference 1.39x
    # against 1.72x with torch's product); replayed, only the device time counts.
    out = se_scale(input, scale) if input.is_cuda and torch.cuda.is_current_stream_capturing() else None
    return scale * input if out is None else out


def load_for_capture(model: nn.Module, inputs: tuple) -> None:
    """Load our kernels ahead of a capture of `model` (`capture`'s warm-up), for the dtypes its maps can have:
    autocast's and the inputs'. A capture whose kernels were not loaded before it runs torch's product (a
    module load inside a capture would invalidate it)."""
    if not any(getattr(getattr(m, "forward", None), "fn", None) is squeeze_excitation_forward
               for m in model.modules()):
        return
    dtypes = {t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point()}
    if torch.is_autocast_enabled("cuda"):
        dtypes.add(torch.get_autocast_dtype("cuda"))
    devices = {t.get_device() for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda}
    for dtype in dtypes & _DTYPES.keys():
        for device in devices:
            _load(_DTYPES[dtype], device)


def _load(dtype: str, device: int) -> bool:
    """Whether our kernels for `dtype` are loaded on `device`, loading them outside a capture (a module load
    inside one would invalidate it: there the call runs torch's product instead)."""
    key = (dtype, device)
    if key not in _loaded:
        if torch.cuda.is_current_stream_capturing():
            return False
        load(*key)
        _loaded.add(key)
    return True


def se_scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """x * s (s of shape (N, C, 1, 1)) through `SeScaleFunction` where our kernels take the call, else None."""
    launcher = _launcher(x, s)
    return None if launcher is None else SeScaleFunction.apply(x, s, launcher)


def _launcher(x: torch.Tensor, s: torch.Tensor) -> SeScale | None:
    if not x.is_cuda or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    if x.dim() != 4 or s.dtype is not x.dtype or s.device != x.device or x.dtype not in _DTYPES:
        return None
    n, c, h, w = x.shape
    if tuple(s.shape) != (n, c, 1, 1) or not 0 < n <= _MAX_SAMPLES or x.numel() == 0 \
            or not supported(c, _DTYPES[x.dtype]):
        return None
    # the kernels read x as rows of C channels and s as (n, c) at n * C + c, with 16-byte loads
    if not x.is_contiguous(memory_format=torch.channels_last) or (c > 1 and s.stride(1) != 1) \
            or (n > 1 and s.stride(0) != c) or (x.data_ptr() | s.data_ptr()) % 16:
        return None
    key = (n, h * w, c, _DTYPES[x.dtype], x.get_device())
    launcher = _launchers.get(key)
    if launcher is None and not _load(key[3], key[4]):
        return None
    if launcher is None:
        if len(_launchers) >= _MAX_LAUNCHERS:
            _launchers.clear()
        launcher = _launchers[key] = SeScale(n, h * w, c, key[3], key[4])
    return launcher


def _dense_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t dense channels-last in like's dtype, 16-byte aligned (autograd's gradients may be views or expanded:
    `.to(memory_format=)` would hand an expanded one back as it is, strides 0)."""
    t = t.to(like.dtype).contiguous(memory_format=torch.channels_last)
    return t.clone(memory_format=torch.channels_last) if t.data_ptr() % 16 else t


class SeScaleFunction(torch.autograd.Function):
    """x * s[n, c] over a channels-last map on our kernels, forward and backward. Made by `se_scale`, which
    checks the call."""

    @staticmethod
    def forward(ctx, x, s, launcher):
        out = torch.empty_like(x, memory_format=torch.channels_last)
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        with _lock:
            launcher.forward(stream, x=x.data_ptr(), s=s.data_ptr(), out=out.data_ptr())
        ctx.save_for_backward(x, s)
        ctx.launcher = launcher
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, s = ctx.saved_tensors
        want_x, want_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_x or want_s):
            return None, None, None
        dy = _dense_like(dy, x)
        dx = torch.empty_like(x, memory_format=torch.channels_last) if want_x else None
        ds = torch.empty_like(s) if want_s else None  # s's own (n, c)-dense strides: written at n * C + c
        launcher = ctx.launcher
        partials = torch.empty(launcher.partials_bytes // 4, dtype=torch.float32, device=x.device) if want_s else None
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        with _lock:
            launcher.backward(stream, dy=dy.data_ptr(), x=x.data_ptr(), s=s.data_ptr(),
                              dx=0 if dx is None else dx.data_ptr(), ds=0 if ds is None else ds.data_ptr(),
                              partials=0 if partials is None else partials.data_ptr())
        return dx, ds, None
