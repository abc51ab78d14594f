"""The device side of a session: one cuDNN handle per thread and device, and the check that a GPU is there."""

from __future__ import annotations

import threading
from typing import Any

from gpu_launch import driver

from ..environment import gpu_problem
from ..errors import NoGpuError
from ..execute import cudnn_backend
from ..graph import frontend


class HandlePool:
    """One cuDNN handle per thread for one device: a handle must not be driven from two threads.

    One pool per device for the process (`for_device`), shared by every session and plan: handles are
    never destroyed (cudnnDestroy synchronises the device) and a new Session pays no cudnnCreate.
    The handle is created through the backend (`raw()`); the frontend's wrapper around it
    (`current()`) is made only where a graph is built, so a warm process never imports the frontend.
    """

    _pools: dict[int, "HandlePool"] = {}
    _pools_lock = threading.Lock()

    @classmethod
    def for_device(cls, device: int) -> "HandlePool":
        pool = cls._pools.get(device)
        if pool is None:
            with cls._pools_lock:
                pool = cls._pools.setdefault(device, cls(device))
        return pool

    def __init__(self, device: int):
        self.device = device
        self._local = threading.local()

    def raw(self) -> int:
        """This thread's cudnnHandle_t."""
        local = self._local
        handle = getattr(local, "raw", None)
        if handle is None:
            with driver.device(self.device):  # a handle belongs to the device current at creation
                handle = local.raw = cudnn_backend.create_handle()
            local.stream, local.wrapped = None, None
        return handle

    def current(self) -> Any:
        """This thread's handle as the frontend takes it."""
        raw = self.raw()
        local = self._local
        if local.wrapped is None:
            local.wrapped = frontend.wrap_handle(raw, self.device, local.stream)
        return local.wrapped

    def on_stream(self, stream_ptr: int) -> int:
        """This thread's raw handle, set to `stream_ptr` unless it already is."""
        local = self._local
        raw = getattr(local, "raw", None) or self.raw()
        if local.stream != stream_ptr:
            cudnn_backend.set_stream(raw, stream_ptr)
            local.stream = stream_ptr
            if local.wrapped is not None:
                frontend.note_stream(local.wrapped, stream_ptr)
        return raw


def require_gpu(env, device: int) -> None:
    """Refuse to plan or load without a GPU: say what is missing and what to do, not a driver error per spec."""
    if not env.has_gpu:
        raise NoGpuError(gpu_problem(device) or "no GPU was found when this session started")
