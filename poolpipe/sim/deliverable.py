"""What a plan delivers: per model, the req/s it serves with >= 99% of its requests on time
under Poisson arrivals at the plan's own throughputs, found by simulating it (the capacity
search of capacity.py, every model at one load factor of its planned throughput).

The fluid figure a plan states (each pool at 100% of its vGPUs) holds where pools are large;
a pool of one or two vGPUs at full load cannot keep 99% of a Poisson stream within what the
SLO leaves for waiting. `deliverable` is the figure a user sizes a cluster by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import Topology
from poolpipe.sim.arrivals import ArrivalSpec
from poolpipe.sim.capacity import search_capacity
from poolpipe.sim.engine import SimConfig
from poolpipe.sim.metrics import ATTAINMENT_TARGET
from poolpipe.sim.runner import run_once
from poolpipe.sim.seeds import usable_cores

# Seeds the planner simulates with (a stated figure's, a screening's); checks of a stated
# figure use others.
PLANNING_SEEDS = (101, 102)
SCREENING_SEEDS = (101,)
# Simulated requests per model and seed at the plan's throughput: sets each run's length.
# A stated figure is found with STATED (a 1% miss rate is about 30 requests per seed at
# half the plan's throughput); plans are compared with SCREENING first.
STATED_REQUESTS = 5000
SCREENING_REQUESTS = 1500
# Bounds on one run's simulated seconds (µs-scale batches need little; a slow model's
# stream needs the longer runs), and on its requests, all models together, at the plan's
# throughput (a model that runs at ten times another's need not be simulated as long).
MIN_DURATION_S = 2.0
MAX_DURATION_S = 60.0
MAX_RUN_REQUESTS_PER_MODEL = 2
# The load-factor grids of the search (of the plan's throughput per model): a stated
# figure's, and a screening's.
STEP = 0.01
SCREENING_STEP = 0.02


@dataclass(frozen=True)
class Delivery:
    """A plan's deliverable figures, and how they were measured."""

    models: tuple[str, ...]
    rates: tuple[float, ...]  # req/s each model serves with >= `target` on time
    load: tuple[float, ...]  # the same as a share of its planned (fluid) throughput
    objective: float  # min over models of rate / weight: the planner's objective, delivered
    target: float
    arrivals: str
    seeds: tuple[int, ...]
    duration_s: float
    simulations: int

    def rate(self, name: str) -> float:
        return self.rates[self.models.index(name)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("models", "rates", "load", "seeds"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Delivery:
        return cls(
            models=tuple(d["models"]),
            rates=tuple(float(x) for x in d["rates"]),
            load=tuple(float(x) for x in d["load"]),
            objective=float(d["objective"]),
            target=float(d["target"]),
            arrivals=str(d["arrivals"]),
            seeds=tuple(int(s) for s in d["seeds"]),
            duration_s=float(d["duration_s"]),
            simulations=int(d["simulations"]),
        )


def run_length_s(throughputs: Sequence[float], requests: int = STATED_REQUESTS) -> float:
    """Simulated seconds per run so that the least-loaded model that is served sends about
    `requests` requests at its planned throughput, and all of them together at most
    MAX_RUN_REQUESTS_PER_MODEL times `requests` per model served."""
    served = [t for t in throughputs if t > 0]
    if not served:
        return MIN_DURATION_S
    least = requests / min(served)
    most = MAX_RUN_REQUESTS_PER_MODEL * requests * len(served) / sum(served)
    return min(MAX_DURATION_S, max(MIN_DURATION_S, min(least, most)))


def deliverable(
    topo: Topology,
    *,
    seeds: Sequence[int] = PLANNING_SEEDS,
    duration_s: float | None = None,
    requests: int = STATED_REQUESTS,
    step: float = STEP,
    target: float = ATTAINMENT_TARGET,
    data_plane: str = "reservation",
    near: Delivery | None = None,
    processes: int | None = None,
) -> Delivery:
    """Each model's deliverable rate on `topo`: its planned throughput times the largest
    load factor (all models at that factor, Poisson arrivals, `seeds` pooled, grid `step`) at
    which >= `target` of its requests finish on time. A model the plan does not serve
    delivers 0. `near`: a coarser measurement of the same plan, where the search starts.
    `processes`: how many the seeds of a point may run on (None: two where this process
    has two cores; the figures are the same)."""
    if not seeds:
        raise PoolpipeError("a deliverable search needs at least one seed")
    thr = [m.throughput for m in topo.models]
    duration = run_length_s(thr, requests) if duration_s is None else duration_s
    spec = ArrivalSpec("poisson")
    if any(t > 0 for t in thr):
        cap = search_capacity(
            topo,
            spec,
            duration_s=duration,
            seeds=seeds,
            data_plane=data_plane,
            method="bisect",
            step=step,
            target=target,
            around=None if near is None else dict(zip(near.models, near.load, strict=True)),
            processes=usable_cores() if processes is None else processes,
        )
        load = [
            cap.capacity[m.name] if t > 0 else 0.0 for m, t in zip(topo.models, thr, strict=True)
        ]
        sims = cap.simulations
    else:
        load, sims = [0.0] * len(thr), 0
    rates = [lf * t for lf, t in zip(load, thr, strict=True)]
    objective = min(
        (r / m.weight for r, m in zip(rates, topo.models, strict=True)), default=math.nan
    )
    return Delivery(
        models=tuple(m.name for m in topo.models),
        rates=tuple(rates),
        load=tuple(load),
        objective=objective,
        target=target,
        arrivals=spec.describe(),
        seeds=tuple(seeds),
        duration_s=duration,
        simulations=sims,
    )


def attainment_at(
    topo: Topology,
    rates: Sequence[float],
    *,
    seeds: Sequence[int] = PLANNING_SEEDS,
    duration_s: float | None = None,
    requests: int = STATED_REQUESTS,
) -> tuple[float, ...]:
    """Per model, the share of its requests on time with Poisson arrivals at `rates` (req/s
    per model, in `topo`'s order), `seeds` pooled: does the plan serve these rates?"""
    duration = run_length_s(rates, requests) if duration_s is None else duration_s
    spec = ArrivalSpec("poisson")
    runs = [
        run_once(topo, spec, 1.0, SimConfig(duration, seed=s), "reservation", rates) for s in seeds
    ]
    out = []
    for k in range(len(topo.models)):
        arrived = sum(r.models[k].arrived for r in runs)
        on_time = sum(r.models[k].on_time for r in runs)
        out.append(on_time / arrived if arrived else 1.0)
    return tuple(out)
