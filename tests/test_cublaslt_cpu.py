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
    if not cublaslt.available():
        pytest.skip("nvmath-python not installed")
    act = lambda n: as_activation("activation", n)  # noqa: E731
    assert gemm_act._lt_epilogue(act("gelu_tanh"), True, True) == "GELU_AUX_BIAS"
    assert gemm_act._lt_epilogue(act("gelu_tanh"), False, False) == "GELU"
    assert gemm_act._lt_epilogue(act("identity"), True, False) == "BIAS"
    # identity without bias is a plain cuBLAS GEMM; exact gelu and relu keep the fused pass
    assert gemm_act._lt_epilogue(act("identity"), False, False) is None
    assert gemm_act._lt_epilogue(act("gelu"), True, True) is None
    assert gemm_act._lt_epilogue(act("relu"), True, True) is None


class _Ops:
    device, dtype = 0, "bfloat16"


def _m(ptr, rows, cols, rs, cs, batch=1, bs=0):
    return Mat(ptr, rows, cols, rs, cs, "bfloat16", batch, bs)


def test_lt_declines_what_it_cannot_express_before_any_gpu_call():
    ops = _Ops()
    x, p, q = _m(0x1000, 8, 16, 16, 1), _m(0x2000, 8, 4, 4, 1), _m(0x3000, 4, 16, 16, 1)
    kw = {"accumulate": False, "tf32": False, "sptr": 0}
    assert gemm_act._lt_mat(ops, None, p, q, **kw) is None  # a batch that did not flatten
    assert gemm_act._lt_mat(ops, _m(0x1000, 8, 16, 16, 1, batch=2, bs=128), p, q, **kw) is None
    assert gemm_act._lt_mat(ops, x, p, q, epilogue="BIAS", bias=0x4008, **kw) is None  # bias not 16-byte aligned
    assert gemm_act._lt_mat(ops, x, p, q, epilogue="BIAS", bias=0x4000, bias_stride=2, **kw) is None
    xt = _m(0x1000, 8, 16, 1, 8)  # a column-major output takes only epilogues that survive the transpose
    assert gemm_act._lt_mat(ops, xt, p, q, epilogue="GELU_AUX_BIAS", bias=0x4000, aux=0x5000, **kw) is None
    odd = _m(0x1000, 8, 13, 13, 1)  # gelu's aux pitch must be a multiple of 8 elements
    assert gemm_act._lt_mat(ops, odd, p, _m(0x3000, 4, 13, 13, 1), epilogue="GELU_AUX", aux=0x5000, **kw) is None


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
