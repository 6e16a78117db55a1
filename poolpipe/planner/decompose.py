"""Closing the last gap of a per-position plan by decomposing it into one MILP per model.

In `per-position` packing every model rounds its own GPUs up to whole GPUs, so models only
interact through the cluster's counts: Σ_m GPUs(m, k) <= N_k. Whether some plan reaches an
objective z is then a question about each model alone, plus a small dynamic programme:

- per model m and type k, the fewest GPUs of k with which m alone serves w_m·z
  (every other type at its full count): min_k(m);
- on the type e with the least slack N_e - Σ_m min_e(m), per model and each count a of
  e-GPUs m could get, the fewest GPUs of the other type o it then needs: b_m(a);
- a split Σ_m a_m <= N_e minimising Σ_m b_m(a_m); z is reachable iff that is <= N_o.

Every step is a single-model MILP with an *integer* objective (a GPU count), which HiGHS
closes quickly, where the group MILP's continuous max-min objective can spend a minute
moving its bound the last 1e-4. b_m is non-increasing in a, so it is evaluated only where
it can change (bisection between equal values). Clusters of one or two GPU types only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from poolpipe.domain.cluster import Cluster
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.formulation import Chosen, build_group_milp, chosen_objective, gpus_used
from poolpipe.planner.solvers import solve

ROUND_TOL = 1e-6


def decomposable(cluster: Cluster, packing: str) -> bool:
    return packing == "per-position" and 1 <= len(cluster.pools) <= 2


@dataclass
class Reach:
    """Outcome of `reach`: a plan with objective >= z, a proof there is none, or unknown."""

    status: str  # feasible | infeasible | unknown
    chosen: list[Chosen] | None = None
    objective: float = -math.inf
    milps: int = 0
    seconds: float = 0.0


class _OutOfTime(Exception):
    pass


@dataclass
class _ModelProblem:
    """The single-model MILPs of one model at one target objective."""

    cands: list[CandidatePipeline]
    weight: float
    cluster: Cluster
    z: float
    solver: str
    deadline: float
    threads: int | None
    milps: int = 0
    cache: dict[tuple, tuple[int | None, Chosen]] = field(default_factory=dict)

    def fewest(self, gpu: str, budgets: dict[str, int]) -> tuple[int | None, Chosen]:
        """Fewest GPUs of `gpu` for this model alone to reach z (None: cannot)."""
        key = (gpu, tuple(sorted(budgets.items())))
        if key not in self.cache:
            self.cache[key] = self._solve(gpu, budgets)
        return self.cache[key]

    def _solve(self, gpu: str, budgets: dict[str, int]) -> tuple[int | None, Chosen]:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise _OutOfTime
        group = build_group_milp([self.cands], [self.weight], self.cluster, "per-position", budgets)
        if gpu in group.gpu_rows:
            group.minimise_gpus(gpu, self.z)
        else:  # no candidate uses this type: only feasibility is asked
            group.milp.cost[group.z] = 0.0
            group.milp.lower[group.z] = self.z
        self.milps += 1
        res = solve(group.milp, self.solver, left, 1e-9, self.threads)
        if res.status == "infeasible":
            return None, []
        if res.status != "optimal" or res.values is None:
            raise _OutOfTime
        used = round(-res.objective) if gpu in group.gpu_rows else 0
        chosen = []
        for c, cand in enumerate(self.cands):
            counts = [math.floor(res.values[v] + ROUND_TOL) for v in group.n[0][c]]
            if min(counts) > 0:
                chosen.append((cand, counts))
        return used, chosen


def reach(
    cands: list[list[CandidatePipeline]],
    weights: list[float],
    cluster: Cluster,
    z: float,
    solver: str,
    time_limit_s: float,
    threads: int | None = None,
) -> Reach:
    """Is there a per-position plan over `cands` with objective >= z? Exact, see module."""
    t0 = time.perf_counter()
    problems = [
        _ModelProblem(c, w, cluster, z, solver, t0 + time_limit_s, threads)
        for c, w in zip(cands, weights, strict=True)
    ]
    try:
        status, chosen = _reach(problems, cluster)
    except _OutOfTime:
        status, chosen = "unknown", None
    out = Reach(status, chosen, milps=sum(p.milps for p in problems))
    if chosen is not None:
        out.objective = chosen_objective(chosen, weights)
    out.seconds = time.perf_counter() - t0
    return out


def _reach(problems: list[_ModelProblem], cluster: Cluster) -> tuple[str, list[Chosen] | None]:
    split = _splits(problems, cluster)
    if split is None:
        return "infeasible", None
    fits = [(total, picks) for total, picks in split.best.values() if total <= split.o_count]
    if not fits:
        return "infeasible", None
    return "feasible", split.chosen(min(fits, key=lambda t: t[0])[1])


@dataclass
class _Splits:
    """Every way to share the cluster's GPUs among the models, each reaching its target:
    per count of type-e GPUs used in all, the fewest GPUs of the other type o."""

    e: str
    o: str | None  # None on a one-type cluster
    o_count: int
    b: list[dict[int, tuple[int | None, Chosen]]]  # per model: e-GPUs -> (fewest o, plan)
    best: dict[int, tuple[int, list[int]]]  # e-GPUs in all -> (fewest o in all, e per model)

    def chosen(self, picks: list[int]) -> list[Chosen]:
        return [self.b[m][a][1] for m, a in enumerate(picks)]


def _splits(problems: list[_ModelProblem], cluster: Cluster) -> _Splits | None:
    """The splits (see _Splits); None when no model split reaches every target."""
    count = {p.gpu: p.count for p in cluster.pools}
    types = list(count)
    b: list[dict[int, tuple[int | None, Chosen]]]
    if len(types) == 1:
        (gpu,) = types
        mins = [p.fewest(gpu, {}) for p in problems]
        if any(n is None for n, _ in mins) or sum(n or 0 for n, _ in mins) > count[gpu]:
            return None
        b = [{n or 0: (0, ch)} for n, ch in mins]
        picks = [n or 0 for n, _ in mins]
        return _Splits(gpu, None, 0, b, {sum(picks): (0, picks)})
    fewest = {gpu: [p.fewest(gpu, {}) for p in problems] for gpu in types}
    if any(n is None for n, _ in fewest[types[0]]):
        return None  # some model cannot reach its target even on the whole cluster
    slack = {gpu: count[gpu] - sum(n or 0 for n, _ in fewest[gpu]) for gpu in types}
    if min(slack.values()) < 0:
        return None
    e = min(types, key=lambda g: slack[g])  # enumerate the scarcer type
    o = types[1] if e == types[0] else types[0]
    los = [n or 0 for n, _ in fewest[e]]
    his = [lo + slack[e] for lo in los]
    # b[m][a]: fewest o-GPUs for model m with a e-GPUs, a in los[m] .. his[m]
    b = [{hi: p.fewest(o, {e: hi})} for p, hi in zip(problems, his, strict=True)]
    if sum(v[hi][0] or 0 for v, hi in zip(b, his, strict=True)) > count[o]:
        return None  # even with every model at its most e-GPUs
    for p, lo, hi, values in zip(problems, los, his, b, strict=True):
        values[lo] = p.fewest(o, {e: lo})
        _fill(p, values, lo, hi, e, o)
    # DP over models: best[used e] = (fewest o in total, choice per model)
    best: dict[int, tuple[int, list[int]]] = {0: (0, [])}
    for values in b:
        nxt: dict[int, tuple[int, list[int]]] = {}
        for used, (total, picks) in best.items():
            for a, (need, _) in values.items():
                if need is None or used + a > count[e]:
                    continue
                cand = (total + need, [*picks, a])
                if used + a not in nxt or cand[0] < nxt[used + a][0]:
                    nxt[used + a] = cand
        best = nxt
    return _Splits(e, o, count[o], b, best)


@dataclass
class CheapestSplit:
    """Outcome of `cheapest_split`: the cheapest plan serving the rates, a proof there is
    none, or unknown (out of time)."""

    status: str  # feasible | infeasible | unknown
    chosen: list[Chosen] | None = None
    gpus: dict[str, int] = field(default_factory=dict)  # physical GPUs per type
    milps: int = 0
    seconds: float = 0.0


def cheapest_split(
    cands: list[list[CandidatePipeline]],
    rates: list[float],
    cluster: Cluster,
    prices: dict[str, float],
    solver: str,
    time_limit_s: float,
    threads: int | None = None,
) -> CheapestSplit:
    """The cheapest per-position plan over `cands` serving `rates`, exactly: models share
    nothing but the GPU counts, so each split of the cluster's GPUs among them (_splits,
    the fewest o-GPUs for every count of e-GPUs) is priced and the cheapest kept; for a
    given count of e-GPUs the fewest o-GPUs is also the cheapest."""
    t0 = time.perf_counter()
    problems = [
        _ModelProblem(c, 1.0, cluster, r, solver, t0 + time_limit_s, threads)
        for c, r in zip(cands, rates, strict=True)
    ]
    out = CheapestSplit("infeasible")
    try:
        split = _splits(problems, cluster)
        if split is not None:
            price = {g: prices[g] for g in (split.e, split.o) if g is not None}
            fits = [
                (price[split.e] * used + (price[split.o] * total if split.o else 0.0), picks)
                for used, (total, picks) in split.best.items()
                if total <= split.o_count
            ]
            if fits:
                chosen = split.chosen(min(fits, key=lambda t: t[0])[1])
                gpus = {g: n for g, n in gpus_used(chosen, "per-position").items() if n}
                out = CheapestSplit("feasible", chosen, gpus)
    except _OutOfTime:
        out = CheapestSplit("unknown")
    out.milps = sum(p.milps for p in problems)
    out.seconds = time.perf_counter() - t0
    return out


def _fill(
    p: _ModelProblem,
    values: dict[int, tuple[int | None, Chosen]],
    lo: int,
    hi: int,
    e: str,
    o: str,
) -> None:
    """Evaluate b(a) on lo..hi (both known); equal ends make the whole range equal."""
    if hi - lo <= 1:
        return
    if values[lo][0] == values[hi][0]:
        for a in range(lo + 1, hi):
            values[a] = values[lo]  # same need, and lo's solution uses at most lo <= a e-GPUs
        return
    mid = (lo + hi) // 2
    values[mid] = p.fewest(o, {e: mid})
    _fill(p, values, lo, mid, e, o)
    _fill(p, values, mid, hi, e, o)
