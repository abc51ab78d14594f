"""CPU: requests infer the spec from their buffers (shape, dtype, layout from strides, groups)."""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_graphs as cg
from cudnn_graphs import BufferMismatchError, ConvBwdDataRequest, ConvBwdFilterRequest, ConvFwdRequest, SpecError
from gpu_launch import buffers
from cudnn_graphs.spec import geometry

_TYPESTR = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "bfloat16": "<V2"}


class FakeCuda:
    """A CUDA-array-interface object with any shape and strides; its pointer is never dereferenced."""

    def __init__(self, shape, *, dtype="float16", layout="channels_first", strides=None, ptr=1 << 20):
        self.shape = tuple(shape)
        itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
        strides = strides or geometry.packed_strides(self.shape, layout)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": _TYPESTR[dtype], "data": (ptr, False),
                                         "strides": tuple(s * itemsize for s in strides), "version": 3}
        self.dtype = dtype


def test_fwd_infers_shapes_dtype_layout_bias_and_residual():
    x = FakeCuda((2, 8, 10, 12), layout="channels_last")
    w = FakeCuda((16, 8, 3, 3), layout="channels_last")
    spec = ConvFwdRequest(x, w, bias=FakeCuda((16,)), z=FakeCuda((2, 16, 10, 12), layout="channels_last"),
                          padding=1, activation="relu").spec()
    assert spec == cg.ConvFwdSpec((2, 8, 10, 12), (16, 8, 3, 3), padding=1, dtype="float16",
                                  layout="channels_last", bias=True, residual=True, activation="relu")


def test_fwd_infers_groups_like_pytorch():
    spec = ConvFwdRequest(FakeCuda((1, 32, 7, 7)), FakeCuda((32, 1, 3, 3)), padding=1).spec()
    assert spec.groups == 32
    spec = ConvFwdRequest(FakeCuda((1, 32, 7, 7)), FakeCuda((64, 8, 3, 3)), padding=1).spec()
    assert spec.groups == 4


def test_groups_given_that_contradict_the_weight_raise():
    with pytest.raises(SpecError) as err:
        ConvFwdRequest(FakeCuda((1, 32, 7, 7)), FakeCuda((64, 8, 3, 3)), groups=2).spec()
    assert err.value.field == "w_shape"


def test_non_packed_buffer_gets_explicit_strides():
    # x is a channel slice of a bigger NCHW tensor: strides of the parent, not packed.
    parent = (2, 16, 9, 9)
    x = FakeCuda((2, 8, 9, 9), strides=geometry.packed_strides(parent, "channels_first"))
    spec = ConvFwdRequest(x, FakeCuda((4, 8, 1, 1))).spec()
    assert spec.layout == "channels_first"
    assert dict(spec.strides) == {"x": (16 * 81, 81, 9, 1)}
    assert spec.tensors()["x"].strides == (16 * 81, 81, 9, 1)


def test_mixed_layouts_keep_the_primary_layout_and_describe_the_other():
    x = FakeCuda((2, 8, 5, 5), layout="channels_last")
    w = FakeCuda((4, 8, 3, 3), layout="channels_first")
    spec = ConvFwdRequest(x, w, padding=1).spec()
    assert spec.layout == "channels_last"
    assert dict(spec.strides) == {"w": geometry.packed_strides((4, 8, 3, 3), "channels_first")}


def test_size_one_dims_do_not_confuse_layout():
    # A 1x1 image is both channels_first and channels_last; frameworks pick arbitrary strides there.
    x = FakeCuda((4, 8, 1, 1), strides=(8, 1, 8, 8))
    spec = ConvFwdRequest(x, FakeCuda((16, 8, 1, 1))).spec()
    assert spec.strides == ()


def test_dtype_comes_from_the_buffers():
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        spec = ConvFwdRequest(FakeCuda((1, 4, 5, 5), dtype=dtype), FakeCuda((4, 4, 1, 1), dtype=dtype)).spec()
        assert spec.dtype == dtype


@pytest.mark.parametrize("stride,padding,dilation,k,size", [(1, 1, 1, 3, 9), (2, 1, 1, 3, 9), (2, 0, 2, 3, 11),
                                                            (3, (1, 2), 1, 4, 10)])
def test_dgrad_smallest_input_reproduces_dy(stride, padding, dilation, k, size):
    fwd = cg.ConvFwdSpec((2, 6, size, size), (8, 6, k, k), stride=stride, padding=padding, dilation=dilation)
    req = ConvBwdDataRequest(FakeCuda(fwd.y_shape), FakeCuda(fwd.w_shape), stride=stride, padding=padding,
                             dilation=dilation)
    spec = req.spec()
    assert spec.dy_shape == fwd.y_shape
    x = spec.x_shape
    assert x[:2] == (2, 6) and x[2] <= size and (size - x[2]) < stride


def test_dgrad_input_size_from_dx_or_x_shape_wins():
    fwd = cg.ConvFwdSpec((2, 6, 10, 10), (8, 6, 3, 3), stride=2, padding=1)
    dy, w = FakeCuda(fwd.y_shape), FakeCuda(fwd.w_shape)
    assert ConvBwdDataRequest(dy, w, dx=FakeCuda((2, 6, 10, 10)), stride=2, padding=1).spec().x_shape == (2, 6, 10, 10)
    assert ConvBwdDataRequest(dy, w, x_shape=(2, 6, 10, 10), stride=2, padding=1).spec().x_shape == (2, 6, 10, 10)


def test_dgrad_groups_and_pre_act():
    fwd = cg.ConvFwdSpec((1, 8, 6, 6), (8, 2, 3, 3), groups=4, padding="same")
    req = ConvBwdDataRequest(FakeCuda(fwd.y_shape), FakeCuda(fwd.w_shape), pre_act=FakeCuda((1, 8, 6, 6)),
                             padding="same", activation_backward="relu")
    spec = req.spec()
    assert (spec.groups, spec.x_shape, spec.has_epilogue) == (4, (1, 8, 6, 6), True)
    spec = ConvBwdDataRequest(FakeCuda(fwd.y_shape), FakeCuda(fwd.w_shape), padding="same", groups=4).spec()
    assert spec.x_shape == (1, 8, 6, 6)


def test_wgrad_filter_from_dw_w_shape_or_sizes():
    x, dy = FakeCuda((2, 4, 9, 9)), FakeCuda((2, 8, 9, 9))
    assert ConvBwdFilterRequest(x, dy, padding=1).spec().w_shape == (8, 4, 3, 3)
    assert ConvBwdFilterRequest(x, dy, padding=2, dilation=2).spec().w_shape == (8, 4, 3, 3)
    assert ConvBwdFilterRequest(x, dy, dw=FakeCuda((8, 2, 3, 3)), padding=1).spec().groups == 2
    spec = ConvBwdFilterRequest(x, dy, w_shape=(8, 4, 3, 3), padding=1, db=FakeCuda((8,))).spec()
    assert spec.bias_grad and spec.groups == 1


def test_wgrad_ambiguous_filter_asks_for_w_shape():
    with pytest.raises(SpecError) as err:
        ConvBwdFilterRequest(FakeCuda((2, 4, 9, 9)), FakeCuda((2, 8, 5, 5)), stride=2, padding=1).spec()
    assert err.value.field == "w_shape" and "pass dw or w_shape" in str(err.value)


def test_raw_pointers_cannot_describe_a_request():
    with pytest.raises(BufferMismatchError) as err:
        ConvFwdRequest(12345, FakeCuda((4, 4, 1, 1)))
    assert (err.value.role, err.value.what) == ("x", "type")


def test_cpu_dlpack_buffer_is_refused_by_device():
    with pytest.raises(BufferMismatchError) as err:
        ConvFwdRequest(np.zeros((1, 4, 3, 3), np.float32), FakeCuda((4, 4, 1, 1), dtype="float32"))
    assert (err.value.role, err.value.what) == ("x", "device")


def test_unknown_object_is_refused_by_type():
    with pytest.raises(BufferMismatchError) as err:
        ConvFwdRequest([[1.0]], FakeCuda((4, 4, 1, 1)))
    assert err.value.what == "type" and "list" in str(err.value)


def test_dlpack_view_reads_shape_strides_dtype_and_offset():
    from gpu_launch import dlpack

    base = np.arange(2 * 6 * 4 * 5, dtype=np.float64).reshape(2, 6, 4, 5)
    sliced = base[:, 2:5, :, ::2]
    view = dlpack.view(sliced, stream=None)
    assert view.shape == sliced.shape
    assert view.strides == tuple(s // 8 for s in sliced.strides)
    assert view.dtype == "float64" and view.device_type == dlpack.KDL_CPU
    assert view.ptr == sliced.__array_interface__["data"][0]


def test_framework_of_each_kind():
    assert buffers.framework_of(7) == "pointer"
    assert buffers.framework_of(FakeCuda((1, 1, 1))) == "cai"
    assert buffers.framework_of(np.zeros(2)) == "dlpack"
    assert buffers.framework_of(object()) == "unknown"


def test_session_run_refuses_buffers_on_another_device(monkeypatch):
    session = cg.Session(device=1)
    req = ConvFwdRequest(FakeCuda((1, 4, 3, 3)), FakeCuda((4, 4, 1, 1)))
    with pytest.raises(BufferMismatchError) as err:
        session.run(req)
    assert (err.value.what, err.value.expected, err.value.got) == ("device", 1, 0)


def test_per_device_sessions_key_plans_on_their_own_gpu(monkeypatch, fake_env):
    """Plans are per device: two GPUs of different models never share a signature."""
    import dataclasses

    from cudnn_graphs.plan import session as session_mod

    envs = {0: fake_env, 1: dataclasses.replace(fake_env, gpu_name="NVIDIA A100-SXM4-80GB",
                                                compute_capability=(8, 0), sm_count=108)}
    monkeypatch.setattr(session_mod, "environment", lambda device, **kw: dataclasses.replace(envs[device], **kw))
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    s0, s1 = cg.Session(device=0), cg.Session(device=1)
    assert s0.signature(spec) != s1.signature(spec)
    assert s0.handles is not s1.handles and s1.handles.device == 1
    assert cg.default_session(0) is cg.default_session(0)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "0"])
def test_session_device_must_be_an_ordinal(bad):
    with pytest.raises(ValueError, match="device"):
        cg.Session(device=bad)


def test_spec_memo_tells_apart_what_changes_the_spec():
    x, w = FakeCuda((1, 4, 6, 6)), FakeCuda((4, 4, 3, 3))
    a = ConvFwdRequest(x, w, padding=1).spec()
    assert ConvFwdRequest(FakeCuda((1, 4, 6, 6), ptr=1 << 30), w, padding=1).spec() is a  # memo hit
    assert ConvFwdRequest(x, w, padding=0).spec().y_shape == (1, 4, 4, 4)
    assert ConvFwdRequest(x, w, padding=1, activation="relu").spec().activation.name == "relu"
    assert ConvFwdRequest(FakeCuda((1, 4, 6, 6), layout="channels_last"), w, padding=1).spec() != a
    dy = FakeCuda((1, 4, 3, 3))
    assert ConvBwdDataRequest(dy, w, stride=2, padding=1).spec().x_shape == (1, 4, 5, 5)
    assert ConvBwdDataRequest(dy, w, stride=2, padding=1, x_shape=(1, 4, 6, 6)).spec().x_shape == (1, 4, 6, 6)


def test_an_input_packed_both_ways_takes_a_channels_last_weights_layout_as_torch_does():
    x = FakeCuda((2, 1, 9, 9))  # one input channel (a grayscale first layer): both layouts fit x
    spec = ConvFwdRequest(x, FakeCuda((8, 1, 3, 3), layout="channels_last"), padding=1).spec()
    assert spec.layout == "channels_last" and not spec.strides
    assert ConvFwdRequest(x, FakeCuda((8, 1, 3, 3)), padding=1).spec().layout == "channels_first"
    wgrad = ConvBwdFilterRequest(x, FakeCuda((2, 8, 9, 9), layout="channels_last"), padding=1).spec()
    assert wgrad.layout == "channels_last" and not wgrad.strides
    double = ConvFwdRequest(FakeCuda((2, 1, 9, 9), dtype="float64"),
                            FakeCuda((8, 1, 3, 3), dtype="float64", layout="channels_last"), padding=1).spec()
    assert double.layout == "channels_first"  # torch lays float64 convs out channels_first
