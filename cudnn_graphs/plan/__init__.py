"""Plans: a spec's graphs with chosen execution plans, per device."""

from .plan import BoundPlan, Plan, PlannedPart
from .session import Session

__all__ = ["BoundPlan", "Plan", "PlannedPart", "Session"]
