"""Launcher for layernorm.cu: LayerNorm over rows of contiguous values, optionally after a per-channel add.

`LayerNormRows(rows, channels, dtype, device, aligned=...)` prepares one geometry's launch once; a call then
takes its pointers (ints), eps and a stream and queues one kernel: no allocation, no check, no
synchronisation. `layout(channels, dtype, aligned)` says how a row is spread over threads, or None where
the row is too wide to hold in registers (the caller runs torch's LayerNorm there).
"""

from __future__ import annotations

import ctypes
import functools

from gpu_launch import driver

from . import compile as _compile
from .types import ITEMSIZE, SIXTEEN_AND_32, STORAGE

THREADS = 256  # LN_THREADS in layernorm.cu
MAX_NV = 8  # vectors a thread holds: 8 x 16 bytes of float16 = 64 float32 registers
TARGET_NV = 4  # fewer threads a row while each holds at most this many vectors: more bytes in flight a thread
BLOCKS_PER_SM = 8  # grid-stride loop over rows: enough resident warps to keep the memory busy
NULL = 0


def _widths(dtype: str) -> tuple[int, ...]:
    """Values a vector: 16 bytes, 8 bytes, or one value."""
    wide = 16 // ITEMSIZE[dtype]
    return wide, wide // 2, 1


def _names(dtype: str) -> dict[tuple[int, int], str]:
    t = STORAGE[dtype]
    return {(vec, nv): f"layer_norm_rows<{t}, {vec}, {nv}>" for vec in _widths(dtype) for nv in range(1, MAX_NV + 1)}


def name_expressions() -> list[str]:
    return [name for dtype in SIXTEEN_AND_32 for name in _names(dtype).values()]


def layout(channels: int, dtype: str, *, align: int) -> tuple[int, int, int] | None:
    """(VEC, NV, lanes): VEC values a vector (16 or 8 bytes where the channel count and every pointer's
    `align`ment in bytes allow), NV vectors a thread, `lanes` threads a row (a power of two up to 32).
    None: a row wider than a warp holds."""
    if dtype not in SIXTEEN_AND_32 or channels <= 0 or align <= 0:
        return None
    size = ITEMSIZE[dtype]
    vec = next(v for v in _widths(dtype) if channels % v == 0 and align % (v * size) == 0)
    vectors = -(-channels // vec)
    lanes = 1
    while lanes < 32 and -(-vectors // lanes) > TARGET_NV:
        lanes *= 2
    nv = -(-vectors // lanes)
    return (vec, nv, lanes) if nv <= MAX_NV else None


@functools.lru_cache(maxsize=None)
def _functions(dtype: str, device: int) -> dict[tuple[int, int], int]:
    names = _names(dtype)
    module = _compile.load_module("layernorm.cu", tuple(names.values()), device)
    return {key: _compile.cufunction(module.get_function(expr), device) for key, expr in names.items()}


class LayerNormRows:
    """The launch of one (rows, channels, dtype, device, alignment) geometry; `align`: bytes every pointer
    of a call is a multiple of (16 for fresh allocations). One thread at a time calls it (its argument
    slots are patched in place)."""

    def __init__(self, rows: int, channels: int, dtype: str, device: int, *, align: int):
        shape = layout(channels, dtype, align=align)
        if shape is None or rows <= 0:
            raise ValueError(f"channels: {channels} {dtype} values a row is beyond this kernel "
                             f"(at most {MAX_NV} vectors a thread, 32 threads a row), rows {rows}")
        vec, nv, lanes = shape
        self.ptrs = [ctypes.c_uint64(0) for _ in range(5)]
        self.eps = ctypes.c_float(1e-5)
        args = [*self.ptrs, ctypes.c_int64(rows), ctypes.c_int32(channels), ctypes.c_int32(lanes.bit_length() - 1),
                self.eps]
        rows_per_block = THREADS // lanes
        grid = max(1, min(-(-rows // rows_per_block), BLOCKS_PER_SM * driver.multiprocessors(device)))
        self.kernel = driver.Kernel(_functions(dtype, device)[(vec, nv)], grid=grid, block=THREADS, args=args,
                                    ordinal=device)

    def __call__(self, stream: int, *, x: int, y: int, eps: float, add: int = NULL, gamma: int = NULL,
                 beta: int = NULL) -> None:
        """y = layer_norm(x + add) * gamma + beta over each row; 0 = absent."""
        for slot, value in zip(self.ptrs, (x, add, gamma, beta, y)):
            slot.value = value
        self.eps.value = eps
        self.kernel.launch(stream)
