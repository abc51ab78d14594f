"""`convert(model)`: every torch.nn.Conv1d/2d/3d of a model becomes ours, in place, and the fusion rules
(`rules/`) run over each module's traced graph.

    model = cudnn_graphs.torch.convert(model)                        # training: parameters shared
    model = cudnn_graphs.torch.convert(model.eval(), inference=True)  # BatchNorm folded, epilogues fused
    print(model.cudnn_graphs_report)

What is fused is decided by what a module's forward computes (`_graph.trace`), never by class or attribute
names: conv -> BatchNorm -> ReLU runs with their residual in training (`rules/conv_bn_run.py`), eval
BatchNorm folded into a copy of the conv's weights with its activation and residual add as the epilogue
(`rules/fold.py`), BatchNorm -> ReLU -> conv as the conv's prologue in eval (`rules/preact.py`). A module
a rule took runs its rewritten graph while the trace holds (`_graph.GraphForward`) and its own forward
otherwise; a module no rule took keeps its forward. Where no gradient is wanted, nn.LayerNorm and
torchvision's LayerNorm2d run on this library's LayerNorm kernel and torchvision's ConvNeXt block in fewer
passes (`_layernorm.py`); inside a CUDA-graph capture torchvision's SqueezeExcitation multiplies its scale
on this library's kernels (`_se.py`). What cannot be converted (transposed or lazy convs, subclasses with
their own forward, TorchScript) stays torch's and is listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from gpu_launch.activations import Activation

from ._chain import Chain, moved, places
from ._conv import Conv1d, Conv2d, Conv3d
from ._graph import TraceFailed, View, container, install, is_leaf, survey, trace, traced_modules
from ._layernorm import (convnext_block_forward, layer_norm_2d_forward, layer_norm_forward, layer_norm_kind,
                         why_not_convnext_block)
from ._nodes import RUNNERS
from ._preact import PreActivation
from ._se import squeeze_excitation, squeeze_excitation_forward
from .rules import rules_for
from .rules.conv_bn_run import unpaired

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
    rules: dict = field(default_factory=dict)  # rule name -> [(where, "fused" or why not)]
    rewritten: list[str] = field(default_factory=list)  # modules whose forward runs their rewritten graph
    untraced: list[tuple[str, str]] = field(default_factory=list)  # (module, why its forward did not trace)
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
        lines += [f"{name} runs its own forward (torch.fx could not trace it): {why}" for name, why in self.untraced]
        for rule, entries in sorted(self.rules.items()):
            fused = sum(1 for _, status in entries if status == "fused")
            lines.append(f"rule {rule}: {fused} fused, {len(entries) - fused} declined")
        return "\n".join(lines)


_TRAIN_CONVS = {"torch": "torch's convolution (its C++ autograd node)",
                "cudnn_graphs": "this library's plans (autotuned once per machine under cudnn.benchmark)"}


def convert(model: nn.Module, *, inference: bool = False, fuse_batchnorm: bool = True,
            train_convs: str = "torch", under_compile: str = "trace") -> nn.Module:
    """`model` with its convolutions on cuDNN graphs (in place); the report is `model.cudnn_graphs_report`.

    `fuse_batchnorm`: conv -> BatchNorm -> ReLU runs become one fused node each in training, and
    BatchNorm -> ReLU -> conv one graph in eval (pre-activation networks).
    `train_convs`: what a conv outside such a run does where its input's gradient is wanted. "torch"
    (default): torch's own convolution, whose C++ autograd node costs a host-bound step less than ours (a
    conv whose input needs no gradient, such as the network's first, keeps this library's plans); "cudnn_graphs":
    this library's plans, which under `cudnn.benchmark` are autotuned once per machine and read from the
    plan cache (no timing in a job's first iteration) at more host time per step. Eval and no-grad calls
    run this library's plans either way. A converted model converted again is returned as it is.
    `under_compile`: what torch.compile does with the fused nodes. "trace" (default): it traces their
    operations, as it would the model's (whole graphs; fullgraph=True works). "fused": it breaks its graph
    at each and calls it, fused, between its compiled graphs.
    Training conversion keeps torch's state_dict keys and Parameter objects: checkpoints load both ways
    (strict) and optimizers made before keep stepping it.
    Inference conversion folds BatchNorm into new weights: load a torch checkpoint before converting."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(fuse_batchnorm, bool):
        raise TypeError(f"fuse_batchnorm: expected True or False, got {fuse_batchnorm!r}")
    if train_convs not in _TRAIN_CONVS:
        raise ValueError(f"train_convs: expected one of {sorted(_TRAIN_CONVS)}, got {train_convs!r}")
    if under_compile not in RUNNERS:
        raise ValueError(f"under_compile: expected one of {sorted(RUNNERS)}, got {under_compile!r}")
    if inference and model.training:
        raise ValueError("convert(inference=True) folds BatchNorm running statistics: call model.eval() first")
    existing = getattr(model, "cudnn_graphs_report", None)
    if isinstance(existing, ConversionReport) and (existing.inference or not inference):
        return model  # converted already: its convs are ours, its runs chained or its BatchNorm folded
    report = ConversionReport(inference=inference, train_convs=train_convs)
    if isinstance(model, torch.jit.ScriptModule):  # its compiled code runs, whatever its modules are
        report.kept.append((type(model).__name__, _SCRIPTED))
        object.__setattr__(model, "cudnn_graphs_report", report)
        return model
    _replace(model, "", report)
    if not inference and train_convs == "torch":
        for conv in _converted(model):
            conv.torch_when_training = True
    _layer_norms(model, report)
    _squeeze_excitations(model, report)
    _apply_rules(model, report, inference, fuse_batchnorm, under_compile)
    model.cudnn_graphs_report = report
    return model


# -- replacing the convolutions ------------------------------------------------------------------------

def _replace(module: nn.Module, prefix: str, report: ConversionReport, done: dict | None = None) -> None:
    done = {} if done is None else done  # id(torch's conv) -> ours: a conv used twice stays one module
    for name, child in list(module._modules.items()):  # every slot: named_children skips repeats
        if child is None:
            continue
        qualified = f"{prefix}{name}"
        if isinstance(child, torch.jit.ScriptModule):
            report.kept.append((qualified, _SCRIPTED))
            continue
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


_SCRIPTED = "a TorchScript module runs its compiled code: convert the nn.Module before scripting it"


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


# -- rules on the traced graph -------------------------------------------------------------------------------

def _apply_rules(model: nn.Module, report: ConversionReport, inference: bool, fuse_batchnorm: bool,
                 under_compile: str) -> None:
    """The rules over every module whose forward traces, smallest first: a module's forward is rewritten
    where a rule took some of its operations, and stays the user's where none did. A training conversion
    traces each module twice: in training mode for the training rules, in eval mode for those that serve
    eval (each rewrite runs only in the mode it was traced in)."""
    if not fuse_batchnorm:
        return
    opaque: dict | None = None
    names = {id(m): n for n, m in model.named_modules()}
    declined: dict = {}
    variants = [("eval", False, rules_for("inference"))] if inference else \
        [("train", True, [r for r in rules_for("training") if r.name != "preact"]),
         ("eval", False, [r for r in rules_for("training") if r.name == "preact"])]
    for tag, training, rules in variants:
        flags = [(m, m.training) for m in model.modules()]
        model.train(training)
        try:
            if opaque is None:  # in the first mode's flags: a forward's branches on them are what it traces
                opaque, lists = survey(model)
            for name, module in _post_order(model):
                if id(module) in opaque:
                    if _fusable_inside(module) and tag == variants[0][0]:
                        report.untraced.append((name or type(module).__name__, opaque[id(module)]))
                    continue
                if is_leaf(module) or container(module) or id(module) in lists or not _fusable_inside(module):
                    continue  # a module called with non-tensors is left to its caller's trace
                _rewrite(module, name, rules, set(opaque), report, names, declined, tag, RUNNERS[under_compile])
        finally:
            for m, flag in flags:
                m.training = flag
    report.unchained = [(w, why) for (rule, w), why in declined.items() if rule == "conv_bn_run"]
    report.no_prologue = [(w, why) for (rule, w), why in declined.items() if rule == "preact"]
    for (rule, where), why in declined.items():
        report.rules.setdefault(rule, []).append((where, why))


def _post_order(model: nn.Module) -> list:
    out, seen = [], set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen or isinstance(module, torch.jit.ScriptModule):
            return
        seen.add(id(module))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{name}.{child_name}" if name else child_name)
        out.append((name, module))

    visit(model, "")
    return out


def _fusable_inside(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def _rewrite(module: nn.Module, name: str, rules: list, leaves: set, report: ConversionReport, names: dict,
             declined: dict, tag: str, runner) -> None:
    try:
        view = View(module, name, trace(module, leaves, tag))
        found = _matches(view, rules, declined)
        if not found:
            return
        # trace again with every module no match reaches kept a call: the rewritten forward then calls
        # them (their hooks fire, a replacement is seen) and only the matched code is inlined
        involved = traced_modules(view, [n for f in found for n in f.nodes])
        keep = leaves | {id(m) for m in module.modules() if m is not module and m not in involved}
        view = View(module, name, trace(module, keep, tag))
    except TraceFailed as err:
        report.untraced.append((name or type(module).__name__, str(err)))
        return
    found = _matches(view, rules, declined)
    nodes = [f.rule.install(f, view) for f in found]  # before any rewrite: each copies its own nodes
    traced = traced_modules(view, view.graph.nodes)  # the matched nodes' modules too: their hooks count
    now: dict = {}  # a match's output node -> the call that replaced it (a later match's input)
    for i, (f, node) in enumerate(zip(found, nodes)):
        attr = f"_cudnn_graphs_{tag}_{f.rule.name}_{i}"
        setattr(module, attr, node)
        now[f.output] = _replace_nodes(view.graph, f, attr, tuple(now.get(a, a) for a in f.rule.call_args(f)),
                                       runner)
        _report(report, f, node, names)
        for n in f.nodes if f.rule.name == "conv_bn_run" else ():  # a pair declined in a smaller trace
            if n.op == "call_module":
                declined.pop(("conv_bn_run", view.qualified(n.target)), None)
    install(module, view.graph, traced, tag)
    report.rewritten.append(f"{name or type(module).__name__} ({tag})")


def _matches(view: View, rules: list, declined: dict) -> list:
    """Each rule's candidates that it takes, none sharing a node (earlier rules first)."""
    taken: list = []
    view.claimed = set()
    for rule in rules:
        for f in rule.match(view):
            why = rule.why_not(f, view)
            if why is not None:
                if rule.name != "conv_bn_run":  # its pairs are reported once each, below
                    declined.setdefault((rule.name, f.where), why)
            elif not view.claimed.intersection(f.nodes):
                view.claimed.update(f.nodes)
                taken.append(f)
    if "conv_bn_run" in {r.name for r in rules}:
        runs = {n for f in taken if f.rule.name == "conv_bn_run" for n in f.nodes}
        for where, why in unpaired(view, runs):
            declined.setdefault(("conv_bn_run", where), why)
    return taken


def _replace_nodes(graph, found, attr: str, args: tuple, runner) -> None:
    """The found nodes become one call of `attr` (a fused node held on the module) through `runner`."""
    with graph.inserting_after(found.output):
        node = graph.get_attr(attr)
    with graph.inserting_after(node):
        new = graph.call_function(runner, (node, *args))
    found.output.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    for node in reversed(found.nodes):
        graph.erase_node(node)
    return new


def _report(report: ConversionReport, found, node, names: dict) -> None:
    rule = found.rule.name
    if (found.where, "fused") in report.rules.get(rule, ()):
        return  # the same site in the other mode's trace
    report.rules.setdefault(rule, []).append((found.where, "fused"))
    if rule == "conv_bn_run":
        report.chains.append((found.where, node))
    elif rule == "preact":
        report.prologues.append((found.where, node))
    elif rule == "fold_bn":
        fold = found.data
        if fold.bn is not None:
            report.folded_batchnorm.append(names.get(id(fold.bn), found.where))
            report.weights = "copied"
        if fold.act is not None:
            report.fused_activation.append((found.where, str(fold.act.epilogue())))
        if fold.residual is not None:
            report.fused_residual.append(found.where)

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
