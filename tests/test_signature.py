"""The cache signature: stable across processes, sensitive to every spec and environment field."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cudnn_graphs
from cudnn_graphs import (ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, Environment, environment,
                          signature, spec_from_dict)

REPO_ROOT = Path(__file__).resolve().parents[1]
HEX64 = re.compile(r"[0-9a-f]{64}")

# Built from the same source in this process and in the children, so both sides hash equal specs.
SPECS_SOURCE = """[
    ConvFwdSpec((2, 8, 16, 16), (16, 8, 3, 3), padding=1),
    ConvFwdSpec((1, 4, 9, 9, 9), (8, 2, 3, 3, 3), padding=((1, 0), (1, 1), (0, 2)), stride=2, groups=2,
                dtype="fp16", layout="NDHWC", bias=True, activation=("leaky_relu", 0.2), residual=True,
                alpha=0.5, beta=0.25),
    ConvBwdDataSpec((2, 16, 8, 8), (16, 8, 3, 3), (2, 8, 16, 16), padding=1, stride=2,
                    activation_backward="gelu"),
    ConvBwdFilterSpec((4, 3, 32), (4, 6, 32), (6, 3, 5), padding=2, dtype="float64", bias_grad=True,
                      strides={"x": (100, 33, 1)}),
]"""


def _specs():
    return eval(SPECS_SOURCE, {"ConvFwdSpec": ConvFwdSpec, "ConvBwdDataSpec": ConvBwdDataSpec,
                               "ConvBwdFilterSpec": ConvBwdFilterSpec})


def _env_kwargs(env: Environment) -> dict:
    return {f.name: getattr(env, f.name) for f in dataclasses.fields(env)}


# -- format and determinism ------------------------------------------------------------------------

def test_signature_is_64_lowercase_hex(fake_env):
    for spec in _specs():
        assert HEX64.fullmatch(signature(spec, fake_env))


def test_signature_is_deterministic_within_a_process(fake_env):
    first = [signature(spec, fake_env) for spec in _specs()]
    again = [signature(spec, fake_env) for spec in _specs()]  # freshly built, equal specs
    assert first == again
    assert len(set(first)) == len(first)
    rebuilt_env = Environment(**_env_kwargs(fake_env))
    assert [signature(spec, rebuilt_env) for spec in _specs()] == first


def _child_signatures(fake_env: Environment, hashseed: str) -> list[str]:
    code = (
        "from cudnn_graphs import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, Environment, signature\n"
        f"env = Environment(**{_env_kwargs(fake_env)!r})\n"
        f"for spec in {SPECS_SOURCE}:\n"
        "    print(signature(spec, env))\n"
    )
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = hashseed
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_signature_is_stable_across_processes_and_hash_seeds(fake_env):
    parent = [signature(spec, fake_env) for spec in _specs()]
    seed0 = _child_signatures(fake_env, "0")
    seed1 = _child_signatures(fake_env, "12345")
    assert seed0 == seed1
    assert seed0 == parent


# -- sensitivity to spec fields --------------------------------------------------------------------

BASE = {
    "fwd": (ConvFwdSpec, dict(x_shape=(2, 8, 16, 16), w_shape=(16, 8, 3, 3), padding=1)),
    "bwd_data": (ConvBwdDataSpec, dict(dy_shape=(2, 16, 16, 16), w_shape=(16, 8, 3, 3), x_shape=(2, 8, 16, 16),
                                       padding=1)),
    "bwd_filter": (ConvBwdFilterSpec, dict(x_shape=(2, 8, 16, 16), dy_shape=(2, 16, 16, 16),
                                           w_shape=(16, 8, 3, 3), padding=1)),
}
# Row-padded (2, 8, 16, 16) strides: a layout no packed layout gives.
PADDED_STRIDES = (8 * 16 * 17, 16 * 17, 17, 1)

# (family, what changes, base overrides, changes). Some fields are tied to others (groups to
# w_shape, dy_shape to x/w, compute_dtype to dtype): the change then touches those too.
SPEC_CHANGES = [
    ("fwd", "padding", {}, dict(padding=((1, 2), (1, 1)))),
    ("fwd", "stride", {}, dict(stride=2)),
    ("fwd", "dilation", {}, dict(dilation=2)),
    ("fwd", "groups(+w_shape)", {}, dict(groups=2, w_shape=(16, 4, 3, 3))),
    ("fwd", "dtype", {}, dict(dtype="float16")),
    ("fwd", "compute_dtype(+dtype)", {}, dict(dtype="float64", compute_dtype="float64")),
    ("fwd", "allow_tf32", {}, dict(allow_tf32=False)),
    ("fwd", "layout", {}, dict(layout="channels_last")),
    ("fwd", "strides", {}, dict(strides={"x": PADDED_STRIDES})),
    ("fwd", "strides_role", dict(strides={"x": PADDED_STRIDES}), dict(strides={"w": PADDED_STRIDES})),
    ("fwd", "x_shape", {}, dict(x_shape=(4, 8, 16, 16))),
    ("fwd", "x_shape_spatial", {}, dict(x_shape=(2, 8, 16, 17))),
    ("fwd", "w_shape", {}, dict(w_shape=(32, 8, 3, 3))),
    ("fwd", "w_shape_filter", {}, dict(w_shape=(16, 8, 1, 1))),
    ("fwd", "bias", {}, dict(bias=True)),
    ("fwd", "activation", {}, dict(activation="relu")),
    ("fwd", "activation_param", dict(activation=("leaky_relu", 0.01)), dict(activation=("leaky_relu", 0.02))),
    ("fwd", "activation_default_param", dict(activation="elu"), dict(activation=("elu", 0.5))),
    ("fwd", "residual", {}, dict(residual=True)),
    ("fwd", "alpha", {}, dict(alpha=2.0)),
    ("fwd", "beta", dict(residual=True), dict(beta=0.5)),
    ("fwd", "prologue", {}, dict(prologue="scale_bias_relu")),
    ("fwd", "stats", {}, dict(stats=True)),
    ("bwd_data", "padding", {}, dict(padding=0, dy_shape=(2, 16, 14, 14))),
    ("bwd_data", "padding_asymmetric", {}, dict(padding=((1, 1), (2, 0)))),
    ("bwd_data", "stride", {}, dict(stride=2, dy_shape=(2, 16, 8, 8))),
    ("bwd_data", "dilation", {}, dict(dilation=2, dy_shape=(2, 16, 14, 14))),
    ("bwd_data", "groups(+w_shape)", {}, dict(groups=2, w_shape=(16, 4, 3, 3))),
    ("bwd_data", "dtype", {}, dict(dtype="bfloat16")),
    ("bwd_data", "compute_dtype(+dtype)", {}, dict(dtype="float64", compute_dtype="float64")),
    ("bwd_data", "allow_tf32", {}, dict(allow_tf32=False)),
    ("bwd_data", "layout", {}, dict(layout="NHWC")),
    ("bwd_data", "strides", {}, dict(strides={"dx": PADDED_STRIDES})),
    # stride 2, pad 1, k 3: x of 16 and of 15 both give dy of 8, so x changes alone.
    ("bwd_data", "x_shape", dict(stride=2, dy_shape=(2, 16, 8, 8)), dict(x_shape=(2, 8, 15, 15))),
    ("bwd_data", "dy_shape(+x_shape)", {}, dict(dy_shape=(4, 16, 16, 16), x_shape=(4, 8, 16, 16))),
    ("bwd_data", "w_shape", {}, dict(w_shape=(32, 8, 3, 3), dy_shape=(2, 32, 16, 16))),
    ("bwd_data", "activation_backward", {}, dict(activation_backward="relu")),
    ("bwd_data", "residual", {}, dict(residual=True)),
    ("bwd_data", "activation_backward_param", dict(activation_backward=("leaky_relu", 0.01)),
     dict(activation_backward=("leaky_relu", 0.02))),
    ("bwd_filter", "padding", {}, dict(padding=0, dy_shape=(2, 16, 14, 14))),
    ("bwd_filter", "stride", {}, dict(stride=2, dy_shape=(2, 16, 8, 8))),
    ("bwd_filter", "dilation", {}, dict(dilation=2, dy_shape=(2, 16, 14, 14))),
    ("bwd_filter", "groups(+w_shape)", {}, dict(groups=4, w_shape=(16, 2, 3, 3))),
    ("bwd_filter", "dtype", {}, dict(dtype="float16")),
    ("bwd_filter", "compute_dtype(+dtype)", {}, dict(dtype="float64", compute_dtype="float64")),
    ("bwd_filter", "allow_tf32", {}, dict(allow_tf32=False)),
    ("bwd_filter", "layout", {}, dict(layout="channels_last")),
    ("bwd_filter", "strides", {}, dict(strides={"x": PADDED_STRIDES})),
    ("bwd_filter", "x_shape", dict(stride=2, dy_shape=(2, 16, 8, 8)), dict(x_shape=(2, 8, 15, 15))),
    ("bwd_filter", "dy_shape(+x_shape)", {}, dict(dy_shape=(4, 16, 16, 16), x_shape=(4, 8, 16, 16))),
    ("bwd_filter", "w_shape", {}, dict(w_shape=(32, 8, 3, 3), dy_shape=(2, 32, 16, 16))),
    ("bwd_filter", "bias_grad", {}, dict(bias_grad=True)),
    ("bwd_filter", "prologue", {}, dict(prologue="scale_bias_relu")),
]


def _build(family: str, overrides: dict):
    cls, base = BASE[family]
    return cls(**{**base, **overrides})


@pytest.mark.parametrize("family, what, base_overrides, changes", SPEC_CHANGES,
                         ids=[f"{family}-{what}" for family, what, _, _ in SPEC_CHANGES])
def test_signature_changes_with_each_spec_field(family, what, base_overrides, changes, fake_env):
    before = _build(family, base_overrides)
    after = _build(family, {**base_overrides, **changes})
    assert before != after
    assert signature(before, fake_env) != signature(after, fake_env)


def test_fields_added_later_leave_earlier_dict_forms_alone():
    """prologue / stats at their defaults are not in the dict form: earlier specs keep their signatures."""
    for family, (cls, base) in BASE.items():
        data = cls(**base).to_dict()
        assert "prologue" not in data and "stats" not in data
        assert spec_from_dict(data) == cls(**base)
    fused = ConvFwdSpec(**BASE["fwd"][1], prologue="scale_bias_relu", stats=True)
    assert spec_from_dict(fused.to_dict()) == fused


def test_spec_changes_cover_every_field():
    """A new spec field with no row in SPEC_CHANGES fails here."""
    for family, (cls, _) in BASE.items():
        changed = set()
        for fam, _what, base_overrides, changes in SPEC_CHANGES:
            if fam == family:
                changed.update(changes)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        assert fields <= changed, f"{family}: no signature-sensitivity case for {sorted(fields - changed)}"


# Spellings that normalise to one spec, hence one signature.
SAME_SPELLINGS = [
    ("fwd", "padding int vs pairs", dict(padding=1), dict(padding=((1, 1), (1, 1)))),
    ("fwd", "padding per-dim vs pairs", dict(padding=[1, 1]), dict(padding=[[1, 1], [1, 1]])),
    ("fwd", "stride int vs per-dim", dict(stride=2), dict(stride=(2, 2))),
    ("fwd", "dtype fp16 vs float16", dict(dtype="fp16"), dict(dtype="float16")),
    ("fwd", "compute_dtype default vs explicit", dict(compute_dtype=None), dict(compute_dtype="float32")),
    ("fwd", "allow_tf32 ignored off float32", dict(dtype="float16", allow_tf32=True),
     dict(dtype="float16", allow_tf32=False)),
    ("fwd", "layout NHWC vs channels_last", dict(layout="NHWC"), dict(layout="channels_last")),
    ("fwd", "activation None vs identity", dict(activation=None), dict(activation="identity")),
    ("fwd", "activation swish vs silu", dict(activation="swish"), dict(activation="silu")),
    ("fwd", "leaky_relu default param", dict(activation="leaky_relu"), dict(activation=("leaky_relu", 0.01))),
    ("fwd", "strides dict vs pairs", dict(strides={"x": PADDED_STRIDES}), dict(strides=[("x", list(PADDED_STRIDES))])),
    ("bwd_data", "activation_backward None vs identity", dict(activation_backward=None),
     dict(activation_backward="identity")),
    ("bwd_data", "activation_backward swish vs silu", dict(activation_backward="swish"),
     dict(activation_backward="silu")),
    ("bwd_filter", "dtype half vs float16", dict(dtype="half"), dict(dtype="float16")),
    ("bwd_filter", "padding int vs pairs", dict(padding=1), dict(padding=((1, 1), (1, 1)))),
]

# 0.0 == -0.0, so these specs compare and hash equal; json.dumps would write "0.0" and "-0.0", so
# the specs normalise -0.0 to 0.0 to keep their signatures equal too.
SIGNED_ZEROS = [
    ("fwd", "alpha 0.0 vs -0.0", dict(alpha=0.0), dict(alpha=-0.0)),
    ("fwd", "beta 0.0 vs -0.0", dict(residual=True, beta=0.0), dict(residual=True, beta=-0.0)),
    ("fwd", "leaky_relu slope 0.0 vs -0.0", dict(activation=("leaky_relu", 0.0)),
     dict(activation=("leaky_relu", -0.0))),
]


@pytest.mark.parametrize("family, what, one, other", [
    *(pytest.param(*case, id=f"{case[0]}-{case[1]}") for case in SAME_SPELLINGS),
    *(pytest.param(*case, id=f"{case[0]}-{case[1]}") for case in SIGNED_ZEROS),
])
def test_equivalent_spellings_share_a_signature(family, what, one, other, fake_env):
    a, b = _build(family, one), _build(family, other)
    assert a == b and hash(a) == hash(b)
    assert signature(a, fake_env) == signature(b, fake_env)


# -- sensitivity to environment fields -------------------------------------------------------------

def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + " (changed)"
    if isinstance(value, tuple):
        return tuple(_changed(v) for v in value)
    raise AssertionError(f"no changed value for {value!r} of type {type(value).__name__}: extend _changed")


ENV_FIELDS = [f.name for f in dataclasses.fields(Environment)]


@pytest.mark.parametrize("name", ENV_FIELDS, ids=ENV_FIELDS)
def test_signature_changes_with_each_environment_field(name, fake_env):
    other = dataclasses.replace(fake_env, **{name: _changed(getattr(fake_env, name))})
    assert other != fake_env
    for spec in _specs():
        assert signature(spec, fake_env) != signature(spec, other), spec


# -- the default environment on this machine --------------------------------------------------------

def _gpu_visible() -> bool:
    from cudnn_graphs.environment import _gpu_properties

    return "name" in _gpu_properties(0)


@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible: this checks the no-GPU fingerprint")
def test_environment_without_gpu():
    env = environment()
    assert isinstance(env, Environment)
    assert env.has_gpu is False
    assert env.gpu_name == "none"
    assert env.compute_capability == (0, 0)
    assert env.sm_count == 0
    for spec in _specs():
        default = signature(spec)
        assert HEX64.fullmatch(default)
        assert default == signature(spec, environment())
        assert default == signature(spec, env)
    # The session flags are part of the fingerprint.
    assert environment(deterministic=True).deterministic is True
    assert environment(allow_tf32=False).allow_tf32 is False
    spec = _specs()[0]
    assert signature(spec, environment(deterministic=True)) != signature(spec)


def test_environment_dict_round_trip(fake_env):
    assert Environment.from_dict(fake_env.to_dict()) == fake_env
    assert cudnn_graphs.Environment is Environment


def test_selection_policy_changes_the_key_and_defaults_do_not(fake_env):
    spec = ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    base = signature(spec, fake_env)
    assert signature(spec, fake_env, policy={}) == base
    capped = signature(spec, fake_env, policy={"max_workspace_bytes": 0})
    assert capped != base and capped != signature(spec, fake_env, policy={"max_workspace_bytes": 1 << 20})
    assert signature(spec, fake_env, policy={"fuse": False}) not in (base, capped)
