"""CPU: autotune's candidate loop (with a fake graph and fake timings), session policy and record precedence."""

from __future__ import annotations

import functools

import pytest

import cudnn_graphs as cg
from cudnn_graphs import ConfigError, config
from cudnn_graphs.cache import LoadOutcome, keep_stored, rank
from cudnn_graphs.plan import autotune, resident
from plan_cache import PlanRecord, PlanStore


class FakeGraph:
    """Execution plans as (engine id, knobs, builds?, workspace); a fake frontend graph."""

    def __init__(self, plans):
        self.plans = plans
        self.built = []

    def get_execution_plan_count(self):
        return len(self.plans)

    def get_engine_and_knobs_at_index(self, i):
        return self.plans[i][0], {}

    def build_plan_at_index(self, i):
        if not self.plans[i][2]:
            raise RuntimeError(f"engine {self.plans[i][0]} declined")
        self.built.append(i)

    def get_workspace_size_plan_at_index(self, i):
        return self.plans[i][3]

    def get_plan_name_at_index(self, i):
        return f"eng{self.plans[i][0]}_k{i}"


def _tune(monkeypatch, plans, speeds, *, limit=None, fail_run=()):
    monkeypatch.setattr(autotune, "time_call", lambda call, stream_ptr: call())
    monkeypatch.setattr(autotune.frontend, "knob_names", lambda knobs: dict(knobs))
    g = FakeGraph(plans)
    workspaces = []

    def make_call(index, ptrs, ws_ptr):
        if index in fail_run:
            raise RuntimeError("launch failed")
        return lambda: speeds[index]

    def buffers():
        return {"x": 1}, lambda n: workspaces.append(n) or 0

    return g, autotune.tune_part(g, buffers=buffers, make_call=make_call, limit=limit, stream_ptr=0), workspaces


def test_fastest_candidate_wins_and_is_built_last(monkeypatch):
    plans = [(1, True, 0), (2, True, 64), (3, True, 0)]
    g, tuned, workspaces = _tune(monkeypatch, [(e, {}, b, w) for e, b, w in plans], [0.3, 0.1, 0.2])
    assert tuned.index == 1 and tuned.heuristic_index == 0
    assert g.built[-1] == 1  # serialize() writes the plan built last
    assert [r.status for r in tuned.table] == ["ok", "ok", "ok"]
    assert [r.median_ms for r in tuned.table] == [0.3, 0.1, 0.2]
    assert workspaces == [0, 64, 0] and tuned.table[1].engine == "eng2_k1"


def test_failures_duplicates_and_limit_are_recorded(monkeypatch):
    plans = [(7, {}, False, 0), (8, {}, True, 0), (8, {}, True, 0), (9, {}, True, 0), (10, {}, True, 0),
             (11, {}, True, 0)]
    _, tuned, _ = _tune(monkeypatch, plans, [0, 0.5, 0.4, 0.6, 0.05, 0.01], limit=2, fail_run={3})
    statuses = [r.status for r in tuned.table]
    assert statuses == ["build_failed", "ok", "duplicate", "run_failed", "ok", "over_limit"]
    assert tuned.index == 4 and tuned.heuristic_index == 1
    assert "declined" in tuned.table[0].error and "launch failed" in tuned.table[3].error
    row = tuned.table[4].to_dict()
    assert row["engine_id"] == 10 and row["median_ms"] == 0.05 and row["status"] == "ok"


def test_no_candidate_runs_is_an_error_with_reasons(monkeypatch):
    with pytest.raises(RuntimeError, match="declined"):
        _tune(monkeypatch, [(1, {}, False, 0)], [0])


@pytest.mark.parametrize("kwargs, field", [({"policy": "fastest"}, "policy"), ({"autotune_limit": 0}, "autotune_limit"),
                                           ({"autotune_inputs": "mine"}, "autotune_inputs")])
def test_session_refuses_bad_autotune_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cg.Session(cache=False, **kwargs)


def test_policy_variable(monkeypatch):
    monkeypatch.setenv(config.POLICY, "autotune")
    assert cg.Session(cache=False).policy == "autotune"
    monkeypatch.setenv(config.POLICY, "best")
    with pytest.raises(ConfigError) as err:
        cg.Session(cache=False)
    assert err.value.variable == config.POLICY


def test_autotuned_record_is_never_replaced_by_a_heuristic_one(tmp_path):
    store = PlanStore(tmp_path / "c")
    tuned, heur = {"chosen_by": "autotune"}, {"chosen_by": "heuristics"}
    assert rank(tuned) > rank(heur)

    def put(blob, meta):
        record = PlanRecord("k", blob, meta)
        return store.put(record, keep_existing=functools.partial(keep_stored, record))

    assert put(b"h", heur)
    assert put(b"t", tuned)  # upgrade
    assert not put(b"h2", heur)
    assert store.get("k").blob == b"t"
    assert put(b"t2", tuned)  # a newer tuning


def test_autotune_session_retunes_a_heuristic_record(tmp_path, monkeypatch):
    spec = cg.ConvFwdSpec((1, 4, 8, 8), (4, 4, 3, 3), padding=1)
    built, loaded = [], []
    for policy, chosen_by, expect_build in [("autotune", "heuristics", True), ("autotune", "autotune", False),
                                            ("heuristic", "autotune", False), ("heuristic", "heuristics", False)]:
        resident.forget()  # each session as a fresh process: the disk decides
        session = cg.Session(cache=tmp_path / policy / chosen_by, policy=policy)
        session.store.put(PlanRecord(session.signature(spec), b"", {"chosen_by": chosen_by}))
        built.clear(), loaded.clear()
        monkeypatch.setattr(session, "_build", lambda spec, key, buffers: built.append(key) or _FakePlan())
        monkeypatch.setattr(session, "_store", lambda plan: None)
        monkeypatch.setattr("cudnn_graphs.plan.session.load_plan",
                            lambda record, spec, session: loaded.append(record) or LoadOutcome(_FakePlan(), "disk", False))
        session._load_or_build(spec, None)
        assert bool(built) == expect_build, (policy, chosen_by)
        assert bool(loaded) != expect_build, (policy, chosen_by)
    resident.forget()


class _FakePlan:
    chosen_by = "autotune"
    build_ms = 1.0
    device, signature = 0, "fake"


def test_a_record_planned_under_older_rules_gives_way_even_autotuned():
    from types import SimpleNamespace

    from cudnn_graphs.cache.policy import keep_stored, rules_behind

    rule = {"depthwise_fwd_epilogue_unfused": 1}
    old_tuned = SimpleNamespace(meta={"chosen_by": "autotune"})  # written before the rule: no stamp
    new_heuristic = SimpleNamespace(meta={"chosen_by": "heuristics", "plan_rules": rule})
    assert rules_behind(old_tuned.meta, rule) and not rules_behind(new_heuristic.meta, rule)
    assert not keep_stored(new_heuristic, old_tuned)  # the store takes the new record
    assert keep_stored(old_tuned, new_heuristic)  # an import of the old one does not replace it
    newer = SimpleNamespace(meta={"chosen_by": "heuristics", "plan_rules": {"depthwise_fwd_epilogue_unfused": 2}})
    assert keep_stored(new_heuristic, newer) and not keep_stored(newer, new_heuristic)
    same_rules_tuned = SimpleNamespace(meta={"chosen_by": "autotune", "plan_rules": rule})
    assert keep_stored(new_heuristic, same_rules_tuned)  # then autotuned outranks heuristic, as before
    assert not rules_behind({"plan_rules": "garbage"}, {})  # no rules apply: nothing is behind
    assert rules_behind({"plan_rules": {"depthwise_fwd_epilogue_unfused": "1"}}, rule)  # a damaged stamp
