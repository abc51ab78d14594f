"""The few CUDA driver calls the launch path needs, through ctypes on libcuda.

Why not CuPy or torch: a torch user's process should not import CuPy (90-140 ms) to run a conv, and
code that serves CuPy, torch and DLPack buffers alike cannot lean on either framework. Streams and
graphs of the driver API are the runtime's own (`CUstream` is `cudaStream_t`), so these calls mix
freely with the frameworks' streams. Each call costs a ctypes round trip (~0.2-0.5 us).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

from .errors import CudaDriverError

# cuda.h values (stable since CUDA 10).
CAPTURE_STATUS_NONE = 0
CAPTURE_MODE_RELAXED = 2  # our captures must not make other threads' cudaMalloc fail (global mode would)
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2

_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def lib() -> Any:
    """libcuda with the signatures used here, initialised; CudaDriverError when there is none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise CudaDriverError("cuInit", -1, f"no CUDA driver (libcuda.so.1 not loadable: {err})") from None
    signatures = {
        "cuInit": [ctypes.c_uint],
        "cuStreamIsCapturing": [_ptr, ctypes.POINTER(ctypes.c_int)],
        "cuStreamQuery": [_ptr],
        "cuStreamBeginCapture_v2": [_ptr, ctypes.c_int],
        "cuStreamEndCapture": [_ptr, ctypes.POINTER(_ptr)],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(_ptr), _ptr, ctypes.c_ulonglong],
        "cuGraphCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
        "cuGraphAddMemsetNode": [ctypes.POINTER(_ptr), _ptr, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, _ptr],
        "cuMemAlloc_v2": [ctypes.POINTER(_u64), ctypes.c_size_t],
        "cuGraphDestroy": [_ptr],
        "cuGraphExecDestroy": [_ptr],
        "cuStreamCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
        "cuEventCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
        "cuEventRecord": [_ptr, _ptr],
        "cuStreamWaitEvent": [_ptr, _ptr, ctypes.c_uint],
        "cuCtxGetCurrent": [ctypes.POINTER(_ptr)],
        "cuCtxSetCurrent": [_ptr],
        "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_ptr), ctypes.c_int],
        "cuModuleLoadData": [ctypes.POINTER(_ptr), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(_ptr), _ptr, ctypes.c_char_p],
        "cuMemsetD8Async": [_u64, ctypes.c_ubyte, ctypes.c_size_t, _ptr],
        "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
    }
    for name, argtypes in signatures.items():
        fn = getattr(cuda, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    _check(cuda.cuInit(0), "cuInit")
    return cuda


def _check(status: int, call: str) -> None:
    if status:
        raise CudaDriverError(call, status)


def stream_idle(stream: int) -> bool:
    """Whether every piece of work queued on `stream` has finished (never waits; an error counts as busy)."""
    return lib().cuStreamQuery(stream) == 0


def is_capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph now (when the driver cannot say: yes)."""
    status = ctypes.c_int(0)
    # Querying the legacy stream while another stream captures in global mode is itself an error.
    return _IS_CAPTURING(stream, ctypes.byref(status)) != 0 or status.value != CAPTURE_STATUS_NONE


def _is_capturing_fn(stream, status_ref) -> int:
    globals()["_IS_CAPTURING"] = fn = lib().cuStreamIsCapturing  # bound once: this is on every launch
    return fn(stream, status_ref)


_IS_CAPTURING = _is_capturing_fn


def device_count() -> int:
    """How many CUDA devices this process sees (0 without a driver)."""
    try:
        cuda = lib()
    except CudaDriverError:
        return 0
    count = ctypes.c_int(0)
    return count.value if cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0


_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
_ATTR_SMS = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT


@functools.lru_cache(maxsize=None)
def compute_capability(ordinal: int) -> tuple[int, int]:
    """(major, minor) of device `ordinal`, asked of the driver once per process."""
    cuda, dev, major, minor = lib(), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    _check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(cuda.cuDeviceGetAttribute(ctypes.byref(major), _ATTR_CC_MAJOR, dev), "cuDeviceGetAttribute")
    _check(cuda.cuDeviceGetAttribute(ctypes.byref(minor), _ATTR_CC_MINOR, dev), "cuDeviceGetAttribute")
    return major.value, minor.value


@functools.lru_cache(maxsize=None)
def multiprocessors(ordinal: int) -> int:
    """The SM count of device `ordinal`, asked of the driver once per process."""
    cuda, dev, count = lib(), ctypes.c_int(0), ctypes.c_int(0)
    _check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(cuda.cuDeviceGetAttribute(ctypes.byref(count), _ATTR_SMS, dev), "cuDeviceGetAttribute")
    return count.value


def new_stream() -> int:
    """A non-blocking stream (the legacy default stream cannot be captured); lives for the process."""
    stream = _ptr()
    _check(lib().cuStreamCreate(ctypes.byref(stream), STREAM_NON_BLOCKING), "cuStreamCreate")
    return stream.value


def new_event() -> int:
    event = _ptr()
    _check(lib().cuEventCreate(ctypes.byref(event), EVENT_DISABLE_TIMING), "cuEventCreate")
    return event.value


def stream_wait(stream: int, *, after: int, event: int) -> None:
    """Make `stream` wait for the work queued on `after` so far (through `event`)."""
    _check(lib().cuEventRecord(event, after), "cuEventRecord")
    _check(lib().cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")


def begin_capture(stream: int) -> None:
    _check(lib().cuStreamBeginCapture_v2(stream, CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")


def relax_capture_mode() -> None:
    """This thread's capture mode relaxed: it may cudaMalloc while another thread captures a CUDA graph
    in global mode (which would refuse the call and end that capture)."""
    mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
    _check(lib().cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")


def end_capture(stream: int) -> int:
    """The captured graph (not yet instantiated); raises when the capture was invalidated."""
    graph = _ptr()
    _check(lib().cuStreamEndCapture(stream, ctypes.byref(graph)), "cuStreamEndCapture")
    return graph.value


_live_executables = 0  # GraphExec objects alive in this process (all devices): what reserve_executables tops up


def live_executables() -> int:
    return _live_executables


class MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", _u64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


def reserve_executables(count: int) -> None:
    """Instantiate `count` executables of a one-byte memset graph in the current context, then destroy them.

    cuGraphInstantiate grows a per-context pool of executable slots every ~43 live executables (the 35th,
    78th, 121st ... of a process, whatever their nodes) and that growth waits for all queued GPU work;
    destroyed executables' slots stay in the pool (H100, docs/kernels.md). Called while the GPU is idle,
    this makes room for `count` more live executables whose instantiation will not wait. (An empty graph's
    executables did not make room: the memset node is needed.)"""
    cuda = lib()
    ctx = _ptr()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    params = MemsetParams(_memset_target(ctx.value), 1, 0, 1, 1, 1)
    graph, node = _ptr(), _ptr()
    _check(cuda.cuGraphCreate(ctypes.byref(graph), 0), "cuGraphCreate")
    execs = []
    try:
        _check(cuda.cuGraphAddMemsetNode(ctypes.byref(node), graph, None, 0, ctypes.byref(params), ctx),
               "cuGraphAddMemsetNode")
        for _ in range(count):
            exec_ = _ptr()
            _check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
            execs.append(exec_.value)
    finally:
        for handle in execs:
            cuda.cuGraphExecDestroy(handle)
        cuda.cuGraphDestroy(graph)


@functools.lru_cache(maxsize=None)
def _memset_target(context: int) -> int:
    """256 bytes of device memory in `context`, kept for the process: what reserve_executables' graph sets."""
    ptr = _u64()
    _check(lib().cuMemAlloc_v2(ctypes.byref(ptr), 256), "cuMemAlloc")
    return ptr.value


class GraphExec:
    """An instantiated CUDA graph; `launch(stream)` replays it. Freed with this object."""

    __slots__ = ("handle", "graph", "launches", "_arg", "_launch", "__weakref__")

    def __init__(self, graph: int, *, keep_graph: bool = False):
        """Takes `graph`: destroyed here (the executable keeps what it needs), or with `keep_graph`
        kept until this object goes, since updates name the nodes of the graph an executable was made
        from; then a failed instantiation leaves `graph` to the caller."""
        global _live_executables
        cuda = lib()
        exec_ = _ptr()
        self.graph = None
        try:
            _check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
        finally:
            if not keep_graph:
                cuda.cuGraphDestroy(graph)
        self.graph = graph if keep_graph else None
        self.handle = exec_.value
        _live_executables += 1  # under the GIL; an estimate is all reserve_executables' callers need
        self._arg = exec_  # passed as is: no int -> pointer conversion per launch
        self._launch = _raw("cuGraphLaunch")  # no argtypes to convert through (see Kernel)
        self.launches = 0

    def launch(self, stream: int) -> None:
        self.launches += 1
        status = self._launch(self._arg, _ptr(stream))
        if status:
            raise CudaDriverError("cuGraphLaunch", status)

    def __del__(self) -> None:
        global _live_executables
        handle, self.handle = getattr(self, "handle", None), None
        graph, self.graph = getattr(self, "graph", None), None
        if handle:
            _live_executables -= 1
        try:
            if handle:
                lib().cuGraphExecDestroy(handle)
            if graph:  # after the executable made from it
                lib().cuGraphDestroy(graph)
        except Exception:  # interpreter shutdown: the driver frees both with the context
            pass


@functools.lru_cache(maxsize=None)
def function(cubin: bytes, name: str, ordinal: int) -> int:
    """The CUfunction `name` of `cubin` loaded on device `ordinal` (once per process; the module
    lives as long as the process, as CuPy's and torch's kernels do)."""
    cuda = lib()
    module, fn = _ptr(), _ptr()
    with device(ordinal):
        _check(cuda.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
    _check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
    return fn.value


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h, CUDA >= 12.0): a launch's geometry and stream, passed by reference."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", _ptr), ("attrs", _ptr), ("numAttrs", ctypes.c_uint)]


class Kernel:
    """A kernel launch with its arguments packed once: `launch(stream)` after patching `args[i].value`.

    `args` are ctypes scalars, arrays or structures in the kernel's parameter order; the parameter array
    points at them, so changing a value changes the next launch and nothing is packed per call.
    `grid` and `block` are an int or up to three dimensions; `shared` is dynamic shared memory bytes.
    One thread launches a Kernel (its stream slot is patched in place).
    """

    __slots__ = ("fn", "grid", "block", "shared", "args", "_params", "_call", "_config", "_ordinal", "_ctx",
                 "_current", "_current_ref", "_get_current", "_launch")

    def __init__(self, fn: int, *, grid: int | tuple, block: int | tuple, args: list, ordinal: int, shared: int = 0):
        self.fn, self.args, self._ordinal, self.shared = fn, args, ordinal, int(shared)
        self.grid, self.block = _dims(grid), _dims(block)
        self._params = (_ptr * len(args))(*(ctypes.addressof(a) for a in args))
        # cuLaunchKernelEx takes the geometry and stream in one struct packed here: 4 ctypes arguments a
        # launch instead of cuLaunchKernel's 11 (5.5 against 6.5 us of host time on an H100 host). Every
        # argument is a ctypes object made here and the entry points carry no argtypes: ctypes then
        # converts nothing per call (with argtypes, converting 11 ints cost ~7 us of a 10 us launch).
        self._config = LaunchConfig(*self.grid, *self.block, self.shared, None, None, 0)
        self._call = (ctypes.byref(self._config), _ptr(fn), self._params, None)
        self._launch, self._get_current = _raw("cuLaunchKernelEx"), _raw("cuCtxGetCurrent")
        self._ctx = _primary_context(ordinal)
        self._current = _ptr()
        self._current_ref = ctypes.byref(self._current)

    def launch(self, stream: int) -> None:
        self._config.hStream = stream
        self._get_current(self._current_ref)
        if self._current.value == self._ctx:
            status = self._launch(*self._call)
        else:  # a function belongs to its device's context: launch there, then restore the caller's
            with device(self._ordinal):
                status = self._launch(*self._call)
        if status:
            raise CudaDriverError("cuLaunchKernelEx", status)


@functools.lru_cache(maxsize=None)
def _raw(name: str) -> Any:
    """A libcuda entry point of its own, without argtypes: callers pass ctypes objects only."""
    lib()  # initialised, and its library loaded
    fn = ctypes.CDLL("libcuda.so.1")[name]
    fn.restype = ctypes.c_int
    return fn


def _dims(value: int | tuple) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    return (*(int(d) for d in dims), *(1,) * (3 - len(dims)))


def memset_async(ptr: int, nbytes: int, stream: int) -> None:
    """Zero `nbytes` at `ptr`, in `stream`'s order."""
    _check(lib().cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")


_current = threading.local()  # per thread: the buffer cuCtxGetCurrent writes into


def context_is_current(ordinal: int) -> bool:
    """Whether `ordinal`'s primary context is this thread's current one (~0.3 us: callers skip the
    `device` switch when it is)."""
    slot = getattr(_current, "slot", None)
    if slot is None:
        value = _ptr()
        slot = _current.slot = (value, _raw("cuCtxGetCurrent"), ctypes.byref(value))
    value, get, ref = slot
    get(ref)
    return value.value == _primary_context(ordinal)


class device:
    """Context manager: make `ordinal`'s primary context current on this thread (what the runtime,
    cuDNN, torch and CuPy call the current device), then restore the previous one."""

    __slots__ = ("ordinal", "_saved")

    def __init__(self, ordinal: int):
        self.ordinal = ordinal

    def __enter__(self) -> "device":
        cuda = lib()
        saved = _ptr()
        _check(cuda.cuCtxGetCurrent(ctypes.byref(saved)), "cuCtxGetCurrent")
        target = _primary_context(self.ordinal)
        self._saved = None if saved.value == target else saved.value  # None: nothing to switch back
        if self._saved is not None or saved.value is None:
            _check(cuda.cuCtxSetCurrent(target), "cuCtxSetCurrent")
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            lib().cuCtxSetCurrent(self._saved)


@functools.lru_cache(maxsize=None)
def _primary_context(ordinal: int) -> int:
    cuda = lib()
    dev, ctx = ctypes.c_int(0), _ptr()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    # Retained for the life of the process, as the runtime (and so torch and CuPy) retains it too.
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx.value
