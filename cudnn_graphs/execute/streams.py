"""Streams and scratch memory in the buffers' own framework."""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any


def stream_pointer(stream: Any, framework: str, device: int) -> int:
    """The cudaStream_t to launch on: the given one, else the framework's current stream."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr", "handle"):
            value = getattr(stream, attr, None)
            if isinstance(value, int):
                return value
        raise TypeError(f"stream: expected an int, torch.cuda.Stream or cupy Stream, got {type(stream).__name__}")
    if framework == "torch":
        return sys.modules["torch"].cuda.current_stream(device).cuda_stream
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0  # raw pointers with no framework: the legacy default stream


def allocate(nbytes: int, framework: str, device: int) -> tuple[Any, int]:
    """(owner, pointer) of nbytes from torch's caching allocator for torch buffers, else CuPy's pool."""
    if nbytes == 0:
        return None, 0
    if framework == "torch":
        torch = sys.modules["torch"]
        owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return owner, owner.data_ptr()
    import cupy

    with cupy.cuda.Device(device):
        owner = cupy.cuda.alloc(nbytes)
    return owner, owner.ptr


def allocate_like(desc, *, like: Any, framework: str, device: int) -> Any:
    """A new, uninitialised tensor for `desc` in the framework of `like` (CuPy for non-torch buffers)."""
    if framework == "torch":
        torch = sys.modules["torch"]
        return torch.empty_strided(desc.shape, desc.strides, dtype=getattr(torch, desc.dtype), device=like.device)
    import cupy

    dtype = _cupy_dtype(desc.dtype)
    itemsize = dtype.itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, desc.strides))
    with cupy.cuda.Device(device):
        memory = cupy.cuda.alloc(span * itemsize)
    return cupy.ndarray(desc.shape, dtype=dtype, memptr=memory, strides=tuple(s * itemsize for s in desc.strides))


def _cupy_dtype(name: str):
    import numpy

    if name != "bfloat16":
        return numpy.dtype(name)
    try:
        import ml_dtypes  # CuPy holds bfloat16 only through ml_dtypes' numpy dtype
    except ImportError:
        from ..errors import BufferMismatchError

        raise BufferMismatchError("output", "dtype", "an output buffer passed in (CuPy needs ml_dtypes to "
                                  "allocate bfloat16)", name) from None
    return numpy.dtype(ml_dtypes.bfloat16)


@functools.lru_cache(maxsize=64)
def external_stream(ptr: int) -> Any:
    """A CuPy stream object for a raw cudaStream_t, cached: creating one per launch costs microseconds."""
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; 13 lacks the replacement
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr)
