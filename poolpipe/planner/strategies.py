"""The three planning strategies of docs/design/planner.md: ppipe, np (no partitioning) and dart-r.

`make_plan(request)` returns a verified `Plan`. The NP plan solved without the batch-wait
term provides λ̂ (each model's expected arrival rate) for the batch-wait term of every
strategy, as in the published plans.
"""

from __future__ import annotations

import time
from dataclasses import replace

from poolpipe.domain.plan import Plan
from poolpipe.errors import InfeasibleError
from poolpipe.planner.baselines import plan_dart_r
from poolpipe.planner.candidates import enumerate_pipelines
from poolpipe.planner.cost import make_cost_plan, rate_shares
from poolpipe.planner.deliverable import maximise, state
from poolpipe.planner.exact import Solved, model_costs, solve_group
from poolpipe.planner.readback import assemble, pipeline_plan, solver_info
from poolpipe.planner.request import PlanRequest

__all__ = ["PlanRequest", "estimate_arrival_rates", "make_plan"]


def estimate_arrival_rates(req: PlanRequest) -> tuple[list[float | None], Solved | None]:
    """λ̂: each model's throughput in the NP plan solved without the batch-wait term.

    Models that no whole GPU can serve within the SLO get λ̂ = 0 (batch 1 only); the others
    are planned together among themselves.
    """
    if not req.batch_wait:
        return [None] * len(req.models), None
    costs = model_costs(req, [None] * len(req.models), whole_gpus_only=True)
    enums = [enumerate_pipelines(c, 1, merge_same_bucket=False) for c in costs]
    ok = [i for i, en in enumerate(enums) if en.pipelines]
    lam: list[float | None] = [0.0] * len(req.models)
    if not ok:
        return lam, None
    sub = replace(
        req,
        models=tuple(req.models[i] for i in ok),
        weights=tuple(req.weights[i] for i in ok),
        slos_us=tuple(req.slos_us[i] for i in ok),
    )
    solved = solve_group(sub, [costs[i] for i in ok], 1, "whole-GPU")
    for j, i in enumerate(ok):
        lam[i] = sum(pipeline_plan(c, n).throughput for c, n in solved.chosen[j])
    return lam, solved


def make_plan(req: PlanRequest) -> Plan:
    """Plan the group with the request's strategy and objective; the result is verified and,
    unless `req.delivery` is "off", states what it delivers (deliverable.py): ppipe and np
    plans chosen for it ("maximise"), dart-r's as its heuristic makes it."""
    started = time.perf_counter()
    if req.objective == "cost":
        req = rate_shares(req)
        lam, lam_solved = estimate_arrival_rates(req)
        return make_cost_plan(req, lam, lam_solved, started, req.cost_alternatives)
    lam, lam_solved = estimate_arrival_rates(req)
    if req.strategy == "dart-r":
        plan = plan_dart_r(req, lam, lam_solved, started)
    else:
        plan = _maxmin(req, lam, lam_solved, started)
        if plan.objective <= 0 and len(req.models) > 1 and req.leave_out:
            return _servable_ones(req)
        if req.delivery == "maximise":

            def again(asked: PlanRequest) -> Plan:
                return _maxmin(replace(asked, warm_start=None), lam, None, time.perf_counter())

            plan = maximise(req, plan, again)
    if req.delivery == "state" or (req.delivery == "maximise" and req.strategy == "dart-r"):
        plan = state(req, plan)
    plan.verify({m.name: m for m in req.models})
    return plan


def _servable_ones(req: PlanRequest) -> Plan:
    """The plan of the models the cluster can serve together, where it cannot hold a
    pipeline of every model at once (the max-min optimum is 0, and every plan as good):
    models are left out one at a time, each time the one whose absence leaves the best
    fluid max-min plan, until the rest are all served; the plan of those, with the models
    left out in `meta["unserved"]`."""
    keep = list(range(len(req.models)))
    while len(keep) > 1:
        best: tuple[float, list[int]] | None = None
        for drop in keep:
            rest = [i for i in keep if i != drop]
            sub = req.only(rest)
            lam, _ = estimate_arrival_rates(sub)
            objective = _maxmin(sub, lam, None, time.perf_counter()).objective
            if best is None or objective > best[0]:
                best = (objective, rest)
        assert best is not None
        keep = best[1]
        if best[0] > 0:
            plan = make_plan(req.only(keep))
            left = [m.name for i, m in enumerate(req.models) if i not in keep]
            return replace(plan, meta={**plan.meta, "unserved": left})
    raise InfeasibleError(
        f"cluster {req.cluster.name} cannot serve any of {', '.join(m.name for m in req.models)}"
        " with a pipeline of its own; plan a larger cluster or looser SLOs"
    )


def _maxmin(
    req: PlanRequest, lam: list[float | None], lam_solved: Solved | None, started: float
) -> Plan:
    """The fluid max-min plan of a ppipe or np request (the MILP, proven within its gap)."""
    whole = req.strategy == "np"
    P = 1 if whole else req.max_partitions
    costs = model_costs(req, lam, whole_gpus_only=whole)
    solved = solve_group(req, costs, P, "whole-GPU" if whole else f"{P}-partition")
    pipelines = [[pipeline_plan(c, n) for c, n in picked] for picked in solved.chosen]
    runs = [s for s in (lam_solved, solved) if s is not None]
    meta = {}
    if solved.warm_objective is not None:
        meta["warm_start_objective"] = solved.warm_objective
    return assemble(req, req.strategy, P, pipelines, lam, solver_info(runs, started), meta)
