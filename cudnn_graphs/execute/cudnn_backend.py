"""The few cuDNN backend calls a warm process needs, through ctypes on libcudnn: no frontend import.

A stored plan is cuDNN's own JSON form of an execution plan; the backend rebuilds it with two
attribute sets and a finalize, and runs it with a variant pack of (uid, pointer) pairs. That is all
a warm process does with cuDNN, and the frontend's Python package costs 70-90 ms to import on an H100
host, more than the three plans of a first step take to load. Building plans (heuristics, graphs)
still goes through the frontend (`graph/frontend.py`), which loads the same libcudnn.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sysconfig
from typing import Any, Sequence

from .. import config
from ..errors import CudnnBackendError

# cudnn_graph.h values (stable across cuDNN 9).
_EXECUTION_PLAN, _VARIANT_PACK = 5, 16
_TYPE_HANDLE, _TYPE_INT64, _TYPE_VOID_PTR, _TYPE_CHAR = 0, 3, 6, 24
_PLAN_HANDLE, _PLAN_WORKSPACE_SIZE, _PLAN_JSON = 400, 402, 405
_PACK_UIDS, _PACK_POINTERS, _PACK_WORKSPACE = 1000, 1001, 1003

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


def library_candidates() -> list[str]:
    """Where the frontend looks for libcudnn, in its order: $LD_LIBRARY_PATH, the nvidia-cudnn wheel,
    then the loader's search by soname. Loading the same file makes both share one library."""
    found = [os.path.join(d, name) for d in config.library_dirs()
             for name in ("libcudnn.so.9", "libcudnn.so") if os.path.exists(os.path.join(d, name))]
    purelib = sysconfig.get_path("purelib")
    for sub in ("nvidia/cudnn/lib", "nvidia/cudnn_jit/lib"):
        found += sorted(glob.glob(os.path.join(purelib, sub, "libcudnn.so.*[0-9]")))
    return found + ["libcudnn.so.9", "libcudnn.so"]


@functools.lru_cache(maxsize=1)
def lib() -> Any:
    """libcudnn with the signatures used here; CudnnBackendError when none loads."""
    errors = []
    for path in library_candidates():
        try:
            cudnn = ctypes.CDLL(path)
            break
        except OSError as err:
            errors.append(str(err))
    else:
        raise CudnnBackendError("dlopen", -1, "no libcudnn could be loaded (" + "; ".join(errors[-2:]) + ")")
    signatures = {
        "cudnnGetVersion": ([], ctypes.c_size_t),
        "cudnnGetCudartVersion": ([], ctypes.c_size_t),
        "cudnnGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
        "cudnnCreate": ([ctypes.POINTER(_ptr)], ctypes.c_int),
        "cudnnSetStream": ([_ptr, _ptr], ctypes.c_int),
        "cudnnBackendCreateDescriptor": ([ctypes.c_int, ctypes.POINTER(_ptr)], ctypes.c_int),
        "cudnnBackendDestroyDescriptor": ([_ptr], ctypes.c_int),
        "cudnnBackendSetAttribute": ([_ptr, ctypes.c_int, ctypes.c_int, _i64, _ptr], ctypes.c_int),
        "cudnnBackendGetAttribute": ([_ptr, ctypes.c_int, ctypes.c_int, _i64, ctypes.POINTER(_i64), _ptr],
                                     ctypes.c_int),
        "cudnnBackendFinalize": ([_ptr], ctypes.c_int),
        "cudnnBackendExecute": ([_ptr, _ptr, _ptr], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(cudnn, name)
        fn.argtypes, fn.restype = argtypes, restype
    last_error = getattr(cudnn, "cudnnGetLastErrorString", None)  # cuDNN >= 9.0: the reason, in words
    if last_error is not None:
        last_error.argtypes, last_error.restype = [ctypes.c_char_p, ctypes.c_size_t], None
    return cudnn


def _check(status: int, call: str) -> None:
    if status:
        raise CudnnBackendError(call, status, _message(status))


def _message(status: int) -> str:
    cudnn = lib()
    text = (cudnn.cudnnGetErrorString(status) or b"").decode(errors="replace")
    last = getattr(cudnn, "cudnnGetLastErrorString", None)
    if last is not None:
        buf = ctypes.create_string_buffer(1024)
        last(buf, len(buf))
        if buf.value:
            text += " (" + buf.value.decode(errors="replace").strip() + ")"
    return text


def version() -> int:
    """cudnnGetVersion() of the library the frontend would load, e.g. 91900."""
    return int(lib().cudnnGetVersion())


def cudart_version() -> int:
    """The CUDA runtime version this libcudnn was built against."""
    return int(lib().cudnnGetCudartVersion())


def create_handle() -> int:
    """A new cudnnHandle_t on the current device (the caller makes it current); runs on the legacy stream."""
    handle = _ptr()
    _check(lib().cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
    return int(handle.value)


def set_stream(handle: int, stream: int) -> None:
    _check(_SET_STREAM(handle, stream), "cudnnSetStream")


def _set_stream_fn(handle, stream) -> int:
    globals()["_SET_STREAM"] = fn = lib().cudnnSetStream  # bound once: set on every stream change
    return fn(handle, stream)


_SET_STREAM = _set_stream_fn


class ExecutionPlan:
    """A finalized execution plan rebuilt from its JSON form on `handle`'s device."""

    __slots__ = ("desc", "workspace_size", "__weakref__")

    def __init__(self, handle: int, plan_json: bytes):
        cudnn = lib()
        desc = _ptr()
        _check(cudnn.cudnnBackendCreateDescriptor(_EXECUTION_PLAN, ctypes.byref(desc)),
               "cudnnBackendCreateDescriptor(EXECUTION_PLAN)")
        self.desc = desc.value
        text = ctypes.create_string_buffer(plan_json, len(plan_json))
        handle_value = _ptr(handle)
        try:
            _check(cudnn.cudnnBackendSetAttribute(self.desc, _PLAN_JSON, _TYPE_CHAR, len(plan_json), text),
                   "cudnnBackendSetAttribute(EXECUTION_PLAN_JSON_REPRESENTATION)")
            _check(cudnn.cudnnBackendSetAttribute(self.desc, _PLAN_HANDLE, _TYPE_HANDLE, 1, ctypes.byref(handle_value)),
                   "cudnnBackendSetAttribute(EXECUTION_PLAN_HANDLE)")
            _check(cudnn.cudnnBackendFinalize(self.desc), "cudnnBackendFinalize(EXECUTION_PLAN)")
            size, count = _i64(0), _i64(0)
            _check(cudnn.cudnnBackendGetAttribute(self.desc, _PLAN_WORKSPACE_SIZE, _TYPE_INT64, 1, ctypes.byref(count),
                                                  ctypes.byref(size)), "cudnnBackendGetAttribute(WORKSPACE_SIZE)")
        except CudnnBackendError:
            self.close()
            raise
        self.workspace_size = int(size.value)

    def close(self) -> None:
        desc, self.desc = getattr(self, "desc", None), None
        if desc:
            lib().cudnnBackendDestroyDescriptor(desc)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def runner(self, uids: Sequence[int], template: Sequence[int], patch: Sequence[tuple[int, int]],
               workspace_ptr: int, handle: int):
        """`run(values)` executing this plan: `template` holds one pointer per uid, and each
        (position, slot) in `patch` takes `values[slot]` per call. The handle's stream is the caller's."""
        return _Runner(self, uids, template, patch, workspace_ptr, handle)


class _Runner:
    """A variant pack per pointer set: cuDNN 9.19 refuses to re-point a finalized pack
    (CUDNN_STATUS_BAD_PARAM) and copies its pointers at finalize (tools/probe_variant_pack.py), so a
    pack serves exactly the pointers it was made with. A training loop's buffers recur (torch's caching
    allocator hands the same blocks back a step or two later), so finalized packs are kept by pointer
    set (at most PACKS per runner, oldest destroyed first: a pack is host memory only) and a recurring
    set costs one cudnnBackendExecute instead of five backend calls. The uid and pointer arrays are
    built once and patched in place. Every argument is a ctypes object made once and the entry points
    carry no argtypes, so ctypes converts nothing per call. One thread runs a runner."""

    __slots__ = ("plan", "uids", "ptrs", "moves", "ws", "calls", "_packs", "_fill", "_handle", "_desc")
    PACKS = 64

    def __init__(self, plan: ExecutionPlan, uids, template, patch, workspace_ptr: int, handle: int):
        n = len(uids)
        self.plan = plan  # keeps the descriptor alive as long as a runner can execute it
        self.uids = (_i64 * n)(*uids)
        self.ptrs = (_ptr * n)(*template)
        self.ws = _ptr(workspace_ptr or None)
        self.moves = tuple(patch)
        self.calls = _hot_calls()
        self._packs: dict[tuple, Any] = {}
        c_int, count = ctypes.c_int, _i64(n)
        self._fill = ((c_int(_PACK_UIDS), c_int(_TYPE_INT64), count, self.uids),
                      (c_int(_PACK_POINTERS), c_int(_TYPE_VOID_PTR), count, self.ptrs),
                      (c_int(_PACK_WORKSPACE), c_int(_TYPE_VOID_PTR), _i64(1), ctypes.byref(self.ws)))
        self._handle, self._desc = _ptr(handle), _ptr(plan.desc)

    def __call__(self, values: Sequence[int]) -> None:
        key = values if type(values) is tuple else tuple(values)
        pack = self._packs.get(key)
        if pack is None:
            pack = self._pack_for(key)
        _check(self.calls[3](self._handle, self._desc, pack), "cudnnBackendExecute")

    def _pack_for(self, values: tuple) -> Any:
        ptrs = self.ptrs
        for i, slot in self.moves:
            ptrs[i] = values[slot]
        create, set_attr, finalize, _, destroy = self.calls
        pack = _ptr()
        _check(create(ctypes.c_int(_VARIANT_PACK), ctypes.byref(pack)), "cudnnBackendCreateDescriptor(VARIANT_PACK)")
        try:
            for what, args in zip(("UNIQUE_IDS", "DATA_POINTERS", "WORKSPACE"), self._fill):
                _check(set_attr(pack, *args), f"cudnnBackendSetAttribute({what})")
            _check(finalize(pack), "cudnnBackendFinalize(VARIANT_PACK)")
        except BaseException:
            destroy(pack)
            raise
        packs = self._packs
        if len(packs) >= self.PACKS:
            destroy(packs.pop(next(iter(packs))))
        packs[values] = pack
        return pack

    def __del__(self) -> None:
        try:
            destroy = self.calls[4]
            for pack in self._packs.values():
                destroy(pack)
            self._packs.clear()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


@functools.lru_cache(maxsize=1)
def _hot_calls() -> tuple:
    """The per-call entry points, each a function object of its own without argtypes (see _Runner)."""
    cudnn = ctypes.CDLL(lib()._name)
    calls = []
    for name in ("cudnnBackendCreateDescriptor", "cudnnBackendSetAttribute", "cudnnBackendFinalize",
                 "cudnnBackendExecute", "cudnnBackendDestroyDescriptor"):
        fn = cudnn[name]
        fn.restype = ctypes.c_int
        calls.append(fn)
    return tuple(calls)
