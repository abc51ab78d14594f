"""Typed errors. Every error carries the fields a caller needs to act on it."""

from __future__ import annotations

import reprlib
from typing import Any

# Values in messages are shown bounded: a 5000-digit int or JSON nested 5000 deep must not make the
# error itself fail (repr of a huge int raises) or drown the one line that names the field.
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 3, 120, 40, 120
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 8


def shown(value: Any) -> str:
    """`repr(value)`, bounded in depth and length."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an int of {value.bit_length()} bits>"
    try:
        return _SHOW.repr(value)
    except Exception:  # a value whose own repr fails
        return f"<{type(value).__name__}>"


class CudnnGraphsError(Exception):
    """Base of every error this library raises on purpose."""


class SpecError(CudnnGraphsError, ValueError):
    """An op spec (or its dict form) is invalid; names the field and the offending value."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={shown(value)}: {reason}")


class ConfigError(CudnnGraphsError, ValueError):
    """An environment variable holds a value this library cannot use."""

    def __init__(self, variable: str, value: str, reason: str):
        self.variable = variable
        self.value = value
        self.reason = reason
        super().__init__(f"${variable}={value!r}: {reason}")


class UnsupportedGraphError(CudnnGraphsError):
    """cuDNN has no engine for this graph; carries the spec and cuDNN's own message."""

    def __init__(self, spec: Any, message: str):
        self.spec = spec
        self.message = message
        super().__init__(f"cuDNN cannot run {type(spec).__name__}: {message}")


class FrontendMissingError(CudnnGraphsError, ImportError):
    """The cuDNN frontend (`import cudnn`) is not importable."""

    def __init__(self, cause: BaseException):
        self.cause = cause
        super().__init__(
            "the cuDNN frontend is not importable (pip install 'cudnn-graphs[cu12]' or '[cu13]'): "
            f"{type(cause).__name__}: {cause}"
        )


class KernelCompileError(CudnnGraphsError):
    """A fallback CUDA kernel failed to compile; carries the compiler log and options."""

    def __init__(self, kernel: str, log: str, options: tuple[str, ...]):
        self.kernel = kernel
        self.log = log
        self.options = tuple(options)
        super().__init__(f"compiling {kernel} with {' '.join(options)} failed:\n{log}")


class BufferMismatchError(CudnnGraphsError, ValueError):
    """A buffer handed to a plan does not match the spec: names the role, what was expected and got."""

    def __init__(self, role: str, what: str, expected: Any, got: Any):
        self.role = role
        self.what = what
        self.expected = expected
        self.got = got
        super().__init__(f"buffer {role!r}: {what} expected {expected!r}, got {got!r}")


class CudaDriverError(CudnnGraphsError, RuntimeError):
    """A CUDA driver call failed; carries the call's name and its CUresult status."""

    def __init__(self, call: str, status: int, detail: str = ""):
        self.call = call
        self.status = status
        super().__init__(detail or f"{call} failed with CUresult {status}")


class NoGpuError(CudnnGraphsError, RuntimeError):
    """Planning or running needs an NVIDIA GPU with its driver and libcudnn, and this machine lacks one;
    `reason` says which, the message what still works here and what to install."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"no usable CUDA GPU: {reason}. Plans are built and run on a GPU; without one, "
            "`cudnn-graphs check` and `cudnn-graphs warmup --dry-run` still validate specs and print their "
            "signatures. On a GPU host: the NVIDIA driver, and `pip install 'cudnn-graphs[cu12]'` (or [cu13]) "
            "for cuDNN and CuPy")


class CudnnBackendError(CudnnGraphsError, RuntimeError):
    """A cuDNN backend call failed; carries the call's name, its cudnnStatus_t and cuDNN's message."""

    def __init__(self, call: str, status: int, detail: str = ""):
        self.call = call
        self.status = status
        super().__init__(f"{call} failed with cudnnStatus {status}" + (f": {detail}" if detail else ""))


class GraphCaptureError(CudnnGraphsError):
    """A plan could not be recorded into a CUDA graph; it still runs through `launch()`."""

    def __init__(self, spec: Any, engines: tuple[str, ...], cause: BaseException | None):
        self.spec = spec
        self.engines = tuple(engines)
        self.cause = cause
        super().__init__(f"CUDA-graph capture of {type(spec).__name__} (engines {list(engines)}) failed: {cause}")
