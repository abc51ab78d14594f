"""The one call memo (gpu_launch.memo) the hot paths share: a hit is dict.get, bounded, cleared when full."""

from __future__ import annotations

import threading

import pytest

from gpu_launch.memo import CallMemo, ThreadMemo


def test_a_hit_is_dicts_own_get():
    memo = CallMemo(4)
    assert type(memo).get is dict.get and isinstance(memo, dict)
    assert memo.put(("k", 1), "v") == "v"
    assert memo.get(("k", 1)) == "v" and memo.get(("k", 2)) is None


def test_the_memo_is_bounded_and_cleared_whole_when_full():
    memo = CallMemo(3)
    for i in range(3):
        memo.put(i, i)
    assert len(memo) == 3
    memo.put(3, 3)  # full: start over rather than grow or keep eviction order on every hit
    assert dict(memo) == {3: 3}
    for i in range(10):
        memo.put(("again", i), i)
        assert len(memo) <= 3


def test_none_and_unhashable_keys_are_not_kept():
    memo = CallMemo(3)
    assert memo.put(None, "v") == "v" and len(memo) == 0 and memo.get(None) is None
    assert memo.put(("opt", ["a list"]), "v") == "v" and len(memo) == 0


def test_the_thread_memo_keeps_each_threads_values_apart():
    memo = ThreadMemo(2)
    memo.put("k", "main")
    seen = {}

    def other():
        seen["before"] = memo.get("k")
        memo.put("k", "other")
        for i in range(5):  # the bound holds per thread
            memo.put(i, i)
        seen["bounded"] = len(memo.memo) <= 2
        seen["after"] = memo.get(4)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"before": None, "bounded": True, "after": 4}
    assert memo.get("k") == "main" and len(memo.memo) == 1


def test_the_hot_paths_keep_their_calls_in_the_one_memo():
    import cudnn_graphs as cg
    from fallback_kernels import gemm_act, grid_sample

    assert isinstance(cg.Session(cache=False).calls, CallMemo)  # requests.run_buffers
    assert isinstance(grid_sample._memo, CallMemo)
    assert isinstance(gemm_act._memo, ThreadMemo)  # a program holds this thread's driver.Kernel


def test_the_torch_layers_convs_keep_their_calls_in_the_one_memo():
    pytest.importorskip("torch")  # the torch layer's config needs torch; the rest of the memo does not
    from cudnn_graphs.torch import _conv

    cfg = _conv._config(2, 1, 0, 1, 1, None, 1.0, ())
    assert all(isinstance(m, CallMemo) for m in (cfg.fwd, cfg.dgrad, cfg.wgrad))
