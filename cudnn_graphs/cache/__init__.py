"""Plans on disk: a built plan <-> a `plan_cache.PlanRecord`, and the store a session uses."""

from .policy import for_machine, keep_stored, rank
from .records import RECORD_SCHEMA, LoadOutcome, load_plan, plan_to_record
from .stores import open_remote, open_store, open_system_store

__all__ = ["RECORD_SCHEMA", "LoadOutcome", "for_machine", "keep_stored", "load_plan", "open_remote", "open_store",
           "open_system_store", "plan_to_record", "rank"]
