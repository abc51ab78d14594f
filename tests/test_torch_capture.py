"""CPU: `cudnn_graphs.torch.capture` refuses what a CUDA graph cannot hold with a typed error naming it,
checks its keywords, and keys captures by what a replay depends on. The captures themselves (bit for
bit against eager steps, a new batch size) are tests/test_gpu_capture.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import cudnn_graphs  # noqa: E402
import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch._capture import _Captures, _key  # noqa: E402


def _model():
    torch.manual_seed(0)
    return cgt.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))


def test_capture_is_exported_and_its_error_is_the_librarys():
    assert cgt.capture is not None and cgt.Captured is not None
    assert issubclass(cudnn_graphs.CaptureError, cudnn_graphs.CudnnGraphsError)
    assert issubclass(cudnn_graphs.CaptureError, ValueError)


def test_a_model_must_be_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got function"):
        cgt.capture(lambda x: x, (torch.zeros(1),))


@pytest.mark.parametrize("kwargs, field", [({"warmup": 1}, "warmup"), ({"warmup": True}, "warmup"),
                                           ({"warmup": 2.0}, "warmup"), ({"max_graphs": 0}, "max_graphs"),
                                           ({"max_graphs": "4"}, "max_graphs")])
def test_bad_keywords_name_the_field(kwargs, field):
    with pytest.raises(cudnn_graphs.SpecError) as err:
        cgt.capture(_model(), (torch.zeros(2, 3, 8, 8),), **kwargs)
    assert err.value.field == field and err.value.value == kwargs[field]


@pytest.mark.parametrize("sample, field", [(3, "sample_args"), ((torch.zeros(2, 3, 8, 8), 2), "sample_args[1]"),
                                           ((), "sample_args")])
def test_sample_args_must_be_tensors(sample, field):
    with pytest.raises(cudnn_graphs.CaptureError) as err:
        cgt.capture(_model(), sample)
    assert err.value.field == field


def test_cpu_tensors_are_refused_naming_the_argument_and_leave_the_model_as_it_was():
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.__dict__.get("forward")  # convert's chained forward, which capture must not replace
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(cudnn_graphs.CaptureError, match=r"sample_args\[0\]=.*device=cpu.*CUDA graph") as err:
        cgt.capture(model, x)  # one tensor stands for a tuple of one
    assert err.value.field == "sample_args[0]" and "CUDA" in err.value.reason
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.__dict__.get("forward") is forward


def test_calls_refuse_keywords_and_non_tensors_before_capturing():
    captured = cgt.Captured(_model())  # no capture yet: each call captures for its own key
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(cudnn_graphs.CaptureError) as err:
        captured(x, scale=2.0)
    assert err.value.field == "kwargs" and err.value.value == ["scale"]
    with pytest.raises(cudnn_graphs.CaptureError) as err:
        captured(x, None)
    assert err.value.field == "args[1]"
    with pytest.raises(cudnn_graphs.CaptureError) as err:
        captured(x)
    assert err.value.field == "args[0]" and captured.captures == 0


def test_data_parallel_wrappers_are_refused_with_what_to_do_instead(tmp_path):
    dist = torch.distributed
    with pytest.raises(cudnn_graphs.CaptureError, match="capture the module inside it") as err:
        cgt.capture(nn.DataParallel(_model()), torch.randn(2, 3, 8, 8))
    assert err.value.field == "model" and err.value.value == "DataParallel"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        with pytest.raises(cudnn_graphs.CaptureError) as err:
            cgt.capture(ddp, torch.randn(2, 3, 8, 8))
        assert err.value.value == "DistributedDataParallel"
    finally:
        dist.destroy_process_group()


def test_the_key_holds_what_a_replay_depends_on_and_not_the_values():
    model = _model()
    x = torch.randn(4, 3, 8, 8)
    base = _key(model, (x,), "args")
    assert _key(model, (torch.zeros(4, 3, 8, 8),), "args") == base  # other values, same graph
    others = [_key(model, (torch.randn(2, 3, 8, 8),), "args"),                  # batch size
              _key(model, (x.double(),), "args"),                               # dtype
              _key(model, (x.clone().requires_grad_(),), "args"),               # an input gradient
              _key(model, (x, x), "args")]                                      # arity
    with torch.no_grad():
        others.append(_key(model, (x,), "args"))
    with torch.inference_mode():
        others.append(_key(model, (x,), "args"))
    model.eval()
    others.append(_key(model, (x,), "args"))
    model.train()
    for dtype in (torch.float16, torch.bfloat16):  # CUDA autocast, set as torch.autocast sets it
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            others.append(_key(model, (x,), "args"))
        finally:
            torch.set_autocast_enabled("cuda", False)
    assert _key(model, (x,), "args") == base
    assert len({base, *others}) == len(others) + 1


def test_captures_are_kept_least_recently_used_first_out():
    held = _Captures(2)
    for key in ("a", "b"):
        held.keep((key,), key.upper())
    assert held.find(("a",)) == "A"  # used: now the most recent
    held.keep(("c",), "C")
    assert list(held) == [("a",), ("c",)] and held.find(("b",)) is None


def test_a_training_converted_model_compiles_whole_without_graph_breaks():
    """torch.compile (reduce-overhead's tracing, aot_eager's backend here) traces a converted model's
    BatchNorm runs as their modules' registered ops: one graph, no breaks."""
    import copy

    from .test_torch_chain import _net

    net = cgt.convert(_net())
    assert net.cudnn_graphs_report.chains
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(copy.deepcopy(net))(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    eager, twin = copy.deepcopy(net), copy.deepcopy(net)
    for model in (eager, torch.compile(twin, fullgraph=True, backend="aot_eager")):
        model(x).square().mean().backward()
    torch.testing.assert_close(twin.state_dict(), eager.state_dict())  # BatchNorm statistics too
    for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def _accumulator(p):
    return p.view_as(p).grad_fn.next_functions[0][0]  # as DDP finds a parameter's AccumulateGrad node


def _nodes(root) -> list:
    seen, todo = [], [root]
    while todo:
        node = todo.pop()
        if node is not None and all(node is not s for s in seen):
            seen.append(node)
            todo += [f for f, _ in node.next_functions]
    return seen


def test_warm_up_and_capture_run_on_aliases_never_on_the_parameters_autograd_nodes():
    from cudnn_graphs.torch._capture import _Body, _Replay

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    net[2].bias.requires_grad_(False)  # frozen: not aliased, read as it is
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    aliases = [p.detach().requires_grad_() for _, p in named]
    node = _accumulator(net[0].weight)
    node.metadata["made"] = "by the caller"  # as DDP's: made on the caller's stream, kept alive
    x = torch.randn(5, 3)
    body = _Body(net, tuple(n for n, _ in named), 1)
    out = body(x, *aliases)
    torch.testing.assert_close(out, net(x), rtol=0, atol=0)  # the same memory, the same numbers
    assert all(a.data_ptr() == p.data_ptr() for a, (_, p) in zip(aliases, named))
    assert not [n for n in _nodes(out.grad_fn) if n.metadata.get("made")]  # no parameter's node in the graph
    grads = torch.autograd.grad(out.sum(), aliases)
    assert all(p.grad is None for p in net.parameters()) and len(grads) == 3
    # a replay is given the parameters themselves: their nodes get the gradients
    replay = _Replay(lambda *a: body(*a), tuple(p for _, p in named))
    replay(x).sum().backward()
    assert net[0].weight.grad is not None and net[2].bias.grad is None
