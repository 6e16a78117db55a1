"""Applications simulated through the serving runtime: the coordinator's parts (fan-out,
fan-in), each request answered once and as a whole, on real plans of hand-made models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolpipe.domain.apps import parse_apps
from poolpipe.errors import PoolpipeError
from poolpipe.planner.apps import AppPlanRequest, app_plan_document, part_name, plan_apps
from poolpipe.sim.apps import run_apps, served_apps, simulate_apps
from poolpipe.sim.engine import SimConfig
from tests.conftest import tiny_cluster, tiny_model

P = tiny_model("p", {("A", 1): [[2000.0, 3000.0, 4000.0, 5000.0]]}, [])
Q = tiny_model("q", {("A", 1): [[8000.0, 9000.0, 10000.0, 11000.0]]}, [])
R = tiny_model("r", {("A", 1): [[1000.0, 1500.0, 2000.0, 2500.0]]}, [])
PROFILES = {"p": P, "q": Q, "r": R}


def _planned(spec: dict, gpus: int = 4):
    apps = parse_apps(spec, "test", list(PROFILES))
    req = AppPlanRequest(
        tuple(apps),
        {m: PROFILES[m] for a in apps for m in a.models},
        tiny_cluster([("A", gpus, 1, (1,))]),
        margin=0.3,
    )
    plan = plan_apps(req)
    doc, profiles = app_plan_document(req, plan)
    return apps, plan, doc, profiles


def _chain(fanout) -> dict:
    edge = {"from": "p", "to": "q", "fanout": fanout}
    return {"apps": [{"name": "a", "slo_ms": 40, "edges": [edge]}]}


def test_a_chain_with_fan_out_two_makes_three_parts_a_request():
    apps, plan, doc, profiles = _planned(_chain(2))
    planned = {"p": plan.budgets[("a", "p")], "q": plan.budgets[("a", "q")]}
    assert doc.meta["apps"]["a"]["planned_budgets_us"] == planned
    served = doc.meta["apps"]["a"]["budgets_us"]  # the planned ones, filling the SLO
    assert served["p"] + served["q"] == pytest.approx(40_000)
    assert served["p"] / served["q"] == pytest.approx(planned["p"] / planned["q"])
    assert [m.name for m in doc.models] == [part_name("a", "p"), part_name("a", "q")]
    rate = 0.5 * plan.rates["a"]
    res = simulate_apps(doc, profiles, apps, {"a": rate}, SimConfig(duration_s=5.0, seed=3))
    row = res.apps["a"]
    assert row["arrived"] > 0.8 * rate * 5
    answered = row["on_time"] + row["late"] + row["dropped"] + row["failed"]
    assert answered == row["arrived"]  # each request answered once
    p, q = res.parts["a.p"], res.parts["a.q"]
    assert p["arrivals"] == row["arrived"]
    assert q["arrivals"] == 2 * (p["on_time"] + p["late"])  # two for each p answered
    assert res.parts_made == p["arrivals"] + q["arrivals"]
    # p's one vGPU at batch 4 drops a few in the simulator at any load (a plan batch of 4
    # held for its last moment on a lone vGPU): the data plane's, as for any model
    assert res.attainment("a") >= 0.9


def test_a_trace_on_a_topology_of_ones_own_is_the_same_simulation():
    """run_apps (a caller's topology, served applications and trace: the live comparison)
    on what simulate_apps builds, its own trace: the same account, request for request."""
    from poolpipe.scheduler import make_data_plane
    from poolpipe.scheduler.topology import build_topology
    from poolpipe.sim.arrivals import ArrivalSpec, generate

    apps, plan, doc, profiles = _planned(_chain(2))
    rate = 0.9 * plan.rates["a"]
    config = SimConfig(duration_s=3.0, seed=7)
    want = simulate_apps(doc, profiles, apps, {"a": rate}, config)
    topo = build_topology(doc, profiles, larger_batches=True)
    times, which = generate(ArrivalSpec("poisson"), [rate], 3.0, 7, ["a"])
    served = served_apps(doc, apps, [m.name for m in topo.models])
    got = run_apps(topo, served, times, which, config, lambda t: make_data_plane("reservation", t))
    assert got.apps == want.apps and got.parts == want.parts
    assert got.parts_made == want.parts_made
    assert got.rates["a"] == pytest.approx(len(times) / 3.0)


def test_fan_in_waits_for_every_parent_and_poisson_fan_out_draws():
    diamond = {
        "apps": [
            {
                "name": "d",
                "slo_ms": 60,
                "edges": [
                    {"from": "p", "to": "q"},
                    {"from": "p", "to": "r"},
                    {"from": "q", "to": "r"},
                ],
            }
        ]
    }
    apps, plan, doc, profiles = _planned(diamond, gpus=5)
    res = simulate_apps(
        doc, profiles, apps, {"d": 0.5 * plan.rates["d"]}, SimConfig(duration_s=4.0, seed=5)
    )
    n, parts = res.apps["d"]["arrived"], res.parts
    assert parts["d.p"]["arrivals"] == n
    # r is made once a request, when both q and p have answered
    assert parts["d.r"]["arrivals"] == parts["d.q"]["on_time"] + parts["d.q"]["late"]
    assert res.parts_made == sum(parts[m]["arrivals"] for m in ("d.p", "d.q", "d.r"))
    assert res.attainment("d") >= 0.99
    apps, plan, doc, profiles = _planned(_chain({"poisson": 2.0}))
    res = simulate_apps(
        doc, profiles, apps, {"a": 0.4 * plan.rates["a"]}, SimConfig(duration_s=5.0, seed=7)
    )
    n = res.apps["a"]["arrived"]
    q = res.parts["a.q"]["arrivals"]
    assert res.parts_made == n + q and 1.6 * n < q < 2.4 * n
    assert res.attainment("a") >= 0.9


def test_a_part_dropped_answers_the_whole_request_dropped():
    """Three times what the plan serves: parts are dropped, and every request that lost a
    part is answered dropped, once; none is answered on time without all its parts."""
    apps, plan, doc, profiles = _planned(_chain(2))
    res = simulate_apps(
        doc, profiles, apps, {"a": 3 * plan.rates["a"]}, SimConfig(duration_s=3.0, seed=1)
    )
    row, p, q = res.apps["a"], res.parts["a.p"], res.parts["a.q"]
    assert row["dropped"] > 0
    assert row["on_time"] + row["late"] + row["dropped"] + row["failed"] == row["arrived"]
    # an on-time request had its p part and both q parts answered with results
    assert row["on_time"] + row["late"] <= min(
        p["on_time"] + p["late"], (q["on_time"] + q["late"]) // 2
    )
    assert row["dropped"] >= p["dropped"]  # each p part dropped drops its request
    assert sum(res.reasons.values()) == row["dropped"] + row["failed"]


def test_a_plan_without_applications_is_refused():
    apps, _, doc, profiles = _planned(_chain(2))
    with pytest.raises(PoolpipeError, match="serves no application"):
        simulate_apps(replace(doc, meta={}), profiles, apps, {"a": 1.0}, SimConfig(duration_s=1))


def test_a_dilated_application_plan_stretches_its_times():
    """Time-warped emulation (domain.plan.dilated): an application's SLO, budgets and the
    SLO of its graph x D, its rate / D, as its models' SLOs."""
    from poolpipe.domain.apps import plan_applications
    from poolpipe.domain.plan import dilated

    _, _, doc, _ = _planned(_chain(2))
    slow = dilated(doc, 10.0)
    rec, was = slow.meta["apps"]["a"], doc.meta["apps"]["a"]
    assert rec["slo_us"] == pytest.approx(10 * was["slo_us"])
    assert rec["budgets_us"] == {m: pytest.approx(10 * b) for m, b in was["budgets_us"].items()}
    assert plan_applications(slow.meta)[0][0].slo_us == pytest.approx(10 * 40_000)
    assert slow.meta["apps_rates"]["a"] == pytest.approx(doc.meta["apps_rates"]["a"] / 10)
    assert [m.slo_us for m in slow.models] == [10 * m.slo_us for m in doc.models]


def test_gpus_lost_under_load_cost_only_the_requests_they_held():
    """A scenario of applications: two of the four GPUs fail mid-run and come back; every
    request is still answered once, and the loss is the failure's."""
    from poolpipe.sim.scenario import GpuChange, Rollout, Scenario

    apps, plan, doc, profiles = _planned(_chain(2))
    rate = {"a": 0.5 * plan.rates["a"]}
    config = SimConfig(duration_s=6.0, seed=4)
    calm = simulate_apps(doc, profiles, apps, rate, config)
    storm = Scenario((GpuChange("gpu_down", 2.0, "A", 2), GpuChange("gpu_up", 4.0, "A", 2)))
    hit = simulate_apps(doc, profiles, apps, rate, config, scenario=storm)
    row = hit.apps["a"]
    assert row["on_time"] + row["late"] + row["dropped"] + row["failed"] == row["arrived"]
    assert row["arrived"] == calm.apps["a"]["arrived"]  # the same trace
    assert hit.attainment("a") < calm.attainment("a")
    with pytest.raises(PoolpipeError, match="not simulated yet"):
        simulate_apps(
            doc, profiles, apps, rate, config, scenario=Scenario((Rollout(1.0, None, "x"),))
        )
