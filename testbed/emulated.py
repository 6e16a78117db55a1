"""The paper's models live on emulated GPUs (docs/design/emulation.md): shadows of the
profiled models onboarded from the shipped profiles (data/ppipe-gpu-group2), a clusters-file
preset as network namespaces with one emulated GPU node per GPU, a plan served there at
time scale D (the router sees the dilated plan: SLOs x D, NICs / D; the nodes stretch the
profiled latencies x D), and the live capacity of a model mix found beside the
simulator's. Every figure leaves here undilated (rates x D, times / D).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.inventory import dealt
from poolpipe.domain.plan import Plan, dilated
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import PoolpipeError
from poolpipe.store.warehouse import REPO_ROOT, Warehouse
from testbed.cpu import host_cpu_ticks, own_cpu_seconds
from testbed.loadgen import (
    CAPACITY_TARGET,
    Shot,
    bisect_grid,
    climb_ladder,
    drive_mix,
    further_loads,
    keeps_target,
    kept_rungs,
    ladder_gap,
    mix_times,
    nearest_to_mean,
    rate_passes,
)
from testbed.netns import EmulatedCluster
from testbed.predict import predict

GROUP2_DIR = REPO_ROOT / "data" / "ppipe-gpu-group2"
GROUP2 = ("colorization-v2", "googlenet-v3-pytorch", "repvgg-b3")
MAF19 = (0.30, 0.33, 0.37)
# Capacity grid of a mix: 1/32 of the top rate (ppipe's plan; 15.5 req/s on hc2-small). At
# 1/16 one step was a quarter of the live capacity there (live 93 against simulated 124).
MIX_STEPS = 32
# A rate that fails narrowly is driven up to this many traces more (loadgen.rate_passes;
# two made the main job 6 min 8 s, over its 6 minutes).
EXTRA_TRACES = 1
# The arrival pattern of a rate's first trace (its seed; the k-th trace's + 1000 k).
PATTERN_SEED = 200
# Patterns a comparison on a ladder chooses its typical one from (typical_pattern).
TYPICAL_PATTERNS = 64
# Warm-up traces at most before a capacity search (while the router still recalibrates).
WARM_UP_TRACES = 3
# A live search starts at the simulator's figure after the warm-up (mix_capacity `guide`)
# only within this many grid steps of the rate it warmed up at: in one main job of three it
# put ppipe at 334 req/s, live 223, and galloping down from there took ten traces.
GUIDE_STEPS = 3
# A live rate that failed with more than this share of its emulated stages ended late by
# the host (the nodes' own count) failed on the host, not on the plan.
HOST_LATE_SHARE = 0.05
# ... or with more than this share of the host's CPU time busy (all its cores).
HOST_BUSY_SHARE = 0.9
# The router's and the nodes' CPU with nothing sent is sampled this long (wall s) after
# each plan's search, a second after its last request: what a request costs is what the
# traces used beyond it (sleeping is idle; polling, sweeps and stats are not).
IDLE_S = 5.0


def onboard_shadows(
    warehouse: str, models=GROUP2, profiles: Path = GROUP2_DIR, devices=("L4", "T4")
) -> list[str]:
    """Onboard the shadow of each of `models` the warehouse cannot serve yet with these
    devices' tables (no block files: not onboarded, or imported profiles only; or tables
    missing) by the flow onboard-shadow; returns those onboarded now."""
    from flows.shadow import onboard_shadow

    with Warehouse.open(warehouse) as wh:
        known = set(wh.model_names())

        def ready(m: str) -> bool:
            if m not in known or wh.whole_model_file(m) is None:
                return False
            profile = wh.load_profile(m)
            # (input_bytes: None where onboarded before input sizes were kept)
            return set(devices) <= {g for g, _ in profile.tables} and (
                profile.input_bytes is not None
            )

        todo = [m for m in models if not ready(m)]
    for m in todo:
        onboard_shadow(m, str(profiles), warehouse=warehouse, devices=list(devices))
    return todo


def group2_inputs(
    warehouse: str | Path | None, cluster: str
) -> tuple[str, dict[str, ModelProfile], Cluster]:
    """Group 2's shadows onboarded in `warehouse` (None: the default one; onboard_shadows):
    the warehouse's path, their profiles by name and `cluster` (the warehouse's, else group
    2's clusters file): what a live run of group 2 on emulated GPUs plans from."""
    from poolpipe.store.plan_inputs import resolve_cluster

    with Warehouse.open(warehouse) as wh:
        path = str(wh.path)
    onboard_shadows(path)
    with Warehouse.open(path) as wh:
        profiles = {m: wh.load_profile(m) for m in GROUP2}
        return path, profiles, resolve_cluster(wh, cluster, GROUP2_DIR / "clusters.toml")


def group_plans(
    warehouse: str,
    cluster: str,
    models=GROUP2,
    weights=MAF19,
    clusters_file=None,
    count_inputs: bool = True,
    search_margins: tuple[float, ...] = (),
) -> dict[str, tuple[Plan, int]]:
    """The ppipe and np plans of `models` at the paper's SLOs (5x reference) on `cluster`
    (stored; with their ids), each request's inputs counted on its first server's NIC
    (`count_inputs`: served live, they cross it; the paper's model leaves them out), also
    planned at `search_margins` (PlanRequest.search_margins)."""
    from poolpipe.planner import make_plan
    from poolpipe.store.plan_inputs import plan_request

    out = {}
    with Warehouse.open(warehouse) as wh:
        req = plan_request(
            wh,
            list(models),
            cluster,
            clusters_file=clusters_file or GROUP2_DIR / "clusters.toml",
            weights=list(weights),
            slo_scale=5.0,
            count_inputs=count_inputs,
            search_margins=tuple(search_margins),
        )
        for strategy in ("ppipe", "np"):
            plan = make_plan(replace(req, strategy=strategy))
            out[strategy] = (plan, wh.store_plan(plan, label=f"emulated:{strategy}"))
    return out


@dataclass
class MixLoad:
    """What a client sends to a served model mix: one request per model, its weight and
    its (dilated) SLO."""

    url: str
    requests: list[tuple[str, dict[str, np.ndarray]]]
    weights: list[float]
    slos_s: list[float]
    sent: int = 0  # requests sent so far

    @classmethod
    def of(cls, dep, weights: dict[str, float]) -> MixLoad:
        requests, slos = [], []
        for io in dep.ios:
            x = np.random.default_rng(0).standard_normal((1, *io.inputs[0].dims))
            requests.append((io.name, {io.inputs[0].name: x.astype(io.inputs[0].dtype)}))
            topo = dep.core.runtime.topo
            slos.append(topo.models[topo.model_index(io.name)].slo_us / 1e6)
        return cls(dep.grpc_url, requests, [weights[io.name] for io in dep.ios], slos)

    def send(self, rate: float, duration_s: float, seed: int) -> tuple[np.ndarray, list[Shot]]:
        """Drive `rate` (dilated req/s) for `duration_s`: (the send times, the shots)."""
        times, which = mix_times(rate, self.weights, duration_s, seed)
        return times, self.drive(times, which)

    def drive(self, times: np.ndarray, which: np.ndarray) -> list[Shot]:
        """Drive the given arrivals (dilated s), request k of model `which[k]`: the shots."""
        self.sent += len(times)
        return drive_mix(self.url, self.requests, times, which)

    def on_time(self, shot: Shot) -> bool:
        return shot.outcome == "ok" and shot.latency_s <= self.slos_s[shot.model]

    def share_on_time(self, shots: list[Shot], sent: int | None = None) -> float:
        n = len(shots) if sent is None else sent
        return sum(map(self.on_time, shots)) / n if n else float("nan")

    def run(self, rate: float, duration_s: float, seed: int) -> float:
        """Drive `rate` (dilated req/s) for `duration_s`: the share on time."""
        return self.run_times(*mix_times(rate, self.weights, duration_s, seed))

    def run_times(self, times: np.ndarray, which: np.ndarray) -> float:
        """Drive the given arrivals (MixLoad.drive): the share on time."""
        shots = self.drive(times, which)
        return self.share_on_time(shots, len(times)) if len(times) else 1.0


def mix_capacity(
    dep,
    load: MixLoad,
    top: float,
    duration_s: float,
    traces: int = 2,
    on_point: Callable[[str, float, float], None] = lambda kind, rate, att: None,
    steps: int = MIX_STEPS,
    stages: Callable[[], tuple[float, float]] | None = None,
    extra: int = EXTRA_TRACES,
    cpu: Callable[[], dict[str, float]] | None = None,
    start: float | None = None,
    warm_up_s: float | None = None,
    guide: bool = False,
    ladder: tuple[int, ...] = (),
    beyond: int = 0,
    pattern: int = PATTERN_SEED,
) -> dict:
    """Live and simulated capacity (dilated req/s) of the mix `dep` serves: the highest multiple
    of top/`steps` at which `traces` Poisson traces keep >= CAPACITY_TARGET of their requests on
    time together (the k-th trace of every rate one pattern scaled to it,
    loadgen.scaled_poisson_times: with a trace of its own each, 279 req/s failed in every
    main-job run that drove it while 301 passed in some; loadgen.rate_passes; a narrow failure
    judged again with up to `extra` traces more), bisected (loadgen.bisect_grid), live first
    (from the grid rate nearest `start`, a quarter of `top` without it, after a warm-up there of
    traces of `warm_up_s` (`duration_s` without it) until the router stops recalibrating: also
    for a plan rolled out under load), then the simulator on the same traces, drawing each
    pool's stage times from those measured live at the same rate (the nearest rate run live
    where it was not): on the emulated GPUs a stage's time includes what the host adds to it and
    its inputs' slips on the server's NIC (the data plane reserves each batch's inputs on its
    first server's downlink, but a transfer that slipped shares the NIC with the next one),
    which grow with the load, so stage times from one load misrepresent another. Stage times
    measured far beyond a plan's capacity made the simulator miss at light loads; those measured
    at light loads know nothing of the queues near capacity. `stages`: the nodes' (on time,
    late) emulated stages so far (EmulatedCluster.emulated_stages), for the share the host made
    late at each live rate ("host_late"), beside the share of the host's CPU time that was busy
    ("host_cpu"): "host_bound" where the first rate above the live capacity failed with more
    than HOST_LATE_SHARE of its stages late or more than HOST_BUSY_SHARE of the CPU busy (the
    host's limit, not the plan's: the router, the nodes and the clients share its cores).
    `guide`: the live search starts where the simulator finds the capacity with the stage
    times and delays of the last warm-up trace ("guide": the step it started at), not at
    `start` (there the warm-up is run), where that is within GUIDE_STEPS of it: each live
    rate costs a trace or two, the simulator's none.
    `ladder`: grid steps driven live each, in turn, instead of a search (and simulated on the
    same traces): the live capacity is the highest of them kept, the loads judged together
    (testbed.loadgen.kept_rungs: shares that cannot rise with the load; "capped": all
    kept), each load's share on time in "points" beside the other plan's
    at the same loads. Near a plan's capacity its share on time can stay within a point of
    99% over several grid steps (ppipe on hc2-small: 0.989-0.993 from 212 to 245 req/s),
    where a search's answer moves by steps from run to run and its traces by minutes.
    `beyond`: loads past the ladder driven, one at a time, while every load so far is kept
    (the gap between the ladder's top two apart), so that a plan's figure is not the
    ladder's top where it keeps more; "ladder" then holds them too. The first load not kept
    is driven the next trace of its pattern where it failed narrowly (climb_ladder `again`),
    and the simulator runs every trace driven live. "sim_ladder": the simulator's figure
    judged as live's, on the same loads and traces ("sim_ladder_capped": it kept all);
    "sim" is still searched on the grid, a load of the ladder judged as there.
    `pattern`: the seed of the first trace's arrival pattern (the k-th: + 1000 k).
    "live_requests" and "live_interval": the requests the live capacity was judged on and a 95%
    interval of their share on time (Wilson). `cpu`: CPU seconds so far by part
    (CpuMeter.sample), summed over the live traces alone into "live_cpu_s", beside their wall
    seconds ("live_wall_s") and requests ("live_sent"): the simulator's searches run in the
    router's process and count for nothing there."""
    first = steps // 4 if start is None else max(1, min(steps, round(start * steps / top)))
    # Warm-up at the first rate judged, until a trace leaves the router's latencies as they
    # were (recalibration rescales pools by a tenth or more in their first stage calls
    # under load: a rate judged meanwhile is judged on latencies no longer served). Warmed
    # up at a quarter of `top` and judged from the plan's stated rate, ppipe's first trace
    # there lost 3.4% of its requests in one run of five (the search ended at 190 req/s
    # against 268-301 in the others).
    for k in range(WARM_UP_TRACES):
        before = dep.core.recalibrations()
        dep.core.take_stage_factors()
        dep.core.take_answer_delays()
        load.run(first * top / steps, warm_up_s or duration_s, seed=k)
        if dep.core.recalibrations() == before:
            break
    warm = dep.core.take_stage_factors(), dep.core.take_answer_delays()  # the last trace's
    points: dict[str, dict[float, float]] = {"live": {}, "sim": {}, "guide": {}}
    judged: dict[str, dict[float, int]] = {"live": {}, "sim": {}, "guide": {}}
    measured: dict[int, list[list[float]]] = {}  # grid step -> per pool, live
    delays: dict[int, list[list[float]]] = {}  # grid step -> answer delays per pool, live
    live_cpu: dict[str, float] = {}
    live_wall = [0.0, 0]  # wall seconds and requests of the live traces

    drawn: dict[float, int] = {}  # rate -> live traces driven there
    host_sums: dict[float, list[float]] = {}  # rate -> CPU busy, total ticks; stages on, late

    def passes(kind: str, i: int, ks: Sequence[int] = ()) -> bool:
        """Whether rate i keeps the target (rate_passes), or, given `ks`, those traces
        of it judged with the ones of this kind driven there before."""
        rate = i * top / steps
        count = 0
        live = kind == "live"
        ticks = host_cpu_ticks() if live else None
        before = stages() if live and stages is not None else None

        def trace(k: int) -> tuple[float, int]:
            nonlocal count
            seed = pattern + 1000 * k  # the k-th trace of every rate: one pattern, scaled
            if live:
                drawn[rate] = max(drawn.get(rate, 0), k + 1)
            times, which = mix_times(rate, load.weights, duration_s, seed, scaled=True)
            if kind != "live":
                near = min(measured, key=lambda j: (abs(j - i), j))
                got = predict(
                    dep, times, duration_s, measured[near], models=which, answer_delays=delays[near]
                ).attainment
            else:
                c0, w0 = (cpu() if cpu is not None else {}), time.perf_counter()
                got = load.run_times(times, which)  # the arrivals the simulator gets too
                live_wall[0] += time.perf_counter() - w0
                live_wall[1] += len(times)
                for part, v in (cpu() if cpu is not None else {}).items():
                    live_cpu[part] = live_cpu.get(part, 0.0) + v - c0[part]
                for kept, taken in (
                    (measured, dep.core.take_stage_factors()),
                    (delays, dep.core.take_answer_delays()),
                ):
                    mine = kept.setdefault(i, [[] for _ in taken])
                    for pool, f in zip(mine, taken, strict=True):
                        pool.extend(f)
            if kind != "guide":
                on_point(kind, rate, got)
            count += len(times)
            return got, len(times)

        if ks:  # more traces of a rate judged before: pooled with them
            before_n = judged[kind].get(rate, 0)
            on = points[kind].get(rate, 1.0) * before_n
            for k in ks:
                share, n = trace(k)
                on += share * n
            ok = keeps_target(before_n + count - on, before_n + count)
            points[kind][rate] = on / max(1, before_n + count)
            judged[kind][rate] = before_n + count
        else:
            ok, points[kind][rate] = rate_passes(traces, trace, extra)
            judged[kind][rate] = count
        if ticks is not None:  # live: the host's CPU and late stages, over all its traces
            sums = host_sums.setdefault(rate, [0.0] * 4)
            busy, total = (a - b for a, b in zip(host_cpu_ticks(), ticks, strict=True))
            sums[0] += busy
            sums[1] += total
            if before is not None and stages is not None:  # (stages: for the type checker)
                on, late = (a - b for a, b in zip(stages(), before, strict=True))
                sums[2] += on
                sums[3] += late
        return ok

    if guide:  # the simulator with the warm-up's stage times and delays: where to start
        measured[first] = [list(f) for f in warm[0]]
        delays[first] = [list(f) for f in warm[1]]
        guided = bisect_grid(lambda i: passes("guide", i), steps, first)
        if abs(guided - first) <= GUIDE_STEPS:
            first = guided
        measured.clear()
        delays.clear()
    rungs = sorted(set(ladder))
    if rungs:  # every load of the ladder live, the capacity the highest kept (kept_rungs)

        def drive(i: int, more: bool = False) -> tuple[float, int]:
            rate = i * top / steps
            passes("live", i, ks=(drawn[rate],) if more else ())
            return points["live"][rate], judged["live"][rate]

        rungs, fell = climb_ladder(rungs, drive, beyond, steps, again=partial(drive, more=True))
        found = {"live": rungs[fell - 1] if fell else 0}
        capped = fell == len(rungs)
        above = rungs[fell] * top / steps if not capped else -1.0  # -1: none
        on_rungs = {  # the simulator at each, on the same traces
            i: passes("sim", i, ks=range(drawn[i * top / steps])) for i in rungs
        }
        # judged as live was: the simulated figure on the same loads
        kept_sim = kept_rungs(
            [points["sim"][i * top / steps] for i in rungs],
            [judged["sim"][i * top / steps] for i in rungs],
        )
        found["sim_ladder"] = rungs[kept_sim - 1] if kept_sim else 0
        sim_capped = kept_sim == len(rungs)
    else:
        found = {"live": bisect_grid(lambda i: passes("live", i), steps, first)}
        capped = found["live"] == steps
        above = (found["live"] + 1) * top / steps
        on_rungs = {}
        sim_capped = False
    found["sim"] = bisect_grid(  # a load of the ladder as judged there, on the same traces
        lambda i: on_rungs[i] if i in on_rungs else passes("sim", i), steps, guess=found["live"]
    )
    live = found["live"] * top / steps
    n = judged["live"].get(live, 0)
    host_cpu = {
        r: busy / total if total > 0 else 0.0 for r, (busy, total, _, _) in host_sums.items()
    }
    host_late = (
        {
            r: late / (on + late) if on + late > 0 else 0.0
            for r, (_, _, on, late) in host_sums.items()
        }
        if stages is not None
        else {}
    )
    return {
        "top": top,
        "guide": first * top / steps,
        "ladder": [i * top / steps for i in rungs],  # dilated req/s
        "above": above if above >= 0 else None,  # the rate above the live capacity driven
        "sim": found["sim"] * top / steps,
        "live": live,
        "sim_capped": found["sim"] == steps,
        # on a ladder: the simulator's figure judged as live's, on the same loads and traces
        # (None: searched live); "sim_ladder_capped": it kept every one
        "sim_ladder": found["sim_ladder"] * top / steps if rungs else None,
        "sim_ladder_capped": bool(rungs) and sim_capped,
        "capped": capped,
        "step": top / steps,
        "points": points,
        "requests": judged,
        "live_requests": n,
        "live_interval": wilson(points["live"].get(live, 1.0), n),
        "host_late": host_late,
        "host_late_above": host_late.get(above),  # None: not driven (capped, or no count)
        "host_cpu": host_cpu,
        "host_cpu_above": host_cpu.get(above),
        "host_bound": host_late.get(above, 0.0) > HOST_LATE_SHARE
        or host_cpu.get(above, 0.0) > HOST_BUSY_SHARE,
        "live_cpu_s": live_cpu,
        "live_wall_s": live_wall[0],
        "live_sent": live_wall[1],
    }


def ladder_steps(stated: list[float | None], top: float, steps: int = MIX_STEPS) -> tuple[int, ...]:
    """The loads both plans are driven at in a comparison without searches (compare_plans
    `ladder`), as steps of a grid of `top` / `steps`: the lowest and the highest of the
    rates the plans state they deliver and the step between them (none where a plan states
    nothing)."""
    known = [x for x in stated if x is not None]
    if not known or len(known) < len(stated):
        return ()
    lo, hi = (max(1, min(steps, round(x * steps / top))) for x in (min(known), max(known)))
    return tuple(sorted({lo, (lo + hi + 1) // 2, hi}))


def simulated_share(
    topo,
    weights: Sequence[float],
    rate: float,
    duration_s: float,
    seed: int,
    lead_s: float = 0.0,
    plane: str = "reservation",
) -> tuple[int, int]:
    """(on time, judged) of a trace of `lead_s` + `duration_s` s at `rate` (undilated
    req/s; the arrival pattern `seed` scaled to it, mix_times, model k at `weights[k]`, the
    topology's order) in the simulator (data plane `plane`, stage times as profiled, no
    host delays), requests arriving in the first `lead_s` s not judged."""
    from poolpipe.runtime import ON_TIME
    from poolpipe.scheduler import make_data_plane
    from poolpipe.sim import SimConfig, Simulator

    times, which = mix_times(rate, list(weights), lead_s + duration_s, seed, scaled=True)
    sim = Simulator(
        topo, make_data_plane(plane, topo), times * 1e6, which,
        SimConfig(lead_s + duration_s, seed=1), None,
    )  # fmt: skip
    sim.run()
    judged = np.asarray(sim.arrival_us) >= lead_s * 1e6
    return int((np.asarray(sim.outcome)[judged] == ON_TIME).sum()), int(judged.sum())


def typical_pattern(
    plans: dict[str, tuple[Plan, int]],
    profiles: dict[str, ModelProfile],
    weights: dict[str, float],
    rates: Sequence[float],
    duration_s: float,
    candidates: int = TYPICAL_PATTERNS,
    plane: str = "reservation",
) -> dict:
    """The arrival pattern a comparison on one short trace a load is judged on: of
    `candidates` patterns (seeds PATTERN_SEED + 1000 c, bench-trace-length's), the one whose
    simulated shares on time (simulated_share, `duration_s` from idle) at every one of
    `rates` (undilated req/s) for every plan lie nearest their means over the candidates
    (loadgen.nearest_to_mean). On 1.25 s a load one pattern's share spreads over points
    around the mean, which does not move with the trace's length (`./run bench-trace-length
    --parts shares`): one pattern drawn once stood for whatever it favoured in every run
    (PATTERN_SEED on hc2-small: np kept 212 req/s, 259 of 261 on time, where the mean of
    64 patterns is 0.987; with the host's delays ppipe missed 279, which 59 of 64 keep).
    Returns "seed",
    "candidates", and per plan and rate the chosen pattern's share ("shares"), the mean
    ("mean") and the patterns that keep CAPACITY_TARGET ("kept")."""
    from poolpipe.scheduler.topology import simulated_topology

    seeds = [PATTERN_SEED + 1000 * c for c in range(max(1, candidates))]
    got: dict[str, dict[float, dict[int, tuple[int, int]]]] = {}
    for strategy, (plan, _) in plans.items():
        topo = simulated_topology(plan, profiles)
        w = [weights[m.name] for m in topo.models]
        got[strategy] = {
            r: {s: simulated_share(topo, w, r, duration_s, s, plane=plane) for s in seeds}
            for r in rates
        }
    vectors: dict[int, list[float]] = {s: [] for s in seeds}  # every plan's, every rate's
    for by_rate in got.values():
        for by_seed in by_rate.values():
            for s, (on, n) in by_seed.items():
                vectors[s].append(on / max(1, n))
    seed = nearest_to_mean(vectors)

    def per(f) -> dict[str, dict[float, float]]:
        return {k: {r: f(v) for r, v in by_rate.items()} for k, by_rate in got.items()}

    return {
        "seed": seed,
        "candidates": len(seeds),
        "shares": per(lambda v: v[seed][0] / max(1, v[seed][1])),
        "mean": per(lambda v: float(np.mean([on / max(1, n) for on, n in v.values()]))),
        "kept": per(lambda v: sum(keeps_target(n - on, n) for on, n in v.values())),
    }


def pattern_text(chosen: dict) -> str:
    """What typical_pattern chose, for a person: the pattern and, at each plan's loads
    nearest 99%, its simulated share beside the mean over the candidates."""
    cells = []
    for strategy, by_rate in chosen["shares"].items():
        mean = chosen["mean"][strategy]
        edge = sorted(by_rate, key=lambda r: abs(mean[r] - CAPACITY_TARGET))[:2]
        cells.append(
            f"{strategy} "
            + ", ".join(f"{by_rate[r]:.3f} (mean {mean[r]:.3f}) at {r:.0f}" for r in sorted(edge))
        )
    return (
        f"the arrival pattern both plans are driven with: of {chosen['candidates']} drawn, the "
        f"one whose simulated shares on time at these loads lie nearest their means (seed "
        f"{chosen['seed']}; {'; '.join(cells)} req/s): a short trace a load stands for the "
        "mean, not for one plan's harsh case and the other's kind one"
    )


def traces_text(n: int) -> str:
    """'one trace' or 'n traces'."""
    return "one trace" if n == 1 else f"{n} traces"


def host_above(r: dict) -> str:
    """At the rate above a plan's live capacity: the share of emulated stages the host
    made late and of the host's CPU time busy, and whether that makes the run host-bound
    (testbed.emulated.mix_capacity)."""
    if r["host_cpu_above"] is None:
        return "- (capped)"
    late = "-" if r["host_late_above"] is None else f"{r['host_late_above']:.1%}"
    bound = " host-bound" if r["host_bound"] else ""
    return f"{late}, {r['host_cpu_above']:.0%}{bound}"


def judged_text(r: dict) -> str:
    """The share on time a plan's live capacity was judged on (mix_capacity's figures), its
    95% interval and the requests behind it: "0.992 (0.986-0.996, 1283)"; "-" where it kept
    no rate."""
    if not r["live"]:
        return "-"
    lo, hi = r["live_interval"]
    share = r["points"]["live"][r["live"]]
    return f"{share:.3f} ({lo:.3f}-{hi:.3f}, {r['live_requests']})"


def wilson(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a share observed in `n` requests;
    (0, 1) without any."""
    if n <= 0:
        return 0.0, 1.0
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * ((share * (1 - share) + z * z / (4 * n)) / n) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def attainment_at(dep, load: MixLoad, rates, duration_s: float, seed: int = 500):
    """Share on time live and simulated (on the same trace, stage times from those the
    live run measured: see mix_capacity) at each of `rates` (dilated req/s): [(rate, live,
    simulated)]."""
    out = []
    for k, rate in enumerate(rates):
        times, which = mix_times(rate, load.weights, duration_s, seed + k)
        dep.core.take_stage_factors()
        dep.core.take_answer_delays()
        topo = dep.core.runtime.topo  # as the run begins: the router may recalibrate during it
        live = load.run(rate, duration_s, seed + k)
        factors = [list(f) for f in dep.core.take_stage_factors()]
        late = dep.core.take_answer_delays()
        sim = predict(
            dep, times, duration_s, factors, models=which, topo=topo, answer_delays=late
        ).attainment
        out.append((rate, live, sim))
    return out


@contextlib.contextmanager
def emulated_nodes(
    cluster,
    workspace: Path,
    time_scale: float,
    token_file: Path,
    node_per_server: bool = False,
    link_scale: tuple[float, float] = (1.0, 1.0),
):
    """`cluster` (a preset) as namespaces, an emulated GPU node per GPU at `time_scale`,
    named <GPU>-<i> as a plan's layout names them (GPU i of a type on the type's server
    i mod servers, as the layout deals them and the inventory assigns them:
    Inventory.gpus_by_device; `node_per_server`: a node per server serving its GPUs, named
    <GPU>-s<i>, its GPUs <GPU>-s<i>/gpu<j>), the NICs shaped at `link_scale` (uplink,
    downlink) times the cluster's bandwidth; yields the EmulatedCluster."""
    with EmulatedCluster.from_cluster(
        cluster, workspace, time_scale, node_per_server, link_scale
    ) as em:
        names: dict[int, str] = {}
        for gpu in dict.fromkeys(em.devices):
            slots = [k for k, device in enumerate(em.devices) if device == gpu]
            if node_per_server:  # (one slot per server, in server order)
                names.update({k: f"{gpu}-s{i}" for i, k in enumerate(slots)})
                continue
            in_turn = dealt(slots, lambda k: em.nodes[k].server)  # as the inventory deals
            names.update({k: f"{gpu}-{i}" for i, k in enumerate(in_turn)})
        for k, gpu in enumerate(em.devices):
            em.start_node(
                k, gpu, name=names[k], wait=False,
                token_file=token_file, emulate=True, time_scale=time_scale,
            )  # fmt: skip
        for k in range(len(em.nodes)):
            em.wait_node(k, 300)
        yield em


def serve_dilated(plan: Plan, plan_id: int, warehouse: str, workspace: Path, d: float, **kw):
    """A ServingProcess of `plan` dilated by `d` (what the router plans deadlines by)."""
    from triton_backend.deploy.serving import ServingProcess

    return ServingProcess(
        dilated(plan, d),
        warehouse,
        workspace,
        plan_id=plan_id,
        stats_interval_s=3600,
        metrics_port=0,
        **kw,
    )


def rollout_under_load(
    server, plan: Plan, plan_id: int, load: MixLoad, rate: float, duration_s: float, seed=99
) -> dict:
    """Steady mix load at `rate` (dilated req/s) for `duration_s`; `plan` (served as given:
    dilate it first) rolled out from a quarter of the run. The share on time before the
    rollout, while the new models load and are calibrated (the old plan serving), after the
    switch, and per twentieth of the run (`timeline`: (start s, share))."""
    result: dict = {}
    start = duration_s / 4

    def roll() -> None:
        time.sleep(start)
        result["r"] = server.rollout(plan, plan_id)

    t = threading.Thread(target=roll, name="rollout")
    t.start()
    times, shots = load.send(rate, duration_s, seed)
    t.join()
    r = result["r"]
    switch = start + r.prepare_s
    sent_at = np.asarray(times)

    def share(a: float, b: float) -> float:
        """On time of the requests sent in [a, b), of all sent then."""
        mine = [s for s in shots if a <= s.sent_s < b]
        return load.share_on_time(mine, int(((sent_at >= a) & (sent_at < b)).sum()))

    phases = {"before": (0.0, start), "preparing": (start, switch), "after": (switch, duration_s)}
    width = duration_s / 20
    timeline = [(k * width, share(k * width, (k + 1) * width)) for k in range(20)]
    return {
        "status": r.status,
        "reason": r.reason,
        "rate": rate,
        "start_s": start,
        "prepare_s": r.prepare_s,
        "downtime_ms": r.downtime_ms,
        "held": r.held,
        "failed": r.failed + sum(1 for s in shots if s.outcome in ("failed", "error")),
        "sent": len(times),
        "unanswered": len(times) - len(shots),
        "attainment": {key: share(a, b) for key, (a, b) in phases.items()},
        "timeline": timeline,
    }


def _cpu_s(pids) -> float:
    return sum(own_cpu_seconds(pid) or 0.0 for pid in pids)


def idle_cores(meter: CpuMeter, seconds: float = IDLE_S) -> dict[str, float]:
    """Cores the router, the nodes and the client thread use with nothing sent (CPU s per
    wall s over `seconds`, after a second for what was in flight to end)."""
    time.sleep(1.0)
    a, t = meter.sample(), time.perf_counter()
    time.sleep(seconds)
    b, wall = meter.sample(), time.perf_counter() - t
    return {k: (b[k] - a[k]) / wall for k in a}


class CpuMeter:
    """CPU seconds so far of the router (this process but its calling thread, which runs
    the clients and the simulator, and the router's own tritonserver and stubs) and of the
    emulated cluster's nodes (each `poolpipe node` and everything below it). Sample from
    the thread that drives the load. Processes are found by their parents
    (nodes.descendants), not by testbed.cpu.cpu_seconds's walk of /proc/<pid>/task/<pid>/
    children, which lists a process's main thread's children only: the router's Triton
    and the nodes' are started from other threads."""

    def __init__(self, em: EmulatedCluster):
        self.em = em

    def sample(self) -> dict[str, float]:
        from triton_backend.node.triton import descendants

        nodes: set[int] = set()
        for s in self.em.nodes:
            if s.node is not None:
                nodes |= {s.node.pid, *(p for p, _ in descendants(s.node.pid))}
        router = [p for p, _ in descendants(os.getpid()) if p not in nodes]
        t = os.times()
        client = time.thread_time()
        return {
            "router": t.user + t.system - client + _cpu_s(router),
            "nodes": _cpu_s(nodes),
            "client": client,
        }


def compare_plans(
    plans: dict[str, tuple[Plan, int]],
    warehouse: str,
    em: EmulatedCluster,
    workspace: Path,
    d: float,
    weights: dict[str, float],
    duration_s: float,
    *,
    token: str,
    transport: str = "router",
    plane: str = "reservation",
    rollout_share: float = 0.25,
    loads: tuple[float, ...] = (),
    traces: int = 2,
    rollout_s: float | None = None,
    warm_up_s: float | None = None,
    guide: bool = False,
    ladder: bool = False,
    beyond: int = 0,
    typical: int = 0,
    on_point: Callable[[str, str, float, float], None] = lambda plan, kind, rate, att: None,
    on_step: Callable[[str], None] = lambda text: None,
) -> dict:
    """ppipe served on the emulated nodes `em` at time scale `d`, its capacity found live
    and simulated (mix_capacity, `weights` by model, `traces` of `duration_s` a rate, warmed
    up with traces of `warm_up_s`, its live search from the simulator's figure where
    `guide`; where `ladder`, no live search but the same loads for both plans, ladder_steps,
    and up to `beyond` more for a plan that keeps every one);
    then np rolled out under a steady load of
    `rollout_share` x ppipe's live capacity for `rollout_s` (3 x `duration_s` without it),
    and its capacity found the same way.
    Rates are dilated. Per plan: mix_capacity's figures, "planned", "ready_s" (wall s to
    serve), "cpu_us" (router / nodes / client CPU µs per request sent in the live search's
    traces, idle time included, the simulator's not), "cores" (their CPU seconds per wall
    second of those traces), "idle_cores" (the same with nothing sent, idle_cores) and
    "cpu_us_above_idle" (CPU µs per request beyond the idle cores over the traces' wall
    time: what serving a request costs, comparable across cluster sizes); "rollout":
    rollout_under_load's figures; "transport": the one used; `plane`: the router's data
    plane (scheduler.DATA_PLANES; the simulator drives the same). `loads`: fractions of each
    plan's live capacity at which to compare live and simulated attainment ("loads":
    attainment_at). `typical`: on a ladder, both plans' traces of the typical one of so
    many arrival patterns (typical_pattern, at the ladder's loads and those `beyond`;
    "pattern" its figures), else of PATTERN_SEED."""
    top = plans["ppipe"][0].objective / d  # both plans on one grid: ppipe's plan rate
    stated = [p.deliverable for p, _ in plans.values()]
    rungs = ladder_steps(stated, plans["ppipe"][0].objective) if ladder else ()
    pattern = PATTERN_SEED
    out: dict = {}
    if rungs and typical:
        steps = [*rungs, *further_loads(rungs, beyond, MIX_STEPS)]
        from poolpipe.store.plan_inputs import served_profiles

        with Warehouse.open(warehouse) as wh:
            profiles = {
                n: p for plan, _ in plans.values() for n, p in served_profiles(wh, plan).items()
            }
        out["pattern"] = typical_pattern(
            plans, profiles, weights,
            [i * top * d / MIX_STEPS for i in steps],
            duration_s / d, candidates=typical, plane=plane,
        )  # fmt: skip
        pattern = out["pattern"]["seed"]
        on_step(pattern_text(out["pattern"]))
    roll_s = 3 * duration_s if rollout_s is None else rollout_s
    meter = CpuMeter(em)
    server = None
    try:
        for strategy in ("ppipe", "np"):
            plan, plan_id = plans[strategy]
            t0 = time.perf_counter()
            if server is None:
                on_step(f"serving the {strategy} plan: the router loads its partitions onto the "
                        "nodes and calibrates them")  # fmt: skip
                server = serve_dilated(
                    plan, plan_id, warehouse, workspace, d, name="emulated", token=token,
                    inventory=em.inventory(), transport=transport, plane=plane,
                )  # fmt: skip
                ready_s = time.perf_counter() - t0
                out["transport"] = server.deployment.options.transport  # "auto" resolved
            else:
                rate = max(rollout_share * out["ppipe"]["live"], top / MIX_STEPS)
                on_step(
                    f"rolling the {strategy} plan out under {rate * d:.0f} req/s "
                    f"({rollout_share:g} of ppipe's live capacity) for {roll_s:g} s"
                )
                load = MixLoad.of(server.deployment, weights)
                roll = rollout_under_load(server, dilated(plan, d), plan_id, load, rate, roll_s)
                out["rollout"] = roll
                if roll["status"] != "done":
                    raise PoolpipeError(
                        f"the rollout to {strategy} ended {roll['status']}: {roll['reason']}"
                    )
                ready_s = roll["prepare_s"]
            dep = server.deployment
            if rungs:
                driven = ", ".join(f"{i * top / MIX_STEPS * d:.0f}" for i in rungs)
                further = (
                    f"; while it keeps every load, {beyond} more at most, "
                    f"{ladder_gap(rungs) * top / MIX_STEPS * d:.0f} req/s apart"
                    if beyond and len(rungs) > 1
                    else ""
                )
                on_step(f"{strategy}: live at {driven} req/s ({traces_text(traces)} each"
                        f"{further}), then the simulator on the same traces and its capacity "
                        f"(>= {CAPACITY_TARGET:.0%} on time)")  # fmt: skip
            else:
                on_step(f"{strategy}: capacity (>= {CAPACITY_TARGET:.0%} on time over "
                        f"{traces_text(traces)} a rate, up to {traces + EXTRA_TRACES} where it "
                        "fails narrowly), live, then the simulator on the same traces")  # fmt: skip
            load = MixLoad.of(dep, weights)
            found = mix_capacity(
                dep,
                load,
                top,
                duration_s,
                on_point=partial(on_point, strategy),
                stages=em.emulated_stages,
                cpu=meter.sample,
                traces=traces,
                warm_up_s=warm_up_s,
                guide=guide and not rungs,
                ladder=rungs,
                beyond=beyond,
                pattern=pattern,
                # one trace a load on a ladder, and one more at the load that failed by a
                # request or two (climb_ladder `again`)
                extra=0 if rungs else EXTRA_TRACES,
                # from what the planner states the plan delivers (>= 99% on time, simulated):
                # near the capacity, where the rates far below it cost a trace or two each
                start=None if plan.deliverable is None else plan.deliverable / d,
            )
            used, wall = found["live_cpu_s"], max(1e-9, found["live_wall_s"])
            sent = found["live_sent"]
            at = []
            if loads and found["live"]:
                rates = [x * found["live"] for x in loads]
                on_step(
                    f"{strategy}: live and simulated at "
                    f"{', '.join(f'{r * d:.0f}' for r in rates)} req/s "
                    f"({', '.join(f'{x:.2f}' for x in loads)} x its live capacity)"
                )
                at = attainment_at(dep, load, rates, duration_s)
            on_step(f"{strategy}: CPU with nothing sent, for {IDLE_S:g} s")
            idle = idle_cores(meter)
            out[strategy] = {
                **found,
                "loads": at,
                "planned": plan.objective,
                # what the planner states it delivers (>= 99% on time, simulated; None:
                # planned without it)
                "deliverable": plan.deliverable,
                "ready_s": ready_s,
                "cpu_us": {k: v / max(1, sent) * 1e6 for k, v in used.items()},
                "cores": {k: v / wall for k, v in used.items()},
                "idle_cores": idle,
                "cpu_us_above_idle": {
                    k: max(0.0, v - idle[k] * wall) / max(1, sent) * 1e6 for k, v in used.items()
                },
            }
    finally:
        if server is not None:
            server.close()
    return out
