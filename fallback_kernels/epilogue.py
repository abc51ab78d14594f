"""Launchers for epilogue.cu: the conv epilogue as one CUDA kernel when cuDNN has no fused engine."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cudnn_graphs.execute.streams import external_stream
from cudnn_graphs.spec.activations import ACTIVATIONS

from . import compile as _compile

ACT_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}  # order matches the enum in epilogue.cu
# io dtype -> (C++ storage type, math type)
CTYPES = {"float16": ("half_t", "float"), "bfloat16": ("bf16_t", "float"), "float32": ("float", "float"),
          "float64": ("double", "double")}
KERNELS = ("epilogue_fwd", "epilogue_act_backward")
OPTIONS = _compile.BASE_OPTIONS
BLOCK = 256


def source() -> str:
    return _compile.source("epilogue.cu")


def name_expressions() -> list[str]:
    names = []
    for io, (t, a) in CTYPES.items():
        for c in sorted({a, t}):
            names += [f"{k}<{t}, {a}, {c}>" for k in KERNELS]
        names.append(f"bias_grad<{t}, {a}>")
    return names


def _module(device: int) -> Any:
    return _compile.load_module("epilogue.cu", tuple(name_expressions()), device, OPTIONS)


def _meta(shape, *strides_per_tensor) -> np.ndarray:
    meta = np.zeros(1 + 5 + 5 * 4, dtype=np.int64)
    meta[0] = len(shape)
    meta[1:1 + len(shape)] = shape
    for t, strides in enumerate(strides_per_tensor):
        meta[6 + 5 * t:6 + 5 * t + len(strides)] = strides
    return meta


@dataclass
class KernelPart:
    """A non-cuDNN step of a plan: one kernel launch reading and writing role buffers."""

    name: str
    roles: tuple[str, ...]
    engine: str
    device: int
    function: Any = field(repr=False)
    meta: Any = field(repr=False)  # device array, kept alive with the plan
    grid: int
    block: int
    make_args: Any = field(repr=False)
    workspace_size: int = 0
    behavior_notes: tuple[str, ...] = ()
    numerical_notes: tuple[str, ...] = ()
    deterministic: bool = True  # elementwise, or one block per channel with a fixed reduction order

    def prepare(self, ptrs: dict[str, int]) -> tuple:
        return self.make_args({role: np.uint64(ptrs.get(role, 0)) for role in self.roles}, np.uint64(self.meta.data.ptr))

    def runner(self, slots: dict[str, int], fixed: dict[str, int], workspace_ptr: int, stream_ptr: int,
               handle: Any) -> Any:
        """`run(ptrs)` launching the kernel on `stream_ptr`, `ptrs[slots[role]]` being a role's pointer
        in this call and `fixed` holding the rest (scratch)."""
        import cupy

        stream = external_stream(stream_ptr)
        dynamic = [(role, slots[role]) for role in self.roles if role in slots]
        base = {role: fixed.get(role, 0) for role in self.roles}
        launch = functools.partial(self.function, (self.grid,), (self.block,))
        device = self.device

        def run(ptrs) -> None:
            args = self.prepare({**base, **{role: ptrs[slot] for role, slot in dynamic}})
            if cupy.cuda.runtime.getDevice() != device:  # a module is loaded per device: switch for the launch
                with cupy.cuda.Device(device):
                    return launch(args, stream=stream)
            launch(args, stream=stream)

        return run


def _grid(n: int) -> int:
    return max(1, min((n + BLOCK - 1) // BLOCK, 65535))


def _upload(meta: np.ndarray, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(meta)


def fwd_epilogue(spec, acc, device: int) -> KernelPart:
    """y = act(alpha*acc + bias + beta*z) for a ConvFwdSpec; `acc` is the conv output's TensorDesc."""
    t = spec.tensors()
    y, z = t["y"], t.get("z")
    io, a = CTYPES[spec.dtype]
    c = CTYPES[acc.dtype][0]
    name = f"epilogue_fwd<{io}, {a}, {c}>"
    real = np.float64 if a == "double" else np.float32
    act = spec.activation
    meta = _upload(_meta(y.shape, acc.strides, y.strides, z.strides if z else ()), device)
    n = int(np.prod(y.shape))
    roles = ("acc", "y") + (("bias",) if spec.bias else ()) + (("z",) if spec.residual else ())

    def make_args(p, meta_ptr):
        return (p["acc"], p.get("bias", np.uint64(0)), p.get("z", np.uint64(0)), p["y"], meta_ptr, np.int64(n),
                real(spec.alpha), real(spec.beta), np.int32(ACT_CODES[act.name]), real(act.param or 0.0))

    return KernelPart("fwd_epilogue", roles, f"kernel:{name}", device, _module(device).get_function(name),
                      meta, _grid(n), BLOCK, make_args)


def act_backward(spec, acc, device: int) -> KernelPart:
    """dx = acc * act'(pre_act) for a ConvBwdDataSpec."""
    t = spec.tensors()
    dx, pre = t["dx"], t["pre_act"]
    io, a = CTYPES[spec.dtype]
    name = f"epilogue_act_backward<{io}, {a}, {CTYPES[acc.dtype][0]}>"
    real = np.float64 if a == "double" else np.float32
    act = spec.activation_backward
    meta = _upload(_meta(dx.shape, acc.strides, dx.strides, pre.strides), device)
    n = int(np.prod(dx.shape))

    def make_args(p, meta_ptr):
        return (p["acc"], p["pre_act"], p["dx"], meta_ptr, np.int64(n), np.int32(ACT_CODES[act.name]),
                real(act.param or 0.0))

    return KernelPart("act_backward", ("acc", "pre_act", "dx"), f"kernel:{name}", device,
                      _module(device).get_function(name), meta, _grid(n), BLOCK, make_args)


def bias_grad(spec, device: int) -> KernelPart:
    """db[k] = sum of dy[:, k, ...] in a fixed order (deterministic) for a ConvBwdFilterSpec."""
    dy = spec.tensors()["dy"]
    io, a = CTYPES[spec.dtype]
    name = f"bias_grad<{io}, {a}>"
    meta = _upload(_meta(dy.shape, dy.strides), device)

    def make_args(p, meta_ptr):
        return (p["dy"], p["db"], meta_ptr)

    return KernelPart("bias_grad", ("dy", "db"), f"kernel:{name}", device, _module(device).get_function(name),
                      meta, spec.w_shape[0], BLOCK, make_args)
