"""A built plan as a `plan_cache.PlanRecord`, and back as data (`read_plan`; `plan/restore.py` makes the Plan).

blob: msgpack list with one serialized cuDNN execution plan per cuDNN part (None where the engine
cannot serialize) and the cubin of each fallback-kernel part. meta: everything needed to rebuild without heuristics (engine id + knobs per part),
to report (notes, workspace), and to audit (spec, environment, how and when it was chosen, versions).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import msgpack

from .._version import __version__
from ..spec import TensorDesc, spec_from_dict
from .policy import plan_rules, rules_behind, rules_of

# A part whose numerical notes nobody asked for yet (probing costs heuristics queries).
UNPROBED = "unprobed"

log = logging.getLogger("cudnn_graphs")

RECORD_SCHEMA = 1


class LoadOutcome(NamedTuple):
    """What loading a record gave (`plan/restore.load_plan`)."""

    plan: Any
    path: str  # "disk": every blob loaded; "knobs": some part rebuilt from its engine id + knobs
    rewrite: bool  # the record should be written again (a part was rebuilt)


def plan_to_record(plan, *, env, policy: dict | None = None, rules: dict[str, int] | None = None):
    """The record for `plan` under its signature; parts whose engine cannot serialize store no blob.
    `policy`: the session settings in the signature (kept so an importer can recompute the key);
    `rules`: the planning rules that chose it ({name: version}, see `policy.rules_behind`)."""
    from plan_cache import PlanRecord

    blobs, parts = [], []
    for part in plan.parts:
        entry = _part_meta(part)
        entry["blob_index"] = len(blobs)
        # A kernel part keeps its cubin: a warm process loads it without NVRTC or CuPy.
        blobs.append(_serialize(part) if entry["kind"] == "cudnn" else part.cubin)
        parts.append(entry)
    meta = {
        "schema": RECORD_SCHEMA, "library_version": __version__, "spec": plan.spec.to_dict(),
        "environment": env.to_dict(), "policy": dict(policy or {}), "fused": plan.fused, "acc_dtype": plan.acc_dtype,
        "intermediates": {role: [list(d.shape), list(d.strides), d.dtype] for role, d in plan.intermediates.items()},
        "parts": parts, "chosen_by": plan.chosen_by, "created": time.time(), "build_ms": plan.build_ms,
        "plan_rules": dict(rules or {}),
    }
    return PlanRecord(key=plan.signature, blob=msgpack.packb(blobs, use_bin_type=True), meta=meta)


def _part_meta(part) -> dict[str, Any]:
    common = {"name": part.name, "engine": part.engine, "workspace_size": int(part.workspace_size),
              "behavior_notes": list(part.behavior_notes)}
    if not hasattr(part, "graph"):
        return {"kind": "kernel", **common, "function": part.function_name, "source": part.source}
    entry = {"kind": "cudnn", **common, "roles": list(part.roles), "engine_id": part.engine_id,
             "knobs": dict(part.knobs), "scalars": [[uid, float(a[0])] for uid, a in part.scalars.items()],
             "nondeterministic_excluded": bool(part.nondeterministic_excluded),
             "heuristic_index": part.heuristic_index, "heuristic_modes": list(part.heuristic_modes)}
    if part.tuning is not None:
        entry["tuning"] = part.tuning
    if part.notes is not UNPROBED:  # probing costs heuristics queries: stored only once someone asked
        entry["numerical_notes"] = None if part.notes is None else list(part.notes)
    return entry


def _serialize(part) -> bytes | None:
    if part.graph is None:  # loaded through the backend: the blob it came from
        return part.serialized
    try:
        return bytes(part.graph.serialize())  # FE returns a list of ints
    except Exception as err:  # some engines cannot serialize: the record keeps engine id + knobs
        log.info("%s: plan not serializable (%s); storing engine id + knobs only", part.engine, err)
        return None


class StoredPlan(NamedTuple):
    """A record's plan as data, checked to be `spec`'s under today's rules: what the plan layer
    (`plan/restore.py`) turns back into a Plan on a GPU."""

    key: str
    spec: Any
    meta: dict
    blobs: list  # by each part's blob_index: a serialized cuDNN plan (None where it cannot serialize) or a cubin
    intermediates: dict  # role -> TensorDesc


def read_plan(record, *, spec) -> StoredPlan | None:
    """The plan in `record` as data, or None when it does not fit `spec` (the caller builds anew): another
    schema or spec, older planning rules, or a blob that does not unpack (logged)."""
    meta = record.meta
    if meta.get("schema") != RECORD_SCHEMA or _spec_of(meta) != spec:
        return None
    rules = plan_rules(spec)
    if rules_behind(meta, rules):
        log.info("plan record %s was planned under older rules (%s, now %s); building anew", record.key[:16],
                 rules_of(meta), rules)
        return None
    try:
        blobs = msgpack.unpackb(record.blob, raw=False, **_blob_limits(meta))
        intermediates = {role: TensorDesc(tuple(s), tuple(st), dt) for role, (s, st, dt) in meta["intermediates"].items()}
    except Exception as err:  # a record that passed its checksum but does not fit this code
        unusable(record, err)
        return None
    return StoredPlan(record.key, spec, meta, blobs, intermediates)


def unusable(record, err: Exception) -> None:
    """Say that `record` passed its checksum but does not fit this code or this GPU."""
    log.warning("plan record %s unusable (%s); building anew", record.key[:16], err)


def _blob_limits(meta: dict) -> dict[str, int]:
    """msgpack's limits for a blob: one bin (or None) per part, nothing else; a blob of millions of empty
    bins would otherwise become millions of objects before a part is looked at."""
    from plan_cache.record import MAX_RECORD_BYTES

    return {"max_array_len": len(meta["parts"]), "max_bin_len": MAX_RECORD_BYTES, "max_str_len": 0,
            "max_map_len": 0, "max_ext_len": 0}


def _spec_of(meta: dict):
    try:
        return spec_from_dict(meta["spec"])
    except Exception:  # written by another version of the library
        return None
