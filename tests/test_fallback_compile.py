"""Every fallback kernel source compiles with NVRTC for sm_80 and sm_90, with no GPU."""

from __future__ import annotations

import ctypes

import pytest

from cudnn_graphs.errors import KernelCompileError
from fallback_kernels import compile as kc
from fallback_kernels import epilogue

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_epilogue_compiles(arch):
    lowered = kc.nvrtc_check("epilogue.cu", epilogue.name_expressions(), arch, epilogue.OPTIONS)
    assert all(lowered[name] for name in epilogue.name_expressions())  # every instantiation exists


def test_compile_failure_carries_the_log(monkeypatch):
    monkeypatch.setattr(kc, "source", lambda filename: "__global__ void k() { not_a_function(); }")
    with pytest.raises(KernelCompileError) as err:
        kc.nvrtc_check("broken.cu", ["k"], "sm_90")
    assert "not_a_function" in err.value.log and err.value.kernel == "broken.cu"


def test_activation_codes_match_the_cuda_enum():
    enum = epilogue.source().split("enum {", 1)[1].split("}", 1)[0]
    names = [n.strip() for n in enum.split(",")]
    assert len(names) == len(epilogue.ACT_CODES)
    expected = {"identity": "ACT_IDENTITY", "relu": "ACT_RELU", "leaky_relu": "ACT_LEAKY", "elu": "ACT_ELU",
                "gelu": "ACT_GELU", "gelu_tanh": "ACT_GELU_TANH", "silu": "ACT_SILU", "sigmoid": "ACT_SIGMOID",
                "tanh": "ACT_TANH", "softplus": "ACT_SOFTPLUS"}
    for act, code in epilogue.ACT_CODES.items():
        assert names[code] == expected[act]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_one_instantiation_compiles_to_a_cubin_with_its_lowered_name(arch):
    cubin, lowered = kc.cubin("epilogue.cu", "bias_grad<bf16_t, float>", arch, epilogue.OPTIONS)
    assert cubin[:4] == b"\x7fELF" and lowered.startswith("_Z9bias_grad")
    assert lowered.encode() in cubin


def test_meta_matches_the_kernels_by_value_struct():
    meta = epilogue._meta((2, 3, 4, 5), (60, 20, 5, 1), (60, 1, 15, 3))
    assert ctypes.sizeof(meta) == 26 * 8 and "struct Meta { long long v[26]; }" in epilogue.source()
    assert list(meta.v[:5]) == [4, 2, 3, 4, 5] and list(meta.v[6:10]) == [60, 20, 5, 1]
    assert list(meta.v[11:15]) == [60, 1, 15, 3]


@pytest.mark.parametrize("shape,strides,channel_stride", [
    ((2, 3, 4, 5), (60, 20, 5, 1), 20),  # channels first
    ((2, 3, 4, 5), (60, 1, 15, 3), 1),  # channels last
    ((2, 3, 4, 5, 6), (360, 1, 90, 18, 3), 1),  # 3-D channels last
    ((2, 3, 4, 5), (120, 1, 30, 6), None),  # a padded view: element i is not at offset i
    ((2, 3, 4, 5), (60, 20, 1, 4), 20),  # H and W transposed: still offset i in every tensor
])
def test_the_dense_epilogue_serves_exactly_the_dense_layouts(shape, strides, channel_stride):
    assert epilogue._dense_channel_stride(shape, strides, strides) == channel_stride


def test_the_dense_epilogue_needs_one_layout_for_every_tensor():
    assert epilogue._dense_channel_stride((2, 3, 4, 5), (60, 20, 5, 1), (60, 1, 15, 3)) is None


def test_a_stored_kernel_of_another_template_is_compiled_again():
    """A record written when the part ran another kernel (other arguments) must not launch with these."""
    names = kc.nvrtc_check("epilogue.cu", epilogue.name_expressions(), "sm_90", epilogue.OPTIONS)
    dense, general = (names[f"{k}<half_t, float, half_t>"] for k in ("epilogue_fwd_dense", "epilogue_fwd"))
    assert epilogue._names(dense, "epilogue_fwd_dense<half_t, float, half_t>")
    assert not epilogue._names(general, "epilogue_fwd_dense<half_t, float, half_t>")
    assert not epilogue._names(dense, "epilogue_fwd<half_t, float, half_t>")
