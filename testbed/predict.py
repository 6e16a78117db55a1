"""The simulator's prediction for what a live deployment serves: the router's calibrated
topology, its data plane, wake guard and reply margin, stage times drawn from what the
router measured, and the same node failures, returns and rollouts (a scenario). The demo
and the benchmarks put it beside what the clients measured."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from poolpipe.scheduler import DataPlane, make_data_plane
from poolpipe.scheduler.topology import Pool, Topology
from poolpipe.sim.apps import AppSimResult, run_apps
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import SimResult
from poolpipe.sim.scenario import Scenario
from triton_backend.deploy.deployment import Deployment


def predict(
    dep: Deployment,
    arrivals_s: np.ndarray,
    duration_s: float,
    stage_factors: Sequence[Sequence[float]] = (),
    models: np.ndarray | None = None,
    scenario: Scenario | None = None,
    topo: Topology | None = None,
    answer_delays: Sequence[Sequence[float]] = (),
) -> SimResult:
    """The simulator's result for these arrivals (seconds; model indexes, default all the
    first) on what `dep` serves: the router's calibrated topology (or `topo`, one taken
    from it earlier), the same data plane, wake guard and reply margin, stage times drawn
    from `stage_factors` (per pool, measured / latency as served, from
    `dep.take_stage_factors()` of earlier runs: factors_on), and the node failures,
    returns and rollouts of `scenario` (node names as the deployment's: `cpu-1t-0` is GPU
    0 of type cpu-1t); each batch answered later by one of `answer_delays` (per pool, µs,
    `dep.take_answer_delays()` of the same earlier runs: what the live data path added)."""
    topo = topo or dep.core.runtime.topo
    arrivals = np.asarray(arrivals_s, dtype=float)
    plane = _plane(dep)
    return Simulator(
        topo,
        plane(topo),
        arrivals * 1e6,
        np.zeros(len(arrivals), dtype=int) if models is None else models,
        _config(dep, topo, duration_s, stage_factors, answer_delays=answer_delays),
        scenario,
        plane,
    ).run()


def _plane(dep: Deployment) -> Callable[[Topology], DataPlane]:
    """The router's data plane (its kind and wake guard) for a topology."""
    kind, guard = dep.options.plane, dep.options.wake_guard_us
    return lambda t: make_data_plane(kind, t, wake_guard_us=guard)


def _config(
    dep: Deployment,
    topo: Topology,
    duration_s: float,
    stage_factors: Sequence[Sequence[float]],
    seed: int = 1,
    answer_delays: Sequence[Sequence[float]] = (),
) -> SimConfig:
    """The simulator set as the router's runtime on `topo`: its reply margin, and stage
    times drawn off reservation (`stage_factors`, by `seed`) recalibrating pools and
    feeding the overrun held back from held batches where the router recalibrates, and
    answers delayed as the router's were (`answer_delays`)."""
    return SimConfig(
        duration_s=duration_s,
        seed=seed,
        stage_factors=factors_on(stage_factors, dep.core.runtime.base_topo, topo),
        answer_delays=tuple(tuple(float(x) for x in f) for f in answer_delays),
        reply_margin_us=dep.core.runtime.reply_margin_us,
        recalibrate=dep.core.runtime.config.recalibrate,
    )


def factors_on(
    stage_factors: Sequence[Sequence[float]], base: Topology, topo: Topology
) -> tuple[tuple[float, ...], ...]:
    """Stage factors measured against the latencies as served (`base`: the router's
    `base_topo`) as factors of `topo`'s, the topology the simulator runs: a pool that
    recalibration had scaled by s in `topo` runs measured / (s x served), so its factors
    are divided by s. The simulator's stage takes `topo`'s latency times a factor drawn;
    factors taken after a live recalibration are then not counted against the old
    latencies (nor the recalibration twice, where `topo` is the router's after the run)."""
    out = []
    for p, f in enumerate(stage_factors):
        s = 1.0
        if p < len(base.pools) and p < len(topo.pools) and _same(base.pools[p], topo.pools[p]):
            was, now = base.pools[p].latency_us, topo.pools[p].latency_us
            k = next((i for i, x in enumerate(was) if x > 0), None)
            if k is not None and k < len(now) and now[k] > 0:
                s = now[k] / was[k]
        out.append(tuple(x / s for x in f))
    return tuple(out)


def _same(a: Pool, b: Pool) -> bool:
    """One pool of one plan in two topologies (not a pool of another plan rolled out)."""
    return (a.model, a.position, a.gpu, a.vgpus) == (b.model, b.position, b.gpu, b.vgpus)


def predict_apps(
    dep: Deployment,
    arrivals_s: np.ndarray,
    which: np.ndarray,
    duration_s: float,
    stage_factors: Sequence[Sequence[float]] = (),
    seed: int = 1,
    topo: Topology | None = None,
    answer_delays: Sequence[Sequence[float]] = (),
) -> AppSimResult:
    """The simulator's result for application requests arriving at `arrivals_s` (seconds;
    request i of the served application `which[i]`, in the router's order of them) on
    what `dep` serves, as `predict` for models: the router's calibrated topology, its
    applications' budgets (`dep.core.apps`), data plane, wake guard, reply margin and
    recalibration, stage times drawn from `stage_factors` (by `seed`), answers delayed by
    `answer_delays` (from the same runs); `topo`: the router's topology taken before the
    run the factors come from (it may recalibrate during it; the simulator then
    recalibrates as it did, from the same truth: factors_on)."""
    if dep.core.apps is None:
        raise ValueError("this deployment serves no application")
    topo = topo or dep.core.runtime.topo
    return run_apps(
        topo,
        dep.core.apps.served,
        np.asarray(arrivals_s, dtype=float) * 1e6,
        np.asarray(which, dtype=int),
        _config(dep, topo, duration_s, stage_factors, seed, answer_delays),
        _plane(dep),
    )
