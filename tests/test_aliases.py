"""CPU: one alias table for the API and spec files: layouts in any case and torch's memory formats,
activations by torch's names and modules, devices as torch spells them; a misnamed parameter is named."""

from __future__ import annotations

import pytest

import cudnn_graphs as cg
from cudnn_graphs import SpecError

X, W = (2, 4, 6, 6), (4, 4, 3, 3)


@pytest.mark.parametrize("layout, want", [("nhwc", "channels_last"), ("NHWC", "channels_last"),
                                          ("Channels_Last", "channels_last"), ("nchw", "channels_first")])
def test_layout_names_in_any_case(layout, want):
    assert cg.ConvFwdSpec(X, W, layout=layout).layout == want


@pytest.mark.parametrize("name, want", [("ReLU", "relu"), ("LeakyReLU", "leaky_relu"), ("leaky-relu", "leaky_relu"),
                                        ("GELU", "gelu"), ("SiLU", "silu"), ("Swish", "silu"), ("Tanh", "tanh")])
def test_activation_names_as_torch_spells_them(name, want):
    spec = cg.ConvFwdSpec(X, W, activation=name)
    assert spec.activation.name == want and spec == cg.ConvFwdSpec(X, W, activation=want)


def test_spec_files_take_the_same_aliases():
    data = {**cg.ConvFwdSpec(X, W).to_dict(), "layout": "nhwc", "activation": "ReLU"}
    spec = cg.spec_from_dict(data)
    assert spec.layout == "channels_last" and spec.activation.name == "relu"


def test_a_misnamed_parameter_is_named():
    with pytest.raises(SpecError, match="'slope' is called 'negative_slope'"):
        cg.ConvFwdSpec(X, W, activation={"name": "leaky_relu", "slope": 0.1})


def test_torch_objects():
    torch = pytest.importorskip("torch")
    assert cg.ConvFwdSpec(X, W, layout=torch.channels_last).layout == "channels_last"
    assert cg.ConvFwdSpec(X, W, layout=torch.contiguous_format).layout == "channels_first"
    assert cg.ConvFwdSpec(X, W, activation=torch.nn.LeakyReLU(0.2)).activation == cg.Activation("leaky_relu", 0.2)
    assert cg.ConvFwdSpec(X, W, activation=torch.nn.GELU(approximate="tanh")).activation.name == "gelu_tanh"
    assert cg.Session(device=torch.device("cuda", 1), cache=False).device == 1


@pytest.mark.parametrize("device, want", [(None, 0), (2, 2), ("cuda", 0), ("cuda:3", 3)])
def test_devices_as_torch_spells_them(device, want):
    assert cg.Session(device=device, cache=False).device == want


@pytest.mark.parametrize("device", ["cpu", -1, True, "cuda:x", 1.0])
def test_bad_devices_are_named(device):
    with pytest.raises(ValueError, match="device="):
        cg.Session(device=device, cache=False)


def test_the_guide_spec_file_example_parses():
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    block = text[text.index("### Spec files"):]
    block = block[block.index("```json") + len("```json"):]
    lines = block[:block.index("```")].strip().splitlines()
    assert [cg.spec_from_dict(json.loads(line)).op for line in lines] == ["conv_fwd", "conv_bwd_data",
                                                                          "conv_bwd_filter"]


@pytest.mark.parametrize("dtype, layout", [("half", "NHWC"), ("fp16", "nhwc"), ("bf16", "channels_last"),
                                           ("float32", "NCHW")])
def test_the_cli_takes_the_same_spellings(dtype, layout, capsys):
    from cudnn_graphs.cli import main

    assert main(["warmup", "--preset", "resnet50", "--batch", "2", "--dtype", dtype, "--layout", layout,
                 "--dry-run", "--json"]) == 0
    import json

    specs = [cg.spec_from_dict(s["spec"]) for s in json.loads(capsys.readouterr().out)["specs"]]
    assert {s.dtype for s in specs} == {cg.ConvFwdSpec(X, W, dtype=dtype).dtype}
    assert {s.layout for s in specs} == {cg.ConvFwdSpec(X, W, layout=layout).layout}
