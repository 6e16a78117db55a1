"""The three planning strategies of planner.md: ppipe, np (no partitioning) and dart-r.

`make_plan(request)` returns a verified `Plan`. The NP plan solved without the batch-wait
term provides λ̂ (each model's expected arrival rate) for the batch-wait term of every
strategy, as in the published plans.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from poolpipe.cluster import Cluster
from poolpipe.costs import ModelCosts
from poolpipe.errors import InfeasibleError, PoolpipeError, SolverError
from poolpipe.plan import (
    PACKINGS,
    STRATEGIES,
    ModelPlan,
    PartitionPlan,
    PipelinePlan,
    Plan,
    SolverInfo,
)
from poolpipe.planner.candidates import (
    CandidatePipeline,
    Enumeration,
    drop_share_dominated,
    enumerate_pipelines,
)
from poolpipe.planner.decompose import decomposable, reach
from poolpipe.planner.formulation import (
    GroupMilp,
    build_group_milp,
    chosen_fits,
    chosen_objective,
    fit_by_swaps,
    served,
)
from poolpipe.planner.knapsack import knapsack_bound
from poolpipe.planner.pruning import CandidateBounds, candidate_bounds, keep_mask
from poolpipe.planner.solvers import (
    DEFAULT_MIP_GAP,
    DEFAULT_TIME_LIMIT_S,
    SOLVERS,
    MilpResult,
    relative_gap,
    solve,
)
from poolpipe.profiles import ModelProfile

ROUND_TOL = 1e-6  # integrality slack when reading vGPU counts back from the solver
PRUNE_ABOVE = 60  # candidates (all models) above which LP-bound pruning runs first
INCUMBENT_POOL = 48  # per model: best-bounded candidates in the quick incumbent MILP
INCUMBENT_PER_SIGNATURE = 2  # ... at most this many of each GPU-bucket signature
INCUMBENT_TIME_S = 2.0  # time limit of the quick incumbent MILP
INCUMBENT_GAP = 3e-3  # its gap: the knapsack and the group MILP do the rest
GROUP_TRY_S = 2.0  # group MILP time before the decomposition or the knapsack tries again


@dataclass(frozen=True)
class PlanRequest:
    """Everything a planning run depends on."""

    models: tuple[ModelProfile, ...]
    weights: tuple[float, ...]
    slos_us: tuple[float, ...]
    cluster: Cluster
    strategy: str = "ppipe"
    packing: str = "per-share"
    margin: float = 0.4
    max_partitions: int = 2
    solver: str = "highs"
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    mip_gap: float = DEFAULT_MIP_GAP
    threads: int | None = None
    batch_wait: bool = True  # include the batch-fill estimate in pipeline latency

    def __post_init__(self) -> None:
        n = len(self.models)
        if n == 0:
            raise PoolpipeError("no models to plan; pass --models A,B,...")
        if len(self.weights) != n or len(self.slos_us) != n:
            raise PoolpipeError(
                f"{n} models but {len(self.weights)} weights and {len(self.slos_us)} SLOs; "
                "give one weight (--weights) and one SLO per model"
            )
        names = [m.name for m in self.models]
        if len(set(names)) != n:
            raise PoolpipeError(f"a model is listed twice: {names}")
        if any(not (w > 0 and math.isfinite(w)) for w in self.weights):
            raise PoolpipeError(f"weights must be positive numbers, got {list(self.weights)}")
        if any(not (s > 0 and math.isfinite(s)) for s in self.slos_us):
            raise PoolpipeError(f"SLOs must be positive numbers of µs, got {list(self.slos_us)}")
        if self.strategy not in STRATEGIES:
            raise PoolpipeError(
                f"unknown strategy {self.strategy!r}; choose {', '.join(STRATEGIES)}"
            )
        if self.packing not in PACKINGS:
            raise PoolpipeError(f"unknown packing {self.packing!r}; choose {', '.join(PACKINGS)}")
        if not 0 <= self.margin < 1:
            raise PoolpipeError(f"margin must be in [0, 1), got {self.margin}")
        if self.max_partitions < 1:
            raise PoolpipeError(f"max partitions must be >= 1, got {self.max_partitions}")
        if self.solver not in SOLVERS:
            raise PoolpipeError(f"unknown solver {self.solver!r}; choose {', '.join(SOLVERS)}")
        for m in self.models:
            if not any(gpu in m.gpus for gpu in (p.gpu for p in self.cluster.pools)):
                raise PoolpipeError(
                    f"model {m.name} has no profile for any GPU type of cluster "
                    f"{self.cluster.name} ({[p.gpu for p in self.cluster.pools]}); it has {m.gpus}"
                )


@dataclass
class _Solved:
    """A solved group MILP, read back as pipelines with integer vGPU counts."""

    chosen: list[list[tuple[CandidatePipeline, list[int]]]]
    result: MilpResult
    enumerations: list[Enumeration]
    group: GroupMilp
    kept: list[list[CandidatePipeline]]  # candidates left after LP-bound pruning
    proof: str = "milp"  # what proved the bound (SolverInfo.proof)


def _costs(req: PlanRequest, lam: list[float | None], whole_gpus_only: bool) -> list[ModelCosts]:
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


def _solve_group(
    req: PlanRequest, costs: list[ModelCosts], max_partitions: int, what: str
) -> _Solved:
    """Solve one group MILP and prove its plan optimal (within the gap) as fast as we can.

    Proofs, cheapest first: the knapsacks (knapsack.py) on the quick incumbent, whose own
    solution may close the gap; the group MILP, which stops once it reaches their bound;
    for per-position groups of several models, after GROUP_TRY_S of it, the knapsacks on
    its better incumbent, then the per-model decomposition (decompose.py).
    """
    enums, cands = enumerate_candidates(req, costs, max_partitions, what)
    quick: _Quick | None = None
    dropped_bound = -math.inf
    if sum(len(c) for c in cands) > PRUNE_ABOVE:
        cands, quick, dropped_bound = _prune(req, cands)
    group = build_group_milp(cands, list(req.weights), req.cluster, req.packing)
    start, target = None, None
    known_bound, before = math.inf, quick.seconds if quick is not None else 0.0
    split = len(cands) > 1 and decomposable(req.cluster, req.packing)
    if quick is not None and quick.chosen is not None:
        known = _quick_result(req, quick, dropped_bound)
        chosen = _knapsack_proof(req, cands, quick, known) or quick.chosen
        if known.gap <= req.mip_gap:
            return _Solved(chosen, known, enums, group, cands, proof="knapsack")
        start = _start_values(group, cands, chosen, known.objective)
        known_bound, before = known.bound, known.seconds
        # The MILP may stop at any plan within the gap of the bound known so far.
        target = known_bound / (1 + req.mip_gap)
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
    solved = _Solved(_read_counts(group, cands, result.values), result, enums, group, cands)
    result.seconds += before
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


def _prune(
    req: PlanRequest, cands: list[list[CandidatePipeline]]
) -> tuple[list[list[CandidatePipeline]], _Quick, float]:
    """Drop candidates that provably cannot be in a plan better than a quick incumbent.

    Returns the kept candidates, the incumbent, and the best objective any plan using a
    dropped candidate could reach (-inf if none was dropped).
    """
    cb = candidate_bounds(cands, list(req.weights), req.cluster)
    top = [_incumbent_pool(mc, b) for mc, b in zip(cands, cb.bounds, strict=True)]
    group = build_group_milp(top, list(req.weights), req.cluster, req.packing)
    res = solve(
        group.milp, req.solver, min(req.time_limit_s, INCUMBENT_TIME_S), INCUMBENT_GAP, req.threads
    )
    chosen = _read_counts(group, top, res.values) if res.values is not None else None
    incumbent = res.objective if chosen is not None else 0.0
    kept, dropped_bound = [], -math.inf
    for model_cands, b in zip(cands, cb.bounds, strict=True):
        keep = keep_mask(b, incumbent)
        kept.append([c for c, k in zip(model_cands, keep, strict=True) if k])
        if (~keep).any():
            dropped_bound = max(dropped_bound, float(b[~keep].max()))
    return kept, _Quick(res.seconds + cb.seconds, incumbent, chosen, cb), dropped_bound


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


def _pipeline_plan(cand: CandidatePipeline, counts: list[int]) -> PipelinePlan:
    parts = tuple(
        PartitionPlan(
            start=p.start,
            end=p.end,
            gpu=p.gpu,
            share=p.share,
            vgpus=n,
            latency_us=p.latency_us,
            transfer_us=p.transfer_us,
            vgpu_throughput=p.vgpu_throughput,
        )
        for p, n in zip(cand.partitions, counts, strict=True)
    )
    return PipelinePlan(
        batch=cand.batch,
        latency_us=cand.latency_us,
        throughput=min(q.throughput for q in parts),
        partitions=parts,
    )


def _assemble(
    req: PlanRequest,
    strategy: str,
    max_partitions: int,
    pipelines: list[list[PipelinePlan]],
    lam: list[float | None],
    solver: SolverInfo,
    meta: dict | None = None,
) -> Plan:
    models = tuple(
        ModelPlan(
            name=m.name,
            weight=w,
            slo_us=slo,
            throughput=sum(p.throughput for p in pipes),
            pipelines=tuple(sorted(pipes, key=lambda p: -p.throughput)),
            est_throughput=lam[i],
        )
        for i, (m, w, slo, pipes) in enumerate(
            zip(req.models, req.weights, req.slos_us, pipelines, strict=True)
        )
    )
    objective = min(m.throughput / m.weight for m in models)
    return Plan(
        strategy=strategy,
        cluster=req.cluster,
        packing=req.packing,
        margin=req.margin,
        max_partitions=max_partitions,
        models=models,
        objective=objective,
        solver=solver,
        meta=meta or {},
    )


def _solver_info(solved: list[_Solved], started: float) -> SolverInfo:
    last = solved[-1]
    statuses = {s.result.status for s in solved}
    status = "optimal" if statuses == {"optimal"} else ",".join(sorted(statuses))
    return SolverInfo(
        name=last.result.solver,
        status=status,
        gap=max(s.result.gap for s in solved),
        seconds=time.perf_counter() - started,
        milp_seconds=sum(s.result.seconds for s in solved),
        num_vars=last.group.milp.num_vars,
        num_integer=last.group.milp.num_integer,
        num_rows=last.group.milp.num_rows,
        candidates=sum(len(c) for c in last.kept),
        feasible_configs=sum(e.feasible for e in last.enumerations),
        proof=last.proof,
    )


def estimate_arrival_rates(req: PlanRequest) -> tuple[list[float | None], _Solved | None]:
    """λ̂: each model's throughput in the NP plan solved without the batch-wait term.

    Models that no whole GPU can serve within the SLO get λ̂ = 0 (batch 1 only); the others
    are planned together among themselves.
    """
    if not req.batch_wait:
        return [None] * len(req.models), None
    costs = _costs(req, [None] * len(req.models), whole_gpus_only=True)
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
    solved = _solve_group(sub, [costs[i] for i in ok], 1, "whole-GPU")
    for j, i in enumerate(ok):
        lam[i] = sum(_pipeline_plan(c, n).throughput for c, n in solved.chosen[j])
    return lam, solved


def make_plan(req: PlanRequest) -> Plan:
    """Plan the group with the request's strategy; the result is verified."""
    started = time.perf_counter()
    lam, lam_solved = estimate_arrival_rates(req)
    if req.strategy == "dart-r":
        plan = _plan_dart_r(req, lam, lam_solved, started)
    else:
        whole = req.strategy == "np"
        P = 1 if whole else req.max_partitions
        costs = _costs(req, lam, whole_gpus_only=whole)
        solved = _solve_group(req, costs, P, "whole-GPU" if whole else f"{P}-partition")
        pipelines = [[_pipeline_plan(c, n) for c, n in picked] for picked in solved.chosen]
        runs = [s for s in (lam_solved, solved) if s is not None]
        plan = _assemble(req, req.strategy, P, pipelines, lam, _solver_info(runs, started))
    plan.verify({m.name: m for m in req.models})
    return plan


# ----------------------------------------------------------------------------- dart-r


def _split_gpus_like_np(req: PlanRequest, np_plan: Plan) -> list[dict[str, int]]:
    """GPUs per model and type as the NP plan uses them; unused GPUs split evenly."""
    alloc = [
        {
            gpu: sum(p.partitions[0].vgpus for p in m.pipelines if p.partitions[0].gpu == gpu)
            for gpu in (q.gpu for q in req.cluster.pools)
        }
        for m in np_plan.models
    ]
    for pool in req.cluster.pools:
        spare = pool.count - sum(a[pool.gpu] for a in alloc)
        each, extra = divmod(max(spare, 0), len(alloc))
        for i, a in enumerate(alloc):
            a[pool.gpu] += each + (1 if i < extra else 0)
    return alloc


def _plan_dart_r(
    req: PlanRequest, lam: list[float | None], lam_solved: _Solved | None, started: float
) -> Plan:
    if len(req.cluster.pools) != 2:
        raise PoolpipeError(
            f"dart-r pairs one high-class with one low-class GPU, so it needs a cluster of "
            f"exactly two GPU types; {req.cluster.name} has {len(req.cluster.pools)}"
        )
    np_req = replace(req, strategy="np")
    costs_np = _costs(req, lam, whole_gpus_only=True)
    np_solved = _solve_group(np_req, costs_np, 1, "whole-GPU")
    np_pipes = [[_pipeline_plan(c, n) for c, n in picked] for picked in np_solved.chosen]
    np_plan = _assemble(np_req, "np", 1, np_pipes, lam, _solver_info([np_solved], started))
    alloc = _split_gpus_like_np(req, np_plan)

    pipelines: list[list[PipelinePlan]] = []
    for i, costs in enumerate(costs_np):
        profile = costs.profile
        # High class: the type that runs this whole model faster at batch 1.
        speed = sorted(
            (p.gpu for p in req.cluster.pools),
            key=lambda g: profile.whole_latency_us(g) if (g, 1) in profile.tables else math.inf,
        )
        high, low = speed[0], speed[1]
        pairs = min(alloc[i][high], alloc[i][low])
        larger = high if alloc[i][high] > alloc[i][low] else low
        leftover = abs(alloc[i][high] - alloc[i][low])
        two = enumerate_pipelines(costs, 2, merge_same_bucket=False).pipelines
        # A pair holds one GPU of each class: no pipeline may use one class twice.
        pair_options = [c for c in two if len({p.gpu for p in c.partitions}) == len(c.partitions)]
        pipes: dict[tuple, tuple[CandidatePipeline, int]] = {}

        def add(cand: CandidatePipeline, count: int, pipes: dict = pipes) -> None:
            key = (cand.batch, tuple((p.gpu, p.start, p.end) for p in cand.partitions))
            prev = pipes.get(key, (cand, 0))[1]
            pipes[key] = (cand, prev + count)

        if pairs and pair_options:
            add(max(pair_options, key=lambda c: (_one_each(c), -c.latency_us)), pairs)
        singles = [
            c for c in pair_options if len(c.partitions) == 1 and c.partitions[0].gpu == larger
        ]
        if leftover and singles:
            add(max(singles, key=lambda c: (_one_each(c), -c.latency_us)), leftover)
        pipelines.append([_pipeline_plan(c, [n] * len(c.partitions)) for c, n in pipes.values()])
    runs = [s for s in (lam_solved, np_solved) if s is not None]
    info = replace(_solver_info(runs, started), candidates=0)
    meta = {"gpu_split": alloc}
    return _assemble(req, "dart-r", 2, pipelines, lam, info, meta)


def _one_each(c: CandidatePipeline) -> float:
    """Throughput of a pipeline with one vGPU per partition."""
    return min(p.vgpu_throughput for p in c.partitions)
