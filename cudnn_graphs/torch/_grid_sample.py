"""A drop-in for torch.nn.functional.grid_sample backed by fallback_kernels.grid_sample.

Same signature and values as torch's, plus `deterministic=`: the backward is bit-reproducible when asked
for, or whenever `torch.use_deterministic_algorithms(True)` is on (torch's own CUDA backward raises then).
The forward and the fast backward run this library's CUDA kernels; CPU tensors go to torch's own op.
Under autocast the inputs are cast to float32, as torch's autocast does for grid_sampler.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fallback_kernels import grid_sample as _kernels

from ._fallback import cpu_once

__all__ = ["GridSample", "grid_sample"]

_ALIGN_WARNING = ("Default grid_sample and affine_grid behavior has changed to align_corners=False since 1.3.0. "
                  "Please specify align_corners=True if the old behavior is desired. See the documentation of "
                  "grid_sample for details.")


def _custom_fwd(fn):
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "custom_fwd"):
        return amp.custom_fwd(fn, device_type="cuda", cast_inputs=torch.float32)
    return torch.cuda.amp.custom_fwd(fn, cast_inputs=torch.float32)  # pragma: no cover - torch < 2.4


def _custom_bwd(fn):
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "custom_bwd"):
        return amp.custom_bwd(fn, device_type="cuda")
    return torch.cuda.amp.custom_bwd(fn)  # pragma: no cover - torch < 2.4


class _GridSampleFunction(torch.autograd.Function):
    @staticmethod
    @_custom_fwd
    def forward(ctx, input, grid, mode, padding_mode, align_corners, deterministic):
        out = _kernels.grid_sample(input, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
        ctx.save_for_backward(input, grid)
        ctx.options = (mode, padding_mode, align_corners, deterministic)
        return out

    @staticmethod
    @once_differentiable
    @_custom_bwd
    def backward(ctx, grad_output):
        input, grid = ctx.saved_tensors
        mode, padding_mode, align_corners, deterministic = ctx.options
        need_input, need_grid = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_input = grad_grid = None
        if need_input or need_grid:
            grad_input, grad_grid = _kernels.grid_sample_backward(
                grad_output, input, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners,
                input_requires_grad=need_input, grid_requires_grad=need_grid,
                deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
        return grad_input, grad_grid, None, None, None, None


def grid_sample(input: torch.Tensor, grid: torch.Tensor, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners: Optional[bool] = None, *, deterministic: bool = False) -> torch.Tensor:
    """torch.nn.functional.grid_sample with this library's CUDA kernels (deterministic backward on request)."""
    _kernels.check_options(mode, padding_mode, False if align_corners is None else align_corners)
    if align_corners is None:
        warnings.warn(_ALIGN_WARNING, stacklevel=2)
        align_corners = False
    if not (input.is_cuda and grid.is_cuda):
        # torch's CPU op would raise its own RuntimeError (5-D bicubic): the same checks, the same SpecError
        _kernels.geometry(input.shape, grid.shape, _dtype_name(input), _dtype_name(grid), mode=mode,
                          padding_mode=padding_mode, align_corners=align_corners)
        cpu_once("grid_sample", input, grid)
        return F.grid_sample(input, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    return _GridSampleFunction.apply(input, grid, mode, padding_mode, bool(align_corners), bool(deterministic))


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class GridSample(torch.nn.Module):
    """Module form of `grid_sample`: GridSample(mode, padding_mode, align_corners, deterministic=False)."""

    def __init__(self, mode: str = "bilinear", padding_mode: str = "zeros", align_corners: Optional[bool] = None,
                 *, deterministic: bool = False):
        super().__init__()
        _kernels.check_options(mode, padding_mode, False if align_corners is None else align_corners)
        self.mode, self.padding_mode, self.align_corners = mode, padding_mode, align_corners
        self.deterministic = deterministic

    def forward(self, input: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return grid_sample(input, grid, self.mode, self.padding_mode, self.align_corners,
                           deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, padding_mode={self.padding_mode!r}, align_corners={self.align_corners}, "
                f"deterministic={self.deterministic}")
