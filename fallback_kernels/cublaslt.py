"""Row-major GEMMs with fused epilogues on cuBLASLt, through nvmath-python's low-level bindings.

    g = lt_gemm(Geometry(device=0, dtype="bfloat16", m=T, n=H, k=C, a=("row", C), b=("col", C), ldd=H,
                         epilogue="GELU_AUX_BIAS", aux_ld=H))
    g.run(a=x_ptr, b=w_ptr, d=h_ptr, bias=b_ptr, aux=pre_ptr, stream=s, workspace=ws_ptr)

computes D[M, N] = A[M, K] @ B[K, N] (+ the epilogue), every matrix row-major in our terms ("row", ld) or a
transposed view of one ("col", ld). To column-major cuBLASLt that is D.T = B.T @ A.T, so its m is our N: the
epilogue's bias runs over our columns (nn.Linear's output features), its aux is row-major [M, aux_ld], the
BGRAD epilogues sum D over its rows (DRELU_BGRAD, DGELU_BGRAD: length N), B over its rows (BGRADA:
length N) or A over its columns (BGRADB: length M, the bias gradient of a wgrad GEMM dW = dY.T @ X).

Why nvmath-python: it is NVIDIA's maintained binding of cuBLASLt (CuPy 14 has none) and finds the cuBLAS
that torch or the CUDA wheels ship. Its stateful `Matmul` costs ~100 us of host time a call; the bindings
with descriptors, layouts and the algorithm built once per geometry cost ~9 us, which is what this does.
cuBLASLt's GELU epilogues are the tanh approximation (torch's `approximate="tanh"`), so only `gelu_tanh`
maps to them. The algorithm is chosen once per geometry and process, so repeated calls run the same
kernel (the MLP's backward is tested bit-identical run to run).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from gpu_launch.errors import CudnnGraphsError

from .blas import COMPUTE_32F, COMPUTE_32F_FAST_TF32, OP_N, OP_T
from .blas import CUDA_DTYPES as CUDA_R
MAX_WORKSPACE = 32 << 20  # torch's cuBLASLt workspace on Hopper; the algorithm asks for what it needs
AUX_EPILOGUES = ("RELU_AUX", "RELU_AUX_BIAS", "GELU_AUX", "GELU_AUX_BIAS", "DRELU", "DRELU_BGRAD", "DGELU",
                 "DGELU_BGRAD")
RELU_MASK_LD = 128  # cuBLASLt's bit-mask aux: ld (in elements, i.e. bits) a multiple of 128
GELU_AUX_LD = 8


class CublasLtError(CudnnGraphsError, RuntimeError):
    """cuBLASLt refused or failed a GEMM; names the geometry and the call."""

    def __init__(self, call: str, geometry: "Geometry", detail: str):
        self.call = call
        self.geometry = geometry
        super().__init__(f"cuBLASLt {call} for {geometry}: {detail}")


@functools.lru_cache(maxsize=1)
def bindings():
    """nvmath's cuBLASLt module, or None where nvmath-python is not installed (the cuBLAS path serves)."""
    try:
        from nvmath.bindings import cublasLt
    except Exception:  # ImportError, or a CUDA library it cannot find
        return None
    return cublasLt


def available() -> bool:
    return bindings() is not None


def alignment(ptr: int) -> int:
    """The largest power of two up to 256 dividing ptr: the alignment class cuBLASLt's algorithms need."""
    return 256 if ptr % 256 == 0 else ptr & -ptr


@dataclass(frozen=True)
class Geometry:
    """What a cuBLASLt plan depends on: shapes, layouts, types, epilogue, pointer alignment classes."""

    device: int
    dtype: str
    m: int
    n: int
    k: int
    a: tuple[str, int]  # (order, ld) of A [M, K]
    b: tuple[str, int]  # (order, ld) of B [K, N]
    ldd: int  # D [M, N] is row-major
    epilogue: str = "DEFAULT"
    aux_ld: int = 0
    tf32: bool = False
    align: tuple[int, int, int] = (256, 256, 256)  # A, B, D (and C, a residual read where D is written)
    out_dtype: str | None = None  # D's type where it differs from A's and B's (float32 accumulators out)


@functools.lru_cache(maxsize=None)
def _handle(device: int, thread: int) -> int:
    return bindings().create()


def handle(device: int) -> int:
    """One cuBLASLt handle per device and thread; callers make `device` current first."""
    return _handle(device, threading.get_ident())


class LtGemm:
    """One geometry's descriptor, layouts and algorithm, built once; `run` sets only the pointers."""

    def __init__(self, geometry: Geometry, *, algo_index: int = 0):
        L = bindings()
        g = self.geometry = geometry
        self._lock = threading.Lock()  # the bias and aux pointers live in the shared descriptor
        self._h = handle(g.device)
        self._desc = L.matmul_desc_create(COMPUTE_32F_FAST_TF32 if g.tf32 else COMPUTE_32F, CUDA_R["float32"])
        # cuBLASLt's A is our B side, its B our A side: D.T = B.T @ A.T
        self._set(L.MatmulDescAttribute.TRANSA, np.int32(OP_N if g.b[0] == "row" else OP_T))
        self._set(L.MatmulDescAttribute.TRANSB, np.int32(OP_N if g.a[0] == "row" else OP_T))
        self._set(L.MatmulDescAttribute.EPILOGUE, np.uint32(getattr(L.Epilogue, g.epilogue)))
        if g.epilogue in AUX_EPILOGUES:
            self._set(L.MatmulDescAttribute.EPILOGUE_AUX_LD, np.int64(g.aux_ld))
        t = CUDA_R[g.dtype]
        self._layouts = (
            L.matrix_layout_create(t, *((g.n, g.k) if g.b[0] == "row" else (g.k, g.n)), g.b[1]),
            L.matrix_layout_create(t, *((g.k, g.m) if g.a[0] == "row" else (g.m, g.k)), g.a[1]),
            L.matrix_layout_create(CUDA_R[g.out_dtype or g.dtype], g.n, g.m, g.ldd),
        )
        self._ptr_buf = np.zeros(2, np.uint64)  # bias, aux: written per call, read by set_attribute
        self._ptr_addr = self._ptr_buf.ctypes.data
        self._last = [None, None]
        self._scalars = np.array([1.0, 0.0, 1.0], np.float32)  # alpha, beta 0, beta 1
        self._alpha = self._scalars.ctypes.data
        self._betas = (self._alpha + 4, self._alpha + 8)
        self._algo, self.workspace = self._choose(algo_index)

    def _set(self, attr, value: np.generic) -> None:
        buf = np.array(value)
        bindings().matmul_desc_set_attribute(self._desc, attr, buf.ctypes.data, buf.nbytes)

    def _choose(self, index: int):
        """The heuristic's `index`-th algorithm (0: its first choice) and the workspace it needs."""
        L, g = bindings(), self.geometry
        pref = L.matmul_preference_create()
        try:
            for attr, value in ((L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, np.uint64(MAX_WORKSPACE)),
                                (L.MatmulPreferenceAttribute.MIN_ALIGNMENT_A_BYTES, np.uint32(g.align[1])),
                                (L.MatmulPreferenceAttribute.MIN_ALIGNMENT_B_BYTES, np.uint32(g.align[0])),
                                (L.MatmulPreferenceAttribute.MIN_ALIGNMENT_C_BYTES, np.uint32(g.align[2])),
                                (L.MatmulPreferenceAttribute.MIN_ALIGNMENT_D_BYTES, np.uint32(g.align[2]))):
                buf = np.array(value)
                L.matmul_preference_set_attribute(pref, attr, buf.ctypes.data, buf.nbytes)
            self._heur = L.MatmulHeuristicResult(index + 1)  # the algorithm structs: kept with the plan
            count = np.zeros(1, np.int32)
            bl, al, dl = self._layouts
            L.matmul_algo_get_heuristic(self._h, self._desc, bl, al, dl, dl, pref, index + 1, self._heur.ptr,
                                        count.ctypes.data)
        except Exception as exc:
            raise CublasLtError("matmul_algo_get_heuristic", g, str(exc)) from exc
        finally:
            L.matmul_preference_destroy(pref)
        if int(count[0]) <= index:
            raise CublasLtError("matmul_algo_get_heuristic", g, f"{int(count[0])} algorithms, asked for #{index}")
        size = L.matmul_heuristic_result_dtype.itemsize
        return self._heur.ptr + index * size, int(self._heur[index].workspace_size)

    def run(self, *, a: int, b: int, d: int, stream: int, bias: int = 0, aux: int = 0, accumulate: bool = False,
            workspace: int = 0, c: int = 0) -> None:
        """D = A @ B (+ D when accumulate, + C where `c` is given: a residual read in the epilogue, laid out as
        D, its alignment class in the geometry's), with the epilogue; pointers are device addresses."""
        L = bindings()
        bl, al, dl = self._layouts
        with self._lock:
            if bias != self._last[0]:
                self._ptr_buf[0] = bias
                L.matmul_desc_set_attribute(self._desc, L.MatmulDescAttribute.BIAS_POINTER, self._ptr_addr, 8)
                self._last[0] = bias
            if aux != self._last[1]:
                self._ptr_buf[1] = aux
                L.matmul_desc_set_attribute(self._desc, L.MatmulDescAttribute.EPILOGUE_AUX_POINTER,
                                            self._ptr_addr + 8, 8)
                self._last[1] = aux
            L.matmul(self._h, self._desc, self._alpha, b, bl, a, al, self._betas[accumulate or c != 0], c or d, dl,
                     d, dl, self._algo, workspace, self.workspace, stream)


_PLANS: dict[Geometry, LtGemm | CublasLtError] = {}
_PLANS_LOCK = threading.Lock()


def lt_gemm(geometry: Geometry) -> LtGemm:
    """The plan of a geometry, built once per process; a refused geometry raises the same error again."""
    plan = _PLANS.get(geometry)
    if plan is None:
        with _PLANS_LOCK:
            plan = _PLANS.get(geometry)
            if plan is None:
                try:
                    plan = LtGemm(geometry)
                except CublasLtError as exc:
                    plan = exc
                _PLANS[geometry] = plan
    if isinstance(plan, CublasLtError):
        raise plan
    return plan


def relu_mask_ld(n: int) -> int:
    """Bits per row of the relu bit mask (ours and cuBLASLt's): n rounded up to 128."""
    return -(-n // RELU_MASK_LD) * RELU_MASK_LD
