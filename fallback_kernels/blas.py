"""cuBLAS GEMMs on raw device pointers through CuPy's bindings, for row- and column-major operands alike.

A matrix is (pointer, rows, cols, row stride, column stride) in elements, optionally a strided batch. A
row-major [r, c] matrix with leading dimension ld is, to column-major cuBLAS, the [c, r] matrix with the
same ld: transposed views (e.g. nn.Linear's weight.T) become op flags, never copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from .types import ITEMSIZE as _ITEMSIZE

# cudaDataType_t and cublasComputeType_t / cublasMath_t values (library_types.h, cublas_api.h).
CUDA_DTYPES = {"float16": 2, "bfloat16": 14, "float32": 0}
ITEMSIZE = {dtype: _ITEMSIZE[dtype] for dtype in CUDA_DTYPES}
COMPUTE_32F, COMPUTE_32F_PEDANTIC, COMPUTE_32F_FAST_TF32 = 68, 69, 77
TF32_TENSOR_OP_MATH = 3
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1
INT_MAX = 2**31 - 1


def matrix_order(rows: int, cols: int, rs: int, cs: int) -> tuple[str, int] | None:
    """('row', ld) or ('col', ld) cuBLAS can address without a copy, else None; strides in elements.

    Strides of a dimension of size 1 never address memory, so they do not constrain the order.
    """
    if (cs == 1 or cols == 1) and (rows == 1 or rs >= max(cols, 1)):
        return "row", (rs if rows > 1 else max(cols, 1))
    if (rs == 1 or rows == 1) and (cols == 1 or cs >= max(rows, 1)):
        return "col", (cs if cols > 1 else max(rows, 1))
    return None


@dataclass(frozen=True)
class Mat:
    """A matrix (or a strided batch of them) in device memory; strides in elements."""

    ptr: int
    rows: int
    cols: int
    rs: int
    cs: int
    dtype: str
    batch: int = 1
    bs: int = 0  # batch stride; 0 with batch == 1, or for an operand shared by every batch

    @property
    def T(self) -> "Mat":  # noqa: N802 - the usual name for a transpose
        return replace(self, rows=self.cols, cols=self.rows, rs=self.cs, cs=self.rs)

    @property
    def order(self) -> tuple[str, int] | None:
        return matrix_order(self.rows, self.cols, self.rs, self.cs)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def flat_rows(self) -> "Mat | None":
        """The batch as one [batch * rows, cols] matrix when memory allows it, else None."""
        if self.batch == 1:
            return self
        if self.rows != 1 and self.bs != self.rows * self.rs:
            return None
        rs = self.rs if self.rows != 1 else self.bs
        flat = replace(self, rows=self.batch * self.rows, rs=rs, batch=1, bs=0)
        return flat if flat.order is not None else None

    def flat_cols(self) -> "Mat | None":
        """The batch as one [rows, batch * cols] matrix when memory allows it, else None."""
        flat = self.T.flat_rows()
        return None if flat is None else flat.T

    def row_slice(self, r0: int, r1: int) -> "Mat":
        return replace(self, ptr=self.ptr + r0 * self.rs * self.itemsize, rows=r1 - r0)

    def item(self, b: int) -> "Mat":
        return replace(self, ptr=self.ptr + b * self.bs * self.itemsize, batch=1, bs=0)


def _lib():
    """CuPy's cuBLAS bindings (a function, so tests can stand in a host emulation)."""
    from cupy_backends.cuda.libs import cublas

    return cublas


def compute_type(dtype: str, *, allow_tf32: bool, handle: int) -> int:
    """f32 accumulation always; for float32, TF32 only when allowed (the handle's math mode may say TF32)."""
    if dtype != "float32":
        return COMPUTE_32F
    if allow_tf32:
        return COMPUTE_32F_FAST_TF32
    return COMPUTE_32F_PEDANTIC if _lib().getMathMode(handle) & 0xF == TF32_TENSOR_OP_MATH else COMPUTE_32F


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def _scalar(v: float) -> np.ndarray:
    return _ONE if v == 1.0 else _ZERO if v == 0.0 else np.full(1, v, np.float32)


def gemm(handle: int, x: Mat, p: Mat, q: Mat, *, beta: float = 0.0, alpha: float = 1.0,
         compute: int = COMPUTE_32F) -> None:
    """x[i] = alpha * p[i] @ q[i] + beta * x[i] for each batch item i (p or q may be shared: batch 1).

    Runs on whatever stream `handle` is bound to. The caller has checked that every matrix has an order.
    """
    cublas = _lib()
    if x.order is None:
        raise ValueError(f"gemm output has no cuBLAS layout: {x}")
    if x.order[0] == "col":  # x = p @ q  <=>  x.T = q.T @ p.T, with x.T row-major
        x, p, q = x.T, q.T, p.T
    m, n, k = x.cols, x.rows, p.cols
    if (p.rows, q.rows, q.cols) != (n, k, m):
        raise ValueError(f"gemm shapes disagree: x {x.rows}x{x.cols}, p {p.rows}x{p.cols}, q {q.rows}x{q.cols}")
    ldc = x.order[1]
    oq, op = q.order, p.order
    if oq is None or op is None:
        raise ValueError("gemm operand has no cuBLAS layout")
    # Column-major A = q.T [m, k]: a row-major q is stored as exactly that (N), a column-major one is q (T).
    transa, lda = (OP_N if oq[0] == "row" else OP_T), oq[1]
    transb, ldb = (OP_N if op[0] == "row" else OP_T), op[1]
    for value in (m, n, k, lda, ldb, ldc, x.batch):
        if value > INT_MAX:
            raise ValueError(f"gemm dimension {value} exceeds cuBLAS's int32 range")
    a_alpha, a_beta = _scalar(alpha), _scalar(beta)
    ta, tb, tc = CUDA_DTYPES[q.dtype], CUDA_DTYPES[p.dtype], CUDA_DTYPES[x.dtype]
    if x.batch == 1:
        cublas.gemmEx(handle, transa, transb, m, n, k, a_alpha.ctypes.data, q.ptr, ta, lda, p.ptr, tb, ldb,
                      a_beta.ctypes.data, x.ptr, tc, ldc, compute, GEMM_DEFAULT)
    else:
        cublas.gemmStridedBatchedEx(handle, transa, transb, m, n, k, a_alpha.ctypes.data, q.ptr, ta, lda,
                                    q.bs if q.batch > 1 else 0, p.ptr, tb, ldb, p.bs if p.batch > 1 else 0,
                                    a_beta.ctypes.data, x.ptr, tc, ldc, x.bs, x.batch, compute, GEMM_DEFAULT)


def main_handle(device: int, stream_ptr: int) -> int:
    """CuPy's cuBLAS handle for the current device, bound to `stream_ptr` (rebound on every call)."""
    import cupy

    handle = cupy.cuda.device.get_cublas_handle()
    _lib().setStream(handle, stream_ptr)
    return handle


@functools.lru_cache(maxsize=None)
def _side_handle(device: int, thread: int) -> int:
    import cupy

    with cupy.cuda.Device(device):
        return _lib().create()  # its own workspace: it runs concurrently with the main handle's GEMMs


def side_handle(device: int, stream_ptr: int) -> int:
    """A second handle (per device and thread) for GEMMs on a side stream, bound to `stream_ptr`."""
    import threading

    handle = _side_handle(device, threading.get_ident())
    _lib().setStream(handle, stream_ptr)
    return handle
