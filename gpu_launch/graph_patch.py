"""A CUDA graph recorded once and re-pointed at each launch: one graph serves every pointer set of a plan.

A cuDNN execute costs 10-15 us of host time where a graph launch costs 2-3 us, but a graph holds the
pointers it was recorded with, and a training loop's buffers move. The kernels' arguments can be
rewritten in an instantiated graph (`cuGraphExecKernelNodeSetParams`, ~0.6 us a node) if one knows
which argument bytes are which buffer's pointer. cuDNN does not say, so it is found out:

the same calls are recorded with the real pointers and MOVES more times with each role's pointer moved
by its own offset (an odd multiple of 256 bytes times a multiplier that flips most address bits up to
2^34, plus a distinct multiple of 2^44; these recordings are never instantiated or run). Node by node,
the recordings must have the same kinds, and each kernel the same function, grid, block and shared
memory; their argument bytes may differ only in 8-byte words that moved by exactly one role's offset,
the same words with the same constants in every moved recording. Such a word is that role's pointer
plus a constant and is rewritten per launch. Anything else -- another difference (a pointer stored shifted, or in an opaque
descriptor, or a choice that depends on the address), a node kind other than kernel, memset or empty,
a memset whose size or value moved -- means the recording cannot be re-pointed, and `PatchError`
says why. A memset's destination is re-pointed like a kernel's pointer argument. The
offsets keep each pointer's address mod 256, so a graph serves the pointer sets of that alignment class.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace
from typing import Sequence

from . import driver
from .errors import CudaDriverError

_KERNEL, _MEMSET, _EMPTY = 0, 2, 5  # CUgraphNodeType
_ALLOWED = frozenset((_KERNEL, _MEMSET, _EMPTY))
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE: past the last parameter
_LAUNCH_PARAM_END, _LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
MASK = (1 << 64) - 1
ALIGNMENT_CLASS = 256  # pointer sets sharing each pointer's address mod this share a graph

_ptr, _u64, _size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t


class PatchError(Exception):
    """A recording whose kernels' pointer arguments cannot be told apart; `reason` says what differed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", _ptr), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("kernel_params", _ptr), ("extra", _ptr), ("kern", _ptr), ("ctx", _ptr)]


_MemsetParams = driver.MemsetParams


MOVES = 2  # recordings with moved pointers; a dependence on the address a move leaves alone would hide
_SPREAD = (0x2AAAAB, 0x1C71C7)  # odd: a move changes the address mod every power of two above 256


def moved_pointers(ptrs: Sequence[int], move: int) -> tuple[int, ...]:
    """A moved recording's pointers: each role moved by an offset no other role (and no difference of
    two roles' offsets) shares, keeping its address mod ALIGNMENT_CLASS."""
    return tuple((p + offset(i, move)) & MASK for i, p in enumerate(ptrs))


def offset(role: int, move: int) -> int:
    return ALIGNMENT_CLASS * (2 * role + 1) * _SPREAD[move] + ((role + 1) << 44)


def destroy(graph: int) -> None:
    """Free an uninstantiated graph (a recording nobody launches)."""
    _calls().cuGraphDestroy(graph)


class PatchableGraph:
    """The first recording instantiated, with the argument words to rewrite per pointer set.

    `launch(ptrs, stream)` rewrites the nodes whose pointers changed since the last launch (changes
    apply to later launches only: those already queued keep their arguments) and launches. One thread
    launches a PatchableGraph. Built from the real recording and MOVES moved ones, uninstantiated (see
    the module docstring), recorded
    on device `ordinal`.
    """

    repoints = True  # launch(ptrs, stream) serves any pointer set of its alignment class

    __slots__ = ("nodes", "sites", "kernels", "_exec", "_ptrs", "__weakref__")

    def __init__(self, graph: int, moved_graphs: Sequence[int], ptrs: Sequence[int], *, ordinal: int):
        """Takes `moved_graphs` (one per move) in any case and `graph` once built; on an error `graph`
        stays the caller's."""
        self._exec = None
        self._ptrs = tuple(ptrs)
        try:
            found = self._plan(graph, moved_graphs, self._ptrs)
        finally:
            for moved in moved_graphs:
                destroy(moved)
        self._exec = driver.GraphExec(graph, keep_graph=True)
        # Each node: (entry point, its arguments, the words to rewrite, the parameter buffers they point
        # into, kept alive here); a memset's update also names the context.
        ctx = _ptr(driver._primary_context(ordinal))
        kernel_set, memset_set = driver._raw("cuGraphExecKernelNodeSetParams_v2"), \
            driver._raw("cuGraphExecMemsetNodeSetParams")
        self.nodes = [(kernel_set, (self._exec._arg, _ptr(node), params.ref), sites, params) if kind == _KERNEL
                      else (memset_set, (self._exec._arg, _ptr(node), params.ref, ctx), sites, params)
                      for node, kind, params, sites in found]
        try:
            for node in self.nodes:  # the rewrite path tried once, with the recorded values
                _set_node(node)
        except CudaDriverError:
            self._exec.graph = None  # the caller's again
            self._exec = None
            raise

    def _plan(self, graph: int, moved_graphs: Sequence[int], ptrs: tuple[int, ...]) -> list[tuple]:
        """(node, kind, parameters to set, [(word, role, constant)]) of every node to rewrite."""
        if len(moved_graphs) != MOVES:
            raise PatchError(f"{len(moved_graphs)} moved recordings where {MOVES} are needed")
        first, others = _nodes(graph), [_nodes(g) for g in moved_graphs]
        if any([t for _, t in first] != [t for _, t in other] for other in others):
            raise PatchError("the recordings have different nodes")
        self.kernels, self.sites, found = 0, 0, []
        for i, (node, kind) in enumerate(first):
            if kind not in _ALLOWED:
                raise PatchError(f"a graph node of kind {kind} (only kernels, memsets and empty nodes are re-pointed)")
            if kind == _EMPTY:
                continue
            self.kernels += kind == _KERNEL
            patched = (_kernel_sites if kind == _KERNEL else _memset_sites)(node, [o[i][0] for o in others], ptrs)
            if patched is not None:
                found.append((node, kind, *patched))
                self.sites += len(patched[1])
        return found

    def launch(self, ptrs: tuple[int, ...], stream: int) -> None:
        if ptrs != self._ptrs:
            for node in self.nodes:
                for word, role, const in node[2]:
                    word.value = (ptrs[role] + const) & MASK
                _set_node(node)
            self._ptrs = ptrs
        self._exec.launch(stream)

def _set_node(node: tuple) -> None:
    fn, args = node[0], node[1]
    status = fn(*args)
    if status:
        raise CudaDriverError("cuGraphExec*NodeSetParams", status)


class _Patched:
    """A kernel node's arguments as one buffer the node's parameter array points into."""

    __slots__ = ("data", "argv", "params", "ref")

    def __init__(self, recorded: _KernelParams, data: bytes, layout: list[tuple[int, int]]):
        self.data = (ctypes.c_char * max(len(data), 1)).from_buffer_copy(data or b"\0")
        base = ctypes.addressof(self.data)
        self.argv = (_ptr * max(len(layout), 1))(*(base + off for off, _ in layout))
        self.params = _KernelParams.from_buffer_copy(recorded)
        self.params.kernel_params, self.params.extra = ctypes.addressof(self.argv), None
        self.ref = ctypes.byref(self.params)


def _kernel_sites(node: int, moved: Sequence[int], ptrs: tuple[int, ...]):
    """(_Patched, [(word, role, constant)]) for a kernel whose arguments hold pointers; None when its
    arguments are the same in every recording; PatchError when they differ otherwise."""
    a, others = _kernel_params(node), [_kernel_params(m) for m in moved]
    launch = (a.func, a.kern, tuple(a.grid), tuple(a.block), a.shared)
    if any(launch != (b.func, b.kern, tuple(b.grid), tuple(b.block), b.shared) for b in others):
        raise PatchError("the recordings launch different kernels or shapes (a choice made on the addresses)")
    layout = _layout(a)
    data = _arguments(a, layout)
    sites = _agreed([pointer_sites(data, _arguments(b, layout), ptrs, move) for move, b in enumerate(others)])
    if not sites:
        return None
    patched = _Patched(a, data, layout)
    return patched, [(_u64.from_buffer(patched.data, start), role, const) for start, role, const in sites]


def _agreed(found: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    """The pointer words every move found (the same words, roles and constants), else PatchError."""
    if any(f != found[0] for f in found):
        raise PatchError("the moved recordings disagree on which argument words are pointers")
    return found[0]


class _Memset:
    __slots__ = ("params", "ref")

    def __init__(self, recorded: _MemsetParams):
        self.params = _MemsetParams.from_buffer_copy(recorded)
        self.ref = ctypes.byref(self.params)


def _memset_sites(node: int, moved: Sequence[int], ptrs: tuple[int, ...]):
    """(_Memset, [(word, role, constant)]) for a memset whose destination is a role's buffer; None when
    every recording sets the same bytes (scratch); PatchError when anything else differs."""
    a, others = _memset_params(node), [_memset_params(m) for m in moved]
    if any(bytes(a)[8:] != bytes(b)[8:] for b in others):
        raise PatchError("a memset whose size or value depends on the pointers")
    sites = _agreed([pointer_sites(bytes(a)[:8], bytes(b)[:8], ptrs, move) for move, b in enumerate(others)])
    if not sites:
        return None
    patched = _Memset(a)
    (_, role, const), = sites
    return patched, [(_u64.from_buffer(patched.params, 0), role, const)]


def pointer_sites(data: bytes, moved_data: bytes, ptrs: Sequence[int], move: int) -> list[tuple[int, int, int]]:
    """(byte offset, role, constant) of each 8-byte word holding a role's pointer plus a constant, from
    a kernel's argument bytes recorded with `ptrs` and with `moved_pointers(ptrs, move)`; PatchError
    for any other difference."""
    deltas = {offset(i, move): i for i in range(len(ptrs))}
    sites = []
    for start in _changed_words(data, moved_data):
        if start + 8 > len(data):
            raise PatchError(f"argument bytes at {start} changed outside a pointer-sized word")
        v1, v2 = (int.from_bytes(d[start:start + 8], "little") for d in (data, moved_data))
        role = deltas.get((v2 - v1) & MASK)
        if role is None:
            raise PatchError(f"argument word at byte {start} changed by {(v2 - v1) & MASK:#x}, no role's offset")
        sites.append((start, role, (v1 - ptrs[role]) & MASK))
    return sites


def _changed_words(a: bytes, b: bytes) -> list[int]:
    """Start offsets of the 8-byte words (from 0) in which `a` and `b` differ."""
    return sorted({i // 8 * 8 for i, (x, y) in enumerate(zip(a, b)) if x != y})


def _layout(params: _KernelParams) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of the node's kernel, from the driver (CUDA >= 12.4)."""
    if params.func:
        get, handle = driver._raw("cuFuncGetParamInfo"), _ptr(params.func)
    else:
        get, handle = driver._raw("cuKernelGetParamInfo"), _ptr(params.kern)
    layout, off, size = [], _size(0), _size(0)
    while True:
        status = get(handle, _size(len(layout)), ctypes.byref(off), ctypes.byref(size))
        if status == _INVALID_VALUE:
            return layout
        if status:
            raise PatchError(f"the driver cannot describe a kernel's parameters (CUresult {status})")
        layout.append((off.value, size.value))


def _arguments(params: _KernelParams, layout: list[tuple[int, int]]) -> bytes:
    total = max((off + size for off, size in layout), default=0)
    if params.kernel_params:
        out = bytearray(total)
        argv = (_ptr * len(layout)).from_address(params.kernel_params)
        for (off, size), arg in zip(layout, argv):
            out[off:off + size] = ctypes.string_at(arg, size)
        return bytes(out)
    if params.extra:  # a buffer passed as CU_LAUNCH_PARAM_BUFFER_POINTER
        words, i, buf, n = (_ptr * 8).from_address(params.extra), 0, None, 0
        while i < 7 and (words[i] or 0) != _LAUNCH_PARAM_END:
            if words[i] == _LAUNCH_PARAM_BUFFER_POINTER:
                buf = words[i + 1]
            elif words[i] == _LAUNCH_PARAM_BUFFER_SIZE:
                n = _size.from_address(words[i + 1]).value
            i += 2
        if buf and n >= total:
            return ctypes.string_at(buf, total)
        raise PatchError("a kernel node's argument buffer could not be read")
    if total:
        raise PatchError("a kernel node without arguments where its kernel takes some")
    return b""


_SIGNATURES = {
    "cuGraphGetNodes": [_ptr, ctypes.POINTER(_ptr), ctypes.POINTER(_size)],
    "cuGraphNodeGetType": [_ptr, ctypes.POINTER(ctypes.c_int)],
    "cuGraphKernelNodeGetParams_v2": [_ptr, ctypes.POINTER(_KernelParams)],
    "cuGraphMemsetNodeGetParams": [_ptr, ctypes.POINTER(_MemsetParams)],
    "cuGraphDestroy": [_ptr],
}


@functools.lru_cache(maxsize=1)
def _calls() -> SimpleNamespace:
    """The graph-inspection entry points with their signatures (used when recording, not per launch)."""
    driver.lib()  # initialised
    cuda = ctypes.CDLL("libcuda.so.1")
    calls = SimpleNamespace()
    for name, argtypes in _SIGNATURES.items():
        fn = cuda[name]
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        setattr(calls, name, fn)
    return calls


def _call(status: int, call: str) -> None:
    if status:
        raise CudaDriverError(call, status)


def _nodes(graph: int) -> list[tuple[int, int]]:
    """(node, kind) of every node of `graph`, in the driver's order (creation order)."""
    calls, count = _calls(), _size(0)
    _call(calls.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (_ptr * max(count.value, 1))()
    _call(calls.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    out = []
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        _call(calls.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        out.append((node, kind.value))
    return out


def _kernel_params(node: int) -> _KernelParams:
    params = _KernelParams()
    _call(_calls().cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    return params


def _memset_params(node: int) -> _MemsetParams:
    params = _MemsetParams()
    _call(_calls().cuGraphMemsetNodeGetParams(node, ctypes.byref(params)), "cuGraphMemsetNodeGetParams")
    return params
