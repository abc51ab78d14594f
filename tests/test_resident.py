"""The process keeps one plan per (device, key): the better one wins, nothing is ever let go of."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cudnn_graphs.plan import resident
from cudnn_graphs.plan.session import HandlePool


@dataclass(eq=False)
class _Plan:
    device: int
    signature: str
    chosen_by: str = "heuristics"


@pytest.fixture(autouse=True)
def _empty():
    resident.forget()
    yield
    resident.forget()


def test_first_plan_is_kept_and_shared():
    a = _Plan(0, "k")
    assert resident.keep(a) is a and resident.get(0, "k") is a
    assert resident.get(1, "k") is None and resident.get(0, "other") is None


def test_a_racing_plan_of_equal_rank_yields_to_the_held_one_and_is_still_kept():
    a, b = _Plan(0, "k"), _Plan(0, "k")
    resident.keep(a)
    assert resident.keep(b) is a and resident.count() == 2


def test_an_autotuned_plan_displaces_a_heuristic_one_but_never_the_reverse():
    heur, tuned, later = _Plan(0, "k"), _Plan(0, "k", "autotune"), _Plan(0, "k")
    resident.keep(heur)
    assert resident.keep(tuned) is tuned and resident.get(0, "k") is tuned
    assert resident.keep(later) is tuned
    assert resident.count() == 3  # the displaced plans are held too: an older session may run them


def test_keeping_the_held_plan_again_adds_nothing():
    a = _Plan(2, "k")
    resident.keep(a)
    resident.keep(a)
    assert resident.count() == 1


def test_one_handle_pool_per_device_for_the_process():
    assert HandlePool.for_device(0) is HandlePool.for_device(0)
    assert HandlePool.for_device(1) is not HandlePool.for_device(0) and HandlePool.for_device(1).device == 1


def test_drop_lets_go_of_those_plans_only():
    a, b, c = _Plan(0, "a"), _Plan(0, "b"), _Plan(0, "b", "autotune")
    for plan in (a, b, c):
        resident.keep(plan)  # c displaces b
    resident.drop([b, c])
    assert resident.get(0, "a") is a and resident.get(0, "b") is None and resident.count() == 1


def test_a_session_releases_its_plans():
    import cudnn_graphs as cg

    session = cg.Session(cache=False)
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    plan = _Plan(session.device, session.signature(spec))
    session._memory[spec] = resident.keep(plan)
    session.release_plans()
    assert spec not in session._memory and resident.get(session.device, plan.signature) is None
