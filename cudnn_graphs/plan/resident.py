"""Plans stay loaded for the life of the process, one per (device, key), shared by every session.

Why: destroying a cuDNN execution plan can wait for the whole GPU. Measured on an H100 (cuDNN 9.19):
with 1 s of work queued, letting go of a session that held a runtime-fused dgrad + dReLU plan took
1011 ms and left the GPU idle (tools/probe_sync_sources.py). Python frees a plan when its garbage
collector decides, so a dropped session or an evicted plan would stall a training loop at a random
step. torch keeps its cuDNN plans for the process for the same reason. Sharing them by key bounds what
is kept to one plan per key (plus, at most, the plan an upgrade or a race displaced), and a new
Session finds the plans an earlier one loaded without reading the disk.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

_plans: dict[tuple[int, str], Any] = {}
_displaced: list[Any] = []  # never destroyed: an older session may still run them
_lock = threading.Lock()


def _rank(plan: Any) -> int:
    return 1 if plan.chosen_by == "autotune" else 0


def get(device: int, key: str) -> Any:
    """The plan this process holds for `key` on `device`, or None."""
    return _plans.get((device, key))


def keep(plan: Any) -> Any:
    """Hold `plan` for the process and return the plan callers should use for its key: `plan`, or one
    another thread kept meanwhile that is at least as good (autotuned beats heuristic)."""
    slot = (plan.device, plan.signature)
    with _lock:
        held = _plans.get(slot)
        if held is plan:
            return plan
        if held is not None and _rank(held) >= _rank(plan):
            _displaced.append(plan)
            return held
        if held is not None:
            _displaced.append(held)
        _plans[slot] = plan
    return plan


def drop(plans) -> None:
    """Stop holding `plans` (a tool that plans many specs once lets go as it goes; destroying them can
    wait for the GPU, so never on a hot path). Other plans, and other holders of these, are untouched."""
    with _lock:
        for plan in plans:
            slot = (plan.device, plan.signature)
            if _plans.get(slot) is plan:
                del _plans[slot]
        ids = {id(plan) for plan in plans}
        _displaced[:] = [plan for plan in _displaced if id(plan) not in ids]


def count() -> int:
    """How many plans the process holds (displaced ones included)."""
    return len(_plans) + len(_displaced)


def forget() -> None:
    """Let go of every held plan (tests and tools that measure loads from disk). Plans no session
    references any more are destroyed now (a garbage collection), which can wait for the GPU: never
    call this on a hot path."""
    with _lock:
        _plans.clear()
        _displaced.clear()
    gc.collect()  # plans sit in reference cycles: destroy them here, not in a later hot loop's collection
