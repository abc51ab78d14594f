"""CPU: torch's cuDNN switches pick the session and key the per-layer memo; traced paths still trace.

`torch.backends.cudnn.benchmark` -> an autotuning session (plans timed once, kept in the plan cache),
`deterministic` / `torch.use_deterministic_algorithms` -> deterministic plans only, `enabled=False` ->
torch's own convolution. The GPU half (what runs) is tests/test_gpu_torch_flags.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch import _conv  # noqa: E402

cudnn = torch.backends.cudnn


@pytest.fixture
def sessions(monkeypatch):
    """A fresh table of flag sessions, opened on this test's cache."""
    monkeypatch.setattr(_conv, "_SESSIONS", {})
    return _conv._SESSIONS


def test_torchs_flag_getters_are_there():
    # the ops read these per call (the torch.backends attributes cost ~1 us each): a rename must fail here
    for name in ("_get_cudnn_benchmark", "_get_cudnn_enabled", "_get_cudnn_deterministic",
                 "_get_deterministic_algorithms", "_get_cudnn_allow_tf32"):
        assert callable(getattr(torch._C, name)), name
    with cudnn.flags(enabled=False, benchmark=True, deterministic=True):
        assert torch._C._get_cudnn_benchmark() and not torch._C._get_cudnn_enabled()


def test_benchmark_means_an_autotuning_session_and_off_means_the_default(sessions):
    with cudnn.flags(enabled=True, benchmark=False, deterministic=False):
        assert _conv._session(0) is None  # the device's default session: heuristics, or $CUDNN_GRAPHS_POLICY
    with cudnn.flags(enabled=True, benchmark=True, deterministic=False):
        tuned = _conv._session(0)
        assert tuned.policy == "autotune" and not tuned.deterministic
        assert _conv._session(0) is tuned  # one per device and flags, not one per call
    assert tuned.device == 0


@pytest.mark.parametrize("how", ["benchmark", "policy variable"])
def test_inside_a_capture_a_session_that_would_autotune_plans_with_heuristics(sessions, monkeypatch, how):
    """Timing synchronises, which a CUDA-graph capture cannot hold: whether autotuning comes from
    cudnn.benchmark or from $CUDNN_GRAPHS_POLICY, a call first seen inside a capture plans with heuristics
    (same determinism), provisionally; outside a capture the autotuning session plans."""
    from cudnn_graphs import plan as plan_mod

    if how == "policy variable":
        monkeypatch.setenv("CUDNN_GRAPHS_POLICY", "autotune")
        default = plan_mod.Session(device=0)
        monkeypatch.setattr(_conv, "default_session", lambda device: default)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with cudnn.flags(enabled=True, benchmark=how == "benchmark", deterministic=True):
        eager, provisional = _conv.planning_session(0)
        assert eager.policy == "autotune" and not provisional
        capturing[0] = True
        in_capture, provisional = _conv.planning_session(0)
        assert provisional and in_capture.policy == "heuristic" and in_capture.deterministic
        assert _conv.planning_session(0)[0] is in_capture, "one heuristic session per device and determinism"


def test_determinism_with_and_without_benchmark(sessions):
    with cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        plain = _conv._session(0)
    with cudnn.flags(enabled=True, benchmark=True, deterministic=True):
        tuned = _conv._session(0)
    assert plain.deterministic and plain.policy == "heuristic"
    assert tuned.deterministic and tuned.policy == "autotune"
    torch.use_deterministic_algorithms(True)
    try:
        with cudnn.flags(enabled=True, benchmark=False, deterministic=False):
            assert _conv._session(0) is plain  # torch.use_deterministic_algorithms counts as cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)


def test_every_flag_is_in_the_memo_key():
    # a prepared call is reused only under the flags it was prepared under
    seen = set()
    for enabled in (True, False):
        for benchmark in (True, False):
            for deterministic in (True, False):
                with cudnn.flags(enabled=enabled, benchmark=benchmark, deterministic=deterministic):
                    seen.add(_conv._flags())
    assert len(seen) == 8


@pytest.mark.parametrize("bench, enabled", [(True, True), (False, False)])
def test_flags_change_nothing_on_cpu_and_compiled_graphs_still_trace(bench, enabled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(cgt.Conv2d(3, 8, 3, padding=1, activation="relu"), cgt.Conv2d(8, 4, 1)).double()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64, requires_grad=True)
    want = model(x)
    torch._dynamo.reset()
    with cudnn.flags(enabled=enabled, benchmark=bench, deterministic=False):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
        torch.testing.assert_close(model(x), want)
