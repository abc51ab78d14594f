"""LayerNorm on this library's kernels, and torchvision's ConvNeXt block in fewer passes over memory.

`convert` (both modes) points these modules' forwards here:
- `nn.LayerNorm` over the last dim, and torchvision's `LayerNorm2d` (over the channels of a channels-last
  map): a call with no gradient wanted, on CUDA, in float16 / bfloat16 / float32 with its parameters in the
  same dtype, outside autocast and torch.compile, whose rows are dense in memory, runs
  `fallback_kernels/layernorm.cu` (a row in a few threads' registers: read once, written once); any other
  call runs the module's own forward. torch's kernel runs a block a row, slow on narrow rows: 113 us for
  100352 rows of 96 float16 values (convnext_tiny's first stage at batch 32, H100), ours 13.
- torchvision's `CNBlock` with no gradient wanted (eval): the depthwise conv without its bias, then one
  kernel that adds the bias and normalises, fc1 on cuBLASLt with its bias, the activation in place, fc2
  with the layer scale folded into its weight and bias (made again when any of them changes) and the
  block's input read in its epilogue. torch adds the bias, normalises, scales and adds in four passes over
  the map, ours in one, and launches half the kernels.
- `CNBlock` where a gradient is wanted under float16 autocast: one autograd node for the whole block
  (`_cnblock_train`).
- `CNBlock` where a gradient is wanted outside autocast and a CUDA graph is being captured (`capture`,
  `make_graphed_callables`): torch's forward with the LayerNorm on our autograd node
  (`LayerNormFunction`: forward and backward kernels, the parameters' gradients summed in a fixed order),
  its output in the conv's dtype under autocast (torch's LayerNorm writes float32, which fc1 casts back:
  two casts and float32 traffic a block, more device time in convnext_tiny's AMP step than the LayerNorm's
  own).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from fallback_kernels.layernorm import LayerNormBackward, LayerNormRows, layout
from fallback_kernels.types import ITEMSIZE
from gpu_launch.replay import Replay

from ..errors import SpecError
from ._chain import _ptr_or_0 as _ptr, _replayed, _up, hooked
from ._cnblock_train import cnblock_training

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_MAX_LAUNCHES = 256  # geometries kept (a model has a few; a loop over many shapes starts the memo again)
_launches: dict[tuple, tuple | None] = {}  # geometry -> (forward, backward or None), None: not ours
_lock = threading.Lock()  # a launch patches its argument slots in place
_UNSEEN = object()  # a memo's miss (None is kept: a geometry our kernels do not take)


def no_grad_cuda_call(x: torch.Tensor, params) -> bool:
    """Whether a call may run our kernels: CUDA, no gradient wanted, no autocast (torch's LayerNorm
    runs in float32 there), no torch.compile or torch.func transform tracing it."""
    if not x.is_cuda or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if torch.is_autocast_enabled("cuda"):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)))


def rows_supported(channels: int, dtype: torch.dtype) -> bool:
    """Whether rows of `channels` values of `dtype` fit the kernel (16-byte aligned: fresh allocations are)."""
    name = _DTYPES.get(dtype)
    return name is not None and layout(channels, name, align=16) is not None


def layer_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
                    add: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.layer_norm(x + add, (C,), weight, bias, eps) over x's last dim C, in a new tensor like x; None where
    the kernel does not take the call (x not contiguous, another dtype, a parameter of another dtype or
    device, rows too wide). No check of gradients or autocast: the caller's (`no_grad_cuda_call`)."""
    found = _geometry(x, (weight, bias, add), backward=False)
    if found is None:
        return None
    launch, _ = found
    y = torch.empty_like(x)
    stream = torch._C._cuda_getCurrentRawStream(x.get_device())
    with _lock:
        launch(stream, x=x.data_ptr(), y=y.data_ptr(), eps=float(eps), add=_ptr(add), gamma=_ptr(weight),
               beta=_ptr(bias))
    return y


def _geometry(x: torch.Tensor, params: tuple, *, backward: bool) -> tuple | None:
    """(LayerNormRows, LayerNormBackward or None) for x's rows and these per-channel operands (all of x's
    dtype, or all float32 under a 16-bit x), or None where the kernels do not take them."""
    c = x.shape[-1] if x.dim() else 0
    dtype = _DTYPES.get(x.dtype)
    if dtype is None or c == 0 or x.numel() == 0 or not x.is_contiguous():
        return None
    given = [t for t in params if t is not None]
    pdtype = given[0].dtype if given else x.dtype
    if pdtype is not x.dtype and (pdtype is not torch.float32 or x.dtype is torch.float32):
        return None
    for t in given:
        if t.dtype is not pdtype or t.device != x.device or t.numel() != c or not t.is_contiguous():
            return None
    ratio = ITEMSIZE[_DTYPES[pdtype]] // ITEMSIZE[dtype]  # float32 parameters' vectors span twice the bytes
    align = min(_alignment(x), _alignment(*given, cap=16 * ratio) // ratio)
    key = (x.numel() // c, c, dtype, _DTYPES[pdtype], x.get_device(), align, backward)
    found = _launches.get(key, _UNSEEN)
    if found is _UNSEEN:
        found = None
        if layout(c, dtype, align=align, backward=backward) is not None:
            rows, _, _, pname, device, _, _ = key
            fwd = LayerNormRows(rows, c, dtype, device, align=align, param_dtype=pname)
            bwd = LayerNormBackward(rows, c, dtype, device, align=align, param_dtype=pname) if backward else None
            found = (fwd, bwd)
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = found
    return found


def _alignment(*tensors: torch.Tensor | None, cap: int = 16) -> int:
    """The largest power of two up to `cap` that every tensor's address is a multiple of (a view can start
    anywhere)."""
    bits = cap
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return bits & -bits


class LayerNormFunction(torch.autograd.Function):
    """F.layer_norm over the last dim on our kernels, forward and backward, its output in x's dtype (float32
    parameters with a 16-bit x: autocast's training). Made by `layer_norm_autograd`, which checks the call."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, launches):
        fwd, _ = launches
        rows = x.numel() // x.shape[-1]
        y = torch.empty_like(x)
        stats = torch.empty(2, rows, dtype=torch.float32, device=x.device)
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        with _lock:
            fwd(stream, x=x.data_ptr(), y=y.data_ptr(), eps=float(eps), gamma=_ptr(weight), beta=_ptr(bias),
                mean=stats.data_ptr(), rstd=stats[1].data_ptr())
        ctx.save_for_backward(x, weight, stats)
        ctx.launches, ctx.bias_like = launches, bias
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        bwd = ctx.launches[1]
        dy = dy.contiguous()
        if dy.data_ptr() % 16:  # a view's gradient can start anywhere: the backward loads 16-byte vectors
            dy = dy.clone()
        dx = torch.empty_like(x)
        want_w, want_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dgamma = torch.empty_like(weight) if want_w else None
        dbeta = torch.empty_like(ctx.bias_like) if want_b else None
        partials = torch.empty(bwd.partials_bytes, dtype=torch.uint8, device=x.device)
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        with _lock:
            bwd(stream, dy=dy.data_ptr(), x=x.data_ptr(), mean=stats.data_ptr(), rstd=stats[1].data_ptr(),
                dx=dx.data_ptr(), partials=partials.data_ptr(), gamma=_ptr(weight), dgamma=_ptr(dgamma),
                dbeta=_ptr(dbeta))
        return dx, dgamma, dbeta, None, None


def layer_norm_autograd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor | None:
    """LayerNormFunction's output where our kernels take the call, else None. Its output is x's dtype: under
    autocast torch's would be float32 (the caller decides whether that matters)."""
    if not x.is_cuda or (x.dtype is torch.float32 and weight is not None and weight.dtype is not torch.float32):
        return None
    x = x if x.is_contiguous() else None
    launches = None if x is None else _geometry(x, (weight, bias), backward=True)
    if launches is None or launches[1] is None:
        return None
    return LayerNormFunction.apply(x, weight, bias, eps, launches)



# -- modules: nn.LayerNorm, torchvision's LayerNorm2d -------------------------------------------------------

def layer_norm_kind(module: nn.Module) -> str | None:
    """"LayerNorm" (torch's, over one last dim), "LayerNorm2d" (torchvision's ConvNeXt), or None."""
    if "forward" in vars(module) or not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1:
        return None
    if type(module) is nn.LayerNorm:
        return "LayerNorm"
    if type(module).__name__ == "LayerNorm2d" and type(module).__module__.startswith("torchvision."):
        return "LayerNorm2d"
    return None


def layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm.forward on our kernel where the call allows, else the module's own forward."""
    y = None
    if no_grad_cuda_call(x, (self.weight, self.bias)) and x.dim() and x.shape[-1] == self.normalized_shape[0]:
        y = layer_norm_rows(x, self.weight, self.bias, self.eps)
    return type(self).forward(self, x) if y is None else y


def layer_norm_2d_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """torchvision's LayerNorm2d (permute to NHWC, LayerNorm over C, permute back) on our kernel where the
    map is channels-last in memory (its NHWC view then dense), else the module's own forward."""
    y = None
    if x.dim() == 4 and x.shape[1] == self.normalized_shape[0] and no_grad_cuda_call(x, (self.weight, self.bias)):
        y = layer_norm_rows(x.permute(0, 2, 3, 1), self.weight, self.bias, self.eps)
    return type(self).forward(self, x) if y is None else y.permute(0, 3, 1, 2)


# -- torchvision's CNBlock ------------------------------------------------------------------------------------

def why_not_convnext_block(block: nn.Module) -> str | None:
    """Why `block` is not a torchvision CNBlock this module runs (checked once, at convert), or None."""
    from ._activations import activation_of as _activation_of
    from ._conv import Conv2d

    seq = getattr(block, "block", None)
    scale = getattr(block, "layer_scale", None)
    if type(seq) is not nn.Sequential or len(seq) != 7 or not isinstance(scale, torch.Tensor) \
            or not hasattr(block, "stochastic_depth"):
        return "not torchvision's CNBlock layout"
    conv, first, norm, fc1, act, fc2, last = seq
    c = scale.shape[0]
    checks = (
        (isinstance(conv, Conv2d) and type(conv).forward is Conv2d.forward and "forward" not in vars(conv),
         "the depthwise conv is not converted"),
        (conv.groups == conv.in_channels == conv.out_channels == c and conv.padding_mode == "zeros"
         and conv.activation.is_identity, "the conv is not a plain depthwise conv of the block's channels"),
        (_keeps_shape(conv), "the conv changes the map's size (the block adds its input to its output)"),
        (list(getattr(first, "dims", ())) == [0, 2, 3, 1] and list(getattr(last, "dims", ())) == [0, 3, 1, 2],
         "the permutes are not NCHW -> NHWC -> NCHW"),
        (_plain_layer_norm(norm) and tuple(norm.normalized_shape) == (c,), "no LayerNorm over C"),
        (type(fc1) is nn.Linear and type(fc2) is nn.Linear and fc1.in_features == c and fc2.out_features == c
         and fc2.in_features == fc1.out_features, "the MLP is not two nn.Linear of the block's width"),
        (_activation_of(act) is not None, f"{type(act).__name__} is not an activation of torch's"),
        (tuple(scale.shape) == (c, 1, 1), "the layer scale is not (C, 1, 1)"),
    )
    return next((why for ok, why in checks if not ok), None)


def _keeps_shape(conv: nn.Module) -> bool:
    """Stride 1, dilation 1, odd kernels padded by half: the output has the input's size."""
    return all(s == 1 for s in conv.stride) and all(d == 1 for d in conv.dilation) \
        and not isinstance(conv.padding, str) \
        and all(k % 2 == 1 and p == k // 2 for k, p in zip(conv.kernel_size, conv.padding))


def _plain_layer_norm(module: nn.Module) -> bool:
    """torch's nn.LayerNorm with its own forward or ours (convert points it here too)."""
    forward = vars(module).get("forward")
    return type(module) is nn.LayerNorm and (forward is None or getattr(forward, "fn", None) is layer_norm_forward)


def convnext_block_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CNBlock.forward in fewer passes where no gradient is wanted; else, under float16 autocast, one autograd
    node; else, while a CUDA graph is captured, torch's forward with its LayerNorm on our autograd node; else
    its own (see the module's docstring)."""
    out = _convnext_block(self, x)
    if out is None:
        out = cnblock_training(self, x)
    if out is None:
        out = _convnext_block_training(self, x)
    return type(self).forward(self, x) if out is None else out


def _convnext_block_training(block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CNBlock.forward as torch writes it, its LayerNorm on our kernels (forward and backward), while a CUDA
    graph is being captured: under autocast its output stays in the conv's 16-bit dtype, which fc1 would cast
    it to (torch's LayerNorm writes float32, and the casts both ways cost a convnext_tiny training step more
    than the LayerNorm itself). Not in eager steps: there the Python node's host time (~100 us a block more than
    torch's three C++ nodes) outweighed the device time it saved on a host-bound step (H100, AMP, batch 64:
    31.5 against 29.4 ms a step for 23.4 against 27.3 ms of kernels); a replayed graph has no host time."""
    seq = block._modules["block"]
    conv, first, norm, fc1, act, fc2, last = seq
    if not x.is_cuda or not torch.cuda.is_current_stream_capturing() or x.dim() != 4 \
            or not x.is_contiguous(memory_format=torch.channels_last) or torch.compiler.is_compiling() \
            or torch._C._are_functorch_transforms_active() or hooked((seq, *seq)):
        return None
    y = conv(x).permute(0, 2, 3, 1)
    t = layer_norm_autograd(y, norm.weight, norm.bias, norm.eps) if not _autocast_mismatch(y) else None
    t = norm(y) if t is None else t
    result = block.layer_scale * fc2(act(fc1(t))).permute(0, 3, 1, 2)
    result = block.stochastic_depth(result)
    result += x
    return result


def _autocast_mismatch(y: torch.Tensor) -> bool:
    """Whether autocast is on with another dtype than y's (our LayerNorm would write y's dtype, not fc1's)."""
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") is not y.dtype


def _convnext_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    # parts read from the modules' dicts: nn.Module.__getattr__ costs ~0.5 us a read
    seq = block._modules["block"]
    parts = seq._modules
    conv, norm, fc1, act, fc2 = parts["0"], parts["2"], parts["3"], parts["4"], parts["5"]
    if block.training or block._modules["stochastic_depth"].training or x.dim() != 4 or not x.is_cuda:
        return None
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() \
            or torch.is_autocast_enabled("cuda") or not torch._C._get_cudnn_enabled():
        return None
    # .get: a parametrization added after convert moves a weight out of _parameters (then torch's forward)
    p = (conv._parameters.get("bias"), norm._parameters.get("weight"), norm._parameters.get("bias"),
         fc1._parameters.get("weight"), fc1._parameters.get("bias"), conv._parameters.get("weight"),
         fc2._parameters.get("weight"), fc2._parameters.get("bias"), block._parameters.get("layer_scale"))
    dtype, device = x.dtype, x.get_device()
    if any(t is None or t.dtype is not dtype or t.get_device() != device or not t.is_contiguous() for t in p):
        return None  # every operand present, dense, of x's dtype and device: the launches read raw pointers
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in p)):
        return None
    if not x.is_contiguous(memory_format=torch.channels_last) \
            or hooked((seq, *seq, block._modules["stochastic_depth"])):
        return None
    launches = _block_launches(x, p, fc1, act)
    scaled = None if launches is None else _scaled_fc2(block, fc2)
    if scaled is None:
        return None
    y = conv._conv_forward(x, conv.weight, None)  # its bias goes into the LayerNorm's pass
    if y.shape != x.shape or not y.is_contiguous(memory_format=torch.channels_last):
        return None  # not the rows the launches were made for (a conv that fell back to another layout)
    return launches(x, y, p[:5], scaled, norm.eps)


class _BlockLaunches:
    """A CNBlock geometry's launches after its depthwise conv, on torch's current stream: the LayerNorm pass
    adding the conv's bias, fc1 on cuBLASLt with its bias, the activation in place, fc2 (the layer scale
    folded in) with its bias and the block's input read in its epilogue; from a stream's second call the four
    replay as one re-pointed CUDA graph (`Replay`: ~30 us of host time a block less). One thread at a time."""

    def __init__(self, rows: int, c: int, hidden: int, dtype: str, device: int, act, tf32: bool,
                 align: tuple[int, int]):
        from fallback_kernels import cublaslt
        from fallback_kernels.gemm_act import FlatActivation

        self.ln = LayerNormRows(rows, c, dtype, device, align=16)
        self.act = FlatActivation(rows * hidden, dtype, device, act)
        geometry = functools.partial(cublaslt.Geometry, device, dtype, rows, epilogue="BIAS", tf32=tf32)
        self.fc1 = cublaslt.lt_gemm(geometry(hidden, c, ("row", c), ("col", c), hidden, align=(256, align[0], 256)))
        self.fc2 = cublaslt.lt_gemm(geometry(c, hidden, ("row", hidden), ("col", hidden), c,
                                             align=(256, 256, align[1])))
        self.t_bytes = _up(rows * c * ITEMSIZE[dtype])
        self.h_bytes = _up(rows * hidden * ITEMSIZE[dtype])
        self.scratch = self.t_bytes + self.h_bytes + max(self.fc1.workspace, self.fc2.workspace)
        self.device, self.geometry = device, (rows, c, hidden, dtype)
        self.replays: dict[float, Replay] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor, p: tuple, scaled: tuple, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)  # channels-last: rows of C, as fc2 writes them
        scratch = torch.empty(self.scratch, dtype=torch.uint8, device=x.device)
        ptrs = (y.data_ptr(), x.data_ptr(), out.data_ptr(), scratch.data_ptr(), *(_ptr(t) for t in p),
                scaled[0].data_ptr(), _ptr(scaled[1]))
        stream = torch._C._cuda_getCurrentRawStream(x.get_device())
        with _lock:
            replay = self.replays.get(eps)
            if replay is None:  # eps is a value in the LayerNorm's arguments, not a pointer: a graph per eps
                replay = self.replays[eps] = Replay(functools.partial(self._run, eps=eps), ordinal=self.device,
                                                    label=f"CNBlock {self.geometry}")
            _replayed(replay, replay.run, ptrs, stream)
        return out

    def _run(self, ptrs: tuple, stream: int, *, eps: float) -> None:
        """The launches, replayed as one re-pointed graph from a stream's second call (`Replay`)."""
        y, x, out, t, conv_bias, ln_w, ln_b, w1, b1, w2s, b2s = ptrs
        h, ws = t + self.t_bytes, t + self.t_bytes + self.h_bytes
        self.ln(stream, x=y, y=t, eps=eps, add=conv_bias, gamma=ln_w, beta=ln_b)
        self.fc1.run(a=t, b=w1, d=h, bias=b1, stream=stream, workspace=ws)
        self.act(stream, x=h, y=h)
        self.fc2.run(a=h, b=w2s, d=out, c=x, bias=b2s, stream=stream, workspace=ws)


_blocks: dict[tuple, _BlockLaunches | None] = {}


def _block_launches(x: torch.Tensor, p: tuple, fc1: nn.Linear, act: nn.Module):
    """The prepared launches of this call's geometry, or None where they cannot serve it: a row too wide for the
    LayerNorm kernel, operands not 16-byte aligned, a bias missing, cuBLASLt absent or refusing, another device
    current (cuBLASLt launches on the current one), or an activation without a flat pass of ours."""
    from fallback_kernels import cublaslt

    from ._activations import activation_of as _activation_of

    n, c, hh, ww = x.shape
    hidden = fc1.out_features
    if torch.cuda.current_device() != x.get_device():  # cuBLASLt's handle and plans belong to the current one
        return None
    tf32 = x.dtype is torch.float32 and torch._C._get_cublas_allow_tf32()
    # cuBLASLt plans for the alignment class of each operand: fc1's weight and the residual (the block's input)
    # are the caller's, the rest fresh allocations (256 bytes)
    align = (cublaslt.alignment(p[3].data_ptr()), min(256, cublaslt.alignment(x.data_ptr())))
    key = (n * hh * ww, c, hidden, x.dtype, x.get_device(), _activation_of(act), tf32, align,
           _alignment(x, *p) >= 16)
    launches = _blocks.get(key, _UNSEEN)
    if launches is _UNSEEN:
        launches = None
        if key[-1] and rows_supported(c, x.dtype) and cublaslt.available():
            try:
                launches = _BlockLaunches(key[0], c, hidden, _DTYPES[x.dtype], key[4], key[5], tf32, align)
            except (cublaslt.CublasLtError, SpecError, ValueError):
                launches = None
        if len(_blocks) >= _MAX_LAUNCHES:
            _blocks.clear()
        _blocks[key] = launches
    return launches


def _scaled_fc2(block: nn.Module, fc2: nn.Linear) -> tuple | None:
    """(weight, bias) of layer_scale * fc2(.), made again when the scale or fc2's parameters change (their
    version counters: an update through `.data` is not seen); None where they changed inside a CUDA-graph
    capture (made there, they would hold values only on replay) or are inference tensors (no version counter:
    torch's forward then). A graph captured through this path keeps the pair of its capture, alive and as it
    was: capture again after changing the parameters."""
    parts = (block.layer_scale, fc2.weight, fc2.bias)
    if any(t.is_inference() for t in parts):
        return None
    versions = tuple((t.data_ptr(), t._version) for t in parts)
    held = block.__dict__.get("_cudnn_graphs_scaled_fc2")
    capturing = torch.cuda.is_current_stream_capturing()
    if held is None or held[0] != versions:
        if capturing:
            return None
        with torch.no_grad():
            s = parts[0].detach().reshape(-1).double()
            weight = (fc2.weight.double() * s[:, None]).to(fc2.weight.dtype).contiguous()
            bias = (fc2.bias.double() * s).to(fc2.bias.dtype)
        held = block.__dict__["_cudnn_graphs_scaled_fc2"] = (versions, (weight, bias))
    if capturing:  # the graph reads these addresses on every replay: never freed while the block lives
        block.__dict__.setdefault("_cudnn_graphs_captured_fc2", []).append(held[1])
    return held[1]
