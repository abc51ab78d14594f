"""Drop-in PyTorch modules and functions: convolutions on this library's cuDNN plans (`Conv2d` ...),
`convert(model)`, `capture(model, sample_args)` (forward and backward as CUDA graphs), and the fallback
kernels (`grid_sample`, `LinearAct`, `MLP` on cuBLASLt).

`import cudnn_graphs.torch` needs torch; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "convert": "_convert", "ConversionReport": "_convert",
    "capture": "_capture", "Captured": "_capture",
    "conv1d": "_conv", "conv2d": "_conv", "conv3d": "_conv", "Conv1d": "_conv", "Conv2d": "_conv", "Conv3d": "_conv",
    "grid_sample": "_grid_sample",
    "GridSample": "_grid_sample",
    "linear_act": "_linear_act",
    "LinearAct": "_linear_act",
    "MLP": "_mlp", "mlp": "_mlp",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
