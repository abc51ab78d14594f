"""`MLP`: Linear layers with an activation between them and none after the last (a transformer block's
feed-forward), with its backward fused the way Transformer Engine's MLP does it, on cuBLASLt epilogues.

    mlp = MLP([4096, 16384, 4096], activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    y = mlp(x)          # x [..., 4096]

Forward, each hidden layer is one GEMM whose epilogue adds the bias, applies the activation and saves the
pre-activation its derivative needs; the last layer's epilogue adds its bias. Backward, from the last layer down: its wgrad GEMM also sums its bias gradient (BGRADB, free on an
H100), and each dgrad GEMM that produces a hidden layer's gradient applies that layer's activation
derivative in its epilogue (DGELU), then one column sum gives that layer's bias gradient (DGELU_BGRAD
does both but was 0.9 ms slower per 8192 x 16384 GEMM on an H100): four GEMMs and one reduction for two
layers. cuBLASLt's GELU is the tanh approximation, so only `activation="gelu_tanh"` takes this path;
`"gelu"` (exact, nn.GELU's default), relu and the others run as a chain of `linear_act` layers (GEMM + one
fused elementwise pass each way). Results are deterministic run to run (one algorithm per geometry,
fixed-order reductions). Parameters and initialisation are nn.Linear's, in an nn.ModuleList `layers`
(`layers.0.weight`, ...).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from fallback_kernels import cublaslt
from gpu_launch.activations import Activation, as_activation
from gpu_launch.errors import SpecError

from ._fallback import cpu_once
from ._linear_act import linear_act

__all__ = ["MLP", "mlp"]

# Activations cuBLASLt's epilogues compute exactly and whose aux is the pre-activation. Not relu yet: DRELU
# reads a bit mask, RELU_AUX_BIAS's disagreed with y's sign on unaligned shapes (gemm_act.LT_FORWARD), and a
# mask read back from y costs a pass; relu MLPs run as the linear_act chain (one RELU_BIAS GEMM a layer).
FUSED = {"gelu_tanh": "GELU"}
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _run(device: int, dtype: str, d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, a_col: bool = False,
         b_col: bool = False, epilogue: str = "DEFAULT", bias: torch.Tensor | None = None,
         aux: torch.Tensor | None = None, aux_ld: int = 0) -> None:
    """d = a @ b with an epilogue; a, b are row-major tensors or (a_col / b_col) transposed views' bases."""
    m, n = d.shape
    k = a.shape[0] if a_col else a.shape[1]
    geometry = cublaslt.Geometry(
        device, dtype, m, n, k, ("col", m) if a_col else ("row", k), ("col", k) if b_col else ("row", n), n,
        epilogue, aux_ld, dtype == "float32" and torch.backends.cuda.matmul.allow_tf32,
        (cublaslt.alignment(a.data_ptr()), cublaslt.alignment(b.data_ptr()), cublaslt.alignment(d.data_ptr())))
    plan = cublaslt.lt_gemm(geometry)
    ws = torch.empty(plan.workspace, dtype=torch.uint8, device=d.device) if plan.workspace else None
    plan.run(a=a.data_ptr(), b=b.data_ptr(), d=d.data_ptr(), stream=torch._C._cuda_getCurrentRawStream(device),
             bias=bias.data_ptr() if bias is not None else 0, aux=aux.data_ptr() if aux is not None else 0,
             workspace=ws.data_ptr() if ws is not None else 0)


class _FusedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, family, *params):
        weights, biases = params[0::2], params[1::2]
        has_bias = biases[0] is not None
        dtype, device = DTYPES[x.dtype], x.device.index
        h = x.reshape(-1, x.shape[-1]).contiguous()
        rows = h.shape[0]
        saved = [h]
        with torch.cuda.device(x.device):
            for i, (w, b) in enumerate(zip(weights, biases)):
                out = torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)
                last = i == len(weights) - 1
                if last:
                    epilogue, aux = ("BIAS" if has_bias else "DEFAULT"), None
                else:
                    epilogue = family + "_AUX" + ("_BIAS" if has_bias else "")
                    aux = torch.empty_like(out)  # the pre-activation, [rows, width] like out
                _run(device, dtype, out, h, w, b_col=True, epilogue=epilogue, bias=b, aux=aux,
                     aux_ld=w.shape[0] if aux is not None else 0)
                if not last:
                    saved += [out, aux]
                h = out
        ctx.family, ctx.x_shape, ctx.has_bias = family, x.shape, has_bias
        ctx.save_for_backward(*saved, *weights)
        return h.view(*x.shape[:-1], weights[-1].shape[0])

    @staticmethod
    def backward(ctx, gy):
        saved = ctx.saved_tensors
        layers = (len(saved) + 1) // 3  # x, (h, aux) per hidden layer, then the weights
        inputs, auxes = [saved[0], *saved[1:2 * layers - 1:2]], saved[2:2 * layers - 1:2]
        weights = saved[2 * layers - 1:]
        need = ctx.needs_input_grad
        family, has_bias = ctx.family, ctx.has_bias
        x = inputs[0]
        dtype, device = DTYPES[x.dtype], x.device.index
        g = gy.reshape(-1, gy.shape[-1]).contiguous()
        rows = g.shape[0]
        grads: list[Any] = [None] * (2 * layers)
        with torch.cuda.device(x.device):
            for i in reversed(range(layers)):
                w, inp = weights[i], inputs[i]
                last = i == layers - 1
                need_w, need_b = need[2 + 2 * i], has_bias and need[3 + 2 * i]
                if need_w or (last and need_b):  # dW = g.T @ inp; the last layer's dbias in the epilogue
                    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
                    db = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if last and need_b else None
                    _run(device, dtype, dw, g, inp, a_col=True, epilogue="BGRADB" if db is not None else "DEFAULT",
                         bias=db)
                    grads[2 * i], grads[2 * i + 1] = (dw if need_w else None), db if last else grads[2 * i + 1]
                if i == 0:
                    if need[0]:
                        dx = torch.empty(rows, w.shape[1], dtype=x.dtype, device=x.device)
                        _run(device, dtype, dx, g, w)
                        grads_x = dx.view(ctx.x_shape)
                    else:
                        grads_x = None
                    break
                # the hidden layer below: dpre = (g @ W) * act'(pre) in the dgrad's epilogue. Its dbias is a
                # separate column sum: DGELU_BGRAD took 2.40 ms where DGELU took 1.50 and a plain dgrad 1.41
                # (bf16, 8192 x 4096 -> 16384, H100: tools/probe_lt_epilogues.py); torch's sum is fixed-order.
                width = w.shape[1]
                dpre = torch.empty(rows, width, dtype=x.dtype, device=x.device)
                _run(device, dtype, dpre, g, w, epilogue=f"D{family}", aux=auxes[i - 1], aux_ld=width)
                if has_bias and need[3 + 2 * (i - 1)]:
                    grads[2 * (i - 1) + 1] = dpre.sum(0, dtype=torch.float32).to(x.dtype)
                g = dpre
        return (grads_x, None, *grads)


def mlp(input: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], *,
        activation: Any = "gelu_tanh") -> torch.Tensor:
    """Linear layers (nn.Linear's [out, in] weights) with `activation` between them, none after the last."""
    act = as_activation("activation", activation)
    weights, biases = list(weights), list(biases)
    if not weights or len(weights) != len(biases):
        raise SpecError("weights", len(weights), f"expected one or more layers, with as many biases ({len(biases)})")
    if input.is_cuda and torch.is_autocast_enabled("cuda"):  # as F.linear under autocast
        cast = torch.get_autocast_dtype("cuda")
        input, weights = input.to(cast), [w.to(cast) for w in weights]
        biases = [b.to(cast) if b is not None else None for b in biases]
    if _fusable(input, weights, biases, act):
        params = [p for pair in zip(weights, biases) for p in pair]
        return _FusedMLP.apply(input, FUSED[act.name], *params)
    if not input.is_cuda:  # CPU tensors: torch's own ops, as nn.Linear would run them
        cpu_once("mlp", input, *weights)
        return _torch_layers(input, weights, biases, act)
    h = input
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = linear_act(h, w, b, activation=act if i < len(weights) - 1 else "identity")
    return h


def _torch_layers(h: torch.Tensor, weights: list, biases: list, act: Activation) -> torch.Tensor:
    from ._activations import torch_activation

    for i, (w, b) in enumerate(zip(weights, biases)):
        h = nn.functional.linear(h, w, b)
        if i < len(weights) - 1:
            h = torch_activation(act.name, act.param)(h)
    return h


def _fusable(x: torch.Tensor, weights: list, biases: list, act: Activation) -> bool:
    """The fused path: cuBLASLt, an activation its epilogues compute, one CUDA dtype, sizes it addresses."""
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    if act.name not in FUSED or len(weights) < 2 or not cublaslt.available():
        return False
    if (biases[0] is None) != all(b is None for b in biases):
        return False
    if any(not t.is_cuda or t.dtype != x.dtype or t.device != x.device for t in tensors) or x.dtype not in DTYPES:
        return False
    if x.numel() == 0 or any(not w.is_contiguous() or w.dim() != 2 for w in weights):
        return False
    widths = [x.shape[-1]] + [w.shape[0] for w in weights]
    chained = all(w.shape[1] == widths[i] for i, w in enumerate(weights))
    aligned = all(n % 8 == 0 for n in widths)  # 16-byte rows for every operand, aux ld a multiple of 8
    return chained and aligned and all(b is None or b.is_contiguous() for b in biases)


class MLP(nn.Module):
    """Linear layers with `activation` between them (none after the last): `sizes` = [in, hidden..., out]."""

    def __init__(self, sizes: Sequence[int], *, activation: Any = "gelu_tanh", bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2 or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise SpecError("sizes", sizes, "expected [in_features, ..., out_features], positive ints, at least 2")
        self.sizes = sizes
        self.activation: Activation = as_activation("activation", activation)
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=bias, device=device, dtype=dtype)
                                    for i, o in zip(sizes, sizes[1:]))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mlp(input, [layer.weight for layer in self.layers], [layer.bias for layer in self.layers],
                   activation=self.activation)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, activation={self.activation}"


def reference(input: torch.Tensor, module: MLP) -> torch.Tensor:
    """The same MLP in torch ops (for tests and benchmarks)."""
    return _torch_layers(input, [layer.weight for layer in module.layers], [layer.bias for layer in module.layers],
                         module.activation)
