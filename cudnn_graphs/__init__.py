"""cudnn-graphs: convolution op specs -> cuDNN v9 operation graphs, with plans cached on disk.

Pipeline: spec (`ConvFwdSpec` ...) -> signature (stable cache key) -> graph (`build_graph`) ->
plan -> cache -> execute.
"""

from ._version import __version__
from .environment import Environment, environment
from .errors import (BufferMismatchError, CudnnGraphsError, ConfigError, FrontendMissingError, KernelCompileError, SpecError,
                     UnsupportedGraphError)
from .graph import GraphBuild, GraphPart, build_graph
from .plan import Plan, Session
from .signature import signature
from .spec import (ACTIVATIONS, Activation, ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, TensorDesc,
                   spec_from_dict)

__all__ = [
    "ACTIVATIONS", "Activation", "BufferMismatchError", "ConfigError", "ConvBwdDataSpec", "ConvBwdFilterSpec", "ConvFwdSpec",
    "CudnnGraphsError", "Environment", "FrontendMissingError", "GraphBuild", "GraphPart",
    "KernelCompileError", "Plan", "Session", "SpecError", "TensorDesc", "UnsupportedGraphError", "__version__",
    "build_graph", "environment", "signature", "spec_from_dict",
]
