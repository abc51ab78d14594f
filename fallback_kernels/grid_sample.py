"""grid_sample forward and backward (torch.nn.functional.grid_sample semantics) as CUDA kernels.

cuDNN's graph API has no grid_sample; these kernels (grid_sample_*.cu: one program per algorithm, `PROGRAMS`,
sharing grid_sample_common.cuh; compiled at run time with NVRTC through CuPy, lazily per device, program and
dtype, so a plan compiles only the programs its kernels are in; binaries kept in CuPy's on-disk kernel cache)
cover it:

* `grid_sample(input, grid, *, mode, padding_mode, align_corners)` -> output
* `grid_sample_backward(grad_output, input, grid, *, mode, padding_mode, align_corners,
  input_requires_grad=True, grid_requires_grad=True, deterministic=False)` -> (grad_input, grad_grid)
* `backward_guarantee(deterministic=..., dtype=...)` -> what a backward promises (determinism, accumulator)

Inputs are torch tensors or CuPy arrays (any strides, f16 / bf16 / f32 / f64) on one CUDA device; work is
launched on the framework's current stream and results come back in the inputs' framework. Output and
grad_input take the input's memory format (channels-last input -> channels-last result, else contiguous);
grad_grid is contiguous. Values follow ATen's CUDA kernels (GridSampler.cuh / GridSampler.cu), edge cases
included: unnormalisation, border clipping, reflection, nearest's round-half-to-even, bicubic's A = -0.75
with padding applied per tap, NaN coordinates (out of bounds, or clipped to 0 where ATen clips them).

Backward algorithms (grad_grid is the same in both: each output point reduces its own channels in a fixed
order, in registers and warp shuffles, so it is deterministic either way):

* tile (fast and deterministic, 16- and 32-bit inputs with dense 16-byte-aligned channel planes whose slice
  fits in shared memory, enough blocks to fill the GPU; `_tile_shape`): gs_tile_sort counts, scans and places
  each batch item's (point, weight) entries by destination pixel in shared memory, once for all channels;
  gs_tile_gather stages a slice of grad_output (and input) channels pixel-major, 16 bytes per point, sums
  each pixel's entries in float32 and writes grad_input once, and computes grad_grid per point. No global
  atomics, memsets or transposes. The deterministic backward sorts every segment by (point, weight) first.
* fast (default), elsewhere: grad_input is scattered with atomics into a channels-last accumulator (float32,
  float64 for float64 inputs; vector `red.global.add.v4.f32` on sm_90), then converted / transposed into the
  result when the result is not already a channels-last float32 / float64 tensor. Not bit-reproducible.
* deterministic, float16 / bfloat16 / float32: a counting sort by destination pixel (count with atomics,
  scan, place), which leaves the order within a pixel to chance; each pixel then sums its contributions
  exactly (int64 fixed point, scaled from max |grad_output| and the pixel's contribution count), so the
  order cannot matter, and is written once. No sort. Bit-identical run to run.
* deterministic, float64: one int64 key per (point, tap) = destination pixel, point, tap; keys are unique,
  so the sort (CuPy's thrust sort) fixes one order; then each destination pixel sums its contributions in
  key order in float64 and is written once. Bit-identical run to run.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import math
import numbers
import sys
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from gpu_launch import driver
from gpu_launch.buffers import describe, torch_tensor_type
from gpu_launch.errors import BufferMismatchError, SpecError
from gpu_launch.memo import CallMemo
from gpu_launch.replay import Replay
from gpu_launch.streams import (allocate_like, call_scratch, capture_probe, external_stream, stream_pointer,
                                torch_allocator)

from . import compile as _compile
from .types import CTYPES, DTYPE_OF, ITEMSIZE

MODES = ("bilinear", "nearest", "bicubic")  # order matches the MODE_* enum in grid_sample_common.cuh (and ATen's)
PADDINGS = ("zeros", "border", "reflection")  # order matches PAD_*
BILINEAR, NEAREST, BICUBIC = range(3)
ACC_DTYPE = DTYPE_OF  # a math type's dtype
# struct Geo (grid_sample_common.cuh) and struct Tr (grid_sample_layout.cu), field for field (all int64)
GEO_FIELDS = ("N", "C", "ID", "IH", "IW", "OD", "OH", "OW",
              "in_sN", "in_sC", "in_sD", "in_sH", "in_sW",
              "gr_sN", "gr_sD", "gr_sH", "gr_sW", "gr_sK",
              "go_sN", "go_sC", "go_sD", "go_sH", "go_sW",
              "pad", "align", "lanes_log2", "flags")
TR_FIELDS = ("N", "C", "S", "H", "W", "sN", "sC", "sD", "sH", "sW", "packed")
F_GI, F_GG, F_IN_VEC, F_GO_VEC, F_GI_VEC, F_POINT_FAST, F_PLANE_VEC = 1, 2, 4, 8, 16, 32, 64
VEC = 4  # channels per lane (VEC in grid_sample_common.cuh)
BLOCK = 256
MAX_BLOCKS = 1 << 20  # grid-stride loops take the rest
OPTIONS = _compile.BASE_OPTIONS
INT_MAX = 2**31 - 1
KERNELS = ("gs_forward", "gs_forward_coords", "gs_forward_plane", "gs_backward", "gs_keys", "gs_gather")
TILE_KERNELS = ("gs_tile_sort", "gs_tile_gather")  # <T, ND, MODE>: the shared-memory backward (16/32-bit)
TILE_THREADS = {BILINEAR: 1024, NEAREST: 1024, BICUBIC: 512}  # GS_TILE_THREADS in grid_sample_tile.cu
TILE_CHUNK = 16  # bytes of one point's / pixel's channels in the tile kernels' shared memory
CELL_KERNELS = ("gs_cell_keys", "gs_cell_gather")  # the deterministic backward's one-key-per-point form
POINT_KERNELS = ("gs_forward_cf",)  # <T, A, ND, MODE>, bilinear / nearest: ATen's loop order (_point_kernel)
COUNT_KERNELS = ("gs_count", "gs_gather_exact")  # its counting form (with gs_place<A, ..>, gs_absmax<T>)
SCAN_KERNELS = ("gs_scan_tiles", "gs_scan_sums", "gs_scan_apply")  # its offsets, in launch order
SCAN_THREADS, SCAN_TILE = 256, 256 * 16  # GS_SCAN_THREADS, GS_SCAN_TILE in grid_sample_counting.cu
# The program (kernel source file) of each kernel; each includes grid_sample_common.cuh. grid_sample.cu holds
# them all in one translation unit for tools; plans never compile it.
PROGRAMS = {
    "grid_sample_forward.cu": ("gs_forward", "gs_forward_coords", "gs_forward_plane", *POINT_KERNELS),
    "grid_sample_backward.cu": ("gs_backward",),
    "grid_sample_tile.cu": (*TILE_KERNELS, "gs_gg_sum"),
    "grid_sample_counting.cu": (*COUNT_KERNELS, "gs_place", *SCAN_KERNELS),
    "grid_sample_sorted.cu": ("gs_keys", "gs_bounds", "gs_gather", *CELL_KERNELS),
    "grid_sample_layout.cu": ("gs_to_cl", "gs_from_cl", "gs_absmax"),
}
_PROGRAM_OF = {kernel: program for program, kernels in PROGRAMS.items() for kernel in kernels}
# (spatial dims, mode) pairs that exist: bicubic is 2-D only, as in torch
VARIANTS = tuple((nd, m) for nd in (2, 3) for m in (BILINEAR, NEAREST, BICUBIC) if not (nd == 3 and m == BICUBIC))
# Knobs (tools/bench_grid_sample.py measures the alternatives). go_transpose / input_transpose: the fast
# backward copies a channels-first grad_output / input to channels-last first, or reads it in place
# through its strides (copying grad_output measured slower, reading the input in place much slower on
# random grids). det_keys: the deterministic backward sorts one key per (point, tap) ("tap") or one key
# per point, its cell ("cell", bilinear and nearest only): on an H100 "cell" measured 7-11% slower on f32
# shapes, 2% faster on an f16 one (thrust's sort costs ~95 us almost whatever the key count, and the cell
# gather is slower). "count" (16- and 32-bit inputs; float64 falls back to "tap", its sums need float64):
# no sort at all, a counting sort by destination and exact fixed-point sums, so the order within a
# destination does not matter; the default.
# tile: both backwards of 16- / 32-bit inputs with dense channel planes take the shared-memory kernels
# (gs_tile_sort + gs_tile_gather) where a slice's grad_output (+ input, for grad_grid) fits in a block's
# shared memory and the (batch item, slice) blocks fill at least tile_min_fill of the SMs; else the
# global-atomic kernel. tile_sort_bytes: shared memory of the sort block (counts + staged entries);
# tile_scratch_bytes: the most its entry regions may take before fewer pixel ranges are used.
# options: extra NVRTC options (e.g. "-DGS_BWD_MIN_BLOCKS=2").
# The forward's lanes per output point (a lane computes the point's taps once, then loops over channel
# groups; ATen's kernel is one thread per point looping over every channel): at least fwd_lanes_log2
# (channels-first, channels-last: channels-last needs lanes for coalesced reads), enough that a lane takes
# at most fwd_groups_per_lane groups, more while points x lanes < fwd_threads (tools/probe_grid_sample_forward.py).
# fwd_plane*: channels-first forwards that may stage input planes in shared memory (gs_forward_plane, which the
# device picks over the gather kernel on scattered grids; _plane_shape says where, docs/kernels.md why);
# fwd_plane_threads / fwd_plane_points reach the kernel as GS_PLANE_THREADS / GS_PLANE_POINTS.
# fwd_cf*: channels-first forwards of at least fwd_cf_min_points points in fwd_cf_modes take gs_forward_cf (one
# thread per point over every channel, ATen's loop order, 32-bit offsets) instead of gs_forward's lanes;
# fwd_cf_unroll reaches it as GS_CF_UNROLL (channels an iteration issues where a warp's points are close);
# fwd_cf_blocks_per_sm > 0 caps its grid at that many blocks an SM (grid-stride: fewer warps share an L1);
# fwd_cf_split reaches it as GS_CF_SPLIT (threads sharing a point's channels). Both measured and left off.
TUNING = {"go_transpose": False, "input_transpose": True, "det_keys": "count", "tile": True, "tile_min_fill": 0.5,
          "tile_sort_bytes": 96 * 1024, "tile_scratch_bytes": 64 << 20, "options": (),
          "fwd_threads": 1 << 15, "fwd_groups_per_lane": 8, "fwd_lanes_log2": (0, 5),
          "fwd_plane": True, "fwd_plane_bytes": 48 * 1024, "fwd_plane_fill": 4, "fwd_plane_min_points": 0.25,
          "fwd_plane_min_values": 1 << 23, "fwd_plane_modes": ("bilinear",), "fwd_plane_threads": 256,
          "fwd_plane_points": 4, "fwd_cf": True, "fwd_cf_min_points": 1 << 15,
          "fwd_cf_modes": ("bilinear", "nearest"), "fwd_cf_unroll": 4, "fwd_cf_blocks_per_sm": 0,
          "fwd_cf_split": 1}
# Set to a list to record (op, start event, end event) for every op of every call (tools/bench_grid_sample.py).
PROFILE: list | None = None

_GEO_DTYPE = np.dtype([(f, np.int64) for f in GEO_FIELDS])
_TR_DTYPE = np.dtype([(f, np.int64) for f in TR_FIELDS])


def source() -> str:
    """Every program's text in one translation unit (grid_sample.cu)."""
    return _compile.source("grid_sample.cu")


def program_of(name: str) -> str:
    """The program (kernel source file) that holds kernel instantiation `name`."""
    return _PROGRAM_OF[name.split("<", 1)[0]]


def programs(dtype: str | None = None) -> dict[str, list[str]]:
    """name_expressions(dtype), by the program that holds them."""
    out: dict[str, list[str]] = {}
    for name in name_expressions(dtype):
        out.setdefault(program_of(name), []).append(name)
    return out


def name_expressions(dtype: str | None = None) -> list[str]:
    """Every kernel instantiation (for one io dtype, or all)."""
    names: list[str] = []
    for dt in ([dtype] if dtype else list(CTYPES)):
        t, a = CTYPES[dt]
        for nd, mode in VARIANTS:
            names += [f"{k}<{t}, {a}, {nd}, {mode}>" for k in KERNELS]
            if mode != BICUBIC:
                names += [f"{k}<{t}, {a}, {nd}, {mode}>" for k in CELL_KERNELS + POINT_KERNELS]
            if dt != "float64":
                names += [f"{k}<{t}, {a}, {nd}, {mode}>" for k in COUNT_KERNELS] + [f"gs_place<{a}, {nd}, {mode}>"]
                names += [f"{k}<{t}, {nd}, {mode}>" for k in TILE_KERNELS]
        if dt != "float64":
            names += [f"gs_absmax<{t}>", f"gs_gg_sum<{t}>"]
        names += [f"gs_to_cl<{t}, {t}>", f"gs_from_cl<{t}, {t}>"]
        if a != t:
            names.append(f"gs_from_cl<{a}, {t}>")
        names += ["gs_bounds", *SCAN_KERNELS]
    return list(dict.fromkeys(names))


def backward_guarantee(*, deterministic: bool, dtype: str) -> dict:
    """What grid_sample_backward promises for `dtype` with the chosen algorithm."""
    if dtype not in CTYPES:
        raise SpecError("dtype", dtype, f"expected one of {sorted(CTYPES)}")
    acc = ACC_DTYPE[CTYPES[dtype][1]]
    out = {"deterministic": bool(deterministic), "accumulator": acc, "algorithm": "atomic-scatter",
           "grad_input": f"sums in {acc} in arbitrary order (global atomics, or a shared-memory sort by "
                         f"destination), rounded once to {dtype}",
           "grad_grid": f"per output point, channels reduced in a fixed order in {acc}: deterministic"}
    if deterministic and _counting(dtype):
        out.update(accumulator="int64 fixed point", algorithm="counting-exact-gather",
                   grad_input=(f"each contribution (weight * grad_output in {acc}) rounded to a multiple of 2^-e, "
                               "e = 59 - ceil(log2(n)) - ceil(log2(max |grad_output|)) for an element with n "
                               "contributions (error <= n * 2^-(58 - ceil(log2(n)))) * max |grad_output|), summed "
                               f"exactly (so in no particular order), then rounded to float64 and to {dtype}; "
                               "NaN / inf contributions give NaN / inf as an IEEE sum would"),
                   shared_memory_form=(f"where the tile kernels run (dense channel planes whose 16-byte chunks fit in "
                                       f"shared memory): each element's contributions sorted by (point, weight) and "
                                       f"summed in {acc} in that order, rounded once; also bit-identical run to run"))
    elif deterministic:
        out.update(algorithm="sorted-gather",
                   grad_input=f"each element summed in a fixed order (destination, point, tap) in {acc} and "
                              "rounded once")
    return out


def _counting(dtype: str) -> bool:
    """Whether the deterministic backward of `dtype` is the counting form (float64 sums need float64)."""
    return TUNING["det_keys"] == "count" and dtype != "float64"


# ------------------------------------------------------------------------------------------------------
# Argument checking (no GPU needed)
# ------------------------------------------------------------------------------------------------------
class Geometry(NamedTuple):
    nd: int  # spatial dims: 2 or 3
    N: int
    C: int
    in_sp: tuple[int, int, int]  # (D, H, W); D = 1 for 2-D
    out_sp: tuple[int, int, int]  # (OD, OH, OW); OD = 1 for 2-D
    dtype: str
    mode: int
    pad: int
    align: bool

    @property
    def points(self) -> int:
        return self.out_sp[0] * self.out_sp[1] * self.out_sp[2]

    @property
    def pixels(self) -> int:
        return self.in_sp[0] * self.in_sp[1] * self.in_sp[2]

    def output_shape(self) -> tuple[int, ...]:
        return (self.N, self.C) + self.out_sp[3 - self.nd:]


def check_options(mode: Any, padding_mode: Any, align_corners: Any) -> tuple[int, int, bool]:
    """(mode code, padding code, align_corners) or SpecError naming the bad field."""
    if not isinstance(mode, str) or mode not in MODES:
        raise SpecError("mode", mode, f"expected one of {list(MODES)}")
    if not isinstance(padding_mode, str) or padding_mode not in PADDINGS:
        raise SpecError("padding_mode", padding_mode, f"expected one of {list(PADDINGS)}")
    if not isinstance(align_corners, (bool, np.bool_)):
        raise SpecError("align_corners", align_corners, "expected True or False")
    return MODES.index(mode), PADDINGS.index(padding_mode), bool(align_corners)


def geometry(input_shape, grid_shape, input_dtype: str, grid_dtype: str, *, mode: str = "bilinear",
             padding_mode: str = "zeros", align_corners: bool = False) -> Geometry:
    """Check shapes and dtypes the way torch does (plus 32-bit coordinate limits); no GPU needed."""
    m, pad, align = check_options(mode, padding_mode, align_corners)
    input_shape, grid_shape = _dims("input_shape", input_shape), _dims("grid_shape", grid_shape)
    rank = len(input_shape)
    if rank not in (4, 5):
        raise BufferMismatchError("input", "rank", "4 (N, C, H, W) or 5 (N, C, D, H, W)", rank)
    nd = rank - 2
    if len(grid_shape) != rank:
        raise BufferMismatchError("grid", "rank", f"{rank}, like input", len(grid_shape))
    if grid_shape[-1] != nd:
        raise BufferMismatchError("grid", "last dimension", nd, grid_shape[-1])
    if grid_shape[0] != input_shape[0]:
        raise BufferMismatchError("grid", "batch size", input_shape[0], grid_shape[0])
    if any(d <= 0 for d in input_shape[2:]):
        raise BufferMismatchError("input", "spatial size", "non-empty spatial dimensions", input_shape)
    if any(d < 0 for d in input_shape + grid_shape):
        raise BufferMismatchError("input", "shape", "non-negative sizes", input_shape)
    if m == BICUBIC and nd != 2:
        raise SpecError("mode", mode, "bicubic interpolation supports 4-D input (N, C, H, W) only, like torch")
    if input_dtype not in CTYPES:
        raise BufferMismatchError("input", "dtype", f"one of {sorted(CTYPES)}", input_dtype)
    if grid_dtype != input_dtype:
        raise BufferMismatchError("grid", "dtype", input_dtype, grid_dtype)
    if any(d > INT_MAX for d in input_shape[2:]):
        raise BufferMismatchError("input", "spatial size", f"at most {INT_MAX} per dimension (int coordinates)",
                                  input_shape)
    for role, shape in (("input", input_shape), ("grid", grid_shape)):
        if math.prod(shape) >= 2**62:
            raise BufferMismatchError(role, "size", "fewer than 2**62 elements", math.prod(shape))
    in_sp = ((1,) + input_shape[2:])[-3:]
    out_sp = ((1,) + grid_shape[1:-1])[-3:]
    return Geometry(nd, input_shape[0], input_shape[1], in_sp, out_sp, input_dtype, m, pad, align)


def _dims(field: str, shape: Any) -> tuple[int, ...]:
    """`shape` as ints; SpecError for anything else in it (int("7") would take a string for a size)."""
    dims = tuple(shape)
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, (bool, np.bool_)) for d in dims):
        raise SpecError(field, shape, "expected a shape of integers")
    return tuple(int(d) for d in dims)


def _check_grad_output(geo: Geometry, shape, dtype: str) -> None:
    expected = geo.output_shape()
    if tuple(shape) != expected:
        raise BufferMismatchError("grad_output", "shape", expected, tuple(shape))
    if dtype != geo.dtype:
        raise BufferMismatchError("grad_output", "dtype", geo.dtype, dtype)


def _check_same_place(infos: dict) -> tuple[str, int]:
    first_role, first = next(iter(infos.items()))
    for role, info in infos.items():
        if info.framework == "pointer":
            raise BufferMismatchError(role, "type", "a torch tensor or CuPy array (shape and strides needed)",
                                      "int pointer")
        if info.framework != first.framework:
            raise BufferMismatchError(role, "framework", f"{first.framework}, like {first_role}", info.framework)
        if info.device != first.device:
            raise BufferMismatchError(role, "device", first.device, info.device)
    return first.framework, first.device


# ------------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------------
class _Desc(NamedTuple):
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _cl_strides(shape) -> tuple[int, ...]:
    """Channels-last strides for (N, C, *spatial)."""
    n, c, *sp = shape
    perm = [0, *range(2, len(shape)), 1]  # N, spatial..., C from slowest to fastest
    cs = _contiguous_strides([shape[i] for i in perm])
    strides = [0] * len(shape)
    for i, s in zip(perm, cs):
        strides[i] = s
    return tuple(strides)


def _same_layout(strides, expected, shape) -> bool:
    return strides is not None and all(s == e or d == 1 for s, e, d in zip(strides, expected, shape))


def _vec_ok(ptr: int, strides, shape, itemsize: int) -> bool:
    """VEC consecutive channels load as one vector at every position: unit channel stride, aligned."""
    if strides[1] != 1 and shape[1] != 1:
        return False
    others = [s for i, (s, d) in enumerate(zip(strides, shape)) if i != 1 and d != 1]
    return ptr % (VEC * itemsize) == 0 and all(s % VEC == 0 for s in others) and shape[1] % VEC == 0


def _spatial5(strides, nd: int) -> tuple[int, int, int]:
    """(sD, sH, sW) of an (N, C, *spatial) tensor; sD = 0 in 2-D."""
    sp = tuple(strides[2:])
    return (0,) + sp if nd == 2 else sp


def _lanes_log2(c: int) -> int:
    groups = max(1, -(-c // VEC))
    return min(5, (groups - 1).bit_length())


def _blocks(threads: int) -> int:
    return max(1, min(-(-threads // BLOCK), MAX_BLOCKS))


def _taps(geo: Geometry) -> int:
    return 1 if geo.mode == NEAREST else 16 if geo.mode == BICUBIC else 1 << geo.nd


def _nc5(strides, nd: int) -> tuple[int, ...]:
    """(sN, sC, sD, sH, sW) of an (N, C, *spatial) tensor."""
    return (strides[0], strides[1]) + _spatial5(strides, nd)


def _grid5(strides, nd: int) -> tuple[int, ...]:
    """(sN, sD, sH, sW, sK) of an (N, *out spatial, nd) grid."""
    sp = tuple(strides[1:-1])
    return (strides[0],) + ((0,) + sp if nd == 2 else sp) + (strides[-1],)


def _geo_struct(geo: Geometry, *, inp=(0,) * 5, grid=(0,) * 5, go=(0,) * 5, lanes_log2=0, flags=0) -> np.ndarray:
    values = (geo.N, geo.C, *geo.in_sp, *geo.out_sp, *inp, *grid, *go, geo.pad, int(geo.align), lanes_log2, flags)
    return np.array([tuple(int(v) for v in values)], dtype=_GEO_DTYPE)  # CuPy passes its bytes as the struct


# ------------------------------------------------------------------------------------------------------
# Plans: what one call launches, built once per (shapes, strides, dtype, options, alignment) and replayed
# with the call's pointers, so the Python work per call is a few allocations and launches.
# ------------------------------------------------------------------------------------------------------
class _Ref(int):
    """A buffer named in a plan, plus a byte offset into it; its int value is the address modulo 256 (all a
    plan may depend on)."""

    def __new__(cls, name: str, residue: int = 0, offset: int = 0):
        obj = int.__new__(cls, residue % 256)
        obj.name, obj.offset = name, offset
        return obj


def _at(ref: _Ref, nbytes: int) -> _Ref:
    """`nbytes` into the buffer of `ref`."""
    return _Ref(ref.name, int(ref) + nbytes, ref.offset + nbytes)


class _Plan(NamedTuple):
    geo: Geometry
    inputs: tuple  # the roles of the call's buffers, in the order their addresses come
    outputs: dict  # role -> _Desc of the results to allocate
    scratch: tuple  # (name, offset) in one scratch allocation
    scratch_bytes: int
    ops: tuple  # ("zero", ref, nbytes) | ("launch", function, grid, block, args, name, shared bytes) | ("sort", ref, n)


def variant_of(name: str) -> tuple[int, int] | None:
    """(nd, mode) of a kernel instantiation whose last two template arguments are those; None for the ones
    every variant shares (layout copies, scans, absmax)."""
    args = name[name.index("<") + 1:-1].split(", ") if "<" in name else []
    return (int(args[-2]), int(args[-1])) if len(args) >= 3 and args[-1].isdigit() and args[-2].isdigit() else None


@functools.lru_cache(maxsize=None)
def _functions(device: int, program: str, dtype: str, options: tuple[str, ...], variant: tuple | None) -> dict:
    """The kernels of one program for one (device, dtype, (nd, mode) variant or the shared ones), compiled on
    first use (CuPy keeps the binary on disk): a call compiles the variant it runs, a fifth of the program."""
    names = tuple(n for n in programs(dtype)[program] if variant_of(n) == variant)
    module = _compile.load_module(program, names, device, options)
    return {name: module.get_function(name) for name in names}


class _Builder:
    def __init__(self, device: int, dtype: str):
        self.device, self.dtype = device, dtype
        self.scratch: list[tuple[str, int]] = []
        self.ops: list[tuple] = []

    def buffer(self, nbytes: int) -> _Ref:
        name = f"scratch{len(self.scratch)}"
        self.scratch.append((name, int(nbytes)))
        return _Ref(name)

    def zero(self, ref: _Ref, nbytes: int) -> None:
        if nbytes:
            self.ops.append(("zero", ref, int(nbytes)))

    def launch(self, name: str, grid, block, args, shared: int = 0) -> None:
        fn = _functions(self.device, program_of(name), self.dtype, _options(), variant_of(name))[name]
        _allow_shared(fn, self.device, shared)
        self.ops.append(("launch", fn, tuple(grid), tuple(block), tuple(args), name, int(shared)))

    def sort(self, ref: _Ref, n: int) -> None:
        self.ops.append(("sort", ref, int(n)))

    def scan(self, src: _Ref, dst: _Ref, n: int) -> None:
        """dst[1 + i] = src[0] + ... + src[i] over n int64 (dst[0] is the caller's)."""
        if n == 0:
            return
        tiles = -(-n // SCAN_TILE)
        sums = self.buffer(tiles * 8)
        first, middle, last = SCAN_KERNELS
        self.launch(first, (tiles,), (SCAN_THREADS,), (src, sums, np.int64(n)))
        self.launch(middle, (1,), (1024,), (sums, np.int64(tiles)))
        self.launch(last, (tiles,), (SCAN_THREADS,), (src, _at(dst, 8), sums, np.int64(n)))

    def transpose(self, kernel: str, src_t: str, dst_t: str, src: _Ref, dst: _Ref, n: int, c: int,
                  sp: tuple[int, int, int], strides, nd: int, amax: _Ref | None = None) -> None:
        """gs_to_cl: strided (n, c, *sp) -> channels-last contiguous (`amax`: also max |finite value| there, as
        double bits); gs_from_cl: the other way."""
        D, H, W = sp
        s = D * H * W
        sD, sH, sW = _spatial5(strides, nd)
        packed = all(st == e or d == 1 for st, e, d in zip((sD, sH, sW), (H * W, W, 1), (D, H, W)))
        tr = np.array([(n, c, s, H, W, strides[0], strides[1], sD, sH, sW, int(packed))], dtype=_TR_DTYPE)
        grid = (-(-s // 32), min(-(-c // 32), 65535), min(n, 65535))
        args = (src, dst, tr, amax) if kernel == "gs_to_cl" else (src, dst, tr)
        self.launch(f"{kernel}<{src_t}, {dst_t}>", grid, (32, 8), args)

    def plan(self, geo: Geometry, inputs: tuple, outputs: dict) -> _Plan:
        offsets, total = [], 0
        for name, nbytes in self.scratch:
            offsets.append((name, total))
            total += -(-max(nbytes, 1) // 256) * 256
        return _Plan(geo, inputs, outputs, tuple(offsets), total, tuple(self.ops))


def _options() -> tuple[str, ...]:
    """NVRTC options of every program: the forward's plane knobs as macros, then TUNING's own."""
    plane = (f"-DGS_PLANE_THREADS={int(TUNING['fwd_plane_threads'])}",
             f"-DGS_PLANE_POINTS={int(TUNING['fwd_plane_points'])}", f"-DGS_CF_UNROLL={int(TUNING['fwd_cf_unroll'])}",
             f"-DGS_CF_SPLIT={int(TUNING['fwd_cf_split'])}")
    return OPTIONS + plane + tuple(TUNING.get("options", ()))


@functools.lru_cache(maxsize=None)
def _device_limits(device: int) -> tuple[int, int]:
    """(opt-in shared memory bytes per block, multiprocessors) of `device`."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return int(props["sharedMemPerBlockOptin"]), int(props["multiProcessorCount"])


def _allow_shared(fn: Any, device: int, nbytes: int) -> None:
    """Let `fn` launch with `nbytes` of dynamic shared memory (above 48 KiB a kernel must opt in)."""
    import cupy

    if nbytes > 48 * 1024 and isinstance(fn, cupy.RawKernel):
        with cupy.cuda.Device(device):
            if fn.max_dynamic_shared_size_bytes < nbytes:
                fn.max_dynamic_shared_size_bytes = nbytes


def _run(plan: _Plan, framework: str, device: int, ptrs: tuple, stream: int | None = None) -> None:
    """Run `plan` on `ptrs` (its inputs' and outputs' addresses) and the stream's scratch block (this
    call's own under capture), on `stream` (default: the framework's current one)."""
    if stream is None:
        stream = stream_pointer(None, framework, device)
    prog = _program(plan, device)
    if _single_launch(plan) and PROFILE is None:  # needs no capture probe (~1 us) nor scratch
        return prog.run(ptrs, stream)
    capturing = capture_probe(framework, None)(stream)
    owner = None
    if plan.scratch_bytes:
        owner, base = call_scratch(plan.scratch_bytes, framework, device, stream, capturing=capturing)
        ptrs += (base,)
    if PROFILE is not None:
        _run_profiled(plan, prog, ptrs, stream, device)
    elif prog.replay is not None:
        prog.replay(ptrs, stream, capturing)
    else:
        prog.run(ptrs, stream)
    del owner  # back to its stream-ordered allocator: later work on this stream may reuse it


def _single_launch(plan: _Plan) -> bool:
    """One launch and no scratch (the forward): nothing for a graph to merge, nothing to allocate."""
    return not plan.scratch_bytes and len(plan.ops) == 1 and plan.ops[0][0] == "launch"


class _Program:
    """A plan's ops ready to run on this thread: launches packed once (patch the pointers, launch), the
    addresses by role index (inputs, outputs, then the scratch block). A plan of two or more ops, all our
    launches and memsets, is also a `Replay`: one re-pointed CUDA graph once recorded."""

    __slots__ = ("steps", "replay")

    def __init__(self, plan: _Plan, device: int):
        roles = {name: (i, 0) for i, name in enumerate(plan.inputs + tuple(plan.outputs))}
        roles.update({name: (len(roles), offset) for name, offset in plan.scratch})
        self.steps = tuple(_step(op, device, roles) for op in plan.ops)
        graphable = len(plan.ops) > 1 and all(op[0] in ("launch", "zero") for op in plan.ops)
        label = "grid_sample " + "+".join(op[5] if op[0] == "launch" else op[0] for op in plan.ops)
        self.replay = Replay(self.run, ordinal=device, label=label) if graphable else None

    def run(self, ptrs: tuple, stream: int) -> None:
        for step in self.steps:
            step(ptrs, stream)


_programs = threading.local()


def _program(plan: _Plan, device: int) -> _Program:
    """The plan's _Program on this thread (packing per call would cost microseconds an op)."""
    held = getattr(_programs, "held", None)
    if held is None:
        held = _programs.held = {}
    hit = held.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    prog = _Program(plan, device)
    if len(held) >= 512:  # plans evicted from their lru_cache leave stale entries: start over
        held.clear()
    held[id(plan)] = (plan, prog)
    return prog


def _step(op: tuple, device: int, roles: dict) -> Callable[[tuple, int], None]:
    """One op as `step(ptrs, stream)`; `roles`: buffer name -> (index in ptrs, byte offset)."""
    if op[0] == "zero":
        (index, base), offset, nbytes = roles[op[1].name], op[1].offset, op[2]
        return lambda ptrs, stream: driver.memset_async(ptrs[index] + base + offset, nbytes, stream)
    if op[0] == "sort":
        (index, base), offset, n = roles[op[1].name], op[1].offset, op[2]
        return lambda ptrs, stream: _sort_int64(ptrs[index] + base + offset, n, device, stream)
    _, fn, grid, block, args, _name, shared = op
    values, patches = [], []
    for a in args:
        value = _c_arg(a)
        if isinstance(a, _Ref):
            index, base = roles[a.name]
            patches.append((value, index, base + a.offset))
        values.append(value)
    kernel = driver.Kernel(_compile.cufunction(fn, device), grid=grid, block=block, args=values, ordinal=device,
                           shared=shared)
    patches = tuple(patches)

    def launch(ptrs: tuple, stream: int) -> None:
        for value, index, offset in patches:
            value.value = ptrs[index] + offset
        kernel.launch(stream)

    return launch


def _c_arg(a: Any) -> Any:
    """A kernel argument as the ctypes value the launch points at."""
    if a is None or isinstance(a, _Ref):
        return ctypes.c_uint64(0)
    if isinstance(a, np.ndarray):  # struct Geo / Tr: int64 fields, passed by value
        assert a.dtype.itemsize % 8 == 0 and a.size == 1, a.dtype
        return (ctypes.c_int64 * (a.dtype.itemsize // 8)).from_buffer_copy(a.tobytes())
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    raise TypeError(f"kernel argument of type {type(a).__name__}")


def _sort_int64(ptr: int, n: int, device: int, stream: int) -> None:
    """Sort n int64 keys at `ptr` in place with CuPy's thrust sort, on (and with memory of) the launch stream."""
    import cupy

    with cupy.cuda.Device(device), external_stream(stream):
        memory = cupy.cuda.UnownedMemory(ptr, n * 8, None, device_id=device)
        cupy.ndarray((n,), dtype=np.int64, memptr=cupy.cuda.MemoryPointer(memory, 0)).sort()


def _run_profiled(plan: _Plan, prog: _Program, ptrs: tuple, stream: int, device: int) -> None:
    """The plan run directly with a pair of CUDA events around each op, appended to PROFILE
    (tools/bench_grid_sample.py)."""
    import cupy

    cupy_stream = external_stream(stream)
    with cupy.cuda.Device(device):
        for op, step in zip(plan.ops, prog.steps):
            start = cupy.cuda.Event()
            start.record(cupy_stream)
            step(ptrs, stream)
            end = cupy.cuda.Event()
            end.record(cupy_stream)
            PROFILE.append((op[5] if op[0] == "launch" else f"{op[0]}({op[2]})", start, end))


def _key(info) -> tuple:
    return (info.shape, info.strides, info.dtype, info.ptr % 256)


@functools.lru_cache(maxsize=256)
def _forward_plan(device: int, inp_key: tuple, grid_key: tuple, mode: str, padding_mode: str,
                  align_corners: bool, tuning: tuple) -> _Plan:
    in_shape, in_strides, in_dtype, in_res = inp_key
    gr_shape, gr_strides, gr_dtype, gr_res = grid_key
    geo = geometry(in_shape, gr_shape, in_dtype, gr_dtype, mode=mode, padding_mode=padding_mode,
                   align_corners=align_corners)
    out = _Desc(geo.output_shape(), _format_strides(in_shape, in_strides, geo.output_shape()), geo.dtype)
    b = _Builder(device, geo.dtype)
    if math.prod(out.shape):
        t, a = CTYPES[geo.dtype]
        item = ITEMSIZE[geo.dtype]
        flags = 0
        if _vec_ok(in_res, in_strides, in_shape, item):
            flags |= F_IN_VEC
        if _vec_ok(0, out.strides, out.shape, item):
            flags |= F_GO_VEC
        channels_last = out.strides[1] == 1
        if not channels_last:
            flags |= F_POINT_FAST
        dense_out = _dense_aligned(0, out.strides, out.shape, 1)
        ps = _plane_shape(geo, in_strides, in_res, device) if dense_out and not channels_last else None
        io = (_Ref("input", in_res), _Ref("grid", gr_res), _Ref("output"))
        variant = f"<{t}, {a}, {geo.nd}, {geo.mode}>"
        scattered = None  # the gather kernel alone: it always runs
        strides = dict(inp=_nc5(in_strides, geo.nd), grid=_grid5(gr_strides, geo.nd), go=_nc5(out.strides, geo.nd))
        if ps is not None:  # both kernels, after the coordinates' pass that picks one of them on the device
            scattered = b.buffer(8)
            b.zero(scattered, 8)
            g = _geo_struct(geo, **strides, flags=flags | (F_PLANE_VEC if ps.vec else 0))
            coords = b.buffer(geo.N * geo.points * geo.nd * ITEMSIZE[ACC_DTYPE[a]])
            b.launch(f"gs_forward_coords{variant}", (_blocks(geo.N * geo.points),), (BLOCK,), (io[1], coords, g, scattered))
            b.launch(f"gs_forward_plane{variant}", (ps.blocks,), (int(TUNING["fwd_plane_threads"]),),
                     (io[0], coords, io[2], g, np.int32(ps.cpb), np.int32(ps.splits), scattered), shared=ps.shared)
        if not channels_last and ps is None and _point_kernel(geo, in_strides):
            g = _geo_struct(geo, **strides, flags=flags)
            blocks = _blocks(geo.N * geo.points * int(TUNING["fwd_cf_split"]))
            per_sm = int(TUNING["fwd_cf_blocks_per_sm"])
            if per_sm > 0:
                blocks = min(blocks, per_sm * _device_limits(device)[1])
            b.launch(f"gs_forward_cf{variant}", (blocks,), (BLOCK,), io + (g, scattered))
        else:
            lanes_log2 = _forward_lanes_log2(geo, channels_last=channels_last)
            g = _geo_struct(geo, **strides, lanes_log2=lanes_log2, flags=flags)
            threads = geo.N * geo.points * min(1 << lanes_log2, -(-geo.C // VEC))
            b.launch(f"gs_forward{variant}", (_blocks(threads),), (BLOCK,), io + (g, scattered))
    return b.plan(geo, FORWARD_INPUTS, {"output": out})


class _PlaneShape(NamedTuple):
    cpb: int  # channels a block
    splits: int  # point ranges a (batch item, channel group)
    blocks: int
    shared: int  # bytes: cpb planes, each rounded up to 16
    vec: bool  # planes copied in 16-byte chunks (F_PLANE_VEC)


def _plane_shape(geo: Geometry, in_strides, in_res: int, device: int) -> _PlaneShape | None:
    """How gs_forward_plane runs a channels-first forward, or None where the gather kernel alone does: modes
    outside fwd_plane_modes (nearest's and bicubic's gathers were as fast on scattered grids), outputs of fewer
    than fwd_plane_min_values values (the coordinates' pass and the kernel that exits cost ~6 us, more than
    scattered reads cost there), a plane above the device's shared memory per block, or fewer points than
    fwd_plane_min_points of a plane's pixels (the gather then reads less than whole planes). A block takes as
    many planes as fit fwd_plane_bytes (at least one); the points split while blocks number fewer than
    fwd_plane_fill per SM, a range at least a block's threads' worth."""
    if not TUNING["fwd_plane"] or MODES[geo.mode] not in TUNING["fwd_plane_modes"]:
        return None
    if geo.points < TUNING["fwd_plane_min_points"] * geo.pixels or geo.N * geo.C * geo.points < TUNING["fwd_plane_min_values"]:
        return None
    item = ITEMSIZE[geo.dtype]
    plane = -(-geo.pixels * item // 16) * 16
    limit, sms = _device_limits(device)
    if plane > limit:
        return None
    cpb = max(1, min(geo.C, int(TUNING["fwd_plane_bytes"]) // plane))
    groups = geo.N * -(-geo.C // cpb)
    splits = max(1, min(-(-int(TUNING["fwd_plane_fill"] * sms) // groups), geo.points // int(TUNING["fwd_plane_threads"])))
    if groups * splits > INT_MAX:
        return None
    values = 16 // item
    vec = geo.pixels % values == 0 and _dense_aligned(in_res, in_strides, _in_shape(geo), values)
    return _PlaneShape(cpb, splits, groups * splits, cpb * plane, vec)


def _point_kernel(geo: Geometry, in_strides) -> bool:
    """Whether a channels-first forward takes gs_forward_cf: TUNING's modes and enough points that one thread
    each fills the GPU (fewer, and lanes over channel groups are needed), with a batch item's tap offsets, the
    channel stride and the point count all within 32 bits."""
    if not TUNING["fwd_cf"] or MODES[geo.mode] not in TUNING["fwd_cf_modes"]:
        return False
    spatial = [(size - 1) * stride for size, stride in zip(_in_shape(geo)[2:], in_strides[2:])]
    points = geo.N * geo.points
    return (int(TUNING["fwd_cf_min_points"]) <= points and points * int(TUNING["fwd_cf_split"]) <= INT_MAX
            and sum(spatial) <= INT_MAX and in_strides[1] <= INT_MAX)


def _forward_lanes_log2(geo: Geometry, *, channels_last: bool) -> int:
    """log2 of the forward's lanes per output point: at least TUNING's fewest for the layout and enough
    that a lane takes at most fwd_groups_per_lane groups of VEC channels, more while points x lanes
    make fewer than fwd_threads threads, never more than one lane per group."""
    groups = max(1, -(-geo.C // VEC))
    fewest = int(TUNING["fwd_lanes_log2"][1 if channels_last else 0])
    per_lane = (-(-groups // int(TUNING["fwd_groups_per_lane"])) - 1).bit_length()
    to_fill = (max(1, -(-int(TUNING["fwd_threads"]) // max(1, geo.N * geo.points))) - 1).bit_length()
    return min((groups - 1).bit_length(), max(fewest, per_lane, to_fill))


@functools.lru_cache(maxsize=256)
def _backward_plan(device: int, go_key: tuple, inp_key: tuple, grid_key: tuple, mode: str, padding_mode: str,
                   align_corners: bool, need_gi: bool, need_gg: bool, deterministic: bool,
                   tuning: tuple) -> _Plan:
    in_shape, in_strides, in_dtype, in_res = inp_key
    gr_shape, gr_strides, gr_dtype, gr_res = grid_key
    geo = geometry(in_shape, gr_shape, in_dtype, gr_dtype, mode=mode, padding_mode=padding_mode,
                   align_corners=align_corners)
    _check_grad_output(geo, go_key[0], go_key[2])
    outputs = {}
    if need_gi:
        outputs["grad_input"] = _Desc(in_shape, _format_strides(in_shape, in_strides, in_shape), geo.dtype)
    if need_gg:
        outputs["grad_grid"] = _Desc(gr_shape, _contiguous_strides(gr_shape), geo.dtype)
    b = _Builder(device, geo.dtype)
    bufs = _Bufs(go=_Tensor(_Ref("grad_output", go_key[3]), go_key[1]),
                 inp=_Tensor(_Ref("input", in_res), in_strides), grid=_Tensor(_Ref("grid", gr_res), gr_strides),
                 gi=_Tensor(_Ref("grad_input"), outputs["grad_input"].strides) if need_gi else None,
                 gg=_Tensor(_Ref("grad_grid"), outputs["grad_grid"].strides) if need_gg else None)
    if geo.N * geo.C * geo.points == 0:  # nothing flows back: zeros, no kernel
        item = ITEMSIZE[geo.dtype]
        if need_gi:
            b.zero(bufs.gi.ref, math.prod(in_shape) * item)
        if need_gg:
            b.zero(bufs.gg.ref, math.prod(gr_shape) * item)
    elif deterministic:
        _backward_deterministic(b, geo, bufs)
    else:
        _backward_fast(b, geo, bufs)
    return b.plan(geo, BACKWARD_INPUTS, outputs)


class _Tensor(NamedTuple):
    ref: _Ref
    strides: tuple


class _Bufs(NamedTuple):
    go: _Tensor
    inp: _Tensor
    grid: _Tensor
    gi: _Tensor | None
    gg: _Tensor | None


def _format_strides(shape, strides, out_shape) -> tuple[int, ...]:
    """Strides for `out_shape` in the memory format of a tensor with (shape, strides): channels-last when
    it is channels-last (and not also contiguous), else contiguous."""
    if _same_layout(strides, _cl_strides(shape), shape) and not _same_layout(strides, _contiguous_strides(shape),
                                                                             shape):
        return _cl_strides(out_shape)
    return _contiguous_strides(out_shape)


def _is_cl_layout(shape, strides) -> bool:
    return _same_layout(strides, _cl_strides(shape), shape)


def _in_shape(geo: Geometry) -> tuple[int, ...]:
    return (geo.N, geo.C) + geo.in_sp[3 - geo.nd:]


def _input_for_grid_grad(b: _Builder, geo: Geometry, inp: _Tensor) -> _Tensor:
    """The input to read corner values from: as given, or a channels-last copy (TUNING)."""
    shape = _in_shape(geo)
    if _is_cl_layout(shape, inp.strides) or not TUNING["input_transpose"]:
        return inp
    t = CTYPES[geo.dtype][0]
    ref = b.buffer(geo.N * geo.C * geo.pixels * ITEMSIZE[geo.dtype])
    b.transpose("gs_to_cl", t, t, inp.ref, ref, geo.N, geo.C, geo.in_sp, inp.strides, geo.nd)
    return _Tensor(ref, _cl_strides(shape))


def _go_cl(b: _Builder, geo: Geometry, go: _Tensor, amax: _Ref | None = None) -> _Tensor:
    """grad_output in channels-last contiguous layout (copied if it is not); `amax`: max |grad_output| there."""
    shape = geo.output_shape()
    t = CTYPES[geo.dtype][0]
    if _is_cl_layout(shape, go.strides):
        if amax is not None:
            elements = geo.N * geo.C * geo.points
            b.launch(f"gs_absmax<{t}>", (min(_blocks(elements), 1024),), (BLOCK,), (go.ref, np.int64(elements), amax))
        return go
    ref = b.buffer(geo.N * geo.C * geo.points * ITEMSIZE[geo.dtype])
    b.transpose("gs_to_cl", t, t, go.ref, ref, geo.N, geo.C, geo.out_sp, go.strides, geo.nd, amax=amax)
    return _Tensor(ref, _cl_strides(shape))


def _backward_launch(b: _Builder, geo: Geometry, go: _Tensor, inp: _Tensor | None, grid: _Tensor,
                     gi: _Ref | None, gg: _Ref | None, flags: int) -> None:
    t, a = CTYPES[geo.dtype]
    item = ITEMSIZE[geo.dtype]
    if _vec_ok(go.ref, go.strides, geo.output_shape(), item):
        flags |= F_GO_VEC
    if inp is not None and _vec_ok(inp.ref, inp.strides, _in_shape(geo), item):
        flags |= F_IN_VEC
    if geo.C % VEC == 0:
        flags |= F_GI_VEC  # the accumulator is channels-last contiguous and 256-byte aligned
    lg = _lanes_log2(geo.C)
    g = _geo_struct(geo, inp=_nc5(inp.strides, geo.nd) if inp is not None else (0,) * 5,
                    grid=_grid5(grid.strides, geo.nd), go=_nc5(go.strides, geo.nd), lanes_log2=lg, flags=flags)
    threads = (geo.N * geo.points) << lg
    b.launch(f"gs_backward<{t}, {a}, {geo.nd}, {geo.mode}>", (_blocks(threads),), (BLOCK,),
             (go.ref, inp.ref if inp is not None else None, grid.ref, gi, gg, g))


class _TileShape(NamedTuple):
    slices: int  # channel slices of 16 bytes per pixel (the gather's blocks per batch item)
    ranges: int  # pixel ranges sorted apart (the sort's blocks per batch item)
    range_pixels: int
    staged: int  # entries a sort block stages in shared memory before writing them out
    sort_shared: int
    gather_shared: int
    stage_input: bool  # grad_grid reads the input's corner values (not for nearest)


def _planes_dense(t: _Tensor, shape, values: int) -> bool:
    """Every channel plane of `t` (N, C, *spatial) is dense and starts on a `values`-element (16-byte) boundary."""
    return _dense_aligned(int(t.ref), t.strides, shape, values)


def _dense_aligned(residue: int, strides, shape, values: int) -> bool:
    """_planes_dense of a buffer at `residue` (its address mod 256) with `strides`."""
    dense = _contiguous_strides(shape)[2:]
    if any(st != e and d != 1 for st, e, d in zip(strides[2:], dense, shape[2:])):
        return False
    return residue % TILE_CHUNK == 0 and all(st % values == 0 for st, d in zip(strides[:2], shape[:2]) if d > 1)


def _round8(chunks: int) -> int:
    return -(-chunks // 8) * 8  # chunk_at() in grid_sample_tile.cu permutes chunks within groups of 8


def _tile_shape(geo: Geometry, bufs: _Bufs, device: int) -> _TileShape | None:
    """How the shared-memory fast backward runs this call, or None where the global-atomic kernel does."""
    if not TUNING["tile"] or bufs.gi is None or geo.dtype == "float64":
        return None
    values = TILE_CHUNK // ITEMSIZE[geo.dtype]
    stage = bufs.gg is not None and geo.mode != NEAREST
    if geo.points % values or geo.pixels % values or not _planes_dense(bufs.go, geo.output_shape(), values):
        return None
    in_shape = _in_shape(geo)
    if not _planes_dense(bufs.gi, in_shape, values) or (stage and not _planes_dense(bufs.inp, in_shape, values)):
        return None
    limit, sms = _device_limits(device)
    gather_shared = TILE_CHUNK * (_round8(geo.points) + (_round8(geo.pixels) if stage else 0))
    slices = -(-geo.C // values)
    if gather_shared > limit or geo.N * slices < TUNING["tile_min_fill"] * sms:
        return None
    entries_per_range = geo.N * _taps(geo) * geo.points * 8
    ranges = max(1, min(sms // min(geo.N, 65535), geo.pixels // 512,
                        TUNING["tile_scratch_bytes"] // entries_per_range))
    range_pixels = -(-geo.pixels // ranges)
    ranges = -(-geo.pixels // range_pixels)
    counts = -(-range_pixels // 32) * 32 * 4
    if counts > limit:
        return None
    staged = max(0, min(_taps(geo) * geo.points, (min(limit, TUNING["tile_sort_bytes"]) - counts) // 8))
    return _TileShape(slices, ranges, range_pixels, staged, counts + staged * 8, gather_shared, stage)


def _backward_tile(b: _Builder, geo: Geometry, bufs: _Bufs, ts: _TileShape, *, ordered: bool) -> None:
    """grad_input (and grad_grid) by the tile kernels; `ordered`: segments sorted, bit-identical run to run."""
    t = CTYPES[geo.dtype][0]
    variant = f"<{t}, {geo.nd}, {geo.mode}>"
    threads, n_blocks = (TILE_THREADS[geo.mode],), min(geo.N, 65535)
    entries = b.buffer(geo.N * ts.ranges * _taps(geo) * geo.points * 8)
    ends = b.buffer(geo.N * geo.pixels * 4)
    g = _geo_struct(geo, inp=_nc5(bufs.inp.strides, geo.nd), grid=_grid5(bufs.grid.strides, geo.nd),
                    go=_nc5(bufs.go.strides, geo.nd))
    b.launch("gs_tile_sort" + variant, (ts.ranges, n_blocks), threads,
             (bufs.grid.ref, entries, ends, g, np.int32(ts.range_pixels), np.int32(ts.staged), np.int32(ordered)),
             shared=ts.sort_shared)
    gg = partials = None
    if bufs.gg is not None and geo.mode == NEAREST:  # nearest: grad_grid is 0
        b.zero(bufs.gg.ref, geo.N * geo.points * geo.nd * ITEMSIZE[geo.dtype])
    elif bufs.gg is not None and ts.slices == 1:
        gg = bufs.gg.ref
    elif bufs.gg is not None:
        partials = b.buffer(ts.slices * geo.N * geo.points * geo.nd * 4)
    b.launch("gs_tile_gather" + variant, (ts.slices, n_blocks), threads,
             (bufs.go.ref, bufs.inp.ref if ts.stage_input else None, bufs.grid.ref, entries, ends, bufs.gi.ref, gg,
              partials, g, np.int64(bufs.gi.strides[0]), np.int64(bufs.gi.strides[1]), np.int32(ts.range_pixels)),
             shared=ts.gather_shared)
    if partials is not None:
        count = geo.N * geo.points * geo.nd
        b.launch(f"gs_gg_sum<{t}>", (_blocks(count),), (BLOCK,), (partials, bufs.gg.ref, np.int64(count),
                                                                   np.int32(ts.slices)))


def _backward_fast(b: _Builder, geo: Geometry, bufs: _Bufs) -> None:
    ts = _tile_shape(geo, bufs, b.device)
    if ts is not None:
        return _backward_tile(b, geo, bufs, ts, ordered=False)
    t, a = CTYPES[geo.dtype]
    acc_bytes = geo.N * geo.C * geo.pixels * ITEMSIZE[ACC_DTYPE[a]]
    flags, acc, direct = 0, None, False
    if bufs.gi is not None:
        flags |= F_GI
        direct = t == a and _is_cl_layout(_in_shape(geo), bufs.gi.strides)  # f32 / f64 channels-last: in place
        acc = bufs.gi.ref if direct else b.buffer(acc_bytes)
        b.zero(acc, acc_bytes)
    inp = None
    if bufs.gg is not None:
        flags |= F_GG
        if geo.mode != NEAREST:
            inp = _input_for_grid_grad(b, geo, bufs.inp)
    go = _go_cl(b, geo, bufs.go) if TUNING["go_transpose"] else bufs.go
    _backward_launch(b, geo, go, inp, bufs.grid, acc, bufs.gg.ref if bufs.gg is not None else None, flags)
    if bufs.gi is not None and not direct:
        b.transpose("gs_from_cl", a, t, acc, bufs.gi.ref, geo.N, geo.C, geo.in_sp, bufs.gi.strides, geo.nd)


def _backward_counting(b: _Builder, geo: Geometry, bufs: _Bufs) -> _Tensor:
    """grad_input by counting sort + exact sums (16- and 32-bit); returns the channels-last grad_output."""
    t, a = CTYPES[geo.dtype]
    acc_item = ITEMSIZE[ACC_DTYPE[a]]
    npts, npix, k = geo.N * geo.points, geo.N * geo.pixels, _taps(geo)
    # One zeroed span: max |grad_output| (256 bytes), the counts, offsets[0] (offsets[1:] come from the scan).
    counts_at = 256 + -(-npix * 8 // 256) * 256
    meta = b.buffer(counts_at + (npix + 1) * 8)
    b.zero(meta, counts_at + 8)
    go_max, counts, offsets = meta, _at(meta, 256), _at(meta, counts_at)
    go = _go_cl(b, geo, bufs.go, amax=go_max)
    coords = b.buffer(npts * geo.nd * acc_item)
    variant = f"<{t}, {a}, {geo.nd}, {geo.mode}>"
    g = _geo_struct(geo, grid=_grid5(bufs.grid.strides, geo.nd))
    b.launch("gs_count" + variant, (_blocks(npts),), (BLOCK,), (bufs.grid.ref, coords, counts, g))
    b.scan(counts, offsets, npix)
    entries = b.buffer(npts * k * 8)
    b.launch(f"gs_place<{a}, {geo.nd}, {geo.mode}>", (_blocks(npts),), (BLOCK,), (coords, offsets, counts, entries, g))
    _gather(b, geo, bufs, go, "gs_gather_exact" + variant, (entries, offsets, coords), (go_max,))
    return go


def _gather(b: _Builder, geo: Geometry, bufs: _Bufs, go: _Tensor, kernel: str, head: tuple, tail: tuple = ()) -> None:
    """A gather kernel (a lane group per destination pixel) writing grad_input, through a transpose if needed."""
    t, item = CTYPES[geo.dtype][0], ITEMSIZE[geo.dtype]
    direct = _is_cl_layout(_in_shape(geo), bufs.gi.strides)
    target = bufs.gi.ref if direct else b.buffer(geo.N * geo.pixels * geo.C * item)
    flags = F_GI_VEC if geo.C % VEC == 0 else 0
    if _vec_ok(go.ref, go.strides, geo.output_shape(), item):
        flags |= F_GO_VEC
    lg = _lanes_log2(geo.C)
    b.launch(kernel, (_blocks((geo.N * geo.pixels) << lg),), (BLOCK,),
             head + (go.ref, target, _geo_struct(geo, lanes_log2=lg, flags=flags)) + tail)
    if not direct:
        b.transpose("gs_from_cl", t, t, target, bufs.gi.ref, geo.N, geo.C, geo.in_sp, bufs.gi.strides, geo.nd)


def _backward_deterministic(b: _Builder, geo: Geometry, bufs: _Bufs) -> None:
    ts = _tile_shape(geo, bufs, b.device)
    if ts is not None:
        return _backward_tile(b, geo, bufs, ts, ordered=True)
    go = bufs.go
    if bufs.gi is not None:
        go = (_backward_counting if _counting(geo.dtype) else _backward_sorted)(b, geo, bufs)
    if bufs.gg is not None:
        inp = _input_for_grid_grad(b, geo, bufs.inp) if geo.mode != NEAREST else None
        _backward_launch(b, geo, go, inp, bufs.grid, None, bufs.gg.ref, F_GG)


def _backward_sorted(b: _Builder, geo: Geometry, bufs: _Bufs) -> _Tensor:
    """grad_input by sorted keys + sums in key order; returns the channels-last grad_output."""
    t, a = CTYPES[geo.dtype]
    acc_item = ITEMSIZE[ACC_DTYPE[a]]
    npts, npix = geo.N * geo.points, geo.N * geo.pixels
    cell = TUNING["det_keys"] == "cell" and geo.mode != BICUBIC  # "count" on float64 sorts by tap
    if cell:  # one key per point: its cell
        D, H, W = geo.in_sp
        dests = geo.N * (D + 1 if geo.nd == 3 else 1) * (H + 1) * (W + 1)
        per_dest, n_keys, kernels = geo.points, npts, ("gs_cell_keys", "gs_cell_gather")
    else:  # one key per (point, tap): its destination pixel
        k = _taps(geo)
        dests, per_dest, n_keys, kernels = npix, geo.points * k, npts * k, ("gs_keys", "gs_gather")
    if dests * per_dest >= 2**62:
        raise BufferMismatchError("grid", "size", "N * input pixels * output points * taps < 2**62 for the "
                                  "deterministic backward's int64 keys", dests * per_dest)
    go = _go_cl(b, geo, bufs.go)
    coords = b.buffer(npts * geo.nd * acc_item)
    keys = b.buffer(n_keys * 8)
    variant = f"<{t}, {a}, {geo.nd}, {geo.mode}>"
    b.launch(kernels[0] + variant, (_blocks(npts),), (BLOCK,),
             (bufs.grid.ref, keys, coords, _geo_struct(geo, grid=_grid5(bufs.grid.strides, geo.nd))))
    b.sort(keys, n_keys)
    bounds = b.buffer(dests * 2 * 8)
    b.zero(bounds, dests * 2 * 8)
    b.launch("gs_bounds", (_blocks(n_keys),), (BLOCK,), (keys, bounds, np.int64(n_keys), np.int64(per_dest)))
    _gather(b, geo, bufs, go, kernels[1] + variant, (keys, bounds, coords))
    return go


# ------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------
FORWARD_INPUTS = ("input", "grid")  # the order of the addresses a call passes
BACKWARD_INPUTS = ("grad_output", "input", "grid")


def _tuning_key() -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in TUNING.items()))


def grid_sample(input: Any, grid: Any, *, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners: bool = False) -> Any:
    """torch.nn.functional.grid_sample(input, grid, mode, padding_mode, align_corners), on the GPU.

    The result is in the input's framework and memory format (channels-last in, channels-last out).
    """
    key, ptrs = _memo_key((input, grid), ("forward", mode, padding_mode, align_corners))
    try:
        prep = _memo.get(key)
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        prep = None
    if prep is not None:
        return _launch(prep, ptrs)[0]
    check_options(mode, padding_mode, align_corners)  # bad option names fail before any buffer is touched
    inp, gr = describe(input, "input"), describe(grid, "grid")
    framework, device = _check_same_place({"input": inp, "grid": gr})
    plan = _forward_plan(device, _key(inp), _key(gr), mode, padding_mode, bool(align_corners), _tuning_key())
    prep = _prepared(plan, framework, device, {"output": input})
    _memo.put(key, prep)
    return _launch(prep, (inp.ptr, gr.ptr))[0]


def grid_sample_backward(grad_output: Any, input: Any, grid: Any, *, mode: str = "bilinear",
                         padding_mode: str = "zeros", align_corners: bool = False,
                         input_requires_grad: bool = True, grid_requires_grad: bool = True,
                         deterministic: bool = False) -> tuple[Any, Any]:
    """(grad_input, grad_grid) of grid_sample; None for a gradient not asked for.

    deterministic=False: atomics (fast); True: bit-identical run to run. See `backward_guarantee`.
    grad_input takes the input's memory format, grad_grid is contiguous; both in the inputs' framework.
    """
    options = ("backward", mode, padding_mode, align_corners, input_requires_grad, grid_requires_grad, deterministic)
    key, ptrs = _memo_key((grad_output, input, grid), options)
    try:
        prep = _memo.get(key)
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        prep = None
    if prep is None:
        check_options(mode, padding_mode, align_corners)
        go, inp, gr = describe(grad_output, "grad_output"), describe(input, "input"), describe(grid, "grid")
        framework, device = _check_same_place({"grad_output": go, "input": inp, "grid": gr})
        plan = _backward_plan(device, _key(go), _key(inp), _key(gr), mode, padding_mode, bool(align_corners),
                              bool(input_requires_grad), bool(grid_requires_grad), bool(deterministic), _tuning_key())
        prep = _prepared(plan, framework, device, {"grad_input": input, "grad_grid": grid})
        _memo.put(key, prep)
        ptrs = (go.ptr, inp.ptr, gr.ptr)
    results = dict(zip((role for role, _ in prep.outputs), _launch(prep, ptrs)))
    return results.get("grad_input"), results.get("grad_grid")


# -- the call path: a geometry seen before skips the checks and the plan lookup ---------------------------
class _Prepared(NamedTuple):
    plan: _Plan
    framework: str
    device: int
    outputs: tuple  # (role, allocate() -> a new result buffer)
    pointer: Callable[[Any], int]  # a result buffer's address
    stream: Callable[[], int]  # the framework's current stream on the device


def _prepared(plan: _Plan, framework: str, device: int, likes: dict) -> _Prepared:
    """What a call of `plan` does besides launching: allocate each result like its model buffer, find its
    address and the stream (for torch: straight from torch._C, skipping the generic helpers' checks)."""
    outputs = []
    for role, desc in plan.outputs.items():
        like = likes[role]
        allocate = torch_allocator(desc, like.device) if framework == "torch" else \
            functools.partial(allocate_like, desc, like=like, framework=framework, device=device)
        outputs.append((role, allocate))
    if framework == "torch":
        torch = sys.modules["torch"]
        stream, pointer = functools.partial(torch._C._cuda_getCurrentRawStream, device), torch.Tensor.data_ptr
    else:
        stream, pointer = functools.partial(stream_pointer, None, framework, device), _ptr
    return _Prepared(plan, framework, device, tuple(outputs), pointer, stream)


def _launch(prep: _Prepared, inputs: tuple) -> list:
    """Allocate the results (a list, in prep.outputs' order) and run the plan on `inputs` (the inputs'
    addresses, in plan.inputs order) and theirs."""
    results = [allocate() for _, allocate in prep.outputs]
    if prep.plan.ops:
        _run(prep.plan, prep.framework, prep.device, inputs + tuple(map(prep.pointer, results)), prep.stream())
    return results


_memo = CallMemo(1024)  # _memo_key -> _Prepared, for torch tensors (what the checks and the plan depend on)
_memo_tuning: list = [None]  # the TUNING the memo was filled under: plans depend on it


def _memo_key(objs: tuple, options: tuple) -> tuple[tuple | None, tuple]:
    """(key, the inputs' addresses): the key holds every input's shape, strides, dtype, device and address
    modulo 256, with the options and their types (1 must not pass where True was checked); None where a
    buffer is not a torch tensor (the checked path serves those)."""
    tensor = torch_tensor_type()
    if tensor is None:
        return None, ()
    parts, ptrs = [], []
    for t in objs:
        if not isinstance(t, tensor):
            return None, ()
        ptr = t.data_ptr()
        ptrs.append(ptr)
        parts.append((t.shape, t.stride(), t.dtype, t.get_device(), ptr % 256))
    key = (options, tuple(map(type, options)), tuple(parts))
    if _memo_tuning[0] != TUNING:  # tests and tools retune: what was prepared under other knobs is stale
        _memo.clear()
        _memo_tuning[0] = copy.deepcopy(TUNING)
    return key, tuple(ptrs)


def _ptr(obj: Any) -> int:
    return obj.data_ptr() if hasattr(obj, "data_ptr") else obj.data.ptr
