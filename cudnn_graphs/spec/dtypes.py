"""Data types a spec may name, their aliases, and which compute types go with them."""

from __future__ import annotations

from typing import Any

from fallback_kernels.types import ITEMSIZE  # noqa: F401  one dtype table for the kernels and the specs

from ..errors import SpecError

FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT32 = "float32"
FLOAT64 = "float64"

IO_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)

_ALIASES = {
    "float16": FLOAT16, "half": FLOAT16, "fp16": FLOAT16, "f16": FLOAT16,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
    "float32": FLOAT32, "float": FLOAT32, "fp32": FLOAT32, "f32": FLOAT32,
    "float64": FLOAT64, "double": FLOAT64, "fp64": FLOAT64, "f64": FLOAT64,
}


def canonical_dtype(field: str, value: Any) -> str:
    """Map a dtype given as a name, numpy dtype or torch dtype to its canonical name."""
    if isinstance(value, str):
        text = value
    elif isinstance(getattr(value, "name", None), str):
        text = value.name  # numpy / cupy dtype objects
    elif isinstance(value, type) and value.__module__ == "numpy":
        text = value.__name__  # numpy scalar types: np.float32
    else:
        text = str(value)  # torch.float16 -> "torch.float16"
    key = text.strip().lower().removeprefix("torch.").removeprefix("numpy.")
    if key not in _ALIASES:
        raise SpecError(field, value, f"unknown dtype; expected one of {list(IO_DTYPES)}")
    return _ALIASES[key]


def default_compute_dtype(dtype: str) -> str:
    return FLOAT64 if dtype == FLOAT64 else FLOAT32


def check_compute_dtype(dtype: str, compute_dtype: str) -> None:
    # Reduced-precision accumulation (fp16 compute) loses accuracy no framework accepts for training.
    if compute_dtype not in (FLOAT32, FLOAT64):
        raise SpecError("compute_dtype", compute_dtype, "must be float32 or float64")
    if dtype == FLOAT64 and compute_dtype != FLOAT64:
        raise SpecError("compute_dtype", compute_dtype, "float64 data takes float64 compute (cuDNN has no "
                        "engine accumulating float64 data in float32): leave compute_dtype unset or pass 'float64'")
    if dtype != FLOAT64 and compute_dtype == FLOAT64:
        raise SpecError("compute_dtype", compute_dtype, f"float64 compute needs float64 data (dtype={dtype!r}): "
                        "leave compute_dtype unset for float32 accumulation, or pass dtype='float64'")
