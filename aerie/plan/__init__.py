"""`aerie plan`: what a run will cost before it starts -- sizes, API dollars, GPU-seconds per stage,
disk per location -- and the refusals of what cannot fit (`check`)."""

from aerie.plan.plan import Plan, check, make_plan

__all__ = ["Plan", "check", "make_plan"]
