"""Whether a stored plan still loads on this machine's GPU (`cudnn-graphs cache verify --load`): the
plan layer's question about the cache layer's records, so it lives above both."""

from __future__ import annotations

from typing import Any

from ..cache.policy import SESSION_FLAGS, for_machine, plan_rules, rules_behind, rules_of
from ..cache.records import _spec_of
from ..environment import environment
from .restore import load_plan
from .session import Session


def verify_load(record: Any, *, device: int = 0, sessions: dict | None = None) -> tuple[str, str]:
    """(status, detail) of loading `record` on GPU `device`: "loads", "rebuilt" (a blob did not load but
    its engine id + knobs did), "foreign" (made on another kind of machine), or "unusable" (a session
    would build anew). `sessions` memoises one memory-only session per set of session flags."""

    spec = _spec_of(record.meta)
    if spec is None:
        return "unusable", "spec not readable by this version of cudnn-graphs"
    if not for_machine(record.meta, environment(device)):
        return "foreign", "recorded on another GPU or with other cuDNN/CUDA versions"
    rules = plan_rules(spec)
    if rules_behind(record.meta, rules):
        return "unusable", (f"planned under older rules ({rules_of(record.meta) or 'none'}, now {rules}): "
                            "the next session builds it anew")
    flags = {k: bool(record.meta["environment"].get(k)) for k in SESSION_FLAGS}
    sessions = {} if sessions is None else sessions
    session = sessions.get(tuple(flags.items()))
    if session is None:
        session = sessions[tuple(flags.items())] = Session(device=device, cache=False, **flags)
    outcome = load_plan(record, spec=spec, session=session)
    if outcome is None:
        return "unusable", "does not load (the log says why)"
    if outcome.path != "disk":
        return "rebuilt", "a stored blob did not load; rebuilt from its engine id + knobs"
    return "loads", ", ".join(outcome.plan.engines)
