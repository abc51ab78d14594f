"""Streams and scratch memory in the buffers' own framework."""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from typing import Any, Callable

from . import driver


def stream_pointer(stream: Any, framework: str, device: int) -> int:
    """The cudaStream_t to launch on: the given one, else the framework's current stream."""
    if stream is not None:
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        for attr in ("cuda_stream", "ptr", "handle"):
            value = getattr(stream, attr, None)
            if isinstance(value, int):
                return value
        raise TypeError(f"stream: expected an int, torch.cuda.Stream or cupy Stream, got {type(stream).__name__}")
    if framework == "torch":
        # The raw getter skips building a torch.cuda.Stream object (0.2 us against 9 on an H100 host).
        return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0  # raw pointers with no framework: the legacy default stream


def allocate(nbytes: int, framework: str, device: int) -> tuple[Any, int]:
    """(owner, pointer) of nbytes from torch's caching allocator for torch buffers, else CuPy's pool."""
    if nbytes == 0:
        return None, 0
    if framework == "torch":
        torch = sys.modules["torch"]
        owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return owner, owner.data_ptr()
    import cupy

    with cupy.cuda.Device(device):
        owner = cupy.cuda.alloc(nbytes)
    return owner, owner.ptr


def allocate_kept(nbytes: int, framework: str, device: int, stream: int) -> tuple[Any, int]:
    """`allocate` for memory kept past this call for work on `stream` (a plan's per-stream workspace, a
    stream's shared scratch). torch's allocator gives a private pool what a thread asks for while it
    captures a CUDA graph or, in torch.compile's cudagraph trees, warms one up (torch 2.11 routes by
    thread), and a block kept there is what those trees refuse ("tensors in the cudagraph pool not
    tracked as outputs"). So torch memory is taken by a thread of ours, in relaxed capture mode (the
    allocator may cudaMalloc during a capture), on a stream of ours that runs nothing (its free blocks
    are only ever kept ones: no queued work of another stream can still be using one), and marked used on
    `stream`: once freed, it waits for that stream's work before it is handed out again."""
    if framework != "torch" or nbytes == 0:
        return allocate(nbytes, framework, device)
    torch = sys.modules["torch"]
    owner = _allocating_thread().submit(_torch_bytes, nbytes, device).result()
    owner.record_stream(torch.cuda.default_stream(device) if stream == 0
                        else torch.cuda.ExternalStream(stream, device=device))
    return owner, owner.data_ptr()


def _torch_bytes(nbytes: int, device: int) -> Any:
    torch = sys.modules["torch"]
    side = _kept_streams.get(device)
    if side is None:
        side = _kept_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(side):  # not the legacy default stream, whose freed blocks may still be in use there
        return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")


_kept_streams: dict[int, Any] = {}  # device -> the stream kept blocks are allocated on (only the worker uses it)


@functools.lru_cache(maxsize=1)
def _allocating_thread():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudnn_graphs-kept",
                              initializer=driver.relax_capture_mode)


_scratch = threading.local()  # .blocks: (framework, device, stream) -> (owner, bytes, pointer)


def stream_scratch(nbytes: int, framework: str, device: int, stream: int) -> int:
    """The address of a scratch block of at least `nbytes` for work queued on `stream`, kept for later
    calls (one allocation a call cost 5-6 us of host time on an H100 host). Work on one stream runs in
    stream order, so every call on it can share one block, grown to the largest asked for; a block left
    for a larger one goes back to its stream-ordered allocator (safe behind queued work). Per thread.
    Not while the stream is being captured (call_scratch says which): a captured graph would keep the
    address of a block this may later give back."""
    blocks = getattr(_scratch, "blocks", None)
    if blocks is None:
        blocks = _scratch.blocks = {}
    key = (framework, device, stream)
    held = blocks.get(key)
    if held is None or held[1] < nbytes:
        nbytes = max(nbytes, held[1] * 2 if held else 0)
        owner, ptr = allocate_kept(nbytes, framework, device, stream)
        held = blocks[key] = (owner, nbytes, ptr)
    return held[2]


def call_scratch(nbytes: int, framework: str, device: int, stream: int, *, capturing: bool) -> tuple[Any, int]:
    """(owner, address) of a call's scratch: the stream's shared block (owner None), or under capture a
    block of the call's own from the capturing framework's pool (keep `owner` until the work is queued)."""
    if capturing:
        return allocate(nbytes, framework, device)
    return None, stream_scratch(nbytes, framework, device, stream)


def release_scratch() -> None:
    """Give this thread's scratch blocks back to their allocators (the next call allocates again)."""
    _scratch.blocks = {}


def allocate_like(desc, *, like: Any, framework: str, device: int) -> Any:
    """A new, uninitialised tensor for `desc` in the framework of `like` (CuPy for non-torch buffers)."""
    if framework == "torch":
        return torch_allocator(desc, like.device)()
    import cupy

    dtype = _cupy_dtype(desc.dtype)
    itemsize = dtype.itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, desc.strides))
    with cupy.cuda.Device(device):
        memory = cupy.cuda.alloc(span * itemsize)
    return cupy.ndarray(desc.shape, dtype=dtype, memptr=memory, strides=tuple(s * itemsize for s in desc.strides))


def torch_allocator(desc, device: Any) -> Callable[[], Any]:
    """A no-argument call returning a new uninitialised torch tensor for `desc` on `device`."""
    torch = sys.modules["torch"]
    # A method of an empty template (which holds no memory) takes dtype and device from it: 3.0 us a
    # call against 5.4 for torch.empty_strided with keyword arguments (H100 host).
    template = torch.empty(0, dtype=getattr(torch, desc.dtype), device=device)
    return functools.partial(template.new_empty_strided, tuple(desc.shape), tuple(desc.strides))


def _cupy_dtype(name: str):
    import numpy

    if name != "bfloat16":
        return numpy.dtype(name)
    try:
        import ml_dtypes  # CuPy holds bfloat16 only through ml_dtypes' numpy dtype
    except ImportError:
        from .errors import BufferMismatchError

        raise BufferMismatchError("output", "dtype", "an output buffer passed in (CuPy needs ml_dtypes to "
                                  "allocate bfloat16)", name) from None
    return numpy.dtype(ml_dtypes.bfloat16)


def capture_probe(framework: str, stream: Any) -> Callable[[int], bool]:
    """A cheap `probe(stream_ptr) -> bool`: is that stream being captured into a CUDA graph now?

    torch answers for its current stream in 0.7 us, CuPy for any stream in less; the driver through
    ctypes costs 2 us. `stream` is what the caller passed (None: the framework's current stream).
    """
    if framework == "torch" and stream is None:
        probe = _PROBES.get("torch")
        if probe is None:
            probe = _PROBES["torch"] = _torch_probe()
        return probe
    probe = _PROBES.get("any")
    if probe is None:
        probe = _PROBES["any"] = _any_stream_probe()
    return probe


_PROBES: dict[str, Callable[[int], bool]] = {}


def _torch_probe() -> Callable[[int], bool]:
    torch_c = sys.modules["torch"]._C
    current, raw, get_device = torch_c._cuda_isCurrentStreamCapturing, torch_c._cuda_getCurrentRawStream, \
        torch_c._cuda_getDevice
    fallback = _any_stream_probe()

    def probe(stream_ptr: int) -> bool:
        # torch's answer is about the current device's current stream: use it only for that stream.
        return current() if raw(get_device()) == stream_ptr else fallback(stream_ptr)

    return probe


def _any_stream_probe() -> Callable[[int], bool]:
    runtime = sys.modules.get("cupy_backends.cuda.api.runtime")
    if runtime is None:
        return driver.is_capturing

    def probe(stream_ptr: int) -> bool:
        try:
            return bool(runtime.streamIsCapturing(stream_ptr))
        except Exception:  # e.g. the legacy stream while another stream captures globally: assume yes
            return True

    return probe


@functools.lru_cache(maxsize=64)
def external_stream(ptr: int) -> Any:
    """A CuPy stream object for a raw cudaStream_t, cached: creating one per launch costs microseconds."""
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; 13 lacks the replacement
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr)
