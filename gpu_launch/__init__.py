"""The launch layer under `cudnn_graphs` and `fallback_kernels`: what a buffer is (torch, CuPy, DLPack,
CUDA array interface, raw pointers), the caller's stream and allocator, the few CUDA driver calls
(streams, graphs, modules, kernel launches), the activation table, and the typed errors these raise.

It imports neither package: `cudnn_graphs` and `fallback_kernels` both stand on it, and
`cudnn_graphs` calls `fallback_kernels`, never the reverse.
"""
