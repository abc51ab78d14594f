"""Which record wins, and which records belong to this machine."""

from __future__ import annotations

from typing import Any

from ..environment import Environment

# Planning rules that changed which plan a spec gets, {name: version}: a stored record planned before a rule
# (or under an older version of it) is built anew and replaced, even if autotuned; other records stay valid.
# Bump a rule's version when its choice changes; add one for a new rule (`plan_rules` below applies them).
PLAN_RULES = {"depthwise_fwd_epilogue_unfused": 1}

AUTOTUNE = "autotune"
HEURISTICS = "heuristics"
# Session flags ride in the fingerprint too, but a record built under other flags is still for this machine.
SESSION_FLAGS = ("deterministic", "allow_tf32")


def plan_rules(spec) -> dict[str, int]:
    """The PLAN_RULES that decide `spec`'s plan (stored in its record, checked when the record loads)."""
    if depthwise_fwd(spec) and spec.has_epilogue:
        return {"depthwise_fwd_epilogue_unfused": PLAN_RULES["depthwise_fwd_epilogue_unfused"]}
    return {}


def depthwise_fwd(spec) -> bool:
    """A forward conv with one input channel per group and several groups."""
    return spec.op == "conv_fwd" and spec.groups > 1 and spec.w_shape[1] == 1


def rank(meta: dict) -> int:
    """How a record's plan was chosen, as a precedence: an autotuned plan outranks a heuristic one."""
    return 1 if meta.get("chosen_by") == AUTOTUNE else 0


def rules_of(meta: dict) -> dict[str, int]:
    """The planning rules a record's plan was chosen under: {rule name: version}; none in older records."""
    rules = meta.get("plan_rules")
    return rules if isinstance(rules, dict) else {}


def rules_behind(meta: dict, rules: dict[str, int]) -> bool:
    """Whether a record was planned under older rules than `rules`: one of them missing from it, or older.
    Its plan may be one today's rules would not choose (a depthwise conv fused into a slow engine)."""
    stored = rules_of(meta)
    return any(not isinstance(stored.get(name), int) or stored[name] < version for name, version in rules.items())


def keep_stored(new, old) -> bool:
    """Whether the stored record `old` stays when `new` arrives: when it outranks it, planning rules first
    (a record planned under older rules gives way even if autotuned), then autotuned over heuristic. For
    `PlanStore.put(keep_existing=partial(keep_stored, new))` and `import_bundle(keep_existing=keep_stored)`.
    Only rules of PLAN_RULES count: a stamp naming a rule this version does not know (forged, damaged, or
    from another version) must not keep a record forever, whatever replaces it."""
    if rules_behind(old.meta, _known(rules_of(new.meta))):
        return False
    if rules_behind(new.meta, _known(rules_of(old.meta))):
        return True
    return rank(old.meta) > rank(new.meta)


def _known(rules: dict) -> dict[str, int]:
    return {name: v for name, v in rules.items() if name in PLAN_RULES and isinstance(v, int)
            and not isinstance(v, bool)}


def machine_fields(env: dict) -> dict:
    """The hardware and library part of an environment dict (without the session flags)."""
    return {k: v for k, v in env.items() if k not in SESSION_FLAGS}


def for_machine(meta: dict, env: Environment) -> bool:
    """True when a record was made on a machine like this one (GPU, SM count, cuDNN, FE, CUDA versions)."""
    stored = meta.get("environment")
    return isinstance(stored, dict) and machine_fields(stored) == machine_fields(env.to_dict())


def key_matches(record: Any) -> bool:
    """Whether a record's key is the signature of its own spec, environment and policy: a record renamed,
    copied under another key or forged is not, and must never be served for that key."""
    from ..signature import signature
    from ..spec import spec_from_dict

    meta = record.meta
    try:
        spec = spec_from_dict(meta["spec"])
        env = Environment.from_dict(meta["environment"])
        return signature(spec, env, policy=meta.get("policy") or None) == record.key
    except Exception:  # a meta this version cannot read: not a record it can vouch for
        return False


def importable(record: Any, env: Environment | None) -> bool:
    """What `cache import` takes: records whose key is their own, made on a GPU like this machine's
    (`env`). `env=None` (`--all`) takes every record whose key is its own, wherever it was made."""
    if not key_matches(record):
        return False
    if env is None:
        return True
    stored = record.meta.get("environment")
    return isinstance(stored, dict) and stored.get("gpu_name") not in (None, "none") and for_machine(record.meta, env)
