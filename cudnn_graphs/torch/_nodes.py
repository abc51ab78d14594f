"""What every fused node of the torch layer shares: how it stays out of torch.compile's traces."""

from __future__ import annotations

import functools
from typing import Callable

import torch

_frames = torch._C._dynamo.eval_frame
_set_eval_frame = _frames.set_eval_frame
# torch before 2.6 has no per-code strategies: there dynamo may look into the wrapper's frame (harmless)
_skip_code = getattr(_frames, "set_code_exec_strategy", None)
_SKIP = _frames._FrameExecStrategy(_frames._FrameAction.SKIP, _frames._FrameAction.DEFAULT) if _skip_code else None


def outside_compile(fn: Callable) -> Callable:
    """`fn` as torch.compile's `disable` makes it -- dynamo breaks its graph at the call and runs `fn` eagerly,
    tracing nothing inside -- without importing torch._dynamo (seconds) where nothing compiles: a fused node
    plans and launches in Python that dynamo cannot trace, and under compile it runs fused, between the
    compiled graphs of the ops around it."""

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        prior = _set_eval_frame(None)  # what torch._dynamo's DisableContext does: no frame below is compiled
        try:
            return fn(*args, **kwargs)
        finally:
            _set_eval_frame(prior)

    eager._torchdynamo_disable = True  # dynamo: break the graph here, call it eagerly
    if _skip_code is not None:
        _skip_code(eager.__code__, _SKIP)  # and compile no frame of this wrapper (torch._dynamo's skip_code)
    return eager




def run_node(node: Callable, *args):
    """What a rewritten forward calls for a fused node: `node(*args)`. Under torch.compile dynamo traces
    it, and the node, seeing `is_compiling()`, runs the traced operations: one graph, as compile(model)."""
    return node(*args)


def run_fused(node: Callable, *args):
    """`node(*args)` outside torch.compile's trace (`convert(under_compile="fused")`): a graph break, and the
    node runs fused between compiled graphs."""
    return node(*args)


run_fused = outside_compile(run_fused)
RUNNERS = {"trace": run_node, "fused": run_fused}
