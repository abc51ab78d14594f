"""A linear layer with bias and activation, forward and backward: cuBLASLt (or cuBLAS) GEMMs + one fused
elementwise pass.

    y, aux = gemm_bias_act(a, b, bias, activation="gelu")          # y = act(a @ b + bias)
    da, db, dbias = gemm_bias_act_backward(dy, a, b, aux, activation="gelu")

a is [M, K] or [Bt, M, K], b is [K, N] (shared), bias [N]; either may be a transposed view (detected from
the strides and handed to cuBLAS as op flags, never copied).

Forward on cuBLASLt (nvmath-python installed, the batch flattens): for identity, relu and gelu_tanh one GEMM
does the whole layer in its epilogue (BIAS, RELU_BIAS, GELU_AUX_BIAS); for the other smooth activations the
GEMM adds the bias in its epilogue and writes the pre-activation in the io dtype, and one pass reads it and
writes y = act(pre). Into a 16-bit output that epilogue rounds a @ b before adding the bias, exactly as
torch.addmm's does (tools/probe_bias_rounding.py), so relu's y is torch's relu(addmm(...)), sign included;
leaky_relu (no epilogue; its derivative is the sign of pre) takes an f32 GEMM output and the pass adds the
bias and rounds once. Without cuBLASLt: a cuBLAS GEMM writes a @ b in f32 and the pass adds the bias and
rounds once. (A beta = 1 GEMM onto a bias-filled 16-bit output rounds the same way.)
The pass's gelu, silu and sigmoid use SFU formulas a few 1e-7 off for 16-bit outputs (gemm_act.cu).
aux is the minimal state the backward needs: None for identity, y itself for relu (y > 0 where pre > 0: what
torch saves), a bit mask (32-bit words [..., M, mask_words(N)], bit c % 32 of word c // 32 set where pre > 0;
rows padded to 128 bits, the layout cuBLASLt's RELU_AUX writes) for leaky_relu, else the pre-activation in
the io dtype (what torch saves).

Backward: one pass reads dy and aux once and writes grad_pre = dy * act'(pre) once, with the bias gradient's
column sums fused in (per-block f32 partials, then a fixed-order sum: deterministic, no atomics, no second
read of grad_pre); then dA = grad_pre @ b.T and dB = a.T @ grad_pre through cuBLASLt where it is installed
and the batch flattens, else cuBLAS; for identity, dbias comes from dB's GEMM epilogue (BGRADA / BGRADB)
and there is no pass at all. With `chunks` > 1 the pass runs in row chunks and dA's row chunks run on a
side stream (cuBLAS) as soon as their rows are ready.

The call path: a call is planned once (checks, layouts, GEMM plans, kernel launches with their arguments
packed) into a `_Program` of steps on named buffers; for torch tensors the program is kept per thread under
a key of every buffer's shape, strides, dtype, device and address modulo 256 (all its checks depend on), so
a repeated call allocates its results and runs the steps. No step synchronises.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import replace
from typing import Any, Callable, NamedTuple

from gpu_launch import driver
from gpu_launch.activations import ACTIVATIONS, Activation, as_activation
from gpu_launch.buffers import BufferInfo, describe, torch_tensor_type
from gpu_launch.dlpack import contiguous_strides
from gpu_launch.errors import BufferMismatchError, SpecError
from gpu_launch.memo import ThreadMemo
from gpu_launch.replay import Replay
from gpu_launch.streams import (allocate_like, call_scratch, capture_probe, external_stream, stream_pointer,
                                torch_allocator)

from . import blas, cublaslt
from . import compile as _compile
from .blas import Mat
from .types import SIXTEEN_AND_32, STORAGE

ACT_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}  # order matches the enum in gemm_act.cu
MASK_ACTS = ("leaky_relu",)  # its derivative needs only the sign of pre: 1 bit per element
# relu's backward reads y itself (y > 0 where pre > 0), as torch's threshold_backward does: no aux buffer, and
# the forward is one GEMM with cuBLASLt's RELU_BIAS epilogue.
AUX_IS_Y = ("relu",)
CTYPES = {dtype: STORAGE[dtype] for dtype in SIXTEEN_AND_32}
VEC = {"float16": 8, "bfloat16": 8, "float32": 4}  # elements per 16-byte access
ITEMSIZE = blas.ITEMSIZE
AUX_NONE, AUX_MASK, AUX_PRE = 0, 1, 2
MASK_DTYPES = ("int32", "uint32", "<i4", "<u4")
OPTIONS = _compile.BASE_OPTIONS
WARPS, UNROLL = 8, 4  # as in gemm_act.cu
BLOCK = 32 * WARPS
# act_fwd_flat's block: 256 threads of one 16-byte vector each took 48.7 us on bf16 8192x4096 gelu where the
# row kernel took 58.0 and torch's gelu 51.6 (70.4 / 83.5 / 75.2 on 16384x3072; 128-512 threads and 1-4
# vectors a thread were within 3 %, H100, tools/probe_act_pass.py)
FLAT_THREADS, FLAT_ITEMS = 256, 1
ROLES = ("a", "b", "bias")


def source() -> str:
    return _compile.source("gemm_act.cu")


def _aux_kind(name: str) -> int:
    """What the backward reads: nothing, a bit mask, or a tensor of y's shape (the pre-activation, or relu's y)."""
    return AUX_NONE if name == "identity" else AUX_MASK if name in MASK_ACTS else AUX_PRE


def module_names(dtype: str, group: str | None) -> list[str]:
    """The kernels of one compiled module: an activation's forward and backward passes (group: its name),
    or the shared reductions (group None). One module per (dtype, activation) keeps a process's first
    call to a compile of the half-dozen kernels it runs."""
    t = CTYPES[dtype]
    if group is None:
        return [f"bias_finalize<{t}>", f"convert_add<{t}>"]
    code = ACT_CODES[group]
    names = []
    for v in (1, VEC[dtype]):
        names.append(f"act_bwd<{t}, {v}, {_aux_kind(group)}, {code}>")
        names += [_fwd_name(t, acc, v, code) for acc in dict.fromkeys(("float", t))]
    return names + [_flat_name(t, VEC[dtype], code)]


def name_expressions(dtype: str | None = None) -> list[str]:
    """Every kernel instantiation launched (for one io dtype, or all)."""
    names = []
    for io in CTYPES:
        if dtype is None or io == dtype:
            for group in (*ACTIVATIONS, None):
                names += module_names(io, group)
    return names


def _fwd_name(t: str, acc: str, v: int, code: int) -> str:
    """The forward pass over f32 accumulators (acc "float") or a pre-activation in the io type (acc t)."""
    return f"act_fwd_rows<{t}, {acc}, {v}, {code}>"


def _flat_name(t: str, v: int, code: int) -> str:
    """The forward pass y = act(pre) over a contiguous io-typed pre-activation, as one flat array."""
    return f"act_fwd_flat<{t}, {v}, {code}, {FLAT_THREADS}, {FLAT_ITEMS}>"


@functools.lru_cache(maxsize=None)
def _function(dtype: str, device: int, name: str, group: str | None) -> Any:
    module = _compile.load_module("gemm_act.cu", tuple(module_names(dtype, group)), device, OPTIONS)
    return module.get_function(name)


class FlatActivation:
    """y = act(x) over `count` contiguous values of `dtype` (in place where y is x), as one launch of the
    forward's flat pass; `count` a multiple of VEC[dtype] and the pointers 16-byte aligned (fresh
    allocations are). One thread at a time calls it (its argument slots are patched in place)."""

    def __init__(self, count: int, dtype: str, device: int, activation: Any):
        act = _activation(activation)
        if dtype not in VEC or count <= 0 or count % VEC[dtype]:
            raise SpecError("count", count, f"a positive multiple of {VEC.get(dtype)} {dtype} values")
        vectors = count // VEC[dtype]
        fn = _function(dtype, device, _flat_name(CTYPES[dtype], VEC[dtype], ACT_CODES[act.name]), act.name)
        self.x, self.y = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self.kernel = driver.Kernel(_compile.cufunction(fn, device), grid=_cdiv(vectors, FLAT_THREADS * FLAT_ITEMS),
                                    block=FLAT_THREADS, ordinal=device,
                                    args=[self.x, self.y, _i64(vectors), _f32(act.param or 0.0)])

    def __call__(self, stream: int, *, x: int, y: int) -> None:
        self.x.value, self.y.value = x, y
        self.kernel.launch(stream)


class FlatActivationBackward:
    """g = dy * act'(pre) over [rows, n] contiguous values of `dtype`, and the bias gradient sum(g) over the rows
    as float32 (deterministic: per-block column sums, then one fixed-order sum), as two launches: the
    backward's pass of an activation whose derivative reads the pre-activation (not leaky_relu's bit mask).
    Pointers 16-byte aligned, n a multiple of VEC[dtype], `partials_bytes` of float32 scratch a call. One
    thread at a time calls it."""

    def __init__(self, rows: int, n: int, dtype: str, device: int, activation: Any):
        act = _activation(activation)
        if dtype not in VEC or rows <= 0 or n <= 0 or n % VEC[dtype] or _aux_kind(act.name) != AUX_PRE:
            raise SpecError("activation", act.name, f"a pass over a saved pre-activation, [{rows}, {n}] {dtype} "
                            f"values (n a multiple of {VEC.get(dtype)})")
        v = VEC[dtype]
        name = f"act_bwd<{CTYPES[dtype]}, {v}, {AUX_PRE}, {ACT_CODES[act.name]}>"
        fn = _compile.cufunction(_function(dtype, device, name, act.name), device)
        rpb = _rows_per_block(rows, n, v, device, _blocks_per_sm(dtype, device, name, act.name))
        blocks = _cdiv(rows, rpb)
        self.partials_bytes = blocks * n * 4
        self.ptrs = [ctypes.c_uint64(0) for _ in range(5)]  # dy, pre, mask (none), g, partial
        self.kernel = driver.Kernel(fn, grid=(_cdiv(n, 32 * v), blocks), block=BLOCK, ordinal=device,
                                    args=[*self.ptrs, _i64(rows), _i32(n), _i32(rpb), _i32(0), _f32(act.param or 0.0)])
        finalize = _compile.cufunction(_function("float32", device, "bias_finalize<float>", None), device)
        self.fin_ptrs = [ctypes.c_uint64(0), ctypes.c_uint64(0)]
        self.finalize = driver.Kernel(finalize, grid=_grid_1d(n), block=256, ordinal=device,
                                      args=[self.fin_ptrs[0], _i32(blocks), _i32(n), self.fin_ptrs[1], _i64(1), _i32(0)])

    def __call__(self, stream: int, *, dy: int, pre: int, g: int, partials: int, dbias: int) -> None:
        for slot, value in zip(self.ptrs, (dy, pre, 0, g, partials)):
            slot.value = value
        self.kernel.launch(stream)
        self.fin_ptrs[0].value, self.fin_ptrs[1].value = partials, dbias
        self.finalize.launch(stream)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


# ----------------------------------------------------------------------------------------- validation


class Loc(NamedTuple):
    """A place in a named buffer of a call (an input's role, an output, scratch) plus a byte offset: what a
    program's steps hold instead of addresses. `loc + nbytes` moves along it, as a pointer would."""

    name: str
    offset: int = 0

    def __add__(self, nbytes: int) -> "Loc":  # type: ignore[override]
        return Loc(self.name, self.offset + nbytes)


class _Desc(NamedTuple):  # what allocate_like needs
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


def _activation(activation: Any) -> Activation:
    return as_activation("activation", activation)


def _need(need: Any) -> tuple[str, ...]:
    if isinstance(need, str):
        need = (need,)
    try:
        items = tuple(need)
    except TypeError:
        raise SpecError("need", need, f"expected a subset of {ROLES}") from None
    bad = [n for n in items if n not in ROLES]
    if bad:
        raise SpecError("need", need, f"unknown gradient {bad}; expected a subset of {ROLES}")
    return tuple(n for n in ROLES if n in items)


def _describe(obj: Any, role: str) -> BufferInfo:
    if obj is None:
        raise BufferMismatchError(role, "buffer", "a CUDA torch tensor or CuPy array", None)
    info = describe(obj, role)
    if info.framework not in ("torch", "cupy", "cai"):
        raise BufferMismatchError(role, "type", "a CUDA torch tensor, CuPy array or __cuda_array_interface__ "
                                  "object (shape and strides are needed)", type(obj).__name__)
    return info


class _Operands:
    """Checked inputs of one call: framework, device, dtype and the matrices as cuBLAS sees them."""

    def __init__(self, a: Any, b: Any):
        self.infos: dict[str, BufferInfo] = {}
        ia = self.add("a", a)
        ib = self.add("b", b)
        if ia.dtype not in CTYPES:
            raise BufferMismatchError("a", "dtype", "float16, bfloat16 or float32", ia.dtype)
        self.dtype = ia.dtype
        self.itemsize = ITEMSIZE[self.dtype]
        if len(ia.shape) not in (2, 3):
            raise BufferMismatchError("a", "shape", "[M, K] or [Bt, M, K]", ia.shape)
        if len(ib.shape) != 2 or ib.shape[0] != ia.shape[-1]:
            raise BufferMismatchError("b", "shape", f"[K={ia.shape[-1]}, N]", ib.shape)
        self.lead = tuple(ia.shape[:-2])
        self.batch = ia.shape[0] if self.lead else 1
        self.m, self.k = ia.shape[-2:]
        self.n = ib.shape[1]
        if 0 in (self.batch, self.m, self.k, self.n):
            raise SpecError("shape", (ia.shape, ib.shape), "empty dimensions are not supported")
        self.check("b", ib)
        self.check("a", ia)
        self.a = self.mat("a", ia)
        self.b = self.mat("b", ib)

    @property
    def rows(self) -> int:
        return self.batch * self.m

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.m, self.n)

    @property
    def mask_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.m, mask_words(self.n))

    def add(self, role: str, obj: Any) -> BufferInfo:
        info = _describe(obj, role)
        if self.infos:
            first_role, first = next(iter(self.infos.items()))
            if (info.framework == "torch") != (first.framework == "torch"):
                raise BufferMismatchError(role, "framework", first.framework, info.framework)
            if info.device is not None and first.device is not None and info.device != first.device:
                raise BufferMismatchError(role, "device", first.device, info.device)
        self.infos[role] = info
        return info

    @property
    def framework(self) -> str:
        return "torch" if self.infos["a"].framework == "torch" else "cupy"

    @property
    def device(self) -> int:
        for info in self.infos.values():
            if info.device is not None:
                return info.device
        import cupy

        return cupy.cuda.runtime.getDevice()

    def check(self, role: str, info: BufferInfo, *, shape: tuple[int, ...] | None = None,
              dtype: str | None = None, contiguous: bool = False) -> None:
        """Shape, dtype, alignment and a layout cuBLAS (or the elementwise kernels) can use as is."""
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise BufferMismatchError(role, "shape", tuple(shape), info.shape)
        want = dtype or self.dtype
        if (info.dtype not in MASK_DTYPES) if want == "mask" else (info.dtype != want):
            raise BufferMismatchError(role, "dtype", "int32 or uint32 words" if want == "mask" else want,
                                      info.dtype)
        itemsize = 4 if want == "mask" else ITEMSIZE[want]
        if info.ptr % itemsize:
            raise BufferMismatchError(role, "alignment", f"a multiple of {itemsize} bytes", hex(info.ptr))
        if contiguous:
            if not _is_contiguous(info.shape, info.strides):
                raise BufferMismatchError(role, "strides", contiguous_strides(info.shape), info.strides)
            return
        if len(info.shape) == 1:
            if info.shape[0] > 1 and info.strides[0] <= 0:
                raise BufferMismatchError(role, "strides", "a positive stride", info.strides)
            return
        *_, rows, cols = info.shape
        *bst, rs, cs = info.strides
        if blas.matrix_order(rows, cols, rs, cs) is None or any(s < 0 for s in bst):
            raise BufferMismatchError(role, "strides", "row-major or transposed (column-major) matrices "
                                      "(copy other layouts with .contiguous())", info.strides)

    def mat(self, role: str, info: BufferInfo) -> Mat:
        """The buffer as a matrix whose ptr is the symbolic `Loc(role)` (programs outlive one call's pointers)."""
        *bsh, rows, cols = info.shape
        *bst, rs, cs = info.strides
        batch = bsh[0] if bsh else 1
        return Mat(Loc(role), rows, cols, rs, cs, self.dtype, batch, (bst[0] if batch > 1 else 0))

    def given(self) -> dict[str, int]:
        """The addresses of the buffers the caller passed, by role."""
        return {role: info.ptr for role, info in self.infos.items()}


def _is_contiguous(shape, strides) -> bool:
    return all(s == e or d == 1 for s, e, d in zip(strides, contiguous_strides(shape), shape))


def _dense_like(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides in the same matrix order as (shape, strides): row-major stays so, transposed too."""
    *bsh, rows, cols = shape
    *_, rs, cs = strides
    col = blas.matrix_order(rows, cols, rs, cs)[0] == "col"
    inner = (1, rows) if col else (cols, 1)
    return ((rows * cols,) if bsh else ()) + inner


# ------------------------------------------------------------------------------------------- programs


Step = Callable[[dict, int], None]  # step(addresses by buffer name, stream): queues its work, never waits


class _Program(NamedTuple):
    """One call planned: the results to allocate, the scratch it needs (offsets into one block), and the
    steps that queue the work, also as one re-pointed CUDA graph (`replay`)."""

    framework: str
    device: int
    outputs: tuple  # (name, allocate() -> a new buffer)
    scratch: tuple  # (name, byte offset) into one block of scratch_bytes
    scratch_bytes: int
    steps: tuple[Step, ...]
    results: tuple  # names returned, in order (None: a result that is absent)
    inputs: tuple  # the roles of the caller's buffers: their addresses, then the outputs', then scratch's
    replay: Replay  # the steps as one re-pointed CUDA graph once recorded

    def run(self, addrs: tuple, stream: int) -> None:
        """Queue every step on `stream`, the buffers at `addrs` (inputs, outputs, the scratch block)."""
        ptrs = dict(zip(self.inputs + tuple([name for name, _ in self.outputs]), addrs))
        if self.scratch_bytes:
            base = addrs[-1]
            for name, offset in self.scratch:
                ptrs[name] = base + offset
        for step in self.steps:
            step(ptrs, stream)


def _execute(prog: _Program, ptrs: dict, given: dict, stream: Any) -> tuple:
    """Allocate the results, take the stream's scratch block (a block of this call's own under capture),
    queue the steps; the results (given buffers for those the caller passed)."""
    objs = dict(given)
    addrs = [ptrs[name] for name in prog.inputs]
    for name, alloc in prog.outputs:
        obj = objs[name] = alloc()
        addrs.append(obj.data_ptr() if prog.framework == "torch" else obj.data.ptr)
    sptr = stream_pointer(stream, prog.framework, prog.device)
    capturing = capture_probe(prog.framework, stream)(sptr)
    owner = None
    if prog.scratch_bytes:
        owner, base = call_scratch(prog.scratch_bytes, prog.framework, prog.device, sptr, capturing=capturing)
        addrs.append(base)
    if driver.context_is_current(prog.device):
        prog.replay(tuple(addrs), sptr, capturing)
    else:
        with driver.device(prog.device):
            prog.replay(tuple(addrs), sptr, capturing)
    del owner  # stream-ordered allocators: freeing after the queued launches is safe
    return tuple(objs.get(name) if name else None for name in prog.results)


def _addr(ptrs: dict, loc: Loc | None) -> int:
    return 0 if loc is None else ptrs[loc.name] + loc.offset


def _bind(mat: Mat, ptrs: dict) -> Mat:
    return replace(mat, ptr=_addr(ptrs, mat.ptr))


class _Builder:
    """Plans one call into a _Program. Decisions that depend on addresses (alignment classes, vector
    widths) use the given buffers' addresses, which the memo key fixes modulo 256, and 256 for what the
    program allocates (allocators return 256-byte aligned blocks; scratch offsets keep that)."""

    def __init__(self, ops: _Operands, like: Any):
        self.ops, self.like = ops, like
        self.given = ops.given()
        self.outputs: dict[str, tuple] = {}
        self.scratch: dict[str, tuple[int, int]] = {}
        self.scratch_bytes = 0
        self.workspace = 0
        self.steps: list[Step] = []

    def addr(self, loc: Any) -> int:
        """The planning address of a Loc (an int passes through)."""
        if not isinstance(loc, Loc):
            return loc
        return self.given.get(loc.name, 0) + loc.offset

    def output(self, name: str, shape, strides, dtype: str) -> Loc:
        if dtype == "mask":
            dtype = "int32" if self.ops.framework == "torch" else "uint32"
        self.outputs[name] = (tuple(shape), tuple(strides), dtype)
        return Loc(name)

    def buffer(self, name: str, nbytes: int) -> Loc:
        """Scratch for this call only, 256-byte aligned (a name asked for again with its size: the same)."""
        if self.scratch.get(name, (0, -1))[1] == nbytes:
            return Loc(name)
        self.scratch[name] = (self.scratch_bytes, nbytes)
        self.scratch_bytes += -(-nbytes // 256) * 256
        return Loc(name)

    def kernel(self, name: str, grid, block: int, args: list, group: str | None = None) -> None:
        """A launch of one of gemm_act.cu's kernels (of module `group`: see module_names); args are ctypes
        values, or Locs patched per call."""
        ops = self.ops
        values, patches = [], []
        for a in args:
            value = ctypes.c_uint64(0) if a is None or isinstance(a, Loc) else a
            if isinstance(a, Loc):
                patches.append((value, a.name, a.offset))
            values.append(value)
        fn = _compile.cufunction(_function(ops.dtype, ops.device, name, group), ops.device)
        launch = driver.Kernel(fn, grid=grid, block=block, args=values, ordinal=ops.device)
        patches = tuple(patches)

        def step(ptrs: dict, stream: int) -> None:
            for value, buf, offset in patches:
                value.value = ptrs[buf] + offset
            launch.launch(stream)

        self.steps.append(step)

    def lt(self, x: Mat | None, p: Mat | None, q: Mat | None, *, tf32: bool, accumulate: bool = False,
           epilogue: str = "DEFAULT", bias: Loc | None = None, aux: Loc | None = None, bias_stride: int = 1) -> bool:
        """x = p @ q (+ x) with an epilogue as one cuBLASLt step (x may be float32 accumulators); False
        (nothing added) where cuBLASLt cannot take it, and the caller plans cuBLAS instead."""
        found = _lt_geometry(self.ops.device, self.ops.dtype, x, p, q, epilogue=epilogue, tf32=tf32, addr=self.addr,
                             bias=bias, bias_stride=bias_stride)
        if found is None:
            return False
        geometry, x, p, q = found
        try:
            plan = cublaslt.lt_gemm(geometry)
        except cublaslt.CublasLtError:
            return False
        self.workspace = max(self.workspace, plan.workspace)
        a_loc, b_loc, d_loc, ws = p.ptr, q.ptr, x.ptr, plan.workspace

        def step(ptrs: dict, stream: int) -> None:
            plan.run(a=ptrs[a_loc.name] + a_loc.offset, b=ptrs[b_loc.name] + b_loc.offset,
                     d=ptrs[d_loc.name] + d_loc.offset, stream=stream, bias=_addr(ptrs, bias),
                     aux=_addr(ptrs, aux), accumulate=accumulate, workspace=ptrs["workspace"] if ws else 0)

        self.steps.append(step)
        return True

    def gemm(self, x: Mat, p: Mat, q: Mat, *, beta: float, allow_tf32: bool) -> None:
        """x[i] = p[i] @ q (+ beta x[i]) on cuBLAS (CuPy's handle), one GEMM over all rows where the batch flattens."""
        device, dtype = self.ops.device, self.ops.dtype

        def step(ptrs: dict, stream: int) -> None:
            handle = blas.main_handle(device, stream)
            compute = blas.compute_type(dtype, allow_tf32=allow_tf32, handle=handle)
            _gemm_rows(handle, _bind(x, ptrs), _bind(p, ptrs), _bind(q, ptrs), beta=beta, compute=compute)

        self.steps.append(step)

    def program(self, results: tuple) -> _Program:
        if self.workspace:
            self.buffer("workspace", self.workspace)
        ops = self.ops
        outputs = []
        for name, (shape, strides, dtype) in self.outputs.items():
            desc = _Desc(shape, strides, dtype)
            alloc = torch_allocator(desc, self.like.device) if ops.framework == "torch" else \
                functools.partial(allocate_like, desc, like=self.like, framework=ops.framework, device=ops.device)
            outputs.append((name, alloc))
        prog = _Program(ops.framework, ops.device, tuple(outputs),
                        tuple((name, off) for name, (off, _) in self.scratch.items()), self.scratch_bytes,
                        tuple(self.steps), results, tuple(self.given), None)
        return prog._replace(replay=Replay(prog.run, ordinal=ops.device, label=f"gemm_act {ops.dtype}"))


def _lt_geometry(device: int, dtype: str, x: Mat | None, p: Mat | None, q: Mat | None, *, epilogue: str,
                 tf32: bool, addr: Callable[[Any], int], bias: Any = None, bias_stride: int = 1):
    """(Geometry, x, p, q) of x = p @ q on cuBLASLt, with x oriented row-major (operands swapped to do it),
    or None where cuBLASLt cannot take it: not installed, a batch that did not flatten, a layout or
    epilogue it cannot express. Pure: touches no GPU. `addr` gives a pointer's planning address.

    BGRADA sums q over its rows into `bias` (length N); the epilogues' bias and aux run along x's columns."""
    if not cublaslt.available() or x is None or p is None or q is None:
        return None
    if 1 < max(x.batch, p.batch, q.batch) or x.order is None or p.order is None or q.order is None:
        return None
    if bias is not None and (bias_stride != 1 and x.cols > 1 or addr(bias) % 16):
        return None
    if x.order[0] == "col":  # x = p @ q  <=>  x.T = q.T @ p.T, x.T row-major; BGRADA/BGRADB trade places
        if epilogue not in ("DEFAULT", "BGRADA", "BGRADB"):
            return None
        x, p, q, epilogue = x.T, q.T, p.T, _SWAP_BGRAD.get(epilogue, epilogue)
    aux_ld = 0
    if epilogue in cublaslt.AUX_EPILOGUES:
        aux_ld = cublaslt.relu_mask_ld(x.cols) if "RELU" in epilogue else x.cols
        if "GELU" in epilogue and x.cols % cublaslt.GELU_AUX_LD:
            return None
    if max(x.rows, x.cols, p.cols) > blas.INT_MAX:
        return None
    align = tuple(cublaslt.alignment(addr(m.ptr)) for m in (p, q, x))
    geometry = cublaslt.Geometry(device, dtype, x.rows, x.cols, p.cols, p.order, q.order, x.order[1], epilogue,
                                 aux_ld, tf32 and dtype == "float32", align,
                                 x.dtype if x.dtype != dtype else None)
    return geometry, x, p, q


_SWAP_BGRAD = {"BGRADA": "BGRADB", "BGRADB": "BGRADA"}


def _vec(b: _Builder, n: int, *locs: Any) -> int:
    """16-byte vectors where every row starts 16-byte aligned, else scalars."""
    v = VEC[b.ops.dtype]
    return v if n % v == 0 and all(b.addr(loc) % 16 == 0 for loc in locs if loc is not None) else 1


def _grid_1d(total: int, block: int = 256) -> tuple[int]:
    return (max(1, min((total + block - 1) // block, 65535 * 4)),)


def _chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    step = WARPS * UNROLL * 4  # 128-row granularity keeps the chunked GEMMs on whole tiles
    size = max(step, -(-rows // chunks // step) * step)
    return [(r, min(rows, r + size)) for r in range(0, rows, size)]


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


@functools.lru_cache(maxsize=None)
def _blocks_per_sm(dtype: str, device: int, name: str, group: str) -> int:
    """Resident 256-thread blocks per SM of one kernel (the driver's occupancy, else from its registers)."""
    fn = _function(dtype, device, name, group)
    try:
        from cupy_backends.cuda.api import driver as cupy_driver

        return max(1, int(cupy_driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, BLOCK, 0)))
    except Exception:  # pragma: no cover - depends on the CuPy version
        regs = max(1, int(getattr(fn, "num_regs", 64)))
        return max(1, min(65536 // (_cdiv(regs, 8) * 8 * BLOCK), 2048 // BLOCK))


def _rows_per_block(rows: int, n: int, v: int, device: int, bps: int) -> int:
    """Rows per block of the backward pass: one resident wave of blocks, whole UNROLL groups of rows."""
    step = WARPS * UNROLL
    tiles = _cdiv(n, 32 * v)
    target = _sm_count(device) * bps
    blocks_y = max(1, min(_cdiv(target, tiles), _cdiv(rows, step)))
    rpb = _cdiv(_cdiv(rows, blocks_y), step) * step
    while _cdiv(rows, rpb) > 65535:
        rpb *= 2
    return rpb


def _rows_mat(ops: _Operands, loc: Loc, dtype: str) -> Mat:
    """A contiguous [(Bt,) M, N] result as the GEMM output."""
    return Mat(loc, ops.m, ops.n, ops.n, 1, dtype, ops.batch, ops.m * ops.n if ops.batch > 1 else 0)


def _gemm_rows(handle: int, x: Mat, p: Mat, q: Mat, *, beta: float, compute: int) -> None:
    """x[i] = p[i] @ q (+ beta x[i]) with q shared: one GEMM over all rows when the batch flattens."""
    fx, fp = x.flat_rows(), p.flat_rows()
    if fx is not None and fp is not None:
        blas.gemm(handle, fx, fp, q, beta=beta, compute=compute)
    else:
        blas.gemm(handle, x, p, q, beta=beta, compute=compute)


_i32, _i64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


# ---------------------------------------------------------------------------------------- the memo

MEMO_SIZE = 1024
_memo = ThreadMemo(MEMO_SIZE)  # key -> _Program, per thread: a program's driver.Kernel is one thread's


def _memo_key(objs: tuple, options: tuple) -> tuple[tuple | None, dict]:
    """(key, addresses): every buffer's shape, strides, dtype, device and address modulo 256 (what a
    program's checks and plans depend on), with the options and their types (1 must not pass where True
    was checked); key None where a buffer is not a torch tensor (those take the checked path each time)."""
    tensor = torch_tensor_type()
    if tensor is None:
        return None, {}
    parts, ptrs = [options, tuple(map(type, options))], {}
    for role, t in objs:
        if t is None:
            parts.append(None)
            continue
        if not isinstance(t, tensor):
            return None, {}
        ptr = ptrs[role] = t.data_ptr()
        parts.append((t.shape, t.stride(), t.dtype, t.get_device(), ptr % 256))
    return tuple(parts), ptrs


# ------------------------------------------------------------------------------------------- forward


def gemm_bias_act(a: Any, b: Any, bias: Any = None, *, activation: Any, save_for_backward: bool = True,
                  allow_tf32: bool = False, stream: Any = None) -> tuple[Any, Any]:
    """y = act(a @ b + bias) and the aux the backward needs (None when not saved or not needed).

    a: [M, K] or [Bt, M, K], b: [K, N], bias: [N] or None; f16, bf16 or f32, all alike; torch tensors or
    CuPy arrays (the result is in the same framework, on its current stream unless `stream` is given).
    Row-major or transposed (column-major) matrices are used in place; other layouts raise
    BufferMismatchError. float32 GEMMs use TF32 only with allow_tf32=True (torch's matmul default: off).
    """
    options = ("forward", activation, save_for_backward, allow_tf32)
    key, ptrs = _memo_key((("a", a), ("b", b), ("bias", bias)), options)
    try:
        prog = _memo.get(key)
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        prog = None
    if prog is None:
        act = _activation(activation)
        ops = _Operands(a, b)
        if bias is not None:
            ops.check("bias", ops.add("bias", bias), shape=(ops.n,))
        ptrs = ops.given()
        prog = _forward_program(ops, a, act, bool(save_for_backward), bool(allow_tf32))
        _memo.put(key, prog)  # not kept for an unhashable option that passed the checks
    return _execute(prog, ptrs, {}, stream)


# activation -> the cuBLASLt epilogue family that computes it exactly (its GELU is the tanh approximation).
# relu into a 16-bit output rounds as torch's relu(addmm(bias, a, b)) does: cuBLASLt rounds a @ b to the io
# dtype before it adds the bias (tools/probe_bias_rounding.py), so where a @ b and the bias nearly cancel the
# sign of y can differ from the exact pre-activation's, as torch's does; its backward reads y (AUX_IS_Y), so
# the gradient is torch's relu gradient. Not RELU_AUX_BIAS: its bit mask disagreed with y's sign on unaligned
# shapes (bf16 and fp16, H100, cuBLAS 13: computed, we infer, before a @ b was rounded).
LT_FORWARD = {"identity": "BIAS", "gelu_tanh": "GELU", "relu": "RELU"}


def _lt_epilogue(act: Activation, has_bias: bool, save: bool) -> str:
    """The cuBLASLt epilogue of a forward GEMM that does the whole layer (act in LT_FORWARD)."""
    family = LT_FORWARD.get(act.name)
    if family == "GELU":
        return family + ("_AUX" if save else "") + ("_BIAS" if has_bias else "")
    if family == "RELU":  # no aux: the backward reads y
        return family + ("_BIAS" if has_bias else "")
    return "BIAS" if has_bias else "DEFAULT"


def _forward_program(ops: _Operands, like: Any, act: Activation, save: bool, allow_tf32: bool) -> _Program:
    bld = _Builder(ops, like)
    y = bld.output("y", ops.y_shape, contiguous_strides(ops.y_shape), ops.dtype)
    aux = None
    if save and act.name not in ("identity", *AUX_IS_Y):
        if act.name in MASK_ACTS:
            aux = bld.output("aux", ops.mask_shape, contiguous_strides(ops.mask_shape), "mask")
        else:
            aux = bld.output("aux", ops.y_shape, contiguous_strides(ops.y_shape), ops.dtype)
    if not _forward_lt(bld, act, y, aux, allow_tf32):
        _forward_blas(bld, act, y, aux, allow_tf32)
    return bld.program(("y", "y" if save and act.name in AUX_IS_Y else "aux" if aux is not None else None))


def _forward_lt(bld: _Builder, act: Activation, y: Loc, aux: Loc | None, allow_tf32: bool) -> bool:
    """The forward on cuBLASLt: one GEMM whose epilogue does the whole layer (identity, relu, gelu_tanh); else one
    GEMM writing the pre-activation plus one pass from it to y. False where cuBLASLt takes neither (the
    caller plans cuBLAS)."""
    ops = bld.ops
    bias = Loc("bias") if "bias" in ops.infos else None
    bias_stride = ops.infos["bias"].strides[0] if bias is not None else 1
    x = lambda loc, dtype=ops.dtype: _rows_mat(ops, loc, dtype).flat_rows()  # noqa: E731 - contiguous
    mask = aux is not None and act.name in MASK_ACTS
    if act.name in LT_FORWARD and bld.lt(x(y), ops.a.flat_rows(), ops.b, tf32=allow_tf32,
                                         epilogue=_lt_epilogue(act, bias is not None, aux is not None),
                                         bias=bias, aux=aux, bias_stride=bias_stride):
        return True
    if act.name in MASK_ACTS and ops.dtype != "float32":
        # leaky_relu (no cuBLASLt epilogue): the GEMM writes f32 and the pass adds the bias, rounding once,
        # so the sign its derivative reads is the exact pre-activation's up to one rounding.
        acc = bld.buffer("acc", ops.rows * ops.n * 4)
        if not bld.lt(x(acc, "float32"), ops.a.flat_rows(), ops.b, tf32=allow_tf32):
            return False
        _act_pass(bld, act, acc=acc, acc_type="float", bias=bias, pre=None, y=y, mask=aux if mask else None)
        return True
    # The GEMM writes pre into the saved pre-activation, else into y (the pass then runs in place).
    d = aux if (aux is not None and not mask) else y
    if not bld.lt(x(d), ops.a.flat_rows(), ops.b, tf32=allow_tf32, epilogue="BIAS" if bias else "DEFAULT",
                  bias=bias, bias_stride=bias_stride):
        return False
    if act.name != "identity":
        _act_pass(bld, act, acc=d, acc_type=CTYPES[ops.dtype], bias=None, pre=None, y=y, mask=aux if mask else None)
    return True


def _forward_blas(bld: _Builder, act: Activation, y: Loc, aux: Loc | None, allow_tf32: bool) -> None:
    """cuBLAS writes a @ b in f32 (in place for float32 io), one pass adds the bias, rounds once and applies
    the activation; identity without bias is the GEMM alone, one rounding."""
    ops = bld.ops
    bias = Loc("bias") if "bias" in ops.infos else None
    if act.name == "identity" and bias is None:
        bld.gemm(_rows_mat(ops, y, ops.dtype), ops.a, ops.b, beta=0.0, allow_tf32=allow_tf32)
        return
    mask = aux is not None and act.name in MASK_ACTS
    pre = aux if (aux is not None and not mask) else None
    acc = (pre or y) if ops.dtype == "float32" else bld.buffer("acc", ops.rows * ops.n * 4)
    bld.gemm(_rows_mat(ops, acc, "float32"), ops.a, ops.b, beta=0.0, allow_tf32=allow_tf32)
    _act_pass(bld, act, acc=acc, acc_type="float", bias=bias, pre=pre, y=y, mask=aux if mask else None)


def _act_pass(bld: _Builder, act: Activation, *, acc: Loc, acc_type: str, bias: Loc | None, pre: Loc | None,
              y: Loc, mask: Loc | None) -> None:
    ops = bld.ops
    n, rows = ops.n, ops.rows
    v = _vec(bld, n, acc, pre, y)
    if acc_type == CTYPES[ops.dtype] and bias is None and pre is None and mask is None and v > 1:
        vectors = rows * n // v  # contiguous [rows, n], rows 16-byte aligned: one flat array of vectors
        bld.kernel(_flat_name(CTYPES[ops.dtype], v, ACT_CODES[act.name]),
                   (_cdiv(vectors, FLAT_THREADS * FLAT_ITEMS),), FLAT_THREADS,
                   [acc, y, _i64(vectors), _f32(act.param or 0.0)], group=act.name)
        return
    grid = (_cdiv(n, 32 * v), max(1, min(_cdiv(rows, WARPS * UNROLL), _sm_count(ops.device) * 8)))
    bias_stride = ops.infos["bias"].strides[0] if bias is not None else 0
    bld.kernel(_fwd_name(CTYPES[ops.dtype], acc_type, v, ACT_CODES[act.name]), grid, BLOCK,
               [acc, bias, _i64(bias_stride), pre, y, mask, _i64(rows), _i32(n), _i32(mask_words(n)),
                _f32(act.param or 0.0)], group=act.name)


# ------------------------------------------------------------------------------------------ backward


def gemm_bias_act_backward(dy: Any, a: Any, b: Any, aux: Any, *, activation: Any,
                           need: Any = ("a", "b", "bias"), accumulate: bool = False, da: Any = None,
                           db: Any = None, dbias: Any = None, allow_tf32: bool = False,
                           chunks: int | None = None, stream: Any = None) -> tuple[Any, Any, Any]:
    """(da, db, dbias) of y = act(a @ b + bias) given dy and the forward's aux; None for those not in `need`.

    da has a's shape and matrix order, db b's (b = W.T gives db = dW.T, W's layout), dbias is [N]. With
    da=/db=/dbias= buffers the results are written there (overwritten), or added to them with
    accumulate=True (which needs a buffer for every needed gradient). For batched a, dB and dbias sum
    over the batch. dy must be contiguous. `chunks` (default 1) > 1 overlaps the elementwise pass with dA's
    GEMM in row chunks on a side stream.
    """
    options = ("backward", activation, need, accumulate, allow_tf32, chunks)
    key, ptrs = _memo_key((("dy", dy), ("a", a), ("b", b), ("aux", aux), ("da", da), ("db", db), ("dbias", dbias)),
                          options)
    try:
        prog = _memo.get(key)
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        prog = None
    if prog is None:
        act = _activation(activation)
        need = _need(need)
        ops = _Operands(a, b)
        _check_backward(ops, dy, aux, act, need, accumulate, {"a": da, "b": db, "bias": dbias})
        if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise SpecError("chunks", chunks, "expected a positive int")
        if not need:
            return None, None, None
        ptrs = ops.given()
        prog = _backward_program(ops, a, act, need, bool(accumulate), bool(allow_tf32), chunks or 1)
        _memo.put(key, prog)  # an unhashable option that passed the checks (a list for `need`): not kept
    given = {name: obj for name, obj in (("da", da), ("db", db), ("dbias", dbias)) if obj is not None}
    return _execute(prog, ptrs, given, stream)


def _check_backward(ops: _Operands, dy: Any, aux: Any, act: Activation, need: tuple, accumulate: bool,
                    given: dict) -> None:
    ops.check("dy", ops.add("dy", dy), shape=ops.y_shape, contiguous=True)
    mode = _aux_kind(act.name)
    if mode == AUX_MASK:
        ops.check("aux", ops.add("aux", aux), shape=ops.mask_shape, dtype="mask", contiguous=True)
    elif mode == AUX_PRE:
        ops.check("aux", ops.add("aux", aux), shape=ops.y_shape, contiguous=True)
    for role in need:
        obj = given[role]
        if obj is None:
            if accumulate:
                raise BufferMismatchError(f"d{role}", "buffer", "a buffer to accumulate into (accumulate=True)",
                                          None)
            continue
        ops.check(f"d{role}", ops.add(f"d{role}", obj), shape=_grad_shape(ops, role))


def _dbias_stride(ops: _Operands) -> int:
    """The bias gradient's stride: the given buffer's, else 1 (the one allocated is dense)."""
    return ops.infos["dbias"].strides[0] if "dbias" in ops.infos else 1


def _grad_shape(ops: _Operands, role: str) -> tuple[int, ...]:
    return (ops.n,) if role == "bias" else tuple(ops.infos[role].shape)


def _backward_program(ops: _Operands, like: Any, act: Activation, need: tuple, accumulate: bool,
                      allow_tf32: bool, chunks: int) -> _Program:
    bld = _Builder(ops, like)
    mats = {}
    for role in need:  # outputs we allocate: dense, in the layout of the input they are the grad of
        name = f"d{role}"
        if name not in ops.infos:
            shape = _grad_shape(ops, role)
            strides = (1,) if role == "bias" else _dense_like(shape, tuple(ops.infos[role].strides))
            bld.output(name, shape, strides, ops.dtype)
            info = BufferInfo(0, shape, strides, ops.dtype, ops.device, ops.framework)
        else:
            info = ops.infos[name]
        if role != "bias":
            mats[role] = ops.mat(name, info)
    mode = _aux_kind(act.name)
    tf32 = allow_tf32 and ops.dtype == "float32"
    # grad_pre: dy itself for identity, else a contiguous scratch [rows, n]
    g_loc = Loc("dy") if mode == AUX_NONE or not ("a" in need or "b" in need) else \
        bld.buffer("g", ops.rows * ops.n * ops.itemsize)
    g = Mat(g_loc, ops.m, ops.n, ops.n, 1, ops.dtype, ops.batch, ops.m * ops.n if ops.batch > 1 else 0)
    b_done = False
    if mode == AUX_NONE and "bias" in need and "b" in need and not accumulate:  # dbias from dB's epilogue
        b_done = bld.lt(mats["b"], ops.a.T.flat_cols(), g.flat_rows(), tf32=tf32, epilogue="BGRADA",
                        bias=Loc("dbias"), bias_stride=_dbias_stride(ops))
    run_pass = (mode != AUX_NONE and g_loc.name == "g") or ("bias" in need and not b_done)
    fx = mats["a"].flat_rows() if "a" in need else None
    bounds = [(0, ops.rows)]
    if run_pass and mode != AUX_NONE and fx is not None and chunks > 1 and ops.rows >= 2 * WARPS * UNROLL * 4:
        bounds = _chunk_bounds(ops.rows, chunks)
    beta = 1.0 if accumulate else 0.0
    side_done = False
    if run_pass:
        side_done = _grad_pre_pass(bld, act, mode, need, g, fx, bounds, accumulate=accumulate, beta=beta,
                                   allow_tf32=allow_tf32)
    if "a" in need and not side_done and not bld.lt(fx, g.flat_rows(), ops.b.T, tf32=tf32, accumulate=accumulate):
        bld.gemm(mats["a"], g, ops.b.T, beta=beta, allow_tf32=allow_tf32)
    if "b" in need and not b_done and not bld.lt(mats["b"], ops.a.T.flat_cols(), g.flat_rows(), tf32=tf32,
                                                 accumulate=accumulate):
        _grad_b(bld, mats["b"], g, beta=beta, allow_tf32=allow_tf32, accumulate=accumulate)
    return bld.program(tuple(f"d{r}" if r in need else None for r in ROLES))


def _grad_pre_pass(bld: _Builder, act: Activation, mode: int, need: tuple, g: Mat, fx: Mat | None,
                   bounds: list, *, accumulate: bool, beta: float, allow_tf32: bool) -> bool:
    """grad_pre = dy * act'(pre) (into g, unless identity) with the bias gradient's per-block column sums,
    per row chunk; with several chunks, dA's chunk GEMMs on a side stream (True: dA is planned)."""
    ops = bld.ops
    n, t = ops.n, CTYPES[ops.dtype]
    g_out = g.ptr if g.ptr.name == "g" else None
    pre = Loc("aux") if mode == AUX_PRE else None
    v = _vec(bld, n, Loc("dy"), pre, g_out)
    name = f"act_bwd<{t}, {v}, {mode}, {ACT_CODES[act.name]}>"
    bps = _blocks_per_sm(ops.dtype, ops.device, name, act.name)
    rpb = _rows_per_block(bounds[0][1] - bounds[0][0], n, v, ops.device, bps)
    blocks = [_cdiv(r1 - r0, rpb) for r0, r1 in bounds]
    partial = bld.buffer("partial", sum(blocks) * n * 4) if "bias" in need else None
    side = _SideGemms(bld, fx, g, allow_tf32=allow_tf32, beta=beta) if len(bounds) > 1 and "a" in need else None
    mask_ld, first = mask_words(n), 0
    for (r0, r1), nb in zip(bounds, blocks):
        bld.kernel(name, (_cdiv(n, 32 * v), nb), BLOCK,
                   [Loc("dy", r0 * n * ops.itemsize), pre + r0 * n * ops.itemsize if pre else None,
                    Loc("aux", r0 * mask_ld * 4) if mode == AUX_MASK else None,
                    g_out + r0 * n * ops.itemsize if g_out else None,
                    partial + first * n * 4 if partial else None,
                    _i64(r1 - r0), _i32(n), _i32(rpb), _i32(mask_ld), _f32(act.param or 0.0)], group=act.name)
        first += nb
        if side is not None:
            side.chunk(r0, r1)
    if side is not None:
        side.join()
    if partial is not None:
        bld.kernel(f"bias_finalize<{t}>", _grid_1d(n), 256, [partial, _i32(sum(blocks)), _i32(n), Loc("dbias"),
                                                              _i64(_dbias_stride(ops)), _i32(int(accumulate))])
    return side is not None


class _SideGemms:
    """dA's row chunks on a side stream, each as soon as the pass has written its rows (cuBLAS, a second
    handle: it runs beside the main handle's GEMMs)."""

    def __init__(self, bld: _Builder, fx: Mat, g: Mat, *, allow_tf32: bool, beta: float):
        self.bld, self.fx, self.fg, self.b_t = bld, fx, g.flat_rows(), bld.ops.b.T
        self.allow_tf32, self.beta = allow_tf32, beta
        self.side = _side_stream(bld.ops.device)
        self.events: list = []

    def chunk(self, r0: int, r1: int) -> None:
        event = _event(self.bld.ops.device, len(self.events))
        self.events.append(event)
        side, device, dtype = self.side, self.bld.ops.device, self.bld.ops.dtype
        x, p, q, beta, allow_tf32 = self.fx.row_slice(r0, r1), self.fg.row_slice(r0, r1), self.b_t, self.beta, \
            self.allow_tf32

        def step(ptrs: dict, stream: int) -> None:
            event.record(external_stream(stream))
            side.wait_event(event)
            handle = blas.side_handle(device, side.ptr)
            compute = blas.compute_type(dtype, allow_tf32=allow_tf32, handle=handle)
            blas.gemm(handle, _bind(x, ptrs), _bind(p, ptrs), _bind(q, ptrs), beta=beta, compute=compute)

        self.bld.steps.append(step)

    def join(self) -> None:
        """The main stream waits for every dA chunk (reusing the last chunk's event)."""
        side, event = self.side, self.events[-1]

        def step(ptrs: dict, stream: int) -> None:
            event.record(side)
            external_stream(stream).wait_event(event)

        self.bld.steps.append(step)


def _grad_b(bld: _Builder, x: Mat, g: Mat, *, beta: float, allow_tf32: bool, accumulate: bool) -> None:
    """dB = sum over batches of a[i].T @ g[i]: one GEMM when the batch flattens, else per batch in f32."""
    ops = bld.ops
    at = ops.a.T  # [Bt, K, M]
    pa, pg = at.flat_cols(), g.flat_rows()
    if pa is not None and pg is not None:
        bld.gemm(x, pa, pg, beta=beta, allow_tf32=allow_tf32)
        return
    if ops.dtype == "float32":  # accumulating in the io dtype is f32 accumulation already
        for i in range(ops.batch):
            bld.gemm(x, at.item(i), g.item(i), beta=beta if i == 0 else 1.0, allow_tf32=allow_tf32)
        return
    acc = Mat(bld.buffer("db_acc", ops.k * ops.n * 4), ops.k, ops.n, ops.n, 1, "float32")
    for i in range(ops.batch):
        bld.gemm(acc, at.item(i), g.item(i), beta=0.0 if i == 0 else 1.0, allow_tf32=allow_tf32)
    bld.kernel(f"convert_add<{CTYPES[ops.dtype]}>", _grid_1d(ops.k * ops.n), 256,
               [acc.ptr, x.ptr, _i32(ops.k), _i32(ops.n), _i64(x.rs), _i64(x.cs), _i32(int(accumulate))])


# Priority of the side stream that runs dA's row chunks (None: the default, lowest). A higher priority
# (more negative) lets those GEMMs take SMs first while the next chunk's elementwise pass fills the rest.
SIDE_STREAM_PRIORITY: int | None = None


@functools.lru_cache(maxsize=None)
def _side_stream_cached(device: int, thread: int, priority: int | None) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.cuda.Stream(non_blocking=True, priority=priority)


def _side_stream(device: int) -> Any:
    return _side_stream_cached(device, threading.get_ident(), SIDE_STREAM_PRIORITY)


@functools.lru_cache(maxsize=None)
def _event_cached(device: int, thread: int, index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.cuda.Event(block=False, disable_timing=True)


def _event(device: int, index: int) -> Any:
    """Reusable events: a wait captures the record made before it, so reuse across calls is safe."""
    return _event_cached(device, threading.get_ident(), index)


def mask_words(n: int) -> int:
    """32-bit words per row of the relu / leaky_relu bit mask: n bits padded to cuBLASLt's 128."""
    return cublaslt.relu_mask_ld(n) // 32
