"""Probe (GPU host): what one kernel launch costs the host through the driver layer, piece by piece.

    python3 tools/probe_launch_cost.py --out launch.json

Host us per call (probe_call_path.host_us: median of 7 rounds of 200 calls, GPU held busy by a queued
sleep) of: a grid_sample forward call and torch's; that call's `driver.Kernel.launch`; its cuLaunchKernel
alone (11 ctypes arguments); the same launch through cuLaunchKernelEx (4 arguments, the geometry in a
config struct packed once: what `driver.Kernel` uses); cuCtxGetCurrent; an argument-less kernel through
both entry points, with the GIL held (ctypes.PyDLL) and through CuPy; torch's cheapest launch
(`torch.cuda._sleep(1)`); allocating the output.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_call_path import host_us  # noqa: E402


def _kernel_of(step):
    from gpu_launch import driver

    for cell in step.__closure__ or ():
        if isinstance(cell.cell_contents, driver.Kernel):
            return cell.cell_contents
    raise RuntimeError("no driver.Kernel in the step's closure")


def _plain_call(kernel, stream: int):
    """(cuLaunchKernel, its 11 prepared ctypes arguments) for the launch `kernel` makes on `stream`."""
    from gpu_launch import driver

    dims = (ctypes.c_uint(d) for d in (*kernel.grid, *kernel.block, kernel.shared))
    return driver._raw("cuLaunchKernel"), (ctypes.c_void_p(kernel.fn), *dims, ctypes.c_void_p(stream),
                                           kernel._params, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import cupy
    import torch
    import torch.nn.functional as F

    from fallback_kernels import compile as _compile
    from fallback_kernels import grid_sample as gs
    from gpu_launch import driver

    x = torch.randn(8, 64, 128, 128, device="cuda")
    grid = torch.rand(8, 128, 128, 2, device="cuda") * 2.2 - 1.1
    gs.grid_sample(x, grid)
    prep = gs._memo.get(gs._memo_key((x, grid), ("forward", "bilinear", "zeros", False))[0])
    (_, allocate), = prep.outputs
    out = allocate()
    prog = gs._program(prep.plan, prep.device)
    step, = prog.steps
    step((x.data_ptr(), grid.data_ptr(), out.data_ptr()), torch.cuda.current_stream().cuda_stream)
    kernel = _kernel_of(step)
    stream = torch.cuda.current_stream().cuda_stream
    kernel._config.hStream = stream
    plain, plain_args = _plain_call(kernel, stream)

    nop = cupy.RawKernel('extern "C" __global__ void nop() {}', "nop")
    nop_kernel = driver.Kernel(_compile.cufunction(nop, 0), grid=1, block=32, args=[], ordinal=0)
    nop_kernel._config.hStream = stream
    nop_plain, nop_plain_args = _plain_call(nop_kernel, stream)
    held = ctypes.PyDLL("libcuda.so.1")["cuLaunchKernelEx"]  # the GIL held through the call
    held.restype = ctypes.c_int
    cupy_stream = cupy.cuda.ExternalStream(stream)
    cupy_stream.use()
    torch.cuda.synchronize()

    cases = {
        "grid_sample call": lambda: gs.grid_sample(x, grid),
        "torch F.grid_sample": lambda: F.grid_sample(x, grid, align_corners=False),
        "Kernel.launch": lambda: kernel.launch(stream),
        "cuLaunchKernel (11 ctypes args)": lambda: plain(*plain_args),
        "cuLaunchKernelEx (4 ctypes args, Kernel's own)": lambda: kernel._launch(*kernel._call),
        "cuCtxGetCurrent": lambda: kernel._get_current(kernel._current_ref),
        "nop cuLaunchKernel": lambda: nop_plain(*nop_plain_args),
        "nop cuLaunchKernelEx": lambda: nop_kernel._launch(*nop_kernel._call),
        "nop cuLaunchKernelEx, GIL held (PyDLL)": lambda: held(*nop_kernel._call),
        "nop CuPy RawKernel call": lambda: nop((1,), (32,), ()),
        "torch.cuda._sleep(1)": lambda: torch.cuda._sleep(1),
        "allocate the output": allocate,
        "torch.empty_like(x)": lambda: torch.empty_like(x),
    }
    row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "param_bytes": ctypes.sizeof(kernel.args[-1]) + 3 * 8}
    for name, fn in cases.items():
        fn()
        row[name] = round(host_us(fn), 2)
        print(name, row[name], flush=True)
    Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
