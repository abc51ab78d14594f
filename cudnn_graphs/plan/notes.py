"""Numerical notes of a chosen execution plan, which the frontend does not report directly.

The frontend filters plans by numerical note (`select_numeric_notes`) but returns no notes per plan.
We learn them from its filter: on a fresh copy of the graph with the same ranked plan list, keep only
plans that carry note N and forbid every workspace, then ask to build the chosen index. The frontend
checks the note filter first ("Deselecting execution plan") and the workspace limit after, so the
error says whether the plan carries N, and nothing is ever built.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..graph import frontend

log = logging.getLogger("cudnn_graphs")

PROBED = ("NONDETERMINISTIC", "TENSOR_CORE", "DOWN_CONVERT_INPUTS", "REDUCED_PRECISION_REDUCTION", "FFT",
          "WINOGRAD")


def probe(new_graph: Callable[[], Any], *, index: int, engine: str,
          modes: tuple[str, ...] = ("A", "FALLBACK")) -> tuple[str, ...] | None:
    """Names of the notes plan `index` (its rank under heuristics `modes`) carries, or None when the
    frontend's answer is not recognisable."""
    fe = frontend.cudnn()
    found = []
    for name in PROBED:
        note = getattr(fe.numerical_note, name, None)
        if note is None:
            continue
        has = _has_note(new_graph, note, index=index, engine=engine, modes=modes)
        if has is None:
            return None
        if has:
            found.append(name)
    return tuple(found)


def _has_note(new_graph: Callable[[], Any], note: Any, *, index: int, engine: str,
              modes: tuple[str, ...]) -> bool | None:
    g = new_graph()
    try:
        return _probe_note(g, note, index=index, engine=engine, modes=modes)
    finally:
        frontend.release_declines(g)  # a probe graph is dropped: leave no cycle for the collector


def _probe_note(g: Any, note: Any, *, index: int, engine: str, modes: tuple[str, ...]) -> bool | None:
    fe = frontend.cudnn()
    g.build_operation_graph()
    g.create_execution_plans([getattr(fe.heur_mode, m) for m in modes])
    if g.get_execution_plan_count() <= index or g.get_plan_name_at_index(index) != engine:
        return None  # heuristics ranked differently this time: no answer rather than a wrong one
    g.select_numeric_notes([note])
    g.deselect_workspace_greater_than(-1)
    try:
        g.build_plan_at_index(index)
    except Exception as err:  # the expected outcome: the message says which check refused it
        text = str(err)
        if "Deselecting" in text:
            return False
        if "workspace" in text or "shared memory" in text:
            return True
        log.debug("numerical-note probe: unrecognised answer %r", text)
        return None
    return None  # built despite a negative workspace limit: this frontend filters differently


def deterministic(notes: tuple[str, ...] | None) -> bool | None:
    return None if notes is None else "NONDETERMINISTIC" not in notes
