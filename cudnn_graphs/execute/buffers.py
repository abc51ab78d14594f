"""What a buffer is (pointer, shape, strides, dtype, device, framework), whatever object holds it.

Accepts torch tensors, CuPy arrays, anything with `__cuda_array_interface__`, and raw device
pointers (ints), for which the caller vouches for shape and layout.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from ..errors import BufferMismatchError
from ..spec import TensorDesc
from ..spec.dtypes import ITEMSIZE

_TYPESTR = {"<f2": "float16", "<f4": "float32", "<f8": "float64", "<V2": "bfloat16", "<bf16": "bfloat16"}


class BufferInfo(NamedTuple):
    ptr: int
    shape: tuple[int, ...] | None
    strides: tuple[int, ...] | None  # in elements
    dtype: str | None
    device: int | None
    framework: str  # "torch", "cupy", "cai", "pointer"


def describe(obj: Any, role: str) -> BufferInfo:
    if isinstance(obj, int) and not isinstance(obj, bool):
        return BufferInfo(obj, None, None, None, None, "pointer")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise BufferMismatchError(role, "device", "a CUDA tensor", str(obj.device))
        return BufferInfo(obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                          str(obj.dtype).removeprefix("torch."), obj.device.index, "torch")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai, role)
    raise BufferMismatchError(role, "type", "a CUDA torch tensor, CuPy array, __cuda_array_interface__ object or int",
                              type(obj).__name__)


def _from_cai(obj: Any, cai: dict, role: str) -> BufferInfo:
    typestr = cai["typestr"]
    dtype = _TYPESTR.get(typestr)
    if dtype is None and "bfloat16" in str(getattr(obj, "dtype", "")):
        dtype = "bfloat16"
    shape = tuple(cai["shape"])
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 2
    strides = cai.get("strides")
    strides = _contiguous(shape) if strides is None else tuple(s // itemsize for s in strides)
    device = getattr(getattr(obj, "device", None), "id", None)
    framework = "cupy" if type(obj).__module__.startswith("cupy") else "cai"
    return BufferInfo(int(cai["data"][0]), shape, strides, dtype or typestr, device, framework)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def check(info: BufferInfo, desc: TensorDesc, role: str, device: int) -> None:
    """Refuse before launch anything that does not match the spec's tensor exactly."""
    if info.framework == "pointer":
        if info.ptr == 0:
            raise BufferMismatchError(role, "pointer", "a non-null device pointer", 0)
        return
    if info.shape != desc.shape:
        raise BufferMismatchError(role, "shape", desc.shape, info.shape)
    if info.dtype != desc.dtype:
        raise BufferMismatchError(role, "dtype", desc.dtype, info.dtype)
    if info.device is not None and info.device != device:
        raise BufferMismatchError(role, "device", device, info.device)
    if not _same_layout(info.strides, desc.strides, desc.shape):
        raise BufferMismatchError(role, "strides", desc.strides, info.strides)
    # A misaligned element pointer faults inside cuDNN's kernels instead of failing cleanly.
    if info.ptr % ITEMSIZE[desc.dtype]:
        raise BufferMismatchError(role, "alignment", f"a multiple of {ITEMSIZE[desc.dtype]} bytes", hex(info.ptr))


def _same_layout(got: tuple[int, ...] | None, expected: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    # Strides of size-1 dims never address memory: frameworks pick arbitrary values there.
    return got is not None and all(g == e or d == 1 for g, e, d in zip(got, expected, shape))
