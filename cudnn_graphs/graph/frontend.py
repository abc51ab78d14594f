"""The one place that imports the cuDNN frontend and smooths over its version differences.

FE <= 1.27 ships pygraph as a pybind class; 1.28+ as a Python class that lowers to the backend and
wants a handle object even for CPU-only graph construction (`cudnn.Handle(None)`).
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import FrontendMissingError
from ..spec import dtypes


@functools.lru_cache(maxsize=1)
def cudnn() -> Any:
    try:
        import cudnn as module
    except Exception as err:  # ImportError, or OSError when libcudnn cannot load
        raise FrontendMissingError(err) from err
    return module


def data_type(name: str) -> Any:
    dt = cudnn().data_type
    return {dtypes.FLOAT16: dt.HALF, dtypes.BFLOAT16: dt.BFLOAT16,
            dtypes.FLOAT32: dt.FLOAT, dtypes.FLOAT64: dt.DOUBLE}[name]


def new_graph(*, io_dtype: str, compute_dtype: str, handle: Any = None, name: str) -> Any:
    """An empty pygraph with explicit io, intermediate and compute types."""
    fe = cudnn()
    kwargs: dict[str, Any] = {}
    if handle is not None:
        kwargs["handle"] = handle
    elif hasattr(fe, "Handle"):
        kwargs["handle"] = fe.Handle(None)  # FE >= 1.28 builds graphs on the CPU only with this
    return fe.pygraph(
        name=name,
        io_data_type=data_type(io_dtype),
        intermediate_data_type=data_type(compute_dtype),
        compute_data_type=data_type(compute_dtype),
        **kwargs,
    )


def release_declines(graph: Any) -> None:
    """Break the reference cycle FE 1.28 leaves on a graph the backend declined anything for: the graph
    keeps that exception (`_backend_declined`), whose traceback holds the graph's own frames and, once
    re-raised through ours, our callers' (a session, its scratch buffers). Such a graph, and all of that,
    then waits for the garbage collector, which frees it at whatever later call it runs in: freeing a
    cuDNN plan can wait for the whole GPU, and autotune's scratch stayed alive until then."""
    exc = getattr(graph, "_backend_declined", None)
    if isinstance(exc, BaseException):
        clear_tracebacks(exc)


def clear_tracebacks(exc: BaseException) -> None:
    """Drop the frames held by `exc` and the exceptions chained to it (keeping their messages)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:  # a chain may loop back on itself
            continue
        seen.add(id(exc))
        exc.__traceback__ = None
        pending += [exc.__cause__, exc.__context__]


def wrap_handle(raw: int, device: int, stream: int | None) -> Any:
    """The frontend's handle object for a backend cudnnHandle_t made elsewhere (FE >= 1.28 wants a
    `cudnn.Handle`, as it documents for foreign handles; older ones take the int itself)."""
    fe = cudnn()
    if not hasattr(fe, "Handle"):
        return raw
    return fe.Handle(raw, device, 0 if stream is None else stream)  # a new handle runs on the legacy stream


def note_stream(handle: Any, stream: int) -> None:
    """Tell the frontend's handle object which stream the backend handle now runs on (its Python
    engines read it there)."""
    if hasattr(handle, "stream"):
        handle.stream = stream


def version() -> str:
    return str(cudnn().__version__)


def deserialize(blob: bytes, *, handle: Any) -> Any:
    """A pygraph holding the execution plan serialized in `blob`."""
    g = cudnn().pygraph(handle=handle)
    # FE 1.26-1.28 bind std::vector<uint8_t>: they take a list of ints, not bytes.
    g.deserialize(handle, list(blob))
    return g


def knob_names(knobs: Any) -> dict[str, int]:
    """{knob name: value} from the frontend's {knob_type: value}: names survive FE versions, enums do not."""
    return {getattr(k, "name", None) or str(k).rsplit(".", 1)[-1]: int(v) for k, v in dict(knobs).items()}


def knobs_from_names(names: dict[str, int]) -> dict[Any, int]:
    knob_type = cudnn().knob_type
    return {getattr(knob_type, name): int(value) for name, value in names.items()}
