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

import math
import time
from dataclasses import dataclass, replace
from typing import Literal

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import Plan, SolverInfo
from poolpipe.errors import InfeasibleError, SolverError
from poolpipe.planner.candidates import CandidatePipeline, Enumeration
from poolpipe.planner.decompose import cheapest_split, decomposable
from poolpipe.planner.deliverable import (
    ATTAINMENT_TARGET,
    PLANNING_SEEDS,
    Delivery,
    attainment_at,
    deliverable,
    stated,
)
from poolpipe.planner.exact import (
    Solved,
    enumerate_candidates,
    model_costs,
    read_counts,
    solve_group,
)
from poolpipe.planner.formulation import GroupMilp, build_cost_milp, gpus_used, price_units
from poolpipe.planner.knapsack import knapsack_reaches
from poolpipe.planner.pruning import candidate_bounds
from poolpipe.planner.readback import assemble, pipeline_plan, solver_info
from poolpipe.planner.request import PlanRequest
from poolpipe.planner.solvers import MilpResult, solve
from poolpipe.scheduler.topology import simulated_topology

COST_TRY_S = 1.0  # cost MILP time before the proof by GPU counts (one or two types)
COST_RTOL = 1e-9  # a plan cheaper by less than this is not cheaper
REACH_RTOL = 1e-9  # max-min objective within this of 1 serves the rates (VERIFY_RTOL is 1e-6)
MAX_IMPROVEMENTS = 20  # cheaper plans found by the counts before giving up
SIZING_ROUNDS = 6  # cost plans simulated at most while sizing one on what it delivers
SIZING_RAISE = 0.05  # the least a short model's rate asked of the MILP grows per round


@dataclass
class Cheapest:
    """A solved cost MILP: its pipelines and vGPU counts, cost per hour, GPUs per type, and
    how it was sized on what it delivers (None: on the fluid plan)."""

    solved: Solved
    cost_per_hour: float
    gpus: dict[str, int]
    sizing: Sizing | None = None


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
    their shares, λ̂ estimated with them); verified. Unless `req.delivery` is "off", it
    serves them with >= 99% of requests on time in simulation (`sized`), and states what it
    delivers. With `compare`, its meta also holds the cheapest np plan's and each single
    GPU type's cost for the same rates, sized the same way (None where none serves them)."""
    assert req.rates is not None
    whole = req.strategy == "np"
    P = 1 if whole else req.max_partitions
    # whole models, sized once: a pooled plan too (P > 1), and what the plan is compared with
    np_best = None
    if not whole and (P > 1 or compare):
        np_best = cheapest_sized(req, lam, 1, True, req.cluster)
    best = cheapest_sized(req, lam, P, whole, req.cluster, required=True, whole_models=np_best)
    if best is None:
        raise _rates_infeasible(req, lam)
    meta: dict = {
        "objective": "cost",
        "rates": dict(zip((m.name for m in req.models), req.rates, strict=True)),
        "prices": {p.gpu: req.prices[p.gpu] for p in req.cluster.pools},
        "cost_per_hour": best.cost_per_hour,
    }
    if compare:
        if whole:
            np_best = best
        meta["np_cost_per_hour"] = None if np_best is None else np_best.cost_per_hour
        single: dict[str, float | None] = {}
        for pool in req.cluster.pools:
            only = replace(req.cluster, pools=(pool,))
            alone = cheapest_sized(req, lam, P, whole, only)
            single[pool.gpu] = None if alone is None else alone.cost_per_hour
        meta["single_type_cost_per_hour"] = single
    runs = [s for s in (lam_solved, best.solved) if s is not None]
    plan = _as_plan(req, best, lam, P, solver_info(runs, started), meta)
    plan.verify({m.name: m for m in req.models})
    if best.sizing is not None:
        s = best.sizing
        plan = stated(plan, s.delivery, s.describe(req))
    return plan


def _as_plan(
    req: PlanRequest,
    best: Cheapest,
    lam: list[float | None],
    P: int,
    info: SolverInfo,
    meta: dict | None = None,
) -> Plan:
    pipelines = [[pipeline_plan(c, n) for c, n in picked] for picked in best.solved.chosen]
    return assemble(req, req.strategy, P, pipelines, lam, info, meta)


@dataclass
class Sizing:
    """How a cost plan was sized on what it delivers: the rates each round asked of the
    cost MILP, its cost, and each model's share on time at the user's rates then."""

    rounds: list[dict]
    delivery: Delivery  # the chosen plan's deliverable figures
    on_time: tuple[float, ...]  # its share on time per model at the user's rates

    def describe(self, req: PlanRequest) -> dict:
        names = [m.name for m in req.models]
        return {
            "mode": "sized",
            "on_time_at_rates": dict(zip(names, self.on_time, strict=True)),
            "sizing_rounds": self.rounds,
            "simulations": self.delivery.simulations + len(self.rounds) * len(PLANNING_SEEDS),
        }


def cheapest_sized(
    req: PlanRequest,
    lam: list[float | None],
    P: int,
    whole: bool,
    cluster: Cluster,
    required: bool = False,
    whole_models: Cheapest | Literal["size"] | None = "size",
) -> Cheapest | None:
    """`cheapest`, and unless `req.delivery` is "off", sized on what it delivers: the plan
    is simulated at the rates, and where a model keeps less than 99% on time its rate asked
    of the cost MILP grows (to the rate over what it delivers, at least by SIZING_RAISE)
    until every model keeps 99% (at most SIZING_ROUNDS plans). Sized twice, from the fluid
    cost plan and from the cost MILP with each model's pools planned with queueing headroom
    at its rate (headroom.py), and for pipelines of several partitions the whole-model plan
    (one partition on whole GPUs, a pooled plan too) sized the same way: the cheapest plan
    that serves. (The cost MILP's plans of equal cost deliver differently, which one it
    returns depends on its path, and sizing raises rates by rounds: a pooled plan sized
    alone could cost more than the whole-model one.) None where no plan serves the rates
    even fluid; InfeasibleError (where `required`) when none keeps 99%. `whole_models`:
    the whole-model plan sized already (None: none serves), or "size" it here."""
    assert req.rates is not None
    if req.delivery == "off":
        return cheapest(req, lam, P, whole, cluster, required)
    served: list[Cheapest] = []
    tried: list[dict] = []
    last: tuple[float, ...] = ()
    for headroom in (False, True):
        found, rounds, on_time = _sized(req, lam, P, whole, cluster, headroom, required)
        last = on_time or last  # (the headroom MILP may have no plan at all)
        if found is False:
            return None  # not even the fluid plan serves them
        tried += rounds
        if found is not None:
            served.append(found)
    if P > 1 and not whole:
        if whole_models == "size":
            whole_models = cheapest_sized(req, lam, 1, True, cluster)
        if whole_models is not None:
            assert whole_models.sizing is not None
            rounds = whole_models.sizing.rounds
            tried += [{**r, "start": f"whole models, {r['start']}"} for r in rounds]
            served.append(whole_models)
    if served:
        best = min(served, key=lambda c: c.cost_per_hour)  # the fluid start on equal cost
        assert best.sizing is not None
        best.sizing.rounds = tried
        return best
    if required:
        names = [m.name for m in req.models]
        kept = ", ".join(f"{n} {a:.1%}" for n, a in zip(names, last, strict=True))
        raise InfeasibleError(
            f"cluster {cluster.name} serves these rates on the fluid plan, but no {req.strategy} "
            f"plan of it was found to keep >= {ATTAINMENT_TARGET:.0%} of requests on time at "
            f"them ({len(tried)} plan{'s' if len(tried) != 1 else ''} simulated; the last kept "
            f"{kept} on time, and serving "
            "more of each model's rate than it asks takes more GPUs than the cluster has). "
            "Lower --rates (poolpipe plan --objective maxmin --weights RATES states what the "
            "cluster delivers at their mix), loosen the SLOs, plan on a larger cluster, or "
            "size on the fluid plan with --delivery off"
        )
    return None


def _sized(
    req: PlanRequest,
    lam: list[float | None],
    P: int,
    whole: bool,
    cluster: Cluster,
    headroom: bool,
    required: bool,
) -> tuple[Cheapest | Literal[False] | None, list[dict], tuple[float, ...]]:
    """One sizing (cheapest_sized), from the fluid cost plan or the headroom one: the plan
    that keeps 99% on time (None: none found; False: the rates are not served even fluid),
    the rounds, and the share on time of the last plan simulated."""
    assert req.rates is not None
    rates = tuple(req.rates)
    profiles = {m.name: m for m in req.models}
    asked = list(rates)
    rounds: list[dict] = []
    on_time: tuple[float, ...] = ()
    for k in range(SIZING_ROUNDS):
        sub = replace(
            req, cluster=cluster, rates=tuple(asked), headroom_rates=rates if headroom else None
        )
        found = cheapest(sub, lam, P, whole, cluster, required and k == 0 and not headroom)
        if found is None and k == 0 and not headroom:
            return False, rounds, on_time
        if found is None:
            break  # what each model needs for 99% on time is more than the GPUs give
        plan = _as_plan(sub, found, lam, P, SolverInfo(req.solver, "sized", 0.0, 0.0))
        topo = simulated_topology(plan, profiles)
        on_time = attainment_at(topo, rates)
        rounds.append(
            {
                "start": "headroom" if headroom else "fluid",
                "asked": dict(zip(profiles, asked, strict=True)),
                "cost_per_hour": found.cost_per_hour,
                "on_time": dict(zip(profiles, on_time, strict=True)),
            }
        )
        if all(a >= ATTAINMENT_TARGET for a in on_time):
            found.sizing = Sizing(rounds, deliverable(topo), on_time)
            return found, rounds, on_time
        delivered = deliverable(topo).rates
        for i, a in enumerate(on_time):
            if a < ATTAINMENT_TARGET:
                short = rates[i] / delivered[i] if delivered[i] > 0 else 2.0
                asked[i] *= max(short, 1 + SIZING_RAISE)
    return None, rounds, on_time


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
    t0 = time.perf_counter()
    by_counts = len(cluster.pools) <= 2
    first = min(req.time_limit_s, COST_TRY_S) if by_counts else req.time_limit_s
    result = solve(group.milp, req.solver, first, req.mip_gap, req.threads)
    if result.values is None and first < req.time_limit_s and result.status != "infeasible":
        by_counts = False  # no plan yet to prove: the MILP has all the time
        left = req.time_limit_s - (time.perf_counter() - t0)
        result = solve(group.milp, req.solver, left, req.mip_gap, req.threads)
    if result.status == "infeasible":
        return None
    if not result.has_solution or result.values is None:
        raise SolverError(
            f"{req.solver} found no plan ({result.status}) for the rates of "
            f"{[m.name for m in req.models]} on {cluster.name} within {req.time_limit_s:g} s; "
            "raise --time-limit"
        )
    values = result.values

    def read(result: MilpResult) -> Cheapest:
        assert result.values is not None
        chosen = read_counts(group, cands, result.values)
        solved = _solved(chosen, result, enums, group, cands, price_units(dict(req.prices))[1])
        gpus = {gpu: round(_used(group, gpu, result)) for gpu in group.gpu_rows}
        return Cheapest(solved, sum(req.prices[g] * n for g, n in gpus.items()), _nonzero(gpus))

    best = read(result)
    if result.status == "optimal" or not by_counts:
        return best
    deadline = t0 + req.time_limit_s
    proven = _prove_by_counts(req, lam, P, whole, cluster, best, deadline)
    if proven is not None:
        proven.solved.result.seconds = time.perf_counter() - t0
        return proven
    # not proven that way: the MILP goes on from its plan with the time left
    left = max(0.0, deadline - time.perf_counter())
    start = {i: float(v) for i, v in enumerate(values)}
    result = solve(group.milp, req.solver, left, req.mip_gap, req.threads, start)
    if result.values is None:
        return best
    best = read(result)
    best.solved.result.seconds = time.perf_counter() - t0
    return best


def _nonzero(gpus: dict[str, int]) -> dict[str, int]:
    return {g: n for g, n in gpus.items() if n}


def _prove_by_counts(
    req: PlanRequest,
    lam: list[float | None],
    P: int,
    whole: bool,
    cluster: Cluster,
    best: Cheapest,
    deadline: float,
) -> Cheapest | None:
    """Prove `best` cheapest (or find a cheaper plan and prove that one) on one or two GPU
    types, by the max-min planner: serving the rates on some GPUs is monotone in their
    counts, so no plan is cheaper iff none of the largest GPU counts that cost less (for
    each count of one type, the most of the other) serves the rates, i.e. reaches max-min
    objective 1 with the rates as weights. Each such count is dismissed by the LP bound or
    by the max-min solve's proven bound (knapsacks, decomposition). None when a question
    stays open (its bound not below 1 without a plan reaching it) or time runs out."""
    assert req.rates is not None
    rates = tuple(req.rates)
    refuted: list[dict[str, int]] = []  # counts that do not serve, nor any below them
    for _ in range(MAX_IMPROVEMENTS):
        for counts in _cheaper_counts(cluster, req.prices, best.cost_per_hour):
            if any(all(counts[g] <= r[g] for g in counts) for r in refuted):
                continue
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            found = _serves(req, lam, P, whole, cluster.with_counts(counts), rates, left)
            if found is None:
                return None  # open
            if found is False:
                refuted.append(counts)
            else:
                gpus = _nonzero(gpus_used(found.chosen, req.packing, cluster.mixes_models))
                cost = sum(req.prices[g] * n for g, n in gpus.items())
                if cost < best.cost_per_hour * (1 - COST_RTOL):
                    result = replace(best.solved.result, objective=cost, bound=cost)
                    best = Cheapest(
                        replace(best.solved, chosen=found.chosen, result=result), cost, gpus
                    )
                    break  # ask again below the new plan's cost
                return None  # reached, yet no cheaper: should not happen; leave it open
        else:
            result = best.solved.result
            result.status, result.bound, result.gap = "optimal", best.cost_per_hour, 0.0
            best.solved.proof = "max-min by counts"
            return best
    return None


def _serves(
    req: PlanRequest,
    lam: list[float | None],
    P: int,
    whole: bool,
    cluster: Cluster,
    rates: tuple[float, ...],
    left: float,
) -> Solved | Literal[False] | None:
    """Do `cluster`'s GPUs serve `rates` (max-min objective >= 1 with the rates as weights,
    the cost problem's λ̂)? Its plan if so, False if provably not, None if left open."""
    sub = replace(
        req, cluster=cluster, weights=rates, objective="maxmin", rates=None, prices={},
        time_limit_s=left,
    )  # fmt: skip
    costs = model_costs(sub, lam, whole_gpus_only=whole)
    what = "whole-GPU" if whole else f"{P}-partition"
    try:
        _, cands = enumerate_candidates(sub, costs, P, what)
    except InfeasibleError:
        return False  # a model has no configuration on these GPUs
    cb = candidate_bounds(cands, list(rates), cluster)
    if cb.dual_bound < 1 - REACH_RTOL:
        return False  # not even the LP relaxation reaches the rates
    if knapsack_reaches(cands, list(rates), cb, cluster, 1 - REACH_RTOL) is False:
        return False  # nor the knapsacks (knapsack.py)
    try:
        solved = solve_group(sub, costs, P, what, enough=1 - REACH_RTOL)
    except SolverError:
        return None
    if solved.result.objective >= 1 - REACH_RTOL:
        return solved
    if solved.result.bound < 1 - REACH_RTOL:
        return False
    return None


def _cheaper_counts(cluster: Cluster, prices, cost: float) -> list[dict[str, int]]:
    """The largest GPU counts (at most the cluster's) that cost less than `cost`: for each
    count of the first type, the most of the second; cheapest first (mostly refuted at
    once by the LP bound; the first that serves the rates gives a plan near the cheapest)."""
    pools = cluster.pools
    below = cost * (1 - COST_RTOL)
    first = pools[0]
    out = []
    for a in range(first.count, -1, -1):
        rest = below - prices[first.gpu] * a
        if rest < 0:
            continue
        if len(pools) == 1:
            out.append({first.gpu: a})
            break  # the largest affordable count covers the smaller ones
        second = pools[1]
        b = min(second.count, math.floor(rest / prices[second.gpu] - COST_RTOL))
        if b < 0:
            continue
        if out and out[-1][second.gpu] == b:
            continue  # (a, b) <= the previous (a + 1, b)
        out.append({first.gpu: a, second.gpu: b})
    return sorted(out, key=lambda c: sum(prices[g] * n for g, n in c.items()))


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
