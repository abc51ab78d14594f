"""Training: conv -> BatchNorm -> ReLU runs, with a residual add (the block's input, a downsample conv ->
BatchNorm of it, or any tensor) and its ReLU, as one fused node (`_chain.Chain`).

Matched on operations: a conv module call whose only user is a batch_norm of one BatchNorm module's own
tensors (its module call, or `F.batch_norm` on its buffers as timm's BatchNormAct2d computes it), then an
activation however spelled (`nn.ReLU`, `F.relu`, `torch.relu`, `.relu_()` ...), then the next conv;
identities and dropouts that are off pass through. Every value inside the run has one user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from .._chain import Chain, Stage, places, why_not_plain
from .._conv import Conv2d
from .._graph import View, add_operands, follow, segment
from . import Found, Rule, register
from ._match import activation_at, batchnorm_at, conv_at, step

# A run of one stage (conv -> BatchNorm [-> ReLU] feeding something else) saves no pass over memory and cost
# host time: mobilenet_v3_large, efficientnet_b0 and regnet_y_800mf trained 0.87x, 0.88x and 0.97x as fast
# with them fused as without (H200, AMP, batch 64, tools/probe_step_kernels.py). Two stages save the first
# stage's normalised activation (written and read again) through the second conv's prologue.
MIN_RUN_STAGES = 2


@dataclass
class _Stage:
    conv: nn.Module
    bn: nn.Module
    act: object  # Act or None
    act_module: nn.Module | None
    nodes: list
    end: fx.Node  # the node whose value leaves the stage


@dataclass
class Run:
    stages: list
    branch: _Stage | None
    residual: fx.Node | None  # the residual's node (None: no add; the run's input: shared)
    final_act: object
    x: fx.Node


def stage_at(view: View, node: fx.Node, claimed: set) -> _Stage | None:
    """conv -> [pass-through] -> batch_norm [-> activation] starting at `node`, else None."""
    conv = conv_at(view, node)
    if conv is None or node in claimed:
        return None
    nxt, taken = step(view, node)
    bn = None if nxt is None else batchnorm_at(view, nxt)
    if bn is None:
        return None
    nodes, end = [node, *taken, *bn.nodes], nxt
    after, taken = step(view, nxt)
    act = None if after is None else activation_at(view, after)
    if act is not None:
        nodes += [*taken, after]
        end = after
    return _Stage(conv, bn.module, act, view.called(after) if act is not None else None, nodes, end)


def _run(view: View, first: fx.Node, claimed: set) -> Run | None:
    stages, node = [], first
    while True:
        st = stage_at(view, node, claimed)
        if st is None:
            break
        stages.append(st)
        if st.act is None:
            break
        node, taken = step(view, st.end)
        if node is None or conv_at(view, node) is None:
            break
        st.nodes += taken
    if not stages:
        return None
    run = Run(stages, None, None, stages[-1].act, first.args[0])
    if stages[-1].act is None:
        _residual(view, run, claimed)
    return run


def _residual(view: View, run: Run, claimed: set) -> None:
    """The run's tail: `+ residual` and its activation, where the last BatchNorm's only user is an add."""
    last = run.stages[-1]
    taken: list = []
    add = follow(view, last.end, taken)
    operands = None if add is None else add_operands(add)
    if operands is None or (taken or [last.end])[-1] not in operands or operands[0] is operands[1]:
        return
    other = operands[1] if operands[0] is (taken or [last.end])[-1] else operands[0]
    if not isinstance(other, fx.Node):
        return
    last.nodes += [*taken, add]
    last.end = add
    branch = _branch(view, other, run.x, claimed)
    run.branch, run.residual = branch, other
    after, taken = step(view, add)
    act = None if after is None else activation_at(view, after)
    if act is not None:
        last.nodes += [*taken, after]
        last.end, last.act_module = after, view.called(after)
    run.final_act = act


def _branch(view: View, other: fx.Node, x: fx.Node, claimed: set) -> _Stage | None:
    """A downsample conv -> BatchNorm of the run's input whose output is the residual, else None."""
    node = other
    while node.op == "call_module" and isinstance(view.called(node), nn.Identity) and len(node.users) == 1:
        node = node.args[0]
    for cand in _producers(node):
        if cand.args[:1] == (x,):
            st = stage_at(view, cand, claimed)
            if st is not None and st.end is other and st.act is None:
                return st
    return None


def _producers(node: fx.Node) -> list:
    """Nodes upstream of `node` through one-input calls (a conv a few calls back)."""
    out = []
    while isinstance(node, fx.Node) and len(out) < 6 and node.args:
        out.append(node)
        node = node.args[0]
    return out


def why_not_stage(conv: nn.Module, bn: nn.Module) -> str | None:
    """Why a conv followed by `bn` cannot be a stage of a fused run, or None when it can."""
    if not isinstance(bn, nn.BatchNorm2d) or not bn.training:
        return f"{type(bn).__name__} is not a training-mode 2-D BatchNorm"
    if not isinstance(conv, Conv2d) or type(conv).forward is not Conv2d.forward:
        return "the conv is not converted (see 'kept')" if isinstance(conv, nn.Conv2d) else "not a 2-D conv"
    why = why_not_plain(conv, bias="the conv has a bias (fused runs take bias=False convs)")
    if why is None and bn.num_features != conv.out_channels:
        why = "the BatchNorm is not of the conv's channels"
    if why is None and (not bn.affine or not bn.track_running_stats):
        why = "the BatchNorm has no affine parameters or running statistics"
    return why


def why_not_run(run: Run) -> str | None:
    """Why a run cannot be one fused node, or None."""
    for st in (*run.stages, *([run.branch] if run.branch else [])):
        why = why_not_stage(st.conv, st.bn)
        if why is not None:
            return why
    if len(run.stages) < MIN_RUN_STAGES:
        return f"a run of {len(run.stages)} stage (fused runs have {MIN_RUN_STAGES} or more: one measured slower)"
    for st in run.stages[:-1]:
        if st.act.name != "relu":
            return f"activation {st.act} inside a run (cuDNN's BatchNorm prologue is ReLU only)"
    if run.final_act is not None and run.final_act.name != "relu":
        return f"final activation {run.final_act} (the run's output pass applies ReLU only)"
    return None


@register
class ConvBatchNormRun(Rule):
    name = "conv_bn_run"
    modes = ("training",)

    def found_at(self, view: View, node: fx.Node, claimed: set) -> Found | None:
        run = _run(view, node, claimed) if conv_at(view, node) is not None else None
        if run is None:
            return None
        nodes = [n for st in (*run.stages, *([run.branch] if run.branch else [])) for n in st.nodes]
        return Found(self, nodes, _inputs(run), run.stages[-1].end, _where(view, run), run)

    def why_not(self, found: Found, view: View) -> str | None:
        return why_not_run(found.data)

    def install(self, found: Found, view: View):
        run: Run = found.data
        stages = [Stage(st.conv, st.bn, relu=st.act is not None, act=st.act_module) for st in run.stages]
        branch = None if run.branch is None else Stage(run.branch.conv, run.branch.bn, relu=False)
        chain = Chain(stages, final_relu=run.final_act is not None, branch=branch)
        chain.unfused_fn = segment(view.root, found.nodes, found.inputs, found.output)
        modules = [m for st in (*stages, *([branch] if branch else [])) for m in (st.conv, st.bn, st.act)
                   if m is not None] + [m for m in (view.called(found.output),) if m is not None]
        chain.held = places(_slots(view.root, modules))
        return chain

    def call_args(self, found: Found) -> tuple:
        run: Run = found.data
        if run.branch is not None or run.residual is None:
            return (run.x,)
        return (run.x, run.residual)


def _inputs(run: Run) -> list:
    if run.branch is not None or run.residual is None or run.residual is run.x:
        return [run.x]
    return [run.x, run.residual]


def _where(view: View, run: Run) -> str:
    """The block's name where the run is its whole forward, else the first conv's."""
    first = run.stages[0].nodes[0]
    whole = run.x.op == "placeholder" and all(u.op == "output" for u in run.stages[-1].end.users)
    return view.name if whole and view.name else view.qualified(first.target)


def _slots(root: nn.Module, modules: list) -> list:
    """(parent, name) of each module in `root`'s tree and of each module above it: where a replacement of
    any of them would be seen."""
    wanted = {id(m) for m in modules}
    out: dict = {}

    def walk(parent: nn.Module, path: list) -> None:
        for name, child in parent._modules.items():
            if child is None:
                continue
            here = path + [(parent, name)]
            if id(child) in wanted:
                out.update({(id(p), n): (p, n) for p, n in here})
            walk(child, here)

    walk(root, [])
    return list(out.values())


def unpaired(view: View, claimed: set) -> list:
    """(conv's name, why) for each conv -> BatchNorm pair no run took."""
    out = []
    for node in view.graph.nodes:
        if node in claimed:
            continue
        st = stage_at(view, node, claimed)
        if st is None:
            continue
        run = _run(view, node, claimed)
        why = why_not_run(run) if run else None
        out.append((view.qualified(node.target), why or "its conv -> BatchNorm is not a run's stage here"))
    return out
