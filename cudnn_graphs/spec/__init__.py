"""Op specs: what to compute, independent of any GPU or library version."""

from gpu_launch.activations import ACTIVATIONS, Activation
from .dtypes import IO_DTYPES
from .serialize import SPEC_SCHEMA_VERSION, spec_from_dict
from .specs import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, ConvSpec, SPEC_TYPES, TensorDesc

__all__ = [
    "ACTIVATIONS", "Activation", "ConvBwdDataSpec", "ConvBwdFilterSpec", "ConvFwdSpec", "ConvSpec",
    "IO_DTYPES", "SPEC_SCHEMA_VERSION", "SPEC_TYPES", "TensorDesc", "spec_from_dict",
]
