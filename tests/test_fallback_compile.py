"""Every fallback kernel source compiles with NVRTC for sm_80 and sm_90, with no GPU."""

from __future__ import annotations

import pytest

from fallback_kernels import epilogue

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_epilogue_compiles(arch):
    prog = nvrtc.createProgram(epilogue.source(), "epilogue.cu", [], [])
    for name in epilogue.name_expressions():
        nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, [*epilogue.OPTIONS, f"--gpu-architecture={arch}"])
    except Exception as err:  # show the compiler's log, not just its status
        pytest.fail(f"{err}\n{nvrtc.getProgramLog(prog)}")
    for name in epilogue.name_expressions():
        assert nvrtc.getLoweredName(prog, name)  # every instantiation exists


def test_activation_codes_match_the_cuda_enum():
    enum = epilogue.source().split("enum {", 1)[1].split("}", 1)[0]
    names = [n.strip() for n in enum.split(",")]
    assert len(names) == len(epilogue.ACT_CODES)
    expected = {"identity": "ACT_IDENTITY", "relu": "ACT_RELU", "leaky_relu": "ACT_LEAKY", "elu": "ACT_ELU",
                "gelu": "ACT_GELU", "gelu_tanh": "ACT_GELU_TANH", "silu": "ACT_SILU", "sigmoid": "ACT_SIGMOID",
                "tanh": "ACT_TANH", "softplus": "ACT_SOFTPLUS"}
    for act, code in epilogue.ACT_CODES.items():
        assert names[code] == expected[act]
