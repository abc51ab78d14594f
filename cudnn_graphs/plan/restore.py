"""A stored record back into a Plan on a session's GPU: each cuDNN part through the backend (no frontend
import) where it runs alone, else the frontend's deserializer, else rebuilt from its engine id + knobs;
each kernel part from its cubin. The cache layer reads the record (`cache.records.read_plan`); this
layer makes the plan, from the session's public side alone (device, env, handles)."""

from __future__ import annotations

import logging
from typing import Any

from gpu_launch import driver

from ..cache.records import UNPROBED, LoadOutcome, StoredPlan, read_plan, unusable
from ..errors import CudnnBackendError, NoGpuError
from ..execute import cudnn_backend
from ..graph import ROLE_UIDS, build_graph, frontend, serialized
from .handles import require_gpu
from .parts import kernel_part, notes_source, scalar_arrays, stored_kernel
from .plan import Plan, PlannedPart

log = logging.getLogger("cudnn_graphs")

_BACKEND_LOADS = True  # stored plans load through the backend where they can (tests turn it off)


def load_plan(record, *, spec, session) -> LoadOutcome | None:
    """The plan in `record` for `spec` on `session`'s device, or None when it does not fit (the caller
    builds anew). A blob cuDNN refuses is rebuilt from its engine id + knobs."""
    stored = read_plan(record, spec=spec)
    if stored is None:
        return None
    try:
        restored = [restore_part(session, stored, i) for i in range(len(stored.meta["parts"]))]
    except NoGpuError:  # the machine, not the record: say so, and keep the record
        raise
    except Exception as err:  # a record that passed its checksum but does not fit this code or this GPU
        unusable(record, err)
        return None
    meta = stored.meta
    rebuilt = any(how == "knobs" for _, how in restored)
    plan = Plan(spec=spec, signature=record.key, device=session.device, fused=bool(meta["fused"]),
                parts=tuple(p for p, _ in restored), intermediates=stored.intermediates, handles=session.handles,
                acc_dtype=meta.get("acc_dtype"), build_ms=0.0, chosen_by=str(meta.get("chosen_by", "heuristics")))
    return LoadOutcome(plan, "knobs" if rebuilt else "disk", rebuilt)


def restore_part(session, stored: StoredPlan, i: int):
    """(part, how) for part `i` of a stored plan: "disk" when its blob loaded, "knobs" when rebuilt."""
    require_gpu(session.env, session.device)
    spec, meta, blobs, entry = stored.spec, stored.meta, stored.blobs, stored.meta["parts"][i]
    if entry["kind"] == "kernel":
        compiled = stored_kernel(entry, blobs)
        part = kernel_part(spec, entry["name"], stored.intermediates, session.device, compiled)
        return part, "disk" if compiled is not None else "knobs"  # compiled anew: the record is rewritten
    blob = blobs[entry["blob_index"]]
    scalars = scalar_arrays(spec, {int(uid): v for uid, v in entry["scalars"]})
    graph, index, how = None, 0, "disk"
    backend = _backend_plan(session, blob, entry, scalars) if blob is not None else None
    if blob is not None and backend is None:
        try:
            graph = frontend.deserialize(blob, handle=session.handle)
        except Exception as err:  # other cuDNN, other GPU, or a damaged blob that passed the checksum
            log.warning("%s: stored plan did not load (%s); rebuilding from engine id + knobs", entry["engine"], err)
    if graph is None and backend is None:
        graph, index, how = *_rebuild_from_knobs(session, stored, i), "knobs"
    rank, modes = entry.get("heuristic_index"), tuple(entry.get("heuristic_modes", ("A", "FALLBACK")))
    part = PlannedPart(
        name=entry["name"], graph=graph, roles=tuple(entry["roles"]), index=index, engine=entry["engine"],
        engine_id=int(entry["engine_id"]), knobs=dict(entry["knobs"]),
        behavior_notes=tuple(entry["behavior_notes"]), workspace_size=int(entry["workspace_size"]),
        scalars=scalars, nondeterministic_excluded=bool(entry["nondeterministic_excluded"]), heuristic_index=rank,
        heuristic_modes=modes, tuning=entry.get("tuning"), notes=_stored_notes(entry),
        notes_source=None if rank is None else notes_source(session.handles, spec, bool(meta["fused"]),
                                                            meta.get("acc_dtype"), i, rank, entry["engine"], modes),
        backend=None if backend is None else backend[0], backend_uids=() if backend is None else backend[1],
        serialized=blob if backend is not None else None,
    )
    return part, how


def _backend_plan(session, blob: bytes, entry: dict, scalars: dict) -> tuple[Any, tuple[int, ...]] | None:
    """(the backend's plan, its variant-pack uids) for a stored blob the backend runs by itself,
    or None: the frontend deserializes it instead (and reports what is wrong with it)."""
    if not _BACKEND_LOADS:
        return None
    try:
        found = serialized.backend_plan(blob)
    except serialized.UBJSONError as err:
        log.info("%s: stored plan not readable without the frontend (%s)", entry["engine"], err)
        return None
    known = {ROLE_UIDS[role] for role in entry["roles"] if role in ROLE_UIDS} | set(scalars)
    if found is None or not found.scalar_uids <= set(scalars) or not found.uids <= known:
        return None
    uids = tuple(sorted(found.uids | found.scalar_uids))
    try:
        with driver.device(session.device):
            plan = cudnn_backend.ExecutionPlan(session.handles.raw(), found.plan_json)
    except CudnnBackendError as err:  # e.g. an engine this cuDNN lacks: the frontend path reports it
        log.info("%s: the backend declined the stored plan (%s)", entry["engine"], err)
        return None
    if plan.workspace_size > int(entry["workspace_size"]):  # scratch is sized from the record
        plan.close()
        return None
    return plan, uids


def _rebuild_from_knobs(session, stored: StoredPlan, i: int) -> tuple[Any, int]:
    """Part `i` rebuilt with exactly the stored engine and knobs: no heuristics query."""
    meta, entry = stored.meta, stored.meta["parts"][i]
    with driver.device(session.device):
        build = build_graph(stored.spec, fused=bool(meta["fused"]), handle=session.handle,
                            acc_dtype=meta.get("acc_dtype"))
        g = build.parts[i].graph
        try:
            g.build_operation_graph()
            g.create_execution_plan(int(entry["engine_id"]), frontend.knobs_from_names(entry["knobs"]))
            index = g.get_execution_plan_count() - 1
            g.build_plan_at_index(index)
        finally:  # kept or dropped, the graph must hold no cycle for the collector
            frontend.release_declines(g)
        if int(g.get_workspace_size_plan_at_index(index)) != int(entry["workspace_size"]):
            raise RuntimeError("the rebuilt engine needs a different workspace than recorded")
    return g, index


def _stored_notes(entry: dict) -> Any:
    if "numerical_notes" not in entry:
        return UNPROBED
    return None if entry["numerical_notes"] is None else tuple(entry["numerical_notes"])
