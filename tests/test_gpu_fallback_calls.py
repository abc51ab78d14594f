"""GPU: the fallback kernels' entry points never synchronise the device, in steady state, and their host
cost stays near the driver's: each is called N times behind a queued ~1 s sleep kernel, and must return
(all N) before the sleep ends."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from fallback_kernels import grid_sample as gs  # noqa: E402
from fallback_kernels.gemm_act import gemm_bias_act, gemm_bias_act_backward  # noqa: E402

pytestmark = pytest.mark.gpu


def _grid_calls(dtype):
    inp = torch.randn(4, 16, 24, 24, device="cuda", dtype=dtype)
    grid = (torch.rand(4, 20, 20, 2, device="cuda", dtype=torch.float64) * 2.2 - 1.1).to(dtype)
    go = torch.randn(4, 16, 20, 20, device="cuda", dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    return {
        f"grid_sample {name}": lambda: gs.grid_sample(inp, grid),
        f"grid_sample_backward fast {name}": lambda: gs.grid_sample_backward(go, inp, grid),
        f"grid_sample_backward deterministic {name}": lambda: gs.grid_sample_backward(go, inp, grid,
                                                                                      deterministic=True),
    }


def _gemm_calls():
    a = torch.randn(96, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 48, device="cuda", dtype=torch.float16)
    bias = torch.randn(48, device="cuda", dtype=torch.float16)
    dy = torch.randn(96, 48, device="cuda", dtype=torch.float16)
    _, aux = gemm_bias_act(a, b, bias, activation="gelu")
    return {
        "gemm_bias_act": lambda: gemm_bias_act(a, b, bias, activation="gelu"),
        "gemm_bias_act_backward": lambda: gemm_bias_act_backward(dy, a, b, aux, activation="gelu"),
    }


@pytest.mark.parametrize("calls", ["grid_sample f32", "grid_sample f16", "grid_sample f64", "gemm_act"])
def test_no_device_synchronisation(calls):
    fns = {"grid_sample f32": lambda: _grid_calls(torch.float32), "grid_sample f16": lambda: _grid_calls(torch.float16),
           "grid_sample f64": lambda: _grid_calls(torch.float64), "gemm_act": _gemm_calls}[calls]()
    for fn in fns.values():  # first sight compiles and plans
        fn()
        fn()
    torch.cuda.synchronize()
    n = 20
    for name, fn in fns.items():
        start = time.perf_counter()
        torch.cuda._sleep(int(2e9))  # about a second of GPU time, queued ahead of the calls
        for _ in range(n):
            fn()
        host_s = time.perf_counter() - start
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert busy and host_s < 0.25, (f"{name}: {n} calls took {host_s:.3f} s of host time; the GPU "
                                        f"{'was still busy' if busy else 'drained: a call synchronised'}")
