"""The call memo under every hot path: a key of what a call's checks read -> what the first call with
that key prepared (a launcher, a plan, a kernel program).

A hit is one bound `dict.get`: no Python frame, no lock, no type checks. A miss prepares the call and
`put`s it; a full memo is cleared whole (a training loop repeats a few keys, a loop of ever-new shapes
must not grow it), so no eviction bookkeeping rides on the hits. Users: `cudnn_graphs.requests` (a
session's `calls`), `cudnn_graphs.torch._conv` (per conv config and direction), `Plan.execute`,
`fallback_kernels.grid_sample` and `fallback_kernels.gemm_act` (per thread).
"""

from __future__ import annotations

import threading
from typing import Any


class CallMemo(dict):
    """A bounded dict: `memo.get(key)` is dict's own get; `memo.put(key, value)` clears it when full.

    Not locked: a dict's get and set are atomic under the GIL, and a value lost to a concurrent clear is
    prepared again on the next miss. Share one only where its values may serve every thread.
    """

    __slots__ = ("size",)

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> Any:
        """Keep `value` under `key` and return it. A None key (a call the memo cannot describe) and an
        unhashable one (an option spelled as a list) keep nothing: such calls take the checked path."""
        if key is not None:
            if len(self) >= self.size:
                self.clear()
            try:
                self[key] = value
            except TypeError:
                pass
        return value


class ThreadMemo(threading.local):
    """One CallMemo per thread, for values holding one thread's driver objects (a loaded kernel is
    the loading thread's): `memo.get(key)` is this thread's dict.get, `memo.put` as CallMemo's."""

    def __init__(self, size: int):  # threading.local runs this once in each thread that uses the memo
        memo = CallMemo(size)
        self.memo, self.get, self.put = memo, memo.get, memo.put
