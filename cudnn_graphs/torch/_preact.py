"""Pre-activation: an eval-mode BatchNorm2d -> ReLU in front of a conv as that conv's prologue.

Pre-activation networks (DenseNet's layers and transitions, pre-activation ResNets) normalise a conv's
input rather than its output, so the BatchNorm cannot be folded into the conv's weights. Where it runs
with its running statistics (eval mode, no gradient wanted), `PreActivation` runs the three modules as
one cuDNN graph: relu(x * scale + shift) -> conv, with scale = gamma / sqrt(var + eps) and shift =
beta - mean * scale, so the normalised activation is never written. Torch runs three kernels and writes
and reads the activation twice.

cuDNN 9.19 has an engine for that prologue only with the conv's statistics in the same graph (relu(x * s +
b) -> conv alone, or with a bias / ReLU epilogue: no engine, H100; `tools/probe_bn_fusions.py --inference`),
so the graph also writes per-channel sums into a scratch no one reads. Float16 (or AMP float16), channels-
last, ungrouped 2-D convs without bias or epilogue; anything else -- training mode, a gradient wanted,
another dtype or layout, hooks on a module, a graph cuDNN declines -- runs the three modules as torch does.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from gpu_launch.streams import allocate_kept, capture_probe

from ..errors import SpecError, UnsupportedGraphError
from ..spec import ConvFwdSpec
from ._chain import REPLACED, _padding, _up, hooked, moved, why_not_plain
from ._conv import planning_session

log = logging.getLogger("cudnn_graphs")

_ROLES = ("x", "scale", "shift", "w", "y", "sum", "sq_sum")
_SCRATCH: dict[tuple[int, int], tuple] = {}  # (device, out channels) -> (owner, address): unread statistics


class PreActivation:
    """BatchNorm2d -> ReLU -> conv, called as `site(x)`: one cuDNN graph where it can, else the modules.

    Holds its modules, not their state: a deep copy of the model copies it onto the copied modules and
    drops the plans (they belong to this process and device)."""

    def __init__(self, bn: nn.BatchNorm2d, relu: nn.Module, conv: nn.Conv2d):
        self.bn, self.relu, self.conv = bn, relu, conv
        self._plans: dict[tuple, Any] = {}  # call key -> (launcher, y shape, out channels), or None: declined
        self._coef: tuple = ((), None)  # (the versions they were made from, (scale16, shift16))
        self._w16: tuple = ((), None)  # under autocast: (the weight version, its float16 copy)
        self._why: str | None = None  # why the last new geometry runs unfused
        self._captured: list = []  # operands a CUDA graph captured through this site reads: never freed
        self.held: tuple = ()  # places(...) of the modules convert found: the report tells when one moved
        self.unfused_fn = None  # where convert matched the site on a traced graph: its operations as traced

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        launcher = self._fused(x)
        operands = None if launcher is None else self._operands()
        if operands is None:
            return self.conv(self.relu(self.bn(x))) if self.unfused_fn is None else self.unfused_fn(x)
        launcher, y_shape, k = launcher
        scale, shift, w = operands
        x16 = x if x.dtype == torch.float16 else x.to(torch.float16, memory_format=torch.channels_last)
        y = torch.empty(y_shape, dtype=torch.float16, device=x.device, memory_format=torch.channels_last)
        device = x.get_device()
        stream = torch._C._cuda_getCurrentRawStream(device)
        stats = _scratch(device, k, stream)
        ptrs = (x16.data_ptr(), scale.data_ptr(), shift.data_ptr(), w.data_ptr(), y.data_ptr(), stats,
                stats + _up(4 * k))
        if torch.cuda.is_current_stream_capturing():  # the graph reads these on every replay: kept alive
            self._captured.append(operands)
        launcher.launch(ptrs, stream, capture_probe("torch", None))
        return y

    def status(self) -> str:
        """"fused", "not run yet", or why the last new geometry runs unfused."""
        if moved(self.held):
            return f"unfused: {REPLACED}"
        if self._why is not None:
            return f"unfused: {self._why}"
        return "fused" if any(p is not None for p in self._plans.values()) else "not run in eval yet"

    def __deepcopy__(self, memo: dict) -> "PreActivation":
        twin = PreActivation(*copy.deepcopy((self.bn, self.relu, self.conv), memo))
        twin.held, twin.unfused_fn = copy.deepcopy((self.held, self.unfused_fn), memo)
        return twin

    def __getstate__(self) -> dict:
        return {"modules": (self.bn, self.relu, self.conv), "held": self.held, "unfused_fn": self.unfused_fn}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["modules"])
        self.held = state.get("held", ())
        self.unfused_fn = state.get("unfused_fn")

    # -- per call ---------------------------------------------------------------------------------------

    def _fused(self, x: torch.Tensor):
        """(launcher, y shape, channels) where this call runs as one graph, else None."""
        bn, conv = self.bn, self.conv
        if bn.training or not x.is_cuda or x.dim() != 4 or hooked((bn, self.relu, conv)) \
                or torch.compiler.is_compiling() or not torch._C._get_cudnn_enabled() \
                or torch._C._are_functorch_transforms_active():
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self._params())):
            return None  # eval with a gradient wanted: torch's modules (this graph has no backward)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        key = (x.shape, x.dtype, dtype, x.get_device(), x.is_contiguous(memory_format=torch.channels_last),
               x.data_ptr() % 16 == 0, conv.weight.dtype, conv.weight.is_contiguous(memory_format=torch.channels_last),
               torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic(),
               torch._C._get_cudnn_benchmark())
        plan = self._plans.get(key, 0)
        if plan == 0:
            plan, provisional = self._plan(x, dtype)
            if not provisional:  # planned inside a capture without the tuning asked for: not kept
                self._plans[key] = plan
        return plan

    def _plan(self, x: torch.Tensor, dtype: torch.dtype) -> tuple:
        why, provisional, plan = _unsupported(self, x, dtype), False, None
        if why is None:
            conv, device = self.conv, x.get_device()
            session, provisional = planning_session(device)
            try:
                spec = ConvFwdSpec(tuple(x.shape), tuple(conv.weight.shape), padding=_padding(conv),
                                   stride=tuple(conv.stride), dilation=tuple(conv.dilation), dtype="float16",
                                   layout="channels_last", prologue="scale_bias_relu", stats=True)
                plan = (session.plan(spec).launcher(_ROLES, "torch"), spec.y_shape, spec.w_shape[0])
            except SpecError as err:  # a geometry the spec refuses (the modules say what torch says)
                why = f"not a conv this graph takes: {err}"
            except UnsupportedGraphError as err:
                why = f"cuDNN declined the graph: {err}"
        self._why = why
        if why is not None:
            log.info("cudnn_graphs: BatchNorm -> ReLU -> conv of %s runs unfused: %s", tuple(x.shape), why)
        return plan, provisional

    def _params(self) -> list:
        return [p for p in (self.bn.weight, self.bn.bias, self.conv.weight) if p is not None]

    def _operands(self) -> tuple | None:
        """(scale16, shift16, weight16): the BatchNorm's running statistics as float16 scale and shift and the
        conv's float16 weight (a copy under autocast), made again when any of them changes (an optimizer step,
        load_state_dict, a training step's statistics). None where they are stale inside a CUDA-graph capture:
        made there, they would hold their values only once the graph replays (the modules run instead). A
        graph captured through this path keeps the values of its capture, as constants."""
        bn, w = self.bn, self.conv.weight
        parts = (bn.running_mean, bn.running_var, bn.weight, bn.bias)
        versions = (bn.eps,) + tuple((t.data_ptr(), t._version) for t in parts if t is not None)
        w_version = () if w.dtype == torch.float16 else (w.data_ptr(), w._version)
        stale = self._coef[0] != versions or self._w16[0] != w_version
        if stale and torch.cuda.is_current_stream_capturing():
            return None
        if self._coef[0] != versions:
            scale, shift = eval_affine(bn, torch.float32)
            self._coef = (versions, (scale.half(), shift.half()))
        if not w_version:
            return (*self._coef[1], w)
        if self._w16[0] != w_version:
            with torch.no_grad():
                self._w16 = (w_version, w.to(torch.float16, memory_format=torch.channels_last))
        return (*self._coef[1], self._w16[1])


def eval_affine(bn: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) in `dtype` with bn(x) == x * scale + shift in eval: gamma / sqrt(var + eps), beta - mean * scale."""
    with torch.no_grad():
        scale = bn.running_var.to(dtype).add(bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight.to(dtype)
        shift = -bn.running_mean.to(dtype) * scale
        if bn.bias is not None:
            shift = shift + bn.bias.to(dtype)
    return scale, shift


def _unsupported(site: PreActivation, x: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why this call cannot run as one graph, or None."""
    bn, conv = site.bn, site.conv
    if dtype != torch.float16:
        return f"the compute dtype is {dtype} (cuDNN's prologue takes float16 only)"
    if not x.is_contiguous(memory_format=torch.channels_last) or x.data_ptr() % 16:
        return "the input is not a 16-byte-aligned channels-last tensor"
    if x.dtype not in (torch.float16, torch.float32):
        return f"the input is {x.dtype}"
    if bn.running_mean is None or bn.running_var is None:
        return "the BatchNorm keeps no running statistics (it normalises with the batch's in eval too)"
    w = conv.weight
    if w.dtype not in (torch.float16, torch.float32) or not w.is_contiguous(memory_format=torch.channels_last):
        return "the conv's weight is not a channels-last float16/float32 tensor (model.to(memory_format=...))"
    if w.dtype != torch.float16 and not torch.is_autocast_enabled("cuda"):
        return "the conv's weight is float32 outside autocast"
    return None


def why_not_site(bn: nn.Module, act, conv: nn.Module) -> str | None:
    """Why a BatchNorm, an activation (`_activations.Act`) and a conv in a row cannot be a PreActivation,
    or None (checked once, at convert)."""
    from ._conv import Conv2d

    if not isinstance(bn, nn.BatchNorm2d) or bn.running_mean is None:
        return f"{type(bn).__name__} is not a 2-D BatchNorm with running statistics"
    if act is None or act.name != "relu":
        return f"{act or 'no activation'} is not a ReLU (cuDNN's prologue is relu(x * scale + shift))"
    if not isinstance(conv, Conv2d) or type(conv).forward is not Conv2d.forward or "forward" in vars(conv):
        return "the conv is not converted (see 'kept')" if isinstance(conv, nn.Conv2d) else "no Conv2d after it"
    why = why_not_plain(conv, bias="the conv has a bias (cuDNN fuses no epilogue with the prologue)")
    if why is None and bn.num_features != conv.in_channels:
        why = "the BatchNorm is not of the conv's input channels"
    return why


def _scratch(device: int, k: int, stream: int) -> int:
    """Address of the statistics cuDNN's prologue graph must write and nothing reads: one per device and
    width, kept for good, shared by every call (concurrent writers race harmlessly)."""
    held = _SCRATCH.get((device, k))
    if held is None:  # a race makes two and keeps one: harmless
        held = _SCRATCH.setdefault((device, k), allocate_kept(2 * _up(4 * k), "torch", device, stream))
    return held[1]
