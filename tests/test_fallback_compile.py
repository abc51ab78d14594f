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


def test_a_stored_single_pass_bias_kernel_is_not_launched_with_the_chunked_arguments():
    old_lowered = "_Z14bias_grad_rowsI6half_tfEvPKT_PS1_xi"  # the kernel records held before the chunked one
    assert not epilogue._names(old_lowered, "bias_grad_chunks<half_t, float>")


@pytest.mark.parametrize("rows, channels", [(1, 1), (288, 40), (2645, 40), (25088, 96), (200704, 96),
                                            (3136, 2048), (10**7, 8), (128 * 1024 + 1, 32)])
def test_bias_chunks_cover_every_row_once_in_whole_strides(rows, channels):
    chunk, chunks = epilogue.bias_chunks(rows, channels)
    assert chunk % 128 == 0 and chunk >= epilogue.CHUNK_MIN_ROWS
    assert (chunks - 1) * chunk < rows <= chunks * chunk  # no empty chunk, none missing
    assert chunks <= 65535  # grid.y
    tiles = (channels + 31) // 32
    assert chunks == 1 or tiles * chunks <= 2 * epilogue.CHUNK_BLOCKS + tiles


def test_a_chunked_bias_part_takes_workspace_and_launches_twice(monkeypatch):
    """The chunked kernel's partial sums live in the plan's workspace; one chunk needs none."""
    from cudnn_graphs import ConvBwdFilterSpec

    monkeypatch.setattr(epilogue, "_arch", lambda device: "sm_90")
    monkeypatch.setattr(epilogue.driver, "function", lambda *a: 0)  # no GPU here: nothing is loaded
    big = ConvBwdFilterSpec((8, 96, 56, 56), (8, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96,
                            dtype="float16", layout="channels_last", bias_grad=True)
    part = epilogue.bias_grad(big, 0)
    assert part.grid == (3, 25) and len(part.then) == 1 and part.then[0][0] == 3
    assert part.workspace_size >= 25 * 96 * 4 and part.workspace_size % 256 == 0
    assert "workspace" in part.args and "workspace" in part.then[0][2]
    small = ConvBwdFilterSpec((2, 8, 12, 12), (2, 40, 12, 12), (40, 8, 3, 3), padding=1, dtype="float16",
                              layout="channels_last", bias_grad=True)
    part = epilogue.bias_grad(small, 0)
    assert part.then == () and part.workspace_size == 0 and "workspace" not in part.args


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_batchnorm_kernels_compile_without_local_memory(arch):
    from fallback_kernels import batchnorm

    found = kc.ptxas_resources("batchnorm.cu", batchnorm.name_expressions(), arch)
    assert set(found) == set(batchnorm.name_expressions())
    for name, res in found.items():  # registers only; the backward reduction's 3x4 rows in flight take ~114
        assert res["stack_bytes"] == 0 and res["spill_stores"] == 0, (name, res)
        assert res["registers"] <= (128 if name.startswith("bn_bwd_reduce") else 80), (name, res)


def test_batchnorm_vector_width_follows_the_channel_count():
    from fallback_kernels import batchnorm

    assert batchnorm.vector_width("float16", 64) == 8 and batchnorm.vector_width("float16", 24) == 8
    assert batchnorm.vector_width("float16", 20) == 1 and batchnorm.vector_width("float32", 20) == 4


def test_batchnorm_launcher_constants_are_the_kernels_own():
    """THREADS and UNROLL size the reduction's grid and chunks in Python; the kernels are compiled with
    the same numbers (a mismatch would leave rows unsummed or threads idle)."""
    from fallback_kernels import batchnorm

    src = kc.source("batchnorm.cu")
    assert f"#define THREADS {batchnorm.THREADS} " in src
    assert f"#define BN_UNROLL {batchnorm.UNROLL} " in src


def test_batchnorm_reductions_read_16_bytes_a_thread_where_the_channels_allow():
    from fallback_kernels.batchnorm import reduce_layout

    assert reduce_layout("float16", 64) == (8, 8) and reduce_layout("float16", 2048) == (8, 8)
    assert reduce_layout("bfloat16", 24) == (8, 8) and reduce_layout("float32", 64) == (4, 8)
    assert reduce_layout("float16", 20) == (2, 32)
    assert reduce_layout("float16", 7) == (1, 32)


def test_batchnorm_reduction_chunks_fill_the_gpu_from_the_shape_alone():
    from fallback_kernels.batchnorm import UNROLL, chunk_rows

    for rows, tiles, lanes in ((200704, 1, 32), (200704, 4, 8), (50176, 2, 8), (3136, 8, 8), (12544, 1, 16), (7, 1, 32)):
        chunk = chunk_rows(rows, tiles, lanes=lanes, blocks=264)
        assert chunk % (lanes * UNROLL) == 0 and chunk > 0  # whole unrolled steps a block
        blocks = tiles * -(-rows // chunk)
        assert blocks <= 264 or chunk == lanes * UNROLL  # one wave, unless the rows are too few to share
        assert chunk_rows(rows, tiles, lanes=lanes, blocks=264) == chunk  # the same sums in the same order


def test_cufunctions_loads_one_module_and_keys_its_functions(monkeypatch):
    loads = []

    class Module:
        def get_function(self, expr):
            return f"fn:{expr}"

    monkeypatch.setattr(kc, "load_module", lambda f, names, device: loads.append((f, names, device)) or Module())
    monkeypatch.setattr(kc, "cufunction", lambda kernel, device: (kernel, device))
    got = kc.cufunctions("x.cu", {"a": "k<float>", ("b", 1): "k<half_t>"}, 3)
    assert loads == [("x.cu", ("k<float>", "k<half_t>"), 3)]
    assert got == {"a": ("fn:k<float>", 3), ("b", 1): ("fn:k<half_t>", 3)}
