"""Reading operations off a traced graph: a conv, a BatchNorm (module call or `F.batch_norm` on one
module's tensors), an activation -- whatever module classes or functions spell them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .._activations import Act, of_call
from .._graph import View, follow, only_user
from .._conv import Conv1d, Conv2d, Conv3d

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_OURS = (Conv1d, Conv2d, Conv3d)
# torch's BatchNorm modules a call_module node may be; SyncBatchNorm only where its statistics are not used
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def conv_at(view: View, node: fx.Node) -> nn.Module | None:
    """The conv module a node calls with one argument: torch's Conv1d/2d/3d or ours, exactly (a subclass
    with its own forward is traced through, not called)."""
    m = view.called(node)
    if m is None or len(node.args) != 1 or node.kwargs:
        return None
    return m if type(m) in _CONVS or type(m) in _OURS else None


@dataclass
class BatchNormCall:
    """A batch_norm a node computes with one module's tensors: the module, the nodes that compute it
    (the call, and the in-place count of `num_batches_tracked` where the forward keeps one), and whether it
    was spelled as the module's call."""

    module: nn.Module
    nodes: list
    training: bool


def batchnorm_at(view: View, node: fx.Node, *, eval_ok: bool = False) -> BatchNormCall | None:
    """The BatchNorm `node` computes on its first argument as torch.nn.BatchNorm would with the module's own
    statistics, momentum and eps, else None."""
    m = view.called(node)
    if m is not None:
        if type(m) in _BN_MODULES or eval_ok and type(m) is nn.SyncBatchNorm and not m.training:
            return BatchNormCall(m, [node], m.training) if len(node.args) == 1 and not node.kwargs else None
        return None
    if node.op != "call_function" or node.target is not F.batch_norm:
        return None
    args = dict(zip(_BN_ARGS, node.args)) | dict(node.kwargs)
    owners = {view.owner(args.get(k), k) for k in ("running_mean", "running_var", "weight", "bias")}
    if len(owners) != 1 or None in owners:
        return None
    bn = owners.pop()
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or type(bn).forward is nn.SyncBatchNorm.forward:
        return None
    training = args.get("training", False)
    if training != bn.training or args.get("eps", 1e-5) != bn.eps or \
            args.get("momentum", 0.1) != (0.0 if bn.momentum is None else bn.momentum):
        return None
    nodes = [node]
    if training and bn.track_running_stats:
        count = _count_of(view, bn)
        if count is None:
            return None  # a forward that does not count batches as torch's does
        nodes = count + nodes
    return BatchNormCall(bn, nodes, training)


def _count_of(view: View, bn: nn.Module) -> list | None:
    """The get_attr of `bn.num_batches_tracked` and its `add_(1)`, where the graph has them."""
    for node in view.graph.nodes:
        if view.owner(node, "num_batches_tracked") is bn:
            user = only_user(node)
            if user is not None and user.op == "call_method" and user.target == "add_" and user.args[1:] == (1,):
                return [node, user]
    return None


def activation_at(view: View, node: fx.Node) -> Act | None:
    """The activation `node` applies to its only tensor argument."""
    if node.op == "call_module" and (len(node.args) != 1 or node.kwargs):
        return None
    return of_call(node, view.called(node))


def step(view: View, node: fx.Node) -> tuple:
    """(the one user of `node` past pass-throughs, those pass-throughs) where that user takes `node`'s value
    as its first argument, else (None, [])."""
    taken: list = []
    nxt = follow(view, node, taken)
    if nxt is None or nxt.args[:1] != ((taken or [node])[-1],):
        return None, []
    return nxt, taken
