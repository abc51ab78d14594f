"""Plans on disk: a built plan <-> a `plan_cache.PlanRecord`, and the store a session uses."""

from .records import RECORD_SCHEMA, LoadOutcome, load_plan, plan_to_record
from .stores import open_store

__all__ = ["RECORD_SCHEMA", "LoadOutcome", "load_plan", "open_store", "plan_to_record"]
