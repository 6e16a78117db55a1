"""The data plane stepped by hand: reservation tables, probe/reserve on hand-worked pools,
the drop / wait / dispatch branches, feedback correction, overload rejection."""

from __future__ import annotations

import bisect
import math
from dataclasses import astuple, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.errors import ClusterError, PoolpipeError
from poolpipe.scheduler import (
    ReactiveScheduler,
    Request,
    ReservationScheduler,
    ReservationTable,
    StageReport,
    earliest_common_slot,
    make_data_plane,
)
from poolpipe.scheduler.messages import (
    DROP_CANNOT_MEET,
    DROP_DEADLINE_PASSED,
    DROP_OVERLOAD,
    Dispatch,
)
from poolpipe.scheduler.topology import with_inputs, with_latencies
from tests.factories import make_pipelines, make_requests, make_topology

# ----------------------------------------------------------------------------- tables


def test_earliest_slot_fills_gaps_that_are_long_enough():
    t = ReservationTable()
    t.reserve(10, 20, 1)
    t.reserve(25, 40, 2)
    assert t.earliest_slot(0, 10) == 0  # fits before the first interval
    assert t.earliest_slot(0, 11) == 40  # 0..11 hits [10,20); the 5 µs gap is too short
    assert t.earliest_slot(12, 5) == 20  # inside an interval: after it, and the gap fits
    assert t.earliest_slot(21, 5) == 40
    assert t.earliest_slot(50, 1) == 50


def test_common_slot_needs_both_resources_free_at_once():
    up, down = ReservationTable(), ReservationTable()
    up.reserve(0, 10, 1)
    down.reserve(12, 20, 2)
    # up frees at 10, but a 5 µs transfer from 10 would run into down's [12, 20)
    assert earliest_common_slot((up, down), 0, 5) == 20
    assert earliest_common_slot((up, down), 0, 2) == 10


def test_correct_replaces_the_reserved_interval_and_forget_drops_the_past():
    t = ReservationTable()
    t.reserve(0, 10, 7)
    assert t.correct(7, 3, 15, now=5)  # started late, runs to 15
    assert t.intervals() == [(3, 15)]
    assert t.earliest_slot(5, 1) == 15
    t.forget_before(15)
    assert len(t) == 0
    assert not t.correct(7, 3, 15, now=20)  # unknown now, and already over: nothing kept
    assert len(t) == 0


def _plain_slot(intervals: list[tuple[float, float]], t: float, duration: float) -> float:
    """earliest_slot as a plain scan of the intervals (sorted by start), without a memo."""
    cand = t
    for start, end in intervals:
        if end <= cand:
            continue
        if start >= cand + duration:
            break
        cand = end
    return cand


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "correct", "forget", "query", "query"]),
        st.integers(0, 200),
        st.integers(1, 40),
        st.sampled_from([3, 7]),
    ),
    max_size=60,
)


def test_earliest_slot_forgets_its_memo_whenever_the_table_changes():
    """Each change of a table ends what earliest_slot remembers: a reservation, one taken
    back by a correction, intervals forgotten (then a query of the past finds them free)."""
    t = ReservationTable()
    assert t.earliest_slot(0, 5) == 0
    t.reserve(0, 10, 1)
    assert t.earliest_slot(0, 5) == 10
    assert t.earliest_slot(4, 5) == 10  # from the memo: [0, 10] answers 10
    t.correct(1, 0, 10, now=30)  # over before now: gone, nothing replaces it
    assert t.earliest_slot(4, 5) == 4
    t.reserve(10, 20, 2)
    assert t.earliest_slot(12, 5) == 20
    t.forget_before(25)
    assert t.earliest_slot(15, 5) == 15


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_earliest_slot_remembers_its_last_answer_only_while_the_table_is_unchanged(ops):
    """earliest_slot answers a query within [t, answer] of its last one from memory: any
    sequence of reservations, corrections, forgetting and queries (queries in a row the
    memo answers) gives what a plain scan of the table's intervals gives."""
    t = ReservationTable()
    keys: list[int] = []
    asked, last = 0.0, 0.0
    for op, a, n, d in ops:
        if op == "reserve":
            keys.append(len(keys) + 1)
            t.reserve(float(a), float(a + n), keys[-1])
        elif op == "correct" and keys:
            # half of them end before `now`: the reservation goes and nothing replaces it
            now = float(a + n) if d == 7 else 0.0
            t.correct(keys[a % len(keys)], float(a), float(a + n), now=now)
        elif op == "forget":
            t.forget_before(float(a))
        else:
            # the last query's time and answer again (the memo's, unless the table changed
            # since), then a time of the op's own and one past it
            for q in (asked, last, float(a), float(a) + n / 2):
                got = t.earliest_slot(q, float(d))
                assert got == _plain_slot(t.intervals(), q, float(d))
            asked, last = float(a) + n / 2, got


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_a_table_keeps_what_a_sorted_list_keeps(ops):
    """A table's buffer is reused in place (ended intervals moved out at the front, room
    left at the back for later reservations): under any sequence of reservations,
    corrections and forgetting it holds exactly what a sorted list of (start, end, key)
    holds, kept the plain way."""
    t = ReservationTable()
    plain: list[tuple[float, float, int]] = []
    keys = 0
    for op, a, n, d in ops:
        if op == "reserve" or (not plain and op == "correct"):
            keys += 1
            t.reserve(float(a), float(a + n), keys)
            bisect.insort_right(plain, (float(a), float(a + n), keys))
        elif op == "correct":
            key = plain[a % len(plain)][2]
            now = float(a + n) if d == 7 else 0.0  # half of them: over before now, gone
            assert t.correct(key, float(a), float(a + n), now=now)
            plain = [x for x in plain if x[2] != key]
            if a + n > now:
                bisect.insort_right(plain, (float(a), float(a + n), key))
        elif op == "forget":
            t.forget_before(float(a))
            while plain and plain[0][1] <= a:
                plain.pop(0)
        assert t.intervals() == [(s, e) for s, e, _ in plain]
        assert len(t) == len(plain)
        for q in (float(a), float(a + n)):
            assert t.earliest_slot(q, float(d)) == _plain_slot(t.intervals(), q, float(d))


# ----------------------------------------------------------------------------- probe


def two_stage(**kw):
    # stage 0: two vGPUs on server 0, 10 µs; stage 1: one vGPU on server 1, 5 µs, 2 µs/sample
    return make_topology([([0, 0], [10.0, 16.0], 0.0), ([1], [5.0, 8.0], 2.0)], **kw)


def test_probe_two_stage_pool_by_hand():
    s = ReservationScheduler(two_stage(batch=2))
    pipe = s.topo.pipelines[0]
    pr = s.probe(pipe, 1, now=0.0)
    path = [astuple(h) for h in pr.path]
    assert (pr.wait_us, pr.finish_us) == (0.0, 17.0)  # compute 0-10, transfer 10-12, 12-17
    assert path[0][5:] == (0.0, 10.0)
    assert path[1][3:] == (10.0, 12.0, 12.0, 17.0)
    s.prober.reserve(pr.path, 0, 0.0)
    # Second batch: the other stage-0 vGPU is free, but the shared uplink of server 0 is
    # busy 10-12 and the stage-1 vGPU until 17.
    pr = s.probe(pipe, 1, now=0.0)
    path = [astuple(h) for h in pr.path]
    assert path[0][1] == 1  # the first stage-0 vGPU is taken until 10
    assert path[1][3:] == (12.0, 14.0, 17.0, 22.0)
    assert pr.finish_us == 22.0
    assert pr.wait_us == pytest.approx((12 - 10) + (17 - 14))
    # Batch 2 takes longer everywhere: 16 + 4 + 8
    s2 = ReservationScheduler(two_stage(batch=2))
    assert s2.probe(pipe, 2, now=0.0).finish_us == 28.0


def test_downlink_contention_between_two_senders():
    # Two stage-0 vGPUs on different servers send to one stage-1 server (two vGPUs there).
    topo = make_topology([([0, 1], [10.0], 0.0), ([2, 2], [5.0], 4.0)])
    s = ReservationScheduler(topo)
    pipe = topo.pipelines[0]
    first = s.probe(pipe, 1, 0.0)
    s.prober.reserve(first.path, 0, 0.0)
    second = s.probe(pipe, 1, 0.0)
    # its own uplink is free at 10, but server 2's downlink carries the first until 14
    assert second.path[0].vgpu != first.path[0].vgpu
    assert (second.path[1].transfer_start_us, second.path[1].transfer_end_us) == (14.0, 18.0)
    assert second.finish_us == 23.0


def test_inputs_cross_the_first_servers_downlink_one_batch_at_a_time():
    # One pool of two vGPUs on server 0, 10 µs a batch; each request's inputs take 4 µs on
    # the server's downlink (topology.with_inputs): a second batch at once waits for the
    # link, not for a vGPU; on another server it would not wait at all.
    topo = make_topology([([0, 0], [10.0], 0.0)], inputs=4.0)
    s = ReservationScheduler(topo)
    pipe = topo.pipelines[0]
    first = s.probe(pipe, 1, 0.0)
    assert astuple(first.path[0])[2:] == (-1, 0.0, 4.0, 4.0, 14.0)
    assert (first.start_us, first.finish_us, first.wait_us) == (0.0, 14.0, 0.0)
    s.prober.reserve(first.path, 0, 0.0)
    second = s.probe(pipe, 1, 0.0)
    assert second.path[0].vgpu != first.path[0].vgpu
    assert astuple(second.path[0])[2:] == (-1, 4.0, 8.0, 8.0, 18.0)
    assert (second.start_us, second.wait_us) == (4.0, 4.0)  # it leaves when the link is free
    # the first batch failed before its inputs went out: the link is free again
    s._inflight.add(Dispatch(0, 0, 0, 1, [], first.path, True, 0))
    s.on_dispatch_failed(0, 0, 0.0)
    assert astuple(s.probe(pipe, 1, 0.0).path[0])[3:5] == (0.0, 4.0)
    other = make_topology([([0, 1], [10.0], 0.0)], inputs=4.0)
    s = ReservationScheduler(other)
    s.prober.reserve(s.probe(other.pipelines[0], 1, 0.0).path, 0, 0.0)
    assert s.probe(other.pipelines[0], 1, 0.0).finish_us == 14.0


def test_a_feature_map_does_not_overtake_the_compute_reserved_before_it():
    # Stage 1's vGPU is reserved 20-30 for another batch (its feature map in by 20). Ours
    # could be in at 12 and run at 30; in at 12, it would reach the node first, and a node
    # runs its queue in arrival order: ours would run first and the other batch late. So
    # it is sent to arrive once the other is due to start (18-20); the compute is as before.
    topo = make_topology([([0], [10.0], 0.0), ([1], [10.0], 2.0)])
    s = ReservationScheduler(topo)
    s.tables.vgpu[1].reserve(20.0, 30.0, 12345)
    path = s.probe(topo.pipelines[0], 1, 0.0).path
    assert astuple(path[1])[3:] == (18.0, 20.0, 30.0, 40.0)
    # nothing reserved ahead of it: it goes at once
    s = ReservationScheduler(topo)
    assert astuple(s.probe(topo.pipelines[0], 1, 0.0).path[1])[3:] == (10.0, 12.0, 12.0, 22.0)


def test_with_inputs_times_the_first_pools_inputs_at_the_nic_bandwidth():
    topo = make_topology([([0], [10.0], 0.0), ([1], [5.0], 2.0)])
    timed = with_inputs(topo, {"m": 1e6}, 8.0)  # 8 Mbit at 8 Gbit/s: 1 ms a request
    assert [p.transfer_in_us for p in timed.pools] == [1000.0, 2.0]
    assert with_inputs(topo, {"other": 1e6}, 8.0) == topo
    with pytest.raises(ClusterError, match="bandwidth"):
        with_inputs(topo, {"m": 1e6}, 0.0)


# ----------------------------------------------------------------------------- batching


def test_waits_for_a_fuller_batch_then_dispatches_at_the_last_moment():
    topo = two_stage(batch=2, slo_us=100.0)
    s = ReservationScheduler(topo, light_load=0.0)
    (r0,) = make_requests(1, slo_us=100.0)
    s.add_request(r0, 0.0)
    d = s.decide(0.0)
    assert d.dispatches == [] and d.drops == []
    # batch of 1 finishes 17 µs after dispatch; the deadline is 100: wait until ~83
    assert d.wake_at_us == pytest.approx(83.0 - 1.0)
    d = s.decide(d.wake_at_us)
    assert len(d.dispatches) == 1
    assert [r.id for r in d.dispatches[0].requests] == [0]
    assert d.dispatches[0].hops[-1].end_us <= r0.deadline_us


def test_at_a_light_load_a_short_batch_goes_at_once_and_is_held_once_the_load_needs_batches():
    """A lone request is not held for batch-mates while the model's arrivals are at most
    LIGHT_LOAD of what its pipelines serve at batch 1 (here 100 req/s: one vGPU, 10 ms):
    holding would only spend its time. Once it arrives at 100 req/s (above the half: batches
    are what keeps up), a lone request is held for its last moment again."""
    topo = make_topology([([0], [10000.0, 12000.0], 0.0)], batch=2, slo_us=100000.0)
    s = ReservationScheduler(topo)
    held = ReservationScheduler(topo, light_load=0.0)  # as the published plane does
    (r0,) = make_requests(1, slo_us=100000.0)
    for plane in (s, held):
        plane.add_request(r0, 0.0)
    d = s.decide(0.0)
    assert [x.requests for x in d.dispatches] == [[r0]] and d.wake_at_us is None
    assert d.dispatches[0].hops[0].start_us == 0.0  # no wait: the vGPU is idle
    h = held.decide(0.0)
    assert h.dispatches == [] and h.wake_at_us == pytest.approx(100000.0 - 10000.0 - 1.0)
    # one second at 100 req/s, each alone on an idle vGPU when it arrives
    sent_at_once = []
    for r in make_requests(101, start_us=20000.0, gap_us=10000.0, slo_us=100000.0)[1:]:
        s.add_request(r, r.arrival_us)
        d = s.decide(r.arrival_us)
        sent_at_once.append(bool(d.dispatches) and d.dispatches[0].requests[0] is r)
        if not d.dispatches:  # held: the next arrival completes the batch of two
            break
    assert 0.5 * 100 / 1e6 < s.arrival_rate(0, r.arrival_us) < 100 / 1e6
    assert sent_at_once[:10] == [True] * 10 and sent_at_once[-1] is False
    assert 50 <= len(sent_at_once) <= 100
    with pytest.raises(PoolpipeError, match="light_load"):
        ReservationScheduler(topo, light_load=1.0)


def test_at_a_light_load_a_request_behind_a_busy_pipeline_waits_only_until_it_frees():
    """Four requests at once (a client's burst) at a light load: the first goes at once,
    alone; the three after it are held until its vGPU frees (10 ms), not for their last
    moment (90 ms), and go together."""
    topo = make_topology([([0], [10000.0, 12000.0, 13000.0, 14000.0], 0.0)], batch=4, slo_us=1e5)
    s = ReservationScheduler(topo)
    r = make_requests(4, slo_us=1e5)
    s.add_request(r[0], 0.0)
    assert [x.requests for x in s.decide(0.0).dispatches] == [[r[0]]]
    for k in (1, 2, 3):
        s.add_request(r[k], 1.0)
    d = s.decide(1.0)
    assert d.dispatches == [] and d.wake_at_us == pytest.approx(10000.0 - 1.0)
    d = s.decide(d.wake_at_us)
    assert [x.requests for x in d.dispatches] == [r[1:]]


def test_a_request_joining_a_held_batch_moves_its_last_moment_earlier():
    # Found on a real H200 (scripts/bench_gpu.py): a ResNet-50 alone on one vGPU, batch 1
    # 3.3 ms, batch 2 5.0 ms. Woken at the last moment of a batch of one, a batch of two no
    # longer fit: the head went alone, and the newcomer behind it was dropped at 50 req/s.
    topo = make_topology([([0], [3300.0, 5000.0, 6500.0, 7000.0], 0.0)], batch=4, slo_us=16500.0)
    s = ReservationScheduler(topo, light_load=0.0)
    r0, r1 = make_requests(2, gap_us=5000.0, slo_us=16500.0)
    s.add_request(r0, 0.0)
    d = s.decide(0.0)
    assert d.dispatches == [] and d.wake_at_us == pytest.approx(16500.0 - 3300.0 - 1.0)
    assert s.add_request(r1, 5000.0)  # to be decided again: two take longer than one
    d = s.decide(5000.0)
    assert d.dispatches == [] and d.wake_at_us == pytest.approx(16500.0 - 5000.0 - 1.0)
    d = s.decide(d.wake_at_us)
    assert [[r.id for r in x.requests] for x in d.dispatches] == [[0, 1]] and d.drops == []
    assert d.dispatches[0].hops[-1].end_us <= r0.deadline_us


def test_a_head_the_least_waiting_pipeline_cannot_meet_goes_to_one_that_can():
    # Found on emulated hc2-large@32 (repvgg-b3: a two-stage pipeline at batch 1 beside the
    # whole model at batch 2 on one L4): the least waiting pipeline at its planned batch
    # could not meet a late head, the busy one could at a smaller batch; the head was
    # dropped. Pipeline 0 takes 30 µs; pipeline 1 takes 10 at batch 1, 18 at batch 2.
    topo = make_pipelines([[([0], [30.0], 0.0)], [([1], [10.0, 18.0], 0.0)]], slo_us=50.0)
    topo = replace(topo, pipelines=(topo.pipelines[0], replace(topo.pipelines[1], batch=2)))
    s = ReservationScheduler(topo)
    for r in make_requests(2, slo_us=50.0):
        s.add_request(r, 0.0)
    d = s.decide(0.0)  # both on pipeline 1, its vGPU busy until 18
    assert [(x.pipeline, x.batch) for x in d.dispatches] == [(1, 2)]
    late = Request(2, 0, 5.0, 30.0)  # a short SLO: pipeline 0 would end at 35
    s.add_request(late, 5.0)
    d = s.decide(5.0)
    assert d.drops == [], d.drops
    assert [(x.pipeline, [r.id for r in x.requests]) for x in d.dispatches] == [(1, [2])]
    assert d.dispatches[0].hops[-1].end_us <= late.deadline_us


def test_a_hold_of_round_off_length_dispatches_rather_than_waking_at_the_same_instant():
    # Found by the simulator hanging: a wake at now + slack - guard came back with a slack
    # above the guard by a round-off, so the plane asked to be woken at now + (a few ulp),
    # which is now in floating point: the virtual clock woke it at the same instant for ever.
    lat, guard, now = 9937.506, 23037.03669380513, 2912533.834256217
    s = ReservationScheduler(
        make_topology([([0], [lat, 2 * lat, 3 * lat], 0.0)], batch=3), wake_guard_us=guard
    )
    finish = s.probe(s.topo.pipelines[0], 1, now).finish_us
    deadline = finish + guard
    while not (deadline - finish > guard and now + (deadline - finish - guard) == now):
        deadline = math.nextafter(deadline, math.inf)
    (r,) = make_requests(1, start_us=deadline - 50_000.0, slo_us=50_000.0)
    s.add_request(r, now)
    d = s.decide(now)
    assert len(d.dispatches) == 1 or (d.wake_at_us is not None and d.wake_at_us > now)


def test_dispatches_when_the_planned_batch_is_there():
    s = ReservationScheduler(two_stage(batch=2))
    for r in make_requests(2, gap_us=1.0):
        s.add_request(r, r.arrival_us)
    d = s.decide(1.0)
    assert len(d.dispatches) == 1 and d.dispatches[0].batch == 2
    assert len(d.dispatches[0].requests) == 2


def test_drops_a_request_whose_deadline_no_batch_can_meet():
    s = ReservationScheduler(two_stage(batch=2, slo_us=10.0))
    (r,) = make_requests(1, slo_us=10.0)  # the fastest path takes 17 µs
    s.add_request(r, 0.0)
    d = s.decide(0.0)
    assert [(x.request.id, x.reason) for x in d.drops] == [(0, DROP_CANNOT_MEET)]
    expired = make_requests(1, start_us=0.0, slo_us=5.0)[0]
    s.add_request(expired, 0.0)
    d = s.decide(6.0)
    assert [x.reason for x in d.drops] == [DROP_DEADLINE_PASSED]


def test_smaller_batch_when_the_planned_one_would_be_late():
    # batch 2 takes 28 µs end to end, batch 1 takes 17; the deadline allows 20
    s = ReservationScheduler(two_stage(batch=2, slo_us=20.0))
    for r in make_requests(3, slo_us=20.0):
        s.add_request(r, 0.0)
    d = s.decide(0.0)
    assert [x.batch for x in d.dispatches][:1] == [1]
    assert all(x.hops[-1].end_us <= 20.0 for x in d.dispatches)


def test_a_shorter_slo_queued_behind_longer_ones_goes_first_not_late():
    # one vGPU: batch 1 takes 5 µs, batch 2 takes 12. Two requests with 100 µs wait for a
    # fuller batch; then one with 8 µs arrives. In arrival order it would ride in a batch
    # of 2 timed for the others (ends at 13 > 9); in deadline order it goes first, alone.
    s = ReservationScheduler(make_topology([([0], [5.0, 12.0], 0.0)], batch=2, slo_us=100.0))
    a, b = make_requests(2, slo_us=100.0)
    for r in (a, b):
        s.add_request(r, 0.0)
    tight = make_requests(1, start_us=1.0, slo_us=8.0)[0]
    tight.id = 2
    s.add_request(tight, 1.0)
    assert [r.id for r in s.models.queues[0]] == [2, 0, 1]
    d = s.decide(1.0)
    for x in d.dispatches:
        for r in x.requests:
            assert x.hops[-1].end_us <= r.deadline_us, (r.id, x.hops[-1].end_us)
    assert d.dispatches[0].requests[0].id == 2
    # equal deadlines keep their arrival order (uniform SLOs: FIFO as before)
    s2 = ReservationScheduler(make_topology([([0], [5.0, 12.0], 0.0)], batch=2, slo_us=100.0))
    for r in make_requests(4, gap_us=1.0, slo_us=100.0):
        s2.add_request(r, r.arrival_us)
    assert [r.id for r in s2.models.queues[0]] == [0, 1, 2, 3]


def test_a_new_head_the_booked_up_pool_cannot_serve_at_the_planned_batch_is_dropped():
    # one vGPU: batch 1 takes 5 µs, batch 2 takes 12; two batches of 2 book it until 24
    s = ReservationScheduler(make_topology([([0], [5.0, 12.0], 0.0)], batch=2, slo_us=30.0))
    for r in make_requests(4, slo_us=30.0):
        s.add_request(r, 0.0)
    assert [x.batch for x in s.decide(0.0).dispatches] == [2, 2]
    late = make_requests(1, start_us=1.0, slo_us=30.0)[0]
    late.id = 4
    s.add_request(late, 1.0)
    d = s.decide(1.0)
    # batch 2 would end at 36 > 31 (an idle vGPU would make it by 13); batch 1 would end at
    # 29, but running it would cost the capacity the later requests need: dropped
    assert d.dispatches == []
    assert [(x.request.id, x.reason) for x in d.drops] == [(4, DROP_CANNOT_MEET)]


def test_under_a_backlog_a_batch_is_held_until_its_start_and_grows():
    # the plan's batch is 1; the profile also has batches 2 and 3 (12 and 14 µs)
    s = ReservationScheduler(make_topology([([0], [10.0, 12.0, 14.0], 0.0)], slo_us=100.0))
    reqs = make_requests(4, gap_us=1.0, slo_us=100.0)
    s.add_request(reqs[0], 0.0)
    first = s.decide(0.0).dispatches  # an idle vGPU: no reason to hold
    assert [x.batch for x in first] == [1]
    s.add_request(reqs[1], 1.0)
    d = s.decide(1.0)
    assert d.dispatches == [] and d.wake_at_us == pytest.approx(10.0 - 1.0)  # booked until 10
    for r in reqs[2:]:
        s.add_request(r, r.arrival_us)
        assert s.decide(r.arrival_us).dispatches == []
    (grown,) = s.decide(9.0).dispatches
    assert grown.batch == 3 and [r.id for r in grown.requests] == [1, 2, 3]
    assert (grown.hops[0].start_us, grown.hops[0].end_us) == (10.0, 24.0)


def test_eager_never_waits_and_deferred_waits_less_than_adaptive():
    wakes = {}
    for policy in ("adaptive", "deferred", "eager"):
        s = ReservationScheduler(two_stage(batch=2), policy, light_load=0.0)
        s.add_request(make_requests(1)[0], 0.0)
        d = s.decide(0.0)
        wakes[policy] = (len(d.dispatches), d.wake_at_us)
    assert wakes["eager"] == (1, None)
    assert wakes["adaptive"][0] == wakes["deferred"][0] == 0
    # deferred goes once a batch of 2 could no longer fit (28 µs), adaptive holds to 17
    assert wakes["deferred"][1] == pytest.approx(100 - 28 - 1)
    assert wakes["deferred"][1] < wakes["adaptive"][1]


def test_feedback_correction_moves_later_probes():
    s = ReservationScheduler(make_topology([([0], [10.0], 0.0)]))
    pipe = s.topo.pipelines[0]
    s.add_request(make_requests(1)[0], 0.0)
    d = s.decide(0.0).dispatches[0]
    assert s.probe(pipe, 1, 0.0).finish_us == 20.0  # next batch queued behind 0-10
    # it really started at 4 (so ends at 14 as far as we know), then ran until 18
    s.on_stage_started(StageReport(d.id, 0, 4.0, None), 4.0)
    assert s.probe(pipe, 1, 4.0).finish_us == 24.0
    s.on_stage_done(StageReport(d.id, 0, 4.0, 18.0), 18.0)
    assert s.probe(pipe, 1, 18.0).finish_us == 28.0


def test_new_latencies_apply_to_later_reservations_only():
    topo = make_topology([([0], [10.0], 0.0)], slo_us=1000.0)
    s = ReservationScheduler(topo)
    pipe = topo.pipelines[0]
    s.add_request(make_requests(1, slo_us=1000.0)[0], 0.0)
    first = s.decide(0.0).dispatches[0]
    assert (first.hops[0].start_us, first.hops[0].end_us) == (0.0, 10.0)
    slower = with_latencies(topo, {0: (float("nan"), 25.0)})
    s.set_latencies(slower)
    assert s.probe(pipe, 1, 0.0).finish_us == 35.0  # behind the 0-10 reservation, now 25 long
    s.add_request(make_requests(1, start_us=1.0, slo_us=1000.0)[0], 1.0)
    second = s.decide(1.0).dispatches[0]
    assert (second.hops[0].start_us, second.hops[0].end_us) == (10.0, 35.0)


def test_overload_is_rejected_explicitly():
    s = make_data_plane("reservation", two_stage(batch=2), max_queue=2)
    for r in make_requests(3):
        s.add_request(r, 0.0)
    d = s.decide(0.0)
    assert [x.reason for x in d.drops] == [DROP_OVERLOAD]
    assert sum(len(x.requests) for x in d.dispatches) == 2


def test_unknown_data_plane_and_policy_are_named():
    with pytest.raises(PoolpipeError, match="unknown data plane 'fast'"):
        make_data_plane("fast", two_stage())
    with pytest.raises(PoolpipeError, match="unknown batching policy"):
        ReservationScheduler(two_stage(), "lazy")


def test_reactive_batches_at_the_first_pool_and_hands_batches_on():
    s = ReactiveScheduler(two_stage(batch=2, slo_us=100.0))
    for r in make_requests(3):
        s.add_request(r, 0.0)
    d = s.decide(0.0)
    # two idle stage-0 vGPUs: a batch of 2, then the remaining one
    assert sorted(len(x.requests) for x in d.dispatches) == [1, 2]
    assert all(not x.final for x in d.dispatches)
    first = d.dispatches[0]
    assert s.on_stage_done(StageReport(first.id, 0, 0.0, 16.0), 16.0)
    d2 = s.decide(16.0)
    assert len(d2.dispatches) == 1 and d2.dispatches[0].final
    assert d2.dispatches[0].hops[0].src_vgpu == first.hops[0].vgpu


@pytest.mark.parametrize("plane", ["reservation", "reactive"])
def test_a_vgpu_taken_down_gets_no_work_until_it_is_back(plane):
    """Two vGPUs in one pool: the one that failed is skipped; with none left the request is
    dropped explicitly; once back, work goes to it again."""
    from poolpipe.scheduler import Request, make_data_plane

    topo = make_topology([([0, 1], [10.0], 0.0)], slo_us=100.0)
    dp = make_data_plane(plane, topo)
    dp.set_vgpu_down(0, True, now=0.0)
    dp.add_request(Request(0, 0, 0.0, 100.0), 0.0)
    d = dp.decide(0.0)
    assert [h.vgpu for x in d.dispatches for h in x.hops] == [1]
    dp.set_vgpu_down(1, True, now=1.0)
    dp.add_request(Request(1, 0, 1.0, 101.0), 1.0)
    d = dp.decide(1.0)
    if plane == "reservation":
        assert not d.dispatches and [x.request.id for x in d.drops] == [1]
    else:  # the reactive plane queues until a vGPU is free
        assert not d.dispatches and not d.drops
    dp.set_vgpu_down(0, False, now=2.0)
    dp.add_request(Request(2, 0, 2.0, 102.0), 2.0)
    d = dp.decide(2.0)
    assert {h.vgpu for x in d.dispatches for h in x.hops} == {0}


def test_a_pipeline_longer_than_the_reservation_keys_hold_is_refused_naming_the_limit():
    """A hop's reservation key is dispatch * 64 + hop * 2 and a job's idle hops a 64-bit
    mask: 31 partitions serve, 32 would make one dispatch's keys collide with the next's."""
    from poolpipe.scheduler.topology import MAX_HOPS

    def chain(hops: int):
        return make_topology([([i], [1.0], 1.0 if i else 0.0) for i in range(hops)])

    topo = chain(MAX_HOPS)
    dp = ReservationScheduler(topo)
    dp.add_request(Request(0, 0, 0.0, 1e6), 0.0)
    [d] = dp.decide(0.0).dispatches
    assert [h.vgpu for h in d.hops] == list(range(MAX_HOPS))  # every hop, in order
    with pytest.raises(ClusterError, match=f"32 partitions.*at most {MAX_HOPS}.*--max-partitions"):
        chain(MAX_HOPS + 1)


def test_a_pipeline_whose_later_pool_is_all_down_loses_to_a_healthy_one():
    """Every vGPU of pipeline 0's second pool is down: its probe is LOST (waits for ever),
    and each request goes to pipeline 1. (A probe once chose vGPU -1 there with a negative
    wait, which won the comparison: every request was dropped as unmeetable.)"""
    topo = make_pipelines(
        [
            [([0], [10.0, 12.0], 1.0), ([1], [10.0, 12.0], 1.0)],
            [([2], [14.0, 16.0], 1.0), ([3], [14.0, 16.0], 1.0)],
        ],
        batch=1,
        slo_us=100.0,
    )
    s = ReservationScheduler(topo)
    s.set_vgpu_down(topo.pools[topo.pipelines[0].pools[1]].vgpus[0], True, 0.0)
    for i in range(3):
        s.add_request(Request(i, 0, float(i), float(i) + 100.0), float(i))
        out = s.decide(float(i))
        assert not out.drops and [d.pipeline for d in out.dispatches] == [1]
    lost = s.probe(topo.pipelines[0], 1, 5.0)
    assert lost.wait_us == lost.finish_us == math.inf and lost.path == []
