"""GPU: the call path (functional helpers, requests, plan.execute, bound launches) in steady state:
no device synchronisation, fresh data through every path (direct, captured, replayed), typed errors."""

from __future__ import annotations

import gc
import itertools
import logging
import time

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cudnn_graphs as cg  # noqa: E402
import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.plan import resident  # noqa: E402
from gpu_launch import replay  # noqa: E402
from cudnn_graphs import BufferMismatchError, ConvBwdDataRequest, ConvFwdRequest  # noqa: E402

from . import gpu_reference as ref  # noqa: E402
from .collector import cyclic_garbage  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last


@pytest.fixture(scope="module")
def session():
    return cg.Session(allow_tf32=False)


def _rand(*shape, dtype=torch.float16, memory_format=CL):
    t = torch.randn(*shape, device="cuda", dtype=torch.float64).to(dtype)
    return t.contiguous(memory_format=memory_format) if t.dim() == 4 else t


def _entry_points(session, *, n=8, c=32, hw=14):
    """Every public conv entry point on one geometry, as no-argument calls (plans built first)."""
    x, w, b = _rand(n, c, hw, hw), _rand(c, c, 3, 3) * 0.1, _rand(c)
    dy, y = _rand(n, c, hw, hw), torch.empty_like(x)
    spec = cg.ConvFwdSpec(x.shape, w.shape, padding=1, dtype="float16", layout="channels_last", bias=True,
                          activation="relu")
    plan = session.plan(spec)
    bound = plan.bind(x=x, w=w, bias=b, y=y)
    conv = cgt.Conv2d(c, c, 3, padding=1, activation="relu").cuda().half().to(memory_format=CL)
    xr = x.detach().clone().requires_grad_(True)

    def module_inference():
        with torch.no_grad():
            conv(x)

    xs = [_rand(n, c, hw, hw) for _ in range(3)]
    ys = [torch.empty_like(x) for x in xs]
    turn = itertools.count()

    def rotating():  # a new pointer set each call: the re-pointed graph rewrites its arguments each time
        i = next(turn) % len(xs)
        cg.conv_fwd(xs[i], w, b, y=ys[i], padding=1, activation="relu", session=session)

    return {
        "conv_fwd": lambda: cg.conv_fwd(x, w, b, padding=1, activation="relu", session=session),
        "conv_fwd_out": lambda: cg.conv_fwd(x, w, b, y=y, padding=1, activation="relu", session=session),
        "conv_fwd_rotating_buffers": rotating,
        "conv_bwd_data": lambda: cg.conv_bwd_data(dy, w, x_shape=x.shape, padding=1, session=session),
        "conv_bwd_data_relu": lambda: cg.conv_bwd_data(dy, w, pre_act=x, padding=1, activation_backward="relu",
                                                       session=session),
        "conv_bwd_filter": lambda: cg.conv_bwd_filter(x, dy, w_shape=w.shape, padding=1, session=session),
        "conv_bwd_filter_bias": lambda: cg.conv_bwd_filter(x, dy, w_shape=w.shape, padding=1, bias_grad=True,
                                                           session=session),
        "session_run": lambda: session.run(ConvFwdRequest(x, w, bias=b, padding=1, activation="relu")),
        "module_run": lambda: cg.run(ConvBwdDataRequest(dy, w, x_shape=x.shape, padding=1)),
        "plan_execute": lambda: plan.execute(x=x, w=w, bias=b, y=y),
        "bound_launch": bound.launch,
        "torch_module_inference": module_inference,
        "torch_module_fwd_bwd": lambda: torch.autograd.backward(conv(xr), dy),
    }


def test_no_device_synchronisation_on_any_call_path(session):
    calls = _entry_points(session)
    for fn in calls.values():  # first sight plans, the second records: steady state after
        for _ in range(3):
            fn()
            torch.cuda.synchronize()
    gc.collect()  # earlier tests let plans go on purpose (resident.forget): not this test's business
    torch.cuda.synchronize()
    for name, fn in calls.items():
        host_s, busy, per_call = ref.queued_calls(fn, 20)
        assert busy and host_s < 0.25, (f"{name}: 20 calls took {host_s:.3f} s of host time and the GPU "
                                        f"{'was still busy' if busy else 'drained: a call synchronised'}; "
                                        f"ms per call: {per_call}")


def _graphs_recorded():
    return sum(launcher.captures for plan in list(resident._plans.values())
               for launcher in list(plan._launchers.values()))


def test_graphs_are_recorded_behind_queued_work_without_waiting_for_it(monkeypatch):
    """A training loop's stream never idles: each entry point's second call (which records its graph)
    is made behind a queued second of GPU work, on a geometry no other test plans (fresh launchers)."""
    monkeypatch.setattr(replay, "_behind_work", True)  # what earlier tests' recordings did is not this test's
    calls = _entry_points(cg.Session(allow_tf32=False), n=4, c=40, hw=12)
    for fn in calls.values():
        fn()  # first sight: plans, runs directly
    torch.cuda.synchronize()
    before = _graphs_recorded()
    for name, fn in calls.items():
        host_s, busy, per_call = ref.queued_calls(fn, 10)
        assert busy and host_s < 0.25, (f"{name}: 10 calls (the second records) took {host_s:.3f} s of host "
                                        f"time; GPU {'still busy' if busy else 'drained'}; ms per call: {per_call}")
    assert replay._behind_work, "a recording waited for queued work"
    assert _graphs_recorded() - before >= len(calls) // 2, "expected graphs recorded behind the queued work"


def test_letting_go_of_sessions_and_plans_never_waits_for_the_gpu(tmp_path, monkeypatch):
    """Destroying a runtime-fused cuDNN plan waits for the whole GPU (measured on cuDNN 9.19): the
    process keeps every plan, so a dropped session or an evicted plan costs nothing, and a later
    session gets the plan without reading the disk."""
    monkeypatch.setenv(cg.config.MEMORY_CACHE_SIZE, "1")  # every new spec evicts the last one
    x, w = _rand(3, 24, 9, 9), _rand(24, 24, 3, 3) * 0.1  # a geometry no other test plans
    dy = _rand(3, 24, 9, 9)
    session = cg.Session(cache=tmp_path)
    for act in ("relu", "gelu"):  # dgrad fused with act' on a runtime-compiled engine
        for _ in range(3):
            cg.conv_bwd_data(dy, w, pre_act=x, padding=1, activation_backward=act, session=session)
    gc.collect()  # earlier tests' garbage (plans they let go of on purpose) is not this test's
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(int(2e9))
    del session
    gc.collect()
    host_s = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and host_s < 0.5, f"letting go of a session took {host_s:.3f} s; GPU still busy: {busy}"
    again = cg.Session(cache=tmp_path)
    got = cg.conv_bwd_data(dy, w, pre_act=x, padding=1, activation_backward="relu", session=again)
    xd = x.double()
    want = torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), padding=1) * (xd > 0)
    assert ref.rel_err(got, want) < ref.TOLERANCE["float16"]
    stats = again.counters()
    assert (stats["memory_hits"], stats["disk_hits"], stats["builds"]) == (1, 0, 0), stats


def test_a_loaded_plan_runs_rotating_buffers_on_kept_variant_packs(tmp_path):
    """A plan loaded through the backend API keeps a finalized variant pack per pointer set (64 at
    most): 70 output buffers in rotation, twice around, then new data in a recurring set, all right."""
    xs, w = [_rand(4, 16, 10, 10) for _ in range(3)], _rand(24, 16, 3, 3) * 0.1
    spec = cg.ConvFwdSpec(xs[0].shape, w.shape, padding=1, dtype="float16", layout="channels_last")
    cg.Session(cache=tmp_path).plan(spec)
    resident.forget()  # the next session loads from disk, as a fresh process would
    plan = cg.Session(cache=tmp_path).plan(spec)
    assert plan.parts[0].backend is not None, "expected the backend-API load path"
    ys = [torch.empty(4, 24, 10, 10, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
          for _ in range(70)]
    tol = ref.TOLERANCE["float16"]

    def run_and_check(i):
        ys[i].fill_(float("nan"))
        plan.bind(x=xs[i % 3], w=w, y=ys[i], cuda_graph=False).launch()
        want = F.conv2d(xs[i % 3].double(), w.double(), padding=1)
        assert ref.rel_err(ys[i], want) < tol, f"buffer {i}"

    for _ in range(2):
        for i in range(len(ys)):
            run_and_check(i)
    xs[0].copy_(_rand(4, 16, 10, 10))  # same pointers, new values: a kept pack reads the new data
    run_and_check(3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_repeated_functional_calls_compute_fresh_data(session, dtype):
    """Direct on first sight, captured on the second, replayed after: each with new inputs and outputs."""
    x, w, b = _rand(4, 16, 12, 12, dtype=dtype), _rand(24, 16, 3, 3, dtype=dtype), _rand(24, dtype=dtype)
    y = torch.empty(4, 24, 6, 6, device="cuda", dtype=dtype).contiguous(memory_format=CL)
    tol = ref.TOLERANCE[str(dtype).removeprefix("torch.")]
    for i in range(5):
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        y.fill_(float("nan"))
        got = cg.conv_fwd(x, w, b, y=y if i % 2 else None, stride=2, padding=1, activation="silu", session=session)
        want = F.silu(F.conv2d(x.double(), w.double(), b.double(), stride=2, padding=1))
        assert got.shape == want.shape and got.is_contiguous(memory_format=CL)
        assert ref.rel_err(got, want) < tol, i
        dy = _rand(*want.shape, dtype=dtype)
        dx = cg.conv_bwd_data(dy, w, x_shape=x.shape, stride=2, padding=1, session=session)
        dw, db = cg.conv_bwd_filter(x, dy, w_shape=w.shape, stride=2, padding=1, bias_grad=True, session=session)
        xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
        F.conv2d(xd, wd, stride=2, padding=1).backward(dy.double())
        assert ref.rel_err(dx, xd.grad) < tol and ref.rel_err(dw, wd.grad) < tol
        assert ref.rel_err(db, dy.double().sum((0, 2, 3))) < tol


def test_memo_tells_geometries_and_params_apart(session):
    x, w = _rand(2, 8, 10, 10), _rand(8, 8, 3, 3)
    for padding, stride, act in [(1, 1, "relu"), (0, 1, "relu"), (1, 2, "relu"), (1, 1, None), ((1, 1), 1, "relu")]:
        got = cg.conv_fwd(x, w, padding=padding, stride=stride, activation=act, session=session)
        want = F.conv2d(x.double(), w.double(), padding=padding, stride=stride)
        want = F.relu(want) if act else want
        assert ref.rel_err(got, want) < ref.TOLERANCE["float16"], (padding, stride, act)
    x2 = _rand(2, 8, 10, 10, memory_format=torch.contiguous_format)  # same shape, other strides
    got = cg.conv_fwd(x2, w, padding=1, session=session)
    assert ref.rel_err(got, F.conv2d(x2.double(), w.double(), padding=1)) < ref.TOLERANCE["float16"]


def test_typed_errors_survive_the_memo(session):
    x, w = _rand(2, 8, 10, 10), _rand(8, 8, 3, 3)
    cg.conv_fwd(x, w, padding=1, session=session)
    with pytest.raises(cg.SpecError):
        cg.conv_fwd(x, w, padding=1.0, session=session)  # equal to 1, but not an int
    with pytest.raises(cg.SpecError):
        cg.conv_fwd(x, w, padding=-1, session=session)
    with pytest.raises(BufferMismatchError) as err:
        cg.conv_fwd(x.float(), w, padding=1, session=session)
    with pytest.raises(BufferMismatchError) as err:
        cg.conv_fwd(x.cpu(), w.cpu(), padding=1)
    assert err.value.what == "device"
    flat = torch.empty(x.numel() + 1, device="cuda", dtype=torch.float16)
    shifted = flat[1:].view(2, 10, 10, 8).permute(0, 3, 1, 2)  # channels_last, 2 bytes off alignment
    spec = cg.ConvFwdSpec(x.shape, w.shape, padding=1, dtype="float16", layout="channels_last")
    with pytest.raises(BufferMismatchError) as err:  # an explicit plan takes buffers as they are
        session.plan(spec).execute(x=shifted, w=w, y=torch.empty_like(x))
    assert (err.value.role, err.value.what) == ("x", "alignment")


def test_views_at_any_offset_work_as_in_torch(session):
    """cuDNN graphs need 16-byte aligned pointers; the call path copies what is not, as torch accepts it."""
    x, w = _rand(2, 8, 10, 10), _rand(8, 8, 3, 3)
    flat = torch.empty(2 * x.numel() + 1, device="cuda", dtype=torch.float16)
    xs = flat[1:x.numel() + 1].view(2, 10, 10, 8).permute(0, 3, 1, 2)  # channels_last, 2 bytes off alignment
    ys = flat[x.numel() + 1:].view(2, 10, 10, 8).permute(0, 3, 1, 2)
    for _ in range(3):
        xs.copy_(torch.randn_like(x))
        ys.fill_(float("nan"))
        out = cg.conv_fwd(xs, w, y=ys, padding=1, activation="relu", session=session)
        assert out is ys
        assert ref.rel_err(ys, F.relu(F.conv2d(xs.double(), w.double(), padding=1))) < ref.TOLERANCE["float16"]
    dy = _rand(2, 8, 10, 10)
    dw = cg.conv_bwd_filter(xs, dy, w_shape=w.shape, padding=1, session=session)
    wd = w.double().requires_grad_(True)
    F.conv2d(xs.double(), wd, padding=1).backward(dy.double())
    assert ref.rel_err(dw, wd.grad) < ref.TOLERANCE["float16"]


def test_a_replayed_call_inside_the_callers_capture_records_its_kernels(session):
    x, w, b = _rand(2, 16, 8, 8), _rand(16, 16, 3, 3), _rand(16)
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the call path now holds a graph for these pointers
            cg.conv_fwd(x, w, b, y=y, padding=1, activation="relu", session=session)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            cg.conv_fwd(x, w, b, y=y, padding=1, activation="relu", session=session)
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
    side.synchronize()
    want = F.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))
    assert ref.rel_err(y, want) < ref.TOLERANCE["float16"]


def test_explicit_stream_and_cupy_buffers(session):
    cupy = pytest.importorskip("cupy")
    x, w = _rand(2, 8, 9, 9, dtype=torch.float32), _rand(8, 8, 3, 3, dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        y = cg.conv_fwd(x, w, padding=1, stream=stream, session=session)
        yc = cg.conv_fwd(cupy.from_dlpack(x), cupy.from_dlpack(w), padding=1, session=session)
    stream.synchronize()
    cupy.cuda.get_current_stream().synchronize()
    want = F.conv2d(x.double(), w.double(), padding=1)
    assert ref.rel_err(y, want) < 1e-5 and ref.rel_err(torch.from_dlpack(yc), want) < 1e-5


def test_prefetch_loads_stored_plans_on_a_background_thread(tmp_path):
    specs = [cg.ConvFwdSpec((2, 16, 10, 10), (16, 16, 3, 3), padding=1, dtype="float16", layout="channels_last",
                            bias=True, activation="gelu"),
             cg.ConvBwdFilterSpec((2, 16, 10, 10), (2, 16, 10, 10), (16, 16, 3, 3), padding=1, dtype="float16",
                                  layout="channels_last", bias_grad=True)]
    writer = cg.Session(cache=tmp_path)
    for spec in specs:
        writer.plan(spec)
    resident.forget()  # as a fresh process: nothing held
    reader = cg.Session(cache=tmp_path)
    counts = reader.prefetch(specs).wait(timeout=120)
    assert counts == {"loaded": 2, "in_memory": 0, "missing": 0, "failed": 0}
    x, w, b = _rand(2, 16, 10, 10), _rand(16, 16, 3, 3), _rand(16)
    y = cg.conv_fwd(x, w, b, padding=1, activation="gelu", session=reader)  # runs on the main thread's handle
    want = F.gelu(F.conv2d(x.double(), w.double(), b.double(), padding=1))
    assert ref.rel_err(y, want) < ref.TOLERANCE["float16"]
    stats = reader.counters()
    assert (stats["disk_hits"], stats["builds"], stats["memory_hits"]) == (2, 0, 1)


_WARM_CHILD = """
import sys, torch
import cudnn_graphs as cg
x = torch.randn(2, 16, 10, 10, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
dy = torch.randn_like(x)
dw, db = cg.conv_bwd_filter(x, dy, w_shape=(16, 16, 3, 3), padding=1, bias_grad=True)
xd, wd = x.double(), torch.zeros(16, 16, 3, 3, dtype=torch.float64, device="cuda", requires_grad=True)
torch.nn.functional.conv2d(xd, wd, padding=1).backward(dy.double())
err = max(float((dw.double() - wd.grad).norm() / wd.grad.norm()),
          float((db.double() - dy.double().sum((0, 2, 3))).norm() / dy.double().sum((0, 2, 3)).norm()))
stats = cg.default_session(0).counters()
print(err, stats["disk_hits"], stats["builds"], sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends", "cudnn")))
"""


def test_a_warm_torch_process_loads_kernel_parts_without_cupy_nvrtc_or_the_frontend(tmp_path):
    """wgrad + bias gradient is a cuDNN part and our kernel: its cubin comes from the record, and
    the cuDNN part loads through the backend from its serialized JSON (no `import cudnn`)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDNN_GRAPHS_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", _WARM_CHILD], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    err, hits, builds, modules = runs[1].stdout.strip().split(" ", 3)
    assert float(err) < ref.TOLERANCE["float16"]
    assert (int(hits), int(builds)) == (1, 0)
    assert modules == "[]", f"the warm process imported {modules}"


def _graph_cases():
    cl = "channels_last"
    x, w = (4, 32, 12, 12), (32, 32, 3, 3)
    return {
        "fwd_bias_relu_fp16": cg.ConvFwdSpec(x, w, padding=1, dtype="float16", layout=cl, bias=True,
                                             activation="relu"),
        "fwd_residual_gelu_bf16": cg.ConvFwdSpec(x, w, padding=1, dtype="bfloat16", layout=cl, bias=True,
                                                 residual=True, activation="gelu"),
        "fwd_fp32_stride2": cg.ConvFwdSpec(x, w, padding=1, stride=2, dtype="float32", layout=cl, allow_tf32=False),
        "dgrad_relu_fp16": cg.ConvBwdDataSpec(x, w, x, padding=1, dtype="float16", layout=cl,
                                              activation_backward="relu"),
        "wgrad_bias_fp16": cg.ConvBwdFilterSpec(x, x, w, padding=1, dtype="float16", layout=cl, bias_grad=True),
        "depthwise_fp16": cg.ConvFwdSpec(x, (32, 1, 3, 3), padding=1, groups=32, dtype="float16", layout=cl),
    }


def _fresh(spec, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bufs = {}
    for role, desc in spec.tensors().items():
        t = torch.empty_strided(desc.shape, desc.strides, dtype=getattr(torch, desc.dtype), device="cuda")
        if role in ("y", "dx", "dw", "db"):
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randn(desc.shape, generator=gen, device="cuda") * 0.5)
        bufs[role] = t
    return bufs


@pytest.mark.parametrize("case", list(_graph_cases()))
def test_graph_replays_compute_what_direct_runs_compute_with_fresh_buffers_each_call(case):
    """Every call on new buffers (outputs poisoned): the entry point's graph replays (re-pointed where
    the plan allows: one graph for all of them) against direct runs of the same plan on copies."""
    spec = _graph_cases()[case]
    plan = cg.Session(allow_tf32=False).plan(spec)
    roles = tuple(spec.tensors())
    launcher = plan.launcher(roles, "torch")
    for seed in range(6):
        direct = _fresh(spec, seed)
        entry = {role: t.clone(memory_format=torch.preserve_format) for role, t in direct.items()}
        torch.cuda.synchronize()  # an idle stream: the second sight may record
        plan.execute(**entry)
        launcher.run(tuple(direct[r].data_ptr() for r in roles), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        for role in roles:
            assert not entry[role].isnan().any(), (case, seed, role)
            if plan.deterministic:
                assert torch.equal(entry[role], direct[role]), (case, seed, role)
            else:
                assert ref.rel_err(entry[role], direct[role].double()) < 1e-3, (case, seed, role)
    assert launcher.replays >= 4, (case, launcher.replays)
    print(case, "re-pointed" if launcher._patched else "per-set graphs", launcher.captures)


@pytest.mark.parametrize("policy", ["heuristic", "autotune"])
def test_planning_leaves_no_cudnn_object_to_the_garbage_collector(tmp_path, policy):
    """Freeing a cuDNN plan can wait for the whole GPU (e60c578:tools/probe_sync_sources.py, in git
    history), and the garbage collector frees what reference cycles hold at whatever later call it runs
    in: a training step, behind a full queue. So planning, with the graphs it tries and drops (fused
    first, a depthwise conv unfused first, autotune's candidates), must leave no cuDNN object to the
    collector."""
    specs = list(_graph_cases().values())
    specs.append(cg.ConvFwdSpec((4, 32, 12, 12), (32, 1, 3, 3), padding=1, groups=32, dtype="float16",
                                layout="channels_last", bias=True, activation="gelu"))
    gc.collect()
    session = cg.Session(cache=tmp_path, policy=policy, autotune_limit=4)
    logging.disable(logging.CRITICAL)  # pytest keeps log records, and through them what they name
    try:
        plans = [session.plan(spec) for spec in specs]
    finally:
        logging.disable(logging.NOTSET)
    assert len(plans) == len(specs)
    del session, plans
    left = cyclic_garbage("cudnn.", "cudnn_graphs.", "gpu_launch.")
    assert not left, f"planning left these to the garbage collector: {left}"
