"""Plans: a spec's graphs with chosen execution plans, per device."""

from .plan import BoundPlan, Plan, PlannedPart
from .session import Session, default_session

__all__ = ["BoundPlan", "Plan", "PlannedPart", "Session", "default_session"]
