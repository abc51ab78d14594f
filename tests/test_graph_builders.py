"""Every builder variant builds a cuDNN graph that the frontend validates, with no GPU."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from cudnn_graphs import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, UnsupportedGraphError, build_graph
from cudnn_graphs.graph import ROLE_UIDS, cudnn_dims

from .collector import cyclic_garbage

ACTS = [None, "relu", ("leaky_relu", 0.2), "elu", ("elu", 0.5), "gelu", "gelu_tanh", "silu", "sigmoid",
        "tanh", "softplus", ("softplus", 2.0)]
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _shapes(nd: int, groups: int):
    x = (2, 8) + (7,) * nd
    w = (8, 8 // groups) + (3,) * nd
    return x, w


def _nodes(part) -> list[tuple[str, str]]:
    data = json.loads(repr(part.graph))
    return [(n["name"], n.get("mode") or n["tag"]) for n in data["nodes"]]


def _tensors(part) -> dict[int, dict]:
    data = json.loads(repr(part.graph))["tensors"]
    items = data.values() if isinstance(data, dict) else data
    return {t["uid"]: t for t in items if t.get("uid_assigned", True) and not t["is_virtual"]}


FWD_CASES = [
    dict(dtype=dt, nd=nd, layout=layout, groups=g, stride=s, dilation=d, padding=p, bias=bias,
         activation=act, residual=res, alpha=alpha, beta=beta)
    for dt, nd, layout, (g, s, d, p), (bias, act, res, alpha, beta) in itertools.product(
        DTYPES, (1, 2, 3), ("channels_first", "channels_last"),
        [(1, 1, 1, 1), (2, 2, 1, ((1, 0),) * 1), (8, 1, 2, 2)],
        [(False, None, False, 1.0, 1.0), (True, None, False, 1.0, 1.0), (True, "relu", False, 1.0, 1.0),
         (True, ("elu", 0.5), True, 0.5, 2.0), (False, "gelu_tanh", True, 1.0, 1.0)],
    )
]


def _fwd_spec(c):
    x, w = _shapes(c["nd"], c["groups"])
    padding = c["padding"] if isinstance(c["padding"], int) else c["padding"] * c["nd"]
    return ConvFwdSpec(x, w, padding=padding, stride=c["stride"], dilation=c["dilation"], groups=c["groups"],
                       dtype=c["dtype"], layout=c["layout"], bias=c["bias"], activation=c["activation"],
                       residual=c["residual"], alpha=c["alpha"], beta=c["beta"])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_fwd_variants_validate(case, fused):
    spec = _fwd_spec(case)
    build = build_graph(spec, fused=fused)
    roles = [r for part in build.parts for r in part.roles]
    assert set(roles) - {"acc"} == set(spec.tensors())
    assert build.fused == (fused or not spec.has_epilogue)
    assert len(build.parts) == (1 if build.fused else 2)
    last = build.parts[-1]
    io = _tensors(last)
    assert io[ROLE_UIDS["y"]]["dim"] == cudnn_dims(spec.tensors()["y"])[0]
    assert io[ROLE_UIDS["y"]]["stride"] == cudnn_dims(spec.tensors()["y"])[1]


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_fwd_every_activation(act, dtype, fused):
    x, w = _shapes(2, 1)
    build = build_graph(ConvFwdSpec(x, w, padding=1, dtype=dtype, bias=True, activation=act), fused=fused)
    names = [name for part in build.parts for name, _ in _nodes(part)]
    assert names[0] == "conv" and "bias" in names


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_dgrad_variants_validate(act, nd, fused):
    x, w = _shapes(nd, 2)
    spec = ConvBwdDataSpec((2, 8) + (4,) * nd, w, x, padding=1, stride=2, groups=2, dtype="float16",
                           layout="channels_last", activation_backward=act)
    build = build_graph(spec, fused=fused)
    first = _nodes(build.parts[0])[0]
    assert first == ("dgrad", "CONV_BPROP_DATA") or first[1] in ("CONV_DGRAD", "CONV_BPROP_DATA")
    if spec.has_epilogue:
        assert "pre_act" in build.parts[-1].roles


@pytest.mark.parametrize("act", ["identity", "relu"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_dgrad_adds_a_residual_gradient_in_its_epilogue(act, fused):
    """dx = dgrad(dy, w) [* act'] + z: the add is the epilogue's last node and z a bound role."""
    spec = ConvBwdDataSpec((2, 8, 8, 8), (8, 16, 1, 1), (2, 16, 8, 8), dtype="float16", layout="channels_last",
                           activation_backward=act, residual=True)
    build = build_graph(spec, fused=fused)
    assert {r for part in build.parts for r in part.roles} - {"acc"} == set(spec.tensors())
    assert "z" in build.parts[-1].roles and build.fused == fused
    assert _nodes(build.parts[-1])[-1][0] == "residual"
    assert build.parts[-1].name.endswith("residual_backward")


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_wgrad_variants_validate(nd, dtype, bias_grad, fused):
    x, w = _shapes(nd, 1)
    spec = ConvBwdFilterSpec(x, (2, 8) + (5,) * nd, w, dtype=dtype, bias_grad=bias_grad, layout="channels_last")
    build = build_graph(spec, fused=fused)
    roles = {r for part in build.parts for r in part.roles}
    assert roles == set(spec.tensors())
    if bias_grad:
        db = _tensors(build.parts[-1])[ROLE_UIDS["db"]]
        assert db["dim"] == [1, 8] + [1] * max(2, nd)


def test_one_d_runs_as_two_d_with_unit_height():
    spec = ConvFwdSpec((2, 3, 10), (4, 3, 3), padding=((2, 1),), stride=2, layout="NWC")
    build = build_graph(spec)
    io = _tensors(build.parts[0])
    assert io[ROLE_UIDS["x"]]["dim"] == [2, 3, 1, 10]
    assert io[ROLE_UIDS["x"]]["stride"] == [30, 1, 30, 3]
    conv = json.loads(repr(build.parts[0].graph))["nodes"][0]
    assert conv["pre_padding"] == [0, 2] and conv["post_padding"] == [0, 1] and conv["stride"] == [1, 2]


def test_scalars_carry_alpha_beta_and_activation_params():
    spec = ConvFwdSpec((2, 8, 7, 7), (4, 8, 3, 3), residual=True, alpha=0.5, beta=2.0, activation=("elu", 0.3))
    part = build_graph(spec).parts[0]
    values = sorted(part.scalars.values())
    assert values == sorted([0.5, 2.0, 0.0, 0.3])
    assert all(uid >= 100 for uid in part.scalars)
    modes = [mode for _, mode in _nodes(part)]
    assert modes.count("ELU_FWD") == 1 and "MIN" in modes and "MAX" in modes


def test_native_ops_when_parameters_are_default():
    spec = ConvFwdSpec((2, 8, 7, 7), (4, 8, 3, 3), activation="elu")
    part = build_graph(spec).parts[0]
    assert [mode for _, mode in _nodes(part)] == ["CONV_FPROP", "ELU_FWD"] and part.scalars == {}


def test_unfused_intermediate_is_compute_precision():
    spec = ConvFwdSpec((2, 8, 7, 7), (4, 8, 3, 3), dtype="bfloat16", bias=True, activation="silu", layout="NHWC")
    build = build_graph(spec, fused=False)
    acc = build.intermediates["acc"]
    assert acc.dtype == "float32" and acc.shape == spec.y_shape and acc.strides == spec.tensors()["y"].strides
    conv_out = _tensors(build.parts[0])[ROLE_UIDS["acc"]]
    assert conv_out["data_type"] == "FLOAT"


def test_no_epilogue_builds_one_part_even_unfused():
    spec = ConvFwdSpec((2, 8, 7, 7), (4, 8, 3, 3))
    assert len(build_graph(spec, fused=False).parts) == 1


def test_validate_failure_is_unsupported_graph_error(monkeypatch):
    from cudnn_graphs.graph import builders

    class Boom(RuntimeError):
        pass

    original = builders.frontend.new_graph

    def broken(**kw):
        g = original(**kw)

        class Wrapper:
            def __getattr__(self, name):
                return getattr(g, name)

            def validate(self):
                raise Boom("cudnn says no")
        return Wrapper()

    monkeypatch.setattr(builders.frontend, "new_graph", broken)
    spec = ConvFwdSpec((2, 8, 7, 7), (4, 8, 3, 3))
    with pytest.raises(UnsupportedGraphError) as err:
        build_graph(spec)
    assert err.value.spec == spec and "cudnn says no" in err.value.message


def test_a_declined_graph_is_freed_when_dropped_not_left_to_the_garbage_collector():
    """FE keeps the backend's decline on the graph, its traceback holding the graph's frames: a cycle.
    Freed by a later collection, a graph with plans can wait for the whole GPU in a hot loop."""
    import gc

    from cudnn_graphs.graph import frontend

    spec = ConvFwdSpec((2, 8, 7, 7), (8, 1, 3, 3), padding=1, groups=8, dtype="float16", layout="channels_last",
                       bias=True, activation="gelu")
    gc.collect()

    def decline(release: bool) -> bool:
        g = build_graph(spec, fused=False).parts[0].graph
        logging.disable(logging.CRITICAL)  # pytest keeps log records, and through them the declines
        try:
            g.build_plans()
        except Exception:  # a decline here: no GPU, or no engine
            pass
        finally:
            logging.disable(logging.NOTSET)
        declined = getattr(g, "_backend_declined", None) is not None
        if release:
            frontend.release_declines(g)
        return declined

    if not decline(release=False):
        pytest.skip("this frontend keeps no decline on the graph here")
    assert cyclic_garbage("cudnn.", "cudnn_graphs."), "the cycle this guards against did not form: the test proves nothing"
    decline(release=True)
    assert not cyclic_garbage("cudnn.", "cudnn_graphs.")


def test_clear_tracebacks_follows_causes_and_contexts_even_round_a_loop():
    from cudnn_graphs.graph import frontend

    def raised(make):
        try:
            make()
        except Exception as err:  # noqa: BLE001 - the exception itself is what this test inspects
            return err

    first = raised(lambda: 1 / 0)
    second = raised(lambda: (_ for _ in ()).throw(ValueError("second")))
    second.__cause__, first.__context__ = first, second  # a loop no raise would make, but a caller can
    frontend.clear_tracebacks(second)
    assert first.__traceback__ is None and second.__traceback__ is None and str(second) == "second"


# -- BatchNorm fusions: a scale-shift-relu prologue on the conv input, statistics of its output ------------

@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("prologue, stats", [("scale_bias_relu", False), (None, True), ("scale_bias_relu", True)])
def test_fwd_prologue_and_stats_validate(nd, prologue, stats):
    x, w = _shapes(nd, 1)
    spec = ConvFwdSpec(x, w, padding=1, dtype="float16", layout="channels_last", prologue=prologue, stats=stats)
    part, = build_graph(spec).parts
    nodes = _nodes(part)
    assert (("prologue_scale", "MUL") in nodes and ("prologue_relu", "RELU_FWD") in nodes) == bool(prologue)
    tensors = _tensors(part)
    c, k = x[1], w[0]
    if prologue:  # per input channel, in the io dtype; the conv reads the relu's output, never x itself
        for role in ("scale", "shift"):
            assert tensors[ROLE_UIDS[role]]["dim"] == [1, c] + [1] * max(2, nd)
            assert tensors[ROLE_UIDS[role]]["data_type"] == "HALF"
        conv = next(n for n in json.loads(repr(part.graph))["nodes"] if n["name"] == "conv")
        assert conv["inputs"]["X"] != "x"
    for role in ("sum", "sq_sum"):
        assert (ROLE_UIDS[role] in tensors) == stats
        if stats:
            assert tensors[ROLE_UIDS[role]]["dim"] == [1, k] + [1] * max(2, nd)
            assert tensors[ROLE_UIDS[role]]["data_type"] == "FLOAT"
    assert set(part.roles) == set(spec.tensors())


def test_wgrad_prologue_validates():
    x, w = _shapes(2, 1)
    spec = ConvBwdFilterSpec(x, (2, 8, 7, 7), w, padding=1, dtype="float16", layout="channels_last",
                             prologue="scale_bias_relu")
    part, = build_graph(spec).parts
    assert ("prologue_relu", "RELU_FWD") in _nodes(part)
    assert set(part.roles) == {"x", "dy", "scale", "shift", "dw"}
