"""Planning applications (poolpipe.domain.apps): each model's latency budget chosen jointly
with the pooled pipelines, in one MILP.

A model of an application gets one budget from a grid (the application's SLO x k / grid,
k = 1..grid); its candidate pipelines are those that meet that budget (enumerated as for a
model whose SLO it is, margin included). Along every path of the application the budgets
sum to at most its SLO. The pipelines of (application, model, budget) share the cluster's
GPUs with all others (the group MILP's pipelines and packing, formulation.py).

Variables beyond the group MILP's
    r[a] >= 0            application a's req/s
    y[a, m, b] binary    model m of a gets budget b (one per (a, m))
Constraints
    w[a] z <= r[a]                                   max-min over applications
    sum_{b, c in (a,m,b)} x[c] >= mult[a, m] r[a]    each model's rate, fan-outs multiplied
    sum_{c in (a,m,b)} x[c] <= U[a,m,b] y[a,m,b]     only the chosen budget's pipelines serve
    sum_b y[a, m, b] = 1
    sum_{m in path} sum_b b y[a, m, b] <= SLO[a]     for every path of a

A fixed split (`budgets`: each (application, model)'s budget given) is the same MILP with
one budget each: how the equal split, the split in proportion to the models' latencies
(`fixed_split`) and any hand-written split are planned and compared. The batch-fill term of
the single-model planner (estimated arrival rates) is off here: the margin holds back for
queueing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from poolpipe.domain.apps import App
from poolpipe.domain.cluster import Cluster
from poolpipe.domain.costs import ModelCosts
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import InfeasibleError, PoolpipeError, SolverError
from poolpipe.planner.candidates import (
    CandidatePipeline,
    drop_share_dominated,
    enumerate_pipelines,
)
from poolpipe.planner.formulation import _add_packing, _add_pipelines
from poolpipe.planner.solvers import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S, Milp, solve

SPLITS = ("joint", "equal", "proportional")
DEFAULT_GRID = 10


@dataclass(frozen=True)
class AppPlanRequest:
    apps: tuple[App, ...]
    profiles: Mapping[str, ModelProfile]
    cluster: Cluster
    grid: int = DEFAULT_GRID
    margin: float = 0.4
    max_partitions: int = 2
    packing: str = "per-share"
    solver: str = "highs"
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    mip_gap: float = DEFAULT_MIP_GAP

    def __post_init__(self) -> None:
        if not self.apps:
            raise PoolpipeError("no applications to plan")
        if self.grid < 1:
            raise PoolpipeError(f"budget grid: at least 1 step, got {self.grid}")
        missing = sorted({m for a in self.apps for m in a.models} - set(self.profiles))
        if missing:
            raise PoolpipeError(f"no profile for model(s) {', '.join(missing)}: profile them")


@dataclass(frozen=True)
class AppPlan:
    """What a split of the applications' SLOs serves: each application's req/s, and per
    (application, model) its budget (µs), the req/s its pipelines serve and the pipelines
    with their vGPU counts."""

    split: str
    objective: float  # least req/s per unit of weight over the applications
    rates: dict[str, float]
    budgets: dict[tuple[str, str], float]
    served: dict[tuple[str, str], float]
    pipelines: dict[tuple[str, str], list[tuple[CandidatePipeline, list[int]]]]
    status: str
    seconds: float
    gpus_used: dict[str, int] = field(default_factory=dict)


def fixed_split(app: App, how: str, fastest_us: Mapping[str, float]) -> dict[str, float]:
    """A split decided before planning: `equal`, each model the SLO over the most models
    on a path through it; `proportional`, each model the least over the paths through it
    of the SLO in proportion to its fastest latency along that path."""
    paths = app.paths()
    out: dict[str, float] = {}
    for m in app.models:
        through = [p for p in paths if m in p]
        if how == "equal":
            out[m] = app.slo_us / max(len(p) for p in through)
        elif how == "proportional":
            out[m] = min(
                app.slo_us * fastest_us[m] / sum(fastest_us[x] for x in p) for p in through
            )
        else:
            raise PoolpipeError(f"split {how!r}? choose equal or proportional")
    return out


def plan_apps(
    req: AppPlanRequest,
    split: str = "joint",
    budgets: Mapping[tuple[str, str], float] | None = None,
) -> AppPlan:
    """The most req/s per unit of weight for the least served application: budgets chosen
    by the MILP (`joint`), or fixed (`equal`, `proportional`, or `budgets` given)."""
    if split not in SPLITS and budgets is None:
        raise PoolpipeError(f"split {split!r}? choose one of {', '.join(SPLITS)}")
    if budgets is None and split != "joint":
        from poolpipe.domain.apps import fastest_latencies

        fastest = fastest_latencies(req.profiles[m] for a in req.apps for m in a.models)
        budgets = {
            (a.name, m): b for a in req.apps for m, b in fixed_split(a, split, fastest).items()
        }
    options = _options(req, budgets)
    t0 = time.perf_counter()
    milp, z, rates, xs, ys, ns, gpu_terms = _build(req, options)
    result = solve(milp, req.solver, req.time_limit_s, req.mip_gap)
    seconds = time.perf_counter() - t0
    if result.values is None:
        if result.status == "infeasible":
            raise InfeasibleError("the applications cannot be served within their SLOs")
        raise SolverError(f"application MILP: {result.status} within {req.time_limit_s:g} s")
    v = result.values
    chosen_budget: dict[tuple[str, str], float] = {}
    served: dict[tuple[str, str], float] = {}
    picked: dict[tuple[str, str], list[tuple[CandidatePipeline, list[int]]]] = {}
    for o, (key, budget, cands) in enumerate(options):
        on = ys[o] is None or v[ys[o]] > 0.5
        if not on:
            continue
        chosen_budget[key] = budget
        served[key] = sum(v[x] for x in xs[o])
        picked[key] = [
            (c, [round(v[n]) for n in ns[o][i]])
            for i, c in enumerate(cands)
            if any(round(v[n]) > 0 for n in ns[o][i])
        ]
    app_rates = {a.name: float(v[rates[i]]) for i, a in enumerate(req.apps)}
    return AppPlan(
        split if budgets is None or split != "joint" else "fixed",
        float(v[z]),
        app_rates,
        chosen_budget,
        served,
        picked,
        result.status,
        seconds,
        {g: round(sum(c * v[x] for x, c in t.items())) for g, t in gpu_terms.items()},
    )


Option = tuple[tuple[str, str], float, list[CandidatePipeline]]


def _options(req: AppPlanRequest, budgets: Mapping[tuple[str, str], float] | None) -> list[Option]:
    """(application, model), budget and candidate pipelines of every budget allowed."""
    merge = req.packing == "per-share"
    memo: dict[tuple[str, float], list[CandidatePipeline]] = {}

    def candidates(model: str, budget: float) -> list[CandidatePipeline]:
        key = (model, round(budget, 3))
        if key not in memo:
            costs = ModelCosts(req.profiles[model], req.cluster, budget, req.margin, None)
            cands = enumerate_pipelines(costs, req.max_partitions, merge).pipelines
            memo[key] = drop_share_dominated(cands) if req.packing == "per-position" else cands
        return memo[key]

    out: list[Option] = []
    for a in req.apps:
        for m in a.models:
            if budgets is not None:
                if (a.name, m) not in budgets:
                    raise PoolpipeError(f"no budget given for model {m} of application {a.name}")
                grid = [budgets[(a.name, m)]]
            else:
                grid = [a.slo_us * k / req.grid for k in range(1, req.grid + 1)]
            some = [(b, candidates(m, b)) for b in grid]
            some = [(b, c) for b, c in some if c]
            if not some:
                raise InfeasibleError(
                    f"application {a.name}: model {m} meets none of its budgets "
                    f"(up to {max(grid) / 1e3:g} ms, margin {req.margin}) on cluster "
                    f"{req.cluster.name}: raise the SLO or lower the margin"
                )
            out += [((a.name, m), b, c) for b, c in some]
    return out


def _build(req: AppPlanRequest, options: list[Option]):
    milp = Milp()
    count = {p.gpu: p.count for p in req.cluster.pools}
    z = milp.add_var(cost=1.0)
    rates = [milp.add_var() for _ in req.apps]
    for i, a in enumerate(req.apps):
        milp.add_row({z: a.weight, rates[i]: -1.0}, upper=0.0)
    xs, ns, buckets = _add_pipelines(milp, [c for _, _, c in options], count, req.packing)
    gpu_terms = _add_packing(milp, buckets, count, req.packing)
    for gpu, terms in gpu_terms.items():  # (c) physical GPUs of each type
        milp.add_row(terms, upper=float(count[gpu]))
    per_key: dict[tuple[str, str], list[int]] = {}
    for o, (key, _, _) in enumerate(options):
        per_key.setdefault(key, []).append(o)
    ys: list[int | None] = [None] * len(options)
    for os_ in per_key.values():
        if len(os_) == 1:
            continue
        chosen: dict[int, float] = {}
        for o in os_:
            y = milp.add_var(upper=1.0, integer=True)
            cap = sum(milp.upper[x] for x in xs[o])
            milp.add_row({**{x: 1.0 for x in xs[o]}, y: -cap}, upper=0.0)
            ys[o], chosen[y] = y, 1.0
        milp.add_row(chosen, lower=1.0, upper=1.0)
    for i, a in enumerate(req.apps):
        mult = a.multiplicity()
        for m in a.models:
            terms = {x: 1.0 for o in per_key[(a.name, m)] for x in xs[o]}
            milp.add_row({**terms, rates[i]: -mult[m]}, lower=0.0)
        for path in a.paths():
            fixed, terms = 0.0, {}
            for m in path:
                os_ = per_key[(a.name, m)]
                if len(os_) == 1:
                    fixed += options[os_[0]][1]
                else:
                    terms.update({yv: options[o][1] for o in os_ if (yv := ys[o]) is not None})
            if fixed > a.slo_us * (1 + 1e-9):
                raise InfeasibleError(
                    f"application {a.name}: the budgets given along {' -> '.join(path)} sum to "
                    f"{fixed / 1e3:g} ms, more than its SLO of {a.slo_us / 1e3:g} ms"
                )
            least = fixed + sum(
                min(options[o][1] for o in per_key[(a.name, m)])
                for m in path
                if len(per_key[(a.name, m)]) > 1
            )
            if least > a.slo_us * (1 + 1e-9):
                raise InfeasibleError(
                    f"application {a.name}: along {' -> '.join(path)} the least budgets its "
                    f"models meet (of the grid, margin {req.margin}) sum to {least / 1e3:g} ms, "
                    f"more than its SLO of {a.slo_us / 1e3:g} ms: raise the SLO, a finer grid "
                    "or a lower margin"
                )
            if terms:
                milp.add_row(terms, upper=a.slo_us - fixed + 1e-6)
    return milp, z, rates, xs, ys, ns, gpu_terms
