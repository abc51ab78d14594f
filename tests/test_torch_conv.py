"""CPU: cudnn_graphs.torch's conv modules are torch's modules to a state_dict, their fake kernels give
torch's shapes, and on CPU tensors they compute what torch computes (torch's own conv serves)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402

OURS = {1: cgt.Conv1d, 2: cgt.Conv2d, 3: cgt.Conv3d}
THEIRS = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}
FUNCS = {1: cgt.conv1d, 2: cgt.conv2d, 3: cgt.conv3d}
KWARGS = [dict(), dict(stride=2, padding=1, bias=False), dict(padding="same", dilation=2, groups=2),
          dict(padding=1, padding_mode="reflect"), dict(padding=1, padding_mode="circular")]


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", KWARGS, ids=str)
def test_same_parameters_state_dict_and_initialisation(nd, kwargs):
    torch.manual_seed(3)
    ours = OURS[nd](4, 6, 3, **kwargs)
    torch.manual_seed(3)
    theirs = THEIRS[nd](4, 6, 3, **kwargs)
    assert isinstance(ours, THEIRS[nd])
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours).startswith(type(ours).__name__) and "activation" not in repr(ours)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", KWARGS, ids=str)
def test_cpu_forward_and_backward_are_torchs(nd, kwargs):
    ours, theirs = OURS[nd](4, 6, 3, **kwargs).double(), THEIRS[nd](4, 6, 3, **kwargs).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, *(9,) * nd, dtype=torch.float64, requires_grad=True)
    y, want = ours(x), theirs(x)
    torch.testing.assert_close(y, want)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx)


def test_activation_and_residual_on_cpu():
    conv = cgt.Conv2d(4, 4, 3, padding=1, activation=("leaky_relu", 0.1)).double()
    x, z = torch.randn(2, 4, 8, 8, dtype=torch.float64), torch.randn(2, 4, 8, 8, dtype=torch.float64)
    want = F.leaky_relu(F.conv2d(x, conv.weight, conv.bias, padding=1) + z, 0.1)
    torch.testing.assert_close(conv(x, z), want)
    assert "activation=leaky_relu(negative_slope=0.1)" in repr(conv)


def test_asymmetric_same_padding_matches_torch():
    x, w = torch.randn(1, 2, 10, 9, dtype=torch.float64), torch.randn(3, 2, 4, 2, dtype=torch.float64)
    torch.testing.assert_close(cgt.conv2d(x, w, padding="same"), F.conv2d(x, w, padding="same"))


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_fake_kernels_give_torchs_shapes(nd):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8, *(13,) * nd)
        w = torch.empty(6, 4, *(3,) * nd)
        y = FUNCS[nd](x, w, None, stride=2, padding=1, groups=2)
        want = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd](x, w, None, stride=2, padding=1, groups=2)
        assert y.shape == want.shape
        dx = torch.ops.cudnn_graphs.conv_bwd_data(y, w, list(x.shape), [2] * nd, [1] * 2 * nd, [1] * nd, 2)
        dw, db = torch.ops.cudnn_graphs.conv_bwd_filter(x, y, list(w.shape), [2] * nd, [1] * 2 * nd, [1] * nd, 2,
                                                        True)
        assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (6,)


def test_fake_output_keeps_channels_last():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
        y = cgt.conv2d(x, torch.empty(4, 8, 3, 3), padding=1)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()


@pytest.mark.parametrize("kwargs, field", [(dict(padding="full"), "padding"), (dict(stride=0), "stride"),
                                           (dict(padding=-1), "padding"), (dict(dilation=(1, 2, 3)), "dilation"),
                                           (dict(padding="same", stride=2), "same"), (dict(groups=0), "groups"),
                                           (dict(groups=1.0), "groups"), (dict(beta="1"), "beta")])
def test_bad_arguments_name_the_field(kwargs, field):
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match=field):
        cgt.conv2d(x, w, **kwargs)


def test_bad_activation_is_a_spec_error():
    from cudnn_graphs import SpecError

    with pytest.raises(SpecError, match="activation"):
        cgt.Conv2d(2, 2, 3, activation="swishy")


def test_equal_arguments_share_one_config_whatever_their_spelling():
    from cudnn_graphs.torch import _conv

    a = _conv._config(2, 1, 1, 1, 1, "relu", 1.0, ())
    assert a is _conv._config(2, (1, 1), [1, 1], [1], 1, ("relu", None), 1, ())  # lists: normalised, then shared
    assert a.flat == ([1, 1], [1, 1, 1, 1], [1, 1], 1) and a.pre is None
    gelu = _conv._config(2, 1, "same", 1, 1, "gelu", 1.0, (4, 4))
    assert gelu.padding == (1, 2, 1, 2) and gelu.pre.act == "identity"  # gelu's gradient needs the pre-activation
    assert _conv._config(2, 2, 1, 1, 1, None, 1.0, ()) is not a


def test_autocast_casts_as_torch_does_and_passes_a_tensor_already_in_the_dtype_as_is():
    from cudnn_graphs.torch import _conv

    x16, w32, b64 = torch.ones(2, dtype=torch.float16), torch.ones(2), torch.ones(2, dtype=torch.float64)
    got = _conv._autocast((x16, w32, b64, None), torch.float16)
    assert got[0] is x16 and got[1].dtype == torch.float16 and got[2] is b64 and got[3] is None
    assert [t.dtype for t in _conv._autocast((x16, w32), torch.bfloat16)] == [torch.bfloat16] * 2


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_unbatched_input_as_torch_takes_it(nd, padding_mode):
    ours = OURS[nd](4, 6, 3, padding=1, padding_mode=padding_mode).double()
    theirs = THEIRS[nd](4, 6, 3, padding=1, padding_mode=padding_mode).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, *(7,) * nd, dtype=torch.float64, requires_grad=True)
    y, want = ours(x), theirs(x)
    assert y.shape == want.shape == (6, *(7,) * nd)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    z = torch.randn(6, *(7,) * nd, dtype=torch.float64)
    plain = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd](x, ours.weight, ours.bias, padding=1)
    torch.testing.assert_close(FUNCS[nd](x, ours.weight, ours.bias, padding=1, residual=z, activation="relu"),
                               F.relu(plain + z))


@pytest.mark.parametrize("x_shape, w_shape, kwargs, field, torch_says", [
    ((8, 8), (6, 8, 3, 3), {}, "input", "Expected 3D"),
    ((2, 4, 8, 8), (6, 3, 3, 3), {}, "input", "channels"),
    ((2, 4, 8, 8), (6, 2, 3, 3), dict(groups=3), "input", "channels"),
    ((2, 4, 8, 8), (6, 4, 3, 3), dict(bias=(5,)), "bias", "bias"),
    ((2, 4, 2, 2), (6, 4, 3, 3), {}, "input", "Kernel size"),
    ((2, 4, 8, 8), (6, 4, 3), {}, "input", None),
    ((2, 4, 8, 8), (6, 4, 3, 3), dict(residual=(2, 6, 8, 8)), "residual", None),
])
def test_shapes_torch_refuses_raise_a_shape_error_that_is_also_torchs_runtime_error(x_shape, w_shape, kwargs, field,
                                                                                     torch_says):
    from cudnn_graphs import ShapeError

    x, w = torch.randn(x_shape), torch.randn(w_shape)
    kwargs = {k: torch.randn(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    with pytest.raises(ShapeError) as err:
        cgt.conv2d(x, w, **kwargs)
    assert err.value.field == field and isinstance(err.value, RuntimeError)
    if torch_says is not None:
        with pytest.raises(RuntimeError, match=torch_says):
            F.conv2d(x, w, **kwargs)


def test_conv_forward_serves_subclasses_that_pass_their_own_weight():
    class Standardised(cgt.Conv2d):  # timm's StdConv2d pattern: a transformed weight through _conv_forward
        def forward(self, x):
            w = (self.weight - self.weight.mean((1, 2, 3), keepdim=True)) / (self.weight.std((1, 2, 3), keepdim=True))
            return self._conv_forward(x, w, self.bias)

    conv = Standardised(4, 6, 3, padding=1, padding_mode="reflect").double()
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    w = (conv.weight - conv.weight.mean((1, 2, 3), keepdim=True)) / conv.weight.std((1, 2, 3), keepdim=True)
    want = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w, conv.bias)
    torch.testing.assert_close(conv(x), want)


def test_output_layout_follows_torchs_cudnn_rule():
    from cudnn_graphs.torch._conv import _conv_format

    cl = torch.channels_last
    x, w = torch.empty(2, 8, 5, 5), torch.empty(4, 8, 3, 3)
    assert _conv_format(x, w) == torch.contiguous_format
    assert _conv_format(x, w.contiguous(memory_format=cl)) == cl  # a channels_last weight decides, as in torch
    assert _conv_format(x.contiguous(memory_format=cl), w) == cl
    assert _conv_format(x.double().contiguous(memory_format=cl), w.double()) == torch.contiguous_format
    gray = torch.empty(2, 1, 5, 5)  # packed both ways: the weight's strides decide (.to restrides, .contiguous not)
    assert _conv_format(gray, torch.empty(4, 1, 3, 3).to(memory_format=cl)) == cl
    assert _conv_format(gray, torch.empty(4, 1, 3, 3)) == torch.contiguous_format
    assert _conv_format(torch.empty(2, 8, 3, 4, 5), torch.empty(4, 8, 1, 1, 1).to(
        memory_format=torch.channels_last_3d)) == torch.channels_last_3d


def test_integer_likes_torch_accepts_are_accepted():
    np = pytest.importorskip("numpy")
    x, w = torch.randn(2, 4, 9, 9, dtype=torch.float64), torch.randn(6, 2, 3, 3, dtype=torch.float64)
    kwargs = dict(stride=(np.int32(2), 1), padding=np.int64(1), dilation=torch.Size([1, 2]), groups=np.int64(2))
    torch.testing.assert_close(cgt.conv2d(x, w, **kwargs), F.conv2d(x, w, **kwargs))
    ours = cgt.Conv2d(4, 6, 3, stride=np.int64(2), padding=np.int64(1)).double()  # torch's _pair keeps numpy ints
    torch.testing.assert_close(ours(x), F.conv2d(x, ours.weight, ours.bias, stride=2, padding=1))
    with pytest.raises(ValueError, match="stride=2.0"):
        cgt.conv2d(x, w, stride=2.0, groups=2)


def test_torch_compile_fullgraph_traces_the_registered_op_without_graph_breaks():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = cgt.Conv2d(4, 8, 3, padding="same", activation="gelu")  # gelu: pre-activation path
            self.b = cgt.Conv2d(8, 8, 3, padding=1, stride=(2, 1), activation="relu")

        def forward(self, x, z):
            return self.b(self.a(x), residual=z).sum()

    torch.manual_seed(0)
    model = Block().double()
    x, z = torch.randn(2, 4, 10, 10, dtype=torch.float64), torch.randn(2, 8, 5, 10, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, z), model(x, z)
    torch.testing.assert_close(got, want)
    (got_w,), (want_w,) = torch.autograd.grad(got, model.a.weight), torch.autograd.grad(want, model.a.weight)
    torch.testing.assert_close(got_w, want_w)
    cgt.conv2d(x, model.a.weight, padding=2, dilation=2)  # a new config eagerly: the compiled graph stays valid
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(x, z), want)


def test_torch_func_transforms_run_through_torchs_conv():
    """grad, vmap, per-sample gradients (vmap of grad), jacrev and functional_call: what torch's conv does."""
    torch.manual_seed(1)
    x, w = torch.randn(3, 4, 8, 8, dtype=torch.float64), torch.randn(6, 4, 3, 3, dtype=torch.float64)

    def results(conv):
        return (torch.func.grad(lambda w: conv(x, w, padding=1).square().sum())(w),
                torch.func.vmap(lambda xi: conv(xi, w, padding=1))(x),  # unbatched samples under vmap
                torch.func.vmap(torch.func.grad(lambda w, xi: conv(xi[None], w, padding=1).tanh().sum()),
                                in_dims=(None, 0))(w, x),
                torch.func.jacrev(lambda xx: conv(xx, w, padding=1).sum((2, 3)))(x[:1]))

    for got, want in zip(results(cgt.conv2d), results(F.conv2d)):
        torch.testing.assert_close(got, want)
    ours = cgt.Conv2d(4, 6, 3, padding=1, padding_mode="reflect", activation="relu").double()
    theirs = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"), torch.nn.ReLU()).double()
    theirs[0].load_state_dict(ours.state_dict())
    got = torch.func.grad(lambda p: torch.func.functional_call(ours, p, (x,)).sum())(dict(ours.named_parameters()))
    want = torch.func.grad(lambda p: torch.func.functional_call(theirs, p, (x,)).sum())(dict(theirs.named_parameters()))
    torch.testing.assert_close(got["weight"], want["0.weight"])
    torch.testing.assert_close(got["bias"], want["0.bias"])


def test_torch_export_keeps_the_registered_op():
    model = torch.nn.Sequential(cgt.Conv2d(4, 6, 3, padding=1, activation="relu"), cgt.Conv2d(6, 6, 2, padding="same"))
    x = torch.randn(2, 4, 8, 8)
    program = torch.export.export(model.eval(), (x,))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.cudnn_graphs.conv_fwd.default] * 2
    torch.testing.assert_close(program.module()(x), model(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_runs_in_its_dtype_as_torchs_conv(dtype):
    x, w, b = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(6)
    with torch.autocast("cpu", dtype=dtype):
        want = F.conv2d(x, w, b, padding=1)
        got = cgt.conv2d(x, w, b, padding=1)
        module = cgt.Conv2d(4, 6, 3)(x)
    assert got.dtype == want.dtype == module.dtype == dtype
    torch.testing.assert_close(got, want)
