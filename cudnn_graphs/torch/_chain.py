"""conv -> BatchNorm -> ReLU runs in training as one autograd node on cuDNN's BatchNorm fusions.

A run is stages conv_i -> BatchNorm_i -> ReLU_i (every stage but the last has its ReLU), ending in
[ReLU](BatchNorm_k(conv_k(...)) [+ residual]): torchvision's Bottleneck and BasicBlock bodies, or two or
more conv, BatchNorm2d, ReLU slot groups of an nn.Sequential (`_convert.py` finds them). A block's
downsample (conv -> BatchNorm of the run's input) may be the run's `branch`: its conv sums its statistics
like a stage's, and the output pass adds its normalised output in place of a residual, so it is never
written normalised; its input gradient is added to the first stage's in one pass.

Forward, per stage: one cuDNN graph runs the conv and sums its output per channel (`stats`), reading the
previous stage's raw conv output through a relu(y * scale + shift) prologue, so no normalised activation
is written; a one-block kernel turns the sums into mean, 1/std, scale, shift and the running statistics.
One pass writes the run's output. Backward, per stage: a one-launch, fixed-order reduction and one
elementwise pass give dy, dgamma, dbeta; cuDNN's dgrad, and its wgrad with the same prologue on its
input. From its second call, a run's forward and its
backward each replay as one re-pointed CUDA graph. Deterministic mode (`torch.use_deterministic_algorithms`,
`cudnn.deterministic`) sums the statistics with our own fixed-order kernel: cuDNN's genstats does not
add its blocks in a fixed order.

cuDNN 9.19 builds these graphs for float16, channels-last, ungrouped 2-D convs (`tools/probe_bn_fusions.py`:
every ResNet-50 layer, strided ones too; not bf16, not float32 operands). Anything else -- another
dtype or layout, eval mode, CPU tensors, a plan cuDNN declines -- runs the modules' own forward.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fallback_kernels.batchnorm import MAX_CAST, BatchNormKernels, Cast
from gpu_launch.replay import Replay
from gpu_launch.streams import capture_probe

from ..errors import UnsupportedGraphError
from ..plan.launcher import _Prepared
from ..spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec
from ._conv import planning_session

log = logging.getLogger("cudnn_graphs")

_ALIGN = 256  # sub-buffers start on this: cuDNN wants 16 bytes, re-pointable graphs 256 (graph_patch)
_F32, _F16 = 4, 2


@dataclass(frozen=True)
class Stage:
    """One conv -> BatchNorm [-> ReLU] of a run; `act` is the model's ReLU module where it has one (the
    unfused path calls it, so that hooks on it fire)."""

    conv: nn.Conv2d
    bn: nn.BatchNorm2d
    relu: bool
    act: nn.Module | None = None


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _StagePlan:
    """Launchers, kernels and buffer layout of one stage for one input geometry."""

    def __init__(self, stage: Stage, x_shape: tuple, prologue: bool, session, device: int, keep_dx: bool = False,
                 mask: bool = False, residual_grad: bool = False):
        # Deterministic sessions sum the statistics again in our fixed order, over cuDNN's: its genstats does
        # not add in a fixed order (bit-different sums call to call with deterministic plans, H200, cuDNN
        # 9.19), and the prologue conv has no engine without genstats.
        self.own_stats = bool(session.deterministic)
        conv = stage.conv
        params = dict(padding=_padding(conv), stride=tuple(conv.stride), dilation=tuple(conv.dilation),
                      dtype="float16", layout="channels_last")
        w_shape = tuple(conv.weight.shape)
        pro = "scale_bias_relu" if prologue else None
        fwd = ConvFwdSpec(x_shape, w_shape, prologue=pro, stats=True, **params)
        self.x_shape, self.y_shape, self.k, self.w_numel = x_shape, fwd.y_shape, w_shape[0], math.prod(w_shape)
        self.rows = math.prod(self.y_shape) // self.k
        self.bn = BatchNormKernels(self.rows, self.k, "float16", device)
        extra = ("scale", "shift") if prologue else ()
        self.fwd = session.plan(fwd).launcher(("x", *extra, "w", "y", "sum", "sq_sum"), "torch")
        adding = self._dgrad_adding(session, w_shape, params) if residual_grad else None
        self.dgrad_adds = adding is not None
        self.dgrad = adding if adding is not None else session.plan(
            ConvBwdDataSpec(self.y_shape, w_shape, x_shape, **params)).launcher(("dy", "w", "dx"), "torch")
        keep_dx = keep_dx or residual_grad and not self.dgrad_adds  # then our pass adds the two
        self.wgrad = session.plan(ConvBwdFilterSpec(x_shape, self.y_shape, w_shape, prologue=pro, **params)).launcher(
            ("x", *extra, "dy", "dw"), "torch")
        k, y_bytes, w_bytes = self.k, _up(math.prod(self.y_shape) * _F16), _up(self.w_numel * _F16)
        # One allocation a stage forward, kept for the backward: y, then float32 sum, sq_sum, mean, 1/std,
        # then float16 scale, shift, and the float16 weight. Every piece starts 256-aligned.
        f32 = _up(k * _F32)
        self.sum, self.sq_sum, self.mean, self.invstd = (y_bytes + i * f32 for i in range(4))
        self.scale, self.shift = y_bytes + 4 * f32, y_bytes + 4 * f32 + _up(k * _F16)
        self.w16 = self.shift + _up(k * _F16)
        self.stats_partials = self.w16 + w_bytes  # deterministic statistics' partial sums
        self.fwd_bytes = self.stats_partials + (_up(self.bn.partials_bytes) if self.own_stats else 0)
        # `mask` (a run's last stage, ending in a ReLU): the output pass writes the ReLU's mask a bit a value
        # here, and the backward reads it in place of the float16 output (1/16 of its bytes, twice a step)
        self.bits = self.fwd_bytes if mask and self.bn.bits else None
        self.fwd_bytes += _up(self.bn.bits_bytes) if self.bits is not None else 0
        # The backward's pieces of this stage (offsets within the run's one backward allocation): dy, the
        # reduction's coefficients and partials, the float16 dw, then dx where another stage reads it or it
        # is one of two input gradients to add (`keep_dx`: the first stage and the branch of a block).
        self.coef = y_bytes
        self.partials = self.coef + _up(3 * k * _F32)
        self.dw16 = self.partials + _up(self.bn.partials_bytes)
        self.dx = self.dw16 + w_bytes
        self.bwd_bytes = self.dx + (_up(math.prod(x_shape) * _F16) if prologue or keep_dx else 0)


    def _dgrad_adding(self, session, w_shape: tuple, params: dict):
        """The launcher (dy, w, z, dx) of the dgrad that adds the residual's gradient z in its epilogue
        (`residual_grad`: the run's input is also its residual, so x's two gradients are summed here); None
        where cuDNN has no one-graph engine for it (two graphs would move more bytes than our add pass)."""
        try:
            plan = session.plan(ConvBwdDataSpec(self.y_shape, w_shape, self.x_shape, residual=True, **params))
        except UnsupportedGraphError as err:
            log.info("cudnn_graphs: no dgrad + residual gradient graph for %s: %s", self.x_shape, err)
            return None
        if not plan.fused:
            log.info("cudnn_graphs: the dgrad + residual gradient of %s plans as two graphs: our add instead",
                     self.x_shape)
            return None
        return plan.launcher(("dy", "w", "z", "dx"), "torch")


def _padding(conv: nn.Conv2d) -> Any:
    if isinstance(conv.padding, str):
        return conv.padding
    return tuple(conv.padding)


class Chain:
    """A run of stages; `__call__(x, residual=None)` runs it: fused where it can, else as its modules do.

    `branch` (a block's downsample conv -> BatchNorm, no ReLU) reads the run's input and takes the residual's
    place; `branch_module` is what the modules' own computation calls for it (the downsample Sequential,
    so that its hooks fire). Holds its modules, not their state: a deep copy of the model copies the chain
    onto the copied modules and drops the plans (they belong to this process and device)."""

    def __init__(self, stages: list[Stage], *, final_relu: bool, branch: Stage | None = None,
                 branch_module: nn.Module | None = None):
        if branch is None and branch_module is not None:
            raise ValueError("branch_module: a run without a branch has no branch module")
        self.stages = tuple(stages)
        self.final_relu = final_relu
        self.branch, self.branch_module = branch, branch_module
        self.held: tuple = ()  # places(...) of the modules convert found: the report tells when one moved
        self.unfused_fn = None  # where convert matched the run on a traced graph: its operations as traced
        self._plans: dict[tuple, Any] = {}
        self._why: str | None = None  # why the last new geometry runs unfused

    @property
    def all_stages(self) -> tuple:
        """The stages, then the branch where there is one: the order of plans, parameters and pointers."""
        return self.stages if self.branch is None else (*self.stages, self.branch)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and self.branch is not None:
            raise ValueError("residual: a run with a downsample branch computes its own residual; got a tensor")
        # torch.func transforms (grad, vmap, jacrev ...) need rules our node does not have: the modules compute
        unfused = self._hooked() or torch._C._are_functorch_transforms_active() or not _chains_run()
        program = None if unfused else self._prepared(x, residual)
        if program is None:
            return self.unfused(x, residual)
        # a residual that is the input itself (a block's identity) enters once: the node sums x's gradient
        return _ChainFunction.apply(self, program, x, None if program.shared else residual, *self._params())

    def unfused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The run as its modules compute it (their hooks fire)."""
        if self.unfused_fn is not None:  # the user's own operations (x enters once where it is the residual)
            return self.unfused_fn(x) if residual is None or residual is x else self.unfused_fn(x, residual)
        if self.branch_module is not None:
            residual = self.branch_module(x)
        for st in self.stages[:-1]:
            x = st.bn(st.conv(x))
            x = (st.act or torch.relu)(x) if st.relu else x
        last = self.stages[-1]
        x = last.bn(last.conv(x))
        if residual is not None:
            x = x + residual
        return (last.act or torch.relu)(x) if self.final_relu else x

    def _hooked(self) -> bool:
        extra = [] if self.branch_module is None else [self.branch_module]
        return hooked([m for st in self.all_stages for m in (st.conv, st.bn, st.act) if m is not None] + extra)

    def status(self) -> str:
        """"fused", "not run yet", or why the last new geometry runs unfused."""
        if moved(self.held):
            return f"unfused: {REPLACED}"
        if self._why is not None:
            return f"unfused: {self._why}"
        return "fused" if self._plans else "not run in training yet"

    def __deepcopy__(self, memo: dict) -> "Chain":
        twin = Chain(copy.deepcopy(list(self.stages), memo), final_relu=self.final_relu,
                     branch=copy.deepcopy(self.branch, memo), branch_module=copy.deepcopy(self.branch_module, memo))
        twin.held, twin.unfused_fn = copy.deepcopy((self.held, self.unfused_fn), memo)
        return twin

    def __getstate__(self) -> dict:
        return {"stages": self.stages, "final_relu": self.final_relu, "branch": self.branch,
                "branch_module": self.branch_module, "held": self.held, "unfused_fn": self.unfused_fn}

    def __setstate__(self, state: dict) -> None:
        self.__init__(list(state["stages"]), final_relu=state["final_relu"], branch=state.get("branch"),
                      branch_module=state.get("branch_module"))
        self.held = state.get("held", ())
        self.unfused_fn = state.get("unfused_fn")

    def _params(self) -> list:
        out = []
        for st in self.all_stages:
            out += [st.conv.weight, st.bn.weight, st.bn.bias]
        return out

    def _prepared(self, x: torch.Tensor, residual: torch.Tensor | None):
        if not x.is_cuda or not self.stages[0].bn.training:
            return None
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        # everything a program bakes in: shapes, dtypes, flags, and each BatchNorm's constants
        key = (x.shape, x.dtype, dtype, x.get_device(),
               None if residual is None else (residual.shape, residual.dtype, residual is x),
               torch._C._get_deterministic_algorithms() or torch._C._get_cudnn_deterministic(),
               torch._C._get_cudnn_benchmark(),  # True: the plans come from an autotuning session
               tuple([(st.bn.training, st.bn.eps, st.bn.momentum, st.conv.weight.dtype) for st in self.all_stages]))
        program = self._plans.get(key, 0)
        if program == 0:
            program, provisional = self._plan(x, residual, dtype)
            if not provisional:  # planned inside a capture without the tuning asked for: not kept
                self._plans[key] = program
        return program

    def _plan(self, x, residual, dtype) -> "tuple[_Program | None, bool]":
        """(program, provisional): provisional where planned inside a capture with heuristics for a session
        that autotunes (`_conv.planning_session`)."""
        provisional = False
        why = _unsupported(self, x, residual, dtype)
        if why is None:
            device = x.get_device()
            session, provisional = planning_session(device)
            try:
                plans, shape, split = [], tuple(x.shape), self.branch is not None
                for i, st in enumerate(self.stages):
                    plans.append(_StagePlan(st, shape, i > 0, session, device, keep_dx=i == 0 and split,
                                            mask=i == len(self.stages) - 1 and self.final_relu,
                                            residual_grad=i == 0 and residual is x))
                    shape = plans[-1].y_shape
                    if plans[-1].rows < 2:
                        why = "one value per channel (torch's BatchNorm raises: let it say so)"
                        break
                if why is None and split:
                    plans.append(_StagePlan(self.branch, tuple(x.shape), False, session, device, keep_dx=True))
                    if plans[-1].y_shape != shape:
                        why = f"the downsample's output {plans[-1].y_shape} is not the run's {shape}"
                if why is None and residual is not None and tuple(residual.shape) != shape:
                    why = f"the residual's shape {tuple(residual.shape)} is not the output's {shape}"
            except UnsupportedGraphError as err:
                why = f"cuDNN declined a graph: {err}"
        self._why = why
        if why is not None:
            log.info("cudnn_graphs: a conv-BatchNorm run of %s runs unfused: %s", tuple(x.shape), why)
            return None, provisional
        return _Program(self, plans, x.get_device(), shared=residual is x), provisional


def _unsupported(chain: Chain, x, residual, dtype) -> str | None:
    """Why this call cannot run fused, or None."""
    if dtype != torch.float16:
        return f"the compute dtype is {dtype} (cuDNN fuses BatchNorm statistics for float16 only)"
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) \
            or x.dtype not in (torch.float16, torch.float32):
        return "the input is not a channels-last 4-D float16/float32 tensor"
    if residual is not None and not residual.is_contiguous(memory_format=torch.channels_last):
        return "the residual is not channels-last"
    for st in chain.all_stages:
        conv, bn = st.conv, st.bn
        if conv.groups != 1 or conv.bias is not None or conv.padding_mode != "zeros" or conv.weight.dim() != 4:
            return f"{conv} is grouped, has a bias or pads other than with zeros"
        w = conv.weight
        if w.dtype not in (torch.float16, torch.float32) or not w.is_contiguous(memory_format=torch.channels_last):
            return f"{conv}'s weight is not a channels-last float16/float32 tensor (model.to(memory_format=...))"
        if not bn.training or bn.weight is not None and bn.weight.dtype != torch.float32:
            return "a BatchNorm is in eval mode or has non-float32 parameters"
        if bn.running_mean is not None and bn.running_mean.dtype != torch.float32:
            return "a BatchNorm's running statistics are not float32"
    if any(not st.relu for st in chain.stages[:-1]):
        return "a stage before the last has no ReLU (cuDNN's prologue is relu(x * scale + shift) only)"
    return None


def _chains_run() -> bool:
    """Whether fused runs may serve this call: not while torch.compile traces (it traces the run's operations;
    a run's planning is Python it cannot trace), not with torch's cuDNN disabled."""
    return not torch.compiler.is_compiling() and torch._C._get_cudnn_enabled()  # dynamo can't trace the getter


REPLACED = "a module it holds was replaced after convert (the owner's own forward runs; convert a fresh model to fuse it)"


def places(held) -> tuple:
    """(parent._modules, name, module) of each (parent, name): where convert found the modules a node holds."""
    return tuple((parent._modules, name, parent._modules[name]) for parent, name in held)


def moved(held: tuple) -> bool:
    """Whether one of the `places` now holds another module (SyncBatchNorm's converter, a new downsample)."""
    for modules, name, module in held:
        if modules.get(name) is not module:
            return True
    return False


def why_not_plain(conv: nn.Module, *, bias: str) -> str | None:
    """Why a converted conv cannot be a fused node's conv (it must be ungrouped, zero-padded, with no bias
    and no activation of its own), or None; `bias` is what to say of a bias."""
    act = getattr(conv, "activation", None)
    for bad, why in ((act is not None and not act.is_identity, "the conv has a fused activation"),
                     (conv.bias is not None, bias),
                     (conv.groups != 1, "a grouped conv (cuDNN fuses no per-channel prologue there)"),
                     (conv.padding_mode != "zeros", f"padding_mode={conv.padding_mode!r}")):
        if bad:
            return why
    return None


def hooked(modules) -> bool:
    """Whether a hook watches one of `modules` (a fused node would pass it by): then the modules compute.
    Read per call, as hooks come and go; global module hooks count too."""
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks \
            or g._global_backward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules if m is not None)


def _ptr_or_0(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _momentum(bn: nn.BatchNorm2d) -> float | None:
    return None if bn.momentum is None else float(bn.momentum)


def _low_bits(ptrs) -> int:
    """Nonzero where a pointer is off the 256-byte class a re-pointed graph serves (then: run directly)."""
    bits = 0
    for p in ptrs:
        bits |= p
    return bits & 255


class _Program:
    """A run's launches for one geometry, forward and backward, each replayed as one re-pointed CUDA graph
    from its second call (`gpu_launch.replay.Replay`): a launch and a few pointer patches instead of a
    launch per kernel. Constants (eps, momentum, flags) are in the key that chose this program."""

    def __init__(self, chain: Chain, plans: list, device: int, shared: bool = False):
        # plans: one per stage, then the branch's where the run has one (chain.all_stages' order); shared:
        # the residual is the run's input (it enters the node once, and the node sums its two gradients)
        self.plans, self.device, self.shared = plans, device, shared
        self.stages = len(chain.stages)
        self.branch = plans[self.stages] if chain.branch is not None else None
        self.final_relu = chain.final_relu
        bns = [st.bn for st in chain.all_stages]
        self.eps = [float(bn.eps) for bn in bns]
        self.momentum = [_momentum(bn) for bn in bns]
        self.track = [bn.track_running_stats and bn.running_mean is not None for bn in bns]
        self.affine = [bn.weight is not None for bn in bns]
        self.cast = [st.conv.weight.dtype == torch.float32 for st in chain.all_stages]
        k = len(plans)
        cast_sizes = [p.w_numel for p, c in zip(plans, self.cast) if c]
        groups = [tuple(cast_sizes[i:i + MAX_CAST]) for i in range(0, len(cast_sizes), MAX_CAST)]
        self.to_half = [Cast(g, to="to_half", device=device) for g in groups]
        self.to_float = [Cast(g, to="to_float", device=device) for g in groups]
        # the two input gradients of a run with a branch, added in one pass over the input's geometry
        first = plans[0]
        adds = self.branch is not None or shared and not first.dgrad_adds
        self.add = None if not adds else BatchNormKernels(
            math.prod(first.x_shape) // first.x_shape[1], first.x_shape[1], "float16", device)
        self.bwd_offsets, total = [], 0
        for plan in plans:
            self.bwd_offsets.append(total)
            total += plan.bwd_bytes
        self.bwd_bytes = total
        self.dgb_offsets = [sum(2 * p.k for p in plans[:i]) for i in range(k)]
        # The reductions' counters, per stage one per tile for the statistics and one for the backward: zeroed
        # once here, left zeroed by each launch (a program runs one call at a time on its stream)
        tiles = [p.bn.tiles for p in plans]
        self.counters = torch.zeros(2 * sum(tiles), dtype=torch.int32, device=f"cuda:{device}")
        base = self.counters.data_ptr()
        self.stats_counters = [base + 4 * 2 * sum(tiles[:i]) for i in range(k)]
        self.bwd_counters = [c + 4 * t for c, t in zip(self.stats_counters, tiles)]
        self.dgb_numel = sum(2 * p.k for p in plans)
        self._preps: dict[tuple, _Prepared] = {}
        self._streams: dict[int, int] = {}  # thread -> the stream its current call replays on
        label = f"conv-BatchNorm run {plans[0].x_shape}"
        self.forward = Replay(self._forward, ordinal=device, label=label + " forward")
        self.backward: dict[tuple, Replay] = {}  # by (dx wanted, residual gradient wanted)
        self._label = label

    def _prep(self, launcher, s: int) -> _Prepared:
        """`launcher`'s plan ready on stream `s` from this thread; a recording's side stream uses the scratch
        of the stream its graph will replay on, as the launcher's own recordings do."""
        tid = threading.get_ident()
        key = (id(launcher), tid, s)
        prep = self._preps.get(key)
        if prep is None:
            prep = self._preps[key] = _Prepared(launcher.plan, launcher._slots, "torch", s,
                                                scratch_of=self._streams.get(tid, s))
        return prep

    # forward pointers: x16, r16 (or 0), out, then per stage: weight (fp32 source or the fp16 weight),
    # the stage's buffer, gamma, beta, running_mean, running_var, num_batches_tracked (0 where absent)
    def _forward(self, ptrs, stream: int) -> None:
        x16, out = ptrs[0], ptrs[2]
        r16 = x16 if self.shared else ptrs[1]
        stage_ptrs = [ptrs[3 + 7 * i: 10 + 7 * i] for i in range(len(self.plans))]
        if self.to_half:
            _cast(self.to_half, [(w, buf + p.w16) for (w, buf, *_), p, c in zip(stage_ptrs, self.plans, self.cast)
                                 if c], stream)
        inp, prev = x16, None
        for i in range(self.stages):
            self._stage_forward(i, stage_ptrs[i], inp, prev, stream)
            buf, plan = stage_ptrs[i][1], self.plans[i]
            inp, prev = buf, (buf + plan.scale, buf + plan.shift)
        scale2 = shift2 = 0
        if self.branch is not None:  # the downsample: its raw output and coefficients feed the output pass
            self._stage_forward(self.stages, stage_ptrs[self.stages], x16, None, stream)
            r16 = stage_ptrs[self.stages][1]
            scale2, shift2 = r16 + self.branch.scale, r16 + self.branch.shift
        last = self.plans[self.stages - 1]
        bits = 0 if last.bits is None else stage_ptrs[self.stages - 1][1] + last.bits
        last.bn.apply(stream, y=inp, scale=prev[0], shift=prev[1], out=out, relu=self.final_relu, residual=r16,
                      scale2=scale2, shift2=shift2, bits=bits)

    def _stage_forward(self, i: int, ptrs: tuple, inp: int, prev: tuple | None, stream: int) -> None:
        """Stage i's conv with its statistics (through the previous stage's prologue where `prev`), then
        its coefficients and running statistics."""
        plan, (w, buf, gamma, beta, rm, rv, nbt) = self.plans[i], ptrs
        w16 = buf + plan.w16 if self.cast[i] else w
        stats = (buf + plan.sum, buf + plan.sq_sum)
        conv = (inp, w16, buf, *stats) if prev is None else (inp, prev[0], prev[1], w16, buf, *stats)
        self._prep(plan.fwd, stream)(conv)
        if plan.own_stats:
            plan.bn.stats(stream, y=buf, partials=buf + plan.stats_partials, sum=buf + plan.sum,
                          sq_sum=buf + plan.sq_sum, counters=self.stats_counters[i])
        plan.bn.finalize(stream, sum=buf + plan.sum, sq_sum=buf + plan.sq_sum, gamma=gamma, beta=beta,
                         running_mean=rm, running_var=rv, num_batches=nbt, scale=buf + plan.scale,
                         shift=buf + plan.shift, mean=buf + plan.mean, invstd=buf + plan.invstd,
                         eps=self.eps[i], momentum=self.momentum[i])

    # backward pointers: g16, out (or 0), x16, dz (or 0), dx (or 0), the backward buffer, dgb, then per
    # stage: its forward buffer, weight (fp16 source where not cast), gamma (or 0), dw. Which launches run
    # follows flags fixed per program and variant, never a pointer's value: a re-pointed graph's moved
    # recordings make every pointer nonzero (graph_patch.moved_pointers), and their launches must match.
    def _backward(self, ptrs, stream: int, want_dx: bool) -> None:
        g16, out, x16, dz, dx, bwd, dgb = ptrs[:7]
        stage_ptrs = [ptrs[7 + 4 * i: 11 + 4 * i] for i in range(len(self.plans))]
        k, split = self.stages, self.branch is not None
        run = (stage_ptrs, out, x16, bwd, dgb, stream)
        if split:  # the downsample's gradients first: it reads the same incoming gradient as the last stage
            self._stage_backward(k, g16, 0, *run)
        da = g16
        for i in range(k - 1, -1, -1):
            da = self._stage_backward(i, da, dz if i == k - 1 else 0, *run)
        if want_dx:
            dgrad = (bwd + self.bwd_offsets[0], self._w16(0, stage_ptrs))
            if self.plans[0].dgrad_adds:  # a shared residual: the dgrad adds its gradient dz itself
                self._prep(self.plans[0].dgrad, stream)((*dgrad, dz, dx))
            elif self.add is None:
                self._prep(self.plans[0].dgrad, stream)((*dgrad, dx))
            else:  # x's two gradients added in our pass: the branch's, or a shared residual's dz
                first, other = bwd + self.bwd_offsets[0] + self.plans[0].dx, dz
                self._prep(self.plans[0].dgrad, stream)((*dgrad, first))
                if split:
                    other = bwd + self.bwd_offsets[k] + self.branch.dx
                    self._prep(self.branch.dgrad, stream)((bwd + self.bwd_offsets[k], self._w16(k, stage_ptrs), other))
                self.add.add(stream, a=first, b=other, out=dx)
        if self.to_float:
            _cast(self.to_float, [(bwd + self.bwd_offsets[i] + p.dw16, stage_ptrs[i][3])
                                  for i, (p, c) in enumerate(zip(self.plans, self.cast)) if c], stream)

    def _w16(self, i: int, stage_ptrs) -> int:
        buf, w = stage_ptrs[i][0], stage_ptrs[i][1]
        return buf + self.plans[i].w16 if self.cast[i] else w

    def _stage_backward(self, i: int, da: int, dz: int, stage_ptrs, out: int, x16: int, bwd: int, dgb: int,
                        stream: int) -> int:
        """Stage (or branch) i's BatchNorm backward and wgrad, and for a stage after the first its dgrad;
        returns where the previous stage's activation gradient is. The last stage and the branch read the
        run's incoming gradient, masked (where the run ends in a ReLU) by the output pass's bits or output."""
        plan, (buf, _, gamma, dw) = self.plans[i], stage_ptrs[i]
        sb, ends = bwd + self.bwd_offsets[i], i >= self.stages - 1
        d_gb = dgb + 4 * self.dgb_offsets[i]
        stored, bits = self._mask(stage_ptrs, out) if ends and self.final_relu else (0, 0)
        plan.bn.backward(stream, da=da, y=buf, out=stored, bits=bits,
                         scale=buf + plan.scale, shift=buf + plan.shift, gamma=gamma, mean=buf + plan.mean,
                         invstd=buf + plan.invstd, partials=sb + plan.partials, coef=sb + plan.coef,
                         dgamma=d_gb if self.affine[i] else 0, dbeta=d_gb + 4 * plan.k if self.affine[i] else 0, dy=sb,
                         relu=self.final_relu if ends else True, counters=self.bwd_counters[i], dz=dz)
        dw_out = sb + plan.dw16 if self.cast[i] else dw
        if i == 0 or i == self.stages:  # reads the run's input
            self._prep(plan.wgrad, stream)((x16, sb, dw_out))
            return 0
        pb, prev = stage_ptrs[i - 1][0], self.plans[i - 1]
        self._prep(plan.wgrad, stream)((pb, pb + prev.scale, pb + prev.shift, sb, dw_out))
        self._prep(plan.dgrad, stream)((sb, self._w16(i, stage_ptrs), sb + plan.dx))
        return sb + plan.dx

    def _mask(self, stage_ptrs, out: int) -> tuple[int, int]:
        """(stored output, bits) the backward of a run ending in a ReLU reads its mask from: the bits the
        output pass wrote into the last stage's buffer where it could, else the output."""
        last = self.plans[self.stages - 1]
        return (out, 0) if last.bits is None else (0, stage_ptrs[self.stages - 1][0] + last.bits)

    def run_forward(self, ptrs: tuple, stream: int) -> None:
        self._streams[threading.get_ident()] = stream
        _replayed(self.forward, self._forward, ptrs, stream)

    def run_backward(self, ptrs: tuple, stream: int, variant: tuple) -> None:
        """variant: (input gradient wanted, residual gradient wanted)."""
        replay = self.backward.get(variant)
        if replay is None:
            run = functools.partial(self._backward, want_dx=variant[0])
            replay = self.backward[variant] = Replay(run, ordinal=self.device, label=f"{self._label} backward")
        self._streams[threading.get_ident()] = stream
        _replayed(replay, replay.run, ptrs, stream)


def _cast(launches: list, pairs: list, stream: int) -> None:
    """(source, destination) pointer pairs through their Cast launches, MAX_CAST a launch, in order."""
    for n, cast in enumerate(launches):
        group = pairs[n * MAX_CAST:(n + 1) * MAX_CAST]
        cast(stream, [a for a, _ in group], [b for _, b in group])


def _replayed(replay: Replay, run, ptrs: tuple, stream: int) -> None:
    if _low_bits(ptrs):  # a view at an odd offset somewhere: this call runs its launches directly
        run(ptrs, stream)
    else:
        replay(ptrs, stream, capture_probe("torch", None)(stream))


def _cl(shape, device, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=dtype, memory_format=torch.channels_last)


def _bytes(n: int, device) -> torch.Tensor:
    return torch.empty(n, device=device, dtype=torch.uint8)


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """`t` as a float16 channels-last tensor whose data starts 16-byte aligned (cuDNN's graphs and the
    kernels' vector loads assume it; a view at an odd offset is copied)."""
    if t.dtype != torch.float16 or not t.is_contiguous(memory_format=torch.channels_last):
        t = t.to(torch.float16, memory_format=torch.channels_last)
    if t.data_ptr() % 16:
        t = t.clone(memory_format=torch.channels_last)
    return t


class _ChainFunction(torch.autograd.Function):
    """The whole run, forward and backward, as one autograd node over one `_Program`. Intermediates live in
    one raw allocation per stage forward and one per run backward (torch's caching allocator, stream-ordered);
    only the output and the gradients are tensors."""

    @staticmethod
    def forward(ctx, chain: Chain, program: _Program, x, residual, *params):
        device = x.device
        x16 = _aligned16(x)
        r16 = None if residual is None else _aligned16(residual)  # None where shared: the kernels read x16
        out = _cl(program.plans[program.stages - 1].y_shape, device)
        bufs = [_bytes(p.fwd_bytes, device) for p in program.plans]
        ptrs = [x16.data_ptr(), _ptr_or_0(r16), out.data_ptr()]
        weights = []
        for i, st in enumerate(chain.all_stages):
            bn, w = st.bn, params[3 * i]
            if not program.cast[i]:  # a float16 weight, read where it is (channels-last, as planned)
                w = w.contiguous(memory_format=torch.channels_last)
                weights.append(w)
            track = program.track[i]
            ptrs += [w.data_ptr(), bufs[i].data_ptr(), _ptr_or_0(params[3 * i + 1]), _ptr_or_0(params[3 * i + 2]),
                     bn.running_mean.data_ptr() if track else 0, bn.running_var.data_ptr() if track else 0,
                     bn.num_batches_tracked.data_ptr() if track else 0]
        program.run_forward(tuple(ptrs), torch._C._cuda_getCurrentRawStream(x.get_device()))
        ctx.program, ctx.x_dtype = program, x.dtype
        ctx.residual_dtype = x.dtype if program.shared else None if residual is None else residual.dtype
        stored = chain.final_relu and program.plans[program.stages - 1].bits is None  # else bits in its buffer
        ctx.save_for_backward(x16, out if stored else None, *bufs, *weights, *params)
        if ctx.residual_dtype not in (None, torch.float16):  # torch's type promotion of the add
            return out.to(torch.promote_types(torch.float16, ctx.residual_dtype))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # its kernels are not differentiable: a second order raises
    def backward(ctx, grad):
        program = ctx.program
        k = len(program.plans)
        saved = ctx.saved_tensors
        x16, out, bufs = saved[0], saved[1], saved[2:2 + k]
        n_w = k - sum(program.cast)
        weights, params = list(saved[2 + k:2 + k + n_w]), saved[2 + k + n_w:]
        device = x16.device
        g16 = _aligned16(grad)
        want_dx, want_dz = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dx = _cl(program.plans[0].x_shape, device) if want_dx else None
        # shared: dz is the residual's half of x's gradient, summed into dx here
        need_dz = want_dz or program.shared and want_dx
        dz = _cl(program.plans[program.stages - 1].y_shape, device) if need_dz else None
        bwd = _bytes(program.bwd_bytes, device)
        dgb = torch.empty(program.dgb_numel, device=device, dtype=torch.float32)
        dws = [torch.empty_like(params[3 * i], memory_format=torch.channels_last) for i in range(k)]
        ptrs = [g16.data_ptr(), _ptr_or_0(out), x16.data_ptr(), _ptr_or_0(dz), _ptr_or_0(dx), bwd.data_ptr(),
                dgb.data_ptr()]
        for i in range(k):
            w = weights.pop(0).data_ptr() if not program.cast[i] else 0
            ptrs += [bufs[i].data_ptr(), w, _ptr_or_0(params[3 * i + 1]), dws[i].data_ptr()]
        program.run_backward(tuple(ptrs), torch._C._cuda_getCurrentRawStream(x16.get_device()), (want_dx, want_dz))
        grads: list = []
        for i in range(k):
            grads.append(dws[i])
            if params[3 * i + 1] is not None:
                o, c = program.dgb_offsets[i], program.plans[i].k
                grads += [dgb[o:o + c], dgb[o + c:o + 2 * c]]
            else:
                grads += [None, None]
        if dx is not None and dx.dtype != ctx.x_dtype:
            dx = dx.to(ctx.x_dtype)
        if program.shared:
            return (None, None, dx, None, *grads)
        dres = None if dz is None or ctx.residual_dtype == torch.float16 else dz.to(ctx.residual_dtype)
        return (None, None, dx, dz if dres is None else dres, *grads)
