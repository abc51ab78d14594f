"""torchvision's ConvNeXt block (`CNBlock`) in training under float16 autocast, as one autograd node.

torch runs a block's forward as ~20 dispatches (autocast's casts of the conv and both Linears' weights and
biases, the conv, LayerNorm in float32, fc1, GELU, fc2, the layer scale, stochastic depth, the residual add)
and its backward as ~15 autograd nodes: on a host-bound AMP step that host time is the step's time
(convnext_tiny: ~1.3 ms a block on an H100 host). This node does the same arithmetic in ~9 launches forward
and ~14 backward, from Python, those after the conv replayed as one re-pointed CUDA graph each direction
(`gpu_launch.replay.Replay`) from a stream's second call:

forward   cast (conv weight, fc1 weight and bias, fc2 weight: one launch) -> depthwise conv (torch's, no bias)
          -> LayerNorm adding the conv's bias (ours, float16 out, row mean and 1/std kept) -> fc1 with its bias
          (cuBLASLt) -> the activation into a second buffer -> fc2 (cuBLASLt, no bias) -> [stochastic depth's
          noise, torch's RNG calls as torchvision makes them] -> out = x + (z + b2) * gamma * noise in float32
          (torch's type promotion: the layer scale is float32)
backward  dz = dy * gamma * noise with gamma's and b2's gradients (ours) -> fc2's dgrad and wgrad (cuBLASLt,
          float32 weight gradient) -> the activation's backward with fc1's bias gradient (ours) -> fc1's wgrad
          and dgrad -> LayerNorm's backward (its input plus the conv bias, the parameters' gradients summed in
          a fixed order) -> torch's conv backward (input, weight and bias gradients) -> dx = dy + conv's dx

Numerics against torch's AMP block: the same roundings to float16 at the same places, except that ours adds
the conv's bias and fc2's in float32 (torch rounds conv + bias and fc2 + bias to float16 first) and writes
the weight gradients in float32 straight from the GEMMs (torch rounds them to float16, then casts).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.autograd.function import once_differentiable

from gpu_launch.replay import Replay

from ..errors import SpecError
from ._chain import _ptr_or_0 as _ptr, _replayed, _up, hooked

_MAX_GEOMETRIES = 64
_geometries: dict[tuple, "_BlockTrain | None"] = {}
_lock = threading.Lock()  # launches patch their argument slots in place
_UNSEEN = object()
_F16 = "float16"


def cnblock_training(block, x: torch.Tensor) -> torch.Tensor | None:
    """The block's output through `CNBlockFunction` where the call is one it takes (float16 autocast, a
    gradient wanted, CUDA, a channels-last float16 or float32 input, float32 parameters, no hooks, no
    torch.compile), else None (the caller runs another path)."""
    seq = block._modules["block"]
    parts = seq._modules
    conv, norm, fc1, act, fc2 = parts["0"], parts["2"], parts["3"], parts["4"], parts["5"]
    sd = block._modules["stochastic_depth"]
    if not x.is_cuda or x.dim() != 4 or x.dtype not in (torch.float16, torch.float32):
        return None
    if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") is not torch.float16 \
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() \
            or not torch._C._get_cudnn_enabled():
        return None
    p = (conv._parameters.get("weight"), conv._parameters.get("bias"), norm._parameters.get("weight"),
         norm._parameters.get("bias"), fc1._parameters.get("weight"), fc1._parameters.get("bias"),
         fc2._parameters.get("weight"), fc2._parameters.get("bias"), block._parameters.get("layer_scale"))
    device = x.get_device()
    if any(t is None or t.dtype is not torch.float32 or t.get_device() != device or t.data_ptr() % 32
           or not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)) for t in p):
        return None  # raw pointers are read: every operand present, float32, dense and 32-byte aligned
    if not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in p)):
        return None
    mode = _depth_mode(sd)
    if not x.is_contiguous(memory_format=torch.channels_last) or x.data_ptr() % 32 or mode is None \
            or hooked((seq, *seq, sd)):
        return None
    launches = _launches(x, p[0].numel(), fc1, act, mode)
    if launches is None:
        return None
    noise = None if mode == "none" else _noise(x, sd)
    return CNBlockFunction.apply(x, *p, launches, conv.padding, norm.eps, noise)


def _depth_mode(sd) -> str | None:
    """torchvision's StochasticDepth's mode ("row", "batch"), "none" for nn.Identity, None for another module."""
    if type(sd) is torch.nn.Identity:
        return "none"
    if type(sd).__name__ == "StochasticDepth" and type(sd).__module__.startswith("torchvision.") \
            and "forward" not in vars(sd) and getattr(sd, "mode", None) in ("row", "batch") \
            and 0.0 <= sd.p <= 1.0:  # else torch's forward raises its own error
        return sd.mode
    return None


def _noise(x: torch.Tensor, sd) -> torch.Tensor | None:
    """torchvision's stochastic_depth noise, made by the same calls (the RNG advances as in torch's block), in
    the block output's dtype (float32); None where it is the identity (eval, p = 0)."""
    if not sd.training or sd.p == 0.0:
        return None
    size = [x.shape[0], 1, 1, 1] if sd.mode == "row" else [1, 1, 1, 1]
    survival = 1.0 - sd.p
    noise = torch.empty(size, dtype=torch.float32, device=x.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return noise


def _launches(x: torch.Tensor, taps: int, fc1, act, mode: str) -> "_BlockTrain | None":
    from ._activations import activation_of as _activation_of

    if torch.cuda.current_device() != x.get_device():  # cuBLASLt's handle and plans belong to the current one
        return None
    n, c, h, w = x.shape
    activation = _activation_of(act)
    key = (n, c, h, w, taps, fc1.out_features, x.dtype, x.get_device(), activation, mode)
    found = _geometries.get(key, _UNSEEN)
    if found is _UNSEEN:
        found = _build(key)
        if len(_geometries) >= _MAX_GEOMETRIES:
            _geometries.clear()
        _geometries[key] = found
    return found


def _build(key: tuple) -> "_BlockTrain | None":
    from fallback_kernels import cublaslt

    n, c, h, w, taps, hidden, dtype, device, activation, mode = key
    if activation is None or not cublaslt.available() or c % 8 or hidden % 8:
        return None
    try:
        return _BlockTrain(n, c, h * w, taps, hidden, "float32" if dtype is torch.float32 else _F16, device,
                           activation, mode)
    except (cublaslt.CublasLtError, SpecError, ValueError):
        return None


class _BlockTrain:
    """One geometry's prepared launches and buffer layout (rows = N*H*W pixels of C channels, hidden = fc1's
    width); every GEMM operand is a 256-byte aligned buffer of ours."""

    def __init__(self, n: int, c: int, hw: int, taps: int, hidden: int, x_dtype: str, device: int, activation,
                 mode: str):
        from fallback_kernels import cublaslt
        from fallback_kernels.batchnorm import Cast
        from fallback_kernels.gemm_act import FlatActivation, FlatActivationBackward
        from fallback_kernels.layernorm import LayerNormBackward, LayerNormRows, LayerScaleResidual

        rows = n * hw
        self.rows, self.c, self.hidden, self.device = rows, c, hidden, device
        self.geometry = (n, c, hw, hidden, x_dtype)
        self._forward: dict[tuple, Replay] = {}
        self._backward: dict[bool, Replay] = {}
        self.ln = LayerNormRows(rows, c, _F16, device, align=16, param_dtype="float32")
        self.ln_bwd = LayerNormBackward(rows, c, _F16, device, align=16, param_dtype="float32")
        self.scale = LayerScaleResidual(rows, c, _F16, x_dtype, device, sample_rows=hw if mode == "row" else rows)
        self.act = FlatActivation(rows * hidden, _F16, device, activation)
        self.act_bwd = FlatActivationBackward(rows, hidden, _F16, device, activation)
        self.cast = Cast((taps, hidden * c, c * hidden, hidden), to="to_half", device=device)

        def gemm(m, nn, k, a, b, ldd, **kw):
            return cublaslt.lt_gemm(cublaslt.Geometry(device, _F16, m, nn, k, a, b, ldd, **kw))

        self.fc1 = gemm(rows, hidden, c, ("row", c), ("col", c), hidden, epilogue="BIAS")  # t @ W1.T + b1
        self.fc2 = gemm(rows, c, hidden, ("row", hidden), ("col", hidden), c)  # a @ W2.T
        self.fc2_dgrad = gemm(rows, hidden, c, ("row", c), ("row", hidden), hidden)  # dz @ W2
        self.fc2_wgrad = gemm(c, hidden, rows, ("col", c), ("row", hidden), hidden, out_dtype="float32")  # dz.T @ a
        self.fc1_wgrad = gemm(hidden, c, rows, ("col", hidden), ("row", c), c, out_dtype="float32")  # dh.T @ t
        self.fc1_dgrad = gemm(rows, c, hidden, ("row", hidden), ("row", c), c)  # dh @ W1
        self.workspace = max(g.workspace for g in (self.fc1, self.fc2, self.fc2_dgrad, self.fc2_wgrad,
                                                    self.fc1_wgrad, self.fc1_dgrad))
        # the forward's saved buffer: t, h, a, z (float16), the rows' mean and 1/std, the cast fc weights and bias
        sizes = (rows * c * 2, rows * hidden * 2, rows * hidden * 2, rows * c * 2, rows * 8, hidden * c * 2,
                 c * hidden * 2, hidden * 2)
        self.saved = _offsets(sizes)
        # the backward's scratch: dz then dt (rows x C), da, dh (rows x hidden), the three kernels' partials
        sizes = (rows * c * 2, rows * hidden * 2, rows * hidden * 2, self.scale.partials_bytes,
                 self.act_bwd.partials_bytes, self.ln_bwd.partials_bytes, self.workspace)
        self.scratch = _offsets(sizes)

    def forward_tail(self, ptrs: tuple, stream: int, eps: float) -> None:
        """After the conv: LayerNorm, fc1, the activation, fc2, the block end; replayed as one graph from its
        second call on a stream (`Replay`, one per eps and noise given or not: values, not pointers)."""
        key = (eps, ptrs[-1] != 0)
        replay = self._forward.get(key)
        if replay is None:
            run = functools.partial(self._forward_run, eps=eps)
            replay = self._forward[key] = Replay(run, ordinal=self.device, label=f"CNBlock {self.geometry} forward")
        _replayed(replay, replay.run, ptrs if key[1] else ptrs[:-1], stream)

    def _forward_run(self, ptrs: tuple, stream: int, *, eps: float) -> None:
        y1, saved, ws, x, out, b_dw, ln_w, ln_b, b2, gamma, *noise = ptrs
        t, h, a, z, stats, w1h, w2h, b1h = (saved + o for o in self.saved[0])
        self.ln(stream, x=y1, y=t, eps=eps, add=b_dw, gamma=ln_w, beta=ln_b, mean=stats, rstd=stats + self.rows * 4)
        self.fc1.run(a=t, b=w1h, d=h, bias=b1h, stream=stream, workspace=ws)
        self.act(stream, x=h, y=a)
        self.fc2.run(a=a, b=w2h, d=z, stream=stream, workspace=ws)
        self.scale.forward(stream, x=x, z=z, bias=b2, gamma=gamma, noise=noise[0] if noise else 0, out=out)

    def backward_tail(self, ptrs: tuple, stream: int) -> None:
        """Before the conv's backward: every launch of ours, replayed as one graph as `forward_tail`."""
        key = ptrs[-1] != 0
        replay = self._backward.get(key)
        if replay is None:
            replay = self._backward[key] = Replay(self._backward_run, ordinal=self.device,
                                                  label=f"CNBlock {self.geometry} backward")
        _replayed(replay, replay.run, ptrs if key else ptrs[:-1], stream)

    def _backward_run(self, ptrs: tuple, stream: int) -> None:
        dy, saved, scratch, y1, dy1, b_dw, ln_w, b2, gamma, dgamma, db2, dw2, db1, dw1, dln_w, dln_b, *noise = ptrs
        t, h, a, z, stats, w1h, w2h, _ = (saved + o for o in self.saved[0])
        dz, da, dh, p_scale, p_act, p_ln, ws = (scratch + o for o in self.scratch[0])
        self.scale.backward(stream, dy=dy, z=z, bias=b2, gamma=gamma, noise=noise[0] if noise else 0, dz=dz,
                            partials=p_scale, dgamma=dgamma, dbias=db2)
        self.fc2_dgrad.run(a=dz, b=w2h, d=da, stream=stream, workspace=ws)
        self.fc2_wgrad.run(a=dz, b=a, d=dw2, stream=stream, workspace=ws)
        self.act_bwd(stream, dy=da, pre=h, g=dh, partials=p_act, dbias=db1)
        self.fc1_wgrad.run(a=dh, b=t, d=dw1, stream=stream, workspace=ws)
        self.fc1_dgrad.run(a=dh, b=w1h, d=dz, stream=stream, workspace=ws)  # dt, where dz was
        self.ln_bwd(stream, dy=dz, x=y1, add=b_dw, mean=stats, rstd=stats + self.rows * 4, dx=dy1, partials=p_ln,
                    gamma=ln_w, dgamma=dln_w, dbeta=dln_b)


def _offsets(sizes: tuple) -> tuple[tuple[int, ...], int]:
    """Each part's offset (256-byte aligned: cuBLASLt's plans are made for that class) and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += _up(size)
    return tuple(offsets), max(total, 1)


class CNBlockFunction(torch.autograd.Function):
    """The block's forward and backward (see the module's docstring); made by `cnblock_training`."""

    @staticmethod
    def forward(ctx, x, w_dw, b_dw, ln_w, ln_b, w1, b1, w2, b2, gamma, launches, padding, eps, noise):
        L = launches
        dev = x.device
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        offsets, total = L.saved
        saved = torch.empty(total, dtype=torch.uint8, device=dev)
        base = saved.data_ptr()
        _, _, _, _, _, w1h, w2h, b1h = (base + o for o in offsets)
        w_dw16 = torch.empty_like(w_dw, dtype=torch.float16)
        x16 = x if x.dtype is torch.float16 else x.to(torch.float16)
        out = torch.empty_like(x, dtype=torch.float32)
        workspace = torch.empty(max(L.workspace, 1), dtype=torch.uint8, device=dev)  # held until queued: freed
        ws = workspace.data_ptr()  # early, its block could become y1's and the GEMMs' scratch would overwrite it
        with _lock:
            L.cast(stream, (w_dw.data_ptr(), w1.data_ptr(), w2.data_ptr(), b1.data_ptr()), (w_dw16.data_ptr(), w1h,
                                                                                            w2h, b1h))
        y1 = torch.convolution(x16, w_dw16, None, [1, 1], list(padding), [1, 1], False, [0, 0], x.shape[1])
        if not y1.is_contiguous(memory_format=torch.channels_last):  # rows of C, as the LayerNorm reads them
            y1 = y1.contiguous(memory_format=torch.channels_last)
        with _lock:
            L.forward_tail((y1.data_ptr(), base, ws, x.data_ptr(), out.data_ptr(), b_dw.data_ptr(), ln_w.data_ptr(),
                            ln_b.data_ptr(), b2.data_ptr(), gamma.data_ptr(), _ptr(noise)), stream, eps)
        del workspace
        # the buffer and noise as saved tensors too: freed with the graph's after backward, seen by saved-tensor
        # hooks (offloading, checkpointing), as torch's own saved activations are
        ctx.save_for_backward(x16, w_dw16, y1, b_dw, ln_w, b2, gamma, saved, noise)
        ctx.keep = (L, padding, x.dtype)
        return out

    @staticmethod
    @once_differentiable  # raw launches: a second-order gradient through them would be silently wrong
    def backward(ctx, dy):
        L, padding, x_dtype = ctx.keep
        x16, w_dw16, y1, b_dw, ln_w, b2, gamma, saved, noise = ctx.saved_tensors
        if saved.data_ptr() % 256:  # a saved-tensor hook gave it back elsewhere: the GEMM plans want 256 bytes
            saved = saved.clone()
        if y1.data_ptr() % 16 or not y1.is_contiguous(memory_format=torch.channels_last):
            y1 = y1.clone(memory_format=torch.channels_last)
        need = ctx.needs_input_grad
        dev = dy.device
        if dy.dtype is not torch.float32 or not dy.is_contiguous(memory_format=torch.channels_last) \
                or dy.data_ptr() % 32:  # the kernels read rows of float32 in 32-byte vectors
            dy = dy.to(torch.float32, memory_format=torch.channels_last, copy=True)
        stream = torch._C._cuda_getCurrentRawStream(dy.get_device())
        scratch = torch.empty(L.scratch[1], dtype=torch.uint8, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        dgamma, db2 = torch.empty(gamma.shape, **f32), torch.empty(b2.shape, **f32)
        dw1, db1 = torch.empty(L.hidden, L.c, **f32), torch.empty(L.hidden, **f32)
        dw2 = torch.empty(L.c, L.hidden, **f32)
        dln_w, dln_b = torch.empty(L.c, **f32), torch.empty(L.c, **f32)
        dy1 = torch.empty_like(y1)
        ptrs = (dy.data_ptr(), saved.data_ptr(), scratch.data_ptr(), y1.data_ptr(), dy1.data_ptr(), b_dw.data_ptr(),
                ln_w.data_ptr(), b2.data_ptr(), gamma.data_ptr(), dgamma.data_ptr(), db2.data_ptr(), dw2.data_ptr(),
                db1.data_ptr(), dw1.data_ptr(), dln_w.data_ptr(), dln_b.data_ptr(), _ptr(noise))
        with _lock:
            L.backward_tail(ptrs, stream)
        c = L.c
        dx_b, dw_dw, db_dw = torch.ops.aten.convolution_backward(
            dy1, x16, w_dw16, [c], [1, 1], list(padding), [1, 1], False, [0, 0], c, [need[0], need[1], need[2]])
        dx = None
        if need[0]:
            dx = torch.add(dy, dx_b) if x_dtype is torch.float32 else dx_b.add_(dy)
        grads = (dx, dw_dw, db_dw, dln_w, dln_b, dw1, db1, dw2, db2, dgamma)
        return (*(g if want else None for g, want in zip(grads, need)), None, None, None, None)
