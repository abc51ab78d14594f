"""Named networks' conv layers as specs, for `cudnn-graphs warmup --preset NAME`.

Built from each network's layer list (torchvision's ResNets, v1.5: the stride sits on the 3x3 conv),
with batch norm folded into a conv bias, which is how the epilogues appear in a fused network:
  forward   conv + bias + relu; the block's last conv adds the shortcut first (residual) then relu;
            the projection shortcut is conv + bias alone.
  dgrad     every layer but the stem (whose input needs no gradient), with relu' of the activation
            that fed it: relu' is linear in the gradient, so it distributes over the shortcut's sum.
  wgrad     every layer, with the bias gradient.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from .errors import SpecError
from .spec import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec


class Layer(NamedTuple):
    """One conv of a network: input (C, H, W), K filters of R x R, and its epilogue."""

    name: str
    c: int
    hw: int
    k: int
    r: int
    stride: int
    residual: bool = False  # the block's last conv: the shortcut is added before the relu
    relu: bool = True
    input_from_relu: bool = True  # dgrad carries relu' of the activation that fed this layer


# name -> (block kind, blocks per stage)
_RESNETS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}
PRESETS = tuple(_RESNETS)
_WIDTHS = (64, 128, 256, 512)


def resnet_layers(name: str, *, image: int = 224) -> list[Layer]:
    """Every conv of a torchvision ResNet in forward order (repeats included)."""
    kind, blocks = _RESNETS[name]
    hw = image // 2
    layers = [Layer("conv1", 3, image, 64, 7, 2, input_from_relu=False)]
    hw //= 2  # the 3x3/2 max pool after the stem
    c = 64
    for stage, (width, count) in enumerate(zip(_WIDTHS, blocks), start=1):
        for block in range(count):
            stride = 2 if stage > 1 and block == 0 else 1
            block_layers, c_out = _block(kind, f"layer{stage}.{block}", c, hw, width, stride)
            layers += block_layers
            c, hw = c_out, hw // stride
    return layers


def _block(kind: str, name: str, c: int, hw: int, width: int, stride: int) -> tuple[list[Layer], int]:
    out_hw = hw // stride
    if kind == "basic":
        c_out = width
        convs = [Layer(f"{name}.conv1", c, hw, width, 3, stride),
                 Layer(f"{name}.conv2", width, out_hw, width, 3, 1, residual=True)]
    else:
        c_out = 4 * width
        convs = [Layer(f"{name}.conv1", c, hw, width, 1, 1),
                 Layer(f"{name}.conv2", width, hw, width, 3, stride),
                 Layer(f"{name}.conv3", width, out_hw, c_out, 1, 1, residual=True)]
    if stride != 1 or c != c_out:
        convs.append(Layer(f"{name}.downsample", c, hw, c_out, 1, stride, relu=False))
    return convs, c_out


def layer_specs(layer: Layer, *, batch: int, dtype: str, layout: str) -> Iterator:
    """The forward, dgrad (unless the input needs no gradient) and wgrad specs of one layer."""
    x = (batch, layer.c, layer.hw, layer.hw)
    w = (layer.k, layer.c, layer.r, layer.r)
    common = dict(padding=layer.r // 2, stride=layer.stride, dtype=dtype, layout=layout)
    fwd = ConvFwdSpec(x, w, bias=True, residual=layer.residual, activation="relu" if layer.relu else None, **common)
    yield fwd
    if layer.input_from_relu:
        yield ConvBwdDataSpec(fwd.y_shape, w, x, activation_backward="relu", **common)
    yield ConvBwdFilterSpec(x, fwd.y_shape, w, bias_grad=True, **common)


def preset_specs(name: str, *, batch: int = 32, dtype: str = "float16", layout: str = "channels_last") -> list:
    """The distinct specs of preset `name`, in the order a training step first plans them."""
    if name not in _RESNETS:
        raise SpecError("preset", name, f"unknown preset; expected one of {list(PRESETS)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SpecError("batch", batch, "expected an int >= 1")
    specs: dict = {}
    for layer in resnet_layers(name):
        for spec in layer_specs(layer, batch=batch, dtype=dtype, layout=layout):
            specs.setdefault(spec, None)
    return list(specs)
