"""Capacity search: the largest load factor at which a model keeps >= 99% SLO attainment.

Load factor 1.0 is a reference rate per model (the ppipe plan's throughput; baselines run at
the same absolute rates). All models of a group run together at one load factor; each gets
its own capacity. Two searches over the same grid (multiples of `step`, at most 1.0):
`step` walks down from 1.0 as the paper does; `bisect` halves the grid interval per model,
assuming attainment falls with load, and shares simulations between models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import Topology
from poolpipe.sim.arrivals import ArrivalSpec
from poolpipe.sim.engine import SimConfig
from poolpipe.sim.metrics import ATTAINMENT_TARGET, SimResult
from poolpipe.sim.runner import run_once
from poolpipe.sim.seeds import SeedRuns

SEARCHES = ("step", "bisect")
# A hinted bisection's first bracket, in grid steps either side of the hint.
AROUND_STEPS = 3


@dataclass
class CapacityResult:
    models: list[str]
    capacity: dict[str, float]  # model -> largest load factor meeting the target
    attainment: dict[float, dict[str, float]] = field(default_factory=dict)  # lf -> model -> att
    simulations: int = 0
    results: dict[float, list[SimResult]] = field(default_factory=dict)  # lf -> one per seed

    def points(self, model: str) -> dict[str, float]:
        """The model's attainment at every load factor tried, keyed "0.95", ascending."""
        return {f"{lf:g}": att[model] for lf, att in sorted(self.attainment.items())}


def search_capacity(
    topo: Topology,
    arrivals: ArrivalSpec,
    *,
    duration_s: float = 30.0,
    seeds: Sequence[int] = (1,),
    data_plane: str = "reservation",
    reference_rates: Sequence[float] | None = None,
    method: str = "step",
    step: float = 0.05,
    jitter: float = 0.0,
    target: float = ATTAINMENT_TARGET,
    on_point: Callable[[float, dict[str, float]], None] | None = None,
    around: Mapping[str, float] | None = None,
    processes: int = 1,
) -> CapacityResult:
    """The capacity of every model of `topo` (module docstring). `around` (bisect only):
    per model, a load factor its capacity is likely near (a coarser search's); the search
    brackets it first, AROUND_STEPS grid steps either side, and bisects from there (the
    same answer as without it, where attainment falls with load, in fewer simulations).
    `processes` >= 2: each point's seeds split over two processes (seeds.py; the same
    results)."""
    if method not in SEARCHES:
        raise PoolpipeError(f"unknown capacity search {method!r}; choose {', '.join(SEARCHES)}")
    if not 0 < step <= 1:
        raise PoolpipeError(f"step must be in (0, 1], got {step}")
    if arrivals.absolute:
        raise PoolpipeError(
            "a plain list of arrival times has fixed rates, so there is no load factor to "
            "search; use poisson, gamma:CV or an Azure trace (or `poolpipe simulate`)"
        )

    def run(lf: float, seed: int) -> SimResult:
        config = SimConfig(duration_s=duration_s, seed=seed, jitter=jitter)
        return run_once(topo, arrivals, lf, config, data_plane, reference_rates)

    with SeedRuns(run, seeds, processes) as runs:
        return _search(topo, runs, method, step, target, on_point, around)


def _search(
    topo: Topology,
    seed_runs: SeedRuns,
    method: str,
    step: float,
    target: float,
    on_point: Callable[[float, dict[str, float]], None] | None,
    around: Mapping[str, float] | None,
) -> CapacityResult:
    names = [m.name for m in topo.models]
    out = CapacityResult(models=names, capacity={})
    top = round(1.0 / step)

    def attainment(i: int) -> dict[str, float]:
        lf = round(i * step, 10)
        if lf not in out.attainment:
            runs = seed_runs(lf)
            out.simulations += len(runs)
            out.results[lf] = runs
            pooled = {}
            for k, name in enumerate(names):
                arrived = sum(r.models[k].arrived for r in runs)
                on_time = sum(r.models[k].on_time for r in runs)
                pooled[name] = on_time / arrived if arrived else 1.0
            out.attainment[lf] = pooled
            if on_point is not None:
                on_point(lf, pooled)
        return out.attainment[lf]

    if method == "step":
        for i in range(top, 0, -1):
            att = attainment(i)
            for name in names:
                if name not in out.capacity and att[name] >= target:
                    out.capacity[name] = round(i * step, 10)
            if len(out.capacity) == len(names):
                break
        for name in names:
            out.capacity.setdefault(name, 0.0)
    else:
        for name in names:
            hint = round(around[name] / step) if around is not None and name in around else None
            tried = {round(lf / step): att for lf, att in out.attainment.items()}
            i = bisect_grid(attainment, name, top, target, tried, hint)
            out.capacity[name] = round(i * step, 10)
    return out


def bisect_grid(
    attainment: Callable[[int], Mapping[str, float]],
    name: str,
    top: int,
    target: float,
    tried: Mapping[int, Mapping[str, float]],
    hint: int | None = None,
) -> int:
    """The largest grid point in [0, top] at which `name`'s attainment (`attainment(i)`,
    every name's at grid point i) meets `target`, by bisection, assuming it falls with load
    (point 0 passes): `top` where that passes; else from the bracket the points already
    simulated give (`tried`, other names' searches), narrowed first to AROUND_STEPS points
    either side of `hint` (a coarser search's answer) where one is given."""
    if attainment(top)[name] >= target:
        return top
    lo, hi = 0, top  # attainment(lo) passes (0 load), attainment(hi) fails
    for i, att in tried.items():
        if att[name] >= target:
            lo = max(lo, i)
        else:
            hi = min(hi, i)
    if hint is not None:
        for i in (min(hint + AROUND_STEPS, top), max(hint - AROUND_STEPS, 0)):
            if lo < i < hi:
                if attainment(i)[name] >= target:
                    lo = i
                else:
                    hi = i
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attainment(mid)[name] >= target:
            lo = mid
        else:
            hi = mid
    return lo
