"""Simulating applications (poolpipe.domain.apps) through the serving runtime: requests of
each application arrive at its rate, the runtime's application coordinator
(runtime/apps.py) makes their parts (fan-out draws, fan-in waits) and the simulated cluster
runs them, as the live router's would. The account is per application (each request
answered once: on time, late, dropped or failed) and per part model (the runtime's own
counters)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poolpipe.domain.apps import App, served_parts
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import PoolpipeError
from poolpipe.runtime.apps import AppCoordinator, AppRequest, ServedApp, served_app
from poolpipe.runtime.ports import DROPPED, FAILED, LATE, ON_TIME, Entry, Outcome
from poolpipe.scheduler import DataPlane, make_data_plane
from poolpipe.scheduler.topology import Topology, simulated_topology
from poolpipe.sim.arrivals import ArrivalSpec, generate
from poolpipe.sim.capacity import bisect_grid
from poolpipe.sim.deliverable import PLANNING_SEEDS, STATED_REQUESTS, STEP, run_length_s
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import ATTAINMENT_TARGET
from poolpipe.sim.scenario import Rollout, Scenario

_NAMES = {ON_TIME: "on_time", LATE: "late", DROPPED: "dropped", FAILED: "failed"}


@dataclass
class AppSimResult:
    """What a simulation of applications measured."""

    duration_s: float
    rates: dict[str, float]  # req/s offered per application
    apps: dict[str, dict[str, int]]  # per application: arrived, on_time, late, dropped, failed
    parts: dict[str, dict[str, int]]  # per part model: the runtime's counters
    parts_made: int
    wall_s: float
    reasons: dict[str, int] = field(default_factory=dict)  # why requests were dropped
    # per part model: its batches by their members' applications (BatchMembers.document)
    batches: dict[str, dict] = field(default_factory=dict)

    def attainment(self, app: str | None = None) -> float:
        """Share of requests answered on time (of one application, or of all)."""
        rows = [self.apps[app]] if app is not None else list(self.apps.values())
        arrived = sum(r["arrived"] for r in rows)
        return sum(r["on_time"] for r in rows) / arrived if arrived else 1.0


def _recorded(plan: Plan) -> dict:
    """The applications a plan records (planner.apps.app_plan_document); an error naming
    the fix for a plan of models alone."""
    recorded = plan.meta.get("apps")
    if not isinstance(recorded, dict):
        raise PoolpipeError(
            "this plan serves no application (no budgets recorded): plan it with poolpipe apps plan"
        )
    return recorded


def part_profiles(plan: Plan, profiles: Mapping[str, ModelProfile]) -> dict[str, ModelProfile]:
    """The profiles of an application plan's models (app.model) from those of the models
    (by their own names, as the warehouse holds them)."""
    from dataclasses import replace

    recorded = _recorded(plan)
    out = {}
    for app, rec in recorded.items():
        for m, served in served_parts(app, rec).items():
            if m not in profiles:
                raise PoolpipeError(f"application {app}: no profile for model {m}: profile it")
            out[served] = replace(profiles[m], name=served)
    return out


def served_apps(plan: Plan, apps: Sequence[App], model_names: Sequence[str]) -> list[ServedApp]:
    """The applications of an application plan (meta["apps"]: their budgets) as the
    runtime serves them, each model at its index among `model_names`."""
    recorded = _recorded(plan)
    known = set(model_names)
    out = []
    for a in apps:
        if a.name not in recorded:
            raise PoolpipeError(f"the plan has no application {a.name}: plan it with the others")
        budgets = recorded[a.name]["budgets_us"]
        parts = served_parts(a.name, recorded[a.name])
        where = {m: parts[m] for m in a.models if parts.get(m) in known}
        out.append(served_app(a, budgets, where))
    return out


def simulate_apps(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    apps: Sequence[App],
    rates: Mapping[str, float],
    config: SimConfig,
    arrivals: ArrivalSpec | None = None,
    data_plane: str = "reservation",
    scenario: Scenario | None = None,
) -> AppSimResult:
    """Simulate an application plan (planner.apps.app_plan_document; `profiles` under its
    model names) with each application's requests arriving at `rates[name]` req/s;
    `scenario`: GPUs failing and coming back on the virtual clock (rollouts of
    application plans are not simulated: refused)."""
    if scenario is not None and any(isinstance(e, Rollout) for e in scenario.events):
        raise PoolpipeError(
            "a scenario of applications may fail GPUs and bring them back; rolling out "
            "another application plan is not simulated yet: leave its rollout events out"
        )
    topo = simulated_topology(plan, profiles)
    served = served_apps(plan, apps, [m.name for m in topo.models])
    times, which = generate(
        arrivals or ArrivalSpec("poisson"),
        [rates[a.name] for a in apps],
        config.duration_s,
        config.seed,
        [a.name for a in apps],
    )
    result = run_apps(
        topo, served, times, which, config, lambda t: make_data_plane(data_plane, t), scenario
    )
    result.rates = {a.name: float(rates[a.name]) for a in apps}
    return result


def run_apps(
    topo: Topology,
    served: Sequence[ServedApp],
    arrival_us: np.ndarray,
    which: np.ndarray,
    config: SimConfig,
    make_plane: Callable[[Topology], DataPlane],
    scenario: Scenario | None = None,
) -> AppSimResult:
    """The applications `served` (their parts named as `topo`'s models) on `topo`, request
    i of application `served[which[i]]` arriving at `arrival_us[i]`: simulate_apps's loop,
    for a caller that has its own topology and trace (the live comparison: the router's
    calibrated topology and budgets, the trace its clients sent). Rates: as arrived."""
    wall0 = time.perf_counter()
    names = [m.name for m in topo.models]
    sim = Simulator(topo, make_plane(topo), arrival_us, which, config, scenario, make_plane)
    reasons: dict[str, int] = {}
    holder: list[AppCoordinator] = []

    index = {n: i for i, n in enumerate(names)}

    def answer(req: AppRequest, outcome: Outcome, reason: str) -> None:
        if reason:
            why = reason.split(": ", 1)[-1]
            reasons[why] = reasons.get(why, 0) + 1

    def start(rt: Any):
        def add(name: str, part: Any, slo_us: float, arrived_us: float) -> Any:
            return rt.add(index[name], part, slo_us, arrived_us)

        coord = AppCoordinator(
            list(served), sim.clock, add, rt.decide, answer, config.seed, keep_latencies=False
        )
        holder.append(coord)

        def part(entry: Entry, outcome: Outcome, reason: str) -> None:
            coord.part_ended(entry.payload, outcome, reason)

        sim.cluster.on_answer = part
        rt.on_batch(lambda model, parts: coord.batch(names[model], parts))

        def arrival(i: int) -> None:
            coord.arrive(int(which[i]), i)

        return arrival

    rt = sim.drive(start, busy=lambda: bool(holder) and holder[0].busy())
    stats = holder[0].stats
    apps = [a.name for a in served]
    counts = {
        a: {"arrived": stats[a].arrivals} | {n: getattr(stats[a], n) for n in _NAMES.values()}
        for a in apps
    }
    arrived = np.bincount(np.asarray(which, dtype=int), minlength=len(apps))
    return AppSimResult(
        config.duration_s,
        {a: float(arrived[i]) / config.duration_s for i, a in enumerate(apps)},
        counts,
        {n: rt.stats[n].counts() for n in names if n in rt.stats},
        holder[0].parts if holder else 0,
        time.perf_counter() - wall0,
        reasons,
        holder[0].members.document() if holder else {},
    )


@dataclass(frozen=True)
class AppDelivery:
    """What an application plan delivers: per application, the req/s it serves with >=
    `target` of its requests on time (every part of a request by the application's SLO)."""

    rates: dict[str, float]
    load: dict[str, float]  # the same as a share of the rate it was planned for
    objective: float  # min over applications of rate / weight
    seeds: tuple[int, ...]
    duration_s: float
    simulations: int


def app_deliverable(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    apps: Sequence[App],
    *,
    seeds: Sequence[int] = PLANNING_SEEDS,
    requests: int = STATED_REQUESTS,
    step: float = STEP,
) -> AppDelivery:
    """Each application's deliverable rate: its planned rate (plan.meta["apps_rates"]) times
    the largest load factor (all applications at that factor, Poisson arrivals, `seeds`
    pooled, grid `step`, capacity.bisect_grid) at which >= 99% of its requests are
    on time. `profiles` under the plan's model names (part_profiles)."""
    planned = plan.meta.get("apps_rates") or {}
    names = [a.name for a in apps]
    base = [float(planned.get(n, 0.0)) for n in names]
    duration = run_length_s(base, requests)
    top = round(1.0 / step)
    seen: dict[int, dict[str, float]] = {}

    def attainment(i: int) -> dict[str, float]:
        if i not in seen:
            lf = i * step
            rates = {n: lf * r for n, r in zip(names, base, strict=True)}
            seen[i] = (
                app_attainment_at(plan, profiles, apps, rates, seeds=seeds, duration_s=duration)
                if lf > 0
                else dict.fromkeys(names, 1.0)
            )
        return seen[i]

    load = {}
    for n, r in zip(names, base, strict=True):
        if r <= 0:
            load[n] = 0.0
            continue
        i = bisect_grid(attainment, n, top, ATTAINMENT_TARGET, seen)
        load[n] = round(i * step, 10)
    rates = {n: load[n] * r for n, r in zip(names, base, strict=True)}
    weight = {a.name: a.weight for a in apps}
    return AppDelivery(
        rates=rates,
        load=load,
        objective=min(rates[n] / weight[n] for n in names),
        seeds=tuple(seeds),
        duration_s=duration,
        simulations=len(seen) * len(seeds),
    )


def app_attainment_at(
    plan: Plan,
    profiles: Mapping[str, ModelProfile],
    apps: Sequence[App],
    rates: Mapping[str, float],
    *,
    seeds: Sequence[int] = PLANNING_SEEDS,
    requests: int = STATED_REQUESTS,
    duration_s: float | None = None,
) -> dict[str, float]:
    """Each application's share of requests on time by its SLO with every application at
    `rates[name]` req/s (Poisson, `seeds` pooled, runs as long as a stated figure's at
    these rates, or `duration_s`)."""
    names = [a.name for a in apps]
    duration = (
        run_length_s([float(rates[n]) for n in names], requests)
        if duration_s is None
        else duration_s
    )
    runs = [
        simulate_apps(plan, profiles, apps, rates, SimConfig(duration_s=duration, seed=s))
        for s in seeds
    ]
    return {n: _pooled_attainment(runs, n) for n in names}


def _pooled_attainment(runs: Sequence[AppSimResult], app: str) -> float:
    arrived = sum(r.apps[app]["arrived"] for r in runs)
    return sum(r.apps[app]["on_time"] for r in runs) / arrived if arrived else 1.0
