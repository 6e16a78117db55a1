"""The exact solve of one group MILP, as an ordered list of proof steps over one solve
state (README, docs/planning.md, "How the planner is exact and fast"):

1. `prune`: candidates enumerated; when there are many, a quick incumbent and LP-bound
   elimination (pruning.py): the incumbent is the first plan, the LP bound (covering the
   candidates dropped) the first bound;
2. `knapsacks`: the knapsack bound on that incumbent (knapsack.py), and the knapsacks' own
   plan when it fits the cluster;
3. `group_milp`: HiGHS on the group MILP from the best plan so far, stopping once it
   reaches the bound known so far; its plan and bound are taken;
4. `knapsacks_again`: when the MILP found a better incumbent, the knapsacks again (a better
   incumbent leaves them fewer options);
5. `decomposition`: per-model MILPs and a small DP (decompose.py) asking whether a plan
   half a gap better exists, until none does or time runs out.

Each step may raise the objective (`SolveState.found`) and lower the bound
(`SolveState.bounded`, naming the proof), and says whether the solve is finished: proven
within the gap, at a `target` (`enough`), or with nothing left to try.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

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

Choice = list[Chosen]  # per model: its pipelines and their vGPU counts


@dataclass
class Solved:
    """A solved group MILP, read back as pipelines with integer vGPU counts."""

    chosen: Choice
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
    room = req.headroom_rates or (None,) * len(req.models)
    return [
        ModelCosts(
            m,
            req.cluster,
            slo,
            req.margin,
            lam[i],
            allowed_shares=allowed,
            inputs=req.count_inputs,
            headroom_rate=room[i],
        )
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
    floor: float | None = None,
) -> Solved:
    """Solve one group MILP and prove its plan optimal (within the gap) as fast as we can,
    by the proof steps of this module, cheapest first. A warm start
    (PlanRequest.warm_start, fitted to the cluster by warm.py) is the first incumbent.
    `enough`: stop at the first plan scoring at least this (proof "target", unproven).
    `floor`: the caller has a plan scoring this and wants only better ones: candidates
    that cannot beat it are dropped, and the solve stops once it proves that no plan
    scores more (status and proof "cutoff", the floor as bound, the best plan it had,
    maybe none: every model without pipelines)."""
    enums, cands = enumerate_candidates(req, costs, max_partitions, what)
    names = [m.name for m in req.models]
    warm = warm_chosen(req.warm_start, names, cands, list(req.weights), req.cluster, req.packing)
    state = SolveState(req, enums, cands, warm, enough, floor)
    for step in STEPS:
        if step(state):
            break
    solved = state.solved()
    solved.warm_objective = warm[1] if warm is not None else None
    return solved


# ---------------------------------------------------------------------------- the state


@dataclass
class _Quick:
    seconds: float
    objective: float
    chosen: Choice | None
    bounds: CandidateBounds  # the LP duals and per-candidate bounds pruning used


@dataclass
class SolveState:
    """One group MILP's solve as it goes: the best plan found (`chosen`, `objective`), the
    bound no plan exceeds (`bound`) and what proved it (`proof`), the gap between them, the
    last solver status and the seconds spent; and what earlier steps leave the later ones
    (the candidates kept, the quick incumbent, the MILP and its start)."""

    req: PlanRequest
    enums: list[Enumeration]
    cands: list[list[CandidatePipeline]]
    warm: tuple[list[Chosen], float] | None
    enough: float | None
    floor: float | None = None  # only plans above it are wanted (solve_group)
    chosen: Choice | None = None
    objective: float = -math.inf
    bound: float = math.inf
    gap: float = math.inf
    proof: str = "milp"
    status: str = "time_limit"  # the last solver's (the solve's: see solved())
    reached_target: bool = False  # stopped at a plan scoring `enough`, unproven
    seconds: float = 0.0
    values: np.ndarray | None = None  # the group MILP's solution, once it ran
    nodes: int = 0
    group: GroupMilp | None = None
    quick: _Quick | None = None
    dropped_bound: float = -math.inf  # the most a plan using a dropped candidate scores
    start: dict[int, float] | None = None  # the group MILP's MIP start
    known_bound: float = math.inf  # the bound the MILP is asked to reach
    split: bool = False  # the per-model decomposition applies
    weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.weights = list(self.req.weights)

    @property
    def proven(self) -> bool:
        return self.gap <= self.req.mip_gap

    @property
    def cut_off(self) -> bool:
        """No plan scores more than the floor: the caller's plan is at least as good."""
        return self.floor is not None and self.bound <= self.floor

    @property
    def at_target(self) -> bool:
        return self.enough is not None and self.objective >= self.enough

    def found(self, chosen: Choice, objective: float) -> None:
        """A plan better than the best so far (the bound stays at least its objective)."""
        self.chosen, self.objective = chosen, objective
        self.bound = max(self.bound, objective)
        self.gap = relative_gap(self.objective, self.bound)

    def bounded(self, bound: float, proof: str) -> None:
        """No plan scores more than `bound` (by `proof`): the bound only ever falls."""
        if bound < self.bound:
            self.bound, self.proof = bound, proof
        self.gap = relative_gap(self.objective, self.bound)

    def solved(self) -> Solved:
        assert self.chosen is not None and self.group is not None  # every path sets them
        status = self.status
        if self.reached_target:
            status = "target"
        elif self.proven:
            status = "optimal"
        elif self.cut_off:
            status = self.proof = "cutoff"
        result = MilpResult(
            self.req.solver,
            status,
            self.values,
            self.objective,
            self.bound,
            self.gap,
            self.seconds,
            self.nodes,
        )
        return Solved(self.chosen, result, self.enums, self.group, self.cands, proof=self.proof)


Step = Callable[[SolveState], bool]


# ---------------------------------------------------------------------------- the steps


def prune_step(s: SolveState) -> bool:
    """1. With many candidates: a quick incumbent and LP-bound elimination. Objective: the
    incumbent's; bound: the LP bound, covering every candidate dropped (a plan using one
    scores at most the best of their bounds). Finished at a target."""
    req = s.req
    if sum(len(c) for c in s.cands) > PRUNE_ABOVE:
        s.cands, s.quick, s.dropped_bound = prune(req, s.cands, s.warm, s.enough, s.floor)
    s.group = build_group_milp(s.cands, s.weights, req.cluster, req.packing)
    if s.warm is not None and s.quick is None:
        s.start = _start_values(s.group, s.cands, *s.warm)
    s.split = len(s.cands) > 1 and decomposable(req.cluster, req.packing)
    q = s.quick
    if q is not None:
        s.seconds = q.seconds
    if q is None or q.chosen is None:
        return False
    s.chosen, s.objective = q.chosen, q.objective
    s.bound = max(q.bounds.dual_bound, s.dropped_bound, q.objective)
    s.gap = relative_gap(s.objective, s.bound)
    if s.at_target:
        s.reached_target, s.proof = True, "target"
        return True
    return False


def knapsack_step(s: SolveState) -> bool:
    """2. The knapsacks on the quick incumbent: their bound, and their plan when it fits
    and beats the incumbent. Finished when that proves the incumbent, or shows that no
    plan reaches the target; otherwise the MILP starts from the best plan and may stop at
    the bound known now."""
    q = s.quick
    if q is None or q.chosen is None:
        return False
    _knapsacks(s, q)
    if s.proven or s.cut_off or (s.enough is not None and s.bound < s.enough):
        s.proof = "knapsack"
        return True
    assert s.group is not None and s.chosen is not None
    s.start = _start_values(s.group, s.cands, s.chosen, s.objective)
    s.known_bound = s.bound
    return False


def milp_step(s: SolveState) -> bool:
    """3. The group MILP (all the time there is; GROUP_TRY_S where the decomposition may
    follow), stopping at any plan within the gap of the bound known so far, or at the
    target. Its plan and its bound replace the incumbent and the bound, but its bound never
    below what dropped candidates could reach, and the bound known before (the LP's or the
    knapsacks') when that is lower."""
    req, group = s.req, s.group
    assert group is not None
    target = None if math.isinf(s.known_bound) else s.known_bound / (1 + req.mip_gap)
    if s.enough is not None:
        target = s.enough if target is None else min(target, s.enough)
    limit = min(req.time_limit_s, GROUP_TRY_S) if s.split else req.time_limit_s
    # cut off at the floor unless the incumbent is the caller's plan itself (a warm start
    # at the floor): the solver then starts from it, where a cutoff would refuse it
    cutoff = None
    had = max(s.objective, s.warm[1] if s.warm is not None else -math.inf)
    if s.floor is not None and had * (1 + req.mip_gap) < s.floor:
        cutoff = s.floor
    result = solve(group.milp, req.solver, limit, req.mip_gap, req.threads, s.start, target, cutoff)
    s.seconds += result.seconds
    if result.status == "cutoff":  # nothing beats the caller's plan: keep the best had
        if s.chosen is None:
            s.chosen, s.objective = [[] for _ in s.cands], 0.0
        s.status, s.nodes = "cutoff", result.nodes
        s.bounded(result.bound, "cutoff")
        return True
    if not result.has_solution or result.values is None:
        raise SolverError(
            f"{req.solver} found no plan ({result.status}) for {[m.name for m in req.models]} "
            f"on {req.cluster.name} within {req.time_limit_s:g} s; raise --time-limit"
        )
    s.nodes, s.status = result.nodes, result.status
    if s.chosen is None or result.objective >= s.objective:  # (below: a cutoff's)
        s.chosen = read_counts(group, s.cands, result.values)
        s.objective, s.values = result.objective, result.values
    s.bound, s.proof = max(result.bound, s.dropped_bound), "milp"
    s.gap = relative_gap(s.objective, s.bound) if cutoff is not None else result.gap
    if s.dropped_bound > s.objective:
        s.gap = max(s.gap, relative_gap(s.objective, s.bound))
    if s.at_target:
        s.reached_target, s.proof = True, "target"
        return True
    if s.known_bound < s.bound:
        s.bound = s.known_bound
        s.gap = relative_gap(s.objective, s.bound)
        if s.proven:
            assert s.quick is not None  # the bound is known only after the knapsacks ran
            s.proof = "knapsack" if s.known_bound < s.quick.bounds.dual_bound else "lp"
    return s.proven or not s.split  # without the decomposition, the MILP had all the time


def knapsack_again_step(s: SolveState) -> bool:
    """4. A better incumbent than the quick one filters the knapsacks' options harder:
    they may prove it now."""
    q = s.quick
    if q is None or q.chosen is None or s.objective <= q.objective:
        return False
    _knapsacks(s, q)
    if s.proven:
        s.proof = "knapsack"
        return True
    return False


def decomposition_step(s: SolveState) -> bool:
    """5. The per-model decomposition (decompose.py) asks for a plan at objective × (1 +
    gap/2): none lowers the bound to that (candidates dropped by LP-bound pruning score
    below the first incumbent, so below it too); one becomes the incumbent and the
    question is asked again, until the gap closes or time runs out."""
    req = s.req
    s.proof = "decomposition"
    left = req.time_limit_s - s.seconds
    while s.objective > 0 and left > 0 and not s.proven:
        target = s.objective * (1 + req.mip_gap / 2)
        r = reach(s.cands, s.weights, req.cluster, target, req.solver, left, req.threads)
        s.seconds += r.seconds
        left -= r.seconds
        if r.status == "unknown":
            break
        if r.status == "infeasible":
            s.bound = min(s.bound, target)
        else:
            assert r.chosen is not None
            s.chosen, s.objective = r.chosen, r.objective
        s.gap = relative_gap(s.objective, s.bound)
    return True


STEPS: tuple[Step, ...] = (
    prune_step,
    knapsack_step,
    milp_step,
    knapsack_again_step,
    decomposition_step,
)


def _knapsacks(s: SolveState, q: _Quick) -> None:
    """The knapsack bound on the best plan so far (it bounds plans over the kept candidates;
    plans using a dropped one score below the quick incumbent, so below the objective), and
    the knapsacks' own plan, fitted to the cluster, when it is better."""
    req = s.req
    kb = knapsack_bound(s.cands, s.weights, q.bounds, req.cluster, s.objective)
    if kb is None:
        return
    s.seconds += kb.seconds
    s.bounded(max(kb.bound, s.objective), "knapsack")
    chosen = kb.chosen
    if chosen is not None and not chosen_fits(chosen, req.cluster, req.packing):
        chosen = fit_by_swaps(chosen, s.cands, req.cluster, req.packing)
    if chosen is not None:
        objective = chosen_objective(chosen, s.weights)
        if objective > s.objective:
            s.found(chosen, objective)


# ---------------------------------------------------------------------------- helpers


def read_counts(group: GroupMilp, cands: list[list[CandidatePipeline]], vals: np.ndarray) -> Choice:
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
    chosen: Choice,
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


def prune(
    req: PlanRequest,
    cands: list[list[CandidatePipeline]],
    warm: tuple[list[Chosen], float] | None = None,
    enough: float | None = None,
    floor: float | None = None,
) -> tuple[list[list[CandidatePipeline]], _Quick, float]:
    """Drop candidates that provably cannot be in a plan better than a quick incumbent
    (the quick MILP's, started from `warm` when given, or `warm` itself if better; the
    quick MILP stops at `enough` when given), or than `floor` where that is higher (a
    plan the caller has).

    Returns the kept candidates, the incumbent, and the best objective any plan using a
    dropped candidate could reach (-inf if none was dropped).
    """
    cb = candidate_bounds(cands, list(req.weights), req.cluster)
    seconds = cb.seconds
    chosen: Choice | None
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
        chosen = read_counts(group, top, res.values) if res.values is not None else None
        incumbent = res.objective if chosen is not None else 0.0
        if warm is not None and warm[1] > incumbent:
            chosen, incumbent = warm
    kept, dropped_bound = [], -math.inf
    least = incumbent if floor is None else max(incumbent, floor)
    for model_cands, b in zip(cands, cb.bounds, strict=True):
        keep = keep_mask(b, least)
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
