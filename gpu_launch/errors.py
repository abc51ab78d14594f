"""The typed errors of the launch layer (buffers, streams, driver calls, kernel compiles), the base of
every error the distribution raises on purpose. Every error carries the fields a caller needs to act on it."""

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
