"""conv -> BatchNorm -> ReLU runs in training as one autograd node on cuDNN's BatchNorm fusions.

A run is stages conv_i -> BatchNorm_i -> ReLU_i (every stage but the last has its ReLU), ending in
[ReLU](BatchNorm_k(conv_k(...)) [+ residual]): torchvision's Bottleneck and BasicBlock bodies, a
Sequential of Conv2dNormActivation. Forward, per stage: one cuDNN graph runs the conv and sums its
output per channel (`stats`), reading the previous stage's raw conv output through a
relu(y * scale + shift) prologue, so no normalised activation is written; a one-block kernel turns the
sums into mean, 1/std, scale, shift and the running statistics. One pass writes the run's output.
Backward, per stage: a two-launch reduction and one elementwise pass give dy, dgamma, dbeta; cuDNN's
dgrad, and its wgrad with the same prologue on its input.

cuDNN 9.19 builds these graphs for float16, channels-last, ungrouped 2-D convs (`tools/probe_bn_fusions.py`:
every ResNet-50 layer, strided ones too; not bf16, not float32 operands). Anything else -- another
dtype or layout, eval mode, CPU tensors, a plan cuDNN declines -- runs the modules' own forward.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fallback_kernels.batchnorm import BatchNormKernels
from gpu_launch.streams import capture_probe

from ..errors import UnsupportedGraphError
from ..plan import default_session
from ..spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec
from ._conv import _session

log = logging.getLogger("cudnn_graphs")

_ALIGN = 256  # sub-buffers start on this: cuDNN wants 16 bytes, re-pointable graphs 256 (graph_patch)
_F32, _F16 = 4, 2


@dataclass(frozen=True)
class Stage:
    """One conv -> BatchNorm [-> ReLU] of a run."""

    conv: nn.Conv2d
    bn: nn.BatchNorm2d
    relu: bool


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _StagePlan:
    """Launchers and kernels of one stage for one input geometry."""

    def __init__(self, stage: Stage, x_shape: tuple, prologue: bool, session, device: int):
        conv = stage.conv
        params = dict(padding=_padding(conv), stride=tuple(conv.stride), dilation=tuple(conv.dilation),
                      dtype="float16", layout="channels_last")
        w_shape = tuple(conv.weight.shape)
        pro = "scale_bias_relu" if prologue else None
        fwd = ConvFwdSpec(x_shape, w_shape, prologue=pro, stats=True, **params)
        self.x_shape, self.y_shape, self.k = x_shape, fwd.y_shape, w_shape[0]
        self.rows = math.prod(self.y_shape) // self.k
        self.bn = BatchNormKernels.get(rows=self.rows, channels=self.k, dtype="float16", device=device)
        extra = ("scale", "shift") if prologue else ()
        self.fwd = session.plan(fwd).launcher(("x", *extra, "w", "y", "sum", "sq_sum"), "torch")
        self.dgrad = session.plan(ConvBwdDataSpec(self.y_shape, w_shape, x_shape, **params)).launcher(
            ("dy", "w", "dx"), "torch")
        self.wgrad = session.plan(ConvBwdFilterSpec(x_shape, self.y_shape, w_shape, prologue=pro, **params)).launcher(
            ("x", *extra, "dy", "dw"), "torch")
        k, y_bytes = self.k, _up(math.prod(self.y_shape) * _F16)
        # One allocation a stage forward, kept for the backward: y, then float32 sum, sq_sum, mean, 1/std,
        # then float16 scale, shift. Every piece starts 256-aligned.
        f32 = _up(k * _F32)
        self.sum, self.sq_sum, self.mean, self.invstd = (y_bytes + i * f32 for i in range(4))
        self.scale, self.shift = y_bytes + 4 * f32, y_bytes + 4 * f32 + _up(k * _F16)
        self.fwd_bytes = self.shift + _up(k * _F16)
        # One a stage backward: dy, the reduction's coefficients and partials, then dx where another
        # stage reads it (the first stage's dx is the returned gradient, a tensor of its own).
        self.coef = _up(math.prod(self.y_shape) * _F16)
        self.partials = self.coef + _up(3 * k * _F32)
        self.dx = self.partials + _up(self.bn.partials_bytes)
        self.bwd_bytes = self.dx + (_up(math.prod(x_shape) * _F16) if prologue else 0)


def _padding(conv: nn.Conv2d) -> Any:
    if isinstance(conv.padding, str):
        return conv.padding
    return tuple(conv.padding)


class Chain:
    """A run of stages; `__call__(x, residual=None)` runs it: fused where it can, else as its modules do.

    Holds its modules, not their state: a deep copy of the model copies the chain onto the copied
    modules and drops the plans (they belong to this process and device)."""

    def __init__(self, stages: list[Stage], *, final_relu: bool):
        self.stages = tuple(stages)
        self.final_relu = final_relu
        self._plans: dict[tuple, Any] = {}
        self._why: str | None = None  # why the last new geometry runs unfused

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        plans = self._prepared(x, residual)
        if plans is None:
            return self.unfused(x, residual)
        return _ChainFunction.apply(self, plans, x, residual, *self._params())

    def unfused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The run as its modules compute it."""
        for st in self.stages[:-1]:
            x = st.bn(st.conv(x))
            x = torch.relu(x) if st.relu else x
        x = self.stages[-1].bn(self.stages[-1].conv(x))
        if residual is not None:
            x = x + residual
        return torch.relu(x) if self.final_relu else x

    def status(self) -> str:
        """"fused", "not run yet", or why the last new geometry runs unfused."""
        if self._why is not None:
            return f"unfused: {self._why}"
        return "fused" if self._plans else "not run in training yet"

    def __deepcopy__(self, memo: dict) -> "Chain":
        return Chain(copy.deepcopy(list(self.stages), memo), final_relu=self.final_relu)

    def __getstate__(self) -> dict:
        return {"stages": self.stages, "final_relu": self.final_relu}

    def __setstate__(self, state: dict) -> None:
        self.__init__(list(state["stages"]), final_relu=state["final_relu"])

    def _params(self) -> list:
        out = []
        for st in self.stages:
            out += [st.conv.weight, st.bn.weight, st.bn.bias]
        return out

    def _prepared(self, x: torch.Tensor, residual: torch.Tensor | None):
        if not x.is_cuda or not self.stages[0].bn.training:
            return None
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        key = (x.shape, x.dtype, dtype, x.get_device(), None if residual is None else (residual.shape, residual.dtype),
               torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic(),
               tuple([st.bn.training for st in self.stages]))
        plans = self._plans.get(key, 0)
        if plans == 0:
            plans = self._plans[key] = self._plan(x, residual, dtype)
        return plans

    def _plan(self, x, residual, dtype) -> list | None:
        why = _unsupported(self, x, residual, dtype)
        if why is None:
            device = x.get_device()
            session = _session(device) or default_session(device)
            try:
                plans, shape = [], tuple(x.shape)
                for i, st in enumerate(self.stages):
                    plans.append(_StagePlan(st, shape, i > 0, session, device))
                    shape = plans[-1].y_shape
                    if plans[-1].rows < 2:
                        why = "one value per channel (torch's BatchNorm raises: let it say so)"
                        break
                if why is None and residual is not None and tuple(residual.shape) != shape:
                    why = f"the residual's shape {tuple(residual.shape)} is not the output's {shape}"
            except UnsupportedGraphError as err:
                why = f"cuDNN declined a graph: {err}"
        self._why = why
        if why is not None:
            log.info("cudnn_graphs: a conv-BatchNorm run of %s runs unfused: %s", tuple(x.shape), why)
            return None
        return plans


def _unsupported(chain: Chain, x, residual, dtype) -> str | None:
    """Why this call cannot run fused, or None."""
    if dtype != torch.float16:
        return f"the compute dtype is {dtype} (cuDNN fuses BatchNorm statistics for float16 only)"
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) or x.dtype not in (torch.float16, torch.float32):
        return "the input is not a channels-last 4-D float16/float32 tensor"
    if residual is not None and not residual.is_contiguous(memory_format=torch.channels_last):
        return "the residual is not channels-last"
    for st in chain.stages:
        conv, bn = st.conv, st.bn
        if conv.groups != 1 or conv.bias is not None or conv.padding_mode != "zeros" or conv.weight.dim() != 4:
            return f"{conv} is grouped, has a bias or pads other than with zeros"
        if not bn.training or bn.weight is not None and bn.weight.dtype != torch.float32:
            return "a BatchNorm is in eval mode or has non-float32 parameters"
        if bn.running_mean is not None and bn.running_mean.dtype != torch.float32:
            return "a BatchNorm's running statistics are not float32"
    if any(not st.relu for st in chain.stages[:-1]):
        return "a stage before the last has no ReLU (cuDNN's prologue is relu(x * scale + shift) only)"
    return None


def _ptr_or_0(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _momentum(bn: nn.BatchNorm2d) -> float | None:
    return None if bn.momentum is None else float(bn.momentum)


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """`t` as a float16 channels-last tensor whose data starts 16-byte aligned (cuDNN's graphs and the
    kernels' vector loads assume it; a view at an odd offset is copied)."""
    if t.dtype != torch.float16 or not t.is_contiguous(memory_format=torch.channels_last):
        t = t.to(torch.float16, memory_format=torch.channels_last)
    if t.data_ptr() % 16:
        t = t.clone(memory_format=torch.channels_last)
    return t


def _cl(shape, device, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=dtype, memory_format=torch.channels_last)


def _bytes(n: int, device) -> torch.Tensor:
    return torch.empty(n, device=device, dtype=torch.uint8)


class _ChainFunction(torch.autograd.Function):
    """The whole run, forward and backward, as one autograd node. Intermediates live in one raw
    allocation per stage and direction (torch's caching allocator, stream-ordered); only the output and
    the gradients are tensors."""

    @staticmethod
    def forward(ctx, chain: Chain, plans: list, x, residual, *params):
        device = x.device
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        probe = capture_probe("torch", None)
        x16 = _aligned16(x)
        weights = [p.to(torch.float16, memory_format=torch.channels_last) for p in params[0::3]]
        bufs, inp, prev = [], x16.data_ptr(), None
        for st, plan, w in zip(chain.stages, plans, weights):
            buf = _bytes(plan.fwd_bytes, device)
            base = buf.data_ptr()
            if prev is None:
                ptrs = (inp, w.data_ptr(), base, base + plan.sum, base + plan.sq_sum)
            else:
                ptrs = (inp, prev[0], prev[1], w.data_ptr(), base, base + plan.sum, base + plan.sq_sum)
            plan.fwd.launch(ptrs, stream, probe)
            bn = st.bn
            plan.bn.finalize(stream, sum=base + plan.sum, sq_sum=base + plan.sq_sum, gamma=_ptr_or_0(bn.weight),
                             beta=_ptr_or_0(bn.bias), running_mean=_ptr_or_0(bn.running_mean),
                             running_var=_ptr_or_0(bn.running_var),
                             num_batches=_ptr_or_0(bn.num_batches_tracked) if bn.track_running_stats else 0,
                             scale=base + plan.scale, shift=base + plan.shift, mean=base + plan.mean,
                             invstd=base + plan.invstd, eps=float(bn.eps), momentum=_momentum(bn))
            bufs.append(buf)
            inp, prev = base, (base + plan.scale, base + plan.shift)
        last = plans[-1]
        out = _cl(last.y_shape, device)
        r = None if residual is None else _aligned16(residual)
        last.bn.apply(stream, y=inp, scale=prev[0], shift=prev[1], out=out.data_ptr(), relu=chain.final_relu,
                      residual=_ptr_or_0(r))
        ctx.chain, ctx.plans, ctx.x_dtype = chain, plans, x.dtype
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.param_dtypes = [p.dtype if p is not None else None for p in params]
        ctx.save_for_backward(x16, out if chain.final_relu else None, *bufs, *weights)
        if residual is not None and residual.dtype != torch.float16:  # torch's type promotion of the add
            return out.to(torch.promote_types(torch.float16, residual.dtype))
        return out

    @staticmethod
    def backward(ctx, grad):
        chain, plans = ctx.chain, ctx.plans
        k = len(plans)
        saved = ctx.saved_tensors
        x16, out, bufs, weights = saved[0], saved[1], saved[2:2 + k], saved[2 + k:]
        device = x16.device
        stream = torch._C._cuda_getCurrentRawStream(x16.get_device())
        probe = capture_probe("torch", None)
        da_t = _aligned16(grad)  # the reference keeps da alive while its readers queue
        da = da_t.data_ptr()
        grads: list = [None] * (3 * k)
        dres = dx = None
        for i in range(k - 1, -1, -1):
            plan, st, base = plans[i], chain.stages[i], bufs[i].data_ptr()
            last = i == k - 1
            scratch = _bytes(plan.bwd_bytes, device)
            sb = scratch.data_ptr()
            dgb = torch.empty((2, plan.k), device=device, dtype=torch.float32)
            dz = _cl(plan.y_shape, device) if last and ctx.needs_input_grad[3] else None
            bn = st.bn
            plan.bn.backward(stream, da=da, y=base, out=_ptr_or_0(out) if last else 0, scale=base + plan.scale,
                             shift=base + plan.shift, gamma=_ptr_or_0(bn.weight), mean=base + plan.mean,
                             invstd=base + plan.invstd, partials=sb + plan.partials, coef=sb + plan.coef,
                             dgamma=dgb.data_ptr(), dbeta=dgb.data_ptr() + 4 * plan.k, dy=sb,
                             relu=chain.final_relu if last else st.relu, dz=_ptr_or_0(dz))
            if last and dz is not None:
                dres = dz if ctx.residual_dtype == torch.float16 else dz.to(ctx.residual_dtype)
            w = weights[i]
            dw = torch.empty_like(w)
            if i == 0:
                plan.wgrad.launch((x16.data_ptr(), sb, dw.data_ptr()), stream, probe)
            else:
                prev, pb = plans[i - 1], bufs[i - 1].data_ptr()
                plan.wgrad.launch((pb, pb + prev.scale, pb + prev.shift, sb, dw.data_ptr()), stream, probe)
            if i > 0:
                plan.dgrad.launch((sb, w.data_ptr(), sb + plan.dx), stream, probe)
                da_t, da = scratch, sb + plan.dx
            elif ctx.needs_input_grad[2]:
                dx = _cl(plan.x_shape, device)
                plan.dgrad.launch((sb, w.data_ptr(), dx.data_ptr()), stream, probe)
            grads[3 * i] = dw.to(ctx.param_dtypes[3 * i])
            if bn.weight is not None:
                grads[3 * i + 1], grads[3 * i + 2] = dgb[0], dgb[1]
        if dx is not None and dx.dtype != ctx.x_dtype:
            dx = dx.to(ctx.x_dtype)
        return (None, None, dx, dres, *grads)
