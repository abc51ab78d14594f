"""Activations a conv epilogue may apply, with PyTorch's names, parameters and defaults.

Each is something cuDNN pointwise modes express, forward and backward; parameters cuDNN's frontend
does not expose (ELU alpha, softplus beta) are built from other pointwise ops by the graph builder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import SpecError

# name -> (parameter name or None, PyTorch's default value)
ACTIVATIONS: dict[str, tuple[str | None, float | None]] = {
    "identity": (None, None),
    "relu": (None, None),
    "leaky_relu": ("negative_slope", 0.01),
    "elu": ("alpha", 1.0),
    "gelu": (None, None),
    "gelu_tanh": (None, None),
    "silu": (None, None),
    "sigmoid": (None, None),
    "tanh": (None, None),
    "softplus": ("beta", 1.0),
}
_ALIASES = {"none": "identity", "linear": "identity", "swish": "silu", "gelu_approx_tanh": "gelu_tanh",
            # torch.nn's class names, lower-cased
            "leakyrelu": "leaky_relu"}
# torch.nn activation modules: (our name, the attribute holding our parameter), found by class name so that
# nothing here imports torch. Softplus's threshold is not modelled: ours is the exact softplus.
_TORCH_MODULES = {"Identity": ("identity", None), "ReLU": ("relu", None), "LeakyReLU": ("leaky_relu", "negative_slope"),
                  "ELU": ("elu", "alpha"), "GELU": ("gelu", None), "SiLU": ("silu", None),
                  "Sigmoid": ("sigmoid", None), "Tanh": ("tanh", None), "Softplus": ("softplus", "beta")}
# a parameter called by another name: which name is ours
_PARAM_ALIASES = {"slope": "negative_slope", "negative_slope": "negative_slope", "alpha": "alpha", "beta": "beta"}


@dataclass(frozen=True)
class Activation:
    """An activation and its one parameter (None for those that take none)."""

    name: str
    param: float | None = None

    def __post_init__(self) -> None:
        name = _canonical_name(self.name) if isinstance(self.name, str) else self.name
        if name not in ACTIVATIONS:
            raise SpecError("activation", self.name, f"unknown activation; expected one of {list(ACTIVATIONS)}")
        param_name, default = ACTIVATIONS[name]
        param = self.param
        if param_name is None:
            if param is not None:
                raise SpecError("activation", self.name, f"{name} takes no parameter, got {param!r}")
        else:
            param = default if param is None else finite_number(f"activation.{param_name}", param)
            if name == "softplus" and param <= 0:
                raise SpecError("activation.beta", param, "softplus beta must be > 0")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "param", param)

    @property
    def param_name(self) -> str | None:
        return ACTIVATIONS[self.name][0]

    @property
    def is_identity(self) -> bool:
        return self.name == "identity"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.param_name is not None:
            out[self.param_name] = self.param
        return out

    def __str__(self) -> str:
        return self.name if self.param is None else f"{self.name}({self.param_name}={self.param!r})"


def finite_number(field: str, value: Any) -> float:
    """`value` as a float when it is a finite real number (not a bool), else SpecError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, value, "expected a finite real number")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise SpecError(field, value, "expected a finite real number (out of float range)") from None
    if not math.isfinite(number):
        raise SpecError(field, value, "expected a finite real number")
    return number + 0.0  # -0.0 == 0.0 but would print (and so hash into signatures) differently


def _canonical_name(name: str) -> str:
    """Our name for an activation however spelled: relu, ReLU, LeakyReLU, leaky-relu, Swish ..."""
    if name in ACTIVATIONS:
        return name
    key = name.lower().replace("-", "_")
    return _ALIASES.get(key, _ALIASES.get(key.replace("_", ""), key))


def _from_module(value: Any) -> Activation | None:
    """The activation a torch.nn module instance is (nn.ReLU(), nn.LeakyReLU(0.1) ...), else None."""
    found = _TORCH_MODULES.get(type(value).__name__) if type(value).__module__.startswith("torch") else None
    if found is None:
        return None
    name, attr = found
    if name == "gelu" and getattr(value, "approximate", "none") == "tanh":
        name = "gelu_tanh"
    return Activation(name, getattr(value, attr) if attr else None)


def as_activation(field: str, value: Any) -> Activation:
    """Accept None, a name, an Activation, a (name, param) pair or a dict form."""
    try:
        if value is None:
            return Activation("identity")
        if isinstance(value, Activation):
            return value
        if isinstance(value, str):
            return Activation(value)
        if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str):
            return Activation(value[0], value[1])
        if isinstance(value, Mapping):
            return _from_mapping(value)
        module = _from_module(value)
        if module is not None:
            return module
    except SpecError as err:
        raise SpecError(field, value, err.reason if err.field == "activation" else str(err)) from None
    raise SpecError(field, value, "expected an activation name, Activation, (name, param) or dict")


def _from_mapping(value: Mapping[str, Any]) -> Activation:
    name = value.get("name")
    if not isinstance(name, str):
        raise SpecError("activation", value, "the dict form needs a 'name'")
    act = Activation(name)
    extra = set(value) - {"name"} - ({act.param_name} if act.param_name else set())
    if extra:
        hint = [f"{k!r} is called {act.param_name!r}" for k in extra
                if act.param_name and _PARAM_ALIASES.get(k) == act.param_name]
        takes = f"{act.name} takes {act.param_name!r}" if act.param_name else f"{act.name} takes no parameter"
        raise SpecError("activation", value, f"unknown keys {sorted(extra)}: {takes}" + (f" ({hint[0]})" if hint else ""))
    return Activation(act.name, value.get(act.param_name)) if act.param_name else act
