"""Where torch's own op serves instead of ours (CPU tensors): said once per geometry, never per call."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("cudnn_graphs")
_said: set = set()
_MAX_SAID = 1024  # a loop of ever-new shapes must not grow the set without bound: past this, silence


def on_cuda(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given is a CUDA tensor (None stands for an absent optional one)."""
    return all(t is None or t.is_cuda for t in tensors)


def cpu_once(op: str, *tensors: torch.Tensor | None, by: str = "torch's own op") -> None:
    """One warning per geometry (op, shapes, dtypes) for a call on CPU tensors that `by` runs."""
    key = (op, by, *((None if t is None else (tuple(t.shape), t.dtype)) for t in tensors))
    if key in _said or len(_said) >= _MAX_SAID:
        return
    _said.add(key)
    shapes = " x ".join(str(tuple(t.shape)) for t in tensors if t is not None)
    log.warning("cudnn_graphs: %s %s runs through %s: CPU tensors (this library runs on CUDA tensors)",
                op, shapes, by)
