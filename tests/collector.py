"""What the garbage collector would free: the objects only reference cycles keep alive."""

from __future__ import annotations

import collections
import gc


def cyclic_garbage(*prefixes: str) -> dict[str, int]:
    """Count, by type, the unreachable objects whose type's module.qualname starts with one of `prefixes`,
    then free them all."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    gc.collect()  # saved garbage, let go of, is unreachable cycles again: free it now
    return {kind: n for kind, n in kinds.items() if kind.startswith(prefixes)}
