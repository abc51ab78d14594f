"""Where torch's own op serves instead of ours (CPU tensors): said once per process, never per call or shape
(one mobilenet_v3_small forward on CPU said it 41 times, once per conv shape)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("cudnn_graphs")
_said: set = set()  # non-empty once the warning was given (tests empty it)


def on_cuda(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given is a CUDA tensor (None stands for an absent optional one)."""
    return all(t is None or t.is_cuda for t in tensors)


def cpu_once(op: str, *tensors: torch.Tensor | None, by: str = "torch's own op") -> None:
    """One warning per process, naming the first call on CPU tensors that `by` ran."""
    if _said:
        return
    _said.add(op)
    shapes = " x ".join(str(tuple(t.shape)) for t in tensors if t is not None)
    log.warning("cudnn_graphs: %s %s runs through %s: CPU tensors (this library runs on CUDA tensors); every "
                "call on CPU tensors does likewise, said once per process", op, shapes, by)
