"""gemm_act without a GPU: NVRTC compiles every kernel, cuBLAS operand mapping (emulated on the host),
and the argument checks that run before anything touches CUDA."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cudnn_graphs.errors import BufferMismatchError, SpecError
from gpu_launch.activations import ACTIVATIONS
from fallback_kernels import blas
from fallback_kernels import compile as kc
from fallback_kernels import gemm_act
from fallback_kernels.blas import Mat


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gemm_act_compiles(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    names = gemm_act.name_expressions()
    lowered = kc.nvrtc_check("gemm_act.cu", names, arch, gemm_act.OPTIONS)
    assert all(lowered[name] for name in names)
    # per io type and vector width, for every activation: the backward, the forward over f32 accumulators and
    # (16-bit io) over the io type; per io type and activation the flat forward; then bias_finalize and
    # convert_add
    acts = len(ACTIVATIONS)
    assert len(names) == 2 * (2 * 3 * acts + 2) + (2 * 2 * acts + 2) + 3 * acts
    assert sorted(names) == sorted(n for dt in gemm_act.CTYPES for n in gemm_act.name_expressions(dt))


def test_forward_pass_fits_its_blocks_per_sm_without_local_memory():
    """The pass over an io-typed pre-activation is compiled for four 256-thread blocks per SM (FWD_MIN_BLOCKS):
    at most 64 registers, and, like the f32-accumulator passes, no stack or spills (sm_90, ptxas -v)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    names = [n for n in gemm_act.name_expressions() if n.startswith("act_fwd_rows<")]
    found = kc.ptxas_resources("gemm_act.cu", names, "sm_90", gemm_act.OPTIONS)
    framed = {n: r for n, r in found.items() if r["stack_bytes"] or r["spill_stores"]}
    assert not framed, f"local memory in: {framed}"
    io_typed = [n for n in names if n.split("<")[1].split(",")[0] == n.split(",")[1].strip()]
    assert io_typed and all(found[n]["registers"] <= 64 for n in io_typed), {n: found[n] for n in io_typed}


def test_flat_forward_pass_has_no_local_memory():
    """The flat pass (a pre-activation the GEMM already rounded) keeps its vectors in registers, few enough
    for a full SM of 256-thread blocks at sm_90 (<= 32 registers: 8 blocks)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    names = [n for n in gemm_act.name_expressions() if n.startswith("act_fwd_flat<")]
    assert len(names) == 3 * len(ACTIVATIONS)
    found = kc.ptxas_resources("gemm_act.cu", names, "sm_90", gemm_act.OPTIONS)
    framed = {n: r for n, r in found.items() if r["stack_bytes"] or r["spill_stores"]}
    assert not framed, f"local memory in: {framed}"
    heavy = {n: r["registers"] for n, r in found.items() if r["registers"] > 32}
    assert not heavy, f"more than 32 registers: {heavy}"


def test_activation_codes_match_the_cuda_enum():
    enum = gemm_act.source().split("enum {", 1)[1].split("}", 1)[0]
    names = [n.strip() for n in enum.split(",")]
    expected = {"identity": "ACT_IDENTITY", "relu": "ACT_RELU", "leaky_relu": "ACT_LEAKY", "elu": "ACT_ELU",
                "gelu": "ACT_GELU", "gelu_tanh": "ACT_GELU_TANH", "silu": "ACT_SILU", "sigmoid": "ACT_SIGMOID",
                "tanh": "ACT_TANH", "softplus": "ACT_SOFTPLUS"}
    assert len(names) == len(gemm_act.ACT_CODES) == len(expected)
    for act, code in gemm_act.ACT_CODES.items():
        assert names[code] == expected[act]
    aux = gemm_act.source().split("enum { AUX_NONE", 1)[1].split("}", 1)[0]
    assert aux.replace(" ", "") == ",AUX_MASK,AUX_PRE" and (gemm_act.AUX_MASK, gemm_act.AUX_PRE) == (1, 2)


def test_matrix_order():
    assert blas.matrix_order(4, 3, 3, 1) == ("row", 3)
    assert blas.matrix_order(4, 3, 8, 1) == ("row", 8)  # padded rows
    assert blas.matrix_order(4, 3, 1, 4) == ("col", 4)  # a transposed view
    assert blas.matrix_order(4, 3, 2, 8) is None  # every other column
    assert blas.matrix_order(4, 3, 0, 1) is None  # broadcast rows
    assert blas.matrix_order(1, 3, 999, 1) == ("row", 3)  # size-1 dims: any stride
    assert blas.matrix_order(4, 1, 1, 999) == ("col", 4) or blas.matrix_order(4, 1, 1, 999)[0] == "row"


def test_flatten_batches():
    a = Mat(0, 5, 3, 3, 1, "float32", batch=4, bs=15)
    assert a.flat_rows() == Mat(0, 20, 3, 3, 1, "float32")
    at = Mat(0, 5, 3, 1, 5, "float32", batch=4, bs=15)  # per-batch column-major: rows do not stack
    assert at.flat_rows() is None
    assert a.T.flat_cols() == Mat(0, 3, 20, 1, 3, "float32")


# --- cuBLAS emulated on host memory: the op-flag / leading-dimension mapping for every operand layout


class _HostBlas:
    """gemmEx / gemmStridedBatchedEx on numpy buffers addressed by their host pointers (float32 only)."""

    def __init__(self):
        self.buffers = []
        self.calls = []

    def array(self, values: np.ndarray, layout: str) -> tuple[np.ndarray, Mat]:
        """`values` [..., r, c] stored row-major ('row') or as a transposed view ('col')."""
        values = np.asarray(values, np.float32)
        store = np.ascontiguousarray(values if layout == "row" else np.swapaxes(values, -1, -2))
        view = store if layout == "row" else np.swapaxes(store, -1, -2)
        self.buffers.append(store)
        *bsh, r, c = view.shape
        *bst, rs, cs = (s // 4 for s in view.strides)
        return view, Mat(store.ctypes.data, r, c, rs, cs, "float32", bsh[0] if bsh else 1, bst[0] if bsh else 0)

    def _read(self, ptr, rows, cols, ld):
        for buf in self.buffers:
            base = buf.ctypes.data
            if base <= ptr < base + buf.nbytes:
                flat = buf.reshape(-1)
                off = (ptr - base) // 4
                idx = off + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]
                return flat, idx
        raise AssertionError("pointer outside every buffer")

    def gemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct,
                             ldc, sc, count, compute, algo):
        al, be = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
        self.calls.append((ta, tb, m, n, k, lda, ldb, ldc, count))
        assert lda >= max(1, m if ta == 0 else k) and ldb >= max(1, k if tb == 0 else n) and ldc >= max(1, m)
        for i in range(count):
            size = {0: 4, 2: 2, 14: 2}  # bytes per element of a cudaDataType_t
            fa, ia = self._read(A + i * sa * size[at], *((m, k) if ta == 0 else (k, m)), lda)
            fb, ib = self._read(B + i * sb * size[bt], *((k, n) if tb == 0 else (n, k)), ldb)
            fc, ic = self._read(C + i * sc * size[ct], m, n, ldc)
            opa = fa[ia] if ta == 0 else fa[ia].T
            opb = fb[ib] if tb == 0 else fb[ib].T
            fc[ic] = al * (opa.astype(np.float64) @ opb) + (be * fc[ic] if be != 0 else 0)

    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo):
        self.gemmStridedBatchedEx(handle, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc,
                                  0, 1, compute, algo)


@pytest.fixture
def host_blas(monkeypatch):
    fake = _HostBlas()
    monkeypatch.setattr(blas, "_lib", lambda: fake)
    return fake


@pytest.mark.parametrize("lx", ["row", "col"])
@pytest.mark.parametrize("lp", ["row", "col"])
@pytest.mark.parametrize("lq", ["row", "col"])
def test_gemm_layouts_without_copies(host_blas, lx, lp, lq):
    rng = np.random.default_rng(0)
    p, mp = host_blas.array(rng.standard_normal((5, 7)), lp)
    q, mq = host_blas.array(rng.standard_normal((7, 3)), lq)
    x0 = rng.standard_normal((5, 3))
    x, mx = host_blas.array(x0, lx)
    blas.gemm(0, mx, mp, mq, beta=1.0)
    np.testing.assert_allclose(x, x0 + p.astype(np.float64) @ q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("la", ["row", "col"])
def test_batched_shared_operand(host_blas, la):
    rng = np.random.default_rng(1)
    a, ma = host_blas.array(rng.standard_normal((3, 5, 7)), la)
    b, mb = host_blas.array(rng.standard_normal((7, 4)), "col")
    y, my = host_blas.array(np.zeros((3, 5, 4)), "row")
    gemm_act._gemm_rows(0, my, ma, mb, beta=0.0, compute=blas.COMPUTE_32F)
    np.testing.assert_allclose(y, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert host_blas.calls[-1][-1] == (1 if la == "row" else 3)  # contiguous batches flatten into one GEMM


# --- argument checks that run before CUDA is touched


class _Fake:
    """Something with __cuda_array_interface__ and a made-up pointer: enough for the checks."""

    def __init__(self, shape, typestr="<f2", strides=None, ptr=1 << 20):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


def _bytes(strides, itemsize=2):
    return tuple(s * itemsize for s in strides)


def _err(exc_info):
    return exc_info.value.role, exc_info.value.what


def test_forward_argument_checks():
    a, b = _Fake((8, 4)), _Fake((4, 6))
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(a, _Fake((5, 6)), activation="relu")
    assert _err(e) == ("b", "shape")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(a, _Fake((4, 6), "<f4"), activation="relu")
    assert _err(e) == ("b", "dtype")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(_Fake((8, 4), "<f8"), _Fake((4, 6), "<f8"), activation="relu")
    assert _err(e) == ("a", "dtype")
    with pytest.raises(BufferMismatchError) as e:  # every other column: neither row- nor column-major
        gemm_act.gemm_bias_act(_Fake((8, 4), strides=_bytes((8, 2))), b, activation="relu")
    assert _err(e) == ("a", "strides")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(a, b, _Fake((5,)), activation="relu")
    assert _err(e) == ("bias", "shape")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(_Fake((8, 4), ptr=(1 << 20) + 1), b, activation="relu")
    assert _err(e) == ("a", "alignment")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(1234, b, activation="relu")
    assert _err(e) == ("a", "type")
    with pytest.raises(BufferMismatchError) as e:
        gemm_act.gemm_bias_act(_Fake((2, 2, 8, 4)), b, activation="relu")
    assert _err(e) == ("a", "shape")
    with pytest.raises(SpecError) as e:
        gemm_act.gemm_bias_act(a, b, activation="mish")
    assert e.value.field == "activation"
    with pytest.raises(SpecError) as e:
        gemm_act.gemm_bias_act(_Fake((0, 4)), b, activation="relu")
    assert e.value.field == "shape"


def test_backward_argument_checks():
    a, b = _Fake((8, 4)), _Fake((4, 40))
    dy, pre, mask = _Fake((8, 40)), _Fake((8, 40)), _Fake((8, 4), "<u4")
    bwd = gemm_act.gemm_bias_act_backward
    with pytest.raises(BufferMismatchError) as e:  # a transposed dy: the elementwise pass wants it contiguous
        bwd(_Fake((8, 40), strides=_bytes((1, 8))), a, b, pre, activation="gelu")
    assert _err(e) == ("dy", "strides")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, pre, activation="leaky_relu")  # leaky_relu's aux is the bit mask
    assert _err(e) == ("aux", "shape")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, _Fake((8, 4), "<f4"), activation="leaky_relu")
    assert _err(e) == ("aux", "dtype")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, mask, activation="relu")  # relu's aux is y itself
    assert _err(e) == ("aux", "shape")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, None, activation="gelu")
    assert _err(e) == ("aux", "buffer")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, mask, activation="leaky_relu", accumulate=True)
    assert _err(e) == ("da", "buffer")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, mask, activation="leaky_relu", db=_Fake((40, 4)))
    assert _err(e) == ("db", "shape")
    with pytest.raises(BufferMismatchError) as e:
        bwd(dy, a, b, mask, activation="leaky_relu", dbias=_Fake((40,), "<f4"))
    assert _err(e) == ("dbias", "dtype")
    with pytest.raises(SpecError) as e:
        bwd(dy, a, b, mask, activation="leaky_relu", need=("a", "w"))
    assert e.value.field == "need"
    with pytest.raises(SpecError) as e:
        bwd(dy, a, b, mask, activation="leaky_relu", chunks=0)
    assert e.value.field == "chunks"
    assert bwd(dy, a, b, mask, activation="leaky_relu", need=()) == (None, None, None)
    # 40 bits padded to 128 (cuBLASLt's RELU_AUX row pitch): 4 words; 129 bits: 8
    assert gemm_act.mask_words(40) == 4 and gemm_act.mask_words(128) == 4 and gemm_act.mask_words(129) == 8
