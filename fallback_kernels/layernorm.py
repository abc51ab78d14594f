"""Launchers for layernorm.cu: LayerNorm over rows of contiguous values, forward and backward.

`LayerNormRows(rows, channels, dtype, device, align=...)` prepares one geometry's forward once; a call then
takes its pointers (ints), eps and a stream and queues one kernel: no allocation, no check, no
synchronisation. `LayerNormBackward` likewise queues the backward's two kernels. `layout(channels, dtype,
align)` says how a row is spread over threads, or None where the row is too wide to hold in registers
(the caller runs torch's LayerNorm there). `param_dtype`: the per-channel operands' dtype, the io dtype or
float32 (autocast's parameters).
"""

from __future__ import annotations

import ctypes
import functools

from gpu_launch import driver

from . import compile as _compile
from .types import ITEMSIZE, SIXTEEN_AND_32, STORAGE

THREADS = 256  # LN_THREADS in layernorm.cu
MAX_CHANNELS = 1024  # LN_MAX_CHANNELS: the backward's per-block sums in shared memory
MAX_NV = 8  # vectors a thread holds: 8 x 16 bytes of float16 = 64 float32 registers
MAX_BWD_NV = 3  # the backward holds x, the gradient and two sums a value: 4 x 24 floats a thread
TARGET_NV = 4  # fewer threads a row while each holds at most this many vectors: more bytes in flight a thread
BLOCKS_PER_SM = 8  # grid-stride loop over rows: enough resident warps to keep the memory busy
BWD_BLOCKS_PER_SM = 2  # the backward's blocks each add a row of partial sums (two waves where ~140 registers a
#                        thread leave one 256-thread block an SM)
SCALE_VEC = 8  # the layer-scale kernels' values a vector: 16 bytes of a 16-bit z, 32 of float32 x and dy
NULL = 0


def _widths(dtype: str) -> tuple[int, ...]:
    """Values a vector: 16 bytes, 8 bytes, or one value."""
    wide = 16 // ITEMSIZE[dtype]
    return wide, wide // 2, 1


def _pairs() -> list[tuple[str, str]]:
    """(io dtype, parameter dtype) instantiated: the parameters in the io dtype, or float32 ones."""
    return [(t, t) for t in SIXTEEN_AND_32] + [(t, "float32") for t in SIXTEEN_AND_32 if t != "float32"]


def _names(dtype: str, param_dtype: str) -> dict[tuple, str]:
    t, p = STORAGE[dtype], STORAGE[param_dtype]
    names: dict[tuple, str] = {}
    for vec in _widths(dtype):
        for nv in range(1, MAX_NV + 1):
            names[("fwd", vec, nv)] = f"layer_norm_rows<{t}, {p}, {vec}, {nv}>"
        for nv in range(1, MAX_BWD_NV + 1):
            names[("bwd", vec, nv)] = f"layer_norm_bwd_rows<{t}, {p}, {vec}, {nv}>"
    names[("params",)] = f"layer_norm_bwd_params<{p}>"
    if param_dtype == "float32" and dtype != "float32":  # autocast's training: ConvNeXt's block end
        for x in dict.fromkeys((t, "float")):
            names[("residual", x)] = f"layer_scale_residual<{x}, {t}, {SCALE_VEC}>"
        for nv in range(1, MAX_BWD_NV + 1):
            names[("scale_bwd", nv)] = f"layer_scale_bwd<{t}, {SCALE_VEC}, {nv}>"
    return names


def name_expressions() -> list[str]:
    return [name for pair in _pairs() for name in _names(*pair).values()]


def layout(channels: int, dtype: str, *, align: int, backward: bool = False) -> tuple[int, int, int] | None:
    """(VEC, NV, lanes): VEC values a vector (16 or 8 bytes where the channel count and every pointer's
    `align`ment, in bytes of the io dtype, allow), NV vectors a thread, `lanes` threads a row (a power of
    two up to 32). None: a row wider than a warp holds (or than the backward takes)."""
    if dtype not in SIXTEEN_AND_32 or channels <= 0 or align <= 0:
        return None
    if backward and channels > MAX_CHANNELS:
        return None
    size = ITEMSIZE[dtype]
    vec = next(v for v in _widths(dtype) if channels % v == 0 and align % (v * size) == 0)
    vectors = -(-channels // vec)
    target = min(TARGET_NV, MAX_BWD_NV) if backward else TARGET_NV
    lanes = 1
    while lanes < 32 and -(-vectors // lanes) > target:
        lanes *= 2
    nv = -(-vectors // lanes)
    return (vec, nv, lanes) if nv <= (MAX_BWD_NV if backward else MAX_NV) else None


@functools.lru_cache(maxsize=None)
def _functions(dtype: str, param_dtype: str, device: int) -> dict[tuple, int]:
    return _compile.cufunctions("layernorm.cu", _names(dtype, param_dtype), device)


def _checked_layout(rows: int, channels: int, dtype: str, param_dtype: str, align: int, backward: bool):
    shape = layout(channels, dtype, align=align, backward=backward)
    if shape is None or rows <= 0 or (dtype, param_dtype) not in _pairs():
        raise ValueError(f"channels: {channels} {dtype} values a row ({param_dtype} parameters) is beyond this "
                         f"kernel{' backward' if backward else ''}, rows {rows}")
    return shape


class LayerNormRows:
    """The forward of one (rows, channels, dtype, parameter dtype, device, alignment) geometry; `align`:
    bytes every io pointer of a call is a multiple of, in io-dtype units for the parameters (16 for fresh
    allocations). One thread at a time calls it (its argument slots are patched in place)."""

    def __init__(self, rows: int, channels: int, dtype: str, device: int, *, align: int,
                 param_dtype: str | None = None):
        vec, nv, lanes = _checked_layout(rows, channels, dtype, param_dtype or dtype, align, False)
        self.ptrs = [ctypes.c_uint64(0) for _ in range(7)]
        self.eps = ctypes.c_float(1e-5)
        args = [*self.ptrs, ctypes.c_int64(rows), ctypes.c_int32(channels), ctypes.c_int32(lanes.bit_length() - 1),
                self.eps]
        grid = max(1, min(-(-rows // (THREADS // lanes)), BLOCKS_PER_SM * driver.multiprocessors(device)))
        fn = _functions(dtype, param_dtype or dtype, device)[("fwd", vec, nv)]
        self.kernel = driver.Kernel(fn, grid=grid, block=THREADS, args=args, ordinal=device)

    def __call__(self, stream: int, *, x: int, y: int, eps: float, add: int = NULL, gamma: int = NULL,
                 beta: int = NULL, mean: int = NULL, rstd: int = NULL) -> None:
        """y = layer_norm(x + add) * gamma + beta over each row; `mean`, `rstd` (float32 a row) receive the
        row statistics where given; 0 = absent."""
        for slot, value in zip(self.ptrs, (x, add, gamma, beta, y, mean, rstd)):
            slot.value = value
        self.eps.value = eps
        self.kernel.launch(stream)


class LayerNormBackward:
    """The backward of one geometry: dx from dy, x and the forward's row statistics, and the parameters'
    gradients through `partials_bytes` of float32 scratch (deterministic: a fixed grid per GPU model)."""

    def __init__(self, rows: int, channels: int, dtype: str, device: int, *, align: int,
                 param_dtype: str | None = None):
        vec, nv, lanes = _checked_layout(rows, channels, dtype, param_dtype or dtype, align, True)
        fns = _functions(dtype, param_dtype or dtype, device)
        self.blocks = max(1, min(-(-rows // (THREADS // lanes)), BWD_BLOCKS_PER_SM * driver.multiprocessors(device)))
        self.partials_bytes = self.blocks * 2 * channels * 4
        self.ptrs = [ctypes.c_uint64(0) for _ in range(8)]
        args = [*self.ptrs, ctypes.c_int64(rows), ctypes.c_int32(channels), ctypes.c_int32(lanes.bit_length() - 1)]
        self.rows_kernel = driver.Kernel(fns[("bwd", vec, nv)], grid=self.blocks, block=THREADS, args=args,
                                         ordinal=device)
        self.params = [ctypes.c_uint64(0) for _ in range(3)]
        self.params_kernel = _params_kernel(fns[("params",)], self.params, self.blocks, channels, device)

    def __call__(self, stream: int, *, dy: int, x: int, mean: int, rstd: int, dx: int, partials: int,
                 gamma: int = NULL, dgamma: int = NULL, dbeta: int = NULL, add: int = NULL) -> None:
        """dx (x's layout) and, where given, dgamma and dbeta (the parameters' dtype); `add`: the forward's;
        0 = absent."""
        for slot, value in zip(self.ptrs, (dy, x, add, mean, rstd, gamma, dx, partials)):
            slot.value = value
        self.rows_kernel.launch(stream)
        if dgamma or dbeta:
            for slot, value in zip(self.params, (partials, dgamma, dbeta)):
                slot.value = value
            self.params_kernel.launch(stream)


def _params_kernel(fn: int, slots: list, blocks: int, channels: int, device: int) -> driver.Kernel:
    return driver.Kernel(fn, grid=-(-2 * channels // THREADS), block=THREADS,
                         args=[*slots, ctypes.c_int32(blocks), ctypes.c_int32(channels)], ordinal=device)


class LayerScaleResidual:
    """ConvNeXt's block end under autocast, forward and backward, for one geometry: `forward` writes
    out = x + (z + bias) * gamma * noise[sample] in float32; `backward` writes dz = dy * gamma * noise (the io
    dtype) and the float32 gradients of gamma and bias. `dtype`: z's (16-bit); `x_dtype`: the block input's
    (`dtype` or float32). Pointers aligned to SCALE_VEC values of their type (32 bytes for float32); channels a
    multiple of SCALE_VEC. One thread at a time calls it."""

    def __init__(self, rows: int, channels: int, dtype: str, x_dtype: str, device: int, *, sample_rows: int):
        if dtype not in ("float16", "bfloat16") or x_dtype not in (dtype, "float32") or channels % SCALE_VEC \
                or channels > MAX_CHANNELS or rows <= 0 or sample_rows <= 0 or rows % sample_rows:
            raise ValueError(f"channels: {channels} {dtype} values a row ({x_dtype} input, {rows} rows, "
                             f"{sample_rows} a sample) is beyond the layer-scale kernels")
        fns = _functions(dtype, "float32", device)
        vec, nv, lanes = _checked_layout(rows, channels, dtype, "float32", 16, True)
        assert vec == SCALE_VEC
        self.fwd_ptrs = [ctypes.c_uint64(0) for _ in range(6)]
        vectors = rows * channels // SCALE_VEC
        grid = max(1, min(-(-vectors // THREADS), BLOCKS_PER_SM * driver.multiprocessors(device)))
        self.fwd = driver.Kernel(fns[("residual", "float" if x_dtype == "float32" else STORAGE[dtype])],
                                 grid=grid, block=THREADS, ordinal=device,
                                 args=[*self.fwd_ptrs, ctypes.c_int64(vectors), ctypes.c_int32(channels),
                                       ctypes.c_int64(sample_rows * channels)])
        self.blocks = max(1, min(-(-rows // (THREADS // lanes)), BWD_BLOCKS_PER_SM * driver.multiprocessors(device)))
        self.partials_bytes = self.blocks * 2 * channels * 4
        self.bwd_ptrs = [ctypes.c_uint64(0) for _ in range(7)]
        self.bwd = driver.Kernel(fns[("scale_bwd", nv)], grid=self.blocks, block=THREADS, ordinal=device,
                                 args=[*self.bwd_ptrs, ctypes.c_int64(rows), ctypes.c_int32(channels),
                                       ctypes.c_int32(lanes.bit_length() - 1), ctypes.c_int64(sample_rows)])
        self.params = [ctypes.c_uint64(0) for _ in range(3)]
        self.params_kernel = _params_kernel(fns[("params",)], self.params, self.blocks, channels, device)

    def forward(self, stream: int, *, x: int, z: int, bias: int, gamma: int, noise: int, out: int) -> None:
        for slot, value in zip(self.fwd_ptrs, (x, z, bias, gamma, noise, out)):
            slot.value = value
        self.fwd.launch(stream)

    def backward(self, stream: int, *, dy: int, z: int, bias: int, gamma: int, noise: int, dz: int, partials: int,
                 dgamma: int, dbias: int) -> None:
        for slot, value in zip(self.bwd_ptrs, (dy, z, bias, gamma, noise, dz, partials)):
            slot.value = value
        self.bwd.launch(stream)
        for slot, value in zip(self.params, (partials, dgamma, dbias)):
            slot.value = value
        self.params_kernel.launch(stream)
