"""What a module computes, as a torch.fx graph: the tracing, the op views the rules match on, and the
rewritten forward `convert` installs.

A module's forward is traced with torch.fx (`trace`): torch.nn's own modules, this library's convs, modules
with hooks, modules `convert` already rewrote and modules whose own forward does not trace stay calls
(`call_module`); everything else -- a user's block, timm's BatchNormAct2d, an nn.Sequential subclass with
its own forward -- is traced through, so a rule sees `F.batch_norm` on a module's buffers, `F.relu`,
`x.relu_()` and `+=` as what they are. Rules (`rules/`) match operations on that graph, never class names.

Tracing specialises: Python branches on a module's attributes are taken as they are at convert time, and
every argument is taken to be a tensor. `GraphForward` therefore runs the rewritten graph only while that
holds -- every argument a tensor, every traced module still in its place with the training flag and plain
attributes it had, no hooks on a module whose code was traced through -- and the module's own forward
otherwise.
"""

from __future__ import annotations

import copy
import importlib
import operator
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ._chain import hooked, moved, places

# calls whose result only feeds checks (`_assert(x.ndim == 4, ...)`): dropped with a value they check
_CHECKS = {torch._assert}
_META_ATTRS = {"ndim", "shape", "dtype", "device", "is_cuda"}
_PLAIN = (bool, int, float, str, type(None))


class TraceFailed(Exception):
    """A module's forward could not be traced; the message says why (torch.fx's words)."""


class _TensorProxy(fx.Proxy):
    """A proxy that `isinstance(x, torch.Tensor)` takes for a tensor: forwards that accept a tensor or a list
    (torchvision's DenseNet layer) trace their tensor branch, which `GraphForward` only runs for tensors."""

    @property
    def __class__(self):  # noqa: D401 - isinstance() consults __class__ after type()
        return torch.Tensor


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[int], tag: str | None):
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer's in-place update (num_batches_tracked) is recorded, not run
        self.leaves, self.tag = leaves, tag

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self.leaves:
            return True
        fwd = vars(m).get("forward")
        if isinstance(fwd, GraphForward):  # rewritten for this mode: a call; for another: traced through
            return self.tag in fwd.tags() or hooked([m]) or type(m).__module__.startswith("cudnn_graphs.")
        return is_leaf(m)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _TensorProxy(node, self)

    def create_arg(self, a: Any) -> Any:
        if type(a) is _TensorProxy:  # before fx's isinstance(a, Parameter), which our proxy would answer
            return a.node
        return super().create_arg(a)


def is_leaf(m: nn.Module) -> bool:
    """Whether a trace keeps `m` a call: torch.nn's own modules (not Sequential), this library's modules,
    scripted modules, modules with hooks (they must fire) and modules with a forward of their own instance."""
    kind = type(m)
    own = vars(m).get("forward")
    if isinstance(m, torch.jit.ScriptModule) or own is not None and not isinstance(own, GraphForward) or hooked([m]):
        return True
    if kind.__module__.startswith("cudnn_graphs."):
        return True
    return kind.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, nn.Sequential)


def container(m: nn.Module) -> bool:
    """A module with no forward of its own (ModuleList, ModuleDict): its owner's forward calls its items."""
    return type(m).forward is nn.Module.forward


def trace(module: nn.Module, leaves: set[int] = frozenset(), tag: str | None = None) -> fx.Graph:
    """`module`'s forward as a graph over its submodules (TraceFailed where fx cannot). Tracing runs the
    forward's Python: a plain tensor attribute it updates in place is put back afterwards, and a forward
    that changes a module's plain attributes (a call counter) fails: its graph would not do it again."""
    saved = [(t, t._version, t.detach().clone()) for t in _small_tensors(module)]
    plain = _plain_state(module)
    try:
        graph = _Tracer(set(leaves), tag).trace(module)
    except Exception as err:  # fx raises TraceError, TypeError, AttributeError ... from the user's forward
        raise TraceFailed(f"{type(err).__name__}: {err}".splitlines()[0][:200]) from None
    finally:
        with torch.no_grad():
            for t, version, value in saved:
                if t._version != version:
                    t.copy_(value)
        changed = _restore(plain)
    if changed:
        raise TraceFailed(f"its forward changes the attribute {changed!r}: a traced graph would not")
    _drop_checks(graph)
    return graph


def _plain_state(module: nn.Module) -> list:
    """(module's __dict__, its plain attributes) of every module below `module`."""
    return [(vars(m), {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)}) for m in module.modules()]


def _restore(plain: list) -> str | None:
    """Put the plain attributes back as `_plain_state` saw them; the name of one that had changed, or None."""
    changed = None
    for state, before in plain:
        now = {k: v for k, v in state.items() if isinstance(v, _PLAIN)}
        if now != before:
            changed = changed or next(k for k in now.keys() | before.keys() if now.get(k, _MISSING) != before.get(k, _MISSING))
            for k in now.keys() - before.keys():
                del state[k]
            state.update(before)
    return changed


def _small_tensors(module: nn.Module) -> list[torch.Tensor]:
    out = [b for b in module.buffers() if b.numel() <= 64]
    for m in module.modules():
        out += [v for v in vars(m).values() if type(v) is torch.Tensor and v.numel() <= 64]
    return out


def _drop_checks(graph: fx.Graph) -> None:
    """Remove `_assert` calls and what only feeds them: checks of a value a fused node consumes would
    otherwise keep it alive (torch's own ops check their inputs again)."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _CHECKS:
            graph.erase_node(node)
        elif not node.users and node.op in ("call_function", "call_method") and _pure(node):
            graph.erase_node(node)


def _pure(node: fx.Node) -> bool:
    """Side-effect-free calls a dropped check may leave unused: attribute reads and comparisons."""
    if node.op == "call_function":
        return node.target in (getattr, operator.eq, operator.ne, operator.getitem, len) and \
            (node.target is not getattr or node.args[1] in _META_ATTRS)
    return node.target in ("dim", "size")


# -- what the nodes are ----------------------------------------------------------------------------------

@dataclass
class View:
    """A traced module and the questions rules ask of its nodes."""

    root: nn.Module
    name: str  # the root's qualified name in the model ("" for the model)
    graph: fx.Graph
    claimed: set = field(default_factory=set)  # nodes an earlier rule took

    def module(self, target: str) -> nn.Module:
        return self.root.get_submodule(target)

    def called(self, node: fx.Node) -> nn.Module | None:
        return self.module(node.target) if node.op == "call_module" else None

    def owner(self, node: fx.Node, buffer: str) -> nn.Module | None:
        """The module whose `buffer` a get_attr node reads, else None."""
        if node.op != "get_attr" or not isinstance(node.target, str) or not node.target.endswith(buffer):
            return None
        path = node.target[: -len(buffer)].rstrip(".")
        return self.module(path) if path else self.root

    def qualified(self, target: str) -> str:
        return f"{self.name}.{target}" if self.name else target


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def passthrough(view: View, node: fx.Node) -> bool:
    """A call that returns its input: nn.Identity, a dropout that is off (p = 0, or its module in eval)."""
    m = view.called(node)
    if isinstance(m, nn.Identity):
        return True
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p == 0 or not m.training
    if node.op == "call_function" and node.target in (F.dropout, F.dropout2d):
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return p == 0 or training is False
    return False


def follow(view: View, node: fx.Node, taken: list) -> fx.Node | None:
    """The one user of `node`, past calls that pass their input through (appended to `taken`)."""
    user = only_user(node)
    while user is not None and passthrough(view, user):
        taken.append(user)
        user = only_user(user)
    return user


def add_operands(node: fx.Node) -> tuple | None:
    """(a, b) of a tensor sum a + b (operator.add/iadd, torch.add, Tensor.add/add_ without alpha), else None."""
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    if node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add):
        return node.args
    if node.op == "call_method" and node.target in ("add", "add_"):
        return node.args
    return None


# -- use counts: which modules are called from exactly one place -------------------------------------------

def survey(model: nn.Module) -> tuple[dict, set]:
    """Every module's own forward traced with its children kept as calls: (opaque, lists), `opaque` mapping
    id(module) to why its forward does not trace, `lists` the ids of modules some forward calls with a list,
    a keyword or another non-tensor (a trace of theirs takes tensors: their caller's trace serves them)."""
    opaque: dict = {}
    lists: set = set()
    for parent in model.modules():
        children = [c for c in parent._modules.values() if c is not None]
        if isinstance(parent, torch.jit.ScriptModule) or is_leaf(parent) and not children or container(parent):
            continue
        try:
            graph = trace(parent, {id(c) for c in children})
        except TraceFailed as err:
            opaque[id(parent)] = str(err)
            continue
        for node in graph.nodes:
            if node.op == "call_module" and (node.kwargs or any(not isinstance(a, fx.Node) for a in node.args)):
                lists.add(id(parent.get_submodule(node.target)))
    return opaque, lists


# -- the rewritten forward ----------------------------------------------------------------------------------

_MODULE_GLOBALS = "module"


class Variant:
    """One rewritten graph of a module (Python source run with the module as `self`) and the state it
    was traced in: its guard holds while every argument is a tensor and each traced module is in its place
    with the training flag and plain attributes it had, without hooks."""

    __slots__ = ("src", "globals_", "guard", "inlined", "arity", "held", "tag", "fn")

    def __init__(self, src: str, globals_: dict, guard: tuple, inlined: tuple, arity: int, held: tuple, tag: str):
        self.src, self.globals_, self.guard, self.inlined = src, globals_, guard, inlined
        self.arity, self.held, self.tag = arity, held, tag
        self.fn = _compile(src, globals_)

    def holds(self, args: tuple, kwargs: dict) -> bool:
        if len(args) + len(kwargs) != self.arity:  # a default taken: the trace saw a tensor there
            return False
        for a in args:
            if not isinstance(a, torch.Tensor):
                return False
        for a in kwargs.values():
            if not isinstance(a, torch.Tensor):
                return False
        for owner, key, value in self.guard:
            if owner.get(key, _MISSING) is not value and owner.get(key, _MISSING) != value:
                return False
        return not moved(self.held) and not hooked(self.inlined)

    def __getstate__(self):
        return (self.src, _picklable(self.globals_), self.guard, self.inlined, self.arity, self.held, self.tag)

    def __setstate__(self, state):
        self.src, globals_, self.guard, self.inlined, self.arity, self.held, self.tag = state
        self.globals_ = _unpickled(globals_)
        self.fn = _compile(self.src, self.globals_)

    def __deepcopy__(self, memo):
        twin = Variant.__new__(Variant)
        twin.src, twin.globals_, twin.fn, twin.arity, twin.tag = self.src, self.globals_, self.fn, self.arity, self.tag
        twin.guard, twin.inlined, twin.held = copy.deepcopy((self.guard, self.inlined, self.held), memo)
        return twin


class GraphForward:
    """A module's forward as the first of its rewritten graphs (`Variant`s: one per mode convert traced it
    in) whose guard holds, else the module's own class forward. Deep-copies onto the copied module and
    pickles (the sources, not function objects)."""

    __slots__ = ("module", "variants")

    def __init__(self, module: nn.Module, variants: tuple = ()):
        self.module, self.variants = module, variants

    def __call__(self, *args, **kwargs):
        for v in self.variants:
            if v.holds(args, kwargs):
                return v.fn(self.module, *args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def tags(self) -> set:
        return {v.tag for v in self.variants}

    def __getstate__(self):
        return (self.module, self.variants)

    def __setstate__(self, state):
        self.module, self.variants = state

    def __deepcopy__(self, memo):
        return GraphForward(*copy.deepcopy((self.module, self.variants), memo))


class Segment:
    """Part of a module's graph as a function of its inputs, run against the module: what a fused node
    computes where it cannot run fused (the user's own operations, in their order)."""

    __slots__ = ("src", "globals_", "root", "fn")

    def __init__(self, src: str, globals_: dict, root: nn.Module):
        self.src, self.globals_, self.root = src, globals_, root
        self.fn = _compile(src, globals_)

    def __call__(self, *args):
        return self.fn(self.root, *args)

    def __getstate__(self):
        return (self.src, _picklable(self.globals_), self.root)

    def __setstate__(self, state):
        self.src, globals_, self.root = state
        self.globals_ = _unpickled(globals_)
        self.fn = _compile(self.src, self.globals_)

    def __deepcopy__(self, memo):
        twin = Segment.__new__(Segment)
        twin.src, twin.globals_, twin.fn = self.src, self.globals_, self.fn
        twin.root = copy.deepcopy(self.root, memo)
        return twin


def segment(root: nn.Module, nodes: list, inputs: list, output: fx.Node) -> Segment:
    """`nodes` (in graph order) as a function of `inputs`, returning `output`'s value."""
    graph, env = fx.Graph(), {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}")

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a get_attr outside the matched nodes: read it again here
            if a.op != "get_attr":
                raise ValueError(f"{a} is neither an input nor one of the matched nodes")
            env[a] = graph.node_copy(a, arg)
        return env[a]

    for node in nodes:
        env[node] = graph.node_copy(node, arg)
    graph.output(env[output])
    code = graph.python_code(root_module="self")
    return Segment(code.src, dict(code.globals), root)


def _picklable(globals_: dict) -> dict:
    return {k: (_MODULE_GLOBALS, v.__name__) if isinstance(v, types.ModuleType) else (None, v)
            for k, v in globals_.items()}


def _unpickled(globals_: dict) -> dict:
    return {k: importlib.import_module(v) if kind == _MODULE_GLOBALS else v for k, (kind, v) in globals_.items()}


_MISSING = object()


def _compile(src: str, globals_: dict) -> Callable:
    scope: dict = dict(globals_)
    exec(compile(src, "<cudnn_graphs rewritten forward>", "exec"), scope)  # noqa: S102 - fx's own codegen
    return scope["forward"]


def install(module: nn.Module, graph: fx.Graph, traced: Iterable[nn.Module], tag: str) -> GraphForward:
    """Add `graph` (rewritten) to `module`'s forward as the variant `tag`, guarded by the state of the modules
    its code was traced through (`traced`: the modules whose forward the graph inlines, `module` among them)."""
    graph.eliminate_dead_code(is_impure_node=_impure)
    graph.lint()
    code = graph.python_code(root_module="self")
    arity = sum(1 for n in graph.nodes if n.op == "placeholder")
    inlined = tuple(dict.fromkeys(traced))
    guard = tuple((vars(m), k, v) for m in inlined for k, v in vars(m).items()
                  if not k.startswith("_") and isinstance(v, _PLAIN))
    held = places(_paths(module, graph, inlined))
    variant = Variant(code.src, dict(code.globals), guard, tuple(m for m in inlined if m is not module), arity, held,
                      tag)
    fwd = vars(module).get("forward")
    if not isinstance(fwd, GraphForward):
        fwd = module.forward = GraphForward(module)
    fwd.variants += (variant,)
    return fwd


def _paths(root: nn.Module, graph: fx.Graph, inlined: tuple) -> list:
    """(parent, name) of every module slot the rewritten graph reaches through: the modules it calls or
    reads, the modules it was traced through, and each of their parents up to `root`."""
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    paths = {names[id(m)] for m in inlined if id(m) in names}
    for node in graph.nodes:
        if node.op == "call_module":
            paths.add(node.target)
        elif node.op == "get_attr":
            paths.add(node.target.rpartition(".")[0])
    out = {}
    for path in paths:
        parts = [p for p in path.split(".") if p]
        parent = root
        for part in parts:
            if part not in parent._modules:
                break  # a plain attribute (a fused node held on the module)
            out[(id(parent), part)] = (parent, part)
            parent = parent._modules[part]
    return list(out.values())


def _impure(node: fx.Node) -> bool:
    """Dead-code elimination keeps in-place calls (a buffer's add_) and calls into modules."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("__"):
        return True
    return node.is_impure()


def traced_modules(view: View, nodes: Iterable[fx.Node]) -> set[nn.Module]:
    """The modules whose forward code produced `nodes` (from fx's module stack), the root included."""
    out = {view.root}
    for node in nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            out.add(view.module(path) if path else view.root)
    return out
