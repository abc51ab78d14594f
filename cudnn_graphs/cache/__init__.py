"""Plans on disk: a built plan -> a `plan_cache.PlanRecord` -> the plan as data (`plan/restore.py` makes a
Plan of it again), and the stores a session uses."""

from .policy import for_machine, keep_stored, plan_rules, rank
from .records import RECORD_SCHEMA, LoadOutcome, StoredPlan, plan_to_record, read_plan
from .stores import open_remote, open_store, open_system_store

__all__ = ["RECORD_SCHEMA", "LoadOutcome", "StoredPlan", "for_machine", "keep_stored", "open_remote", "open_store",
           "open_system_store", "plan_rules", "plan_to_record", "rank", "read_plan"]
