"""Float64 references through torch for the GPU tests (torch is the oracle on the GPU host), and the
queued-sleep harness the no-synchronisation tests share."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}
# Relative L2 error allowed per dtype (fp32 with TF32 off).
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}


def random(desc, *, scale=1.0, device="cuda"):
    """Fresh random data laid out with the spec's strides (never zeros)."""
    base = torch.randn(desc.shape, dtype=torch.float64, device=device) * scale
    out = torch.empty_strided(desc.shape, desc.strides, dtype=TORCH_DTYPES[desc.dtype], device=device)
    out.copy_(base)
    return out


def poisoned(desc, device="cuda"):
    out = torch.empty_strided(desc.shape, desc.strides, dtype=TORCH_DTYPES[desc.dtype], device=device)
    return out.fill_(float("nan"))


def act_fn(act):
    name, p = act.name, act.param
    return {
        "identity": lambda t: t, "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, p),
        "elu": lambda t: F.elu(t, p), "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "softplus": lambda t: F.softplus(t, beta=p, threshold=1e9),
    }[name]


def _conv(spec, x, w):
    pads = [p for pre, post in reversed(spec.padding) for p in (pre, post)]
    x = F.pad(x, pads)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec.nd]
    return fn(x, w, stride=spec.stride, dilation=spec.dilation, groups=spec.groups)


def fwd(spec, bufs):
    d = {k: v.double() for k, v in bufs.items() if k != "y"}
    out = spec.alpha * _conv(spec, d["x"], d["w"])
    if spec.bias:
        out = out + d["bias"].view(1, -1, *([1] * spec.nd))
    if spec.residual:
        out = out + spec.beta * d["z"]
    return act_fn(spec.activation)(out)


def dgrad(spec, bufs):
    d = {k: v.double() for k, v in bufs.items() if k != "dx"}
    x = torch.zeros(spec.x_shape, dtype=torch.float64, device="cuda", requires_grad=True)
    _conv(spec, x, d["w"]).backward(d["dy"])
    grad = x.grad
    if spec.has_epilogue:
        pre = d["pre_act"].clone().requires_grad_(True)
        act_fn(spec.activation_backward)(pre).backward(grad)
        grad = pre.grad
    return grad


def wgrad(spec, bufs):
    d = {k: v.double() for k, v in bufs.items() if k not in ("dw", "db")}
    w = torch.zeros(spec.w_shape, dtype=torch.float64, device="cuda", requires_grad=True)
    _conv(spec, d["x"], w).backward(d["dy"])
    out = {"dw": w.grad}
    if spec.bias_grad:
        out["db"] = d["dy"].sum(dim=[0, *range(2, 2 + spec.nd)])
    return out


def rel_err(got, ref) -> float:
    got = got.double()
    if torch.isnan(got).any():
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


def queued_calls(fn, n):
    """`fn` called n times behind ~1 s of queued GPU work: (host seconds, GPU still busy after, ms per call)."""
    start = time.perf_counter()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time, queued ahead of every call
    ends = []
    for _ in range(n):
        fn()
        ends.append(time.perf_counter())
    host_s = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return host_s, busy, " ".join(f"{(b - a) * 1e3:.1f}" for a, b in zip([start, *ends], ends))
