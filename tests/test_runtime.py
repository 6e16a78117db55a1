"""The serving runtime by hand on the virtual clock, through its ports only: a clock, and an
executor whose hops the test reports (start, end, failure) as it chooses. No server runs.
Every case is worked out by hand: deadlines and reply margin, outcomes, a stage failure with
and without a live path, a retry that misses its deadline, node checks and return,
recalibration that triggers and one that does not, and flush migrations that wait for the
batch in flight or give up at their timeout."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import (
    DROPPED,
    FAILED,
    LATE,
    ON_TIME,
    RECALIBRATE_EVERY,
    RECALIBRATE_MAX,
    Clock,
    Entry,
    Executor,
    Job,
    PlanUsage,
    RuntimeConfig,
    ServedPlan,
    ServingRuntime,
)
from poolpipe.runtime.placement import vgpu_nodes
from poolpipe.scheduler import PlaneWrapper, make_data_plane
from poolpipe.scheduler.messages import DROP_OVERDUE, DROP_STAGE_OVERRAN
from poolpipe.sim.engine import VirtualClock
from tests.factories import make_topology


class HandExecutor(Executor):
    """Keeps what it is given; the test plays the cluster."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.answers: dict[int, tuple[int, str]] = {}  # payload -> (outcome, reason)
        self.checks: list[tuple[float, str]] = []
        self.node_ok: dict[str, bool] = {}
        self.retired: list[PlanUsage] = []
        self.rt: ServingRuntime

    def bind(self, runtime: ServingRuntime) -> None:
        self.rt = runtime

    def run(self, job: Job) -> None:
        self.jobs.append(job)

    def answer(self, entry: Entry, outcome: int, reason: str) -> None:
        assert entry.payload not in self.answers, "answered twice"
        self.answers[entry.payload] = (outcome, reason)

    def check_node(self, node: str, served: ServedPlan) -> None:
        self.checks.append((self.rt.clock.now(), node))
        self.rt.node_checked(node, self.node_ok.get(node, False))

    def retire(self, usage: PlanUsage) -> None:
        self.retired.append(usage)


def runtime(stages, *, slo_us=100.0, batch=1, plane="eager", **config):
    topo = make_topology(stages, slo_us=slo_us, batch=batch)
    clock = VirtualClock()
    ex = HandExecutor()
    served = ServedPlan(topo, make_data_plane(plane, topo), vgpu_nodes(topo))
    return ServingRuntime(served, clock, ex, RuntimeConfig(**config)), clock, ex


def run_job(rt: ServingRuntime, job: Job, at: float, durations: list[float]) -> float:
    """Every hop of `job` back to back from `at`, each taking its duration."""
    t = at
    for h, dur in enumerate(durations):
        rt.clock.run_until(t)
        rt.hop_started(job, h, t)
        rt.clock.run_until(t + dur)
        rt.hop_done(job, h, t, t + dur)
        t += dur
    return t


def two_in_one_batch(**config):
    """Two stages of 10 µs; two requests, SLOs 25 and 60 µs, in one batch of 2 (eager):
    reserved stage 0 at [0, 10], stage 1 at [10, 20]."""
    rt, clock, ex = runtime(
        [([0], [10.0, 10.0], 0.0), ([1], [10.0, 10.0], 0.0)], slo_us=60.0, batch=2, **config
    )
    rt.add(0, 1, slo_us=25.0)
    rt.add(0, 2)
    rt.decide()
    (job,) = ex.jobs
    return rt, clock, ex, job


def test_deadlines_hold_back_the_reply_margin_and_count_against_the_full_slo():
    # (without the overdue watch, a batch that runs past an SLO is answered late)
    rt, _, ex = runtime([([0], [10.0], 0.0)], slo_us=50.0, reply_margin_us=5.0, drop_overdue=False)
    (a,) = rt.submit(0, [1])
    assert a is not None and (a.arrival_us, a.deadline_us, a.due_us) == (0.0, 45.0, 50.0)
    (b,) = rt.submit(0, [2], slo_us=30.0)  # a per-request SLO
    assert b is not None and (b.deadline_us, b.due_us) == (25.0, 30.0)
    first, second = ex.jobs
    run_job(rt, first, 0.0, [48.0])  # 48 <= 50: on time, though past the scheduled 45
    run_job(rt, second, 48.0, [10.0])  # 58 > 30: late
    assert ex.answers == {1: (ON_TIME, ""), 2: (LATE, "")}
    s = rt.stats["m"]
    assert (s.arrivals, s.on_time, s.late, s.latency_us) == (2, 1, 1, [48.0, 58.0])
    window = rt.take_window()
    (m,) = window.models
    assert (m.model, m.arrivals, m.on_time, m.late) == ("m", 2, 1, 1)
    assert window.pools[0].busy_ms == pytest.approx(58e-3)
    assert rt.take_window().model("m").arrivals == 0  # a window counts once


def test_a_batch_still_running_at_its_slo_is_answered_then_dropped_not_late():
    # Stage 0 runs until 40 (a host whose cores a burst took): request 1 (SLO 25) is
    # answered at 26, dropped, while the stage still runs; request 2 (SLO 60) is answered
    # with the batch, on time.
    rt, clock, ex, job = two_in_one_batch()
    rt.hop_started(job, 0, 0.0)
    clock.run_until(25.0)
    assert not ex.answers  # its SLO has not run out yet
    clock.run_until(26.0)
    assert ex.answers == {1: (DROPPED, DROP_OVERDUE)}
    rt.hop_done(job, 0, 0.0, 40.0)
    clock.run_until(40.0)
    assert rt.hop_late(job, 1) is True  # request 2 can still make it: the hop runs
    rt.hop_started(job, 1, 40.0)
    clock.run_until(50.0)
    rt.hop_done(job, 1, 40.0, 50.0)
    assert ex.answers[2] == (ON_TIME, "")
    s = rt.stats["m"]
    assert (s.on_time, s.late, s.dropped) == (1, 0, 1)
    assert rt.drop_reasons == {DROP_OVERDUE: 1}
    clock.run_until(1_000.0)  # the watch of the ended batch answers nothing more
    assert len(ex.answers) == 2 and rt.in_flight() == 0


def test_a_batch_that_ends_past_the_slo_before_the_watch_fires_is_a_drop_too():
    # the live loop may take a stage's answer in after the SLO, before the watch's timer
    rt, _, ex = runtime([([0], [10.0], 0.0)], slo_us=30.0)
    rt.submit(0, [1])
    (job,) = ex.jobs
    rt.hop_started(job, 0, 0.0)
    rt.hop_done(job, 0, 0.0, 30.5)  # the clock still stands at 0
    assert ex.answers == {1: (DROPPED, DROP_OVERDUE)}
    assert rt.stats["m"].late == 0


def test_a_request_that_cannot_make_its_deadline_is_dropped_explicitly():
    rt, _, ex = runtime([([0], [10.0], 0.0)], slo_us=8.0, plane="reservation")
    rt.submit(0, [7])
    assert ex.answers[7] == (DROPPED, "deadline cannot be met") and not ex.jobs
    assert rt.drop_reasons == {"deadline cannot be met": 1} and rt.in_flight() == 0


def two_stages(**kw):
    """Stage 0 on one vGPU; stage 1 on two vGPUs (two nodes), 10 µs each."""
    return runtime([([0], [10.0], 0.0), ([1, 2], [10.0], 0.0)], plane="reservation", **kw)


def test_a_failure_mid_batch_retries_on_a_live_path_and_the_node_returns_when_it_answers():
    rt, clock, ex = two_stages(node_check_every_us=1000.0)
    rt.submit(0, [1])
    (job,) = ex.jobs
    first_node = job.served.vgpu_node[job.dispatch.hops[1].vgpu]
    rt.hop_started(job, 0, 0.0)
    clock.run_until(10.0)
    rt.hop_done(job, 0, 0.0, 10.0)
    rt.hop_started(job, 1, 10.0)
    clock.run_until(12.0)
    assert rt.live_throughput() == {"m": 100.0}
    rt.hop_failed(job, 1, "connection refused")  # the node dies under the batch
    assert rt.down_nodes() == {first_node} and rt.stats["m"].retried == 1
    assert rt.live_throughput() == {"m": 50.0}  # stage 1 has one vGPU of two left
    assert 1 not in ex.answers and len(ex.jobs) == 2  # started over, on the other node
    retry = ex.jobs[1]
    assert retry.served.vgpu_node[retry.dispatch.hops[1].vgpu] != first_node
    run_job(rt, retry, 12.0, [10.0, 10.0])
    assert ex.answers[1] == (ON_TIME, "")  # 32 <= 100
    # the runtime asks whether the node serves again every 1000 µs until it does
    clock.run_until(2500.0)
    assert ex.checks == [(1012.0, first_node), (2012.0, first_node)]
    ex.node_ok[first_node] = True
    clock.run_until(3100.0)
    assert ex.checks[-1] == (3012.0, first_node)
    assert rt.down_nodes() == set() and rt.recoveries == 1
    clock.run_until(10_000.0)
    assert len(ex.checks) == 3  # back in service: no more checks
    # the returned node takes batches again: of two idle stage-1 vGPUs the lowest-numbered,
    # its own, takes each (packing; while it was down the other took them)
    used = set()
    for k in range(4):
        clock.run_until(20_000.0 + 1000 * k)
        rt.submit(0, [100 + k])
        run_job(rt, ex.jobs[-1], clock.now(), [10.0, 10.0])
        used.add(ex.jobs[-1].dispatch.hops[1].vgpu)
    assert used == {1} and job.served.vgpu_node[1] == first_node


def test_without_a_live_path_the_batch_fails_explicitly():
    rt, _, ex = runtime([([0], [10.0], 0.0), ([1], [10.0], 0.0)], plane="reservation")
    rt.submit(0, [1, 2])
    for job in list(ex.jobs):
        rt.hop_started(job, 0, 0.0)
        rt.hop_failed(job, 0, "connection refused")
    assert ex.answers[1][0] == FAILED and "no live path" in ex.answers[1][1]
    assert ex.answers[2][0] == FAILED
    assert rt.stats["m"].failed == 2 and rt.in_flight() == 0
    assert not rt.has_live_path(0) and rt.without_path() == {0}  # the router's readiness
    assert rt.live_throughput() == {"m": 0.0}
    rt.submit(0, [3])  # nothing can take it now: an explicit answer, at once, saying why
    assert ex.answers[3][0] == FAILED
    assert ex.answers[3][1].startswith("no live path for model m: node(s) ")
    assert rt.stats["m"].arrivals == 3 and rt.in_flight() == 0


def test_a_retry_that_misses_its_deadline_is_a_drop_not_a_failure():
    rt, clock, ex = two_stages(slo_us=25.0)
    rt.submit(0, [1])
    job = ex.jobs[0]
    rt.hop_started(job, 0, 0.0)
    clock.run_until(10.0)
    rt.hop_done(job, 0, 0.0, 10.0)
    rt.hop_started(job, 1, 10.0)
    clock.run_until(24.0)  # the call fails late: 24 + 20 > 25 for a retry
    rt.hop_failed(job, 1, "timed out")
    assert ex.answers[1][0] == DROPPED and rt.stats["m"].failed == 0
    assert rt.stats["m"].retried == 1


def test_a_second_failure_fails_the_request():
    rt, clock, ex = runtime([([0, 1], [10.0], 0.0), ([2], [10.0], 0.0)], plane="reservation")
    rt.submit(0, [1])
    nodes = []
    for attempt in range(2):
        job = ex.jobs[attempt]
        nodes.append(job.served.vgpu_node[job.dispatch.hops[0].vgpu])
        rt.hop_started(job, 0, clock.now())
        rt.hop_failed(job, 0, f"failure {attempt}")
    assert nodes[0] != nodes[1]  # the retry took the other node
    assert ex.answers[1] == (FAILED, f"failure 1 (node {nodes[1]}; no attempt left to retry)")


def test_recalibration_triggers_outside_the_band_and_not_inside():
    rt, clock, ex = runtime([([0], [10.0, 18.0], 0.0)], batch=2, plane="eager")
    t = 0.0
    for k in range(RECALIBRATE_EVERY):
        rt.submit(0, [k])
        t = run_job(rt, ex.jobs[-1], t, [15.0]) + 1  # 1.5x the 10 µs reserved
        clock.run_until(t)
        if k < RECALIBRATE_EVERY - 1:
            assert rt.recalibrations == 0  # too few calls yet
    assert rt.recalibrations == 1
    assert rt.topo.pools[0].latency_us[1:] == (15.0, 27.0)  # every batch size scaled
    assert rt.plane.topo is rt.topo  # the plane reserves with the new latencies
    for k in range(RECALIBRATE_EVERY):
        rt.submit(0, [100 + k])
        t = run_job(rt, ex.jobs[-1], t, [15.5]) + 1  # within 1 +- 0.1 of 15
        clock.run_until(t)
    assert rt.recalibrations == 1


def test_recalibration_stays_within_its_limits_and_the_door_judges_by_the_plan():
    """Stages measured 10x slower than reserved (an overload that took the host's cores)
    scale the pool's latencies by RECALIBRATE_MAX at most, from the latencies it was
    served with: a request still fits its SLO and is served, so stages keep running and
    measured, and the latencies come back when the stages do; the door's check of what
    the plan can ever serve uses the served latencies, not the scaled ones."""
    rt, clock, ex = runtime([([0], [10.0, 18.0], 0.0)], slo_us=40.0, batch=2, plane="eager")
    t = 0.0
    for rounds, took in ((3, 100.0), (1, 10.0)):
        for _ in range(rounds * RECALIBRATE_EVERY):
            rt.submit(0, [len(ex.answers) + 1000])
            assert ex.jobs[-1].dispatch.hops[0].start_us == pytest.approx(t)  # served
            t = run_job(rt, ex.jobs[-1], t, [took]) + 1
            clock.run_until(t)
        if took > 10.0:
            top = RECALIBRATE_MAX
            assert rt.topo.pools[0].latency_us[1:] == (10.0 * top, 18.0 * top)
            assert rt.check("m", 2, None) == (0, None)  # 2 rows fit 40 µs as served (18)
    assert rt.topo.pools[0].latency_us[1:] == (10.0, 18.0)  # back as the stages came back


def test_recalibration_can_be_turned_off_and_stage_factors_are_kept_when_asked():
    rt, clock, ex = runtime([([0], [10.0], 0.0)], recalibrate=False, record_stage_factors=True)
    t = 0.0
    for k in range(RECALIBRATE_EVERY):
        rt.submit(0, [k])
        t = run_job(rt, ex.jobs[-1], t, [20.0]) + 1
        clock.run_until(t)
    assert rt.recalibrations == 0 and rt.topo.pools[0].latency_us[1] == 10.0
    assert rt.take_stage_factors() == ((2.0,) * RECALIBRATE_EVERY,)
    assert rt.take_stage_factors() == ((),)  # taken once


def test_stage_factors_stay_against_the_latencies_served_across_a_recalibration():
    """A stage that always takes 1.5x its served time: after the pool is recalibrated to
    it the reservations are 15 µs and each call is measured 1.0 of them, but the factor
    kept for the simulator (whose stage runs the served 10 µs times a factor) stays 1.5;
    testbed.predict.factors_on turns them into factors of the scaled topology."""
    from testbed.predict import factors_on

    rt, clock, ex = runtime([([0], [10.0], 0.0)], record_stage_factors=True)
    base = rt.topo
    t = 0.0
    for k in range(2 * RECALIBRATE_EVERY):
        rt.submit(0, [k])
        t = run_job(rt, ex.jobs[-1], t, [15.0]) + 1
        clock.run_until(t)
    assert rt.recalibrations == 1 and rt.topo.pools[0].latency_us[1] == 15.0
    assert rt.base_topo is base and rt.base_topo.pools[0].latency_us[1] == 10.0
    factors = rt.take_stage_factors()
    assert factors == ((1.5,) * (2 * RECALIBRATE_EVERY),)
    assert factors_on(factors, rt.base_topo, rt.topo) == ((1.0,) * (2 * RECALIBRATE_EVERY),)
    assert factors_on(factors, rt.base_topo, base) == factors


def test_a_stage_that_waited_behind_another_is_not_measured():
    rt, _, ex = runtime([([0], [10.0], 0.0)], recalibrate=False, record_stage_factors=True)
    rt.submit(0, [1])
    rt.submit(0, [2])  # eager: two batches for the one vGPU, both sent now
    a, b = ex.jobs
    rt.hop_started(a, 0, 0.0)
    rt.hop_started(b, 0, 0.0)  # sent while the vGPU was busy: it queues at the node
    rt.hop_done(a, 0, 0.0, 10.0)
    rt.hop_done(b, 0, 0.0, 20.0)
    assert rt.take_stage_factors() == ((1.0,),)


def test_answer_delays_are_what_a_batch_was_late_beyond_its_stages():
    """Two stages of 10 µs on idle vGPUs: stage 0 ran 4 µs over, and the answer came 9 µs
    after the reserved end (stage 1 placed 5 µs late, as a chain's transport places it
    from when the answer came): 5 µs of it is the data path's. A batch that waited for
    its vGPU is measured too: behind a batch the host made late it is answered late, which
    the simulator's queues, on reserved times, do not make; where its wait is inside its
    stage's measured time (a relay's) nothing is left beyond its stages."""
    rt, clock, ex = runtime(
        [([0], [10.0], 0.0), ([1], [10.0], 0.0)], recalibrate=False, record_stage_factors=True
    )
    rt.submit(0, [1])
    job = ex.jobs[-1]
    rt.hop_started(job, 0, 0.0)
    rt.hop_done(job, 0, 0.0, 14.0)
    rt.hop_started(job, 1, 19.0)
    rt.hop_done(job, 1, 19.0, 29.0)
    assert rt.take_answer_delays() == ((), (5.0,))
    assert rt.take_answer_delays() == ((), ())  # taken once
    clock.run_until(40.0)
    rt.submit(0, [2])
    rt.submit(0, [3])
    a, b = ex.jobs[-2:]
    for job in (a, b):
        rt.hop_started(job, 0, 40.0)  # b waits behind a at the node
    rt.hop_done(a, 0, 40.0, 50.0)
    rt.hop_started(a, 1, 50.0)
    rt.hop_done(a, 1, 50.0, 60.0)
    rt.hop_done(b, 0, 40.0, 60.0)
    rt.hop_started(b, 1, 60.0)
    rt.hop_done(b, 1, 60.0, 70.0)
    # b's too: reserved 50-70, answered at 70, its stage 0 took 20 (its wait at the node
    # inside it, as a relay measures it): nothing beyond its stages, -10 (the simulator
    # answers it at once)
    assert rt.take_answer_delays() == ((), (0.0, -10.0))


def test_flush_migration_holds_new_requests_until_the_batch_in_flight_ends():
    rt, clock, ex = runtime([([0], [10.0], 0.0)], slo_us=1000.0)
    rt.submit(0, [1])
    old_job = ex.jobs[0]
    rt.hop_started(old_job, 0, 0.0)
    topo2 = make_topology([([0, 1], [8.0], 0.0)], slo_us=1000.0)
    new = ServedPlan(topo2, make_data_plane("eager", topo2), vgpu_nodes(topo2))
    results = []
    clock.run_until(2.0)
    rt.switch(new, 1e6, results.append)
    clock.run_until(5.0)
    rt.submit(0, [2])  # held: no job yet
    assert len(ex.jobs) == 1 and not results
    clock.run_until(10.0)
    rt.hop_done(old_job, 0, 0.0, 10.0)
    clock.run_until(10.0)
    assert ex.answers[1] == (ON_TIME, "")
    (res,) = results
    assert (res.downtime_us, res.held, res.failed) == (8.0, 1, 0)
    assert rt.served is new and len(ex.jobs) == 2
    held_job = ex.jobs[1]
    assert held_job.served is new and held_job.entries[0].arrival_us == 5.0  # kept its time
    run_job(rt, held_job, 10.0, [8.0])
    assert ex.answers[2] == (ON_TIME, "")


def test_a_flush_that_cannot_finish_fails_what_is_left_at_its_timeout():
    rt, clock, ex = runtime([([0], [10.0], 0.0)], slo_us=1000.0)
    rt.submit(0, [1])
    stuck = ex.jobs[0]
    rt.hop_started(stuck, 0, 0.0)
    new = ServedPlan(rt.topo, make_data_plane("eager", rt.topo), vgpu_nodes(rt.topo))
    results = []
    rt.switch(new, 500.0, results.append)
    with pytest.raises(PoolpipeError, match="already under way"):
        rt.switch(new, 500.0, results.append)
    clock.run_until(499.0)
    assert not results
    clock.run_until(500.0)
    assert ex.answers[1] == (FAILED, "the plan was switched before this request could finish")
    assert results[0].failed == 1 and rt.served is new
    rt.hop_done(stuck, 0, 0.0, 600.0)  # the old batch ends after all: nothing more
    assert len(ex.answers) == 1 and rt.stats["m"].failed == 1


def test_plans_switched_away_from_are_retired_with_their_last_job():
    # A router that rolls out every night must not keep every plan it ever served (each
    # with its data plane's tables): an old plan is forgotten, and its executor told, as
    # soon as no job runs on it; one whose batch outlives the flush waits for that batch.
    rt, clock, ex = runtime([([0], [10.0], 0.0)], slo_us=1000.0)
    rt.submit(0, [1])
    stuck = ex.jobs[0]
    rt.hop_started(stuck, 0, 0.0)
    for k in range(1, 6):  # five switches; the first one's flush gives up on `stuck`
        new = ServedPlan(rt.topo, make_data_plane("eager", rt.topo), vgpu_nodes(rt.topo))
        rt.switch(new, 100.0, lambda r: None)
        clock.run_until(clock.now() + 100.0)
        assert rt.generation == k and rt.served is new
    assert [u.generation for u in ex.retired] == [1, 2, 3, 4]  # none of them ran a job
    assert [u.generation for u in rt.usage()] == [0, 5]  # gen 0: its batch still runs
    rt.hop_done(stuck, 0, 0.0, 700.0)  # the old batch ends after all: gen 0 goes
    assert [u.generation for u in ex.retired] == [1, 2, 3, 4, 0]
    assert [u.generation for u in rt.usage()] == [5]
    gone = ex.retired[-1]
    assert gone.vgpu_busy_us == (700.0,) and gone.pool_batches == (1,)
    rt.submit(0, [2])
    (job,) = [j for j in ex.jobs if j is not stuck]
    assert job.generation == 5
    run_job(rt, job, clock.now(), [10.0])
    assert ex.answers[2] == (ON_TIME, "") and len(ex.retired) == 5  # the current one stays


def test_a_switch_refuses_a_plan_without_the_served_models():
    rt, _, _ = runtime([([0], [10.0], 0.0)])
    topo = make_topology([([0], [10.0], 0.0)])
    topo = replace(topo, models=(replace(topo.models[0], name="other"),))
    other = ServedPlan(topo, make_data_plane("eager", topo), vgpu_nodes(topo))
    with pytest.raises(PoolpipeError, match=r"does not serve \['m'\]"):
        rt.switch(other, 1e6, lambda r: None)


def test_config_is_checked():
    with pytest.raises(PoolpipeError, match="reply margin"):
        RuntimeConfig(reply_margin_us=-1)
    with pytest.raises(PoolpipeError, match="node checks"):
        RuntimeConfig(node_check_every_us=0)


def test_a_hop_that_gets_its_vgpu_too_late_drops_what_would_be_late():
    # slack = 25 - 20 = 5 µs
    rt, clock, ex, job = two_in_one_batch()
    assert job.slack_us == pytest.approx(5.0)
    clock.run_until(0.0)
    rt.hop_started(job, 0, 0.0)
    clock.run_until(18.0)
    rt.hop_done(job, 0, 0.0, 18.0)  # ran 8 µs over its reservation
    # stage 1 starts 8 µs late: 20 + 8 > 25 drops request 1 now; request 2 (due 60) rides on
    assert rt.hop_late(job, 1) is True
    assert ex.answers == {1: (DROPPED, DROP_STAGE_OVERRAN)}
    assert job.slack_us == pytest.approx(40.0)
    rt.hop_started(job, 1, 18.0)
    clock.run_until(28.0)
    rt.hop_done(job, 1, 18.0, 28.0)
    assert ex.answers[2] == (ON_TIME, "")
    s = rt.stats["m"]
    assert (s.on_time, s.late, s.dropped) == (1, 0, 1)


@pytest.mark.parametrize(
    ("drop_overdue", "reason"), [(True, DROP_OVERDUE), (False, DROP_STAGE_OVERRAN)]
)
def test_a_batch_with_nothing_left_on_time_does_not_run_and_frees_its_path(drop_overdue, reason):
    # stage 0 runs until 30, past the SLO (25): the overdue watch answers the request at 26;
    # without it, hop_late drops it when stage 1 could start
    rt, clock, ex = runtime(
        [([0], [10.0], 0.0), ([1], [10.0], 0.0)], slo_us=25.0, drop_overdue=drop_overdue
    )
    rt.submit(0, [1])
    (job,) = ex.jobs
    rt.hop_started(job, 0, 0.0)
    clock.run_until(30.0)
    rt.hop_done(job, 0, 0.0, 30.0)
    assert rt.hop_late(job, 1) is False  # the hop must not run
    assert ex.answers[1] == (DROPPED, reason) and rt.in_flight() == 0
    rt.submit(0, [2])  # the path it held is free: the next request is served from now
    nxt = ex.jobs[-1]
    assert nxt.dispatch.hops[0].start_us == pytest.approx(30.0)


def test_an_overrun_into_the_reply_margin_is_not_dropped():
    # SLO 40 µs, margin 10: reserved to end at 20 (slack 20 to the SLO's end). Stage 0 runs
    # 12 µs over: stage 1 ends at 32, past the scheduled 30 but within the SLO (the margin
    # is held back for the reply, not a deadline of the stages): it runs, on time.
    rt, clock, ex = runtime(
        [([0], [10.0], 0.0), ([1], [10.0], 0.0)], slo_us=40.0, reply_margin_us=10.0
    )
    rt.submit(0, [1])
    (job,) = ex.jobs
    assert job.slack_us == pytest.approx(20.0)
    rt.hop_started(job, 0, 0.0)
    clock.run_until(22.0)
    rt.hop_done(job, 0, 0.0, 22.0)
    assert rt.hop_late(job, 1) is True and not ex.answers
    rt.hop_started(job, 1, 22.0)
    clock.run_until(32.0)
    rt.hop_done(job, 1, 22.0, 32.0)
    assert ex.answers[1] == (ON_TIME, "")


class DelegatingClock(Clock):
    """A VirtualClock whose timers a test shifts (by composition: the simulator's clock is
    compiled, and an interpreted class cannot subclass a compiled one, but for the ports'
    bases)."""

    def __init__(self):
        self.clock = VirtualClock()

    def now(self):
        return self.clock.now()

    def call_at(self, t_us, fn):
        return self.clock.call_at(t_us, fn)

    def run_until(self, t_us):
        self.clock.run_until(t_us)


def test_held_batches_wake_earlier_when_the_clocks_timers_fire_late():
    """A lone request is held for batch-mates until its last moment less the wake guard
    (1 µs in the simulator). On a clock whose timers fire 30 µs late it is dropped, until
    the runtime has measured that lateness (after 8 wakes) and the plane wakes that much
    earlier: then every lone request is served on time again. The plane's guard follows
    the p99 of the lateness."""

    class LateClock(DelegatingClock):
        def call_at(self, t_us, fn):
            return self.clock.call_at(t_us + 30.0, fn)

    topo = make_topology([([0], [10.0, 12.0, 14.0, 16.0], 0.0)], slo_us=1000.0, batch=4)
    clock = LateClock()
    ex = HandExecutor()
    plane = make_data_plane("holding", topo)
    rt = ServingRuntime(ServedPlan(topo, plane, vgpu_nodes(topo)), clock, ex, RuntimeConfig())
    outcomes = []
    t = 0.0
    for k in range(12):
        clock.run_until(t)
        rt.submit(0, [k])
        jobs = len(ex.jobs)
        while k not in ex.answers and len(ex.jobs) == jobs:  # until its (late) wake
            t += 1.0
            clock.run_until(t)
        if len(ex.jobs) > jobs:  # sent: runs as reserved, from its wake
            run_job(rt, ex.jobs[-1], t, [10.0])
        outcomes.append(ex.answers[k][0])
        t += 5000.0
    assert outcomes[:8] == [DROPPED] * 8  # held to the last moment: the late wake misses it
    assert outcomes[8:] == [ON_TIME] * 4
    assert rt.wake_late_us == 30.0 and plane.wake_guard_us == 31.0


@pytest.mark.parametrize("recalibrate", [False, True])
def test_the_guard_is_recomputed_every_few_samples_also_once_its_windows_are_full(recalibrate):
    """The p99s of the last 256 wakes' lateness and of the last 256 batches' overrun are
    recomputed every 8 samples each: with timers that fire a little later each time (and so
    batches that end later than reserved), the plane's guard moves once per 8 wakes, or at
    most once per 8 wakes and once per 8 batches with recalibration on. (It moved on every
    wake and batch once a window was full, sorting the window each time: the hot path of
    the simulator and of the live router.)"""
    fired = []

    class LaterClock(DelegatingClock):
        late = 0.0

        def call_at(self, t_us, fn):
            self.late += 0.5
            return self.clock.call_at(t_us + self.late, lambda: (fired.append(t_us), fn()))

    topo = make_topology([([0], [10.0, 12.0, 14.0, 16.0], 0.0)], slo_us=100_000.0, batch=4)
    clock = LaterClock()
    ex = HandExecutor()
    moves: list[float] = []

    class CountingPlane(PlaneWrapper):  # the plane, counting its guard's moves
        def set_wake_lateness(self, us):
            moves.append(us)
            self.inner.set_wake_lateness(us)

    plane = CountingPlane(make_data_plane("holding", topo))
    # (the overdue watch, a timer of its own, is left out: only the wakes are counted)
    config = RuntimeConfig(recalibrate=recalibrate, drop_overdue=False)
    rt = ServingRuntime(ServedPlan(topo, plane, vgpu_nodes(topo)), clock, ex, config)
    t = 0.0
    for k in range(300):
        clock.run_until(t)
        rt.submit(0, [k])
        jobs = len(ex.jobs)
        while k not in ex.answers and len(ex.jobs) == jobs:
            t += 100.0
            clock.run_until(t)
        if len(ex.jobs) > jobs:
            run_job(rt, ex.jobs[-1], t, [10.0])
        t += 200_000.0
    assert len(fired) == 300  # a wake per request, nothing else timed
    if recalibrate:
        assert 300 // 8 < len(moves) <= 2 * (300 // 8), len(moves)
    else:
        assert len(moves) == 300 // 8 and moves == sorted(moves), len(moves)


def test_held_batches_go_out_earlier_when_batches_overrun_their_reservations():
    """Stages that run 30 µs over their reservation (a busy host's stage workers, the
    executor's own path) make every lone request, held for batch-mates until its last
    moment, miss its SLO (answered then, dropped: the overdue watch). After 8 such batches
    (stages that found their vGPU idle) the runtime has measured the overrun and the
    plane's wake guard holds its p99 back: lone requests go out that much earlier and are
    on time again."""
    topo = make_topology([([0], [10.0, 12.0, 14.0, 16.0], 0.0)], slo_us=1000.0, batch=4)
    clock = VirtualClock()
    ex = HandExecutor()
    plane = make_data_plane("holding", topo)
    rt = ServingRuntime(ServedPlan(topo, plane, vgpu_nodes(topo)), clock, ex, RuntimeConfig())
    outcomes = []
    t = 0.0
    for k in range(12):
        clock.run_until(t)
        rt.submit(0, [k])
        jobs = len(ex.jobs)
        while len(ex.jobs) == jobs:  # held until its wake
            t += 1.0
            clock.run_until(t)
        run_job(rt, ex.jobs[-1], t, [40.0])  # reserved 10 µs
        outcomes.append(ex.answers[k][0])
        t += 5000.0
    assert outcomes[:8] == [DROPPED] * 8
    assert outcomes[8:] == [ON_TIME] * 4
    assert rt.overrun_us == 30.0 and plane.wake_guard_us == 31.0


def _stage1_nodes(rt) -> list[str]:
    topo, vn = rt.served.topo, rt.served.vgpu_node
    return [vn[v] for v in topo.pools[1].vgpus]


def test_a_drained_node_gets_no_new_batch_its_batches_end_and_undrain_checks_it():
    rt, clock, ex = two_stages()
    changes: list[tuple[str, str]] = []
    rt.on_node_change(lambda node, state, why, t: changes.append((node, state)))
    a, b = _stage1_nodes(rt)
    rt.submit(0, [1])
    (job,) = ex.jobs
    on = job.served.vgpu_node[job.dispatch.hops[1].vgpu]
    assert rt.node_jobs(on) == 1
    assert rt.drain(on) == 1  # its batch is still on it
    assert rt.drained_nodes() == {on} and rt.down_nodes() == set()
    assert rt.live_throughput() == {"m": 50.0}
    run_job(rt, job, 0.0, [10.0, 10.0])  # the batch on it runs to its end
    assert ex.answers[1] == (ON_TIME, "") and rt.node_jobs(on) == 0
    for k in range(4):  # every new batch goes to the other node
        clock.run_until(1000.0 * (k + 1))
        rt.submit(0, [10 + k])
        assert ex.jobs[-1].served.vgpu_node[ex.jobs[-1].dispatch.hops[1].vgpu] != on
        run_job(rt, ex.jobs[-1], clock.now(), [10.0, 10.0])
    assert ex.checks == []  # a drained node is not watched
    with pytest.raises(PoolpipeError, match="serves nothing of the plan"):
        rt.drain("no-such-node")
    ex.node_ok[on] = False  # stopped while drained: undrain finds out at once
    rt.undrain(on)
    assert rt.drained_nodes() == set() and rt.down_nodes() == {on}
    assert changes == [(on, "drained"), (on, "undrained"), (on, "down")]
    assert {a, b} >= {on}


def test_a_node_whose_watch_broke_leaves_at_once_and_returns_only_once_watched_again():
    rt, clock, ex = two_stages(node_check_every_us=1000.0)
    a, _ = _stage1_nodes(rt)
    ex.node_ok[a] = True  # its Triton, shutting down, still answers checks
    rt.node_lost(a, "its process ended (watch connection closed)")
    assert rt.down_nodes() == {a}
    clock.run_until(3500.0)
    assert len(ex.checks) == 3 and rt.down_nodes() == {a}  # answers, but no watch yet
    rt.node_watched(a)  # a new process: the watch connects again
    clock.run_until(4500.0)
    assert rt.down_nodes() == set() and rt.recoveries == 1
    rt.node_lost("not-a-node-of-the-plan", "gone")  # nothing of the plan: nothing changes
    assert rt.down_nodes() == set()


def test_the_sweep_takes_a_node_that_is_not_ready_out_and_leaves_a_busy_one_in():
    rt, clock, ex = two_stages(node_sweep_every_us=1000.0, node_check_every_us=500.0)
    a, b = _stage1_nodes(rt)
    for n in {a, b} | set(rt.served.vgpu_node.values()):
        ex.node_ok[n] = True
    clock.run_until(1000.0)
    assert {n for _, n in ex.checks} == set(rt.served.vgpu_node.values())  # each, traffic or not
    assert rt.down_nodes() == set()
    ex.node_ok[a] = False  # restarted empty, or shutting down
    clock.run_until(2000.0)
    assert rt.down_nodes() == {a}
    ex.node_ok[a] = True  # the driver refilled it
    clock.run_until(2500.0)
    assert rt.down_nodes() == set() and rt.recoveries == 1
    rt.node_checked(b, None)  # no answer in time: busy is not dead
    assert rt.down_nodes() == set()
    rt.stop_sweep()
    n = len(ex.checks)
    clock.run_until(10_000.0)
    assert len(ex.checks) == n


def test_a_check_of_a_plan_rolled_away_says_nothing_of_the_plan_served_now():
    # A sweep's check in flight while a rollout ends: it looked for the old plan's models,
    # which the rollout unloaded; its "not ready" must not take the node out of the new
    # plan (whose models it holds), nor its "ready" put a down node back.
    rt, clock, _ = runtime([([0], [10.0], 0.0)], slo_us=1000.0)
    old = rt.served
    (node,) = set(old.vgpu_node.values())
    new = ServedPlan(rt.topo, make_data_plane("eager", rt.topo), vgpu_nodes(rt.topo))
    rt.switch(new, 1e6, lambda res: None)
    clock.run_until(1.0)
    assert rt.served is new and set(new.vgpu_node.values()) == {node}
    assert rt.node_checked(node, False, "its models are not loaded", old) is False
    assert rt.down_nodes() == set()
    # the plan served now: its check counts, and a stale one cannot bring the node back
    assert rt.node_checked(node, False, "its models are not loaded", new) is False
    assert rt.down_nodes() == {node}
    rt.node_watched(node)
    assert rt.node_checked(node, True, "", old) is False and rt.down_nodes() == {node}
    assert rt.node_checked(node, True, "", new) is True and rt.down_nodes() == set()
    # a recalibration keeps the plan (its plane): a check made before it still counts
    recal = replace(new, topo=new.topo)
    assert rt.node_checked(node, False, "no answer", recal) is False
    assert rt.down_nodes() == {node}


class PendingChecks(HandExecutor):
    """Keeps each node check asked (node, plan) for the test to answer when it likes, as
    the router's checks answer later, over the network."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[str, ServedPlan]] = []

    def check_node(self, node: str, served: ServedPlan) -> None:
        self.pending.append((node, served))


def test_a_down_nodes_check_that_outlived_its_plan_is_asked_again_about_the_plan_now():
    # A down node is asked every check period, each check asked when the last answered.
    # One in flight while a rollout ended (the node lost, the plan rolled out without it)
    # used to be dropped with nothing asked after it: the node, started again, was never
    # seen back, and nothing re-planned for it.
    topo = make_topology([([0], [10.0], 0.0)], slo_us=1000.0)
    clock, ex = VirtualClock(), PendingChecks()
    old = ServedPlan(topo, make_data_plane("eager", topo), vgpu_nodes(topo))
    rt = ServingRuntime(old, clock, ex, RuntimeConfig(node_check_every_us=500.0))
    (node,) = set(old.vgpu_node.values())
    rt.node_lost(node, "its process ended")
    clock.run_until(600.0)
    assert ex.pending == [(node, old)]
    new = ServedPlan(topo, make_data_plane("eager", topo), vgpu_nodes(topo))
    rt.switch(new, 1e6, lambda res: None)
    clock.run_until(700.0)
    assert rt.served is new
    rt.node_watched(node)  # started again
    assert rt.node_checked(node, True, "", ex.pending.pop()[1]) is False  # of the old plan
    assert rt.down_nodes() == {node}
    clock.run_until(1300.0)
    assert ex.pending == [(node, new)]  # asked again, about the plan served now
    assert rt.node_checked(node, True, "", new) is True and rt.down_nodes() == set()


def test_a_window_counts_the_outcomes_of_its_own_arrivals_never_more():
    """A request in flight when its window closes used to be counted as arrived in that
    window and answered in the next (a row with more on time than arrivals). Its window is
    now given out once all its requests are answered, arrivals and outcomes together."""
    rt, clock, ex = runtime([([0], [10.0], 0.0)], slo_us=100.0)
    rt.submit(0, [1])
    run_job(rt, ex.jobs[0], 0.0, [10.0])
    w = rt.take_window().model("m")  # all answered: given out now
    assert (w.arrivals, w.on_time) == (1, 1) and rt.windows_pending == 0
    rt.submit(0, [2])  # arrives at 10, still running when its window closes
    w = rt.take_window().model("m")
    assert (w.arrivals, w.on_time) == (0, 0) and rt.windows_pending == 1
    clock.run_until(30.0)
    rt.submit(0, [3])  # the next window's
    run_job(rt, ex.jobs[1], 10.0, [10.0])
    run_job(rt, ex.jobs[2], 30.0, [10.0])
    w = rt.take_window().model("m")  # both windows, each with its own outcomes
    assert (w.arrivals, w.on_time) == (2, 2) and rt.windows_pending == 0
    assert rt.stats["m"].arrivals == 3 and rt.stats["m"].on_time == 3  # cumulative as ever
    assert rt.take_window().model("m").arrivals == 0


def test_requests_queued_when_their_last_path_leaves_fail_saying_so_not_dropped():
    """A node found gone (its watch, or the sweep) while a request waits in the queue for
    a fuller batch: with no path left, the plane cannot place it; it is answered failed,
    naming the node, as one arriving then would be (it used to be dropped: "deadline cannot
    be met", as if it were only late)."""
    rt, clock, ex = runtime(
        [([0], [10.0, 10.0, 10.0, 10.0], 0.0), ([1], [10.0, 10.0, 10.0, 10.0], 0.0)],
        slo_us=1000.0,
        batch=4,
        plane="holding",  # it waits at any load
    )
    rt.submit(0, [1])  # waits for a fuller batch
    assert not ex.jobs and rt.in_flight() == 1
    (node,) = {rt.served.vgpu_node[v] for v in rt.served.topo.pools[1].vgpus}
    rt.node_lost(node, "its process ended")
    clock.run_until(2000.0)
    outcome, reason = ex.answers[1]
    assert outcome == FAILED and "no live path for model m" in reason and node in reason
