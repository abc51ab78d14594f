"""Execution through cuDNN itself: the backend calls a warm process needs, and captured plans.

Buffers, streams and driver calls, which `fallback_kernels` shares, are in `gpu_launch`."""
