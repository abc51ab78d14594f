"""Inference: conv -> BatchNorm (eval) [-> activation] [+ residual [-> activation]] as one conv with the
BatchNorm folded into a copy of its weights and the rest as its epilogue (`_fold.FoldedConv`).

The model's own conv and BatchNorm stay as they were (state_dict, other call sites, hooks): the folded
weights are made from them, and made again when one of them changes. Where the folded conv cannot serve a
call -- a gradient wanted through them, a BatchNorm back in training mode, a hook -- the matched operations
run as torch wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from .._chain import places
from .._fold import FoldedConv
from .._graph import View, add_operands, segment
from . import Found, Rule, register
from ._match import _OURS, activation_at, batchnorm_at, step
from .conv_bn_run import _slots


@dataclass
class Fold:
    conv: nn.Module
    bn: nn.Module | None
    act: object  # Act or None
    residual: fx.Node | None
    x: fx.Node


def _fold_at(view: View, node: fx.Node, claimed: set) -> tuple | None:
    """(Fold, its nodes, its last node) for a conv call at `node`, else None."""
    conv = view.called(node)
    if type(conv) not in _OURS or node in claimed or len(node.args) != 1 or node.kwargs or _pre_activated(view, node):
        return None
    nodes, end, bn, act, residual = [node], node, None, None, None
    nxt, taken = step(view, end)
    got = None if nxt is None else batchnorm_at(view, nxt, eval_ok=True)
    if got is not None and not got.training:
        bn, end, nodes = got.module, nxt, nodes + taken + got.nodes
        nxt, taken = step(view, end)
    operands = None if nxt is None else add_operands(nxt)
    if operands is not None:
        last = (taken or [end])[-1]
        other = operands[1] if operands[0] is last else operands[0]
        if isinstance(other, fx.Node) and other is not last:
            residual, end, nodes = other, nxt, nodes + taken + [nxt]
            nxt, taken = step(view, end)
    a = None if nxt is None else activation_at(view, nxt)
    if a is not None and a.epilogue() is not None:
        act, end, nodes = a, nxt, nodes + taken + [nxt]
    if bn is None and act is None and residual is None:
        return None
    return Fold(conv, bn, act, residual, node.args[0]), nodes, end


def _pre_activated(view: View, conv_node: fx.Node) -> bool:
    """Whether the conv reads relu(BatchNorm(t)) of a t no conv wrote (a cat, a sum: DenseNet's layers): the
    pre-activation rule makes that one graph, which an epilogue folded into this conv would prevent."""
    act_node = conv_node.args[0]
    if not isinstance(act_node, fx.Node) or len(act_node.users) != 1 or not act_node.args:
        return False
    act = activation_at(view, act_node)
    bn_node = act_node.args[0]
    if act is None or act.name != "relu" or not isinstance(bn_node, fx.Node) or len(bn_node.users) != 1:
        return False
    if batchnorm_at(view, bn_node, eval_ok=True) is None:
        return False
    source = bn_node.args[0]
    return not (isinstance(source, fx.Node) and type(view.called(source)) in _OURS)


@register
class FoldBatchNorm(Rule):
    name = "fold_bn"
    modes = ("inference",)

    def found_at(self, view: View, node: fx.Node, claimed: set) -> Found | None:
        got = _fold_at(view, node, claimed)
        if got is None:
            return None
        fold, nodes, end = got
        inputs = [fold.x] if fold.residual is None else [fold.x, fold.residual]
        return Found(self, nodes, inputs, end, view.qualified(node.target), fold)

    def why_not(self, found: Found, view: View) -> str | None:
        fold: Fold = found.data
        if fold.bn is not None and fold.bn.num_features != fold.conv.out_channels:
            return "the BatchNorm is not of the conv's channels"
        if fold.bn is not None and fold.bn.running_mean is None:
            return "the BatchNorm keeps no running statistics"
        return None

    def install(self, found: Found, view: View):
        fold: Fold = found.data
        node = FoldedConv(fold.conv, fold.bn, None if fold.act is None else fold.act.epilogue())
        node.unfused_fn = segment(view.root, found.nodes, found.inputs, found.output)
        node.held = places(_slots(view.root, [m for m in (fold.conv, fold.bn) if m is not None]))
        return node

    def call_args(self, found: Found) -> tuple:
        return tuple(found.inputs)
