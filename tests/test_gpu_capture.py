"""GPU: `cudnn_graphs.torch.capture` steps against eager steps bit for bit (deterministic algorithms, fixed
inputs) for a small convnet with BatchNorm, in float32 and under float16 autocast (where convert fuses
the conv-BatchNorm-ReLU runs); a new batch size re-captured; a forward-only capture; a module that
synchronises refused by name; `torch.compile(mode="reduce-overhead")` on a converted model."""

from __future__ import annotations

import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import cudnn_graphs  # noqa: E402
import cudnn_graphs.torch as cgt  # noqa: E402

from .test_torch_convert import BasicBlock  # noqa: E402

pytestmark = pytest.mark.gpu
CASES = {"float32": (torch.contiguous_format, None), "fp16-autocast": (torch.channels_last, torch.float16)}


class Net(nn.Module):
    """Conv-BatchNorm-ReLU stem, two torchvision BasicBlocks, a 1x1 conv head: no Linear (cuBLAS) and
    no adaptive pooling (atomics in its backward), so every kernel has a deterministic choice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 32, stride=2))
        self.head = nn.Conv2d(32, 10, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x))).mean((2, 3))


@pytest.fixture
def deterministic():
    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark = saved[1]


def _models(fmt, **convert):
    torch.manual_seed(0)
    base = Net().cuda().to(memory_format=fmt)
    return cgt.convert(copy.deepcopy(base), **convert), cgt.convert(copy.deepcopy(base), **convert)


def _batches(n, batch, fmt, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(batch, 3, 16, 16, device="cuda", generator=g).contiguous(memory_format=fmt),
             torch.randn(batch, 10, device="cuda", generator=g)) for _ in range(n)]


def _autocast(dtype):
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _train(forward, params, batches, dtype):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        with _autocast(dtype):
            loss = F.mse_loss(forward(x).float(), y)  # read before the next call overwrites the output
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def _assert_same_state(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("case", list(CASES))
def test_captured_steps_equal_eager_steps_bit_for_bit(case, deterministic):
    fmt, dtype = CASES[case]
    eager, model = _models(fmt)
    batches = _batches(5, 8, fmt)
    sample = batches[0][0].clone()
    with _autocast(dtype):
        step = cgt.capture(model, (sample,))
    _assert_same_state(model, eager)  # warm-up and capture left no trace (BatchNorm statistics restored)
    want = _train(eager, eager.parameters(), batches, dtype)
    got = _train(step, model.parameters(), batches, dtype)
    assert torch.equal(got, want), (got, want)
    _assert_same_state(model, eager)  # parameters, momentum-stepped; running statistics; counters
    assert step.captures == 1 and torch.equal(sample, batches[0][0])  # the sample was never written


def test_a_new_batch_size_is_captured_once_and_replays_after(deterministic):
    eager, model = _models(torch.contiguous_format)
    step = cgt.capture(model, _batches(1, 8, torch.contiguous_format)[0][0], max_graphs=2)
    mixed = _batches(2, 8, torch.contiguous_format, seed=2) + _batches(2, 4, torch.contiguous_format, seed=3)
    mixed += _batches(1, 8, torch.contiguous_format, seed=4)
    assert torch.equal(_train(step, model.parameters(), mixed, None), _train(eager, eager.parameters(), mixed, None))
    assert step.captures == 2  # batch 8 at capture(), batch 4 on its first call; batch 8 again replays
    _assert_same_state(model, eager)
    with torch.no_grad():  # another grad mode: a forward-only capture of its own
        x = mixed[0][0]
        model.eval(), eager.eval()
        assert torch.equal(step(x), eager(x)) and step.captures == 3
        assert len(step._graphs) == 2  # max_graphs: the least recently used went


def test_autocast_state_selects_its_own_capture():
    _, model = _models(torch.channels_last)
    x = _batches(1, 8, torch.channels_last)[0][0]
    step = cgt.capture(model, x)
    assert step(x).dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.float16):
        assert step(x).dtype == torch.float16
    assert step.captures == 2


def test_a_module_that_synchronises_is_refused_by_name():
    torch.manual_seed(0)
    model = cgt.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None),
                                      nn.ReLU()).cuda(), fuse_batchnorm=False)
    before = model[1].num_batches_tracked.clone()
    with pytest.raises(cudnn_graphs.CaptureError, match="synchronises the device") as err:
        cgt.capture(model, torch.randn(4, 3, 8, 8, device="cuda"))
    assert err.value.field == "model.1" and err.value.value == "BatchNorm2d"  # momentum=None reads a counter
    assert torch.equal(model[1].num_batches_tracked, before)
    assert torch.cuda.get_sync_debug_mode() == 0


def test_tensors_on_another_device_than_the_model_are_refused():
    _, model = _models(torch.contiguous_format)
    with pytest.raises(cudnn_graphs.CaptureError) as err:
        cgt.capture(model.cpu(), torch.randn(2, 3, 16, 16, device="cuda"))
    assert err.value.field.startswith("parameter ") and "cpu" in str(err.value)


def _compiled_run(model, batches, *, mode):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    explained = torch._dynamo.explain(copy.deepcopy(model))(batches[0][0])
    compiled = torch.compile(model, mode=mode)
    losses = _train(compiled, model.parameters(), batches, torch.float16)
    return losses, explained, dict(torch._dynamo.utils.counters["inductor"])


# "cudnn_graphs": the lone convs run this library's registered ops inside inductor's graphs, whose plans keep
# a per-stream workspace allocated at their first call on the capture stream (allocate_kept: outside the pool)
@pytest.mark.parametrize("train_convs", ["torch", "cudnn_graphs"])
def test_reduce_overhead_compiles_converted_models_whole(train_convs):
    fmt = torch.channels_last
    eager, model = _models(fmt, train_convs=train_convs)
    theirs = copy.deepcopy(eager)
    assert model.cudnn_graphs_report.chains  # fp16 channels-last training: fused runs, which tracing must skip
    batches = _batches(4, 8, fmt)
    want = _train(eager, eager.parameters(), batches, torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        got, explained, counters = _compiled_run(model, batches, mode="reduce-overhead")
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    torch_net = Net().cuda().to(memory_format=fmt)
    torch_net.load_state_dict(theirs.state_dict())
    with torch.autocast("cuda", dtype=torch.float16):
        _, _, torch_counters = _compiled_run(torch_net, batches, mode="reduce-overhead")
    # cudagraphs skipped no more often for ours than for torch's own model (mutated BatchNorm buffers ...)
    assert counters.get("cudagraph_skips", 0) <= torch_counters.get("cudagraph_skips", 0), (counters, torch_counters)


def test_reduce_overhead_compiles_converted_inference():
    """Eval calls run this library's plans (BatchNorm folded): under inductor's CUDA graphs too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Net().cuda().half().to(memory_format=torch.channels_last).eval()
    model = cgt.convert(copy.deepcopy(base), inference=True)
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for x, _ in _batches(4, 8, torch.channels_last, seed=5):
            x = x.half()
            got = compiled(x).clone()  # read before the next replay overwrites the output
            torch.testing.assert_close(got, model(x), rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(got, base(x), rtol=1e-2, atol=1e-2)


_STEPS_WARNING_FREE = r"""
import json, sys, warnings
import torch
sys.path.insert(0, sys.argv[1])
import cudnn_graphs.torch as cgt
from tests.test_gpu_capture import Net

torch.manual_seed(0)
cl = torch.channels_last
model = cgt.convert(Net().cuda().to(memory_format=cl))
x = torch.randn(8, 3, 16, 16, device="cuda").contiguous(memory_format=cl)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.autocast("cuda", dtype=torch.float16):
        step = cgt.capture(model, (x,))
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = step(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
print(json.dumps(sorted({str(w.message)[:200] for w in caught})))
"""


def test_captured_steps_raise_no_accumulate_grad_stream_warning():
    """torch warns once per process, so a fresh one: the capture's side-stream AccumulateGrad nodes must
    not outlive it (they did, kept by make_graphed_callables's static outputs; torch warned at each step)."""
    import json
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _STEPS_WARNING_FREE, root], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    caught = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [w for w in caught if "stream" in w.lower()], caught
