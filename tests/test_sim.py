"""The simulator on real shipped profiles: determinism, conservation, exact reservations
without jitter, late completions counted as misses, arrivals, and a small capacity search."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from poolpipe.domain.cluster import load_cluster
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError, UnknownNameError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.scheduler import DATA_PLANES, build_topology, make_data_plane
from poolpipe.scheduler.topology import filled, simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, Simulator, generate, run_once
from poolpipe.sim.capacity import search_capacity
from poolpipe.sim.metrics import DROPPED, LATE, ON_TIME
from poolpipe.sim.seeds import SeedRuns
from tests.factories import make_topology

PLANS = Path(__file__).parent / "plans"

GROUP = ("colorization-v2", "googlenet-v3-pytorch", "repvgg-b3")
MAF19 = (0.30, 0.33, 0.37)


@pytest.fixture(scope="module")
def plans(ppipe_profiles, ppipe_dir):
    cluster = load_cluster(ppipe_dir / "clusters.toml", "hc2-small")
    out = {}
    for strategy in ("ppipe", "np"):
        req = PlanRequest(
            delivery="off",  # the fluid MILP alone
            models=tuple(ppipe_profiles[n] for n in GROUP),
            weights=MAF19,
            slos_us=tuple(5 * ppipe_profiles[n].reference_latency_us for n in GROUP),
            cluster=cluster,
            strategy=strategy,
            packing="per-position",
            margin=0.4,
            max_partitions=2,
        )
        plan = make_plan(req)
        out[strategy] = (plan, build_topology(plan, ppipe_profiles, larger_batches=True))
    return out


def test_topology_places_every_vgpu_of_the_plan(plans):
    plan, topo = plans["ppipe"]
    assert len(topo.vgpus) == sum(
        q.vgpus for m in plan.models for p in m.pipelines for q in p.partitions
    )
    per_gpu: dict[tuple[str, int], float] = {}
    for v in topo.vgpus:
        per_gpu[(v.gpu, v.physical)] = per_gpu.get((v.gpu, v.physical), 0) + 1 / v.share
        assert topo.servers[v.server].gpu == v.gpu
    assert topo.overcommitted_gpus == 0
    assert max(per_gpu.values()) <= 1 + 1e-9
    for gpu, count in topo.gpu_counts.items():
        assert len({p for g, p in per_gpu if g == gpu}) <= count


@pytest.mark.parametrize("data_plane", DATA_PLANES)
def test_every_request_ends_exactly_once(plans, data_plane):
    _, topo = plans["ppipe"]
    times, models = generate(
        ArrivalSpec.parse("gamma:3"), [200.0, 200.0, 200.0], 2.0, 5, [m.name for m in topo.models]
    )
    sim = Simulator(
        topo,
        make_data_plane(data_plane, topo),
        times,
        models,
        SimConfig(duration_s=2.0, seed=5, jitter=0.2),
    )
    res = sim.run()
    assert set(sim.outcome) <= {ON_TIME, LATE, DROPPED}  # nothing left pending
    assert res.arrived == len(times) > 0
    for m in res.models:
        assert m.on_time + m.late + m.dropped == m.arrived


def test_reservations_are_exact_without_jitter(plans):
    """With execution as profiled, nothing a reservation scheduler dispatched is late."""
    _, topo = plans["ppipe"]
    res = run_once(topo, ArrivalSpec.parse("poisson"), 1.0, SimConfig(duration_s=3.0, seed=2))
    assert sum(m.late for m in res.models) == 0
    assert res.attainment > 0.5
    assert res.probes_per_batch >= 1.0


def test_same_seed_same_result_other_seed_other_result(plans):
    _, topo = plans["ppipe"]
    spec = ArrivalSpec.parse("poisson")
    a = run_once(topo, spec, 0.9, SimConfig(duration_s=2.0, seed=11, jitter=0.1))
    b = run_once(topo, spec, 0.9, SimConfig(duration_s=2.0, seed=11, jitter=0.1))
    c = run_once(topo, spec, 0.9, SimConfig(duration_s=2.0, seed=12, jitter=0.1))
    assert a.models == b.models
    assert a.models != c.models


@pytest.mark.parametrize("drop_overdue", [True, False])
def test_late_completions_count_as_misses(drop_overdue):
    # One vGPU, 10 µs per request, SLO 15 µs, and the executor runs 3x slower than profiled:
    # the scheduler dispatches (the profile says 10 fits), the request runs past its SLO:
    # answered at 15 µs, dropped, as the router does; or, without the overdue watch, late.
    topo = make_topology([([0], [10.0], 0.0)], slo_us=15.0)
    dp = make_data_plane("eager", topo)
    config = SimConfig(duration_s=1e-3, seed=1, jitter=0.0, drop_overdue=drop_overdue)
    sim = Simulator(topo, dp, np.array([0.0]), np.array([0]), config)
    topo_slow = make_topology([([0], [30.0], 0.0)], slo_us=15.0)
    sim.topo = topo_slow  # the executor's truth differs from the scheduler's profile
    res = sim.run()
    m = res.models[0]
    assert (m.on_time, m.late, m.dropped) == ((0, 0, 1) if drop_overdue else (0, 1, 0))
    assert res.attainment == 0.0


def test_measured_stage_factors_stretch_each_pools_computes():
    # Two stages of 10 µs, SLO 25 µs. Stage 1 measured at 2x its reservation: 10 + 20 > 25,
    # late (the last stage's overrun cannot be foreseen); the same factor on stage 0 only:
    # stage 1 would start 10 µs after its reserved start, the batch could no longer end by
    # 25, and the request is dropped explicitly instead of answered late; factors of 1.0
    # change nothing. (Without the overdue watch, which would answer both at 25, dropped.)
    topo = make_topology([([0], [10.0], 0.0), ([1], [10.0], 0.0)], slo_us=25.0)

    def run(factors):
        dp = make_data_plane("eager", topo)
        cfg = SimConfig(duration_s=1e-3, seed=1, stage_factors=factors, drop_overdue=False)
        return Simulator(topo, dp, np.array([0.0]), np.array([0]), cfg).run()

    assert run(((1.0,), (1.0,))).attainment == 1.0
    assert run(((), (2.0,))).models[0].late == 1
    slow_first = run(((2.0,), ())).models[0]
    assert (slow_first.late, slow_first.dropped) == (0, 1)
    res = run(((1.0, 1.1), (1.0, 1.1)))  # drawn from the list: at most 22 µs
    assert res.attainment == 1.0


def test_measured_answer_delays_hold_back_each_batchs_answer():
    # One stage of 10 µs, SLO 25 µs, two requests 30 µs apart: answered at 10 and 40.
    # Each answer 8 µs later (the data path's, as measured live): 18 and 48, still on time;
    # 20 µs later: past the SLO, dropped when it runs out (the router's overdue watch).
    topo = make_topology([([0], [10.0], 0.0)], slo_us=25.0)

    def run(delays):
        dp = make_data_plane("eager", topo)
        cfg = SimConfig(duration_s=1e-3, seed=1, answer_delays=delays)
        return Simulator(topo, dp, np.array([0.0, 30.0]), np.array([0, 0]), cfg)

    sim = run(((8.0,),))
    res = sim.run()
    assert res.attainment == 1.0
    assert list(sim.cluster.finish_us) == [18.0, 48.0]
    plain = run(((),))
    plain.run()
    assert list(plain.cluster.finish_us) == [10.0, 40.0]
    late = run(((20.0,),)).run()
    assert (late.models[0].on_time, late.models[0].dropped) == (0, 2)
    assert run(((-5.0,),)).run().attainment == 1.0  # none below 0


def test_inputs_cross_the_first_servers_downlink_one_at_a_time():
    # One pool of two vGPUs, 10 µs, SLO 18 µs; each request's inputs take 5 µs on its
    # server's downlink. Two requests at once on one server: the first's inputs 0-5,
    # compute 5-15; the second's inputs can only follow (5-10), compute 10-20 > 18:
    # dropped. With the vGPUs on two servers both are on time.
    def run(servers):
        topo = make_topology([(servers, [10.0], 0.0)], slo_us=18.0, inputs=5.0)
        cfg = SimConfig(duration_s=1e-3, seed=1)
        dp = make_data_plane("eager", topo)
        return Simulator(topo, dp, np.array([0.0, 0.0]), np.array([0, 0]), cfg).run().models[0]

    one = run([0, 0])
    assert (one.on_time, one.dropped) == (1, 1)
    assert run([0, 1]).on_time == 2


def test_reply_margin_tightens_scheduling_but_not_the_count():
    # One vGPU, 10 µs, SLO 15 µs. With a 4 µs margin the data plane must finish by 11 µs:
    # it still can, and the request counts on time against the full SLO. With 6 µs (by
    # 9 µs) it cannot, and the request is dropped, as the live router would.
    topo = make_topology([([0], [10.0], 0.0)], slo_us=15.0)

    def run(margin):
        dp = make_data_plane("reservation", topo)
        cfg = SimConfig(duration_s=1e-3, seed=1, reply_margin_us=margin)
        return Simulator(topo, dp, np.array([0.0]), np.array([0]), cfg).run().models[0]

    ok = run(4.0)
    assert (ok.on_time, ok.late, ok.dropped) == (1, 0, 0)
    tight = run(6.0)
    assert (tight.on_time, tight.dropped) == (0, 1)


def test_poisson_and_gamma_rates_and_burstiness():
    names = ["a"]
    t, _ = generate(ArrivalSpec.parse("poisson"), [1000.0], 20.0, 1, names)
    assert len(t) == pytest.approx(20000, rel=0.03)
    gaps = np.diff(t)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)
    t, _ = generate(ArrivalSpec.parse("gamma:4"), [1000.0], 20.0, 1, names)
    gaps = np.diff(t)
    assert len(t) == pytest.approx(20000, rel=0.15)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(4.0, rel=0.2)


def test_list_and_azure_files(tmp_path):
    lst = tmp_path / "arrivals.txt"
    lst.write_text("# µs\n0\n250 b\n100\n")
    t, m = generate(ArrivalSpec.parse(str(lst)), [1.0, 1.0], 1.0, 1, ["a", "b"])
    assert t.tolist() == [0.0, 100.0, 250.0]
    assert m.tolist() == [0, 1, 1]  # unlabelled lines alternate; "b" is named
    bad = tmp_path / "bad.txt"
    bad.write_text("10 nosuchmodel\n")
    with pytest.raises(UnknownNameError, match=r"bad\.txt:1: model .nosuchmodel."):
        generate(ArrivalSpec.parse(str(bad)), [1.0], 1.0, 1, ["a"])
    az = tmp_path / "trace.csv"
    rows = ["app,func,end_timestamp,duration"]
    rows += [f"x,f{i % 3},{i * 0.01 + 0.5},0.5" for i in range(300)]
    az.write_text("\n".join(rows) + "\n")
    spec = ArrivalSpec.parse(str(az))
    assert spec.kind == "azure"
    t, m = generate(spec, [500.0, 250.0], 2.0, 1, ["a", "b"])
    assert np.sum(m == 0) == pytest.approx(1000, rel=0.1)
    assert np.sum(m == 1) == pytest.approx(500, rel=0.1)
    with pytest.raises(PoolpipeError, match="neither poisson"):
        ArrivalSpec.parse("uniform")
    with pytest.raises(PoolpipeError, match="positive CV"):
        ArrivalSpec.parse("gamma:-1")


def test_small_capacity_search_on_real_profiles(plans):
    """Both searches agree on the grid; ppipe serves at least np's load (np at the same
    absolute rates)."""
    pplan, ptopo = plans["ppipe"]
    _, ntopo = plans["np"]
    rates = [m.throughput for m in pplan.models]
    spec = ArrivalSpec.parse("poisson")
    kw = dict(duration_s=3.0, seeds=(1,), reference_rates=rates, step=0.1)
    step = search_capacity(ptopo, spec, method="step", **kw)
    bis = search_capacity(ptopo, spec, method="bisect", **kw)
    base = search_capacity(ntopo, spec, method="bisect", **kw)
    for name in GROUP:
        assert 0.0 <= step.capacity[name] <= 1.0
        att = step.attainment[step.capacity[name]][name] if step.capacity[name] else 1.0
        assert att >= 0.99
        assert bis.capacity[name] == pytest.approx(step.capacity[name], abs=0.1 + 1e-9)
    assert bis.simulations <= step.simulations + 2
    assert sum(step.capacity.values()) >= sum(base.capacity.values())


def test_a_points_seeds_on_two_processes_give_the_same_search(plans):
    """A capacity search with each point's seeds split over two processes finds what one
    process finds, run for run, and leaves no process behind."""
    _, ptopo = plans["ppipe"]
    spec = ArrivalSpec.parse("poisson")
    kw = dict(duration_s=2.0, seeds=(3, 4, 5), method="bisect", step=0.1)
    before = _children()
    one = search_capacity(ptopo, spec, **kw)
    two = search_capacity(ptopo, spec, processes=2, **kw)
    assert _children() == before
    assert two.capacity == one.capacity and two.attainment == one.attainment
    assert two.simulations == one.simulations
    for lf, runs in one.results.items():
        assert [r.models for r in two.results[lf]] == [r.models for r in runs]


def _children() -> set[str]:
    """This process's children (Linux)."""
    return {
        pid for f in Path("/proc/self/task").glob("*/children") for pid in f.read_text().split()
    }


def _where(lf: float, seed: int) -> tuple:
    if seed == 99:
        raise ValueError("seed 99 cannot run")
    return (os.getpid(), lf, seed)


def test_seeds_run_beside_the_caller_and_where_the_helper_fails_here():
    """The helper runs every other seed, the results in the seeds' order; a run that fails
    there is run again here (its error is the caller's); a helper killed leaves the caller
    to run every seed."""
    before = _children()
    with SeedRuns(_where, (1, 2, 3, 4), processes=2) as runs:
        got = runs(0.5)
        assert [g[1:] for g in got] == [(0.5, 1), (0.5, 2), (0.5, 3), (0.5, 4)]
        here = os.getpid()
        assert [g[0] == here for g in got] == [True, False, True, False]
        helper = got[1][0]
        os.kill(helper, signal.SIGKILL)
        os.waitpid(helper, 0)
        assert [g[0] for g in runs(0.6)] == [here] * 4
    with SeedRuns(_where, (1, 99), processes=2) as runs, pytest.raises(ValueError, match="99"):
        runs(0.5)
    with SeedRuns(_where, (1, 2), processes=1) as runs:
        assert {g[0] for g in runs(0.5)} == {os.getpid()}
    assert _children() == before


def test_the_cluster_reads_its_answers_back_by_request() -> None:
    """The simulated cluster logs its answers as they come; read back by request, each
    request has its last answer's outcome (PENDING where none came) and, where that was on
    time or late, its time."""
    from poolpipe.runtime.ports import PENDING, Entry
    from poolpipe.runtime.stats import EpochStats
    from poolpipe.sim.engine import SimulatedCluster, VirtualClock

    clock = VirtualClock()
    cluster = SimulatedCluster(clock, SimConfig(1.0), 5)
    stats = EpochStats()

    def answer(i: int, outcome, at: float) -> None:
        clock.t = at
        cluster.answer(Entry(i, 0, 0.0, 1.0, 1.0, i, stats), outcome, "")

    answer(3, LATE, 7.0)
    answer(0, ON_TIME, 2.0)
    answer(4, DROPPED, 3.0)
    answer(3, DROPPED, 9.0)  # (an answer again: the last one counts)
    assert cluster.outcome.tolist() == [ON_TIME, PENDING, PENDING, DROPPED, DROPPED]
    finish = cluster.finish_us
    assert finish[0] == 2.0 and finish[3] == 7.0
    assert np.isnan(finish[[1, 2, 4]]).all()


def test_a_backlog_does_not_leave_a_models_slower_pipelines_idle(ppipe_profiles):
    # colorization-v2 on hc2-large at 90% of its max-min rates has four pipelines, one of
    # them the whole model on L4s, which may grow its batches under a backlog. A head the
    # slower pipelines could no longer meet was sent to it and held the model's queue
    # until its vGPUs were free; from then on every head was such a one, and the slower
    # pipelines idled: from second 18 of this trace, 39% on time.
    plan = Plan.load(PLANS / "colorization-backlog-hc2-large.json")
    topo = simulated_topology(plan, ppipe_profiles)
    rates = [plan.meta["rates"][m.name] for m in plan.models]
    names = [m.name for m in plan.models]
    times, models = generate(ArrivalSpec.parse("poisson"), rates, 60.0, 8, names)
    keep = times < 22e6
    sim = Simulator(
        topo, make_data_plane("reservation", topo), times[keep], models[keep], SimConfig(22.0, 8)
    )
    s = sim.run().per_second["colorization-v2"]
    late = [o / a for o, a in zip(s["on_time"][18:], s["arrived"][18:], strict=True)]
    assert min(late) > 0.9, late


def test_packing_leaves_the_highest_vgpus_idle_at_a_low_load_and_serves_as_much_at_a_high():
    """Load-proportional packing (the reservation plane): of equally good vGPUs the
    lowest-numbered takes the batch, so at a low load the pool's last GPU runs nothing (it
    could be given back); `spread` (equally good vGPUs take turns) keeps every GPU a little
    busy. Above adaptive.PACK_LOAD of the plan's rate the reservation plane's vGPUs take
    turns too (the `packed` plane packs at any load). Near the pool's capacity both serve
    every request on time."""
    # one pool of 4 GPUs, 1.0-1.6 ms at batch 1-4 (2,500 req/s each at batch 4), SLO 10 ms
    topo = make_topology(
        [([0, 1, 2, 3], [1000.0, 1200.0, 1400.0, 1600.0], 0.0)],
        batch=4,
        slo_us=10_000.0,
        throughput=8000.0,
    )
    poisson = ArrivalSpec.parse("poisson")
    low = {p: run_once(topo, poisson, 0.0125, SimConfig(duration_s=4.0, seed=3), p)
           for p in ("reservation", "spread")}  # fmt: skip
    assert low["reservation"].arrived > 300
    assert low["reservation"].gpu_busy["G#3"] == 0.0 and low["reservation"].gpus_idle >= 1
    assert low["reservation"].gpu_busy["G#0"] > 0.05
    assert low["spread"].gpus_idle == 0  # each takes its turn
    # the same work either way: the GPU-time busy is the same to within a batch or two
    busy = {p: sum(r.gpu_busy.values()) for p, r in low.items()}
    assert busy["reservation"] == pytest.approx(busy["spread"], rel=0.05)
    # at 0.6 of the plan's 8,000 req/s, above PACK_LOAD
    mid = {p: run_once(topo, poisson, 0.6, SimConfig(duration_s=6.0, seed=3), p).gpu_busy
           for p in ("reservation", "packed")}  # fmt: skip
    assert min(mid["reservation"].values()) > 0.9 * max(mid["reservation"].values())
    assert mid["packed"]["G#3"] < 0.5 * mid["packed"]["G#0"]
    for p in ("reservation", "spread"):
        assert low[p].attainment == 1.0
        high = run_once(topo, poisson, 0.9, SimConfig(duration_s=2.0, seed=3), p)
        assert high.arrived > 10_000 and high.attainment >= 0.99, p
        assert high.gpus_idle == 0, p  # near capacity every GPU works


def test_dummy_requests_run_every_short_batch_as_long_as_the_planned_one():
    """Piccolo's dummy requests (topology.filled): a batch below the planned batch is filled
    up to it, so a stage at batch 1 takes the planned batch's latency; at a low load the
    same requests keep the GPUs busier and wait longer; near capacity, where batches are
    full anyway, both serve every request on time."""
    topo = make_topology(
        [([0, 1, 2, 3], [1000.0, 1200.0, 1400.0, 1600.0], 0.0)],
        batch=4,
        slo_us=10_000.0,
        throughput=8000.0,
    )
    full = filled(topo)
    assert full.pools[0].latency_us[1:] == (1600.0, 1600.0, 1600.0, 1600.0)
    assert topo.pools[0].latency_us[1:] == (1000.0, 1200.0, 1400.0, 1600.0)  # untouched
    poisson = ArrivalSpec.parse("poisson")
    low = {name: run_once(t, poisson, 0.0125, SimConfig(duration_s=4.0, seed=3))
           for name, t in (("plain", topo), ("filled", full))}  # fmt: skip
    assert low["plain"].arrived == low["filled"].arrived > 300
    busy = {name: sum(r.gpu_busy.values()) for name, r in low.items()}
    assert busy["filled"] > 1.2 * busy["plain"]
    assert low["filled"].models[0].latency_p50_us > low["plain"].models[0].latency_p50_us
    for name, t in (("plain", topo), ("filled", full)):
        assert low[name].attainment == 1.0
        high = run_once(t, poisson, 0.9, SimConfig(duration_s=2.0, seed=3))
        assert high.arrived > 10_000 and high.attainment >= 0.99, name
