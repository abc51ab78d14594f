"""GPU: torch's cuDNN switches as a torch user sets them.

`cudnn.benchmark = True`: a geometry first seen is autotuned once, kept in the plan cache, and a fresh
process (benchmark on or off) loads the tuned plans without timing anything. `cudnn.enabled = False`:
torch's own convolution, no plan consulted. `cudnn.deterministic` / `use_deterministic_algorithms`:
deterministic plans, gradients bit-identical run to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.plan import default_session  # noqa: E402
from cudnn_graphs.torch import _conv  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
PLANNED = ("memory_hits", "disk_hits", "remote_hits", "builds", "autotuned")


@pytest.fixture(autouse=True)
def _fresh_sessions(monkeypatch):
    # the flag sessions open the cache configured when they are made: make them on this test's cache
    monkeypatch.setattr(_conv, "_SESSIONS", {})


def _worker(mode: str, cache: Path) -> dict:
    env = dict(os.environ, CUDNN_GRAPHS_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_flags_worker", mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_benchmark_autotunes_once_and_fresh_processes_reuse_the_tuned_plans(tmp_path):
    tuned = _worker("on", tmp_path)
    assert tuned["policy"] == "autotune" and tuned["rel_err"] < 4e-3, tuned
    assert tuned["first"]["autotuned"] == 3 and tuned["first"]["timings"] >= 3, tuned  # fwd, dgrad, wgrad
    assert tuned["again"] == tuned["first"], "a second step planned again"
    again = _worker("on", tmp_path)  # torch would time again in every process: we load
    assert again["first"]["autotuned"] == again["first"]["timings"] == again["first"]["builds"] == 0, again
    assert again["first"]["disk_hits"] == 3 and again["chosen_by"] == ["autotune"], again
    off = _worker("off", tmp_path)  # benchmark off finds the tuned plans too: the fleet shares them
    assert off["first"]["disk_hits"] == 3 and off["first"]["builds"] == 0 and off["chosen_by"] == ["autotune"], off


def _planned() -> int:
    sessions = [default_session(0), *_conv._SESSIONS.values()]
    return sum(s.counters()[name] for s in sessions for name in PLANNED)


def test_cudnn_disabled_runs_torchs_convolution_and_enabling_it_plans_again():
    torch.manual_seed(0)
    conv = cgt.Conv2d(12, 20, 3, padding=1, activation="relu").cuda()
    theirs = torch.nn.Conv2d(12, 20, 3, padding=1).cuda()
    theirs.load_state_dict(conv.state_dict())
    x = torch.randn(5, 12, 17, 15, device="cuda")
    with torch.backends.cudnn.flags(enabled=False, benchmark=False, deterministic=False, allow_tf32=False):
        before = _planned()
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, want = conv(xo), F.relu(theirs(xt))
        y.sum().backward()
        want.sum().backward()
        torch.cuda.synchronize()
        assert _planned() == before, "a plan was asked for with cuDNN disabled"
        assert torch.equal(y, want)  # the very call torch makes: the same kernels, the same bits
        torch.testing.assert_close(xo.grad, xt.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(conv.weight.grad, theirs.weight.grad, rtol=1e-6, atol=1e-6)
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        torch.testing.assert_close(conv(x), want.detach(), rtol=1e-5, atol=1e-5)
        assert _planned() > before, "enabled again, the layer kept torch's path"


# not "benchmark": pytest-benchmark (on the GPU host) owns a fixture of that name
@pytest.mark.parametrize("tune", [False, True], ids=["heuristics", "autotune"])
def test_deterministic_flag_gives_deterministic_plans_and_repeatable_gradients(tune):
    torch.manual_seed(1)
    fmt = torch.channels_last
    conv = cgt.Conv2d(32, 32, 3, padding=1).to("cuda", torch.float16).to(memory_format=fmt)
    x = torch.randn(64, 32, 28, 28, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    dy = torch.randn(64, 32, 28, 28, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    grads = []
    with torch.backends.cudnn.flags(enabled=True, benchmark=tune, deterministic=True):
        session = _conv._session(0)
        for _ in range(3):
            conv.weight.grad = conv.bias.grad = None
            xi = x.clone().requires_grad_()
            conv(xi).backward(dy)  # wgrad is where nondeterministic (split-K, atomics) engines live
            grads.append((conv.weight.grad.clone(), conv.bias.grad.clone(), xi.grad.clone()))
    assert session.deterministic and session.policy == ("autotune" if tune else "heuristic")
    plans = list(session._memory.values())
    assert len(plans) >= 3 and all(plan.deterministic for plan in plans), [p.engines for p in plans]
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again))
