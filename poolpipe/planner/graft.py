"""Planning entry streams (domain/entry.py): Graft's re-aligned pooled pipelines, and the
two plans they are compared with.

- `realigned`: a model's fragments are grouped (adjacent ones together); a group's
  streams are re-aligned at X, its deepest entry. Each entry p < X runs blocks [p, X) in an
  alignment part of its own (one per entry block, shared by the group's streams entering
  there) and every stream of the group runs blocks [X, N) in one suffix part, its pools
  shared and its batches mixing entry points and budgets.
- `per-fragment`: each fragment planned apart (GSLICE-like per-fragment serving): the
  streams entering at p with one budget share blocks [p, N), nothing else.
- `raw`: every client sends the raw input: a model's streams share blocks [0, N), each
  with its whole SLO (the raw input's upload is not counted, which favours this plan).

Each is an application plan (planner/apps.py) with shared parts: a stream is an
application of one or two segments (alignment -> suffix) whose SLO is the stream's budget;
one MILP chooses every part's budget with its pipelines (along each stream the budgets
within its budget) and the cheapest GPUs serving the streams' rates (the cost objective).

A fragment is a stream's entry block and budget; streams of one fragment share their
parts in every plan. How groups are chosen is Graft's merging heuristic, not exact (the
MILP has no choice of paths): from one group per fragment (the per-fragment plan), in the
order of their entries and budgets, adjacent groups of a model are merged while a merge
does not raise the price of that model's streams planned alone on the cluster (the first
such merge in that order each round, each trial priced against the best so far, which the
solver need only prove it exceeds; of equal prices the fewer, larger pools, which queue
better). The first trial merges every entry block's fragments at once (they run the same
blocks; only their budgets differ): one MILP where merging them pair by pair took one a
pair (27 streams over three models: 11 MILPs instead of 28). The models merge at once,
each in a thread (HiGHS solves outside Python's lock); their groups are then planned
together.
`sized=True` sizes each plan on what it delivers: simulated at the streams' rates, the rate
asked of the MILP for a stream short of 99% on time grows and the plan is made again
(as the cost objective's sizing does for models: planner/cost.py)."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace

from poolpipe.domain.apps import App, Edge
from poolpipe.domain.cluster import Cluster
from poolpipe.domain.entry import EntryStream, segment
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import InfeasibleError, PoolpipeError, SolverError
from poolpipe.planner.apps import (
    AppPlan,
    AppPlanRequest,
    Dearer,
    app_plan_document,
    cheapest_apps,
    size_by_share,
)
from poolpipe.planner.solvers import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S, stopped_by

HOWS = ("realigned", "per-fragment", "raw")


@dataclass(frozen=True)
class GraftRequest:
    streams: tuple[EntryStream, ...]
    profiles: Mapping[str, ModelProfile]  # the whole models'
    cluster: Cluster
    prices: Mapping[str, float] | None = None  # per GPU-hour (None: 1 per GPU)
    margin: float = 0.4
    max_partitions: int = 2
    packing: str = "per-share"
    grid: int = 10
    solver: str = "highs"
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    mip_gap: float = DEFAULT_MIP_GAP
    # pools planned with room for queueing at the rates they serve (planner/headroom.py):
    # a pool of one or two vGPUs at 100% of its fluid throughput keeps nowhere near 99%
    # of a Poisson stream on time; False: fluid
    headroom: bool = True
    # each part's request inputs counted on its first server's NIC (PlanRequest's): the
    # live router sends them there
    count_inputs: bool = False
    # re-aligned groups: each round's first merge that costs no more ("first"), or its
    # cheapest ("best": a MILP per adjacent pair a round, O(fragments^2) in all)
    merge: str = "first"

    def __post_init__(self) -> None:
        if not self.streams:
            raise PoolpipeError("no entry streams to plan")
        missing = sorted({s.model for s in self.streams} - set(self.profiles))
        if missing:
            raise PoolpipeError(f"no profile for model(s) {', '.join(missing)}: profile them")
        if self.merge not in ("first", "best"):
            raise PoolpipeError(f"merge: 'first' or 'best', not {self.merge!r}")

    @property
    def unit_prices(self) -> dict[str, float]:
        gpus = [p.gpu for p in self.cluster.pools]
        return {g: 1.0 for g in gpus} if self.prices is None else {g: self.prices[g] for g in gpus}

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(s.model for s in self.streams))


Fragment = tuple[int, float]  # a stream's entry block and budget (µs)


def fragment(s: EntryStream) -> Fragment:
    return (s.entry, s.budget_us)


@dataclass(frozen=True)
class Group:
    """The streams of `model` whose fragments (entry block, budget) are `fragments`,
    re-aligned at block `at` (default: their deepest entry)."""

    model: str
    fragments: tuple[Fragment, ...]
    at: int | None = None

    @property
    def entries(self) -> tuple[int, ...]:
        return tuple(sorted({e for e, _ in self.fragments}))

    @property
    def align(self) -> int:
        return max(self.entries) if self.at is None else self.at

    def holds(self, s: EntryStream) -> bool:
        return s.model == self.model and fragment(s) in self.fragments


def group_at(req: GraftRequest, model: str, entries: Sequence[int]) -> Group:
    """The group of `model`'s streams entering at `entries` (a re-alignment given)."""
    return Group(
        model,
        tuple(
            sorted({fragment(s) for s in req.streams if s.model == model and s.entry in entries})
        ),
    )


@dataclass
class GraftPlan:
    """A plan of entry streams: how it was made, its groups, the application plan that
    serves them (`request`: its applications and segments) and what it costs."""

    how: str
    groups: tuple[Group, ...]
    request: AppPlanRequest
    plan: AppPlan
    seconds: float  # planning wall time, groupings and sizing included
    priced: int  # MILPs solved
    asked: dict[str, float]  # req/s per stream asked of the MILP (above the rate: sized)
    on_time: dict[str, float] | None = None  # per stream at its rate, simulated (sized)
    rounds: list[dict] = field(default_factory=list)
    source: GraftRequest | None = None  # the streams and settings planned

    @property
    def cost_per_hour(self) -> float:
        return float(self.plan.cost_per_hour or 0.0)

    @property
    def gpus(self) -> dict[str, int]:
        return {g: n for g, n in self.plan.gpus_used.items() if n}

    def document(self) -> tuple[Plan, dict[str, ModelProfile]]:
        """The plan as the simulator (and a router) serves it, with its segments' profiles;
        `meta["graft"]` records how it was made and its groups."""
        doc, profiles = app_plan_document(self.request, self.plan)
        meta = dict(doc.meta)
        meta["graft"] = {
            "how": self.how,
            "groups": [
                {"model": g.model, "align": g.align, "fragments": [list(f) for f in g.fragments]}
                for g in self.groups
            ],
            "asked": dict(self.asked),
        }
        if self.source is not None:  # what re-planning for another load needs
            meta["graft"] |= graft_settings(self.source) | {"cost_per_hour": self.cost_per_hour}
        return replace(doc, meta=meta), profiles


def graft_settings(req: GraftRequest) -> dict:
    """What a plan records of its streams and settings (meta graft): `replan_streams`
    plans them again from it."""
    return {
        "streams": [asdict(st) for st in req.streams],
        "margin": req.margin,
        "max_partitions": req.max_partitions,
        "packing": req.packing,
        "headroom": req.headroom,
        "count_inputs": req.count_inputs,
        "merge": req.merge,
    }


def streams_of(meta: Mapping) -> tuple[EntryStream, ...]:
    """The entry streams a plan of them records (meta graft streams); an error naming
    the fix where it records none."""
    rows = (meta.get("graft") or {}).get("streams")
    if not rows:
        raise PoolpipeError(
            "this plan records no entry streams (a plan of models, or one made before plans "
            "recorded them): plan the streams with poolpipe graft plan"
        )
    return tuple(
        EntryStream(
            str(r["name"]),
            str(r["model"]),
            int(r["entry"]),
            float(r["budget_us"]),
            float(r["rate"]),
            float(r["slo_us"]),
        )
        for r in rows
    )


def replan_streams(
    served: Plan,
    profiles: Mapping[str, ModelProfile],
    cluster: Cluster,
    rates: Mapping[str, float],
    prices: Mapping[str, float] | None = None,
    sized: bool = True,
    regroup: bool = False,
) -> GraftPlan:
    """The plan of entry streams `served` (at time scale 1) made again, as it was made
    (how, margin, partitions, packing, and its groups: the same segments, which a running
    router can roll out), for each stream's rate in `rates` (req/s; a stream left out
    keeps its own) on `cluster`: the entry mix moved, or the load. `regroup`: its
    re-aligned groups merged again for the new rates (other segments: a new router).
    `profiles`: the whole models' (the warehouse's)."""
    rec = served.meta.get("graft") or {}
    streams = tuple(
        replace(s, rate=float(rates.get(s.name, s.rate))) for s in streams_of(served.meta)
    )
    unknown = sorted(set(rates) - {s.name for s in streams})
    if unknown:
        raise PoolpipeError(
            f"rates given for {', '.join(unknown)}, which the plan has no stream of: "
            + ", ".join(s.name for s in streams)
        )
    bad = [f"{s.name}={s.rate}" for s in streams if not (s.rate > 0 and math.isfinite(s.rate))]
    if bad:
        raise PoolpipeError(f"a stream's rate must be req/s > 0, got {', '.join(bad)}")
    req = GraftRequest(
        streams,
        {m: profiles[m] for m in {s.model for s in streams}},
        cluster,
        prices=prices,
        margin=float(rec.get("margin", served.margin)),
        max_partitions=int(rec.get("max_partitions", max(1, served.max_partitions))),
        packing=str(rec.get("packing", served.packing)),
        headroom=bool(rec.get("headroom", True)),
        count_inputs=bool(rec.get("count_inputs", served.counts_inputs)),
        merge=str(rec.get("merge", "first")),
    )
    how = str(rec.get("how", "realigned"))
    groups = None
    if how == "realigned" and not regroup:
        groups = [
            Group(
                str(g["model"]),
                tuple((int(e), float(b)) for e, b in g["fragments"]),
                int(g["align"]),
            )
            for g in rec.get("groups", ())
        ]
    return plan_streams(req, how, sized=sized, groups=groups)


def app_request(
    req: GraftRequest,
    groups: Sequence[Group],
    raw: bool = False,
    rates: Mapping[str, float] | None = None,
) -> tuple[AppPlanRequest, dict[str, float]]:
    """The application plan request of `groups` (streams of other models left out) and
    each stream's rate: a stream an application of its segments (above), the parts
    shared within a group (a segment two groups of a model have is two parts, the later
    one's name tagged .g<k>, k its place among the model's groups); `raw`: each stream
    enters at block 0 with its whole SLO. Each part's pools are sized for the streams'
    `rates` (default: theirs) through it (GraftRequest.headroom)."""
    profiles: dict[str, ModelProfile] = {}
    whose: dict[str, int] = {}  # segment name -> the group (of its model) that has it
    apps: list[App] = []
    own: dict[str, float] = {}

    def part(k: int, model: str, start: int, end: int) -> str:
        p = segment(req.profiles[model], start, end)
        name = p.name if whose.get(p.name, k) == k else f"{p.name}.g{k}"
        whose.setdefault(p.name, k)
        if name != p.name and "segment_of" not in p.meta:  # the whole model, a second time
            p = replace(p, meta={**p.meta, "segment_of": model, "blocks": f"{start}-{end}"})
        profiles[name] = replace(p, name=name)
        return name

    kth: dict[str, int] = {}
    for g in groups:
        k = kth[g.model] = kth.get(g.model, -1) + 1  # the group's place among its model's
        whole = req.profiles[g.model]
        suffix = part(k, g.model, g.align, whole.num_blocks)
        for s in req.streams:
            if s.model != g.model or (not raw and not g.holds(s)):
                continue
            entry, budget = (0, s.slo_us) if raw else (s.entry, s.budget_us)
            own[s.name] = s.rate
            if entry == g.align:
                apps.append(App(s.name, budget, s.rate, (suffix,)))
                continue
            head = part(k, g.model, entry, g.align)
            apps.append(
                App(
                    s.name,
                    budget,
                    s.rate,
                    (head, suffix),
                    (Edge(head, suffix),),
                )
            )
    through: dict[str, float] = {}
    for a in apps:
        for m in a.models:
            through[m] = through.get(m, 0.0) + (rates or own)[a.name]
    areq = AppPlanRequest(
        tuple(apps),
        profiles,
        req.cluster,
        grid=req.grid,
        margin=req.margin,
        max_partitions=req.max_partitions,
        packing=req.packing,
        solver=req.solver,
        time_limit_s=req.time_limit_s,
        mip_gap=req.mip_gap,
        shared=frozenset(profiles),
        headroom=through if req.headroom else None,
        count_inputs=req.count_inputs,
    )
    return areq, own


def groups_of(req: GraftRequest, how: str, model: str) -> tuple[Group, ...]:
    """The groups of `model`'s streams a plan starts from: one per fragment (entry block
    and budget: per-fragment, and where realigned merges from), or one at block 0 (raw)."""
    frags = sorted({fragment(s) for s in req.streams if s.model == model})
    if how == "raw":
        return (Group(model, tuple(frags), at=0),)
    return tuple(Group(model, (f,)) for f in frags)


class _Planner:
    """Plans of groups of streams at rates, each model's planned alone (and remembered):
    with each model's GPUs its own (no mixed models on a GPU), the cheapest plan of all
    models is the union of each model's cheapest where the union fits the cluster, and
    one MILP of them all otherwise."""

    def __init__(self, req: GraftRequest, how: str, on_step: Callable[[str], None]):
        self.req, self.how, self.on_step = req, how, on_step
        self.raw = how == "raw"
        # per model's groups and rates: its plan, None (not served), or a price it was
        # proven dearer than
        self.memo: dict[tuple, AppPlan | float | None] = {}
        self.why: dict[str, str] = {}  # per model, why its last plan alone failed
        self.priced = 0
        self.lock = threading.Lock()  # models are merged in threads (_each_merged)

    def model(
        self,
        groups: tuple[Group, ...],
        rates: Mapping[str, float],
        at_most: float | None = None,
    ) -> AppPlan | None:
        """One model's groups planned alone at `rates` (None: they cannot be served, or,
        given `at_most`, not for at most that price)."""
        areq, own = app_request(self.req, groups, self.raw, rates)
        key = (groups, tuple(sorted((n, rates[n]) for n in own)))
        known = self.memo.get(key, False)
        if isinstance(known, float):  # proven dearer than `known` before
            if at_most is not None and at_most <= known:
                return None
            known = False
        if known is False:
            with self.lock:
                self.priced += 1
            self.on_step(f"{groups[0].model}: " + ", ".join(str(list(g.entries)) for g in groups))
            try:
                self.memo[key] = cheapest_apps(
                    areq, {n: rates[n] for n in own}, self.req.unit_prices, at_most=at_most
                )
            except Dearer:
                assert at_most is not None
                self.memo[key] = float(at_most)
                return None
            except InfeasibleError as e:
                self.memo[key] = None
                self.why[groups[0].model] = str(e)
        found = self.memo[key]
        return None if isinstance(found, float) else found

    def price(
        self, groups: tuple[Group, ...], rates: Mapping[str, float], at_most: float | None = None
    ) -> float:
        """What `groups` cost planned alone at `rates` (inf: not served, or dearer than
        `at_most` where given)."""
        plan = self.model(groups, rates, at_most)
        return math.inf if plan is None else float(plan.cost_per_hour or 0.0)

    def all(self, chosen: Mapping[str, tuple[Group, ...]], rates: Mapping[str, float]) -> AppPlan:
        """Every model's groups planned together at `rates`."""
        plans = []
        for m, groups in chosen.items():
            plan = self.model(groups, rates)
            if plan is None:
                raise InfeasibleError(
                    f"{self.how} plan of the entry streams: {m}'s cannot be served within "
                    f"their budgets on cluster {self.req.cluster.name} ({self.why.get(m, '')})"
                )
            plans.append(plan)
        union = _union(plans)
        count = {p.gpu: p.count for p in self.req.cluster.pools}
        if all(n <= count.get(g, 0) for g, n in union.gpus_used.items()):
            return union
        self.priced += 1
        every = [g for gs in chosen.values() for g in gs]
        areq, _ = app_request(self.req, every, self.raw, rates)
        try:
            return cheapest_apps(areq, rates, self.req.unit_prices)
        except InfeasibleError as e:
            raise InfeasibleError(f"{self.how} plan of the entry streams: {e}") from None
        except SolverError:
            raise InfeasibleError(
                f"{self.how} plan of the entry streams: each model's cheapest plan alone "
                f"takes {_union_text(union.gpus_used)} together, more than cluster "
                f"{self.req.cluster.name} has, and the plan of them all found none within "
                f"{self.req.time_limit_s:g} s: lower the rates or give a larger cluster"
            ) from None


def _union_text(gpus: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {g}" for g, n in sorted(gpus.items()) if n)


def _union(plans: Sequence[AppPlan]) -> AppPlan:
    """Plans of disjoint parts as one."""
    used: dict[str, int] = {}
    for p in plans:
        for g, n in p.gpus_used.items():
            used[g] = used.get(g, 0) + n
    return AppPlan(
        "joint",
        min(p.objective for p in plans),
        {k: v for p in plans for k, v in p.rates.items()},
        {k: v for p in plans for k, v in p.budgets.items()},
        {k: v for p in plans for k, v in p.served.items()},
        {k: v for p in plans for k, v in p.pipelines.items()},
        next((p.status for p in plans if p.status != "optimal"), "optimal"),
        sum(p.seconds for p in plans),
        used,
        sum(float(p.cost_per_hour or 0.0) for p in plans),
        max(p.gap for p in plans),
    )


def unservable(req: GraftRequest, how: str = "realigned") -> dict[str, str]:
    """Each stream no pipeline of the cluster serves alone within its budget (its whole
    SLO from block 0 for `raw`), and why: the fastest of its blocks' pipelines against the
    budget less the margin. A re-aligned plan serves a stream only where it can alone."""
    from poolpipe.domain.costs import ModelCosts
    from poolpipe.planner.candidates import enumerate_pipelines

    out = {}
    for s in req.streams:
        whole = req.profiles[s.model]
        entry, budget = (0, s.slo_us) if how == "raw" else (s.entry, s.budget_us)
        costs = ModelCosts(
            segment(whole, entry, whole.num_blocks),
            req.cluster,
            budget,
            req.margin,
            None,
            inputs=req.count_inputs,
        )
        found = enumerate_pipelines(costs, req.max_partitions, req.packing == "per-share")
        if not found.pipelines:
            fastest = (
                f"its blocks' fastest pipeline takes {found.best_latency_us / 1e3:.1f} ms"
                if math.isfinite(found.best_latency_us)
                else "no GPU of the cluster is profiled for it"
            )
            out[s.name] = (
                f"{s.name} ({s.model} from block {entry}): {fastest}, more than its budget of "
                f"{budget / 1e3:.1f} ms less the margin {req.margin:g} "
                f"({costs.budget_us() / 1e3:.1f} ms)"
            )
    return out


def plan_streams(
    req: GraftRequest,
    how: str = "realigned",
    sized: bool = False,
    on_step: Callable[[str], None] = lambda line: None,
    groups: Sequence[Group] | None = None,
) -> GraftPlan:
    """The cheapest plan of `req`'s streams made `how` (HOWS), `sized` on what it
    delivers (simulated); `on_step` is told each model's groups as they are planned (a
    progress line). `groups` (realigned): the re-alignment given, every entry block of
    every model in one group, instead of merged."""
    if how not in HOWS:
        raise PoolpipeError(f"how {how!r}? choose one of {', '.join(HOWS)}")
    t0 = time.perf_counter()
    bad = unservable(req, how)
    if bad:
        raise InfeasibleError(
            f"{how} plan: no pipeline of cluster {req.cluster.name} serves "
            + "; ".join(bad.values())
            + ": give them more budget (a faster client or uplink), or leave them out"
        )
    planner = _Planner(req, how, on_step)
    rates = {s.name: s.rate for s in req.streams}
    chosen = {m: groups_of(req, how, m) for m in req.models}
    if groups is not None:
        chosen = _given(req, how, groups)
    elif how == "realigned":
        chosen = _each_merged(
            chosen, lambda g, at_most: planner.price(g, rates, at_most), req.merge
        )
    groups = [g for gs in chosen.values() for g in gs]
    areq, _ = app_request(req, groups, planner.raw)
    result = GraftPlan(how, tuple(groups), areq, planner.all(chosen, rates), 0.0, 0, dict(rates))
    result.source = req
    if sized:
        _size(result, rates, lambda asked: planner.all(chosen, asked))
    result.priced = planner.priced
    result.seconds = time.perf_counter() - t0
    return result


def _given(req: GraftRequest, how: str, groups: Sequence[Group]) -> dict[str, tuple[Group, ...]]:
    """The groups given, by model; an error naming an entry block in none or in two."""
    if how != "realigned":
        raise PoolpipeError(f"groups are given to a realigned plan, not a {how} one")
    out: dict[str, tuple[Group, ...]] = {}
    for m in req.models:
        mine = tuple(g for g in groups if g.model == m)
        for s in (s for s in req.streams if s.model == m):
            holding = [g for g in mine if g.holds(s)]
            if len(holding) != 1:
                raise PoolpipeError(
                    f"groups of {m}: stream {s.name} (entry {s.entry}) is in {len(holding)} "
                    "groups; give each of its streams one"
                )
        if any(g.at is not None and g.at < max(g.entries) for g in mine):
            raise PoolpipeError(f"groups of {m}: a group re-aligns below one of its entries")
        out[m] = mine
    return out


def _each_merged(
    chosen: Mapping[str, tuple[Group, ...]],
    price: Callable[[tuple[Group, ...], float | None], float],
    how: str,
) -> dict[str, tuple[Group, ...]]:
    """Each model's groups merged (_merged), the models at once in threads (one a core,
    at least two; the most fragments first): their prices are MILPs apart, and HiGHS
    solves without Python's lock (on two cores 27 streams over three models merge in about
    half the time). A Ctrl-C, or an error in one model's, stops every model's merging at
    once (its running MILP too: solvers.stopped_by)."""
    stop = threading.Event()

    def priced(groups: tuple[Group, ...], at_most: float | None) -> float:
        if stop.is_set():
            raise KeyboardInterrupt
        return price(groups, at_most)

    def merged(m: str) -> tuple[Group, ...]:
        with stopped_by(stop):  # its MILP running stops too
            return _merged(chosen[m], priced, how)

    if len(chosen) == 1:
        return {m: _merged(gs, priced, how) for m, gs in chosen.items()}
    workers = min(len(chosen), max(2, os.cpu_count() or 2))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="graft-merge")
    try:
        # the longest merging starts at once
        order = sorted(chosen, key=lambda m: -len(chosen[m]))
        futures = {m: pool.submit(merged, m) for m in order}
        wait(futures.values(), return_when=FIRST_EXCEPTION)  # the first error, not in order
        for f in futures.values():
            if f.done():
                f.result()  # raises it
        return {m: futures[m].result() for m in chosen}
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # stopped: within milliseconds


def _merged(
    start: tuple[Group, ...],
    price: Callable[[tuple[Group, ...], float | None], float],
    how: str = "first",
) -> tuple[Group, ...]:
    """Graft's merging: one model's groups, adjacent ones merged while a merge does not
    raise the price of the model's plan alone, stopping when none does; each round the
    first such merge in the order of entries and budgets (`how` "first"), or the one
    lowering the price most ("best"; of equal prices the first). Equal prices merge (the
    fewer, larger pools queue better). `price(groups, at_most)`: inf where dearer than
    `at_most`: a trial is priced against the best so far (and, "best", the cheapest trial
    of its round so far), which the solver need only prove it exceeds. Before the rounds,
    every entry block's adjacent groups merged at once is priced, and kept where no dearer."""
    groups = start
    best = price(groups, None)
    by_entry = _by_entry(groups)
    if len(by_entry) < len(groups):
        cost = price(by_entry, best)
        if cost <= best + 1e-9:
            best, groups = cost, by_entry
    while len(groups) > 1:
        chosen: tuple[float, tuple[Group, ...]] | None = None
        for i in range(len(groups) - 1):
            merged = Group(groups[i].model, groups[i].fragments + groups[i + 1].fragments)
            trial = (*groups[:i], merged, *groups[i + 2 :])
            bound = best if chosen is None else chosen[0]
            cost = price(trial, bound)
            if cost <= bound + 1e-9 and (chosen is None or cost < chosen[0] - 1e-9):
                chosen = (cost, trial)
                if how == "first":
                    break
        if chosen is None:
            break
        best, groups = chosen
    return groups


def _by_entry(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    """Adjacent groups of the same entry blocks merged."""
    out: list[Group] = []
    for g in groups:
        if out and out[-1].entries == g.entries:
            out[-1] = Group(g.model, out[-1].fragments + g.fragments)
        else:
            out.append(g)
    return tuple(out)


def _size(
    result: GraftPlan, rates: Mapping[str, float], plan_at: Callable[[Mapping[str, float]], AppPlan]
) -> None:
    """Size `result` on what it delivers (module doc; planner.apps.size_by_share), in
    place; `plan_at` plans its groups at the rates asked."""
    from poolpipe.planner.deliverable import app_attainment_at  # the way into the simulator

    def on_time(plan: AppPlan) -> dict[str, float]:
        doc, profiles = app_plan_document(result.request, plan)
        return app_attainment_at(doc, profiles, result.request.apps, rates)

    result.plan, result.on_time, result.asked, result.rounds = size_by_share(
        result.plan, on_time(result.plan), rates, on_time, plan_at
    )
