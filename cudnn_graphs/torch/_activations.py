"""Our activations as torch functions: the fallbacks and unfused paths of the torch layer use them."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def torch_activation(name: str, param: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's function for activation `name` with its parameter (softplus without torch's threshold,
    as our kernels compute it)."""
    return {
        "identity": lambda t: t, "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, param),
        "elu": lambda t: F.elu(t, param), "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "softplus": lambda t: F.softplus(t, beta=param, threshold=1e9),
    }[name]
