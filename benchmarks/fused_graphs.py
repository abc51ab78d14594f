"""Benchmark (GPU host): each fused piece of a conv -> BatchNorm -> ReLU training run against the torch ops it replaces.

Per ResNet-50 layer: device us, bytes moved, achieved bandwidth against the GPU's peak (issue 36).

    python -m benchmarks.fused_graphs --out fused_graphs.json [--plot fused_graphs.png] [--layers N]
    python -m benchmarks.fused_graphs --table-from fused_graphs.json [--plot fused_graphs.png]  # no GPU

What is timed. A fused run (`cudnn_graphs/torch/_chain.py`) replaces torchvision's Bottleneck: per stage a
conv graph that sums its output per channel (genstats) and, after the first stage, reads the previous
stage's raw output through a relu(y * scale + shift) prologue; one kernel finalizes the sums; one output
pass writes the block's output; backward, per stage, our BatchNorm reduction + elementwise pass and a wgrad
with the same prologue. Each piece here is built by the library's own code: the conv graphs by
`_chain._StagePlan` (the specs, session and launchers a run plans), the BatchNorm launches by
`fallback_kernels.batchnorm.BatchNormKernels`; the launchers run directly (a run replays them from one CUDA
graph: the same kernels). Torch's side is what torch runs for the same modules under AMP (float16
activations and weights, float32 BatchNorm parameters, channels-last, `cudnn.benchmark=True`, autograd for
the backward). Each of torch's ops goes in the row of the fused launch that makes it unnecessary, so the
rows of a block add up to the block's BatchNorm-related work on each side, nothing counted twice:

- `conv_stats` (a block's first conv, and its downsample): ours the conv + genstats graph and the finalize
  kernel; torch the conv alone (its BatchNorm is in the row of the launch that applies it: the next conv's
  `prologue_conv_stats`, or the `output_pass`), so this row is the cost of the statistics.
- `prologue_conv_stats` (the second and third convs): ours relu(y_prev * scale + shift) -> conv ->
  genstats and the finalize; torch batch_norm(training) of y_prev -> relu_ -> conv.
- `output_pass` (the third conv's BatchNorm, the residual, the ReLU): ours one pass relu(y * scale + shift
  + residual) -- with a downsample, + y_ds * scale2 + shift2 -- writing the ReLU's mask as bits; torch
  batch_norm(training) of y (and of y_ds) -> add_ -> relu_.
- `bn_backward`, per stage: ours the reduction and the elementwise pass (dy, dgamma, dbeta); torch, through
  autograd, threshold_backward (the ReLU's) and batch_norm's backward. Variants: `relu` (first and second
  stages: our mask from y * scale + shift); `last` (an identity block's third stage: the mask from the
  output pass's bits, and the residual's gradient dz written too); `last_down` (the same in a block with a
  downsample: no dz); `branch` (the downsample: our mask from the bits again; torch's threshold_backward is
  counted once, in `last_down`, so torch runs batch_norm's backward alone).
- `prologue_wgrad` (the second and third convs): ours the wgrad graph reading relu(y_prev * scale + shift)
  through its prologue; torch the wgrad reading the normalised activation its forward stored.
- `dgrad_residual` (an identity block's first conv: its input is also the residual): ours the dgrad graph
  adding the residual's gradient in its epilogue (or, where cuDNN builds no such graph, the dgrad and our
  add pass, as a run does: the row says which); torch the dgrad and autograd's add of x's two gradients.

Not rows, being the same work on both sides: the other dgrads, the first conv's and the downsample's plain
wgrads, the weight casts AMP adds to both, and a downsample block's add of its input's two gradients.

Rows: ResNet-50's convs after the stem (`cudnn_graphs.presets.resnet_layers`), batch 64; each distinct
(piece, variant, geometry) once, with the layers it serves and `count`, how many times a training step
runs it; `totals` adds count x us per piece (ms a step, over the rows measured). `--layers N` keeps the
pieces of the first N convs in forward order.

Bytes moved: a model of the minimum each side's passes must move (`passes`): every tensor a pass reads
once, every tensor it writes once, in the passes the side is made of -- a BatchNorm's statistics (or its
backward reduction) and its elementwise pass are two passes on both sides, a conv reads its input and
weight and writes its output once; per-channel vectors (sums, scale, shift, statistics, gamma, their
gradients, the reductions' partial sums: under 2 % of any row) are left out. GB/s = those bytes / device
us, `of_peak` = that over `--peak-tbps` (3.35: H100 SXM's HBM3). A fraction above 1 means the implementation
moved fewer bytes than its passes' model (a persistent kernel keeping the data on chip); the convs'
fractions are low because they are compute-bound, not because they move bytes badly.

Device us: `harness.device_ms` of 20 back-to-back calls queued behind a GPU sleep (no launch gaps), ours
and torch's in `--rounds` interleaved rounds (`harness.interleaved`), medians. Before timing, every fused
piece's outputs start as NaN and are compared with torch's (relative error; a NaN left is inf) on random
inputs: `rel_err` per output, `check` "FAIL" above 5e-2. Expect ~1e-3 forward; up to ~1e-2 backward,
where the ReLU's mask differs at values within a float16 rounding of 0 (ours from y * scale + shift with
float16 scale and shift, or the output pass's bits, which round once; torch's from its own output). Our
plans come from cuDNN's heuristics; a converted model under `cudnn.benchmark=True` autotunes them
(`--policy autotune [--autotune-limit N]`, minutes more on a cold plan cache).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks import harness

BATCH = 64
DEVICE = "cuda"  # where the rows' tensors live (the CPU tests run the pieces against stand-in launchers)
CALLS = 20  # back-to-back calls a timed block
SLEEP_MS = 20.0  # the GPU sleep a timed block queues behind: longer than the host needs to queue its calls
EPS, MOMENTUM = 1e-5, 0.1
ITEM = 2  # bytes of a float16 value
TOLERANCE = 5e-2  # a relative error above it marks the row's check "FAIL"
PIECES = ("conv_stats", "prologue_conv_stats", "output_pass", "bn_backward", "prologue_wgrad", "dgrad_residual")


# -- the rows: ResNet-50's fused pieces by geometry (pure) ----------------------------------------------

def out_hw(hw: int, r: int, stride: int, pad: int) -> int:
    return (hw + 2 * pad - r) // stride + 1


def _role_pieces(role: str, down: bool) -> list[tuple[str, str | None, str]]:
    """(piece, variant, "conv" or "bn" geometry) of one conv of a Bottleneck, by its name in the block."""
    if role == "conv1":
        return [("conv_stats", None, "conv"), ("bn_backward", "relu", "bn")] + \
            ([] if down else [("dgrad_residual", None, "conv")])
    if role == "conv2":
        return [("prologue_conv_stats", None, "conv"), ("prologue_wgrad", None, "conv"), ("bn_backward", "relu", "bn")]
    if role == "conv3":
        return [("prologue_conv_stats", None, "conv"), ("prologue_wgrad", None, "conv"),
                ("output_pass", "branch" if down else "identity", "bn"),
                ("bn_backward", "last_down" if down else "last", "bn")]
    if role == "downsample":
        return [("conv_stats", None, "conv"), ("bn_backward", "branch", "bn")]
    raise ValueError(f"role: a Bottleneck's conv1, conv2, conv3 or downsample, not {role!r}")


def _geometries(layer, batch: int) -> dict:
    pad = layer.r // 2
    ho = out_hw(layer.hw, layer.r, layer.stride, pad)
    y = (batch, layer.k, ho, ho)
    conv = {"x": (batch, layer.c, layer.hw, layer.hw), "w": (layer.k, layer.c, layer.r, layer.r), "y": y,
            "stride": layer.stride, "pad": pad}
    return {"conv": conv, "bn": {"x": None, "w": None, "y": y, "stride": None, "pad": None}}


def entries(*, batch: int = BATCH, layers: int | None = None) -> list[dict]:
    """Each distinct (piece, variant, geometry) of ResNet-50's fused runs (the first `layers` convs after
    the stem, forward order), in order of first use: shapes, the layers using it, `count` a step."""
    from cudnn_graphs.presets import resnet_layers

    convs = [layer for layer in resnet_layers("resnet50") if layer.name != "conv1"]
    downs = {layer.name.rsplit(".", 1)[0] for layer in convs if layer.name.endswith(".downsample")}
    found: dict[tuple, dict] = {}
    for layer in convs[:layers]:
        block, role = layer.name.rsplit(".", 1)
        geo = _geometries(layer, batch)
        for piece, variant, kind in _role_pieces(role, block in downs):
            g = geo[kind]
            key = (piece, variant, g["x"], g["w"], g["y"], g["stride"])
            row = found.setdefault(key, {"piece": piece, "variant": variant, **g, "layers": [], "count": 0})
            row["layers"].append(layer.name)
            row["count"] += 1
    return list(found.values())


def passes(piece: str, variant: str | None, *, x: int, y: int, w: int, fused_graph: bool = True) -> dict:
    """{"fused": [(pass, bytes)], "torch": [...]}: the minimum bytes each pass of each side moves, from the
    element counts of the conv's input `x`, output (or the BatchNorm's tensor) `y` and weight `w`."""
    X, Y, W, bits = ITEM * x, ITEM * y, ITEM * w, y // 8
    bn_fwd = [("batch_norm statistics", Y), ("batch_norm apply", 2 * Y)]
    bn_bwd = [("batch_norm backward reduction", 2 * Y), ("batch_norm backward pass", 3 * Y)]
    dgrad = ("dgrad", Y + W + X)
    if piece == "conv_stats":
        return {"fused": [("conv + genstats", X + W + Y)], "torch": [("conv", X + W + Y)]}
    if piece == "prologue_conv_stats":
        return {"fused": [("relu(x*scale+shift) -> conv + genstats", X + W + Y)],
                "torch": [("batch_norm statistics", X), ("batch_norm apply", 2 * X), ("relu_", 2 * X),
                          ("conv", X + W + Y)]}
    if piece == "output_pass":
        branch = [("downsample batch_norm statistics", Y), ("downsample batch_norm apply", 2 * Y)]
        return {"fused": [("apply + residual + relu, mask bits", 3 * Y + bits)],
                "torch": bn_fwd + (branch if variant == "branch" else []) + [("add_", 3 * Y), ("relu_", 2 * Y)]}
    if piece == "bn_backward":
        return _bn_backward_passes(variant, Y, bits, bn_bwd)
    if piece == "prologue_wgrad":
        return {"fused": [("relu(x*scale+shift) -> wgrad", X + Y + W)], "torch": [("wgrad", X + Y + W)]}
    if piece == "dgrad_residual":
        add = ("add", 3 * X)
        return {"fused": [("dgrad + z", Y + W + 2 * X)] if fused_graph else [dgrad, add], "torch": [dgrad, add]}
    raise ValueError(f"piece: one of {PIECES}, not {piece!r}")


def _bn_backward_passes(variant: str | None, Y: int, bits: int, bn_bwd: list) -> dict:
    relu = [("threshold_backward", 3 * Y)]
    if variant == "relu":
        return {"fused": [("reduction", 2 * Y), ("pass", 3 * Y)], "torch": relu + bn_bwd}
    if variant not in ("last", "last_down", "branch"):
        raise ValueError(f"variant: relu, last, last_down or branch, not {variant!r}")
    dz = Y if variant == "last" else 0
    fused = [("reduction, mask bits", 2 * Y + bits), ("pass, mask bits" + (", dz" if dz else ""), 3 * Y + bits + dz)]
    return {"fused": fused, "torch": bn_bwd if variant == "branch" else relu + bn_bwd}


def numels(entry: dict) -> dict:
    """Element counts {x, y, w} of an entry's tensors (0 where it has none)."""
    return {k: math.prod(entry[k]) if entry[k] else 0 for k in ("x", "y", "w")}


def side(us: float, passes_: list, *, peak_tbps: float) -> dict:
    """One side's figures: device us, bytes moved, GB/s and the fraction of the peak."""
    moved = sum(b for _, b in passes_)
    gbps = moved / us / 1e3 if us and not math.isnan(us) else float("nan")
    return {"us": round(us, 2), "bytes": moved, "GBps": round(gbps, 1), "of_peak": round(gbps / (peak_tbps * 1e3), 3),
            "passes": [name for name, _ in passes_]}


def totals(rows: list[dict]) -> dict:
    """Per piece, then overall ("all", last): count x device us and count x bytes summed over the rows (ms
    and GB a training step), torch / fused."""
    out: dict[str, dict] = {}
    for row in rows:
        if "fused" not in row:
            continue
        for name in (row["piece"], "all"):
            t = out.setdefault(name, {"torch_ms": 0.0, "fused_ms": 0.0, "torch_gb": 0.0, "fused_gb": 0.0})
            for side_ in ("torch", "fused"):
                t[f"{side_}_ms"] += row["count"] * row[side_]["us"] / 1e3
                t[f"{side_}_gb"] += row["count"] * row[side_]["bytes"] / 1e9
    for t in out.values():
        t["speedup"] = round(harness.ratio(t["torch_ms"], t["fused_ms"]), 3)
        for k in ("torch_ms", "fused_ms", "torch_gb", "fused_gb"):
            t[k] = round(t[k], 3)
    if "all" in out:
        out["all"] = out.pop("all")
    return out


# -- reading a result: the docs' table and the chart (no GPU) -------------------------------------------

def label(row: dict) -> str:
    """"64x56x56 -> 256 1x1" for a conv, "256x56x56" for a BatchNorm tensor."""
    if row["x"] is None:
        _, k, h, w = row["y"]
        return f"{k}x{h}x{w}"
    _, c, h, w = row["x"]
    k, _, r, _ = row["w"]
    return f"{c}x{h}x{w} -> {k} {r}x{r}" + (f"/{row['stride']}" if row["stride"] != 1 else "")


def _cell(s: dict) -> str:
    return f"{s['bytes'] / 1e6:.1f} MB, {s['GBps'] / 1e3:.2f} TB/s ({100 * s['of_peak']:.0f} %)"


def markdown(result: dict) -> str:
    """The table docs/training.md keeps: a line per row (by piece), then ms a step per piece."""
    lines = ["| piece | geometry | layers (a step) | torch us | ours us | torch / ours | torch bytes, bandwidth "
             "| ours bytes, bandwidth | max rel err |", "|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(result["rows"], key=lambda r: PIECES.index(r["piece"]))
    for r in rows:
        piece = r["piece"] + (f" ({r['variant']})" if r["variant"] else "")
        where = f"{r['layers'][0]}{' ...' if r['count'] > 1 else ''} ({r['count']})"
        if "fused" not in r:
            lines.append(f"| {piece} | {label(r)} | {where} | | | | | | {r.get('error', '?')} |")
            continue
        lines.append(f"| {piece} | {label(r)} | {where} | {r['torch']['us']:.1f} | {r['fused']['us']:.1f} | "
                     f"{r['speedup']:.2f}x | {_cell(r['torch'])} | {_cell(r['fused'])} | {r['max_rel_err']:.1e} |")
    lines += ["", "| piece | torch ms a step | ours ms a step | torch / ours | torch GB a step | ours GB a step |",
              "|---|---|---|---|---|---|"]
    for name, t in result["totals"].items():
        moved = f"{t['torch_gb']:.2f} | {t['fused_gb']:.2f}" if "torch_gb" in t else " | "
        lines.append(f"| {name} | {t['torch_ms']:.2f} | {t['fused_ms']:.2f} | {t['speedup']:.2f}x | {moved} |")
    return "\n".join(lines)


def plot(path, result: dict):
    """Speed-up torch / ours, a group per layer (the first one a row serves), a bar per piece."""
    groups: dict[str, dict[str, float]] = {}
    for r in result["rows"]:
        if "speedup" in r:
            groups.setdefault(r["layers"][0], {})[r["piece"]] = r["speedup"]
    return harness.bar_chart(path, groups, title=harness.title(result, "fused pieces, torch / ours, device us"),
                             ylabel="speed-up (torch / ours)", baseline=1.0)


# -- GPU: tensors, the library's launchers, the pieces -----------------------------------------------------

def _t():
    import torch

    return torch


def _cl(t):
    return t.contiguous(memory_format=_t().channels_last)


def _rand(shape, *, scale=1.0, shift=0.0):
    """float16 channels-last N(shift, scale) values: a conv's raw output."""
    torch = _t()
    return _cl((torch.randn(shape, device=DEVICE) * scale + shift).half())


def _nan(shape, dtype=None):
    torch = _t()
    t = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype or torch.float16)
    return _cl(t) if len(shape) == 4 else t


def _weight(shape):
    return _cl((_t().randn(shape, device=DEVICE) / math.prod(shape[1:]) ** 0.5).half())


def _p(t) -> int:
    return 0 if t is None else t.data_ptr()


def bn_buffers(k: int) -> dict:
    """One BatchNorm's parameters, running statistics (ours and torch's) and NaN-poisoned outputs."""
    torch = _t()
    f32 = dict(device=DEVICE, dtype=torch.float32)
    return {"gamma": torch.rand(k, **f32) + 0.5, "beta": torch.randn(k, **f32) * 0.5,
            "rm": torch.zeros(k, **f32), "rv": torch.ones(k, **f32), "rm_t": torch.zeros(k, **f32),
            "rv_t": torch.ones(k, **f32), "nbt": torch.zeros(1, dtype=torch.int64, device=DEVICE),
            "sum": _nan((k,), torch.float32), "sq_sum": _nan((k,), torch.float32), "mean": _nan((k,), torch.float32),
            "invstd": _nan((k,), torch.float32), "scale": _nan((k,)), "shift": _nan((k,))}


def finalize(kernels, b: dict, stream: int) -> None:
    kernels.finalize(stream, sum=_p(b["sum"]), sq_sum=_p(b["sq_sum"]), gamma=_p(b["gamma"]), beta=_p(b["beta"]),
                     running_mean=_p(b["rm"]), running_var=_p(b["rv"]), num_batches=_p(b["nbt"]),
                     scale=_p(b["scale"]), shift=_p(b["shift"]), mean=_p(b["mean"]), invstd=_p(b["invstd"]),
                     eps=EPS, momentum=MOMENTUM)


def bn_state(t, kernels, stream: int) -> dict:
    """A BatchNorm over `t` as a run holds it after its finalize: our kernel on `t`'s sums."""
    b = bn_buffers(t.shape[1])
    b["sum"].copy_(t.float().sum((0, 2, 3)))
    b["sq_sum"].copy_((t.float() ** 2).sum((0, 2, 3)))
    finalize(kernels, b, stream)
    return b


def torch_bn(t, b: dict):
    """torch's batch_norm in training on `t` with `b`'s parameters (its own running statistics)."""
    return _t().nn.functional.batch_norm(t, b["rm_t"], b["rv_t"], b["gamma"], b["beta"], True, MOMENTUM, EPS)


def rel(got, want) -> float:
    return harness.rel_err(got.flatten(), want.flatten())


def stats_errors(y, b: dict, want) -> dict:
    """The conv output, its sums and the finalize's mean and 1/std against torch's output `want`."""
    w = want.double()
    var = w.var((0, 2, 3), unbiased=False)
    return {"y": rel(y, want), "sum": rel(b["sum"], w.sum((0, 2, 3))),
            "sq_sum": rel(b["sq_sum"], (w * w).sum((0, 2, 3))), "mean": rel(b["mean"], w.mean((0, 2, 3))),
            "invstd": rel(b["invstd"], (var + EPS).rsqrt())}


class Bench:
    """The library's launchers for the rows' geometries (one stage plan per conv geometry and kind, one
    BatchNormKernels per tensor geometry), on torch's current stream."""

    def __init__(self, session):
        torch = _t()
        self.session, self.stream = session, torch.cuda.current_stream().cuda_stream
        self.device = torch.cuda.current_device()
        self._stages: dict = {}
        self._kernels: dict = {}

    def stage(self, e: dict, *, prologue: bool, residual_grad: bool = False):
        """The `_StagePlan` a run builds for this conv: its forward, dgrad and wgrad launchers."""
        key = (e["x"], e["w"], e["stride"], prologue, residual_grad)
        if key not in self._stages:
            from torch import nn

            from cudnn_graphs.torch._chain import Stage, _StagePlan

            k, c, r, _ = e["w"]
            conv = nn.Conv2d(c, k, r, stride=e["stride"], padding=e["pad"], bias=False, device="meta")
            stage = Stage(conv, nn.BatchNorm2d(k, device="meta"), relu=True)
            self._stages[key] = _StagePlan(stage, tuple(e["x"]), prologue, self.session, self.device,
                                           residual_grad=residual_grad)
        return self._stages[key]

    def kernels(self, shape):
        """BatchNormKernels over a (N, C, H, W) tensor's rows x channels."""
        key = tuple(shape)
        if key not in self._kernels:
            from fallback_kernels.batchnorm import BatchNormKernels

            self._kernels[key] = BatchNormKernels(math.prod(shape) // shape[1], shape[1], "float16", self.device)
        return self._kernels[key]

    def scratch(self, kernels, k: int) -> dict:
        """A backward's reduction partials, zeroed counters, coefficients and NaN dgamma, dbeta."""
        torch = _t()
        return {"partials": torch.empty(kernels.partials_bytes // 4 + 64, device=DEVICE),
                "counters": torch.zeros(kernels.tiles, dtype=torch.int32, device=DEVICE),
                "coef": torch.empty(3 * k, device=DEVICE), "dgamma": _nan((k,), torch.float32),
                "dbeta": _nan((k,), torch.float32)}


# Each piece: (fused, torch, check, info) for one row; check() runs the fused side once on NaN outputs and
# returns {output: relative error against torch's}; info is added to the row.

def _conv_args(e: dict) -> tuple:
    return [e["stride"]] * 2, [e["pad"]] * 2, [1, 1], False, [0, 0], 1


def _forward_piece(bench, e: dict, *, x, prev: dict | None = None, before=None):
    """A conv + statistics graph (through the prologue where `prev`, the previous BatchNorm) and its
    finalize; torch's side conv(before(x)), `before` torch's BatchNorm + ReLU of x where there is one."""
    F = _t().nn.functional
    st, b, y, w = bench.stage(e, prologue=prev is not None), bn_buffers(e["w"][0]), _nan(e["y"]), _weight(e["w"])
    pro = () if prev is None else (_p(prev["scale"]), _p(prev["shift"]))
    ptrs = (_p(x), *pro, _p(w), _p(y), _p(b["sum"]), _p(b["sq_sum"]))

    def fused(_keep=(x, prev, w, y)):  # what `ptrs` points into, held as long as it
        st.fwd.run(ptrs, bench.stream)
        finalize(st.bn, b, bench.stream)

    def theirs():
        return F.conv2d(x if before is None else before(x), w, stride=e["stride"], padding=e["pad"])

    def check():
        fused()
        return stats_errors(y, b, theirs())
    return fused, theirs, check, {}


def conv_stats(bench, e: dict, variant):
    x = _cl(_t().rand(e["x"], device=DEVICE).half())  # a ReLU's output: the block's input
    return _forward_piece(bench, e, x=x)


def prologue_conv_stats(bench, e: dict, variant):
    x = _rand(e["x"], scale=1.5, shift=0.3)  # the previous stage's raw conv output
    prev = bn_state(x, bench.kernels(e["x"]), bench.stream)
    return _forward_piece(bench, e, x=x, prev=prev, before=lambda t: torch_bn(t, prev).relu_())


def prologue_wgrad(bench, e: dict, variant):
    torch = _t()
    x, w, dy, dw = _rand(e["x"], scale=1.5, shift=0.3), _weight(e["w"]), _rand(e["y"]), _nan(e["w"])
    prev = bn_state(x, bench.kernels(e["x"]), bench.stream)
    a = torch_bn(x, prev).relu_()  # the normalised activation torch's forward stored
    st = bench.stage(e, prologue=True)
    ptrs = (_p(x), _p(prev["scale"]), _p(prev["shift"]), _p(dy), _p(dw))

    def fused(_keep=(x, prev)):  # holds what `ptrs` points into: freed, torch's allocator would hand it out
        st.wgrad.run(ptrs, bench.stream)

    def theirs():
        return torch.ops.aten.convolution_backward(dy, a, w, None, *_conv_args(e), [False, True, False])[1]

    def check():
        fused()
        return {"dw": rel(dw, theirs())}
    return fused, theirs, check, {}


def dgrad_residual(bench, e: dict, variant):
    torch = _t()
    st = bench.stage(e, prologue=False, residual_grad=True)
    dy, w, z, dx = _rand(e["y"]), _weight(e["w"]), _rand(e["x"]), _nan(e["x"])
    if st.dgrad_adds:
        def fused():
            st.dgrad.run((_p(dy), _p(w), _p(z), _p(dx)), bench.stream)
    else:  # as a run does where cuDNN has no dgrad + residual graph: the dgrad, then our add pass
        first, add = _nan(e["x"]), bench.kernels(e["x"])

        def fused():
            st.dgrad.run((_p(dy), _p(w), _p(first)), bench.stream)
            add.add(bench.stream, a=_p(first), b=_p(z), out=_p(dx))

    def theirs():
        return torch.add(torch.ops.aten.convolution_backward(dy, z, w, None, *_conv_args(e),
                                                            [True, False, False])[0], z)

    def check():
        fused()
        return {"dx": rel(dx, theirs())}
    return fused, theirs, check, {"fused_graph": st.dgrad_adds}


def bits_mismatch(bits, out) -> float:
    """The fraction of mask bits that disagree with out > 0 (memory order: bit j of byte i is value 8i + j)."""
    torch = _t()
    want = out.permute(0, 2, 3, 1).reshape(-1, 8) > 0
    got = (bits.view(-1, 1).int() >> torch.arange(8, device=bits.device)) & 1
    return float((got.bool() != want).float().mean())


def _apply_args(out, bits, y, b: dict, residual, rb: dict | None) -> dict:
    """bn_apply's pointers: out = relu(y * scale + shift + residual [* scale2 + shift2]), mask bits."""
    return dict(y=_p(y), scale=_p(b["scale"]), shift=_p(b["shift"]), out=_p(out), relu=True, residual=_p(residual),
                scale2=0 if rb is None else _p(rb["scale"]), shift2=0 if rb is None else _p(rb["shift"]),
                bits=_p(bits))


def _torch_out(variant: str, y, b: dict, other, ob: dict | None):
    """torch's block output as a Bottleneck computes it, as a function of the BatchNorm input y: the stage's
    relu_(bn(y)), or at the block's end relu_(bn3 + identity | bn3 + bn_ds) with y as bn3's or bn_ds's."""
    if variant == "relu":
        return torch_bn(y, b).relu_()
    if variant == "branch":  # y is the downsample's conv output, other the third conv's
        z = torch_bn(other, ob)
        z += torch_bn(y, b)
    else:  # y is the third conv's output; other the identity ("last") or the downsample's output
        z = torch_bn(y, b)
        z += other if variant == "last" else torch_bn(other, ob)
    return z.relu_()


def output_pass(bench, e: dict, variant):
    torch = _t()
    kern = bench.kernels(e["y"])
    y, r = _rand(e["y"], scale=1.5, shift=0.3), _rand(e["y"], scale=1.5, shift=0.3)
    b = bn_state(y, kern, bench.stream)
    rb = bn_state(r, kern, bench.stream) if variant == "branch" else None  # the downsample's raw output
    out, bits = _nan(e["y"]), torch.zeros(kern.bits_bytes, dtype=torch.uint8, device=DEVICE)
    args = _apply_args(out, bits, y, b, r, rb)

    def fused(_keep=(y, r, b, rb, out, bits)):  # what `args` points into, held as long as it
        kern.apply(bench.stream, **args)

    def theirs():
        return _torch_out("last" if rb is None else "last_down", y, b, r, rb)

    def check():
        fused()
        return {"out": rel(out, theirs()), "bits": bits_mismatch(bits, out)}
    return fused, theirs, check, {}


def _mask_bits(bench, e: dict, variant: str, y, b: dict, other, ob: dict | None):
    """The output pass's bits the backward of a block's last stage (or its downsample) reads its mask from."""
    torch = _t()
    kern = bench.kernels(e["y"])
    if not kern.bits:  # K % 8 != 0: a run stores the output for the mask instead (not in ResNet-50)
        raise ValueError(f"{e['y']}: no mask bits at {e['y'][1]} channels")
    out, bits = _nan(e["y"]), torch.zeros(kern.bits_bytes, dtype=torch.uint8, device=DEVICE)
    if variant == "branch":  # relu(bn3(other) + bn_ds(y))
        kern.apply(bench.stream, **_apply_args(out, bits, other, ob, y, b))
    else:  # relu(bn3(y) + other), other through the downsample's BatchNorm in a block that has one
        kern.apply(bench.stream, **_apply_args(out, bits, y, b, other, ob))
    return bits


def _torch_backward(variant: str, y, b: dict, da, other, ob: dict | None):
    """(torch's backward of the BatchNorm over y as autograd runs it -> (dy, dgamma, dbeta), dz's reference)."""
    torch = _t()
    yl = y.detach().requires_grad_()
    gamma, beta = b["gamma"].clone().requires_grad_(), b["beta"].clone().requires_grad_()
    p = {**b, "gamma": gamma, "beta": beta}
    with torch.enable_grad():
        if variant == "branch":  # the ReLU's backward is the last stage's row: here the downsample's BatchNorm
            grad = da * (_torch_out(variant, y, b, other, ob) > 0)
            a = torch_bn(yl, p)
        else:
            a = _torch_out(variant, yl, p, other, ob)
            grad = da
    dz = da * (a.detach() > 0)
    return (lambda: torch.autograd.grad(a, (yl, gamma, beta), grad, retain_graph=True)), dz


def bn_backward(bench, e: dict, variant):
    kern, k = bench.kernels(e["y"]), e["y"][1]
    y, da, other = _rand(e["y"], scale=1.5, shift=0.3), _rand(e["y"]), _rand(e["y"], scale=1.5, shift=0.3)
    b = bn_state(y, kern, bench.stream)
    ob = bn_state(other, kern, bench.stream) if variant in ("last_down", "branch") else None
    bits = None if variant == "relu" else _mask_bits(bench, e, variant, y, b, other, ob)
    s, dy = bench.scratch(kern, k), _nan(e["y"])
    dz = _nan(e["y"]) if variant == "last" else None
    args = dict(da=_p(da), y=_p(y), out=0, scale=_p(b["scale"]), shift=_p(b["shift"]), gamma=_p(b["gamma"]),
                mean=_p(b["mean"]), invstd=_p(b["invstd"]), partials=_p(s["partials"]), coef=_p(s["coef"]),
                dgamma=_p(s["dgamma"]), dbeta=_p(s["dbeta"]), dy=_p(dy), relu=True, counters=_p(s["counters"]),
                dz=_p(dz), bits=_p(bits))
    theirs, dz_ref = _torch_backward(variant, y, b, da, other, ob)

    def fused(_keep=(y, da, other, b, ob, bits, s, dy, dz)):  # what `args` points into, held as long as it
        kern.backward(bench.stream, **args)

    def check():
        fused()
        want = theirs()
        errs = {"dy": rel(dy, want[0]), "dgamma": rel(s["dgamma"], want[1]), "dbeta": rel(s["dbeta"], want[2])}
        return errs if dz is None else {**errs, "dz": rel(dz, dz_ref)}
    return fused, theirs, check, {}


BUILDERS = {"conv_stats": conv_stats, "prologue_conv_stats": prologue_conv_stats, "output_pass": output_pass,
            "bn_backward": bn_backward, "prologue_wgrad": prologue_wgrad, "dgrad_residual": dgrad_residual}


# -- one row, the run ---------------------------------------------------------------------------------------

def row_base(e: dict) -> dict:
    return {"piece": e["piece"], "variant": e["variant"], "layers": e["layers"], "count": e["count"],
            **{k: None if e[k] is None else list(e[k]) if isinstance(e[k], tuple) else e[k]
               for k in ("x", "w", "y", "stride", "pad")}}


def measure(bench, e: dict, *, rounds: int, cycles: int, peak_tbps: float) -> dict:
    """One row: checked, then timed (fused and torch in interleaved rounds), with its bytes model."""
    fused, theirs, check, info = BUILDERS[e["piece"]](bench, e, e["variant"])
    errors = check()
    for fn in (fused, theirs, fused, theirs):  # warm: torch's benchmark search, our first launches
        fn()
    us = harness.interleaved({"fused": fused, "torch": theirs},
                             {"us": lambda fn: harness.device_ms(fn, calls=CALLS, sleep_cycles=cycles) * 1e3},
                             rounds=rounds)["us"]
    model = passes(e["piece"], e["variant"], **numels(e), fused_graph=info.get("fused_graph", True))
    worst = max(errors.values())
    return {**row_base(e), **info, "fused": side(us["fused"], model["fused"], peak_tbps=peak_tbps),
            "torch": side(us["torch"], model["torch"], peak_tbps=peak_tbps),
            "speedup": round(harness.ratio(us["torch"], us["fused"]), 3),
            "rel_err": {k: float(f"{v:.3g}") for k, v in errors.items()}, "max_rel_err": worst,
            "check": "ok" if worst <= TOLERANCE else "FAIL"}


def run_row(bench, e: dict, args) -> dict:
    """measure(), or the row with the error that stopped it (the run goes on to the next row)."""
    try:
        return measure(bench, e, rounds=args.rounds, cycles=args.cycles, peak_tbps=args.peak_tbps)
    except Exception as err:  # noqa: BLE001 - a declined graph or a bug: recorded, the other rows still run
        import traceback

        traceback.print_exc()
        return {**row_base(e), "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}


def run(args) -> dict:
    import torch

    from cudnn_graphs import Session

    torch.backends.cudnn.benchmark = True
    session = Session(device=torch.cuda.current_device(), policy=args.policy, autotune_limit=args.autotune_limit)
    bench = Bench(session)
    args.cycles = harness.sleep_cycles_for(SLEEP_MS)
    rows: list[dict] = []
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
              "peak_tbps": args.peak_tbps, "policy": args.policy, "rounds": args.rounds, "calls": CALLS,
              "rows": rows, "totals": {}}
    with torch.no_grad():
        for e in entries(batch=args.batch, layers=args.layers):
            rows.append(run_row(bench, e, args))
            print(json.dumps(rows[-1]), flush=True)
            result["totals"] = totals(rows)
            harness.write_json(args.out, result)  # rewritten as rows come: a run cut short keeps them
    return result



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="the JSON result (required unless --table-from)")
    p.add_argument("--plot", help="a PNG of torch / ours per layer and piece (needs matplotlib)")
    p.add_argument("--table-from", help="print the markdown table (and draw --plot) from this JSON: no GPU")
    p.add_argument("--layers", type=int, help="only the pieces of ResNet-50's first N convs after the stem")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds a row (medians)")
    p.add_argument("--peak-tbps", type=float, default=3.35, help="the GPU's memory bandwidth (H100 SXM: 3.35)")
    p.add_argument("--policy", choices=("heuristic", "autotune"), default="heuristic",
                   help="how our plans are chosen (a converted model under cudnn.benchmark=True: autotune)")
    p.add_argument("--autotune-limit", type=int, help="with --policy autotune: candidates timed a plan")
    args = p.parse_args(argv)
    if args.table_from:
        result = json.loads(Path(args.table_from).read_text())
    elif args.out:
        result = run(args)
    else:
        p.error("--out (a run on the GPU) or --table-from (a stored result)")
    print(markdown(result))
    if args.plot:
        plot(args.plot, result if "meta" in result else {**result, "meta": harness.metadata()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
