"""Probe (GPU host): host us per call of the layers between a module's forward and the cuDNN execute.

    python3 tools/probe_op_overhead.py

For one 32x128x28x28 3x3 fp16 channels_last conv: cg.conv_fwd (functional), the registered op with
and without autograd, the module's forward, and a plan's direct execute through the frontend-built
plan and through the backend-loaded one (each ctypes step of the latter timed alone).
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_call_path import host_us  # noqa: E402  (tools/ is sys.path[0] when run as a script)


def main() -> int:
    import torch

    import cudnn_graphs as cg
    import cudnn_graphs.torch as cgt
    from cudnn_graphs.execute import cudnn_backend as cb
    from cudnn_graphs.plan import resident

    cl = torch.channels_last
    x = torch.randn(32, 128, 28, 28, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.half) * 0.05).contiguous(memory_format=cl)
    y = torch.empty_like(x)
    spec = cg.ConvFwdSpec(x.shape, w.shape, padding=1, dtype="float16", layout="channels_last")
    cache = tempfile.mkdtemp()
    built = cg.Session(cache=cache).plan(spec)
    resident.forget()  # the next session loads from disk, as a fresh process would
    loaded = cg.Session(cache=cache).plan(spec)
    assert loaded.parts[0].backend is not None and built.parts[0].backend is None
    wr = w.detach().clone().requires_grad_(True)
    conv = cgt.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    flat = ([1, 1], [1, 1, 1, 1], [1, 1], 1)
    cases = {
        "cg.conv_fwd": lambda: cg.conv_fwd(x, w, padding=1),
        "torch.ops.cudnn_graphs.conv_fwd (no grad)": lambda: torch.ops.cudnn_graphs.conv_fwd(
            x, w, None, None, *flat, "identity", 0.0, 1.0),
        "torch.ops.cudnn_graphs.conv_fwd (w requires grad)": lambda: torch.ops.cudnn_graphs.conv_fwd(
            x, wr, None, None, *flat, "identity", 0.0, 1.0),
        "cgt.conv2d (w requires grad)": lambda: cgt.conv2d(x, wr, padding=1),
        "Conv2d module forward (training)": lambda: conv(x),
        "torch F.conv2d (w requires grad)": lambda: torch.nn.functional.conv2d(x, wr, padding=1),
        "built plan bind().launch direct": built.bind(x=x, w=w, y=y, cuda_graph=False).launch,
        "loaded plan bind().launch direct": loaded.bind(x=x, w=w, y=y, cuda_graph=False).launch,
    }
    # A training layer: fwd + bwd (dx and dw), inputs that rotate as activations do across layers, so
    # pointer sets rarely repeat (direct runs once the launchers' capture budget is spent).
    tconv = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    xs = [x.detach().clone().requires_grad_(True) for _ in range(48)]
    gy = torch.randn_like(x)
    turn = itertools.count()

    def train(module):
        def step():
            module(xs[next(turn) % len(xs)]).backward(gy)
        return step

    def fwd_rotating():
        cg.conv_fwd(xs[next(turn) % len(xs)].detach(), w, padding=1)

    cases.update({
        "torch nn.Conv2d fwd+bwd, inputs rotating": train(tconv),
        "Conv2d module fwd+bwd, inputs rotating": train(conv),
        "torch nn.Conv2d fwd+bwd, same input": lambda: tconv(xs[0]).backward(gy),
        "Conv2d module fwd+bwd, same input": lambda: conv(xs[0]).backward(gy),
        "cg.conv_fwd, inputs rotating": fwd_rotating,
    })
    torch.backends.cudnn.benchmark = True
    for name, fn in cases.items():
        fn()
        print(f"{name:55s} {host_us(fn):8.2f} us", flush=True)
    import cProfile
    import io
    import pstats

    profile, step = cProfile.Profile(), cases["Conv2d module fwd+bwd, inputs rotating"]
    torch.cuda._sleep(int(2e9))
    profile.enable()
    for _ in range(300):
        step()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
    print("== 300 rotating fwd+bwd of the module, by own time\n" + text.getvalue()[-4500:], flush=True)
    # the backend runner's steps, one at a time
    lib, part = cb.lib(), loaded.parts[0]
    handle = loaded.handles.on_stream(torch.cuda.current_stream().cuda_stream)
    n = len(part.backend_uids)
    uids = (ctypes.c_int64 * n)(*part.backend_uids)
    ptrs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in (x, w, y)][:n])
    stream = torch.cuda.current_stream().cuda_stream
    ws = ctypes.c_void_p(loaded._scratch_for(stream, "torch")[1]["workspace"] or None)
    pack = ctypes.c_void_p()

    def create():
        lib.cudnnBackendCreateDescriptor(16, ctypes.byref(pack))

    def fill():
        lib.cudnnBackendSetAttribute(pack, 1000, 3, n, uids)
        lib.cudnnBackendSetAttribute(pack, 1001, 6, n, ptrs)
        lib.cudnnBackendSetAttribute(pack, 1003, 6, 1, ctypes.byref(ws))

    def whole():
        create()
        fill()
        lib.cudnnBackendFinalize(pack)
        status = lib.cudnnBackendExecute(handle, part.backend.desc, pack)
        lib.cudnnBackendDestroyDescriptor(pack)
        return status

    assert whole() == 0, "the probe's execute failed"

    def no_execute():
        create()
        fill()
        lib.cudnnBackendFinalize(pack)
        lib.cudnnBackendDestroyDescriptor(pack)

    for name, fn in {"varpack create+fill+finalize+destroy": no_execute, "... + execute": whole}.items():
        print(f"{name:55s} {host_us(fn):8.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
