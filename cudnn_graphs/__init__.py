"""cudnn-graphs: convolution op specs -> cuDNN v9 operation graphs, with plans cached on disk.

Pipeline: spec (`ConvFwdSpec` ...) -> signature (stable cache key) -> graph (`build_graph`) ->
plan -> cache -> execute.
"""

from ._version import __version__
from .api import conv_bwd_data, conv_bwd_filter, conv_fwd, default_session, run
from .environment import Environment, environment
from .errors import (BufferMismatchError, CaptureError, ConfigError, CudaDriverError, CudnnBackendError,
                     CudnnGraphsError, FrontendMissingError, GraphCaptureError, KernelCompileError, NoGpuError,
                     ShapeError, SpecError, TargetEnvError, UnsupportedGraphError)
from .graph import GraphBuild, GraphPart, build_graph
from .plan import Plan, Session
from .recording import record
from .requests import ConvBwdDataRequest, ConvBwdFilterRequest, ConvFwdRequest
from .signature import signature
from .spec import (ACTIVATIONS, Activation, ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, TensorDesc,
                   spec_from_dict)

__all__ = [
    "ACTIVATIONS", "Activation", "BufferMismatchError", "CaptureError", "ConfigError", "ConvBwdDataRequest", "ConvBwdDataSpec",
    "ConvBwdFilterRequest", "ConvBwdFilterSpec", "ConvFwdRequest", "ConvFwdSpec", "CudaDriverError",
    "CudnnBackendError", "CudnnGraphsError", "Environment", "FrontendMissingError", "GraphBuild", "GraphCaptureError",
    "GraphPart", "KernelCompileError", "NoGpuError", "Plan", "Session", "ShapeError", "SpecError", "TargetEnvError",
    "TensorDesc", "UnsupportedGraphError", "__version__", "build_graph", "conv_bwd_data", "conv_bwd_filter",
    "conv_fwd", "default_session", "environment", "record", "run", "signature", "spec_from_dict",
]
