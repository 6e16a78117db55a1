"""Nightly re-planning decisions: the observed request mix, and whether a new plan beats the
serving one by enough to be worth a rollout. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError


def observed_weights(arrivals: Mapping[str, float], models: Sequence[str]) -> list[float] | None:
    """Each model's share of the requests seen (same order as `models`); None without any.
    A model that saw no request keeps a small share so that the plan still serves it."""
    total = sum(max(0.0, arrivals.get(m, 0.0)) for m in models)
    if total <= 0:
        return None
    floor = 0.01
    return [max(arrivals.get(m, 0.0) / total, floor) for m in models]


def objective_under(
    plan: Plan, models: Sequence[str], weights: Sequence[float], delivered: bool = True
) -> float:
    """The planner's objective (max-min req/s / weight) of `plan` for this mix: of what the
    plan delivers where it states it and `delivered`, else of its fluid throughputs."""
    if len(models) != len(weights):
        raise PoolpipeError("one weight per model")
    use = delivered and plan.deliverable is not None
    thr = {m.name: float(m.deliverable or 0.0) if use else m.throughput for m in plan.models}
    missing = [m for m in models if m not in thr]
    if missing:
        raise PoolpipeError(f"the plan does not serve {missing}")
    return min(thr[m] / w for m, w in zip(models, weights, strict=True))


def worth_rolling_out(current: float, new: float, margin: float) -> bool:
    """Roll out only when the new plan is better by more than `margin` (0.05 = 5%)."""
    return new > current * (1.0 + margin)
