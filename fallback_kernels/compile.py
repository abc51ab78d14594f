"""One way to turn a shipped .cu file into a loaded module: NVRTC through CuPy, per device, cached.

CuPy's RawModule keeps the compiled binary in its on-disk kernel cache ($CUPY_CACHE_DIR, default
~/.cupy/kernel_cache), so a second process loads it instead of compiling again; this module adds the
per-process memo and turns compiler failures into `KernelCompileError` with the log and options.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from typing import Any, Sequence

from gpu_launch.errors import KernelCompileError

BASE_OPTIONS = ("--std=c++17",)


_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh?)"[ \t]*$', re.M)


def source(filename: str) -> str:
    """The text of a kernel source shipped in this package, with its local `#include "x.cuh"` lines (and
    grid_sample.cu's `#include "x.cu"`) replaced by the included files' text, recursively, each file once
    (a later include of it is dropped, as `#pragma once` would drop it): NVRTC then needs no include path,
    and CuPy's on-disk kernel cache and NVRTC, which see only this text, see every included file's."""
    return _expand(filename, set())


def _expand(filename: str, seen: set[str]) -> str:
    seen.add(filename)
    return _LOCAL_INCLUDE.sub(lambda m: "" if m.group(1) in seen else _expand(m.group(1), seen), _read(filename))


def _read(filename: str) -> str:
    return importlib.resources.files(__package__).joinpath(filename).read_text()


@functools.lru_cache(maxsize=None)
def load_module(filename: str, name_expressions: tuple[str, ...], device: int,
                options: tuple[str, ...] = BASE_OPTIONS) -> Any:
    """A compiled cupy.RawModule of `filename` for `device`; raises KernelCompileError."""
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source(filename), options=options, name_expressions=name_expressions)
        try:
            module.compile()
        except cupy.cuda.compiler.CompileException as err:
            raise KernelCompileError(filename, str(err), options) from err
    return module


@functools.lru_cache(maxsize=None)
def source_digest(filename: str, options: tuple[str, ...] = BASE_OPTIONS) -> str:
    """A short digest of a kernel source's text (its includes pasted) and compile options: stored with a
    cubin in a plan record, so a record whose cubin came from other source is compiled again, not run."""
    import hashlib

    text = "\0".join((source(filename), *options))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def cubin(filename: str, name_expression: str, arch: str, options: tuple[str, ...] = BASE_OPTIONS) -> tuple[bytes, str]:
    """(cubin, lowered name) of one kernel instantiation for `arch` (e.g. "sm_90"), compiled with NVRTC
    (no GPU needed). Plans keep the cubin in their record, so a warm process loads it with the driver
    and neither compiles nor imports CuPy."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(filename), filename, [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, [*options, f"--gpu-architecture={arch}"])
        except Exception as err:  # the status alone says nothing: attach the compiler's log
            raise KernelCompileError(filename, f"{err}\n{nvrtc.getProgramLog(prog)}", options) from err
        return bytes(nvrtc.getCUBIN(prog)), nvrtc.getLoweredName(prog, name_expression)
    finally:
        nvrtc.destroyProgram(prog)


def cufunctions(filename: str, names: dict, device: int) -> dict:
    """{key: CUfunction} of `names` ({key: name expression}) compiled together from `filename` for `device`."""
    module = load_module(filename, tuple(names.values()), device)
    return {key: cufunction(module.get_function(expr), device) for key, expr in names.items()}


def cufunction(kernel: Any, device: int) -> int:
    """The CUfunction behind a CuPy RawKernel of `device`, for `gpu_launch.driver.Kernel` (CuPy loads
    modules in the primary context, where the driver layer launches)."""
    import cupy

    with cupy.cuda.Device(device):
        return int(getattr(kernel, "kernel", kernel).ptr)


def nvrtc_check(filename: str, name_expressions: Sequence[str], arch: str,
                options: tuple[str, ...] = BASE_OPTIONS) -> dict[str, str]:
    """Compile with NVRTC for `arch` (e.g. "sm_90") without a GPU; {name expression: lowered name}."""
    return _nvrtc(filename, name_expressions, arch, options)[0]


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_FIELDS = {"stack_bytes": re.compile(r"(\d+) bytes stack frame"),
                 "spill_stores": re.compile(r"(\d+) bytes spill stores"),
                 "registers": re.compile(r"Used (\d+) registers")}


def ptxas_resources(filename: str, name_expressions: Sequence[str], arch: str,
                    options: tuple[str, ...] = BASE_OPTIONS) -> dict[str, dict[str, int]]:
    """What ptxas made of each kernel, without a GPU: {name expression: {"stack_bytes", "spill_stores",
    "registers"}} from its -v report (a local array indexed at run time shows as stack bytes)."""
    lowered, log = _nvrtc(filename, name_expressions, arch, (*options, "--ptxas-options=-v"))
    found: dict[str, dict[str, int]] = {}
    entry: dict[str, int] = {}
    for line in log.splitlines():  # an entry's lines follow its "Compiling entry function" line
        if m := _PTXAS_ENTRY.search(line):
            entry = found.setdefault(m.group(1), {})
        for field, pattern in _PTXAS_FIELDS.items():
            if m := pattern.search(line):
                entry[field] = int(m.group(1))
    return {name: found[low] for name, low in lowered.items()}


def _nvrtc(filename: str, name_expressions: Sequence[str], arch: str,
           options: tuple[str, ...]) -> tuple[dict[str, str], str]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(filename), filename, [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*options, f"--gpu-architecture={arch}"])
        except Exception as err:  # the status alone says nothing: attach the compiler's log
            raise KernelCompileError(filename, f"{err}\n{nvrtc.getProgramLog(prog)}", options) from err
        log = nvrtc.getProgramLog(prog)
        log = log.decode() if isinstance(log, bytes) else log
        return {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}, log
    finally:
        nvrtc.destroyProgram(prog)
