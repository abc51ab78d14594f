"""CPU: `convert` points nn.LayerNorm, torchvision's LayerNorm2d and CNBlock at the LayerNorm kernel's paths,
says so in its report, keeps modules and state_dict keys, and computes what the modules compute wherever
the kernel cannot run (here: CPU tensors). The kernel's row layout, compile and launch constants."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._layernorm import _alignment, layer_norm_kind, why_not_convnext_block  # noqa: E402
from fallback_kernels import compile as kc  # noqa: E402
from fallback_kernels import layernorm  # noqa: E402


class Permute(nn.Module):
    """torchvision.ops.misc.Permute, as its code reads."""

    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class LayerNorm2d(nn.LayerNorm):
    """torchvision.models.convnext.LayerNorm2d, as its code reads."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """torchvision.models.convnext.CNBlock, as its code reads (stochastic depth: identity in eval)."""

    def __init__(self, dim, layer_scale=1e-6):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True), Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim, bias=True), nn.GELU(),
            nn.Linear(4 * dim, dim, bias=True), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = nn.Identity()

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result = self.stochastic_depth(result)
        result += input
        return result


for _cls in (LayerNorm2d, CNBlock):  # recognised as torchvision's: by class name and module
    _cls.__module__ = "torchvision.models.convnext"


def tiny_convnext(dim=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, dim, 4, stride=4), LayerNorm2d(dim, eps=1e-6), CNBlock(dim, 0.5),
                          CNBlock(dim, 0.3), LayerNorm2d(dim, eps=1e-6), nn.Conv2d(dim, 2 * dim, 2, stride=2),
                          nn.Flatten(2), nn.LayerNorm(4, eps=1e-5))
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    return model


def test_convert_finds_the_layernorms_and_convnext_blocks_and_keeps_the_state_dict():
    torch_model = tiny_convnext().eval()
    model = cgt.convert(copy.deepcopy(torch_model), inference=True)
    report = model.cudnn_graphs_report
    assert report.convnext_blocks == ["2", "3"]
    assert report.layer_norms == ["1", "2.block.2", "3.block.2", "4", "7"]
    assert "2 ConvNeXt blocks" in str(report) and "5 LayerNorm" in str(report) and report.unfused_convnext == []
    assert list(model.state_dict()) == list(torch_model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(model(x), torch_model(x))  # CPU: every module's own forward


def test_training_conversion_takes_them_too_and_gradients_flow_through_torchs_forward():
    torch_model = tiny_convnext()
    model = cgt.convert(copy.deepcopy(torch_model))
    assert len(model.cudnn_graphs_report.convnext_blocks) == 2
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    model(x).sum().backward()
    torch_model(x.detach().requires_grad_()).sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), torch_model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_converted_blocks_deep_copy_and_layernorms_pickle_with_their_forwards():
    model = cgt.convert(tiny_convnext().eval(), inference=True)
    x = torch.randn(1, 3, 16, 16)
    twin = copy.deepcopy(model)
    assert "forward" in vars(twin[2]) and twin[2].forward.module is twin[2]
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
    # (the stand-in torchvision classes above cannot pickle: their module does not import here)
    mlp = cgt.convert(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)))
    back = pickle.loads(pickle.dumps(mlp))
    assert back[1].forward.module is back[1]
    assert torch.equal(back(x[0, 0, :1, :4]), mlp(x[0, 0, :1, :4]))


@pytest.mark.parametrize("change,why", [
    (lambda b: setattr(b.block, "4", nn.Hardswish()), "Hardswish is not an activation"),
    (lambda b: setattr(b.block[1], "dims", [0, 3, 2, 1]), "permutes"),
    (lambda b: setattr(b.block, "2", nn.BatchNorm1d(8)), "no LayerNorm over C"),
    (lambda b: setattr(b.block, "5", nn.Linear(32, 4)), "MLP"),
    (lambda b: setattr(b, "layer_scale", nn.Parameter(torch.ones(8))), "layer scale"),
    (lambda b: setattr(b.block, "0", nn.Conv2d(8, 8, 7, padding=3, groups=8, stride=2)), "changes the map's size"),
    (lambda b: setattr(b.block, "0", nn.Conv2d(8, 8, 7, padding=2, groups=8)), "changes the map's size"),
    (lambda b: setattr(b.block, "5", nn.Linear(16, 8)), "MLP"),  # fc1 gives 32 features
])
def test_a_block_that_differs_from_torchvisions_stays_its_own_forward(change, why):
    block = CNBlock(8)
    change(block)
    model = cgt.convert(nn.Sequential(block).eval(), inference=True)
    report = model.cudnn_graphs_report
    assert report.convnext_blocks == [] and "forward" not in vars(model[0])
    assert why in why_not_convnext_block(model[0])
    assert report.unfused_convnext == [("0", why_not_convnext_block(model[0]))]
    assert f"ConvNeXt block 0 runs its own forward: {report.unfused_convnext[0][1]}" in str(report)


def test_only_torchs_layernorm_and_torchvisions_layernorm2d_are_taken():
    class Mine(nn.LayerNorm):
        pass

    assert layer_norm_kind(nn.LayerNorm(4)) == "LayerNorm"
    assert layer_norm_kind(LayerNorm2d(4)) == "LayerNorm2d"
    assert layer_norm_kind(Mine(4)) is None  # a subclass may compute something else
    assert layer_norm_kind(nn.LayerNorm((4, 4))) is None  # over two dims: not rows of one


def test_a_block_whose_module_is_replaced_after_convert_runs_its_own_forward():
    model = cgt.convert(tiny_convnext().eval(), inference=True)
    model[2].block[4] = nn.ReLU()  # a new activation: the held slot moved
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        want = CNBlock.forward(model[2], model[1](model[0](x)))
        assert torch.equal(model[2](model[1](model[0](x))), want)


def test_the_row_layout_takes_16_then_8_byte_vectors_and_declines_rows_wider_than_a_warp_holds():
    assert layernorm.layout(96, "float16", align=16) == (8, 3, 4)  # convnext_tiny's first stage: 4 threads a row
    assert layernorm.layout(768, "float16", align=16) == (8, 3, 32)
    assert layernorm.layout(2048, "float16", align=16) == (8, 8, 32)
    assert layernorm.layout(4096, "float16", align=16) is None
    assert layernorm.layout(100, "float16", align=16) == (4, 4, 8)  # 100 % 8 != 0: 8-byte vectors
    assert layernorm.layout(96, "float16", align=8) == (4, 3, 8)
    assert layernorm.layout(96, "float16", align=2) == (1, 3, 32)
    assert layernorm.layout(96, "float32", align=16) == (4, 3, 8)
    assert layernorm.layout(7, "bfloat16", align=16) == (1, 4, 2)
    assert layernorm.layout(96, "float64", align=16) is None


def test_alignment_is_the_largest_power_of_two_every_address_shares():
    base = torch.empty(64, dtype=torch.float16)
    assert _alignment(base) == 16 and _alignment(base, None) == 16
    assert _alignment(base, base[4:]) == 8 and _alignment(base[1:]) == 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layernorm_kernels_compile_without_local_memory(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    found = kc.ptxas_resources("layernorm.cu", layernorm.name_expressions(), arch)
    assert set(found) == set(layernorm.name_expressions())
    for name, res in found.items():  # the backward holds four floats a value: one 256-thread block an SM
        limit = 160 if name.startswith("layer_norm_bwd_rows") else 128
        assert res["stack_bytes"] == 0 and res["spill_stores"] == 0 and res["registers"] <= limit, (name, res)


def test_layernorm_launcher_constants_are_the_kernels_own():
    assert f"#define LN_THREADS {layernorm.THREADS} " in kc.source("layernorm.cu")
    assert f"#define LN_MAX_CHANNELS {layernorm.MAX_CHANNELS} " in kc.source("layernorm.cu")


def test_the_backward_takes_rows_of_up_to_three_vectors_a_thread():
    assert layernorm.layout(768, "float16", align=16, backward=True) == (8, 3, 32)
    assert layernorm.layout(1024, "float16", align=16, backward=True) is None  # 4 vectors a thread
    assert layernorm.layout(96, "float32", align=16, backward=True) == (4, 3, 8)
    for c, lanes in ((64, 4), (128, 8), (256, 16), (512, 32)):  # powers of two: more threads, not 4 vectors
        assert layernorm.layout(c, "float16", align=16, backward=True) == (8, 2, lanes)


def test_the_training_node_takes_torchvisions_stochastic_depth_or_identity_and_lays_out_aligned_buffers():
    from cudnn_graphs.torch import _cnblock_train as T

    class StochasticDepth(nn.Module):  # torchvision's, by name and module
        def __init__(self, p, mode):
            super().__init__()
            self.p, self.mode = p, mode

    StochasticDepth.__module__ = "torchvision.ops.stochastic_depth"
    assert T._depth_mode(nn.Identity()) == "none"
    assert T._depth_mode(StochasticDepth(0.1, "row")) == "row"
    assert T._depth_mode(StochasticDepth(0.0, "batch")) == "batch"
    assert T._depth_mode(StochasticDepth(0.1, "column")) is None
    assert T._depth_mode(StochasticDepth(1.5, "row")) is None  # torch's forward raises its own error
    assert T._depth_mode(nn.Dropout(0.1)) is None
    offsets, total = T._offsets((10, 0, 300, 1))
    assert offsets == (0, 256, 256, 768) and total == 1024
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    assert T.cnblock_training(CNBlock(8), x) is None  # CPU: the block's own forward
