"""What a plan's parts are made of, alike whether a session builds them or restores them from a record:
fallback-kernel parts, the scalars cuDNN reads, and the probe of a part's numerical notes."""

from __future__ import annotations

import functools

import numpy as np

from ..errors import UnsupportedGraphError
from ..graph import build_graph
from ..spec import dtypes


def kernel_part(spec, name: str, intermediates: dict, device: int, compiled: tuple | None = None):
    """The fallback kernel for graph part `name`; `compiled` is (cubin, lowered name) from a record."""
    from fallback_kernels import epilogue

    if name == "fwd_epilogue":
        return epilogue.fwd_epilogue(spec, intermediates["acc"], device, compiled)
    if name == "act_backward":
        return epilogue.act_backward(spec, intermediates["acc"], device, compiled)
    if name == "bias_grad":
        return epilogue.bias_grad(spec, device, compiled)
    raise UnsupportedGraphError(spec, f"no fallback kernel for graph part {name!r}")


def stored_kernel(entry: dict, blobs: list) -> tuple | None:
    """(cubin, lowered name) of a record's kernel part, or None where it must be compiled again: no
    usable blob, or a cubin compiled from other kernel source than this version's (an upgrade or an edit
    kept the function's name but may have changed its body or arguments)."""
    from fallback_kernels import epilogue

    index, function = entry.get("blob_index"), entry.get("function")
    cubin = blobs[index] if isinstance(index, int) and 0 <= index < len(blobs) else None
    if not isinstance(cubin, bytes) or not isinstance(function, str) or entry.get("source") != epilogue.source_digest():
        return None
    return cubin, function


def scalar_arrays(spec, values: dict[int, float]) -> dict[int, np.ndarray]:
    # cuDNN reads each scalar through a host pointer as exactly the declared compute type.
    dtype = np.float64 if spec.compute_dtype == dtypes.FLOAT64 else np.float32
    return {uid: np.full((1,), value, dtype=dtype) for uid, value in values.items()}


def notes_source(handles, spec, fused: bool, acc_dtype, i: int, index: int, engine: str,
                 modes: tuple[str, ...] = ("A", "FALLBACK")):
    """A call that probes part `i`'s numerical notes on a fresh copy of its graph. It holds the
    session's `handles`, not the session: a plan outlives it (resident.py)."""

    def fresh_graph():
        return build_graph(spec, fused=fused, handle=handles.current(), acc_dtype=acc_dtype).parts[i].graph

    return functools.partial(_probe_notes, fresh_graph, index=index, engine=engine, modes=modes)


def _probe_notes(fresh_graph, **kwargs):
    from . import notes  # imported when someone asks: a warm process never probes

    return notes.probe(fresh_graph, **kwargs)
