"""Probe (GPU host): where a fallback kernel call's host time goes (cProfile, GPU held busy).

    python3 tools/probe_fallback_host.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from fallback_kernels import grid_sample as gs
    from fallback_kernels import gemm_act
    from fallback_kernels.gemm_act import gemm_bias_act, gemm_bias_act_backward

    x = torch.randn(32, 32, 64, 64, device="cuda", dtype=torch.half)
    grid = (torch.rand(32, 64, 64, 2, device="cuda") * 2.2 - 1.1).half()
    go = torch.randn_like(x)
    a = torch.randn(4096, 1024, device="cuda", dtype=torch.half)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.half)
    bias = torch.randn(4096, device="cuda", dtype=torch.half)
    dy = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
    _, mask = gemm_bias_act(a, b, bias, activation="relu")
    cases = {"grid_sample f16": lambda: gs.grid_sample(x, grid),
             "grid_sample_backward f16 fast": lambda: gs.grid_sample_backward(go, x, grid),
             "gemm_bias_act fp16 relu": lambda: gemm_bias_act(a, b, bias, activation="relu"),
             "gemm_bias_act fp16 gelu_tanh": lambda: gemm_bias_act(a, b, bias, activation="gelu_tanh"),
             "gemm_bias_act_backward fp16 relu": lambda: gemm_bias_act_backward(dy, a, b, mask, activation="relu")}
    from probe_call_path import host_us, profile_calls

    from gpu_launch import driver
    from gpu_launch.streams import stream_pointer

    gs.grid_sample(x, grid)
    prep = next(iter(gs._memo.values()))
    step = gs._program(prep.plan, 0).steps[0]
    stream = stream_pointer(None, "torch", 0)
    ctx = driver.device(0)

    def enter_exit():
        with ctx:
            pass

    out = prep.outputs[0][1]()
    ptrs = (x.data_ptr(), grid.data_ptr(), out.data_ptr())
    key, _ = gs._memo_key((x, grid), ("forward", "bilinear", "zeros", False))
    pieces = {
        "grid_sample f16 (whole call)": cases["grid_sample f16"],
        "memo key": lambda: gs._memo_key((x, grid), ("forward", "bilinear", "zeros", False)),
        "memo lookup": lambda: gs._memo.get(key),
        "allocate the output": prep.outputs[0][1],
        "_run (patch + launch)": lambda: gs._run(prep.plan, "torch", 0, ptrs),
        "step (patch + Kernel.launch)": lambda: step(ptrs, stream),
        "driver.device enter+exit": enter_exit,
        "stream_pointer": lambda: stream_pointer(None, "torch", 0),
        "driver.context_is_current": lambda: driver.context_is_current(0),
        "gemm forward memo key": lambda: gemm_act._memo_key((("a", a), ("b", b), ("bias", bias)),
                                                            ("forward", "relu", True, False)),
        "torch.empty_strided 4096x4096 f16": lambda: torch.empty_strided((4096, 4096), (4096, 1), dtype=torch.half,
                                                                         device=x.device),
    }
    for act in ("identity", "relu", "gelu", "gelu_tanh"):
        pieces[f"gemm_bias_act fp16 {act}"] = lambda act=act: gemm_bias_act(a, b, bias, activation=act)
        pieces[f"torch {act}(addmm)"] = {"identity": lambda: torch.addmm(bias, a, b),
                                          "relu": lambda: torch.relu(torch.addmm(bias, a, b)),
                                          "gelu": lambda: torch.nn.functional.gelu(torch.addmm(bias, a, b)),
                                          "gelu_tanh": lambda: torch.nn.functional.gelu(torch.addmm(bias, a, b),
                                                                                        approximate="tanh")}[act]
    for act in ("identity", "relu", "gelu_tanh"):  # what each forward program holds
        gemm_bias_act(a, b, bias, activation=act)
        key, _ = gemm_act._memo_key((("a", a), ("b", b), ("bias", bias)), ("forward", act, True, False))
        prog = gemm_act._memo.get(key)
        print(f"forward program {act}: {len(prog.steps)} steps, outputs {[n for n, _ in prog.outputs]}, "
              f"scratch {dict(prog.scratch)} ({prog.scratch_bytes} B)", flush=True)
    lt = next(p for g, p in gemm_act.cublaslt._PLANS.items() if g.epilogue == "GELU_AUX_BIAS" and g.dtype == "float16")
    y2 = [torch.empty(4096, 4096, device="cuda", dtype=torch.half) for _ in range(4)]
    ws = torch.empty(max(lt.workspace, 1), dtype=torch.uint8, device="cuda")
    sp = stream_pointer(None, "torch", 0)
    turn = [0]

    def lt_run(vary: bool):
        i = turn[0] = (turn[0] + 1) % 2 if vary else 0
        lt.run(a=a.data_ptr(), b=b.data_ptr(), d=y2[2 * i].data_ptr(), stream=sp, bias=bias.data_ptr(),
               aux=y2[2 * i + 1].data_ptr(), workspace=ws.data_ptr())

    L, (bl, al, dl) = gemm_act.cublaslt.bindings(), lt._layouts
    args = (lt._h, lt._desc, lt._alpha, b.data_ptr(), bl, a.data_ptr(), al, lt._betas[0], y2[0].data_ptr(), dl,
            y2[0].data_ptr(), dl, lt._algo, ws.data_ptr(), lt.workspace, sp)
    pieces["cublasLt.matmul binding alone"] = lambda: L.matmul(*args)
    pieces["LtGemm.run GELU_AUX_BIAS, same pointers"] = lambda: lt_run(False)
    pieces["LtGemm.run GELU_AUX_BIAS, aux pointer alternating"] = lambda: lt_run(True)
    pieces["gemm_bias_act_backward fp16 relu"] = cases["gemm_bias_act_backward fp16 relu"]
    pieces["gemm_bias_act_backward fp16 gelu"] = lambda: gemm_bias_act_backward(dy, a, b, dy, activation="gelu")
    for name, fn in pieces.items():
        print(f"{name:40s} {host_us(fn):8.2f} us", flush=True)
    profile_calls(cases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
