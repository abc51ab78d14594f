"""An eval-mode BatchNorm folded into a copy of the conv's weights, with an activation and a residual add
as the conv's epilogue: one launch where torch runs up to four.

`FoldedConv(conv, bn, act)(x, residual)` computes act(bn(conv(x)) + residual) from folded weights it makes
from the modules' own tensors (float64 arithmetic, stored in the weight's dtype) and makes again when one
of them changes (an optimizer step, load_state_dict, `.to()`); under autocast the folded weights are cast
once per dtype and version, not per call. The modules themselves are never changed. Where it cannot
serve a call -- a gradient wanted through the modules' parameters, the BatchNorm in training mode, a hook
on either, a stale copy inside a CUDA-graph capture, a torch.func transform -- `unfused_fn` (the user's
operations as traced) runs instead.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from gpu_launch.activations import Activation

from ._chain import hooked
from ._conv import _conv, _memory_format
from ._preact import eval_affine

_IDENTITY = Activation("identity")


class FoldedConv:
    """conv [-> eval BatchNorm] [+ residual] [-> activation] as one conv of this library's."""

    def __init__(self, conv: nn.Module, bn: nn.Module | None, act: Activation | None):
        self.conv, self.bn, self.act = conv, bn, act or _IDENTITY
        self.unfused_fn = None  # the matched operations as torch runs them (`_graph.segment`)
        self.held: tuple = ()
        self._folded: tuple = ((), None)  # (the sources' versions, (weight, bias))
        self._cast: tuple = ((), None)  # (versions and dtype, (weight, bias) in the autocast dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        fits = residual is None or _residual_fits(self.conv, x, residual)
        weights = self._weights(x) if fits and self._serves() else None
        if weights is None:
            return self.unfused_fn(x) if residual is None else self.unfused_fn(x, residual)
        conv, padding = self.conv, self.conv.padding
        if conv.padding_mode != "zeros":  # torch pads with the mode first, then convolves unpadded
            x = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
            padding = 0
        return _conv(conv._nd, x, *weights, conv.stride, padding, conv.dilation, conv.groups, self.act, residual, 1.0)

    def _serves(self) -> bool:
        bn = self.bn
        if bn is not None and bn.training or torch._C._are_functorch_transforms_active() \
                or torch.compiler.is_compiling():  # compile traces the operations (and folds them itself)
            return False
        if hooked([m for m in (self.conv, bn) if m is not None]):
            return False
        return not torch.is_grad_enabled() or not any(p.requires_grad for p in self._sources())

    def _sources(self) -> list:
        conv, bn = self.conv, self.bn
        parts = [conv.weight, conv.bias]
        if bn is not None:
            parts += [bn.weight, bn.bias, bn.running_mean, bn.running_var]
        return [t for t in parts if t is not None]

    def _weights(self, x: torch.Tensor) -> tuple | None:
        """(weight, bias) to convolve with: folded, then in the autocast dtype; None where a stale copy would
        have to be made inside a CUDA-graph capture (it would hold its values only once the graph replays)."""
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in self._sources())
        if self.bn is not None:
            key += (self.bn.eps,)
        dtype = _autocast_dtype(x)
        cast_key = key + (dtype,)
        fresh = self._folded[0] == key and (dtype is None or self._cast[0] == cast_key)
        if not fresh and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        if self._folded[0] != key:
            self._folded = (key, self._fold())
        w, b = self._folded[1]
        if dtype is None or w.dtype == dtype:
            return w, b
        if self._cast[0] != cast_key:
            with torch.no_grad():
                self._cast = (cast_key, (w.to(dtype), None if b is None else b.to(dtype)))
        return self._cast[1]

    def _fold(self) -> tuple:
        conv, bn = self.conv, self.bn
        w = conv.weight
        if bn is None:
            return w.detach(), None if conv.bias is None else conv.bias.detach()
        scale, shift = eval_affine(bn, torch.float64)
        with torch.no_grad():
            folded = w.double() * scale.view(-1, *([1] * (w.dim() - 1)))
            bias = shift if conv.bias is None else conv.bias.double() * scale + shift
            return (folded.to(w.dtype).contiguous(memory_format=_memory_format(w)), bias.to(w.dtype))

    def __deepcopy__(self, memo: dict) -> "FoldedConv":
        twin = FoldedConv(*copy.deepcopy((self.conv, self.bn), memo), self.act)
        twin.unfused_fn, twin.held = copy.deepcopy((self.unfused_fn, self.held), memo)
        return twin

    def __getstate__(self) -> dict:
        return {"modules": (self.conv, self.bn), "act": self.act, "unfused_fn": self.unfused_fn, "held": self.held}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["modules"], state["act"])
        self.unfused_fn, self.held = state["unfused_fn"], state["held"]


def _residual_fits(conv: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether `+ residual` is an add of the conv's own shape and compute dtype: torch's add would broadcast
    another shape and promote another dtype, which the epilogue does not."""
    dtype = _autocast_dtype(x) if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else None
    if residual.dtype != (dtype or x.dtype) or x.dim() != conv.weight.dim():
        return False
    kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
    if isinstance(conv.padding, str):
        pads = [0] * len(kernel) if conv.padding == "valid" else None
    else:
        pads = list(conv.padding)
    spatial = list(x.shape[2:]) if pads is None else [
        (i + 2 * p - d * (k - 1) - 1) // s + 1 for i, p, d, k, s in zip(x.shape[2:], pads, dilation, kernel, stride)]
    return tuple(residual.shape) == (x.shape[0], conv.out_channels, *spatial)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
