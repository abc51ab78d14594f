"""CPU: the cuBLASLt layer's pure parts (geometry, mask pitch, alignment classes, which GEMMs it declines
before touching a GPU) and the MLP module's construction, state_dict and CPU forward."""

from __future__ import annotations

import pytest

from fallback_kernels import cublaslt, gemm_act
from fallback_kernels.blas import Mat
from gpu_launch.activations import as_activation
from gpu_launch.errors import SpecError


def test_relu_mask_pitch_and_alignment_classes():
    assert [cublaslt.relu_mask_ld(n) for n in (1, 128, 129, 4096)] == [128, 128, 256, 4096]
    assert [cublaslt.alignment(p) for p in (0x1000, 0x1010, 0x1002, 0x1100)] == [256, 16, 2, 256]


def test_forward_epilogue_choice():
    act = lambda n: as_activation("activation", n)  # noqa: E731
    assert gemm_act._lt_epilogue(act("gelu_tanh"), True, True) == "GELU_AUX_BIAS"
    assert gemm_act._lt_epilogue(act("gelu_tanh"), False, False) == "GELU"
    assert gemm_act._lt_epilogue(act("identity"), True, False) == "BIAS"
    assert gemm_act._lt_epilogue(act("identity"), False, False) == "DEFAULT"
    # relu's bit mask is our pass's over y (y > 0), never RELU_AUX's
    assert gemm_act._lt_epilogue(act("relu"), True, True) == "RELU_BIAS"
    assert gemm_act._lt_epilogue(act("relu"), False, True) == "RELU"
    # exact gelu and leaky_relu are not in cuBLASLt's epilogues: the GEMM adds the bias, the pass does the rest
    assert set(gemm_act.LT_FORWARD) == {"identity", "gelu_tanh", "relu"}


def _m(ptr, rows, cols, rs, cs, batch=1, bs=0):
    return Mat(ptr, rows, cols, rs, cs, "bfloat16", batch, bs)


def _geometry(x, p, q, **kw):
    return gemm_act._lt_geometry(0, "bfloat16", x, p, q, tf32=False, addr=lambda v: v, **kw)


def test_lt_declines_what_it_cannot_express_before_any_gpu_call():
    x, p, q = _m(0x1000, 8, 16, 16, 1), _m(0x2000, 8, 4, 4, 1), _m(0x3000, 4, 16, 16, 1)
    assert _geometry(None, p, q, epilogue="DEFAULT") is None  # a batch that did not flatten
    assert _geometry(_m(0x1000, 8, 16, 16, 1, batch=2, bs=128), p, q, epilogue="DEFAULT") is None
    assert _geometry(x, p, q, epilogue="BIAS", bias=0x4008) is None  # bias not 16-byte aligned
    assert _geometry(x, p, q, epilogue="BIAS", bias=0x4000, bias_stride=2) is None
    xt = _m(0x1000, 8, 16, 1, 8)  # a column-major output takes only epilogues that survive the transpose
    assert _geometry(xt, p, q, epilogue="GELU_AUX_BIAS", bias=0x4000) is None
    odd = _m(0x1000, 8, 13, 13, 1)  # gelu's aux pitch must be a multiple of 8 elements
    assert _geometry(odd, p, _m(0x3000, 4, 13, 13, 1), epilogue="GELU_AUX") is None


def test_lt_geometry_orients_the_output_row_major_and_records_alignment_classes():
    if not cublaslt.available():
        pytest.skip("nvmath-python not installed")
    x, p, q = _m(0x1000, 8, 16, 16, 1), _m(0x2010, 8, 4, 4, 1), _m(0x3000, 4, 16, 1, 4)
    geometry, *_ = _geometry(x, p, q, epilogue="GELU_AUX_BIAS", bias=0x4000)
    assert (geometry.m, geometry.n, geometry.k) == (8, 16, 4)
    assert (geometry.a, geometry.b, geometry.ldd, geometry.aux_ld) == (("row", 4), ("col", 4), 16, 16)
    assert geometry.align == (16, 256, 256) and geometry.epilogue == "GELU_AUX_BIAS"
    xt = _m(0x1000, 8, 16, 1, 8)  # x column-major: x.T = q.T @ p.T, and BGRADA becomes BGRADB
    geometry, x2, p2, q2 = _geometry(xt, p, q, epilogue="BGRADA", bias=0x4000)
    assert geometry.epilogue == "BGRADB" and (x2.rows, x2.cols) == (16, 8) and p2.ptr == q.ptr and q2.ptr == p.ptr


def test_locations_move_like_pointers():
    loc = gemm_act.Loc("dy") + 64
    assert loc == gemm_act.Loc("dy", 64) and (loc + 8).offset == 72
    m = Mat(gemm_act.Loc("a"), 10, 4, 4, 1, "float16")
    assert m.row_slice(2, 6).ptr == gemm_act.Loc("a", 16)  # 2 rows of 4 halves


def test_mlp_module_matches_torch_on_cpu_and_shares_nn_linear_parameters():
    torch = pytest.importorskip("torch")
    from cudnn_graphs.torch import MLP
    from cudnn_graphs.torch._mlp import _fusable, reference

    m = MLP([16, 32, 24, 8], activation="gelu_tanh")
    assert [type(layer) for layer in m.layers] == [torch.nn.Linear] * 3
    assert list(m.state_dict()) == [f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")]
    x = torch.randn(5, 16)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 24),
                              torch.nn.GELU(approximate="tanh"), torch.nn.Linear(24, 8))
    ref.load_state_dict({k.replace("layers.1", "2").replace("layers.2", "4").replace("layers.0", "0"): v
                         for k, v in m.state_dict().items()})
    assert torch.allclose(m(x), ref(x), atol=1e-6) and torch.equal(m(x), reference(x, m))
    weights, biases = [layer.weight for layer in m.layers], [layer.bias for layer in m.layers]
    assert not _fusable(x, weights, biases, m.activation)  # CPU tensors: torch's ops


@pytest.mark.parametrize("sizes", [[16], [], [16, 0], [16, True], [16, 8.0]])
def test_mlp_bad_sizes_name_the_field(sizes):
    pytest.importorskip("torch")
    from cudnn_graphs.torch import MLP

    with pytest.raises(SpecError) as e:
        MLP(sizes)
    assert e.value.field == "sizes"
