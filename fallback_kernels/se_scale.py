"""Launchers for se_scale.cu: squeeze-excitation's `scale * x` over a channels-last map, forward and backward.

`SeScale(samples, rows, channels, dtype, device)` prepares one geometry (N samples of H*W rows of C channels)
once; `forward` then queues one kernel and `backward` two, taking pointers (ints) and a stream: no allocation,
no check, no synchronisation. `supported(channels, dtype)` says where the kernels apply (16-byte vectors along
the channels); the caller runs torch's multiply elsewhere.
"""

from __future__ import annotations

import ctypes
import functools

from gpu_launch import driver

from . import compile as _compile
from .types import ITEMSIZE, SIXTEEN_AND_32, STORAGE

THREADS = 256  # SE_THREADS in se_scale.cu
BLOCKS_PER_SM = 8  # the forward's grid-stride loop: enough resident warps to keep the memory busy
BWD_BLOCKS_PER_SM = 4  # the backward's blocks over (column chunks, row ranges, samples): a fixed grid per GPU
#                        model, so its sums add in the same order on every run
NULL = 0


def vec(dtype: str) -> int:
    """Values a 16-byte vector of `dtype` holds."""
    return 16 // ITEMSIZE[dtype]


def supported(channels: int, dtype: str) -> bool:
    return dtype in SIXTEEN_AND_32 and channels > 0 and channels % vec(dtype) == 0


def _names(dtype: str) -> dict[str, str]:
    t, v = STORAGE[dtype], vec(dtype)
    return {"fwd": f"se_scale_fwd<{t}, {v}>", "bwd": f"se_scale_bwd<{t}, {v}>", "sum": f"se_scale_bwd_sum<{t}>"}


def name_expressions() -> list[str]:
    return [name for dtype in SIXTEEN_AND_32 for name in _names(dtype).values()]


def load(dtype: str, device: int) -> None:
    """Compile (or read from CuPy's disk cache) and load the kernels for `dtype` on `device`: a caller that will
    launch them inside a CUDA-graph capture does this before it (a module load while capturing breaks it)."""
    _functions(dtype, device)


@functools.lru_cache(maxsize=None)
def _functions(dtype: str, device: int) -> dict[str, int]:
    return _compile.cufunctions("se_scale.cu", _names(dtype), device)


def backward_grid(samples: int, rows: int, channels: int, dtype: str, sms: int) -> tuple[int, int, int, int]:
    """(column chunks, splits, samples, rows a split) of the backward's grid: about BWD_BLOCKS_PER_SM blocks an
    SM, each sample's rows cut into `splits` ranges, no more ranges than a block's row steps would fill."""
    vectors = channels // vec(dtype)
    chunks = -(-vectors // THREADS)
    rows_at_once = THREADS // min(vectors, THREADS)
    splits = max(1, min(-(-BWD_BLOCKS_PER_SM * sms // (samples * chunks)), -(-rows // rows_at_once)))
    per_split = -(-rows // splits)
    return chunks, -(-rows // per_split), samples, per_split


class SeScale:
    """One (samples, rows, channels, dtype, device) geometry; pointers must be 16-byte aligned. One thread at a
    time calls it (its argument slots are patched in place)."""

    def __init__(self, samples: int, rows: int, channels: int, dtype: str, device: int):
        if not supported(channels, dtype) or samples <= 0 or rows <= 0:
            raise ValueError(f"channels: {channels} {dtype} values a row ({samples} samples of {rows} rows) is "
                             f"beyond this kernel: it takes float16, bfloat16 or float32 rows of whole 16-byte vectors")
        fns, sms = _functions(dtype, device), driver.multiprocessors(device)
        vectors = samples * rows * channels // vec(dtype)
        self.fwd_ptrs = [ctypes.c_uint64(0) for _ in range(3)]
        self.fwd = driver.Kernel(fns["fwd"], grid=max(1, min(-(-vectors // THREADS), BLOCKS_PER_SM * sms)),
                                 block=THREADS, args=[*self.fwd_ptrs, ctypes.c_int64(vectors),
                                                      ctypes.c_int32(channels), ctypes.c_int64(rows * channels)],
                                 ordinal=device)
        chunks, splits, _, per_split = backward_grid(samples, rows, channels, dtype, sms)
        self.partials_bytes = samples * splits * channels * 4
        self.bwd_ptrs = [ctypes.c_uint64(0) for _ in range(5)]
        self.bwd = driver.Kernel(fns["bwd"], grid=(chunks, splits, samples), block=THREADS,
                                 args=[*self.bwd_ptrs, ctypes.c_int64(rows), ctypes.c_int32(channels),
                                       ctypes.c_int64(per_split)], ordinal=device)
        self.sum_ptrs = [ctypes.c_uint64(0) for _ in range(2)]
        total = samples * channels
        self.sum = driver.Kernel(fns["sum"], grid=max(1, min(-(-total // THREADS), BLOCKS_PER_SM * sms)),
                                 block=THREADS, args=[*self.sum_ptrs, ctypes.c_int32(channels),
                                                      ctypes.c_int32(splits), ctypes.c_int64(total)],
                                 ordinal=device)

    def forward(self, stream: int, *, x: int, s: int, out: int) -> None:
        """out = x * s[n, c]."""
        for slot, value in zip(self.fwd_ptrs, (x, s, out)):
            slot.value = value
        self.fwd.launch(stream)

    def backward(self, stream: int, *, dy: int, x: int, s: int, dx: int = NULL, ds: int = NULL,
                 partials: int = NULL) -> None:
        """dx = dy * s[n, c] where `dx` is given; ds[n, c] = sum over the sample's rows of dy * x where `ds` is
        given, through `partials` (partials_bytes of float32 scratch). 0 = absent."""
        if ds and not partials:
            raise ValueError("partials: ds needs partials_bytes of float32 scratch, got none")
        for slot, value in zip(self.bwd_ptrs, (dy, x, s, dx, partials if ds else NULL)):
            slot.value = value
        self.bwd.launch(stream)
        if ds:
            self.sum_ptrs[0].value, self.sum_ptrs[1].value = partials, ds
            self.sum.launch(stream)
