"""CUDA C++ kernels for what cuDNN lacks, compiled at run time through CuPy (NVRTC)."""
