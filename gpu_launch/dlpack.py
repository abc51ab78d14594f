"""Read a DLPack capsule (`__dlpack__`) with ctypes: pointer, shape, strides, dtype, device.

For buffers that offer nothing else (JAX arrays, TVM, other frameworks). The capsule is consumed as
the protocol requires, and the producer's deleter runs when the returned holder is collected.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
_DTYPES = {(2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16",
           (0, 8): "int8", (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8"}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DLPackView(NamedTuple):
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    device_type: int
    device_id: int
    owner: Any  # keeps the producer's memory alive; its deleter runs when this is collected


class _Owner:
    """Calls the producer's deleter exactly once, when the last user of the buffer lets go."""

    def __init__(self, managed: ctypes.POINTER(_DLManagedTensor)):
        self._managed = managed

    def __del__(self) -> None:
        managed, self._managed = self._managed, None
        if managed and managed.contents.deleter:
            managed.contents.deleter(managed)


def device_of(obj: Any) -> tuple[int, int]:
    """(device_type, device_id) from `__dlpack_device__`, without exporting anything."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return (KDL_CUDA, 0)  # producers that predate __dlpack_device__ are CUDA-only in practice
    device_type, device_id = dev()
    return int(device_type), int(device_id)


def view(obj: Any, *, stream: int | None) -> DLPackView:
    """Export `obj` through `__dlpack__`; `stream` is the consumer stream the producer syncs with."""
    capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("__dlpack__ did not return an unconsumed 'dltensor' capsule")
    managed = ctypes.cast(_api.PyCapsule_GetPointer(capsule, b"dltensor"), ctypes.POINTER(_DLManagedTensor))
    # Renaming marks it consumed: the producer's capsule destructor must not free it, our owner will.
    _api.PyCapsule_SetName(capsule, b"used_dltensor")
    owner = _Owner(managed)
    t = managed.contents.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else contiguous_strides(shape)
    dtype = _DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    dtype = dtype or f"dlpack(code={t.dtype.code},bits={t.dtype.bits},lanes={t.dtype.lanes})"
    return DLPackView((t.data or 0) + t.byte_offset, shape, strides, dtype, t.device.device_type,
                      t.device.device_id, owner)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))
