"""Graph construction: spec -> cuDNN operation graph(s) with explicit uids, names and dtypes."""

from .builders import ROLE_UIDS, GraphBuild, GraphPart, build_graph, cudnn_dims

__all__ = ["ROLE_UIDS", "GraphBuild", "GraphPart", "build_graph", "cudnn_dims"]
