"""Planning applications (poolpipe.domain.apps): each model's latency budget chosen jointly
with the pooled pipelines, in one MILP (or, where the applications' maximal splits of the
grid are few, split by split: `_search_splits`).

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
(`fixed_split`), Nexus's split-then-plan (`nexus_split`) and any hand-written split are
planned and compared. The batch-fill term of the single-model planner (estimated arrival
rates) is off here: the margin holds back for queueing.

The cost objective (`cheapest_apps`) is the same MILP with each application's rate given:
the models' rates are then fixed, and the price of the physical GPUs used is minimised
(formulation.build_cost_milp's terms); `whole=True` plans it with whole-model pipelines
only, the cheapest plan without pooled pipelines."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from poolpipe.domain.apps import App, app_table, part_name
from poolpipe.domain.cluster import Cluster
from poolpipe.domain.costs import ModelCosts
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import InfeasibleError, PoolpipeError, SolverError
from poolpipe.planner.candidates import (
    CandidatePipeline,
    drop_share_dominated,
    enumerate_pipelines,
)
from poolpipe.planner.exact import solve_group
from poolpipe.planner.formulation import (
    _add_packing,
    _add_pipelines,
    build_group_milp,
    gpus_used,
    price_units,
)
from poolpipe.planner.formulation import served as capacity
from poolpipe.planner.request import PlanRequest, check_prices, check_rates
from poolpipe.planner.solvers import (
    DEFAULT_MIP_GAP,
    DEFAULT_TIME_LIMIT_S,
    Milp,
    MilpResult,
    relative_gap,
    solve,
)

SPLITS = ("joint", "equal", "proportional", "nexus")
# The joint split searches the applications' splits one by one (_search_splits) when they
# make at most this many combinations; with more, one MILP chooses every budget at once.
SEARCH_SPLITS_UP_TO = 400
_SPLITS_ENUMERATED_UP_TO = 100_000  # grid points of one application's budgets looked at
_LEAST_SPLIT_S = 1.0  # the first split planned gets this long at least, whatever is left


class _Unservable(InfeasibleError):
    """The application MILP itself is infeasible (the rates asked cannot be served)."""


class Dearer(PoolpipeError):
    """cheapest_apps proved no plan costs at most the `at_most` it was given."""


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
    # each part's request inputs counted on its first server's NIC, as for models
    # (PlanRequest.count_inputs): the live router sends them there
    count_inputs: bool = False
    # models whose pools every application naming them shares: one budget (each
    # application's path must fit it), one set of pipelines serving all their requests,
    # batched together (Graft's shared suffixes: planner/graft.py). Joint split only.
    shared: frozenset[str] = frozenset()
    # req/s each model's pools are sized for, planned with room for queueing at it
    # (headroom.py, as PlanRequest.headroom_rates); a model not named: fluid
    headroom: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not self.apps:
            raise PoolpipeError("no applications to plan")
        if self.grid < 1:
            raise PoolpipeError(f"budget grid: at least 1 step, got {self.grid}")
        missing = sorted({m for a in self.apps for m in a.models} - set(self.profiles))
        if missing:
            raise PoolpipeError(f"no profile for model(s) {', '.join(missing)}: profile them")

    def key(self, app: str, model: str) -> tuple[str, str]:
        """The part a model of an application is planned as: ("", model) where it is
        shared, else (app, model)."""
        return ("", model) if model in self.shared else (app, model)

    def owner(self, key: tuple[str, str]) -> object:
        """Whose GPUs a part's vGPUs take (per-share packing): a segment's, the model it is
        cut from (its partitions are that model's blocks, as a pipeline's are); any other
        part's, its own."""
        base = self.profiles[key[1]].meta.get("segment_of")
        return ("", base) if base else key

    def served_name(self, app: str, model: str) -> str:
        """The served plan's model for a model of an application."""
        return model if model in self.shared else part_name(app, model)


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
    cost_per_hour: float | None = None  # the cost objective's: price of the GPUs used
    gap: float = 0.0  # the solver's relative gap at its end (0 when proven optimal)


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
    start: AppPlan | None = None,
) -> AppPlan:
    """The most req/s per unit of weight for the least served application: budgets chosen
    by the MILP (`joint`), or fixed (`equal`, `proportional`, `nexus`, or `budgets`
    given). `start`: a plan of the same applications (a split's, budgets on the grid)
    the solver starts from: the result serves at least as much, found sooner."""
    budgets = _split_budgets(req, split, budgets)
    return _plan(req, split, budgets, None, start)


def cheapest_apps(
    req: AppPlanRequest,
    rates: Mapping[str, float],
    prices: Mapping[str, float],
    split: str = "joint",
    budgets: Mapping[tuple[str, str], float] | None = None,
    whole: bool = False,
    start: AppPlan | None = None,
    at_most: float | None = None,
) -> AppPlan:
    """The cheapest GPUs of the cluster (prices per GPU-hour) serving each application at
    `rates[name]` req/s within its SLO, budgets chosen with the pipelines (`joint`) or
    fixed; `whole`: whole-model pipelines only. Rates the cluster cannot serve together
    are refused, naming the share of them it can. `start`: a plan of the same rates (a
    fixed split's, say) the MILP starts from where its budgets are on the grid; the result
    costs no more than it either way (the start itself where the MILP ends dearer: on
    hc2-large's traffic + scene the joint MILP stopped at 13.23 $/h after 30 s, where the
    proportional split is proven at 12.88 in 7 s). `at_most`: only a plan costing at most
    this is wanted (a search comparing plans): Dearer where the solver proves none does,
    sooner than it would prove the cheapest."""
    names = [a.name for a in req.apps]
    extra = sorted(set(rates) - set(names))
    missing = [n for n in names if n not in rates]
    if extra or missing:
        raise PoolpipeError(
            "rates: give one per application ("
            + ", ".join(names)
            + ")"
            + (f"; unknown: {', '.join(extra)}" if extra else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
        )
    check_rates(rates)
    check_prices(req.cluster, prices)
    gpus = [p.gpu for p in req.cluster.pools]
    if whole:
        req = replace(req, max_partitions=1)
    budgets = _split_budgets(req, split, budgets)
    if start is not None and start.cost_per_hour is None:
        raise PoolpipeError("start: a plan of the cost objective (cheapest_apps), not max-min")
    try:
        return _plan(req, split, budgets, (rates, {g: prices[g] for g in gpus}), start, at_most)
    except _Unservable:
        weighted = replace(req, apps=tuple(replace(a, weight=rates[a.name]) for a in req.apps))
        share = plan_apps(weighted, split, budgets).objective
        raise InfeasibleError(
            f"cluster {req.cluster.name} cannot serve these rates within the SLOs"
            + (" with whole-model pipelines" if whole else "")
            + f": at most {share:.1%} of each together"
        ) from None


def cheapest_by_split(
    req: AppPlanRequest,
    rates: Mapping[str, float],
    prices: Mapping[str, float],
    on_split: Callable[[str], None] = lambda split: None,
) -> dict[str, AppPlan | None]:
    """cheapest_apps for every split, by name in SPLITS order: each fixed split's (None
    where that split cannot serve the rates), then the joint split's, started from the
    cheapest of them (so never dearer than a fixed split; the joint MILP alone stopped
    at 13.23 $/h on hc2-large's traffic + scene where the proportional split is 12.88).
    The joint split serves whatever a fixed one does: where it cannot, InfeasibleError
    says how much of the rates the cluster can serve. `on_split`: told each split before
    it is planned (a progress line)."""
    plans: dict[str, AppPlan | None] = {}
    for split in SPLITS[1:]:
        on_split(split)
        try:
            plans[split] = cheapest_apps(req, rates, prices, split)
        except InfeasibleError:
            plans[split] = None
    fixed = [p for p in plans.values() if p is not None and p.cost_per_hour is not None]
    start = min(fixed, key=lambda p: p.cost_per_hour or 0.0) if fixed else None
    on_split(SPLITS[0])
    joint = cheapest_apps(req, rates, prices, SPLITS[0], start=start)
    return {SPLITS[0]: joint, **plans}


@dataclass(frozen=True)
class AppSizing:
    """How the joint split's cost plan was sized on what it delivers: each application's
    share on time at the user's rates, simulated, per split (the joint split's as sized),
    the rates asked of the joint MILP per round, and whether every application keeps 99%."""

    on_time: dict[str, dict[str, float]]
    rounds: list[dict]
    served: bool


def cheapest_by_split_sized(
    req: AppPlanRequest,
    rates: Mapping[str, float],
    prices: Mapping[str, float],
    on_split: Callable[[str], None] = lambda split: None,
) -> tuple[dict[str, AppPlan | None], AppSizing]:
    """cheapest_by_split, each plan simulated at `rates` (its applications' shares on time
    by their SLOs), and the joint split's sized on it: where an application keeps less than
    99% on time, the rate asked of the MILPs for it grows (by three times its shortfall, at
    least twice SIZING_RAISE) and all splits are planned again, until every application
    keeps 99% or SIZING_ROUNDS plans were simulated, or the cluster serves no more. The
    joint split's plan returned is the first that keeps 99% (else the one planned at the
    user's rates). Equal-cost plans differ in what they deliver, so the share on time need
    not grow with every round."""
    from poolpipe.planner.deliverable import ATTAINMENT_TARGET, app_attainment_at

    def on_time(p: AppPlan) -> dict[str, float]:
        doc, profiles = app_plan_document(req, p)
        return app_attainment_at(doc, profiles, req.apps, rates)

    plans = cheapest_by_split(req, rates, prices, on_split)
    kept = {split: on_time(p) for split, p in plans.items() if p is not None}
    joint = plans[SPLITS[0]]
    assert joint is not None

    def joint_at(asked: Mapping[str, float]) -> AppPlan:
        sized = cheapest_by_split(req, asked, prices, on_split)[SPLITS[0]]
        assert sized is not None
        return sized

    plans[SPLITS[0]], kept[SPLITS[0]], _, rounds = size_by_share(
        joint, kept[SPLITS[0]], rates, on_time, joint_at
    )
    served = min(kept[SPLITS[0]].values()) >= ATTAINMENT_TARGET
    return plans, AppSizing(kept, rounds, served)


def size_by_share(
    plan: AppPlan,
    got: Mapping[str, float],
    rates: Mapping[str, float],
    on_time: Callable[[AppPlan], dict[str, float]],
    plan_at: Callable[[Mapping[str, float]], AppPlan],
) -> tuple[AppPlan, dict[str, float], dict[str, float], list[dict]]:
    """A cost plan (`plan`, planned at `rates`, `got` its applications' shares on time)
    sized on what it delivers: where an application keeps less than 99% on time, the rate
    asked of the MILP for it grows (by three times its shortfall, at least twice
    SIZING_RAISE) and `plan_at` plans again, until every application keeps 99% or
    SIZING_ROUNDS plans were simulated, or the cluster serves no more (InfeasibleError).
    (the plan kept: the first that keeps 99%, else `plan`; its shares; the rates it was
    asked; each round's asked rates, cost and shares)."""
    from poolpipe.planner.cost import SIZING_RAISE, SIZING_ROUNDS
    from poolpipe.planner.deliverable import ATTAINMENT_TARGET

    asked = dict(rates)
    kept = (plan, dict(got), dict(asked))
    rounds = [{"asked": dict(asked), "cost_per_hour": plan.cost_per_hour, "on_time": dict(got)}]
    while min(got.values()) < ATTAINMENT_TARGET and len(rounds) < SIZING_ROUNDS:
        for a, share in got.items():
            if share < ATTAINMENT_TARGET:
                asked[a] *= 1 + max(2 * SIZING_RAISE, 3 * (ATTAINMENT_TARGET - share))
        try:
            sized = plan_at(asked)
        except InfeasibleError:
            break  # what each application needs for 99% on time is more than the cluster has
        got = on_time(sized)
        rounds.append({"asked": dict(asked), "cost_per_hour": sized.cost_per_hour, "on_time": got})
        if min(got.values()) >= ATTAINMENT_TARGET:
            kept = (sized, got, dict(asked))
    return (*kept, rounds)


def _split_budgets(
    req: AppPlanRequest, split: str, budgets: Mapping[tuple[str, str], float] | None
) -> Mapping[tuple[str, str], float] | None:
    """The budgets a split fixes before planning (None: the joint split's are chosen by
    the MILP)."""
    if budgets is not None:
        return budgets
    if req.shared and split != "joint":
        raise PoolpipeError(
            f"split {split!r}: applications that share models are planned with the joint split"
        )
    if split not in SPLITS:
        raise PoolpipeError(f"split {split!r}? choose one of {', '.join(SPLITS)}")
    if split == "joint":
        return None
    if split == "nexus":
        return nexus_split(req)
    from poolpipe.domain.apps import fastest_latencies

    fastest = fastest_latencies(req.profiles[m] for a in req.apps for m in a.models)
    return {(a.name, m): b for a in req.apps for m, b in fixed_split(a, split, fastest).items()}


def _plan(
    req: AppPlanRequest,
    split: str,
    budgets: Mapping[tuple[str, str], float] | None,
    cost: tuple[Mapping[str, float], Mapping[str, float]] | None,
    start: AppPlan | None = None,
    at_most: float | None = None,
) -> AppPlan:
    options = _options(req, budgets)
    t0 = time.perf_counter()
    if budgets is None and cost is None:
        searched = _search_splits(req, options, start, t0)
        if searched is not None:
            return searched
    milp, z, rates, xs, ys, ns, gpu_terms = _build(req, options, cost)
    first = None
    if start is not None:
        first = _start_values(req, options, start, z, rates, xs, ys, ns, cost is not None)
    cutoff = None
    if cost is not None and at_most is not None:  # the objective: -cost in price units
        cutoff = -at_most * price_units(dict(cost[1]))[1] - 0.5
    result = solve(milp, req.solver, req.time_limit_s, req.mip_gap, start=first, cutoff=cutoff)
    if result.status == "cutoff":
        raise Dearer(f"no plan costs at most {at_most:g} per hour")
    seconds = time.perf_counter() - t0
    if cost is not None and start is not None and budgets is None:  # the joint split's
        kept = _cheaper_start(start, result, cost[1], seconds, req.mip_gap)
        if kept is not None:
            return kept
    if result.values is None:
        if result.status == "infeasible":
            raise _Unservable("the applications cannot be served within their SLOs")
        raise SolverError(f"application MILP: {result.status} within {req.time_limit_s:g} s")
    v = result.values
    chosen_budget: dict[tuple[str, str], float] = {}
    served: dict[tuple[str, str], float] = {}
    picked: dict[tuple[str, str], list[tuple[CandidatePipeline, list[int]]]] = {}
    for o, opt in enumerate(options):
        k = 0 if ys[o] is None else max(range(len(opt.budgets)), key=lambda i: v[ys[o][i]])
        chosen_budget[opt.key] = opt.budgets[k]
        served[opt.key] = sum(v[x] for x in xs[o])
        picked[opt.key] = [
            (c, [round(v[n]) for n in ns[o][i]])
            for i, c in enumerate(opt.candidates)
            if all(round(v[n]) > 0 for n in ns[o][i])
        ]
    app_rates = {a.name: float(v[rates[i]]) for i, a in enumerate(req.apps)}
    used = {g: round(sum(c * v[x] for x, c in t.items())) for g, t in gpu_terms.items()}
    if cost is None:
        objective, price = float(v[z]), None
    else:
        price = sum(cost[1][g] * n for g, n in used.items())
        objective = min(app_rates[a.name] / a.weight for a in req.apps)
    return AppPlan(
        split if budgets is None or split != "joint" else "fixed",
        objective,
        app_rates,
        chosen_budget,
        served,
        picked,
        result.status,
        seconds,
        used,
        price,
        0.0 if result.status == "optimal" else result.gap,
    )


def _cheaper_start(
    start: AppPlan,
    result: MilpResult,
    prices: Mapping[str, float],
    seconds: float,
    mip_gap: float,
) -> AppPlan | None:
    """The cost objective's start when the MILP found nothing cheaper (its budgets off
    the grid, or the MILP out of time before a plan): the start, its gap against the
    MILP's bound (none below it on the grid: 0). None where the MILP's plan is cheaper."""
    assert start.cost_per_hour is not None
    scale = price_units(dict(prices))[1]  # the MILP maximises -price x scale
    if result.values is not None and -result.objective / scale <= start.cost_per_hour * (1 + 1e-9):
        return None
    least = -result.bound / scale if math.isfinite(result.bound) else 0.0
    gap = 0.0 if least >= start.cost_per_hour else relative_gap(start.cost_per_hour, least)
    return replace(
        start,
        split="joint",
        status="optimal" if gap <= mip_gap else "time_limit",
        seconds=start.seconds + seconds,
        gap=0.0 if gap <= mip_gap else gap,
    )


def _start_values(
    req: AppPlanRequest,
    options: list[Option],
    start: AppPlan,
    z: int,
    rates: list[int],
    xs: list[list[int]],
    ys: list[list[int] | None],
    ns: list[list[list[int]]],
    cost: bool = False,
) -> dict[int, float] | None:
    """`start`'s plan as values of this MILP's variables (its GPU-bucket counts left to
    the solver); None where it does not fit (a budget off this MILP's grid). `cost`: the
    cost MILP's, whose z is fixed at 0."""
    vals: dict[int, float] = {z: 0.0 if cost else start.objective}
    for i, a in enumerate(req.apps):
        vals[rates[i]] = start.rates.get(a.name, 0.0)
    for o, opt in enumerate(options):
        chosen_y = ys[o]
        if chosen_y is not None:
            b = start.budgets.get(opt.key)
            k = next(
                (
                    j
                    for j, x in enumerate(opt.budgets)
                    if b is not None and abs(x - b) <= 1e-6 * max(1.0, b)
                ),
                None,
            )
            if k is None:
                return None
            vals.update({y: float(j == k) for j, y in enumerate(chosen_y)})
        picked = dict((c, counts) for c, counts in start.pipelines.get(opt.key, []))
        for i, c in enumerate(opt.candidates):
            counts = picked.get(c)
            vals[xs[o][i]] = 0.0 if counts is None else capacity(c, counts)
            for d, n in enumerate(ns[o][i]):
                vals[n] = 0.0 if counts is None else float(counts[d])
    return vals


def _search_splits(
    req: AppPlanRequest, options: list[Option], start: AppPlan | None, t0: float
) -> AppPlan | None:
    """The joint split, found split by split: every combination of the applications'
    maximal splits of the grid (_maximal_splits) gets its LP bound (the MILP of that fixed
    split, relaxed); from the highest bound down, each split is planned by the group
    planner (exact.solve_group: its parts as models, weighted by their requests per
    request, their budgets as SLOs, with its pruning, knapsack and decomposition proofs)
    until no split left is bounded above the best plan. None where the combinations are
    too many (the joint MILP then). On hc2-large's traffic+scene mix the joint MILP ended
    its 30 s with a 2.5% gap; 2 of its 90 combinations are bounded above the best split's
    plan (docs/benchmarks.md)."""
    if req.shared:  # a shared part's budget is every application's: one MILP chooses them
        return None
    by_key = {o.key: o for o in options}
    per_app: list[list[dict[tuple[str, str], float]]] = []
    total = 1
    for a in req.apps:
        splits = _maximal_splits(a, by_key)
        if not splits:  # too many to look at; or none fits (the MILP's checks name why)
            return None
        total *= len(splits)
        if total > SEARCH_SPLITS_UP_TO:
            return None
        per_app.append(splits)
    bounded: list[tuple[float, dict[tuple[str, str], float]]] = []
    for choice in itertools.product(*per_app):
        budgets = {k: b for split in choice for k, b in split.items()}
        milp, z, *_ = _build(req, [_at_budget(o, budgets[o.key]) for o in options])
        milp.integer = [False] * milp.num_vars
        relaxed = solve(milp, req.solver, req.time_limit_s, req.mip_gap)
        if relaxed.values is not None:
            bounded.append((float(relaxed.values[z]), budgets))
        elif relaxed.status != "infeasible":  # out of time: no bound known
            bounded.append((math.inf, budgets))
    bounded.sort(key=lambda x: -x[0])
    best = start if start is not None and start.objective > 0 else None
    # the start's pipelines warm-start every split whose candidates include them
    warm = None if best is None else app_plan_document(req, best)[0]
    open_bound = 0.0  # the most a split planned but not proven may serve
    status = "optimal"
    for bound, budgets in bounded:
        if best is not None and bound <= best.objective * (1 + req.mip_gap):
            break  # this split and every one after it serve no more than the best
        left = req.time_limit_s - (time.perf_counter() - t0)
        if left <= 0 and best is not None:
            open_bound, status = max(open_bound, bound), "time_limit"
            break
        floor = None if best is None else best.objective * (1 + req.mip_gap)
        plan, plan_bound = _plan_split(req, budgets, max(left, _LEAST_SPLIT_S), floor, warm)
        if best is None or plan.objective > best.objective:
            best = plan
        if plan.status not in ("optimal", "cutoff"):  # cutoff: it serves no more than best
            open_bound = max(open_bound, plan_bound)
    if best is None:
        raise _Unservable("the applications cannot be served within their SLOs")
    if best is not start:
        best = replace(best, budgets=_least_budgets(best, by_key))
    gap = 0.0
    if open_bound > best.objective * (1 + req.mip_gap):
        status, gap = "time_limit", relative_gap(best.objective, open_bound)
    return replace(best, split="joint", status=status, seconds=time.perf_counter() - t0, gap=gap)


def _maximal_splits(
    app: App, by_key: Mapping[tuple[str, str], Option]
) -> list[dict[tuple[str, str], float]] | None:
    """The application's splits of its grid that fit its SLO along every path and leave
    no model a larger budget of its grid that would still fit: a model given more time
    keeps its pipelines or ones that dominate them, so the others serve no more. None when
    its grid has too many points to look at."""
    lists = [by_key[(app.name, m)].budgets for m in app.models]  # each in ascending order
    if math.prod(len(x) for x in lists) > _SPLITS_ENUMERATED_UP_TO:
        return None
    where = {m: i for i, m in enumerate(app.models)}
    paths = [[where[m] for m in p] for p in app.paths()]
    slo = app.slo_us * (1 + 1e-9)

    def fits(ks: tuple[int, ...]) -> bool:
        return all(sum(lists[i][ks[i]] for i in p) <= slo for p in paths)

    out = []
    for ks in itertools.product(*(range(len(x)) for x in lists)):
        if not fits(ks):
            continue
        if any(
            k + 1 < len(lists[i]) and fits((*ks[:i], k + 1, *ks[i + 1 :])) for i, k in enumerate(ks)
        ):
            continue  # a model could have more
        out.append({(app.name, m): lists[i][ks[i]] for i, m in enumerate(app.models)})
    return out


def _least_budgets(
    plan: AppPlan, by_key: Mapping[tuple[str, str], Option]
) -> dict[tuple[str, str], float]:
    """Each model's least budget of its grid at which every pipeline it was given is still
    enumerated: the split's slack is then spread over the models when the budgets are
    filled up to the SLO (filled_budgets), as a MILP's split leaves it, instead of all of
    it going to the models the maximal split gave the most."""
    out = dict(plan.budgets)
    for key, picked in plan.pipelines.items():
        o = by_key[key]
        at = {o.candidates[i]: o.at[i] for i in range(len(o.candidates))}
        common = set(range(len(o.budgets)))
        for c, _ in picked:
            common &= set(at.get(c, ()))
        if common:
            out[key] = min(out[key], o.budgets[min(common)])
    return out


def _at_budget(o: Option, budget: float) -> Option:
    """The option with one budget: its candidates enumerated at it."""
    k = o.budgets.index(budget)
    cands = [c for c, at in zip(o.candidates, o.at, strict=True) if k in at]
    return Option(o.key, [budget], cands, [[0] for _ in cands])


def _plan_split(
    req: AppPlanRequest,
    budgets: Mapping[tuple[str, str], float],
    time_limit_s: float,
    floor: float | None = None,
    warm: Plan | None = None,
) -> tuple[AppPlan, float]:
    """A fixed split planned by the group planner, and the bound its solve proved; with a
    `floor` (what the best split so far serves, within the gap) the solve stops once it
    proves this split serves no more (status "cutoff"); `warm`: a plan of the parts
    (app_plan_document's) to start from where its pipelines are this split's candidates."""
    parts = [(a, m) for a in req.apps for m in a.models]
    models = tuple(replace(req.profiles[m], name=part_name(a.name, m)) for a, m in parts)
    slos = tuple(budgets[(a.name, m)] for a, m in parts)
    group = PlanRequest(
        models,
        tuple(a.multiplicity()[m] * a.weight for a, m in parts),
        slos,
        req.cluster,
        packing=req.packing,
        margin=req.margin,
        max_partitions=req.max_partitions,
        solver=req.solver,
        time_limit_s=time_limit_s,
        mip_gap=req.mip_gap,
        warm_start=warm,
        count_inputs=req.count_inputs,
    )
    costs = [_costs(req, p, s) for p, s in zip(models, slos, strict=True)]
    solved = solve_group(
        group, costs, req.max_partitions, f"{req.max_partitions}-partition", floor=floor
    )
    served: dict[tuple[str, str], float] = {}
    picked: dict[tuple[str, str], list[tuple[CandidatePipeline, list[int]]]] = {}
    for (a, m), chosen in zip(parts, solved.chosen, strict=True):
        served[(a.name, m)] = sum(capacity(c, n) for c, n in chosen)
        picked[(a.name, m)] = [(c, list(n)) for c, n in chosen if all(x > 0 for x in n)]
    rates = {
        a.name: min(served[(a.name, m)] / a.multiplicity()[m] for m in a.models) for a in req.apps
    }
    result = solved.result
    used = gpus_used(solved.chosen, req.packing, req.cluster.mixes_models)
    plan = AppPlan(
        "joint",
        min(rates[a.name] / a.weight for a in req.apps),
        rates,
        dict(budgets),
        served,
        picked,
        result.status,
        result.seconds,
        {g: used.get(g, 0) for g in dict.fromkeys(p.gpu for p in req.cluster.pools)},
        None,
        result.gap if result.status != "optimal" else 0.0,
    )
    return plan, result.bound


def nexus_split(req: AppPlanRequest) -> dict[tuple[str, str], float]:
    """Nexus's split-then-plan: each application's SLO split before planning, by each
    model's cost alone. A model at a budget of the grid costs the share of the whole
    cluster it would need per request of the application: its requests per request over
    what it serves alone on the cluster at that budget (the same candidate pipelines and
    packing). The split of least summed cost with every path within the SLO is chosen
    exactly (Nexus does it by dynamic programming over a tree; a small MILP over the grid
    here, which fan-in needs). What the models' sharing of GPU types costs one another is
    not seen: that is the joint MILP's."""
    cands = _candidate_fn(req)
    alone: dict[tuple[str, float], float] = {}
    out: dict[tuple[str, str], float] = {}
    for a in req.apps:
        grid = _grid(a, req.grid)
        mult = a.multiplicity()
        milp = Milp()
        ys: dict[str, dict[float, int]] = {}
        for m in a.models:
            for b in grid:
                if (m, b) not in alone:
                    alone[(m, b)] = _alone(req, cands(m, b))
            opts = [b for b in grid if alone[(m, b)] > 0]
            if not opts:
                raise _meets_none(req, a, m, grid)
            ys[m] = {
                b: milp.add_var(upper=1.0, integer=True, cost=-mult[m] / alone[(m, b)])
                for b in opts
            }
            milp.add_row({y: 1.0 for y in ys[m].values()}, lower=1.0, upper=1.0)
        for path in a.paths():
            milp.add_row({y: b for m in path for b, y in ys[m].items()}, upper=a.slo_us + 1e-6)
        result = solve(milp, req.solver, req.time_limit_s, 1e-9)
        if result.values is None:
            raise InfeasibleError(
                f"application {a.name}: no split of the grid fits every path within its SLO "
                f"of {a.slo_us / 1e3:g} ms with each model served alone: raise the SLO, a "
                "finer grid or a lower margin"
            )
        for m in a.models:
            out[(a.name, m)] = next(b for b, y in ys[m].items() if result.values[y] > 0.5)
    return out


def _alone(req: AppPlanRequest, cands: list[CandidatePipeline]) -> float:
    """What a model serves alone on the whole cluster with these candidates (req/s)."""
    if not cands:
        return 0.0
    group = build_group_milp([cands], [1.0], req.cluster, req.packing)
    result = solve(group.milp, req.solver, req.time_limit_s, req.mip_gap)
    return float(result.values[group.z]) if result.values is not None else 0.0


@dataclass
class Option:
    """An application's model: the budgets it may get (µs) and its distinct candidate
    pipelines over all of them, each with the indices of the budgets it is enumerated at
    (at each budget the candidates are the non-dominated ones that meet it)."""

    key: tuple[str, str]
    budgets: list[float]
    candidates: list[CandidatePipeline]
    at: list[list[int]]


def _costs(req: AppPlanRequest, profile: ModelProfile, budget: float) -> ModelCosts:
    """A model's costs at a budget, as for a model whose SLO it is (no batch-fill term: the
    margin holds back for queueing)."""
    room = (req.headroom or {}).get(profile.name)
    return ModelCosts(
        profile, req.cluster, budget, req.margin, None, inputs=req.count_inputs, headroom_rate=room
    )


def _candidate_fn(req: AppPlanRequest) -> Callable[[str, float], list[CandidatePipeline]]:
    """A model's candidate pipelines at a budget (µs), as for a model whose SLO it is;
    memoised."""
    merge = req.packing == "per-share"
    memo: dict[tuple[str, float], list[CandidatePipeline]] = {}

    def candidates(model: str, budget: float) -> list[CandidatePipeline]:
        key = (model, round(budget, 3))
        if key not in memo:
            costs = _costs(req, req.profiles[model], budget)
            cands = enumerate_pipelines(costs, req.max_partitions, merge).pipelines
            memo[key] = drop_share_dominated(cands) if req.packing == "per-position" else cands
        return memo[key]

    return candidates


def _grid(app: App, steps: int) -> list[float]:
    return [app.slo_us * k / steps for k in range(1, steps + 1)]


def _meets_none(req: AppPlanRequest, app: App, model: str, grid: list[float]) -> InfeasibleError:
    return InfeasibleError(
        f"application {app.name}: model {model} meets none of its budgets "
        f"(up to {max(grid) / 1e3:g} ms, margin {req.margin}) on cluster "
        f"{req.cluster.name}: raise the SLO or lower the margin"
    )


def _options(req: AppPlanRequest, budgets: Mapping[tuple[str, str], float] | None) -> list[Option]:
    """Every (application, model)'s budgets allowed and candidate pipelines."""
    candidates = _candidate_fn(req)
    out: list[Option] = []
    done: set[tuple[str, str]] = set()
    for a in req.apps:
        for m in a.models:
            key = req.key(a.name, m)
            if key in done:
                continue
            done.add(key)
            if budgets is not None:
                if key not in budgets:
                    raise PoolpipeError(f"no budget given for model {m} of application {a.name}")
                grid = [budgets[key]]
            elif m in req.shared:
                naming = [x for x in req.apps if m in x.models]
                if all(len(x.models) == 1 for x in naming):  # alone in each: the least SLO
                    grid = [min(x.slo_us for x in naming)]
                else:  # the grid of the longest SLO of the applications naming it
                    grid = _grid(max(naming, key=lambda x: x.slo_us), req.grid)
            else:
                grid = _grid(a, req.grid)
            some = [(b, candidates(m, b)) for b in grid]
            some = [(b, c) for b, c in some if c]
            if not some:
                raise _meets_none(req, a, m, grid)
            index: dict[CandidatePipeline, int] = {}
            cands: list[CandidatePipeline] = []
            at: list[list[int]] = []
            for k, (_, cs) in enumerate(some):
                for c in cs:
                    if c not in index:
                        index[c] = len(cands)
                        cands.append(c)
                        at.append([])
                    at[index[c]].append(k)
            out.append(Option(key, [b for b, _ in some], cands, at))
    return out


def _build(
    req: AppPlanRequest,
    options: list[Option],
    cost: tuple[Mapping[str, float], Mapping[str, float]] | None = None,
):
    """The MILP: max-min over the applications, or (`cost`: rates and prices) each
    application's rate fixed and the price of the GPUs used minimised."""
    milp = Milp()
    count = {p.gpu: p.count for p in req.cluster.pools}
    if cost is None:
        z = milp.add_var(cost=1.0)
        rates = [milp.add_var() for _ in req.apps]
        for i, a in enumerate(req.apps):
            milp.add_row({z: a.weight, rates[i]: -1.0}, upper=0.0)
    else:
        z = milp.add_var(upper=0.0)
        rates = [milp.add_var(lower=cost[0][a.name], upper=cost[0][a.name]) for a in req.apps]
    owners = [req.owner(o.key) for o in options]
    xs, ns, buckets = _add_pipelines(
        milp, [o.candidates for o in options], count, req.packing, req.cluster.mixes_models, owners
    )
    gpu_terms = _add_packing(milp, buckets, count, req.packing)
    units = price_units(dict(cost[1]))[0] if cost is not None else {}
    for gpu, terms in gpu_terms.items():  # (c) physical GPUs of each type
        milp.add_row(terms, upper=float(count[gpu]))
        for var, coef in terms.items() if cost is not None else ():
            milp.cost[var] = -units[gpu] * coef
    ys: list[list[int] | None] = [None] * len(options)
    for o, opt in enumerate(options):
        if len(opt.budgets) == 1:
            continue
        y: list[int] = [milp.add_var(upper=1.0, integer=True) for _ in opt.budgets]
        milp.add_row({v: 1.0 for v in y}, lower=1.0, upper=1.0)
        for x, at in zip(xs[o], opt.at, strict=True):
            if len(at) < len(opt.budgets):  # only at the budgets it is enumerated at
                milp.add_row({x: 1.0, **{y[k]: -milp.upper[x] for k in at}}, upper=0.0)
        ys[o] = y
    per_key = {opt.key: o for o, opt in enumerate(options)}
    # each part's pipelines serve its applications' rates times their requests per request
    shared: dict[int, dict[int, float]] = {}
    for i, a in enumerate(req.apps):
        mult = a.multiplicity()
        for m in a.models:
            o = per_key[req.key(a.name, m)]
            if m in req.shared:
                shared.setdefault(o, {})[rates[i]] = -mult[m]
            else:
                milp.add_row({**{x: 1.0 for x in xs[o]}, rates[i]: -mult[m]}, lower=0.0)
        for path in a.paths():
            fixed, least, terms = 0.0, 0.0, {}
            for m in path:
                o = per_key[req.key(a.name, m)]
                chosen = ys[o]
                if chosen is None:
                    fixed += options[o].budgets[0]
                else:
                    least += min(options[o].budgets)
                    terms.update({chosen[k]: b for k, b in enumerate(options[o].budgets)})
            if fixed > a.slo_us * (1 + 1e-9):
                raise InfeasibleError(
                    f"application {a.name}: the budgets given along {' -> '.join(path)} sum to "
                    f"{fixed / 1e3:g} ms, more than its SLO of {a.slo_us / 1e3:g} ms"
                )
            if fixed + least > a.slo_us * (1 + 1e-9):
                raise InfeasibleError(
                    f"application {a.name}: along {' -> '.join(path)} the least budgets its "
                    f"models meet (of the grid, margin {req.margin}) sum to "
                    f"{(fixed + least) / 1e3:g} ms, more than its SLO of {a.slo_us / 1e3:g} ms: "
                    "raise the SLO, a finer grid or a lower margin"
                )
            if terms:
                milp.add_row(terms, upper=a.slo_us - fixed + 1e-6)
    for o, row in shared.items():
        milp.add_row({**{x: 1.0 for x in xs[o]}, **row}, lower=0.0)
    return milp, z, rates, xs, ys, ns, gpu_terms


# ---------------------------------------------------------------------------- the plan


def filled_budgets(app: App, budgets: Mapping[str, float]) -> dict[str, float]:
    """Budgets scaled up until the application's longest path takes its whole SLO: what a
    served plan gives its models. The MILP leaves slack where several budgets serve alike
    (the grid's steps, ties); the pipelines it chose meet the budgets it chose, so they
    meet larger ones, and every part gets the time the SLO leaves it."""
    longest = max(sum(budgets[m] for m in p) for p in app.paths())
    return {m: b * app.slo_us / longest for m, b in budgets.items()}


def app_plan_document(req: AppPlanRequest, plan: AppPlan) -> tuple[Plan, dict[str, ModelProfile]]:
    """An application plan as a `Plan` that the simulator and the router serve: one model
    per (application, model), named by `part_name` (a shared model: one, by its own name,
    its SLO the least budget an application gives it), with its budget (filled_budgets) as
    its SLO and the application's weight times its requests per request as its weight;
    `meta["apps"]` records each application's SLO, weight, budgets (and its parts where
    some are shared). Verified against the profiles,
    which are returned under the plan's model names."""
    from poolpipe.domain.entry import segment_record
    from poolpipe.domain.plan import ModelPlan, SolverInfo
    from poolpipe.planner.readback import pipeline_plan

    parts: dict[str, ModelPlan] = {}
    profiles = {}
    meta_apps: dict[str, dict] = {}
    for a in req.apps:
        mult = a.multiplicity()
        planned = {m: plan.budgets[req.key(a.name, m)] for m in a.models}
        budgets = filled_budgets(a, planned)
        meta_apps[a.name] = {
            "slo_us": a.slo_us,
            "weight": a.weight,
            "models": list(a.models),
            "budgets_us": budgets,
            "planned_budgets_us": planned,
            "spec": app_table(a),
        } | ({"parts": {m: req.served_name(a.name, m) for m in a.models}} if req.shared else {})
        for m in a.models:
            name = req.served_name(a.name, m)
            profiles[name] = replace(req.profiles[m], name=name)
            weight = a.weight * mult[m]
            if name in parts:  # shared: its SLO the least any application gives it
                parts[name] = replace(
                    parts[name],
                    weight=parts[name].weight + weight,
                    slo_us=min(parts[name].slo_us, budgets[m]),
                )
                continue
            pipes = [pipeline_plan(c, n) for c, n in plan.pipelines.get(req.key(a.name, m), [])]
            parts[name] = ModelPlan(
                name=name,
                weight=weight,
                slo_us=budgets[m],
                throughput=sum(p.throughput for p in pipes),
                pipelines=tuple(sorted(pipes, key=lambda p: -p.throughput)),
                est_throughput=None,
            )
    models = list(parts.values())
    segments = {name: rec for name, p in profiles.items() if (rec := segment_record(p))}
    doc = Plan(
        strategy="ppipe" if req.max_partitions > 1 else "np",
        cluster=req.cluster,
        packing=req.packing,
        margin=req.margin,
        max_partitions=req.max_partitions,
        models=tuple(models),
        objective=min(m.throughput / m.weight for m in models),
        solver=SolverInfo(name=req.solver, status=plan.status, gap=0.0, seconds=plan.seconds),
        meta={
            "apps": meta_apps,
            "split": plan.split,
            "apps_objective": plan.objective,
            "apps_rates": dict(plan.rates),  # req/s per application: load factor 1
        }
        | ({"inputs": "counted"} if req.count_inputs else {})  # Plan.verify counts them
        | ({"segments": segments} if segments else {}),
    )
    doc.verify(profiles)
    return doc, profiles


# ---------------------------------------------------------------------------- re-planning


def observed_app_shares(meta: Mapping, arrivals: Mapping[str, float]) -> dict[str, float] | None:
    """Each application's share of the requests a router saw, from the arrivals of its
    entry model's parts (one per application request), as a plan's meta records them;
    None without any. An application that saw none keeps a small share, as a model does
    (planner.replan.observed_weights)."""
    from poolpipe.domain.apps import plan_applications
    from poolpipe.planner.replan import observed_weights

    apps, _ = plan_applications(meta)
    names = [a.name for a in apps]
    seen = {a.name: arrivals.get(part_name(a.name, a.entry), 0.0) for a in apps}
    shares = observed_weights(seen, names)
    return None if shares is None else dict(zip(names, shares, strict=True))


def part_weights(meta: Mapping, shares: Mapping[str, float], models: Sequence[str]) -> list[float]:
    """The weight of each of a plan's `models` (its application parts) under an application
    mix: the application's share times the part's requests per request (what the
    application planner gives a part)."""
    from poolpipe.domain.apps import plan_applications

    apps, _ = plan_applications(meta)
    weight = {
        part_name(a.name, m): shares[a.name] * k for a in apps for m, k in a.multiplicity().items()
    }
    return [weight[m] for m in models]


def replan_apps(
    current: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: Cluster,
    shares: Mapping[str, float],
    grid: int = DEFAULT_GRID,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> Plan:
    """A serving application plan planned again for another mix (`shares` per
    application) on `cluster` (the GPUs in service): the same applications, SLOs, margin
    and partitions; the joint split started from Nexus's plan. `profiles`: the models'
    own (the warehouse's names)."""
    from poolpipe.domain.apps import plan_applications

    apps, _ = plan_applications(current.meta)
    req = AppPlanRequest(
        tuple(replace(a, weight=shares[a.name]) for a in apps),
        {m: profiles[m] for a in apps for m in a.models},
        cluster,
        grid=grid,
        margin=current.margin,
        max_partitions=current.max_partitions,
        packing=current.packing,
        time_limit_s=time_limit_s,
        count_inputs=current.counts_inputs,
    )
    joint = plan_apps(req, start=plan_apps(req, "nexus"))
    return app_plan_document(req, joint)[0]


def choose_apps(
    req: AppPlanRequest,
    plans: Mapping[str, AppPlan],
    keep: str = "maximise",
    on_split: Callable[[str], None] = lambda split: None,
) -> tuple[str, dict[str, Plan]]:
    """Each split's plan (plan_apps, by split name) as a plan document stated
    with what it delivers (state_apps), and the split kept: `keep` "maximise", the one that
    delivers most (the joint split on equal figures: the fluid optimum is not always what
    keeps the most on time); "state", the joint split. `on_split`: told each split before
    it is simulated (a progress line)."""
    from poolpipe.planner.deliverable import state_apps

    if keep not in ("maximise", "state"):
        raise PoolpipeError(f"keep: 'maximise' or 'state', not {keep!r}")
    docs = {}
    for split, p in plans.items():
        on_split(split)
        doc, profiles = app_plan_document(req, p)
        docs[split] = state_apps(doc, profiles, req.apps)
    chosen = "joint"
    if keep == "maximise":
        chosen = max(docs, key=lambda s: (docs[s].meta["apps_deliverable"], s == "joint"))
    return chosen, docs
