"""The cost objective: the cheapest GPUs of a cluster that serve given rates within the SLOs.

The same candidate pipelines, shares, packing and NIC limits as max-min planning (and the
same λ̂ for the batch-wait term, so a max-min plan serving the rates is a feasible point);
the MILP (formulation.build_cost_milp) asks each model's pipelines for at least its rate
and minimises the price of the physical GPUs used, with the types' counts as availability.
HiGHS proves it optimal within the gap. Beside the plan, for the same rates: the cheapest
whole-model (np) plan and the cheapest plan on GPUs of one type, for the user to compare.

Rates the cluster cannot serve are named with what it can: a max-min plan weighted by the
rates gives the largest fraction of every rate that can be served together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import Plan
from poolpipe.errors import InfeasibleError, SolverError
from poolpipe.planner.candidates import CandidatePipeline, Enumeration
from poolpipe.planner.decompose import cheapest_split, decomposable
from poolpipe.planner.exact import (
    Solved,
    _read_counts,
    enumerate_candidates,
    model_costs,
    solve_group,
)
from poolpipe.planner.formulation import GroupMilp, build_cost_milp, price_units
from poolpipe.planner.readback import assemble, pipeline_plan, solver_info
from poolpipe.planner.request import PlanRequest
from poolpipe.planner.solvers import MilpResult, solve


@dataclass
class Cheapest:
    """A solved cost MILP: its pipelines and vGPU counts, cost per hour, GPUs per type."""

    solved: Solved
    cost_per_hour: float
    gpus: dict[str, int]


def rate_shares(req: PlanRequest) -> PlanRequest:
    """`req` with the rates' shares as the models' weights (the workload mix they make)."""
    assert req.rates is not None  # PlanRequest checked it
    total = sum(req.rates)
    return replace(req, weights=tuple(r / total for r in req.rates))


def make_cost_plan(
    req: PlanRequest,
    lam: list[float | None],
    lam_solved: Solved | None,
    started: float,
    compare: bool = True,
) -> Plan:
    """The cheapest plan of `req.strategy` (ppipe or np) serving `req.rates` (req's weights
    their shares, λ̂ estimated with them); verified. With `compare`, its meta also holds the
    cheapest np plan's and each single GPU type's cost for the same rates (None where none
    serves them)."""
    assert req.rates is not None
    whole = req.strategy == "np"
    P = 1 if whole else req.max_partitions
    best = cheapest(req, lam, P, whole, req.cluster, required=True)
    if best is None:
        raise _rates_infeasible(req, lam)
    meta: dict = {
        "objective": "cost",
        "rates": dict(zip((m.name for m in req.models), req.rates, strict=True)),
        "prices": {p.gpu: req.prices[p.gpu] for p in req.cluster.pools},
        "cost_per_hour": best.cost_per_hour,
    }
    if compare:
        np_best = best if whole else cheapest(req, lam, 1, True, req.cluster)
        meta["np_cost_per_hour"] = None if np_best is None else np_best.cost_per_hour
        single: dict[str, float | None] = {}
        for pool in req.cluster.pools:
            only = Cluster(req.cluster.name, req.cluster.bandwidth_gbps, (pool,))
            alone = cheapest(req, lam, P, whole, only)
            single[pool.gpu] = None if alone is None else alone.cost_per_hour
        meta["single_type_cost_per_hour"] = single
    pipelines = [[pipeline_plan(c, n) for c, n in picked] for picked in best.solved.chosen]
    runs = [s for s in (lam_solved, best.solved) if s is not None]
    plan = assemble(req, req.strategy, P, pipelines, lam, solver_info(runs, started), meta)
    plan.verify({m.name: m for m in req.models})
    return plan


def cheapest(
    req: PlanRequest,
    lam: list[float | None],
    P: int,
    whole: bool,
    cluster: Cluster,
    required: bool = False,
) -> Cheapest | None:
    """The cheapest GPUs of `cluster` serving req.rates with pipelines of at most P
    partitions (whole GPUs only if `whole`); None when no plan serves them, or when some
    model has no configuration within its SLO (InfeasibleError naming it if `required`)."""
    sub = replace(req, cluster=cluster)
    costs = model_costs(sub, lam, whole_gpus_only=whole)
    what = "whole-GPU" if whole else f"{P}-partition"
    try:
        enums, cands = enumerate_candidates(sub, costs, P, what)
    except InfeasibleError:
        if required:
            raise
        return None  # a comparison where some model has no configuration
    assert req.rates is not None
    group = build_cost_milp(cands, list(req.rates), cluster, req.packing, dict(req.prices))
    if decomposable(cluster, req.packing):
        split = cheapest_split(
            cands, list(req.rates), cluster, dict(req.prices), req.solver, req.time_limit_s,
            req.threads,
        )  # fmt: skip
        if split.status == "infeasible":
            return None
        if split.status == "feasible":
            assert split.chosen is not None
            cost = sum(req.prices[g] * n for g, n in split.gpus.items())
            result = MilpResult(req.solver, "optimal", None, cost, cost, 0.0, split.seconds)
            solved = Solved(split.chosen, result, enums, group, cands, proof="decomposition")
            return Cheapest(solved, cost, split.gpus)
        # out of time: the MILP has what is left
    result = solve(group.milp, req.solver, req.time_limit_s, req.mip_gap, req.threads)
    if result.status == "infeasible":
        return None
    if not result.has_solution or result.values is None:
        raise SolverError(
            f"{req.solver} found no plan ({result.status}) for the rates of "
            f"{[m.name for m in req.models]} on {cluster.name} within {req.time_limit_s:g} s; "
            "raise --time-limit"
        )
    chosen = _read_counts(group, cands, result.values)
    solved = _solved(chosen, result, enums, group, cands, price_units(dict(req.prices))[1])
    gpus = {gpu: round(_used(group, gpu, result)) for gpu in group.gpu_rows}
    cost = sum(req.prices[g] * n for g, n in gpus.items())
    return Cheapest(solved, cost, {g: n for g, n in gpus.items() if n})


def _solved(
    chosen: list[list[tuple[CandidatePipeline, list[int]]]],
    result: MilpResult,
    enums: list[Enumeration],
    group: GroupMilp,
    cands: list[list[CandidatePipeline]],
    scale: float,
) -> Solved:
    # objective and bound are costs (negated back, in the prices' units) from here on
    result.objective, result.bound = -result.objective / scale, -result.bound / scale
    return Solved(chosen, result, enums, group, cands, proof="milp")


def _used(group: GroupMilp, gpu: str, result: MilpResult) -> float:
    assert result.values is not None
    return sum(coef * result.values[var] for var, coef in group.gpu_terms(gpu).items())


def _rates_infeasible(req: PlanRequest, lam: list[float | None]) -> InfeasibleError:
    """What the cluster can serve instead: each model alone, and all together at the
    rates' proportions (the max-min plan weighted by them)."""
    assert req.rates is not None
    whole = req.strategy == "np"
    P = 1 if whole else req.max_partitions
    what = "whole-GPU" if whole else f"{P}-partition"
    costs = model_costs(req, lam, whole_gpus_only=whole)
    alone = []
    for i, (m, r) in enumerate(zip(req.models, req.rates, strict=True)):
        one = replace(req, models=(m,), weights=(1.0,), slos_us=(req.slos_us[i],), rates=(r,))
        best = max(0.0, solve_group(one, [costs[i]], P, what).result.objective)
        if best < r:
            alone.append(f"{m.name} asks {r:,.1f} req/s, at most {best:,.1f} alone")
    if alone:
        return InfeasibleError(
            f"cluster {req.cluster.name} cannot serve these rates within the SLOs even with "
            f"all its GPUs: {'; '.join(alone)}. Lower --rates, loosen the SLOs, or plan on a "
            "larger cluster."
        )
    z = max(0.0, solve_group(req, costs, P, what).result.objective) / sum(req.rates)
    most = ", ".join(
        f"{m.name} {z * r:,.1f} of {r:,.1f}" for m, r in zip(req.models, req.rates, strict=True)
    )
    return InfeasibleError(
        f"cluster {req.cluster.name} serves each of these rates alone but not all together: "
        f"at most {z:.1%} of each ({most} req/s). Lower --rates, loosen the SLOs, or plan on "
        "a larger cluster."
    )
