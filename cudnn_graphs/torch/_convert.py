"""`convert(model)`: every torch.nn.Conv1d/2d/3d of a model becomes ours, in place.

    model = cudnn_graphs.torch.convert(model)                        # training: parameters shared
    model = cudnn_graphs.torch.convert(model.eval(), inference=True)  # BatchNorm folded, epilogues fused
    print(model.cudnn_graphs_report)

Training: conv -> BatchNorm2d -> ReLU runs (torchvision's BasicBlock and Bottleneck bodies with their
residual add and their downsample's conv -> BatchNorm, and runs inside an nn.Sequential) run as one
fused autograd node each (`_chain.py`), where the call allows it (float16 or AMP float16, channels_last,
training mode); elsewhere the modules' own forward runs. `fuse_batchnorm=False` keeps torch's BatchNorm.
A conv outside a fused run calls torch's own convolution where a gradient is wanted (`train_convs`).

Training: each conv keeps its Parameter objects (an optimizer made before still steps them); a conv
used in two places stays one module, and one under torch.nn.utils.parametrize (weight_norm ...) keeps
its parametrizations.
Inference (eval mode): a BatchNorm right after a conv, in an nn.Sequential or in torchvision's
ResNet blocks, is folded into the conv's weight and bias (new tensors: the report says "copied"),
a following activation becomes the conv's fused epilogue, and in torchvision's BasicBlock and
Bottleneck the residual add and ReLU fuse into the last conv. What cannot be converted (transposed
or lazy convs, subclasses with their own forward) stays torch and is listed with the reason.
Both modes: a BatchNorm2d -> ReLU in front of a conv (DenseNet's layers and transitions, such
slots in an nn.Sequential) runs in eval, with no gradient wanted, as one cuDNN graph with the
BatchNorm and ReLU as the conv's prologue (`_preact.py`); its modules stay where they were. Where no
gradient is wanted, nn.LayerNorm and torchvision's LayerNorm2d run on this library's LayerNorm kernel,
and torchvision's ConvNeXt block in fewer passes over memory (`_layernorm.py`). Inside a CUDA-graph
capture, torchvision's SqueezeExcitation multiplies its scale into a channels-last map on this library's
kernels, forward and backward (`_se.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from gpu_launch.activations import Activation

from ._chain import Chain, Stage, moved, places, why_not_plain
from ._conv import Conv1d, Conv2d, Conv3d, _memory_format
from ._layernorm import (convnext_block_forward, layer_norm_2d_forward, layer_norm_forward, layer_norm_kind,
                         why_not_convnext_block)
from ._preact import PreActivation, eval_affine, why_not_site
from ._se import squeeze_excitation, squeeze_excitation_forward

__all__ = ["ConversionReport", "convert"]

_OURS = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass
class ConversionReport:
    """What `convert` did, by qualified module name."""

    replaced: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (name, why it stays torch's)
    folded_batchnorm: list[str] = field(default_factory=list)  # the BatchNorm modules folded away
    fused_activation: list[tuple[str, str]] = field(default_factory=list)  # (conv, activation)
    fused_residual: list[str] = field(default_factory=list)  # blocks whose add + relu the last conv does
    weights: str = "shared"  # or "copied" where BatchNorm was folded into new weight and bias tensors
    chains: list[tuple[str, Chain]] = field(default_factory=list)  # training: (where, conv-BatchNorm run)
    unchained: list[tuple[str, str]] = field(default_factory=list)  # training: (conv, why its BatchNorm stays)
    # eval: (conv, site) where BatchNorm -> ReLU -> conv runs as one graph; (conv, why not) where it cannot
    prologues: list[tuple[str, PreActivation]] = field(default_factory=list)
    no_prologue: list[tuple[str, str]] = field(default_factory=list)
    # no gradient wanted: LayerNorm modules on our kernel; torchvision ConvNeXt blocks in fewer passes
    layer_norms: list[str] = field(default_factory=list)
    convnext_blocks: list[str] = field(default_factory=list)
    unfused_convnext: list[tuple[str, str]] = field(default_factory=list)  # (block, why its own forward runs)
    squeeze_excitations: list[str] = field(default_factory=list)  # torchvision SqueezeExcitation: scale * x ours
    inference: bool = False  # converted with inference=True (BatchNorm folded, epilogues fused)
    train_convs: str = "torch"  # where a conv outside a fused run needs a gradient: "torch" or "cudnn_graphs"

    def __str__(self) -> str:
        lines = [f"{len(self.replaced)} convolutions converted (weights {self.weights})"]
        if not self.inference:
            lines.append(f"convs outside fused runs train with {_TRAIN_CONVS[self.train_convs]} "
                         f"(train_convs={self.train_convs!r})")
        if self.folded_batchnorm:
            lines.append(f"{len(self.folded_batchnorm)} BatchNorm folded, {len(self.fused_activation)} activations "
                         f"and {len(self.fused_residual)} residual adds fused")
        if self.chains:
            lines.append(f"{len(self.chains)} conv-BatchNorm-ReLU runs, each one fused node in training:")
            lines += [f"  {where} ({len(chain.stages)} convs{' + downsample' if chain.branch else ''}): "
                      f"{chain.status()}" for where, chain in self.chains]
        if self.unchained:
            lines.append(f"{len(self.unchained)} conv -> BatchNorm pairs left unfused in training:")
            lines += [f"  {where}: {why}" for where, why in self.unchained]
        if self.prologues:
            lines.append(f"{len(self.prologues)} BatchNorm -> ReLU -> conv, each one graph in eval (the conv's prologue):")
            lines += [f"  {where}: {site.status()}" for where, site in self.prologues]
        lines += [f"BatchNorm -> ReLU -> {where} stays three kernels in eval: {why}" for where, why in self.no_prologue]
        if self.layer_norms:
            lines.append(f"{len(self.layer_norms)} LayerNorm on this library's kernel where no gradient is wanted")
        if self.convnext_blocks:
            lines.append(f"{len(self.convnext_blocks)} ConvNeXt blocks in fewer passes where no gradient is wanted, "
                         f"one autograd node each in float16 AMP training")
        lines += [f"ConvNeXt block {where} runs its own forward: {why}" for where, why in self.unfused_convnext]
        if self.squeeze_excitations:
            lines.append(f"{len(self.squeeze_excitations)} squeeze-excitation scales (scale * x) on this library's "
                         f"kernels inside CUDA-graph captures of channels-last CUDA maps")
        lines += [f"kept torch's {name}: {why}" for name, why in self.kept]
        return "\n".join(lines)


_TRAIN_CONVS = {"torch": "torch's convolution (its C++ autograd node)",
                "cudnn_graphs": "this library's plans (autotuned once per machine under cudnn.benchmark)"}


def convert(model: nn.Module, *, inference: bool = False, fuse_batchnorm: bool = True,
            train_convs: str = "torch") -> nn.Module:
    """`model` with its convolutions on cuDNN graphs (in place); the report is `model.cudnn_graphs_report`.

    `fuse_batchnorm`: conv -> BatchNorm -> ReLU runs become one fused node each in training, and
    BatchNorm -> ReLU -> conv one graph in eval (pre-activation networks).
    `train_convs`: what a conv outside such a run does where its input's gradient is wanted. "torch"
    (default): torch's own convolution, whose C++ autograd node costs a host-bound step less than ours (a
    conv whose input needs no gradient, such as the network's first, keeps this library's plans); "cudnn_graphs":
    this library's plans, which under `cudnn.benchmark` are autotuned once per machine and read from the
    plan cache (no timing in a job's first iteration) at more host time per step. Eval and no-grad calls
    run this library's plans either way. A converted model converted again is returned as it is.
    Training conversion keeps torch's state_dict keys and Parameter objects: checkpoints load both ways
    (strict) and optimizers made before keep stepping it.
    Inference conversion folds BatchNorm into new weights: load a torch checkpoint before converting."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(fuse_batchnorm, bool):
        raise TypeError(f"fuse_batchnorm: expected True or False, got {fuse_batchnorm!r}")
    if train_convs not in _TRAIN_CONVS:
        raise ValueError(f"train_convs: expected one of {sorted(_TRAIN_CONVS)}, got {train_convs!r}")
    if inference and model.training:
        raise ValueError("convert(inference=True) folds BatchNorm running statistics: call model.eval() first")
    existing = getattr(model, "cudnn_graphs_report", None)
    if isinstance(existing, ConversionReport) and (existing.inference or not inference):
        return model  # converted already: its convs are ours, its runs chained or its BatchNorm folded
    report = ConversionReport(inference=inference, train_convs=train_convs)
    if inference:
        _fuse(model, report)
    _replace(model, "", report)
    if not inference and train_convs == "torch":
        for conv in _converted(model):
            conv.torch_when_training = True
    if not inference and fuse_batchnorm:
        _chain_batchnorm(model, report)
    if fuse_batchnorm:
        _pre_activations(model, report)
    _layer_norms(model, report)
    _squeeze_excitations(model, report)
    model.cudnn_graphs_report = report
    return model


# -- replacing the convolutions ------------------------------------------------------------------------

def _replace(module: nn.Module, prefix: str, report: ConversionReport, done: dict | None = None) -> None:
    done = {} if done is None else done  # id(torch's conv) -> ours: a conv used twice stays one module
    for name, child in list(module._modules.items()):  # every slot: named_children skips repeats
        if child is None:
            continue
        qualified = f"{prefix}{name}"
        ours = _ours_for(child)
        if id(child) in done:
            setattr(module, name, done[id(child)])
        elif ours is not None:
            done[id(child)] = new = _as_ours(child, ours)
            setattr(module, name, new)
            report.replaced.append(qualified)
        elif isinstance(child, nn.modules.conv._ConvNd) and not isinstance(child, tuple(_OURS.values())):
            report.kept.append((qualified, _why_kept(child)))
        else:
            _replace(child, qualified + ".", report, done)


def _converted(model: nn.Module) -> list[nn.Module]:
    ours = tuple(_OURS.values())
    return [m for m in model.modules() if isinstance(m, ours)]


def _ours_for(conv: nn.Module) -> type | None:
    """Our class for torch's Conv1d/2d/3d, also under torch.nn.utils.parametrize (weight_norm ...),
    which puts each parametrized module in a class of its own derived from torch's."""
    kind = type(conv)
    if parametrize.is_parametrized(conv) and kind.__bases__[0] in _OURS:
        return _OURS[kind.__bases__[0]]
    return _OURS.get(kind)


def _as_ours(conv: nn.Module, ours: type) -> nn.Module:
    """The same module state (the very Parameter objects, hooks, training flag) under our class."""
    if parametrize.is_parametrized(conv):
        # the same class parametrize made (its properties, getstate, deepcopy), derived from ours instead
        namespace = {k: v for k, v in vars(type(conv)).items() if k not in ("__dict__", "__weakref__")}
        ours = type(f"Parametrized{ours.__name__}", (ours,), namespace)
    new = ours.__new__(ours)
    new.__dict__.update(conv.__dict__)
    if "activation" not in new.__dict__:
        new.activation = Activation("identity")
    return new


def _why_kept(conv: nn.Module) -> str:
    if isinstance(conv, nn.modules.conv._ConvTransposeNd):
        return "transposed convolution (not planned by this library)"
    if isinstance(conv, nn.modules.lazy.LazyModuleMixin):
        return "lazy convolution whose shape is not known yet"
    return f"{type(conv).__name__} subclasses torch's conv with its own behaviour"


class _Forward:
    """A module's replacement forward: `fn(module, *args)`. Unlike a bound method it pickles (the
    function by name, the module by reference) and deep-copies onto the copied module.

    `held`: the places (`_chain.places`) of the modules that `fn`'s fused nodes hold. Once one of them
    holds another module (SyncBatchNorm.convert_sync_batchnorm, a new downsample, a swapped activation),
    the module's own class forward runs, with the modules it has now: the nodes would use the old ones."""

    __slots__ = ("fn", "module", "held")

    def __init__(self, fn, module: nn.Module, held: tuple = ()):
        self.fn, self.module, self.held = fn, module, held

    def __call__(self, *args, **kwargs):
        if moved(self.held):  # replaced after convert: the fused nodes are stale
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.fn(self.module, *args, **kwargs)

    def __getstate__(self):
        return (self.fn, self.module, self.held)

    def __setstate__(self, state):
        self.fn, self.module, self.held = state if len(state) == 3 else (*state, ())


# -- inference: BatchNorm folding and epilogue fusion ---------------------------------------------------

def _fuse(model: nn.Module, report: ConversionReport) -> None:
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Sequential):
            _fuse_sequential(module, prefix, report)
        elif _resnet_block(module) is not None:
            _fuse_resnet_block(module, prefix, report)


def _fuse_sequential(seq: nn.Sequential, prefix: str, report: ConversionReport) -> None:
    names = list(seq._modules)
    for i, name in enumerate(names):
        conv = seq._modules[name]
        if type(conv) not in _OURS and type(conv) not in _OURS.values():
            continue
        j = i + 1
        if j < len(names) and _fold(conv, seq._modules[names[j]], report, prefix + names[j]):
            seq._modules[names[j]] = nn.Identity()
            j += 1
        if j < len(names):
            act = _activation_of(seq._modules[names[j]])
            if act is not None and _identity_epilogue(conv):
                conv.activation = act
                seq._modules[names[j]] = nn.Identity()
                report.fused_activation.append((prefix + name, str(act)))


def _resnet_block(module: nn.Module) -> str | None:
    """torchvision's BasicBlock / Bottleneck, recognised by their parts (no torchvision import)."""
    kind = type(module).__name__
    parts = {"BasicBlock": ("conv1", "bn1", "conv2", "bn2", "relu"),
             "Bottleneck": ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu")}.get(kind)
    if parts is None or not all(hasattr(module, p) for p in parts) or not isinstance(module.relu, nn.ReLU):
        return None
    return kind


def _fuse_resnet_block(block: nn.Module, prefix: str, report: ConversionReport) -> None:
    convs = ["conv1", "conv2"] + (["conv3"] if _resnet_block(block) == "Bottleneck" else [])
    if not all(type(getattr(block, c)) in _OURS for c in convs):
        return
    for i, conv_name in enumerate(convs, start=1):
        conv, bn = getattr(block, conv_name), getattr(block, f"bn{i}")
        if not _fold(conv, bn, report, f"{prefix}bn{i}"):
            return  # left as torch wrote it: its forward still calls every part
        setattr(block, f"bn{i}", nn.Identity())
    for conv_name in convs:
        getattr(block, conv_name).activation = Activation("relu")
    report.fused_activation += [(f"{prefix}{c}", "relu") for c in convs]
    block.forward = _Forward(_fused_block_forward, block)
    block._cudnn_graphs_convs = tuple(convs)
    report.fused_residual.append(prefix.rstrip("."))


def _fused_block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """torchvision's block with BatchNorm folded: relu(conv(...)) per conv, the last one
    relu(conv(out) + identity) in one epilogue."""
    identity = x if self.downsample is None else self.downsample(x)
    *inner, last = self._cudnn_graphs_convs
    out = x
    for name in inner:
        out = getattr(self, name)(out)
    return getattr(self, last)(out, identity)


def _fold(conv: nn.Module, bn: nn.Module, report: ConversionReport, bn_name: str) -> bool:
    """Fold an eval-mode BatchNorm that follows `conv` into its weight and bias (new tensors)."""
    if not isinstance(bn, _BATCHNORMS) or bn.training or bn.running_mean is None or not _identity_epilogue(conv):
        return False
    if bn.num_features != conv.out_channels:
        return False
    scale, shift = eval_affine(bn, torch.float64)
    with torch.no_grad():
        weight = conv.weight.double() * scale.view(-1, *([1] * (conv.weight.dim() - 1)))
        bias = shift if conv.bias is None else conv.bias.double() * scale + shift
        dtype = conv.weight.dtype
        conv.weight = nn.Parameter(weight.to(dtype).contiguous(memory_format=_memory_format(conv.weight)),
                                   requires_grad=False)
        conv.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    report.folded_batchnorm.append(bn_name)
    report.weights = "copied"
    return True


def _identity_epilogue(conv: nn.Module) -> bool:
    act = getattr(conv, "activation", None)
    return act is None or act.is_identity


def _activation_of(module: nn.Module) -> Activation | None:
    """Our activation for a torch activation module, or None when it has no exact counterpart."""
    kind = type(module)
    if kind is nn.ReLU:
        return Activation("relu")
    if kind is nn.LeakyReLU:
        return Activation("leaky_relu", module.negative_slope)
    if kind is nn.ELU:
        return Activation("elu", module.alpha)
    if kind is nn.GELU:
        return Activation("gelu_tanh" if module.approximate == "tanh" else "gelu")
    if kind is nn.SiLU:
        return Activation("silu")
    if kind is nn.Sigmoid:
        return Activation("sigmoid")
    if kind is nn.Tanh:
        return Activation("tanh")
    return None  # Hardswish, ReLU6, Softplus with its threshold...: not exactly ours


# -- training: conv -> BatchNorm -> ReLU runs as fused nodes -------------------------------------------

def _chain_batchnorm(model: nn.Module, report: ConversionReport) -> None:
    branches: set[int] = set()  # downsamples that became a block's branch (named_modules lists blocks first)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if _resnet_block(module) is not None:
            _chain_resnet_block(module, prefix, report, branches)
        elif type(module).forward is nn.Sequential.forward and id(module) not in branches:
            _chain_sequential(module, prefix, report)


def _conv_bn(conv: nn.Module, bn: nn.Module) -> bool:
    """Our plain Conv2d (ungrouped, no bias or epilogue, zero padding) feeding a BatchNorm2d of its channels."""
    return _why_not_stage(conv, bn) is None


def _why_not_stage(conv: nn.Module, bn: nn.Module) -> str | None:
    """Why a conv followed by `bn` cannot be a stage of a fused run, or None when it can."""
    if type(bn) is not nn.BatchNorm2d:
        return f"{type(bn).__name__} is not torch's BatchNorm2d"
    if not isinstance(conv, Conv2d) or type(conv).forward is not Conv2d.forward:
        return "the conv is not converted (see 'kept')" if isinstance(conv, nn.Conv2d) else "no Conv2d before it"
    why = why_not_plain(conv, bias="the conv has a bias (fused runs take bias=False convs)")
    if why is None and bn.num_features != conv.out_channels:
        why = "the BatchNorm is not of the conv's channels"
    return why


def _chain_resnet_block(block: nn.Module, prefix: str, report: ConversionReport, branches: set[int]) -> None:
    n = 3 if _resnet_block(block) == "Bottleneck" else 2
    pairs = [(getattr(block, f"conv{i}"), getattr(block, f"bn{i}")) for i in range(1, n + 1)]
    why = next((w for w in (_why_not_stage(c, b) for c, b in pairs) if w is not None), None)
    if why is not None:
        report.unchained.append((prefix.rstrip("."), why))
        return
    stages = [Stage(c, b, relu=True, act=block.relu) for c, b in pairs]
    branch = _branch(getattr(block, "downsample", None))
    if branch is not None:
        branches.add(id(block.downsample))
    block._cudnn_graphs_chain = Chain(stages, final_relu=True, branch=branch,
                                      branch_module=None if branch is None else block.downsample)
    held = [(block, f"{kind}{i}") for i in range(1, n + 1) for kind in ("conv", "bn")] + [(block, "relu")]
    if branch is not None:
        held += [(block, "downsample"), (block.downsample, "0"), (block.downsample, "1")]
    block._cudnn_graphs_chain.held = places(held)
    block.forward = _Forward(_chained_block_forward, block, block._cudnn_graphs_chain.held)
    report.chains.append((prefix.rstrip("."), block._cudnn_graphs_chain))


def _branch(downsample: nn.Module | None) -> Stage | None:
    """A block's downsample as its run's branch: torchvision's nn.Sequential(conv, BatchNorm2d) whose pair
    could be a stage. Anything else stays the residual input, computed by its own modules."""
    if type(downsample) is not nn.Sequential or len(downsample) != 2:
        return None
    conv, bn = downsample[0], downsample[1]
    return Stage(conv, bn, relu=False) if _why_not_stage(conv, bn) is None else None


def _chains_run() -> bool:
    """Whether fused runs may serve this call: not while torch.compile traces (it traces the modules'
    registered ops; a run's planning is Python it cannot trace), not with torch's cuDNN disabled."""
    return not torch.compiler.is_compiling() and torch._C._get_cudnn_enabled()  # dynamo can't trace the getter


def _chained_block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """torchvision's block, its body one fused node in training (its own forward in eval)."""
    if not self.training or not _chains_run():
        return type(self).forward(self, x)
    chain = self._cudnn_graphs_chain
    if chain.branch is not None:  # the downsample runs inside the node (or, unfused, as its modules)
        return chain(x)
    return chain(x, x if self.downsample is None else self.downsample(x))


# A run of one stage (conv -> BatchNorm [-> ReLU] feeding something else) saves no pass over memory and cost
# host time: mobilenet_v3_large, efficientnet_b0 and regnet_y_800mf trained 0.87x, 0.88x and 0.97x as fast
# with them fused as without (H200, AMP, batch 64, tools/probe_step_kernels.py). Two stages save the first
# stage's normalised activation (written and read again) through the second conv's prologue.
MIN_RUN_STAGES = 2


def _chain_sequential(seq: nn.Sequential, prefix: str, report: ConversionReport) -> None:
    """Runs of MIN_RUN_STAGES or more conv, BatchNorm2d[, ReLU] slots; a stage without its ReLU ends a run."""
    names, steps, i, held = list(seq._modules), [], 0, []
    while i < len(names):
        stages, start = [], i
        while i + 1 < len(names) and _conv_bn(seq._modules[names[i]], seq._modules[names[i + 1]]):
            relu = i + 2 < len(names) and type(seq._modules[names[i + 2]]) is nn.ReLU
            act = seq._modules[names[i + 2]] if relu else None
            stages.append(Stage(seq._modules[names[i]], seq._modules[names[i + 1]], relu=relu, act=act))
            i += 3 if relu else 2
            if not relu:
                break
        if len(stages) < MIN_RUN_STAGES:
            _note_unchained(seq, names, start, len(stages), prefix, report)
            steps += names[start:i] if stages else [names[i]]
            i += 0 if stages else 1
            continue
        final = stages[-1].relu
        chain = Chain(stages, final_relu=final)
        steps.append(chain)
        report.chains.append((f"{prefix}{names[start]}", chain))
        held += [(seq, name) for name in names[start:i]]
    if held:
        _hold(seq, steps, _chained_sequential_forward, held)


def _note_unchained(seq: nn.Sequential, names: list, start: int, stages: int, prefix: str,
                    report: ConversionReport) -> None:
    """Say why a conv -> BatchNorm pair at `start` stays unfused (nothing when no BatchNorm follows a conv)."""
    if stages:
        report.unchained.append((f"{prefix}{names[start]}", f"a run of {stages} stage (fused runs have "
                                                             f"{MIN_RUN_STAGES} or more: one measured slower)"))
        return
    conv = seq._modules[names[start]]
    after = seq._modules[names[start + 1]] if start + 1 < len(names) else None
    if isinstance(conv, nn.Conv2d) and isinstance(after, nn.modules.batchnorm._BatchNorm):
        report.unchained.append((f"{prefix}{names[start]}", _why_not_stage(conv, after)))


def _hold(seq: nn.Sequential, steps: list, forward, held: list) -> None:
    """`seq` runs `steps` (module names and fused nodes) through `forward` while the modules at `held`
    (its (seq, name) places of the nodes' modules) stay; every node reports when one moved."""
    seq._cudnn_graphs_steps = tuple(steps)
    places_ = places(held)
    for step in steps:
        if not isinstance(step, str):
            step.held = places_
    seq.forward = _Forward(forward, seq, places_)


def _chained_sequential_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not self.training or not _chains_run():
        return nn.Sequential.forward(self, x)
    for step in self._cudnn_graphs_steps:
        x = step(x) if isinstance(step, Chain) else self._modules[step](x)
    return x



# -- eval: BatchNorm -> ReLU -> conv (pre-activation networks) as the conv's prologue ---------------------

def _pre_activations(model: nn.Module, report: ConversionReport) -> None:
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if _dense_layer(module):
            _pre_activate_dense_layer(module, prefix, report)
        elif type(module).forward is nn.Sequential.forward and "forward" not in vars(module):
            _pre_activate_sequential(module, prefix, report)


def _site(bn: nn.Module, relu: nn.Module, conv_name: str, conv: nn.Module,
          report: ConversionReport) -> PreActivation | None:
    why = why_not_site(bn, relu, conv)
    if why is not None:
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and isinstance(conv, nn.modules.conv._ConvNd):
            report.no_prologue.append((conv_name, why))
        return None
    site = PreActivation(bn, relu, conv)
    report.prologues.append((conv_name, site))
    return site


def _pre_activate_sequential(seq: nn.Sequential, prefix: str, report: ConversionReport) -> None:
    """BatchNorm2d, ReLU, Conv2d slots in a row (torchvision's DenseNet transition, pre-activation blocks)."""
    names, steps, i, held = list(seq._modules), [], 0, []
    while i < len(names):
        if i + 2 < len(names) and type(seq._modules[names[i + 1]]) is nn.ReLU:
            bn, relu, conv = (seq._modules[n] for n in names[i:i + 3])
            site = _site(bn, relu, prefix + names[i + 2], conv, report)
            if site is not None:
                steps.append(site)
                held += [(seq, name) for name in names[i:i + 3]]
                i += 3
                continue
        steps.append(names[i])
        i += 1
    if held:
        _hold(seq, steps, _pre_activated_sequential_forward, held)


def _pre_activated_sequential_forward(self, x: torch.Tensor) -> torch.Tensor:
    for step in self._cudnn_graphs_steps:
        x = step(x) if isinstance(step, PreActivation) else self._modules[step](x)
    return x


_DENSE_PARTS = ("norm1", "relu1", "conv1", "norm2", "relu2", "conv2", "drop_rate", "memory_efficient")


def _dense_layer(module: nn.Module) -> bool:
    """torchvision's DenseNet layer, recognised by its parts (no torchvision import)."""
    return type(module).__name__ == "_DenseLayer" and all(hasattr(module, p) for p in _DENSE_PARTS) \
        and "forward" not in vars(module)


def _pre_activate_dense_layer(layer: nn.Module, prefix: str, report: ConversionReport) -> None:
    sites = [_site(getattr(layer, f"norm{i}"), getattr(layer, f"relu{i}"), f"{prefix}conv{i}",
                   getattr(layer, f"conv{i}"), report) for i in (1, 2)]
    if all(s is not None for s in sites):
        layer._cudnn_graphs_sites = tuple(sites)
        held = places((layer, f"{kind}{i}") for i in (1, 2) for kind in ("norm", "relu", "conv"))
        for site in sites:
            site.held = held
        layer.forward = _Forward(_pre_activated_dense_forward, layer, held)
    else:  # its own forward calls every module: a site made for one half would never be called
        report.prologues = [(w, s) for w, s in report.prologues if s not in sites]


def _pre_activated_dense_forward(self, input):
    """torchvision's _DenseLayer.forward, its two BatchNorm -> ReLU -> conv halves PreActivation sites (each
    runs its modules where it cannot fuse); memory-efficient checkpointing where a gradient is wanted."""
    prev = [input] if isinstance(input, torch.Tensor) else input
    if self.memory_efficient and torch.is_grad_enabled() and any(t.requires_grad for t in prev):
        return type(self).forward(self, input)
    first, second = self._cudnn_graphs_sites
    out = second(first(torch.cat(prev, 1)))
    if self.drop_rate > 0:
        out = torch.nn.functional.dropout(out, p=self.drop_rate, training=self.training)
    return out


# -- no gradient wanted: LayerNorm on our kernel, torchvision's ConvNeXt block -------------------------------

def _layer_norms(model: nn.Module, report: ConversionReport) -> None:
    forwards = {"LayerNorm": layer_norm_forward, "LayerNorm2d": layer_norm_2d_forward}
    for name, module in list(model.named_modules()):
        kind = layer_norm_kind(module)
        if kind is not None:
            module.forward = _Forward(forwards[kind], module)
            report.layer_norms.append(name)
        elif _convnext_block(module):
            why = why_not_convnext_block(module)
            if why is not None:
                report.unfused_convnext.append((name, why))
                continue
            slots = [(module, "block"), (module, "stochastic_depth"),
                     *((module.block, n) for n in module.block._modules)]
            module.forward = _Forward(convnext_block_forward, module, places(slots))
            report.convnext_blocks.append(name)


def _squeeze_excitations(model: nn.Module, report: ConversionReport) -> None:
    for name, module in list(model.named_modules()):
        if squeeze_excitation(module):
            module.forward = _Forward(squeeze_excitation_forward, module)
            report.squeeze_excitations.append(name)


def _convnext_block(module: nn.Module) -> bool:
    """torchvision's CNBlock, recognised by its class (its parts by `why_not_convnext_block`)."""
    kind = type(module)
    return kind.__name__ == "CNBlock" and kind.__module__.startswith("torchvision.") and "forward" not in vars(module)
