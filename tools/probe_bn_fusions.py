"""Which BatchNorm fusions cuDNN builds for ResNet-50's layers, how fast they run, and against what.

For every ResNet-50 conv geometry (batch 64, NHWC) and io dtype, builds straight through the frontend:
  stats : conv -> genstats (per-channel sum and sum of squares of the output)
  pro   : relu(x * scale + shift) -> conv -> genstats  (the previous BN's apply as this conv's prologue)
  wgrad : relu(x * scale + shift) -> wgrad            (the same prologue on the filter gradient)
with the scale/shift operands in the io dtype and in float32. `--inference`: DenseNet-121's pre-activation
layers (batch 32, float16): relu(x * scale + shift) -> conv with no statistics, with a bias + ReLU epilogue,
and each with genstats, the fastest of the first 4 plans each, beside torch's eval BatchNorm -> ReLU -> conv. Device µs are CUDA-event times of 20
back-to-back executes queued behind a sleep (no host gaps), beside torch's unfused sequence measured
the same way (`cudnn.benchmark=True`): conv; conv -> batch_norm(training) -> relu_; the prologue's
elementwise + wgrad. Each built graph's results are checked against torch in float32.

    python -m tools.probe_bn_fusions --out probe_bn_fusions.json [--inference]
"""

from __future__ import annotations

import argparse
import json
import time

import cudnn
import torch
import torch.nn.functional as F

from benchmarks import harness

N = 64
# (C, K, H, W, R, stride, pad): 16 of the 22 distinct convs of torchvision's resnet50 after the stem (not layer3/4's
# strided 3x3s and downsamples, 512 -> 256 at 28, 1024 -> 512 at 14; benchmarks/fused_graphs.py has all 22)
LAYERS = [
    (64, 64, 56, 56, 1, 1, 0), (64, 64, 56, 56, 3, 1, 1), (64, 256, 56, 56, 1, 1, 0), (256, 64, 56, 56, 1, 1, 0),
    (256, 128, 56, 56, 1, 1, 0), (128, 128, 56, 56, 3, 2, 1), (256, 512, 56, 56, 1, 2, 0),
    (128, 512, 28, 28, 1, 1, 0), (512, 128, 28, 28, 1, 1, 0), (128, 128, 28, 28, 3, 1, 1),
    (256, 256, 14, 14, 3, 1, 1), (1024, 256, 14, 14, 1, 1, 0), (256, 1024, 14, 14, 1, 1, 0),
    (512, 512, 7, 7, 3, 1, 1), (2048, 512, 7, 7, 1, 1, 0), (512, 2048, 7, 7, 1, 1, 0),
]
DT = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float32: cudnn.data_type.FLOAT}


def nhwc(t):
    return t.to(memory_format=torch.channels_last)


def device_us(fn, reps=20):
    """Device us per call of `reps` back-to-back calls queued behind a sleep (no host gaps)."""
    return harness.device_ms(fn, calls=reps, sleep_cycles=int(2e7)) * 1000


def graph(handle, dtype):
    return cudnn.pygraph(io_data_type=DT[dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def tensor(g, name, t, dtype=None):
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=DT[dtype or t.dtype])


def build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    return g


def fwd_graph(handle, x, w, s, b, stride, pad, prologue):
    g = graph(handle, x.dtype)
    X, W = tensor(g, "X", x), tensor(g, "W", w)
    inp, ops = X, {}
    if prologue:
        S, B = tensor(g, "S", s), tensor(g, "B", b)
        inp = g.relu(input=g.bias(input=g.scale(input=X, scale=S), bias=B))
        ops.update(S=S, B=B)
    Y = g.conv_fprop(image=inp, weight=W, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                     compute_data_type=cudnn.data_type.FLOAT)
    Y.set_output(True).set_data_type(DT[x.dtype])
    SUM, SQ = g.genstats(input=Y)
    SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    return build(g), dict(X=X, W=W, Y=Y, SUM=SUM, SQ=SQ, **ops)


def wgrad_graph(handle, x, dy, s, b, w_shape, stride, pad):
    g = graph(handle, x.dtype)
    X, DY, S, B = tensor(g, "X", x), tensor(g, "DY", dy), tensor(g, "S", s), tensor(g, "B", b)
    a = g.relu(input=g.bias(input=g.scale(input=X, scale=S), bias=B))
    DW = g.conv_wgrad(image=a, loss=DY, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                      compute_data_type=cudnn.data_type.FLOAT)
    k, c, r, _ = w_shape
    DW.set_output(True).set_dim(list(w_shape)).set_stride([c * r * r, 1, c * r, c]).set_data_type(DT[x.dtype])
    return build(g), dict(X=X, DY=DY, S=S, B=B, DW=DW)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def probe_layer(handle, layer, dtype, scale_dtype):
    c, k, h, wd, r, stride, pad = layer
    x = nhwc(torch.randn(N, c, h, wd, device="cuda", dtype=dtype))
    w = nhwc(torch.randn(k, c, r, r, device="cuda", dtype=dtype) / (c * r * r) ** 0.5)
    s = nhwc(torch.rand(1, c, 1, 1, device="cuda") + 0.5).to(scale_dtype)
    b = nhwc(torch.randn(1, c, 1, 1, device="cuda") * 0.5).to(scale_dtype)
    a = torch.relu(x.float() * s.float() + b.float()).to(dtype)
    y_ref = F.conv2d(a, w, stride=stride, padding=pad)
    ws = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    out = {"layer": list(layer), "dtype": str(dtype), "scale_dtype": str(scale_dtype)}
    for name, pro in (("stats", False), ("pro", True)):
        if name == "stats" and scale_dtype == torch.float32:
            continue
        inp = a if not pro else x
        y = torch.full_like(y_ref, float("nan"))
        sm = torch.full((1, k, 1, 1), float("nan"), device="cuda")
        sq = torch.full_like(sm, float("nan"))
        t0 = time.perf_counter()
        try:
            g, T = fwd_graph(handle, inp, w, s, b, stride, pad, pro)
        except Exception as err:  # the frontend's own types: record the message
            out[name] = {"ok": False, "error": str(err).splitlines()[0][:200]}
            continue
        pack = {T["X"]: inp, T["W"]: w, T["Y"]: y, T["SUM"]: sm, T["SQ"]: sq}
        if pro:
            pack.update({T["S"]: s, T["B"]: b})
        us = device_us(lambda: g.execute(pack, ws, handle=handle))
        yf = y_ref.float()
        out[name] = {"ok": True, "build_ms": round((time.perf_counter() - t0) * 1e3, 1), "us": round(us, 1),
                     "y_err": rel(y, y_ref), "sum_err": rel(sm.flatten(), yf.sum((0, 2, 3))),
                     "sq_err": rel(sq.flatten(), (yf * yf).sum((0, 2, 3)))}
    dy = nhwc(torch.randn_like(y_ref))
    dw = nhwc(torch.full((k, c, r, r), float("nan"), device="cuda", dtype=dtype))
    try:
        g, T = wgrad_graph(handle, x, dy, s, b, (k, c, r, r), stride, pad)
        pack = {T["X"]: x, T["DY"]: dy, T["S"]: s, T["B"]: b, T["DW"]: dw}
        us = device_us(lambda: g.execute(pack, ws, handle=handle))
        dw_ref = torch.ops.aten.convolution_backward(dy, a, w, None, [stride] * 2, [pad] * 2, [1, 1], False,
                                                     [0, 0], 1, [False, True, False])[1]
        out["wgrad"] = {"ok": True, "us": round(us, 1), "dw_err": rel(dw, dw_ref)}
    except Exception as err:
        out["wgrad"] = {"ok": False, "error": str(err).splitlines()[0][:200]}
    if scale_dtype != torch.float32:
        out["torch"] = torch_times(x, w, a, dy, s, b, stride, pad)
    return out


def torch_times(x, w, a, dy, s, b, stride, pad):
    k = w.shape[0]
    gamma, beta = torch.ones(k, device="cuda"), torch.zeros(k, device="cuda")
    rm, rv = torch.zeros(k, device="cuda"), torch.ones(k, device="cuda")

    def chain():
        y = F.conv2d(a, w, stride=stride, padding=pad)
        return torch.relu_(F.batch_norm(y, rm, rv, gamma, beta, True, 0.1, 1e-5))

    def pro_wgrad():
        a2 = torch.relu(x * s + b)
        return torch.ops.aten.convolution_backward(dy, a2, w, None, [stride] * 2, [pad] * 2, [1, 1], False,
                                                   [0, 0], 1, [False, True, False])

    for f in (chain, pro_wgrad):
        f()
    return {"conv_us": round(device_us(lambda: F.conv2d(a, w, stride=stride, padding=pad)), 1),
            "conv_bn_relu_us": round(device_us(chain), 1), "relu_affine_wgrad_us": round(device_us(pro_wgrad), 1),
            "wgrad_us": round(device_us(lambda: torch.ops.aten.convolution_backward(
                dy, a, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, [False, True, False])), 1)}


# DenseNet-121's BatchNorm -> ReLU -> conv: (C, K, H=W, R), layers of its four blocks and a transition
DENSE_LAYERS = [(64, 128, 56, 1), (224, 128, 56, 1), (128, 32, 56, 3), (480, 128, 28, 1), (992, 128, 14, 1),
                (992, 128, 7, 1), (256, 128, 56, 1), (1024, 512, 14, 1), (128, 32, 7, 3)]
INFER_N = 32


def inference_variant(handle, x, w, s, b, bias, variant, ws):
    """The fastest of the first 4 plans of one prologue graph (us), its relative error, or why none ran."""
    pad = w.shape[2] // 2
    a = torch.relu(x.float() * s.float() + b.float()).half()
    ref = F.conv2d(a, w, padding=pad)
    ref = torch.relu(ref.float() + bias.float()).half() if "epi" in variant else ref
    g = graph(handle, torch.float16)
    X, W, S, B = tensor(g, "X", x), tensor(g, "W", w), tensor(g, "S", s), tensor(g, "B", b)
    Y = g.conv_fprop(image=g.relu(input=g.bias(input=g.scale(input=X, scale=S), bias=B)), weight=W,
                     padding=[pad, pad], stride=[1, 1], dilation=[1, 1], compute_data_type=cudnn.data_type.FLOAT)
    pack = {X: x, W: w, S: s, B: b}
    if "epi" in variant:
        BI = tensor(g, "BI", bias)
        Y, pack[BI] = g.relu(input=g.bias(input=Y, bias=BI)), bias
    Y.set_output(True).set_data_type(DT[torch.float16])
    y = pack[Y] = torch.full_like(ref, float("nan"))
    if "stats" in variant:
        for T in g.genstats(input=Y):
            T.set_output(True).set_data_type(cudnn.data_type.FLOAT)
            pack[T] = torch.empty(1, w.shape[0], 1, 1, device="cuda")
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
    except Exception as err:  # the frontend's own types: record the message
        return {"ok": False, "error": str(err).splitlines()[0][:200]}
    best = None
    for i in range(min(g.get_execution_plan_count(), 4)):
        try:
            g.build_plan_at_index(i)
            us = device_us(lambda: g.execute_plan_at_index(pack, ws, i, handle=handle))
        except Exception:  # a plan that does not build or run: the next one
            continue
        best = (us, i) if best is None or us < best[0] else best
    if best is None:
        return {"ok": False, "error": "no plan built and ran"}
    g.execute_plan_at_index(pack, ws, best[1], handle=handle)
    return {"ok": True, "us": round(best[0], 1), "y_err": rel(y, ref)}


def probe_inference(handle, layer):
    c, k, hw, r = layer
    x = nhwc(torch.randn(INFER_N, c, hw, hw, device="cuda", dtype=torch.float16))
    w = nhwc(torch.randn(k, c, r, r, device="cuda", dtype=torch.float16) / (c * r * r) ** 0.5)
    s, b = nhwc(torch.rand(1, c, 1, 1, device="cuda") + 0.5).half(), nhwc(torch.randn(1, c, 1, 1, device="cuda") * 0.5).half()
    bias = nhwc(torch.randn(1, k, 1, 1, device="cuda")).half()
    ws = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    row = {"layer": list(layer)}
    for variant in ("pro", "pro_epi", "pro_stats", "pro_epi_stats"):
        row[variant] = inference_variant(handle, x, w, s, b, bias, variant, ws)
    bn = torch.nn.BatchNorm2d(c).cuda().half().eval()
    bn.running_var.uniform_(0.5, 2)
    bn.running_mean.normal_()
    with torch.no_grad():
        for _ in range(3):
            F.conv2d(torch.relu(bn(x)), w, padding=r // 2)
        row["torch_bn_relu_conv_us"] = round(device_us(lambda: F.conv2d(torch.relu(bn(x)), w, padding=r // 2)), 1)
        row["torch_conv_us"] = round(device_us(lambda: F.conv2d(x, w, padding=r // 2)), 1)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="probe_bn_fusions.json")
    p.add_argument("--inference", action="store_true", help="DenseNet-121's pre-activation layers instead")
    args = p.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows = []
    if args.inference:
        for layer in DENSE_LAYERS:
            rows.append(probe_inference(handle, layer))
            print(json.dumps(rows[-1]), flush=True)
        harness.write_json(args.out, {"batch": INFER_N, "rows": rows})
        return 0
    for dtype, sdt in ((torch.float16, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        for layer in LAYERS:
            row = probe_layer(handle, layer, dtype, sdt)
            print(json.dumps(row), flush=True)
            rows.append(row)
    harness.write_json(args.out, {"batch": N, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
