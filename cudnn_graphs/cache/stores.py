"""Which on-disk store a session uses, from its `cache=` argument and the environment."""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import config
from ..errors import SpecError

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


_remotes: dict[tuple, Any] = {}  # one client (and connection pool) per (url, secret, timeout) per process


def open_remote(remote: Any = None):
    """The remote tier a session writes through to and reads after its local stores, or None.

    `None`: $CUDNN_GRAPHS_REMOTE_CACHE (off when unset); `False`: off; a URL; or a
    `plan_cache.RemoteStore` used as is. Without a signing key the tier stays off with one warning:
    records from a remote load native code, so unsigned sharing is not offered.
    """
    from plan_cache import RemoteCacheError, RemoteStore, redact_url

    if remote is False:
        return None
    if isinstance(remote, RemoteStore):
        return remote
    if remote is not None and not isinstance(remote, str):
        raise TypeError(f"remote={remote!r}: expected None, False, a redis:// URL or a plan_cache.RemoteStore")
    if remote is not None and not remote.strip().lower().startswith(config.REMOTE_SCHEMES):
        raise SpecError("remote", redact_url(remote), f"expected None, False, a URL starting with one of "
                        f"{list(config.REMOTE_SCHEMES)} or a plan_cache.RemoteStore")
    url = remote if remote is not None else config.remote_cache_url()
    if url is None:
        return None
    secret = config.remote_cache_key()
    if secret is None:
        _warn_once(("nokey", url), "remote plan cache %s is off: no signing key ($%s or $%s)", redact_url(url),
                   config.REMOTE_KEY, config.REMOTE_KEY_FILE)
        return None
    slot = (url, secret, config.remote_cache_timeout())
    store = _remotes.get(slot)
    if store is None:
        try:
            store = _remotes.setdefault(slot, RemoteStore(url, secret=secret, timeout=slot[2]))
        except RemoteCacheError as err:
            _warn_once(("setup", url), "remote plan cache %s is off: %s", redact_url(url), err)
            return None
    return store


_warned: set = set()


def _warn_once(what: tuple, message: str, *args: Any) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message, *args)
