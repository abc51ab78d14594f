"""One activation vocabulary, from torch's spellings to our kernels' names.

`ROWS` has one row per activation: how torch spells it (module class, functions, Tensor methods) and how
its parameter is read. `of_node` reads an fx node with it, `of_module` a module; `epilogue` says which of
them this library's conv epilogues compute exactly. A new activation is one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_launch.activations import ACTIVATIONS, Activation


@dataclass(frozen=True)
class Act:
    """An activation as torch computes it: our name and its one parameter (None where it has none)."""

    name: str
    param: float | None = None

    def epilogue(self) -> Activation | None:
        """This library's epilogue activation computing exactly this, or None (relu6, hardswish ...)."""
        return Activation(self.name, self.param) if self.name in ACTIVATIONS else None

    def __str__(self) -> str:
        return self.name if self.param is None else f"{self.name}({self.param})"


@dataclass(frozen=True)
class _Row:
    name: str
    module: type
    functions: tuple
    methods: tuple
    param: Callable | None = None  # (module or node args/kwargs reader) -> parameter, or the name when it varies


def _gelu_name(approximate: str) -> str:
    return "gelu_tanh" if approximate == "tanh" else "gelu"


ROWS = (
    _Row("relu", nn.ReLU, (F.relu, torch.relu, F.relu_, torch.relu_), ("relu", "relu_")),
    _Row("relu6", nn.ReLU6, (F.relu6,), ()),
    _Row("leaky_relu", nn.LeakyReLU, (F.leaky_relu, F.leaky_relu_), (), "negative_slope"),
    _Row("elu", nn.ELU, (F.elu, F.elu_), (), "alpha"),
    _Row("silu", nn.SiLU, (F.silu,), ()),
    _Row("hardswish", nn.Hardswish, (F.hardswish,), ()),
    _Row("gelu", nn.GELU, (F.gelu,), ()),
    _Row("sigmoid", nn.Sigmoid, (torch.sigmoid, F.sigmoid), ("sigmoid", "sigmoid_")),
    _Row("tanh", nn.Tanh, (torch.tanh, F.tanh), ("tanh", "tanh_")),
)
_BY_MODULE = {row.module: row for row in ROWS}
_BY_FUNCTION = {f: row for row in ROWS for f in row.functions}
_BY_METHOD = {m: row for row in ROWS for m in row.methods}
_DEFAULTS = {"negative_slope": 0.01, "alpha": 1.0}
_POSITION = {"negative_slope": 1, "alpha": 1}


def of_module(module: nn.Module) -> Act | None:
    """The activation a torch.nn activation module computes (its exact class), else None."""
    kind = type(module)
    if kind is nn.Hardtanh and module.min_val == 0.0 and module.max_val == 6.0:
        return Act("relu6")
    row = _BY_MODULE.get(kind)
    if row is None:
        return None
    if row.name == "gelu":
        return Act(_gelu_name(module.approximate))
    return Act(row.name, float(getattr(module, row.param)) if row.param else None)


def activation_of(module: nn.Module) -> Activation | None:
    """This library's epilogue activation for a torch activation module, or None without an exact one."""
    act = of_module(module)
    return None if act is None else act.epilogue()


def of_call(node, module: nn.Module | None) -> Act | None:
    """The activation an fx node applies to its first argument (a module call, function or Tensor
    method), else None."""
    if node.op == "call_module":
        return of_module(module)
    if node.op == "call_function":
        if node.target is F.hardtanh:
            lo = node.kwargs.get("min_val", node.args[1] if len(node.args) > 1 else -1.0)
            hi = node.kwargs.get("max_val", node.args[2] if len(node.args) > 2 else 1.0)
            return Act("relu6") if (lo, hi) == (0.0, 6.0) else None
        row = _BY_FUNCTION.get(node.target)
    elif node.op == "call_method":
        row = _BY_METHOD.get(node.target)
    else:
        return None
    if row is None:
        return None
    if row.name == "gelu":
        return Act(_gelu_name(node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")))
    if row.param is None:
        return Act(row.name)
    value = node.kwargs.get(row.param, node.args[_POSITION[row.param]] if len(node.args) > _POSITION[row.param]
                            else _DEFAULTS[row.param])
    return Act(row.name, float(value)) if isinstance(value, (int, float)) else None


def torch_activation(name: str, param: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's function for activation `name` with its parameter (softplus without torch's threshold,
    as our kernels compute it)."""
    return {
        "identity": lambda t: t, "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, param),
        "elu": lambda t: F.elu(t, param), "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu6": F.relu6, "hardswish": F.hardswish,
        "softplus": lambda t: F.softplus(t, beta=param, threshold=1e9),
    }[name]
