"""GPU: requests and helpers, DLPack-only buffers, CUDA-graph replay, workspace limits, plan reports."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cudnn_graphs as cg  # noqa: E402
from cudnn_graphs import BufferMismatchError, ConvFwdRequest  # noqa: E402

from . import gpu_reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last


@pytest.fixture(scope="module")
def session():
    return cg.Session(allow_tf32=False)


def _rand(*shape, dtype=torch.float16, memory_format=torch.contiguous_format):
    return torch.randn(*shape, device="cuda", dtype=torch.float64).to(dtype).contiguous(memory_format=memory_format)


def _err(got, want):
    return ref.rel_err(got, want)


@pytest.mark.parametrize("dtype, fmt", [(torch.float16, CL), (torch.bfloat16, torch.contiguous_format),
                                        (torch.float32, torch.contiguous_format), (torch.float64, CL)])
def test_conv_fwd_helper_matches_torch_and_keeps_layout(session, dtype, fmt):
    x, w, b = _rand(4, 16, 13, 11, dtype=dtype, memory_format=fmt), _rand(32, 8, 3, 3, dtype=dtype, memory_format=fmt), _rand(32, dtype=dtype)
    y = cg.conv_fwd(x, w, b, stride=2, padding=1, groups=2, activation="relu", session=session)
    want = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride=2, padding=1, groups=2))
    assert y.dtype == dtype and y.shape == want.shape
    assert y.is_contiguous(memory_format=fmt)
    assert _err(y, want) < ref.TOLERANCE[str(dtype).removeprefix("torch.")]


def test_run_with_given_output_and_residual(session):
    x, w = _rand(2, 8, 9, 9, memory_format=CL), _rand(8, 8, 3, 3, memory_format=CL)
    z = _rand(2, 8, 9, 9, memory_format=CL)
    y = torch.full_like(z, float("nan"))
    out = cg.run(ConvFwdRequest(x, w, y=y, z=z, padding="same", alpha=0.5, beta=2.0, residual=True,
                                activation="silu"), session=session)
    assert out is y
    want = F.silu(0.5 * F.conv2d(x.double(), w.double(), padding="same") + 2.0 * z.double())
    assert _err(y, want) < ref.TOLERANCE["float16"]


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_bwd_data_helper_with_activation(session, stride):
    x = _rand(2, 8, 10, 10, memory_format=CL).requires_grad_(False)
    w = _rand(16, 8, 3, 3, memory_format=CL)
    pre = _rand(2, 8, 10, 10, memory_format=CL)
    dy = _rand(2, 16, *F.conv2d(x, w, stride=stride, padding=1).shape[2:], memory_format=CL)
    dx = cg.conv_bwd_data(dy, w, pre_act=pre, stride=stride, padding=1, activation_backward="gelu", session=session)
    xd = torch.zeros(x.shape, dtype=torch.float64, device="cuda", requires_grad=True)
    F.conv2d(xd, w.double(), stride=stride, padding=1).backward(dy.double())
    p = pre.double().requires_grad_(True)
    F.gelu(p).backward(xd.grad)
    assert dx.shape == x.shape and dx.is_contiguous(memory_format=CL)
    assert _err(dx, p.grad) < ref.TOLERANCE["float16"]


def test_conv_bwd_filter_helper_returns_dw_and_db(session):
    x, dy = _rand(4, 8, 12, 12, dtype=torch.float32), _rand(4, 16, 12, 12, dtype=torch.float32)
    dw, db = cg.conv_bwd_filter(x, dy, padding=1, bias_grad=True, session=session)
    wd = torch.zeros(16, 8, 3, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    F.conv2d(x.double(), wd, padding=1).backward(dy.double())
    assert dw.shape == (16, 8, 3, 3)
    assert _err(dw, wd.grad) < ref.TOLERANCE["float32"]
    assert _err(db, dy.double().sum((0, 2, 3))) < ref.TOLERANCE["float32"]


def test_cupy_request_allocates_cupy_outputs(session):
    cupy = pytest.importorskip("cupy")
    x, w = _rand(2, 4, 8, 8, dtype=torch.float32), _rand(4, 4, 3, 3, dtype=torch.float32)
    y = cg.run(ConvFwdRequest(cupy.from_dlpack(x), cupy.from_dlpack(w), padding=1), session=session)
    assert isinstance(y, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    assert _err(torch.from_dlpack(y), F.conv2d(x.double(), w.double(), padding=1)) < 1e-5


class DLPackOnly:
    """Exposes a tensor through the DLPack protocol alone, as JAX and others do."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, stream=None):
        return self._t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_dlpack_only_buffers(session):
    spec = cg.ConvFwdSpec((2, 8, 9, 9), (8, 8, 3, 3), padding=1, dtype="bfloat16", layout="channels_last", bias=True)
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    bufs["y"].fill_(float("nan"))
    session.plan(spec).execute(**{r: DLPackOnly(t) for r, t in bufs.items()})
    torch.cuda.synchronize()
    assert _err(bufs["y"], ref.fwd(spec, bufs)) < ref.TOLERANCE["bfloat16"]
    bad = dict(bufs, x=DLPackOnly(bufs["x"].float()))
    with pytest.raises(BufferMismatchError) as err:
        session.plan(spec).execute(**{r: b if r == "x" else DLPackOnly(b) for r, b in bad.items()})
    assert err.value.what == "dtype"


@pytest.mark.parametrize("fused", [True, False])
def test_cuda_graph_capture_replays_with_new_data(fused):
    session = cg.Session(allow_tf32=False, fuse=fused)
    spec = cg.ConvFwdSpec((2, 16, 12, 12), (32, 16, 3, 3), padding=1, dtype="float16", layout="channels_last",
                          bias=True, activation="gelu")
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = session.plan(spec).bind(**bufs).capture()
        for _ in range(2):
            assert _rerun_err(spec, bufs, graph.replay, side) < ref.TOLERANCE["float16"]


def _rerun_err(spec, bufs, run, stream) -> float:
    """Fresh inputs in the same memory, a poisoned output, `run()`, then the forward's error."""
    bufs["x"].copy_(torch.randn_like(bufs["x"], dtype=torch.float32))
    bufs["y"].fill_(float("nan"))
    run()
    stream.synchronize()
    return _err(bufs["y"], ref.fwd(spec, bufs))


@pytest.mark.parametrize("fused", [True, False])
def test_bound_launch_replays_a_graph_from_the_second_launch(fused):
    session = cg.Session(allow_tf32=False, fuse=fused)
    spec = cg.ConvFwdSpec((2, 16, 12, 12), (32, 16, 3, 3), padding=1, dtype="float16", layout="channels_last",
                          bias=True, activation="silu")
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        bound = session.plan(spec).bind(**bufs)
        for i in range(4):
            assert _rerun_err(spec, bufs, bound.launch, side) < ref.TOLERANCE["float16"], i
            assert (bound._replay is not None) == (i >= 1)
        # Inside the caller's own capture, launch() records its calls into their graph instead.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            bound.launch()
        assert _rerun_err(spec, bufs, graph.replay, side) < ref.TOLERANCE["float16"]
    never = session.plan(spec).bind(cuda_graph=False, **bufs)
    for _ in range(3):
        never.launch()
    assert never._replay is None


def test_max_workspace_bytes_excludes_plans():
    # wgrad on a large image: the default plan wants a workspace; a zero limit must pick one that doesn't.
    spec = cg.ConvBwdFilterSpec((8, 64, 56, 56), (8, 64, 56, 56), (64, 64, 3, 3), padding=1, dtype="float32",
                                allow_tf32=False)
    default = cg.Session(allow_tf32=False).plan(spec)
    limited = cg.Session(allow_tf32=False, max_workspace_bytes=0).plan(spec)
    assert limited.workspace_size == 0
    if default.workspace_size == 0:
        pytest.skip(f"the default plan {default.engines} needs no workspace on this GPU")
    assert limited.engines != default.engines
    bufs = {r: ref.random(d) for r, d in spec.tensors().items()}
    bufs["dw"].fill_(float("nan"))
    limited.execute(**bufs)
    torch.cuda.synchronize()
    assert _err(bufs["dw"], ref.wgrad(spec, bufs)["dw"]) < 1e-5


def test_plan_reports_engine_notes_and_determinism(session):
    spec = cg.ConvFwdSpec((2, 16, 12, 12), (32, 16, 3, 3), padding=1, dtype="float16", layout="channels_last",
                          bias=True, activation="relu")
    report = session.plan(spec).describe()
    part = report["parts"][0]
    assert isinstance(part["engine_id"], int) and isinstance(part["knobs"], dict)
    assert part["numerical_notes"] is not None, "the note probe did not recognise the frontend's answers"
    assert "TENSOR_CORE" in part["numerical_notes"]  # fp16 conv on Hopper runs on tensor cores
    assert report["deterministic"] is ("NONDETERMINISTIC" not in part["numerical_notes"])
    det = cg.Session(deterministic=True).plan(cg.ConvBwdFilterSpec((4, 32, 28, 28), (4, 32, 28, 28), (32, 32, 3, 3),
                                                                   padding=1, dtype="float16"))
    assert det.deterministic is True and "NONDETERMINISTIC" not in (det.parts[0].numerical_notes or ())
