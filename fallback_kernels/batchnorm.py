"""Launchers for batchnorm.cu: training-mode BatchNorm around cuDNN's conv + statistics graphs.

`BatchNormKernels(rows, channels, dtype, device)` prepares, once per geometry, every launch a
conv -> BatchNorm (-> ReLU) stage needs; each launch then takes its pointers (ints) and a stream and
queues one kernel, nothing else: no allocation, no check, no synchronisation.
`Cast` casts up to four same-layout tensors between float32 and float16 in one launch.
Tensors are channels-last and dense: `rows` = N * spatial, `channels` = C; per-channel float32 buffers
(statistics, gamma, beta, running statistics, mean, 1/std, gradients) and io-dtype scale / shift.

The kernels are compiled with NVRTC through CuPy once per device and dtype; CuPy keeps the binary in
its on-disk kernel cache, so a later process only loads it.
"""

from __future__ import annotations

import ctypes
import functools

from gpu_launch import driver

from . import compile as _compile
from .types import ITEMSIZE, SIXTEEN_AND_32, STORAGE

CTYPES = {dtype: STORAGE[dtype] for dtype in SIXTEEN_AND_32}
BLOCK = 256
MAX_BLOCKS = 132 * 8  # grid-stride loops: a few waves of an H100's SMs cover any size
THREADS = 256  # a reduction block: TX channel groups x THREADS / TX row lanes (batchnorm.cu)
NULL = 0
UNROLL = 4  # rows a reduction thread loads at once (BN_UNROLL in batchnorm.cu)
REDUCE_WAVES = 1  # reduction blocks: this many waves of 2 an SM


def chunk_rows(rows: int, tiles: int, *, lanes: int, blocks: int) -> int:
    """Rows one reduction block sums, from the shape and the grid's size alone (deterministic on one GPU
    model: the grid follows its SM count, so another GPU or MIG slice sums in another order):
    `blocks` blocks over `tiles` channel tiles, a multiple of the rows a block loads at once. One wave of
    equal blocks leaves no tail but the last block's sum of the partials, which grows with the block count:
    4 waves (1056 blocks) left a 64-channel 56x56 layer at batch 64 at 1.5 TB/s."""
    step = lanes * UNROLL
    per_block = -(-rows // max(1, blocks // tiles))
    return -(-max(step, per_block) // step) * step


def reduce_layout(dtype: str, channels: int) -> tuple[int, int]:
    """(RV, TX) of the reductions: RV channels a thread, TX threads across a row's tile of RV * TX channels.
    16-byte loads where the channel count allows, 8 threads a row (64 float16 channels a tile, 32 rows a
    block: more tiles and fewer chunks a tile than 16 or 32 threads a row gave, whose last blocks' sums of
    the partials cost up to 40% more on ResNet-50's small layers, H100); else 1-2 channels a thread, 32 a row."""
    v = 16 // ITEMSIZE[dtype]
    if channels % v == 0:
        return v, 8
    return (2 if channels % 2 == 0 else 1), 32


def _layouts(dtype: str) -> list[tuple[int, int]]:
    return [(1, 32), (2, 32), (16 // ITEMSIZE[dtype], 8)]


def _names(dtype: str) -> dict[str, str]:
    t = CTYPES[dtype]
    return {"finalize": f"bn_finalize<{t}>",
            **{f"reduce{v}x{tx}": f"bn_bwd_reduce<{t}, {v}, {tx}>" for v, tx in _layouts(dtype)},
            **{f"stats{v}x{tx}": f"bn_stats<{t}, {v}, {tx}>" for v, tx in _layouts(dtype)},
            **{f"apply{v}": f"bn_apply<{t}, {v}>" for v in (1, 16 // ITEMSIZE[dtype])},
            **{f"bwd_apply{v}": f"bn_bwd_apply<{t}, {v}>" for v in (1, 16 // ITEMSIZE[dtype])}}


CASTS = {"to_half": "cast_multi<float, half_t>", "to_float": "cast_multi<half_t, float>"}
MAX_CAST = 4  # tensors one cast launch takes (CastArgs in batchnorm.cu)


def name_expressions() -> list[str]:
    return [name for dtype in CTYPES for name in _names(dtype).values()] + list(CASTS.values())


def vector_width(dtype: str, channels: int) -> int:
    """Channels a thread handles in the elementwise passes: 16 bytes where the channel count allows."""
    v = 16 // ITEMSIZE[dtype]
    return v if channels % v == 0 else 1


@functools.lru_cache(maxsize=None)
def _functions(dtype: str, device: int) -> dict[str, int]:
    return _compile.cufunctions("batchnorm.cu", {**_names(dtype), **CASTS}, device)


class _Launch:
    """One kernel with its arguments packed once; `__call__(stream, *pointers)` patches the pointer
    arguments (in their parameter order) and launches."""

    __slots__ = ("kernel", "slots")

    def __init__(self, fn: int, grid, block, args: list, device: int):
        self.slots = tuple(a for a in args if isinstance(a, ctypes.c_uint64))
        self.kernel = driver.Kernel(fn, grid=grid, block=block, args=args, ordinal=device)

    def __call__(self, stream: int, *pointers: int) -> None:
        for slot, value in zip(self.slots, pointers):
            slot.value = value
        self.kernel.launch(stream)


def _ptrs(n: int) -> list:
    return [ctypes.c_uint64(0) for _ in range(n)]


class BatchNormKernels:
    """Every launch of one (rows, channels, dtype, device) stage. Argument slots are patched in place: one
    thread at a time drives each direction (finalize/apply forward, backward)."""

    def __init__(self, rows: int, channels: int, dtype: str, device: int):
        if dtype not in CTYPES:
            raise ValueError(f"dtype: batchnorm kernels take {sorted(CTYPES)}, got {dtype!r}")
        fns = _functions(dtype, device)
        n, c = rows * channels, channels
        vec = vector_width(dtype, c)
        grid = max(1, min(-(-n // (BLOCK * vec)), MAX_BLOCKS))
        rv, tx = reduce_layout(dtype, c)
        tiles = -(-c // (rv * tx))
        chunk = chunk_rows(rows, tiles, lanes=THREADS // tx, blocks=REDUCE_WAVES * 2 * driver.multiprocessors(device))
        self.chunks = -(-rows // chunk)
        self.partials_bytes = 2 * self.chunks * c * 4
        i32, i64 = ctypes.c_int32, ctypes.c_int64
        self._finalize_args = [*_ptrs(11), i32(c), ctypes.c_double(rows), ctypes.c_float(1e-5), ctypes.c_float(0.1)]
        # one block (its counter is read before it is written), a thread a channel up to 1024: each thread's
        # channels are dependent round trips to memory, and 256 threads took 4-8 of them on C = 1024-2048
        fin_threads = min(1024, -(-c // 32) * 32)
        self._finalize = _Launch(fns["finalize"], 1, fin_threads, self._finalize_args, device)
        self.bits = vec == 8  # apply can write the ReLU's mask as bits, which the backward reads
        self.bits_bytes = n // 8 if self.bits else 0
        self._apply_args = [*_ptrs(8), i64(n), i32(c), i32(1)]
        self._apply = _Launch(fns[f"apply{vec}"], grid, BLOCK, self._apply_args, device)
        self.tiles = tiles  # counters a reduction needs (one per tile, zero between launches)
        red = [i64(rows), i32(c), i64(chunk), i64(self.chunks)]
        self._reduce_args = [*_ptrs(14), *red, i32(1)]
        blocks = (tiles, self.chunks)
        self._reduce = _Launch(fns[f"reduce{rv}x{tx}"], blocks, THREADS, self._reduce_args, device)
        self._stats = _Launch(fns[f"stats{rv}x{tx}"], blocks, THREADS, [*_ptrs(5), *red], device)
        self._bwd_args = [*_ptrs(10), i64(n), i32(c), i32(1)]
        self._bwd_apply = _Launch(fns[f"bwd_apply{vec}"], grid, BLOCK, self._bwd_args, device)

    def stats(self, stream: int, *, y: int, partials: int, sum: int, sq_sum: int, counters: int) -> None:
        """The per-channel sum and sum of squares of y in a fixed order (deterministic); `partials` holds
        `partials_bytes`, `counters` `tiles` zeroed uint32 that the launch leaves zeroed (one launch at a
        time per counters)."""
        self._stats(stream, y, partials, sum, sq_sum, counters)

    def finalize(self, stream: int, *, sum: int, sq_sum: int, gamma: int, beta: int, running_mean: int,
                 running_var: int, num_batches: int, scale: int, shift: int, mean: int, invstd: int,
                 eps: float, momentum: float | None) -> None:
        """mean, 1/std, scale, shift from the conv's statistics; the running statistics updated as torch's
        BatchNorm does (momentum None: the cumulative average), num_batches_tracked + 1. 0 = absent."""
        self._finalize_args[-2].value = eps
        self._finalize_args[-1].value = -1.0 if momentum is None else momentum
        self._finalize(stream, sum, sq_sum, gamma, beta, running_mean, running_var, num_batches, scale, shift,
                       mean, invstd)

    def apply(self, stream: int, *, y: int, scale: int, shift: int, out: int, relu: bool, residual: int = NULL,
              scale2: int = NULL, shift2: int = NULL, bits: int = NULL) -> None:
        """out = [relu](y * scale + shift [+ residual | + residual * scale2 + shift2]); 0 = absent. `bits`
        (`bits_bytes`, where `self.bits`) receives out > 0 a bit a value, for `backward`'s mask."""
        if bits and not self.bits:
            raise ValueError(f"bits: this geometry writes no mask bits ({self._apply_args[-2].value} channels)")
        self._apply_args[-1].value = int(relu)
        self._apply(stream, y, scale, shift, residual, scale2, shift2, out, bits)

    def add(self, stream: int, *, a: int, b: int, out: int) -> None:
        """out = a + b, elementwise over this stage's rows x channels (summed in float32, rounded once,
        as torch adds float16 tensors)."""
        self._apply_args[-1].value = 0
        self._apply(stream, a, NULL, NULL, b, NULL, NULL, out, NULL)

    def backward(self, stream: int, *, da: int, y: int, out: int, scale: int, shift: int, gamma: int, mean: int,
                 invstd: int, partials: int, coef: int, dgamma: int, dbeta: int, dy: int, relu: bool, counters: int,
                 dz: int = NULL, bits: int = NULL) -> None:
        """dy (and dgamma, dbeta) from da, the gradient of the stage's activation. The relu's mask comes
        from `bits` (what `apply` wrote) where given, else `out` (the stored activation) where given, else
        from y * scale + shift. `partials` holds `partials_bytes`, `coef` 3 * channels float32; `dz`
        receives the gradient before the BatchNorm (a residual input's gradient) where given; `counters`
        as for `stats`."""
        if bits and not self.bits:
            raise ValueError(f"bits: this geometry reads no mask bits ({self._bwd_args[-2].value} channels)")
        self._reduce_args[-1].value = int(relu)
        self._reduce(stream, da, y, out, bits, scale, shift, gamma, mean, invstd, partials, dgamma, dbeta, coef,
                     counters)
        self._bwd_args[-1].value = int(relu)
        self._bwd_apply(stream, da, y, out, bits, scale, shift, mean, coef, dy, dz)


class Cast:
    """One launch casting up to MAX_CAST same-layout tensors of fixed sizes: float32 -> float16
    (`to="to_half"`) or back (`to="to_float"`). `__call__(stream, srcs, dsts)` takes their pointers."""

    def __init__(self, sizes: tuple[int, ...], *, to: str, device: int):
        if not 0 < len(sizes) <= MAX_CAST:
            raise ValueError(f"sizes: 1 to {MAX_CAST} tensors a cast, got {len(sizes)}")
        self.srcs, self.dsts = _ptrs(MAX_CAST), _ptrs(MAX_CAST)
        counts = [ctypes.c_int64(n) for n in (*sizes, *(0,) * (MAX_CAST - len(sizes)))]
        self.count = len(sizes)
        grid = (max(1, min(-(-max(sizes) // BLOCK), MAX_BLOCKS)), len(sizes))
        self.kernel = driver.Kernel(_functions("float16", device)[to], grid=grid, block=BLOCK,
                                    args=[*self.srcs, *self.dsts, *counts], ordinal=device)

    def __call__(self, stream: int, srcs, dsts) -> None:
        for i in range(self.count):
            self.srcs[i].value, self.dsts[i].value = srcs[i], dsts[i]
        self.kernel.launch(stream)
