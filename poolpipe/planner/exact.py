"""The exact solve of one group MILP: candidate enumeration, LP-bound pruning with a quick
incumbent, the knapsack bound, the group MILP, and the per-model decomposition, cheapest
proof first (README, "How the planner is exact and fast")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from poolpipe.domain.costs import ModelCosts
from poolpipe.errors import InfeasibleError, SolverError
from poolpipe.planner.candidates import (
    CandidatePipeline,
    Enumeration,
    drop_share_dominated,
    enumerate_pipelines,
)
from poolpipe.planner.decompose import decomposable, reach
from poolpipe.planner.formulation import (
    Chosen,
    GroupMilp,
    build_group_milp,
    chosen_fits,
    chosen_objective,
    fit_by_swaps,
    served,
)
from poolpipe.planner.knapsack import knapsack_bound
from poolpipe.planner.pruning import CandidateBounds, candidate_bounds, keep_mask
from poolpipe.planner.request import PlanRequest
from poolpipe.planner.solvers import MilpResult, relative_gap, solve
from poolpipe.planner.warm import warm_chosen

ROUND_TOL = 1e-6  # integrality slack when reading vGPU counts back from the solver
PRUNE_ABOVE = 60  # candidates (all models) above which LP-bound pruning runs first
INCUMBENT_POOL = 48  # per model: best-bounded candidates in the quick incumbent MILP
INCUMBENT_PER_SIGNATURE = 2  # ... at most this many of each GPU-bucket signature
INCUMBENT_TIME_S = 2.0  # time limit of the quick incumbent MILP
INCUMBENT_GAP = 3e-3  # its gap: the knapsack and the group MILP do the rest
GROUP_TRY_S = 2.0  # group MILP time before the decomposition or the knapsack tries again
WARM_CLOSE = 0.01  # a warm start this close to the LP bound replaces the quick incumbent


@dataclass
class Solved:
    """A solved group MILP, read back as pipelines with integer vGPU counts."""

    chosen: list[list[tuple[CandidatePipeline, list[int]]]]
    result: MilpResult
    enumerations: list[Enumeration]
    group: GroupMilp
    kept: list[list[CandidatePipeline]]  # candidates left after LP-bound pruning
    proof: str = "milp"  # what proved the bound (SolverInfo.proof)
    warm_objective: float | None = None  # of the warm start fitted to the cluster, if any


def model_costs(
    req: PlanRequest, lam: list[float | None], whole_gpus_only: bool
) -> list[ModelCosts]:
    allowed: dict[str, tuple[int, ...]] | None = (
        {p.gpu: (1,) for p in req.cluster.pools} if whole_gpus_only else None
    )
    return [
        ModelCosts(m, req.cluster, slo, req.margin, lam[i], allowed_shares=allowed)
        for i, (m, slo) in enumerate(zip(req.models, req.slos_us, strict=True))
    ]


def _infeasible(req: PlanRequest, costs: ModelCosts, en: Enumeration, what: str) -> InfeasibleError:
    best = (
        "no configuration is profiled"
        if not math.isfinite(en.best_latency_us)
        else (f"the fastest configuration takes {en.best_latency_us:,.0f} µs")
    )
    return InfeasibleError(
        f"model {costs.profile.name}: no {what} configuration meets its SLO of "
        f"{costs.slo_us:,.0f} µs on cluster {req.cluster.name} (planning budget "
        f"{costs.budget_us():,.0f} µs after margin {req.margin}); {best}. Loosen the SLO "
        "(--slo-scale / --slo-us), lower --margin, or allow more partitions."
    )


def enumerate_candidates(
    req: PlanRequest, costs: list[ModelCosts], max_partitions: int, what: str = "feasible"
) -> tuple[list[Enumeration], list[list[CandidatePipeline]]]:
    """Every model's non-dominated candidate pipelines; InfeasibleError names a model without."""
    merge = req.packing == "per-share"
    enums = [enumerate_pipelines(c, max_partitions, merge_same_bucket=merge) for c in costs]
    for c, en in zip(costs, enums, strict=True):
        if not en.pipelines:
            raise _infeasible(req, c, en, what)
    cands = [en.pipelines for en in enums]
    if req.packing == "per-position":
        cands = [drop_share_dominated(c) for c in cands]
    return enums, cands


def solve_group(
    req: PlanRequest,
    costs: list[ModelCosts],
    max_partitions: int,
    what: str,
    enough: float | None = None,
) -> Solved:
    """Solve one group MILP and prove its plan optimal (within the gap) as fast as we can.

    Proofs, cheapest first: the knapsacks (knapsack.py) on the quick incumbent, whose own
    solution may close the gap; the group MILP, which stops once it reaches their bound;
    for per-position groups of several models, after GROUP_TRY_S of it, the knapsacks on
    its better incumbent, then the per-model decomposition (decompose.py). A warm start
    (PlanRequest.warm_start, fitted to the cluster by warm.py) is the first incumbent.
    `enough`: stop at the first plan scoring at least this (proof "target", unproven).
    """
    enums, cands = enumerate_candidates(req, costs, max_partitions, what)
    names = [m.name for m in req.models]
    warm = warm_chosen(req.warm_start, names, cands, list(req.weights), req.cluster, req.packing)
    solved = _solve(req, enums, cands, warm, enough)
    solved.warm_objective = warm[1] if warm is not None else None
    return solved


def _solve(
    req: PlanRequest,
    enums: list[Enumeration],
    cands: list[list[CandidatePipeline]],
    warm: tuple[list[Chosen], float] | None,
    enough: float | None = None,
) -> Solved:
    weights = list(req.weights)
    quick: _Quick | None = None
    dropped_bound = -math.inf
    if sum(len(c) for c in cands) > PRUNE_ABOVE:
        cands, quick, dropped_bound = prune(req, cands, warm, enough)
    group = build_group_milp(cands, weights, req.cluster, req.packing)
    start, target = None, None
    if warm is not None and quick is None:
        start = _start_values(group, cands, *warm)
    known_bound, before = math.inf, quick.seconds if quick is not None else 0.0
    split = len(cands) > 1 and decomposable(req.cluster, req.packing)
    if quick is not None and quick.chosen is not None:
        known = _quick_result(req, quick, dropped_bound)
        if enough is not None and quick.objective >= enough:
            known.status = "target"
            return Solved(quick.chosen, known, enums, group, cands, proof="target")
        chosen = _knapsack_proof(req, cands, quick, known) or quick.chosen
        if known.gap <= req.mip_gap or (enough is not None and known.bound < enough):
            return Solved(chosen, known, enums, group, cands, proof="knapsack")
        start = _start_values(group, cands, chosen, known.objective)
        known_bound, before = known.bound, known.seconds
        # The MILP may stop at any plan within the gap of the bound known so far.
        target = known_bound / (1 + req.mip_gap)
    if enough is not None:
        target = enough if target is None else min(target, enough)
    limit = min(req.time_limit_s, GROUP_TRY_S) if split else req.time_limit_s
    result = solve(group.milp, req.solver, limit, req.mip_gap, req.threads, start, target)
    if not result.has_solution or result.values is None:
        raise SolverError(
            f"{req.solver} found no plan ({result.status}) for {[m.name for m in req.models]} "
            f"on {req.cluster.name} within {req.time_limit_s:g} s; raise --time-limit"
        )
    # The bound covers dropped candidates too: a plan using one scores <= dropped_bound.
    result.bound = max(result.bound, dropped_bound)
    if dropped_bound > result.objective:
        result.gap = max(result.gap, relative_gap(result.objective, result.bound))
    solved = Solved(_read_counts(group, cands, result.values), result, enums, group, cands)
    result.seconds += before
    if enough is not None and result.objective >= enough:
        result.status, solved.proof = "target", "target"
        return solved
    if known_bound < result.bound:
        result.bound = known_bound
        result.gap = relative_gap(result.objective, result.bound)
        if result.gap <= req.mip_gap:
            assert quick is not None  # known_bound is finite only after the knapsacks ran
            solved.proof = "knapsack" if known_bound < quick.bounds.dual_bound else "lp"
    if result.gap <= req.mip_gap:
        result.status = "optimal"
        return solved
    if not split:
        return solved  # the MILP had all the time
    if quick is not None and quick.chosen is not None and result.objective > quick.objective:
        # A better incumbent filters the knapsacks' options harder: they may prove it now.
        solved.chosen = _knapsack_proof(req, cands, quick, result) or solved.chosen
        if result.gap <= req.mip_gap:
            solved.proof = "knapsack"
            return solved
    solved.chosen = _close_gap(req, cands, result, solved.chosen)
    solved.proof = "decomposition"
    return solved


def _quick_result(req: PlanRequest, quick: _Quick, dropped_bound: float) -> MilpResult:
    """The quick incumbent as a result, with the LP bound (covering dropped candidates)."""
    bound = max(quick.bounds.dual_bound, dropped_bound, quick.objective)
    gap = relative_gap(quick.objective, bound)
    return MilpResult(req.solver, "time_limit", None, quick.objective, bound, gap, quick.seconds)


def _knapsack_proof(
    req: PlanRequest, cands: list[list[CandidatePipeline]], quick: _Quick, result: MilpResult
) -> list[list[tuple[CandidatePipeline, list[int]]]] | None:
    """Tighten `result` by the knapsacks (knapsack.py): their bound, and their own solution
    when it fits the cluster and beats result's plan (returned; None otherwise). Its status
    becomes optimal when that closes the gap.

    The knapsacks bound plans over the kept candidates; plans using a dropped one score
    below the quick incumbent (that is how they were dropped), so below result.objective.
    """
    weights = list(req.weights)
    kb = knapsack_bound(cands, weights, quick.bounds, req.cluster, result.objective)
    if kb is None:
        return None
    result.seconds += kb.seconds
    result.bound = min(result.bound, max(kb.bound, result.objective))
    found, chosen = None, kb.chosen
    if chosen is not None and not chosen_fits(chosen, req.cluster, req.packing):
        chosen = fit_by_swaps(chosen, cands, req.cluster, req.packing)
    if chosen is not None:
        objective = chosen_objective(chosen, weights)
        if objective > result.objective:
            found, result.objective = chosen, objective
            result.bound = max(result.bound, objective)
    result.gap = relative_gap(result.objective, result.bound)
    if result.gap <= req.mip_gap:
        result.status = "optimal"
    return found


def _close_gap(
    req: PlanRequest,
    cands: list[list[CandidatePipeline]],
    result: MilpResult,
    chosen: list[list[tuple[CandidatePipeline, list[int]]]],
) -> list[list[tuple[CandidatePipeline, list[int]]]]:
    """Prove (or improve) the incumbent by the per-model decomposition (decompose.py).

    Asks for a plan at z = incumbent · (1 + gap/2): none means the incumbent is within half
    the gap tolerance of the optimum; one becomes the new incumbent and the question is
    asked again. `result` is updated in place (objective, bound, gap, status, seconds).
    """
    left = req.time_limit_s - result.seconds
    while result.objective > 0 and left > 0 and result.gap > req.mip_gap:
        target = result.objective * (1 + req.mip_gap / 2)
        r = reach(cands, list(req.weights), req.cluster, target, req.solver, left, req.threads)
        result.seconds += r.seconds
        left -= r.seconds
        if r.status == "unknown":
            break
        if r.status == "infeasible":
            # Candidates dropped by LP-bound pruning score below the first incumbent (that
            # is how they were dropped), so below target: the bound covers them too.
            result.bound = min(result.bound, target)
        else:
            assert r.chosen is not None
            chosen, result.objective = r.chosen, r.objective
        result.gap = relative_gap(result.objective, result.bound)
    result.status = "optimal" if result.gap <= req.mip_gap else result.status
    return chosen


def _read_counts(
    group: GroupMilp, cands: list[list[CandidatePipeline]], vals: np.ndarray
) -> list[list[tuple[CandidatePipeline, list[int]]]]:
    """Pipelines with at least one vGPU in every partition, with their vGPU counts."""
    chosen = []
    for m, model_cands in enumerate(cands):
        picked = []
        for c, cand in enumerate(model_cands):
            counts = [math.floor(vals[v] + ROUND_TOL) for v in group.n[m][c]]
            if min(counts) > 0:
                picked.append((cand, counts))
        chosen.append(picked)
    return chosen


def _start_values(
    group: GroupMilp,
    cands: list[list[CandidatePipeline]],
    chosen: list[list[tuple[CandidatePipeline, list[int]]]],
    objective: float,
) -> dict[int, float]:
    """A MIP start from an earlier plan; GPU bucket variables are left to the solver."""
    start = {group.z: objective}
    for m, model_cands in enumerate(cands):
        used = {id(c): counts for c, counts in chosen[m]}
        for c, cand in enumerate(model_cands):
            counts = used.get(id(cand), [0] * len(cand.partitions))
            start[group.x[m][c]] = served(cand, counts)
            for var, n in zip(group.n[m][c], counts, strict=True):
                start[var] = float(n)
    return start


@dataclass
class _Quick:
    seconds: float
    objective: float
    chosen: list[list[tuple[CandidatePipeline, list[int]]]] | None
    bounds: CandidateBounds  # the LP duals and per-candidate bounds pruning used


def prune(
    req: PlanRequest,
    cands: list[list[CandidatePipeline]],
    warm: tuple[list[Chosen], float] | None = None,
    enough: float | None = None,
) -> tuple[list[list[CandidatePipeline]], _Quick, float]:
    """Drop candidates that provably cannot be in a plan better than a quick incumbent
    (the quick MILP's, started from `warm` when given, or `warm` itself if better; the
    quick MILP stops at `enough` when given).

    Returns the kept candidates, the incumbent, and the best objective any plan using a
    dropped candidate could reach (-inf if none was dropped).
    """
    cb = candidate_bounds(cands, list(req.weights), req.cluster)
    seconds = cb.seconds
    chosen: list[Chosen] | None
    if warm is not None and warm[1] * (1 + WARM_CLOSE) >= cb.dual_bound:
        chosen, incumbent = warm  # close enough to the LP bound: no quick MILP
    else:
        top = [_incumbent_pool(mc, b) for mc, b in zip(cands, cb.bounds, strict=True)]
        start = None
        if warm is not None:  # the warm plan's pipelines join the pool, and start it
            for pool, picked in zip(top, warm[0], strict=True):
                pool.extend(c for c, _ in picked if all(c is not t for t in pool))
        group = build_group_milp(top, list(req.weights), req.cluster, req.packing)
        if warm is not None:
            start = _start_values(group, top, *warm)
        limit = min(req.time_limit_s, INCUMBENT_TIME_S)
        res = solve(group.milp, req.solver, limit, INCUMBENT_GAP, req.threads, start, enough)
        seconds += res.seconds
        chosen = _read_counts(group, top, res.values) if res.values is not None else None
        incumbent = res.objective if chosen is not None else 0.0
        if warm is not None and warm[1] > incumbent:
            chosen, incumbent = warm
    kept, dropped_bound = [], -math.inf
    for model_cands, b in zip(cands, cb.bounds, strict=True):
        keep = keep_mask(b, incumbent)
        kept.append([c for c, k in zip(model_cands, keep, strict=True) if k])
        if (~keep).any():
            dropped_bound = max(dropped_bound, float(b[~keep].max()))
    return kept, _Quick(seconds, incumbent, chosen, cb), dropped_bound


def _incumbent_pool(cands: list[CandidatePipeline], bounds: np.ndarray) -> list[CandidatePipeline]:
    """The best-bounded candidates, at most INCUMBENT_PER_SIGNATURE per GPU-bucket signature."""
    taken: dict[tuple, int] = {}
    pool = []
    for i in np.argsort(-bounds, kind="stable"):
        sig = tuple((p.gpu, p.share) for p in cands[i].partitions)
        if taken.get(sig, 0) < INCUMBENT_PER_SIGNATURE:
            taken[sig] = taken.get(sig, 0) + 1
            pool.append(cands[i])
            if len(pool) >= INCUMBENT_POOL:
                break
    return pool
