"""Typed errors. Every error carries the fields a caller needs to act on it.

The launch layer's errors (and the base class) live in `gpu_launch.errors`, below both this package and
`fallback_kernels`; they are re-exported here so that `cudnn_graphs.SpecError` and friends are one
hierarchy.
"""

from __future__ import annotations

from typing import Any

from gpu_launch.errors import (BufferMismatchError, CudaDriverError, CudnnGraphsError, KernelCompileError,
                               SpecError, shown)

__all__ = ["BufferMismatchError", "CaptureError", "ConfigError", "CudaDriverError", "CudnnBackendError", "CudnnGraphsError",
           "FrontendMissingError", "GraphCaptureError", "KernelCompileError", "NoGpuError", "ShapeError",
           "SpecError", "TargetEnvError", "UnsupportedGraphError", "shown"]


class ConfigError(CudnnGraphsError, ValueError):
    """An environment variable holds a value this library cannot use."""

    def __init__(self, variable: str, value: str, reason: str):
        self.variable = variable
        self.value = value
        self.reason = reason
        super().__init__(f"${variable}={shown(value)}: {reason}")  # bounded: a 5000-digit value is not echoed whole


class TargetEnvError(CudnnGraphsError, ValueError):
    """A `--target-env` file is not what `cudnn-graphs env` prints; names the file and, where one field is
    at fault, that field and its value."""

    def __init__(self, path: str, reason: str, field: str | None = None, value: Any = None):
        self.path = path
        self.reason = reason
        self.field = field
        self.value = value
        where = "" if field is None else f"{field}={shown(value)}: "
        super().__init__(f"--target-env {path}: {where}{reason}; not the output of `cudnn-graphs env`")


class ShapeError(SpecError, RuntimeError):
    """A tensor's shape does not fit the op (channels, bias length, a kernel larger than the padded
    input ...). Also a RuntimeError: where a drop-in torch function raises, code catching torch's
    RuntimeError catches ours."""


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


class CaptureError(CudnnGraphsError, ValueError):
    """A model or its inputs cannot be captured into a CUDA graph (`cudnn_graphs.torch.capture`): names
    what (an argument, a parameter or buffer, a module by its path in the model) and why."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"cannot capture {field}={shown(value)}: {reason}")
