"""The runtime's policies one at a time, each through its own small interface and a virtual
clock: the overdue watch, the wake guard, node health and its watch, recalibration, and the
state of a flush migration. (tests/test_runtime.py drives them together.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import Job, Outcome, ServedPlan
from poolpipe.runtime.guard import OVERRUN_CAP_US, WAKE_EVERY, WAKE_WINDOW, WakeGuard
from poolpipe.runtime.health import NodeHealth
from poolpipe.runtime.migration import FlushMigration, HeldRequest
from poolpipe.runtime.overdue import OVERDUE_AFTER_US, OverdueWatch
from poolpipe.runtime.placement import vgpu_nodes
from poolpipe.runtime.recalibration import RECALIBRATE_MAX, Recalibrator
from poolpipe.scheduler import Dispatch, make_data_plane
from poolpipe.sim.engine import VirtualClock
from tests.factories import make_topology


def _job(did: int) -> Job:
    """A job of nothing but its dispatch id: what the watch reads of it is `ended`."""
    return Job(Dispatch(did, 0, 0, 1, [], [], True, 0), [], SimpleNamespace(generation=0))


def test_outcomes_say_what_they_are():
    assert [o.has_result for o in Outcome] == [True, True, False, False, False]
    assert not Outcome.PENDING.is_finished and Outcome.FAILED.is_finished
    assert Outcome.LATE == 1  # stored as small ints where arrays count them


def test_the_overdue_watch_keeps_one_timer_and_skips_ended_jobs():
    clock = VirtualClock()
    seen: list[tuple[str, float]] = []
    later = {"a": 30.0, "b": math.inf, "c": math.inf}

    names = "abc"

    def overdue(job, now):
        name = names[job.dispatch.id]
        seen.append((name, now))
        return later.pop(name, math.inf)

    watch = OverdueWatch(clock, overdue)
    a, b, c = _job(0), _job(1), _job(2)
    watch.add(b, 20.0)
    watch.add(a, 10.0)
    watch.add(c, 25.0)
    c.ended = True  # ended before its SLO: never looked at, and let go at once
    watch.ended(c)
    assert c.watch_slot == -1 and all(j is not c for j in watch._heap.pending())
    assert len(watch) == 3  # (its entry stays until its turn)
    clock.run_until(10.0)
    assert seen == []  # a batch is looked at just after its SLO end, never on it
    clock.run_until(10.0 + OVERDUE_AFTER_US)
    assert seen == [("a", 11.0)]
    clock.run_until(100.0)
    assert seen == [("a", 11.0), ("b", 21.0), ("a", 31.0)]  # a again at its next SLO end
    assert len(watch) == 0 and len(clock) == 0  # no timer left either


def test_the_wake_guard_follows_the_p99_every_few_samples_within_its_cap():
    g = WakeGuard()
    changed = [g.overrun_seen(100.0) for _ in range(WAKE_EVERY)]
    assert changed == [False] * (WAKE_EVERY - 1) + [True]
    assert (g.overrun_us, g.late_us, g.extra_us) == (100.0, 0.0, 100.0)
    assert not any(g.overrun_seen(100.0) for _ in range(WAKE_EVERY))  # same p99: no news
    for _ in range(WAKE_EVERY):
        g.wake_seen(-5.0)  # early wakes count as on time
    assert g.late_us == 0.0
    for _ in range(4 * WAKE_EVERY):
        g.overrun_seen(1e9)
    assert g.overrun_us == OVERRUN_CAP_US
    # the late samples count while they are in the window, and only then
    g = WakeGuard()
    for late in [3000.0] * 3 + [0.0] * (WAKE_WINDOW - 6) + [3000.0] * 3:
        g.wake_seen(late)
    assert g.late_us == 3000.0
    for _ in range(WAKE_EVERY):
        g.wake_seen(0.0)  # the first three leave the window, the last three stay
    assert g.late_us == 3000.0
    changed = [g.wake_seen(0.0) for _ in range(WAKE_WINDOW)]
    assert sum(changed) == 1 and g.late_us == 0.0


def test_node_health_knows_paths_and_watches_a_failed_node_until_it_is_back():
    # one pipeline whose one pool has two vGPUs, each a node of its own
    topo = make_topology([([0, 1], [10.0], 0.0)], slo_us=100.0)
    served = ServedPlan(topo, make_data_plane("eager", topo), vgpu_nodes(topo))
    clock = VirtualClock()
    checks: list[tuple[float, str]] = []
    health = NodeHealth(clock, lambda node: checks.append((clock.now(), node)), 50.0)
    (n0, n1) = sorted(set(served.vgpu_node.values()))
    full = health.live_throughput(served)["m"]
    health.failed(n0, served, 0.0)
    assert health.down == {n0} and health.has_live_path(served, 0)
    assert health.live_throughput(served)["m"] == pytest.approx(full / 2)
    health.failed(n1, served, 0.0)
    assert health.no_path == {0} and "node(s) " + ", ".join(sorted([n0, n1])) in (
        health.no_path_reason(served, 0)
    )
    clock.run_until(50.0)
    assert sorted(checks) == [(50.0, n0), (50.0, n1)]
    health.watch(n0, 50.0)  # not back yet: asked again
    health.back(n1, served, 0.0)
    clock.run_until(200.0)
    assert checks[2:] == [(100.0, n0)] and health.no_path == set()  # n1 is no longer asked


def test_recalibration_scales_a_pool_from_its_served_latencies_within_limits():
    topo = make_topology([([0], [10.0, 20.0], 0.0)])
    r = Recalibrator(topo, every=4, band=0.1)
    assert [r.observe(0, 1.05) for _ in range(4)] == [None] * 4  # inside the band
    news = [r.observe(0, 1.5) for _ in range(4)]
    assert news[:3] == [None] * 3 and news[3] is not None
    assert news[3].pools[0].latency_us[1:] == (15.0, 30.0) and r.scale == [1.5]
    for _ in range(4):
        new = r.observe(0, 10.0)  # far slower: capped
    assert r.scale == [RECALIBRATE_MAX] and new is not None
    assert new.pools[0].latency_us[1:] == (20.0, 40.0)  # from the served ones, not compounded
    assert r.base is topo


def test_a_flush_migration_holds_requests_and_completes_once():
    topo = make_topology([([0], [10.0], 0.0)])
    served = ServedPlan(topo, make_data_plane("eager", topo), vgpu_nodes(topo))
    m = FlushMigration()
    done: list = []
    sw = m.begin(served, 5.0, done.append)
    assert m.paused and m.finishing
    with pytest.raises(PoolpipeError, match="already under way"):
        m.begin(served, 6.0, done.append)
    m.hold(HeldRequest("m", None, "first", 6.0))
    m.hold(HeldRequest("m", 3000.0, "second", 7.0))
    assert m.finish() is sw and m.finish() is None and not m.finishing
    held = m.resume()
    assert [h.payload for h in held] == ["first", "second"] and held[1].slo_us == 3000.0
    assert not m.paused and m.held == [] and m.switch is None
