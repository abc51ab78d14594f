"""`capture(model, sample_args)`: a model's forward and backward as CUDA graphs, called each step.

    with torch.autocast("cuda", dtype=torch.float16):    # the autocast and grad mode the loop runs in
        step = cudnn_graphs.torch.capture(model, (x,))
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(step(x), y)          # replays the forward graph
        opt.zero_grad(set_to_none=True)
        loss.backward()                                  # replays the backward graph; .grad accumulates
        opt.step()

Built on `torch.cuda.make_graphed_callables` (one autograd node: the forward graph, and the backward
graph in its backward), with what it leaves to the user done here: autocast's cast cache off during
capture, warm-up on a side stream, both run on aliases of the parameters (so no AccumulateGrad node is
made on a side stream: torch warned of the stream mismatch at every step, DDP's included), each call's
inputs copied into static buffers of the capture's own (the sample tensors are never written), the
model's buffers (BatchNorm statistics) restored after warm-up and capture, and a new capture for a call
whose input shapes, dtypes, devices or requires_grad, autocast state, grad mode or `model.training`
differ (a small LRU of captures, each in its own memory pool). What a graph cannot hold is refused with a `CaptureError` naming it: CPU tensors, tensors on
another device than the model, non-tensor arguments, DataParallel / DistributedDataParallel wrappers
(capture the inner module, then wrap the result), and a module that synchronises the device each
step (found on the last warm-up step under torch's sync debug mode), such as torch's BatchNorm with
`momentum=None` reading its counter on the host.

Outputs live in the graph's static memory: the next call overwrites them (as with torch's graphed
callables): compute the loss before the next call. Loss, backward and optimizer stay outside.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import CaptureError, SpecError
from ._se import load_for_capture

__all__ = ["Captured", "capture"]

_WRAPPERS = ("DistributedDataParallel", "DataParallel")


def capture(model: nn.Module, sample_args: Any, *, warmup: int = 3, max_graphs: int = 4) -> "Captured":
    """`model`'s forward and backward captured as CUDA graphs for `sample_args` (a CUDA tensor or a
    tuple of them, as `model` takes them positionally), under the grad mode and CUDA autocast state of
    this call; returns a `Captured` module to call each step in their place.

    `warmup`: eager steps before capture (>= 2; the last is checked for synchronisations).
    `max_graphs`: captures kept for other input shapes or states (least recently used dropped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    captured = Captured(model, warmup=warmup, max_graphs=max_graphs)
    args = (sample_args,) if isinstance(sample_args, torch.Tensor) else sample_args
    if not isinstance(args, (tuple, list)):
        raise CaptureError("sample_args", sample_args, "expected a tensor or a tuple of tensors")
    captured._graphed(tuple(args), "sample_args")  # now: a refusal comes here, not mid-training
    return captured


class Captured(nn.Module):
    """A model whose calls replay CUDA graphs: `forward(*tensors)` replays the capture for their
    shapes and state (capturing one first when there is none). The model is `.module`; its parameters
    and buffers are this module's (state_dict keys carry DDP's `module.` prefix). Wrap this module in
    DistributedDataParallel, not the other way round: gradients accumulate outside the graph, where
    DDP's hooks run."""

    def __init__(self, module: nn.Module, *, warmup: int = 3, max_graphs: int = 4):
        super().__init__()
        _check_count("warmup", warmup, 2)
        _check_count("max_graphs", max_graphs, 1)
        _refuse_wrapper(module)
        self.module = module
        self.warmup, self.max_graphs = warmup, max_graphs
        self.captures = 0  # how many captures were made (a new shape or state makes one)
        self._graphs = _Captures(max_graphs)

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        if kwargs:
            raise CaptureError("kwargs", sorted(kwargs), "a captured model takes positional tensors only")
        return self._graphed(args, "args")(*args)

    def prepare(self, *args: torch.Tensor) -> None:
        """Capture for these arguments' shapes and the current state now, without running a step
        (a last partial batch's size, say): its first call then replays."""
        self._graphed(args, "args")

    def reset(self) -> None:
        """Drop every capture: after changing a submodule's train/eval mode, or its parameters or buffers
        (new tensors, not in-place updates), which the key of a capture does not see."""
        self._graphs.clear()

    def _graphed(self, args: tuple, what: str) -> Callable:
        key = _key(self.module, args, what)
        graphed = self._graphs.find(key)
        if graphed is None:
            graphed = self._graphs.keep(key, _capture(self.module, args, what, self.warmup))
            self.captures += 1
        return graphed

    def extra_repr(self) -> str:
        return f"captures={self.captures}, held={len(self._graphs)}, max_graphs={self.max_graphs}"


# -- what a capture is keyed by -------------------------------------------------------------------------

class _Captures(OrderedDict):
    """key -> graphed callable, the `size` most recently used."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def find(self, key: tuple) -> Callable | None:
        found = self.get(key)
        if found is not None:
            self.move_to_end(key)
        return found

    def keep(self, key: tuple, graphed: Callable) -> Callable:
        self[key] = graphed
        while len(self) > self.size:
            self.popitem(last=False)  # its graphs and memory pool go once no step in flight holds them
        return graphed


def _key(model: nn.Module, args: tuple, what: str) -> tuple:
    """Everything a replay depends on besides the tensors' values: each argument's shape, dtype, device
    and requires_grad, the model's training flag, grad and inference mode, and CUDA autocast."""
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            raise CaptureError(f"{what}[{i}]", arg, "a captured model takes positional tensors only (a graph "
                                                    "replays with the values it was captured with)")
    autocast = (torch.get_autocast_dtype("cuda"),) if torch.is_autocast_enabled("cuda") else ()
    return (tuple([(a.shape, a.dtype, a.device, a.requires_grad) for a in args]), model.training,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


# -- refusals -------------------------------------------------------------------------------------------

def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(name, value, f"expected an int >= {minimum}")


def _refuse_wrapper(model: nn.Module) -> None:
    kind = type(model).__name__
    if kind in _WRAPPERS:  # by name: no torch.distributed import for a check
        raise CaptureError("model", kind, f"capture the module inside it, then wrap the result in {kind}: "
                                          "its gradient hooks and collectives must run outside the graph")


def _described(t: torch.Tensor) -> str:
    return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


def _check_capturable(model: nn.Module, args: tuple, what: str) -> torch.device:
    """The CUDA device the capture runs on, or a CaptureError naming what a graph cannot hold."""
    if not args:
        raise CaptureError(what, args, "expected at least one CUDA tensor (the graph's static input)")
    device = args[0].device
    for i, arg in enumerate(args):
        if arg.device.type != "cuda":
            raise CaptureError(f"{what}[{i}]", _described(arg), "a CUDA graph replays CUDA work only: move it "
                                                                 "to the model's CUDA device")
        if arg.device != device:
            raise CaptureError(f"{what}[{i}]", _described(arg), f"on another device than {what}[0] ({device})")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device != device:
                raise CaptureError(f"{kind} {name}", _described(t), f"not on the inputs' device {device}")
            if kind == "buffer" and t.requires_grad:
                raise CaptureError(f"buffer {name}", _described(t), "a buffer that requires grad: only "
                                                                      "parameters may be trained through a capture")
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError("model", type(model).__name__, "called while the current stream is being captured: "
                                                          "capture or call it outside that capture")
    return device


# -- capturing ------------------------------------------------------------------------------------------

class _Body:
    """What make_graphed_callables graphs: the model called with aliases in place of its trainable
    parameters (`torch.func.functional_call`). An alias shares its parameter's memory but is an autograd
    leaf of its own, so the warm-up and the capture, on side streams, never make or feed a parameter's
    AccumulateGrad node: those are made and fed on the caller's stream at each step, where DDP hooks
    them. Nodes made on a side stream and kept alive (make_graphed_callables's static outputs keep the
    capture's graph) made torch warn of a stream mismatch at every step; a node made on the legacy
    stream and fed inside a later capture is an error."""

    def __init__(self, model: nn.Module, names: tuple, count: int):
        self.model, self.names, self.count = model, names, count  # count: the user's arguments

    def __call__(self, *inputs: torch.Tensor) -> Any:
        args, aliases = inputs[:self.count], inputs[self.count:]
        return torch.func.functional_call(self.model, dict(zip(self.names, aliases)), args)


class _Replay:
    """A capture's graphed callable, given the model's own parameters where it was captured with their
    aliases (the same memory: nothing is copied), so gradients flow to the parameters' nodes."""

    __slots__ = ("graphed", "params")

    def __init__(self, graphed: Callable, params: tuple):
        self.graphed, self.params = graphed, params

    def __call__(self, *args: torch.Tensor) -> Any:
        return self.graphed(*args, *self.params)


def _capture(model: nn.Module, args: tuple, what: str, warmup: int) -> Callable:
    device = _check_capturable(model, args, what)
    # static inputs of the capture's own: each call is copied into them, the sample is never written
    static = tuple(a.detach().clone(memory_format=torch.preserve_format).requires_grad_(a.requires_grad)
                   for a in args)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = tuple(p for _, p in named)
    inputs = (*static, *(p.detach().requires_grad_() for p in params))
    body = _Body(model, tuple(name for name, _ in named), len(static))
    saved = [(b, b.clone()) for b in model.buffers()]
    try:
        with torch.cuda.device(device), _capture_autocast():
            _warm_up(model, body, inputs, warmup)
            graphed = _graph(model, body, inputs)
    finally:
        with torch.no_grad():  # warm-up and capture ran the model warmup + 1 times: no trace of them stays
            for buffer, value in saved:
                buffer.copy_(value)
    return _Replay(graphed, params)


def _capture_autocast() -> contextlib.AbstractContextManager:
    """The caller's CUDA autocast with its cast cache off: a cached cast made during capture would be
    a tensor of the graph's pool that later steps read stale (make_graphed_callables refuses it)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _warm_up(model: nn.Module, body: _Body, inputs: tuple, steps: int) -> None:
    """Eager forward + backward steps on a side stream, as make_graphed_callables does (plans built,
    autotuning and lazy initialisation done before capture), the last under torch's sync debug mode."""
    surface = tuple(t for t in inputs if t.requires_grad)
    load_for_capture(model, inputs)  # kernels that only captures launch: loaded now, not mid-capture
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for step in range(steps):
            with _synchronisations_refused(model) if step == steps - 1 else contextlib.nullcontext():
                outputs = [o for o in torch.utils._pytree.tree_leaves(body(*inputs))
                           if isinstance(o, torch.Tensor) and o.requires_grad]
                if outputs and surface:  # grads returned, never accumulated into .grad
                    torch.autograd.grad(outputs, surface, [torch.ones_like(o) for o in outputs], allow_unused=True)
                del outputs
    torch.cuda.synchronize()


@contextlib.contextmanager
def _synchronisations_refused(model: nn.Module) -> Iterator[None]:
    """A synchronising CUDA call raises a CaptureError naming the innermost module running it."""
    names = {id(m): name for name, m in model.named_modules()}
    running: list[nn.Module] = []

    def enter(module, inputs):
        if id(module) in names:
            running.append(module)

    def leave(module, inputs, output):
        if running and running[-1] is module:
            running.pop()

    hooks = (nn.modules.module.register_module_forward_pre_hook(enter),
             nn.modules.module.register_module_forward_hook(leave))
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        where = f"model.{names[id(running[-1])]}" if running and names[id(running[-1])] else "model"
        what = type(running[-1]).__name__ if running else "its backward"
        raise CaptureError(where, what, "synchronises the device in every step (e.g. .item(), a host read of "
                                        "a CUDA tensor; torch's BatchNorm with momentum=None does): a CUDA graph "
                                        f"cannot hold that. torch: {_first_line(err)}") from err
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        for hook in hooks:
            hook.remove()


def _graph(model: nn.Module, body: _Body, inputs: tuple) -> Callable:
    try:  # warmed up already: torch's capture runs no warm-up of its own
        return torch.cuda.make_graphed_callables(body, inputs, num_warmup_iters=0, allow_unused_input=True)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:  # cudaErrorStreamCaptureUnsupported and kin, from whatever the model ran
        raise CaptureError("model", type(model).__name__, f"its capture failed: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
