"""What a buffer is (pointer, shape, strides, dtype, device, framework), whatever object holds it.

Accepts torch tensors, CuPy arrays, anything with `__cuda_array_interface__` or `__dlpack__`, and
raw device pointers (ints), for which the caller vouches for shape and layout.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from .errors import BufferMismatchError
from . import dlpack

ALIGNMENT = 16  # bytes: what every tensor of our cuDNN graphs declares
_TYPESTR = {"<f2": "float16", "<f4": "float32", "<f8": "float64", "<V2": "bfloat16", "<bf16": "bfloat16"}


class BufferInfo(NamedTuple):
    ptr: int
    shape: tuple[int, ...] | None
    strides: tuple[int, ...] | None  # in elements
    dtype: str | None
    device: int | None
    framework: str  # "torch", "cupy", "cai", "dlpack", "pointer"
    owner: Any = None  # what keeps the memory alive while a bound plan uses it (DLPack exports)


def framework_of(obj: Any) -> str:
    """Which framework's stream and allocator serve this buffer; cheap, exports nothing."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return "pointer"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return "torch"
    if hasattr(obj, "__cuda_array_interface__"):
        return "cupy" if type(obj).__module__.startswith("cupy") else "cai"
    if hasattr(obj, "__dlpack__"):
        return "dlpack"
    return "unknown"


def torch_tensor_type() -> type | None:
    """torch.Tensor once torch is imported (never imported here: a CuPy user pays nothing for it)."""
    global _TORCH_TENSOR
    if _TORCH_TENSOR is None:
        torch = sys.modules.get("torch")
        _TORCH_TENSOR = getattr(torch, "Tensor", None)
    return _TORCH_TENSOR


_TORCH_TENSOR: type | None = None


def read_all(roles: tuple[str, ...], objs, stream: int) -> tuple[tuple, tuple[int, ...], list]:
    """(key, pointers, owners) of buffers, each read once; None stands for an absent buffer. The key
    holds what a plan's checks depend on (which buffers are given; shape, strides, dtype, device of
    each; whether all are 16-byte aligned), so equal keys pass or fail the checks alike. Owners keep
    DLPack exports alive until the launch is queued."""
    tensor = torch_tensor_type()
    parts, ptrs, owners = [], [], []
    for role, obj in zip(roles, objs):
        if obj is None:
            parts.append(None)
        elif tensor is not None and isinstance(obj, tensor):
            parts.append((obj.shape, obj.stride(), obj.dtype, obj.get_device()))
            ptrs.append(obj.data_ptr())
        else:
            info = describe(obj, role, stream=stream)
            parts.append((info.shape, info.strides, info.dtype, info.device, info.framework))
            ptrs.append(info.ptr)
            if info.owner is not None:
                owners.append(info.owner)
    parts.append(all(p % ALIGNMENT == 0 for p in ptrs))
    return tuple(parts), tuple(ptrs), owners


def describe(obj: Any, role: str, *, stream: int | None = None) -> BufferInfo:
    """`stream` is the one the launch will use: DLPack producers make their work visible to it."""
    framework = framework_of(obj)
    if framework == "pointer":
        return BufferInfo(obj, None, None, None, None, "pointer")
    if framework == "torch":
        if obj.device.type != "cuda":
            raise BufferMismatchError(role, "device", "a CUDA tensor", str(obj.device))
        return BufferInfo(obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                          str(obj.dtype).removeprefix("torch."), obj.device.index, "torch")
    if framework in ("cupy", "cai"):
        return _from_cai(obj, obj.__cuda_array_interface__, role)
    if framework == "dlpack":
        return _from_dlpack(obj, role, stream)
    raise BufferMismatchError(role, "type", "a CUDA torch tensor, CuPy array, __cuda_array_interface__ or "
                              "__dlpack__ object, or an int device pointer", type(obj).__name__)


# what a user calls the DLPack device types a buffer may come from (dlpack.h's DLDeviceType)
_DLPACK_DEVICES = {1: "a CPU (host) buffer: copy it to the GPU first", 3: "a pinned host buffer (kDLCUDAHost): "
                   "copy it to the GPU first", 4: "an OpenCL buffer", 7: "a Vulkan buffer", 8: "a Metal buffer",
                   10: "a ROCm buffer", 14: "a oneAPI buffer"}


def _from_dlpack(obj: Any, role: str, stream: int | None) -> BufferInfo:
    device_type, _ = dlpack.device_of(obj)
    if device_type not in (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED):
        raise BufferMismatchError(role, "device", "a CUDA buffer", _DLPACK_DEVICES.get(
            device_type, f"a buffer on DLPack device type {device_type}"))
    # DLPack: 0 is ambiguous for CUDA, so the legacy default stream is spelled 1.
    v = dlpack.view(obj, stream=None if stream is None else (stream or 1))
    return BufferInfo(v.ptr, v.shape, v.strides, v.dtype, v.device_id, "dlpack", v.owner)


def _from_cai(obj: Any, cai: dict, role: str) -> BufferInfo:
    typestr = cai["typestr"]
    dtype = _TYPESTR.get(typestr)
    if dtype is None and "bfloat16" in str(getattr(obj, "dtype", "")):
        dtype = "bfloat16"
    shape = tuple(cai["shape"])
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 2
    strides = cai.get("strides")
    strides = dlpack.contiguous_strides(shape) if strides is None else tuple(s // itemsize for s in strides)
    device = getattr(getattr(obj, "device", None), "id", None)
    framework = "cupy" if type(obj).__module__.startswith("cupy") else "cai"
    return BufferInfo(int(cai["data"][0]), shape, strides, dtype or typestr, device, framework)


def check(info: BufferInfo, desc: Any, role: str, device: int) -> None:
    """Refuse before launch anything that does not match `desc` (a spec's TensorDesc: shape, strides, dtype)."""
    if info.framework == "pointer":
        if info.ptr == 0:
            raise BufferMismatchError(role, "pointer", "a non-null device pointer", 0)
        if info.ptr % ALIGNMENT:
            raise BufferMismatchError(role, "alignment", f"a multiple of {ALIGNMENT} bytes", hex(info.ptr))
        return
    if info.shape != desc.shape:
        raise BufferMismatchError(role, "shape", desc.shape, info.shape)
    if info.dtype != desc.dtype:
        raise BufferMismatchError(role, "dtype", desc.dtype, info.dtype)
    if info.device is not None and info.device != device:
        raise BufferMismatchError(role, "device", device, info.device)
    if not same_layout(info.strides, desc.strides, desc.shape):
        raise BufferMismatchError(role, "strides", desc.strides, info.strides)
    # cuDNN graphs declare 16-byte aligned tensors (the frontend's default); its engines may use vector
    # loads, so a less aligned pointer faults or reads wrong data instead of failing cleanly.
    if info.ptr % ALIGNMENT:
        raise BufferMismatchError(role, "alignment", f"a multiple of {ALIGNMENT} bytes (a view at an offset "
                                  "breaks it: pass a copy, e.g. .clone())", hex(info.ptr))


def same_layout(got: tuple[int, ...] | None, expected: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    # Strides of size-1 dims never address memory: frameworks pick arbitrary values there.
    return got is not None and all(g == e or d == 1 for g, e, d in zip(got, expected, shape))
