"""The checked data plane (`--data-plane checked`, poolpipe/scheduler/checked.py) runs the
fast reservation plane and its specification side by side and stops at the first decision
where they differ: it finds none where the fast plane is exact (here, and on every
reservation run of `scripts/digest.py sim --checked`), and stops, naming the call and both
answers, where a difference is planted."""

from __future__ import annotations

import pytest

from poolpipe.scheduler import (
    CheckedPlane,
    PlaneDifference,
    ReservationScheduler,
    checked_plane,
    make_data_plane,
)
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from tests.factories import make_pipelines
from tests.test_probe_equivalence import drive, multi_pipeline_topology

ARRIVALS = [0.7 * i for i in range(120)]


def two_pipelines():
    return multi_pipeline_topology([[[0, 1], [2]], [[3], [4, 5]]], [8.0, 12.0], 1.0)


def test_the_checked_plane_finds_no_difference_and_serves_the_fast_planes_decisions():
    topo = two_pipelines()
    checked = checked_plane(topo)
    log = drive(checked, ARRIVALS, [0.6, 1.0, 1.3], False, fails={5, 17})
    assert log == drive(ReservationScheduler(topo), ARRIVALS, [0.6, 1.0, 1.3], False, fails={5, 17})
    assert checked.calls > len(ARRIVALS) and checked.probes == checked.fast.probes > 0
    assert make_data_plane("checked", topo).name == "checked"
    assert make_data_plane("reference", topo).name == "reference"


def test_a_planted_tie_break_is_caught_at_its_first_decision():
    """The fast plane's scan of the first pool starts one vGPU later than its reference's:
    equally good idle vGPUs, another chosen, the very first dispatch differs."""
    topo = two_pipelines()
    fast = ReservationScheduler(topo)
    fast.prober.rr[0] = 1
    checked = CheckedPlane(fast, ReservationScheduler(topo, reference=True))
    with pytest.raises(PlaneDifference, match=r"call \d+ \(decide\)") as err:
        drive(checked, ARRIVALS, [1.0], False)
    message = str(err.value)
    assert "fast:" in message and "reference:" in message and "--data-plane reference" in message


def test_a_planted_policy_difference_is_caught():
    """The fast plane dispatching what is queued at once (eager), its reference waiting for
    fuller batches: the first batch held apart is a difference."""
    topo = make_pipelines([[([0], [10.0, 12.0, 14.0, 16.0], 0.0)]], batch=4, slo_us=200.0)
    checked = CheckedPlane(
        ReservationScheduler(topo, "eager"), ReservationScheduler(topo, reference=True)
    )
    with pytest.raises(PlaneDifference):
        drive(checked, [float(i) for i in range(20)], [1.0], False)


def test_the_simulator_runs_the_checked_plane_through_a_failure_and_a_rollout():
    topo = two_pipelines()
    res = run_once(
        topo, ArrivalSpec("poisson"), 0.9, SimConfig(0.05, seed=3, jitter=0.2), "checked"
    )
    assert res.data_plane == "checked" and res.batches > 0
