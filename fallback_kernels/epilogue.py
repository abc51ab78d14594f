"""Launchers for epilogue.cu: the conv epilogue as one CUDA kernel when cuDNN has no fused engine."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

from gpu_launch import driver
from gpu_launch.activations import ACTIVATIONS

from . import compile as _compile
from .types import CTYPES

ACT_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}  # order matches the enum in epilogue.cu
KERNELS = ("epilogue_fwd", "epilogue_fwd_dense", "epilogue_act_backward")
OPTIONS = _compile.BASE_OPTIONS
BLOCK = 256


def source() -> str:
    return _compile.source("epilogue.cu")


def name_expressions() -> list[str]:
    names = []
    for io, (t, a) in CTYPES.items():
        for c in sorted({a, t}):
            names += [f"{k}<{t}, {a}, {c}>" for k in KERNELS]
        names += [f"bias_grad<{t}, {a}>", f"bias_grad_chunks<{t}, {a}>"]
    return names


class _Meta(ctypes.Structure):
    """epilogue.cu's `Meta`, passed by value: rank, shape[5], then 5 strides per tensor (up to 4)."""

    _fields_ = [("v", ctypes.c_longlong * 26)]


def _meta(shape, *strides_per_tensor) -> _Meta:
    meta = _Meta()
    meta.v[0] = len(shape)
    for d, n in enumerate(shape):
        meta.v[1 + d] = n
    for t, strides in enumerate(strides_per_tensor):
        for d, st in enumerate(strides):
            meta.v[6 + 5 * t + d] = st
    return meta


@dataclass
class KernelPart:
    """A non-cuDNN step of a plan: one kernel, launched once or more, reading and writing role buffers.

    `args` are the kernel's arguments in order: a role name (that buffer's pointer, given per call),
    "workspace" (the plan's workspace, `workspace_size` bytes of it) or a ctypes value. `then` holds
    further launches of the same kernel, (grid, block, args) each, run in order after the first.
    The cubin travels in the plan's record, so a warm process only loads it.
    """

    name: str
    roles: tuple[str, ...]
    engine: str
    device: int
    cubin: bytes = field(repr=False)
    function_name: str = field(repr=False)  # the instantiation's lowered (mangled) name
    grid: int
    block: int | tuple[int, int]
    args: tuple = field(repr=False)
    then: tuple = field(default=(), repr=False)
    workspace_size: int = 0
    behavior_notes: tuple[str, ...] = ()
    numerical_notes: tuple[str, ...] = ()
    deterministic: bool = True  # elementwise, or one block per channel with a fixed reduction order
    source: str = ""  # source_digest() of the text the cubin was compiled from (kept in the record)

    def runner(self, slots: dict[str, int], fixed: dict[str, int], workspace_ptr: int, stream_ptr: int,
               handles: Any) -> Any:
        """`run(ptrs)` launching the kernel on `stream_ptr`, `ptrs[slots[role]]` being a role's pointer
        in this call and `fixed` holding the rest (scratch). Arguments are packed once, here."""
        fn = driver.function(self.cubin, self.function_name, self.device)
        launches, patch, fixed = [], [], {**fixed, "workspace": workspace_ptr}
        for grid, block, args in ((self.grid, self.block, self.args), *self.then):
            values = [self._value(arg, slots, fixed, patch) for arg in args]
            launches.append(driver.Kernel(fn, grid=grid, block=block, args=values, ordinal=self.device).launch)
        launches, patch = tuple(launches), tuple(patch)

        def run(ptrs) -> None:
            for value, slot in patch:
                value.value = ptrs[slot]
            for launch in launches:
                launch(stream_ptr)

        return run

    @staticmethod
    def _value(arg, slots: dict[str, int], fixed: dict[str, int], patch: list) -> Any:
        if not isinstance(arg, str):
            return type(arg).from_buffer_copy(arg)
        value = ctypes.c_uint64(fixed.get(arg, 0))
        if arg in slots:
            patch.append((value, slots[arg]))
        return value


def _grid(n: int) -> int:
    return max(1, min((n + BLOCK - 1) // BLOCK, 65535))


def _part(name: str, roles: tuple[str, ...], expression: str, device: int, grid: int | tuple, args: tuple,
          compiled: tuple[bytes, str] | None, *, block: int | tuple[int, int] = BLOCK, then: tuple = (),
          workspace_size: int = 0) -> KernelPart:
    if compiled is not None and not _names(compiled[1], expression):
        compiled = None  # a record from a version that chose another kernel for this part: its arguments differ
    cubin, lowered = compiled or _compile.cubin("epilogue.cu", expression, _arch(device), OPTIONS)
    driver.function(cubin, lowered, device)  # load now: a stored cubin that will not load fails the plan's load
    return KernelPart(name, roles, f"kernel:{expression}", device, cubin, lowered, grid, block, args, then,
                      workspace_size, source=source_digest())


def source_digest() -> str:
    """What a stored cubin of these kernels must have been compiled from to be loaded (else compiled again)."""
    return _compile.source_digest("epilogue.cu", OPTIONS)


def _names(lowered: str, expression: str) -> bool:
    """Whether a lowered (Itanium-mangled) name is an instantiation of `expression`'s kernel template."""
    base = expression.split("<", 1)[0]
    return lowered.startswith(f"_Z{len(base)}{base}I")


def _arch(device: int) -> str:
    major, minor = driver.compute_capability(device)
    return f"sm_{major}{minor}"


def _real(math_type: str):
    return ctypes.c_double if math_type == "double" else ctypes.c_float


def fwd_epilogue(spec, acc, device: int, compiled: tuple[bytes, str] | None = None) -> KernelPart:
    """y = act(alpha*acc + bias + beta*z) for a ConvFwdSpec; `acc` is the conv output's TensorDesc.
    `compiled`: (cubin, lowered name) from a stored plan, else compiled now."""
    t = spec.tensors()
    y, z = t["y"], t.get("z")
    io, a = CTYPES[spec.dtype]
    real, act = _real(a), spec.activation
    n = math.prod(y.shape)
    absent = ctypes.c_uint64(0)
    pointers = ("acc", "bias" if spec.bias else absent, "z" if spec.residual else absent, "y")
    scalars = (real(spec.alpha), real(spec.beta), ctypes.c_int32(ACT_CODES[act.name]), real(act.param or 0.0))
    roles = ("acc", "y") + (("bias",) if spec.bias else ()) + (("z",) if spec.residual else ())
    cstride = _dense_channel_stride(y.shape, acc.strides, y.strides, *((z.strides,) if z else ()))
    kernel = "epilogue_fwd" if cstride is None else "epilogue_fwd_dense"
    if cstride is None:
        args = (*pointers, _meta(y.shape, acc.strides, y.strides, z.strides if z else ()), ctypes.c_int64(n), *scalars)
    else:
        args = (*pointers, ctypes.c_int64(n), ctypes.c_int64(cstride), ctypes.c_int64(y.shape[1]), *scalars)
    return _part("fwd_epilogue", roles, f"{kernel}<{io}, {a}, {CTYPES[acc.dtype][0]}>", device, _grid(n), args,
                 compiled)


def _dense_channel_stride(shape, *strides_per_tensor) -> int | None:
    """The channel dim's stride when every tensor has the same dense strides (the dims in some order, no
    gaps): offset i then holds the same element in each, of channel (i / stride) % C. Else None."""
    strides = strides_per_tensor[0]
    if any(tuple(s) != tuple(strides) for s in strides_per_tensor[1:]):
        return None
    expected = 1
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], -d)):
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    return strides[1]


def act_backward(spec, acc, device: int, compiled: tuple[bytes, str] | None = None) -> KernelPart:
    """dx = acc * act'(pre_act) for a ConvBwdDataSpec."""
    t = spec.tensors()
    dx, pre = t["dx"], t["pre_act"]
    io, a = CTYPES[spec.dtype]
    act = spec.activation_backward
    n = math.prod(dx.shape)
    args = ("acc", "pre_act", "dx", _meta(dx.shape, acc.strides, dx.strides, pre.strides), ctypes.c_int64(n),
            ctypes.c_int32(ACT_CODES[act.name]), _real(a)(act.param or 0.0))
    return _part("act_backward", ("acc", "pre_act", "dx"), f"epilogue_act_backward<{io}, {a}, {CTYPES[acc.dtype][0]}>",
                 device, _grid(n), args, compiled)


def bias_grad(spec, device: int, compiled: tuple[bytes, str] | None = None) -> KernelPart:
    """db[k] = sum of dy[:, k, ...] in a fixed order (deterministic) for a ConvBwdFilterSpec."""
    dy = spec.tensors()["dy"]
    io, a = CTYPES[spec.dtype]
    k = dy.shape[1]
    if _dense_channel_stride(dy.shape, dy.strides) == 1:  # channels last: rows of K, read across channels
        return _bias_grad_chunks(dy, io, a, device, compiled)
    return _part("bias_grad", ("dy", "db"), f"bias_grad<{io}, {a}>", device, k, ("dy", "db", _meta(dy.shape, dy.strides)),
                 compiled)


CHUNK_BLOCKS = 512  # blocks of 32x32 threads to aim for in a chunked pass: a few waves on an H100's 132 SMs
CHUNK_MIN_ROWS = 1024  # fewer rows than this per block and the second pass costs more than it saves


def bias_chunks(rows: int, channels: int) -> tuple[int, int]:
    """(rows per chunk, chunks) for bias_grad_chunks: a multiple of its 128-row stride, from the shape alone."""
    tiles = (channels + 31) // 32
    chunk = max(CHUNK_MIN_ROWS, -(-rows // max(1, CHUNK_BLOCKS // tiles)))
    chunk = -(-chunk // 128) * 128
    return chunk, -(-rows // chunk)


def _bias_grad_chunks(dy, io: str, a: str, device: int, compiled) -> KernelPart:
    k = dy.shape[1]
    rows, tiles = math.prod(dy.shape) // k, (k + 31) // 32
    chunk, chunks = bias_chunks(rows, k)
    expression, block = f"bias_grad_chunks<{io}, {a}>", (32, 32)
    common = (ctypes.c_int32(k), ctypes.c_int64(chunk))
    if chunks == 1:
        args = ("dy", ctypes.c_uint64(0), "db", ctypes.c_int64(rows), *common, ctypes.c_int32(2))
        return _part("bias_grad", ("dy", "db"), expression, device, tiles, args, compiled, block=block)
    first = ("dy", "workspace", "db", ctypes.c_int64(rows), *common, ctypes.c_int32(0))
    final = ("dy", "workspace", "db", ctypes.c_int64(chunks), *common, ctypes.c_int32(1))
    size = chunks * k * ctypes.sizeof(_real(a))
    return _part("bias_grad", ("dy", "db"), expression, device, (tiles, chunks), first, compiled, block=block,
                 then=((tiles, block, final),), workspace_size=-(-size // 256) * 256)
