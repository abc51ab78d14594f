"""The io dtypes the kernels take, one table for every kernel source: each dtype's storage type in
types.cuh, its math (accumulation) type, and its size in bytes."""

from __future__ import annotations

STORAGE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
MATH = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPE_OF = {ctype: dtype for dtype, ctype in STORAGE.items()}  # "float" -> "float32"
# io dtype -> (storage type, math type): what the epilogue and grid_sample templates are instantiated on
CTYPES = {dtype: (STORAGE[dtype], MATH[dtype]) for dtype in STORAGE}
SIXTEEN_AND_32 = ("float16", "bfloat16", "float32")  # the tensor-core dtypes: GEMMs and BatchNorm's kernels
