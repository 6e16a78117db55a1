"""The router core without Triton: live recalibration (stage times measured against what was
reserved scale a pool's latencies once their median leaves the band) and statistics reset."""

from __future__ import annotations

import pytest

from poolpipe.scheduler import make_data_plane
from tests.factories import make_topology
from triton_backend.router import RECALIBRATE_EVERY, ModelStats, RouterCore, ServedPlan


@pytest.fixture
def two_pools():
    topo = make_topology([([0], [10.0, 18.0], 0.0), ([1], [5.0, 9.0], 0.0)], batch=2)
    plane = make_data_plane("reservation", topo)
    return topo, plane, ServedPlan(topo, plane, {}, {}, {})


def _core(served: ServedPlan, **kw) -> RouterCore:
    core = RouterCore(served, **kw)
    core._loop.close()  # never started: only the synchronous bookkeeping is exercised
    return core


def test_a_slow_pool_gets_longer_reservations(two_pools):
    topo, plane, served = two_pools
    core = _core(served)
    for _ in range(RECALIBRATE_EVERY - 1):
        core._observe(0, 1.5)
    assert core.topo.pools[0].latency_us[1:] == (10.0, 18.0)  # too few calls yet
    core._observe(0, 1.5)
    assert core.topo.pools[0].latency_us[1:] == (15.0, 27.0)
    assert plane.topo is core.topo  # the data plane reserves with the new latencies
    assert core.topo.pools[1] == topo.pools[1] and core.recalibrations == 1
    for _ in range(RECALIBRATE_EVERY):
        core._observe(1, 1.05)  # inside the band: left alone
    assert core.topo.pools[1] == topo.pools[1] and core.recalibrations == 1


def test_recalibration_can_be_turned_off(two_pools):
    topo, _, served = two_pools
    core = _core(served, recalibrate=False)
    for _ in range(RECALIBRATE_EVERY):
        core._observe(0, 2.0)
    assert core.topo is topo and core.recalibrations == 0


def test_reset_stats_starts_counters_from_zero_and_keeps_what_was_learnt(two_pools):
    _, _, served = two_pools
    core = RouterCore(served).start()
    try:
        core.stats["m"].arrivals = 7
        core.pool_busy_us[1] = 3.0
        for _ in range(RECALIBRATE_EVERY):
            core._observe(0, 2.0)
        learnt = core.topo
        core.reset_stats()
        assert core.stats == {"m": ModelStats()} and core.pool_busy_us == [0.0, 0.0]
        assert core.take_stage_factors() == ((), ())
        assert core.topo is learnt  # recalibrated latencies stay
    finally:
        core.stop()
