"""`linear_act` / `LinearAct`: nn.Linear followed by an activation, forward and backward through
fallback_kernels.gemm_act (cuBLAS GEMMs plus one fused elementwise pass each way).

    y = linear_act(x, weight, bias, activation="gelu")   # act(x @ weight.T + bias), weight [out, in]

Any leading batch dimensions, like nn.Linear. The weight is used in place as the transposed operand
(no copy); its gradient comes back in its own [out, in] layout. What is saved for backward: the input,
the weight, and relu's output itself (as torch's relu saves it), leaky_relu's bit mask, or the
pre-activation in the io dtype (the others).
CUDA tensors of one dtype (float16, bfloat16 or float32); float32 matmuls follow
torch.backends.cuda.matmul.allow_tf32. CPU tensors run through torch's own ops (one warning per geometry),
as `MLP`, the convolutions and `grid_sample` do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fallback_kernels.gemm_act import gemm_bias_act, gemm_bias_act_backward
from gpu_launch.activations import Activation, as_activation

from ._activations import torch_activation
from ._fallback import cpu_once, on_cuda

__all__ = ["linear_act", "LinearAct"]


class _LinearActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, act):
        x2 = x.reshape(-1, x.shape[-1])  # a view when x is contiguous
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
        save = any(ctx.needs_input_grad[:3])
        y, aux = gemm_bias_act(x2, weight.t(), bias, activation=act, save_for_backward=save,
                               allow_tf32=allow_tf32)
        ctx.act, ctx.allow_tf32, ctx.x_shape, ctx.has_bias = act, allow_tf32, x.shape, bias is not None
        if save:
            ctx.save_for_backward(x2, weight, aux)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        need = tuple(name for name, flag in zip(("a", "b", "bias"), ctx.needs_input_grad[:3])
                     if flag and (name != "bias" or ctx.has_bias))
        if not need:
            return None, None, None, None
        x2, weight, aux = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1]).contiguous()  # an explicit copy when autograd hands a strided grad
        da, db, dbias = gemm_bias_act_backward(gy2, x2, weight.t(), aux, activation=ctx.act, need=need,
                                               allow_tf32=ctx.allow_tf32)
        dx = da.view(ctx.x_shape) if da is not None else None
        dw = db.t() if db is not None else None  # db has weight.T's layout: db.T is [out, in] contiguous
        return dx, dw, dbias, None


def linear_act(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               activation: Any = "relu") -> torch.Tensor:
    """act(input @ weight.T + bias) with nn.Linear's weight layout [out_features, in_features]."""
    act = as_activation("activation", activation)
    if input.shape[-1:] != weight.shape[-1:] or weight.dim() != 2:
        raise ValueError(f"linear_act: input {tuple(input.shape)} and weight {tuple(weight.shape)} do not match "
                         "(weight is [out_features, in_features])")
    lead = input.shape[:-1]
    if not on_cuda(input, weight, bias):  # CPU tensors: torch's own ops, as nn.Linear would run them
        cpu_once("linear_act", input, weight)
        return torch_activation(act.name, act.param)(torch.nn.functional.linear(input, weight, bias))
    if input.dim() == 1:
        return _LinearActFunction.apply(input.unsqueeze(0), weight, bias, act).squeeze(0)
    if 0 in (math.prod(lead), weight.shape[0], weight.shape[1]):  # empty: torch ops keep autograd and shapes
        return torch_activation(act.name, act.param)(torch.nn.functional.linear(input, weight, bias))
    return _LinearActFunction.apply(input, weight, bias, act)


class LinearAct(nn.Module):
    """nn.Linear (same parameters, initialisation and state_dict) followed by an activation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: Any = "relu",
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.activation: Activation = as_activation("activation", activation)
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # as nn.Linear
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_act(input, self.weight, self.bias, activation=self.activation)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation}")
