"""MILP planning of pooled pipelines (docs/design/planner.md): strategies ppipe, np and dart-r."""

from poolpipe.planner.strategies import PlanRequest, estimate_arrival_rates, make_plan

__all__ = ["PlanRequest", "estimate_arrival_rates", "make_plan"]
