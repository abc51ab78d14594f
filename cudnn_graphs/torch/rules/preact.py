"""Both modes: BatchNorm -> ReLU -> conv (pre-activation nets: DenseNet's layers and transitions,
pre-activation ResNets) as one cuDNN graph with the BatchNorm and ReLU as the conv's prologue, where it
runs in eval with no gradient wanted (`_preact.PreActivation`); otherwise the operations as traced."""

from __future__ import annotations

from .._chain import places
from .._graph import View, segment
from .._preact import PreActivation, why_not_site
from . import Found, Rule, register
from ._match import _OURS, activation_at, batchnorm_at, step
from .conv_bn_run import _slots


def _site_at(view: View, node, claimed: set):
    bn = batchnorm_at(view, node)
    if bn is None:
        return None
    act_node, taken = step(view, node)
    act = None if act_node is None else activation_at(view, act_node)
    if act is None:
        return None
    conv_node, more = step(view, act_node)
    conv = None if conv_node is None else view.called(conv_node)
    if type(conv) not in _OURS or len(conv_node.args) != 1:
        return None
    nodes = [*bn.nodes, *taken, act_node, *more, conv_node]
    return (bn.module, act, view.called(act_node), conv), nodes, conv_node


@register
class PreActivationRule(Rule):
    name = "preact"
    modes = ("training", "inference")

    def found_at(self, view: View, node, claimed: set) -> Found | None:
        got = _site_at(view, node, claimed)
        if got is None:
            return None
        parts, nodes, end = got
        return Found(self, nodes, [node.args[0]], end, view.qualified(end.target), parts)

    def why_not(self, found: Found, view: View) -> str | None:
        bn, act, _, conv = found.data
        return why_not_site(bn, act, conv)

    def install(self, found: Found, view: View):
        bn, _, act_module, conv = found.data
        site = PreActivation(bn, act_module, conv)
        site.unfused_fn = segment(view.root, found.nodes, found.inputs, found.output)
        site.held = places(_slots(view.root, [m for m in (bn, act_module, conv) if m is not None]))
        return site

    def call_args(self, found: Found) -> tuple:
        return tuple(found.inputs)
