"""Which on-disk store a session uses, from its `cache=` argument and the environment."""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import config

log = logging.getLogger("cudnn_graphs")


def open_system_store():
    """$CUDNN_GRAPHS_SYSTEM_CACHE_DIR as a read-only store, or None (unset, or refused with one warning)."""
    from plan_cache import PlanStore

    root = config.system_cache_dir()
    if root is None:
        return None
    try:
        return PlanStore(root, read_only=True, touch_interval=1e12)
    except OSError as err:  # UntrustedCacheError: group-writable, foreign-owned ...
        log.warning("plan cache: the system cache %s is not used: %s", root, err)
        return None


def open_store(cache: Any):
    """`None`: the configured default; `False`: memory only; a path; or a `PlanStore` used as is.

    A store that cannot be opened or trusted is a warning and memory-only plans, never an error.
    """
    from plan_cache import PlanStore

    if cache is False:
        return None
    if isinstance(cache, PlanStore):
        return cache
    if cache is None:
        if config.cache_disabled():
            return None
        root, max_bytes = config.cache_dir(), config.cache_max_bytes()
    elif isinstance(cache, (str, os.PathLike)):
        root, max_bytes = cache, config.cache_max_bytes()
    else:
        raise TypeError(f"cache={cache!r}: expected None, False, a directory path or a plan_cache.PlanStore")
    return PlanStore.open_or_none(root, max_bytes=max_bytes)
