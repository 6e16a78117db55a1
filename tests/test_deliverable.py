"""Plans that state and maximise what they deliver (planner/deliverable.py): the queueing
headroom table, the deliverable figures against independent simulations, idle GPUs given to
pools, cost plans sized on what they deliver, and the figures kept in JSON and the
warehouse."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.deliverable import measure
from poolpipe.planner.fill import fill_idle, fits
from poolpipe.planner.headroom import POOL_SIZES, SLACKS, _table, simulate_utilisation
from poolpipe.scheduler.topology import simulated_topology
from poolpipe.sim import ArrivalSpec
from poolpipe.sim.capacity import search_capacity
from poolpipe.sim.deliverable import attainment_at
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.plans import delivery_line
from tests.conftest import tiny_cluster, tiny_model

# Two blocks; A is four times as fast as B, the map between them small.
A1 = [[2000.0, 3000.0], [2000.0, 3000.0]]
B1 = [[8000.0, 12000.0], [8000.0, 12000.0]]


def request(models, cluster, slo_us, **kw) -> PlanRequest:
    return PlanRequest(
        models=tuple(models),
        weights=tuple(1.0 for _ in models),
        slos_us=tuple(slo_us for _ in models),
        cluster=cluster,
        margin=0.0,
        batch_wait=False,
        **kw,
    )


def test_the_headroom_table_is_what_the_queue_gives():
    # two cells simulated again with other random numbers: the table is the queue's
    u = _table()[2]
    for c, r in ((1, 1.0), (4, 2.0)):
        i, j = POOL_SIZES.index(c), SLACKS.index(r)
        assert simulate_utilisation(c, r, seed=1) == pytest.approx(u[i, j], abs=0.03)
    # more vGPUs and more slack never leave less room (within the simulation's noise)
    assert (np.diff(u, axis=0) >= -0.005).all() and (np.diff(u, axis=1) >= -0.005).all()
    assert u[0, 3] < 0.2 < 0.9 < u[-1, 4]  # one vGPU, one stage of slack: under 20%


def test_a_one_vgpu_pool_is_never_stated_deliverable_at_its_fluid_load():
    # One A GPU, the whole model at batch 2 (6 ms) within a 30 ms SLO: 333 req/s fluid,
    # about 80% of it with 99% on time (a far tighter SLO leaves a load of a few percent,
    # where one grid step is a tenth of the figure)
    m = tiny_model("m", {("A", 1): A1}, [1000.0])
    plan = make_plan(request([m], tiny_cluster([("A", 1, 1, (1,))]), 30_000, delivery="state"))
    (pm,) = plan.models
    assert [q.vgpus for p in pm.pipelines for q in p.partitions] == [1]
    assert pm.deliverable is not None and pm.deliverable < 0.9 * pm.throughput
    assert plan.deliverable == pytest.approx(pm.deliverable / pm.weight)
    # an independent capacity search (other seeds, longer runs) finds it within 10%
    d = plan.meta["delivery"]
    assert d["seeds"] != [31, 32] and d["duration_s"] < 90
    cap = search_capacity(
        simulated_topology(plan, {"m": m}),
        ArrivalSpec.parse("poisson"),
        duration_s=90.0,
        seeds=(31, 32),
        method="bisect",
        step=0.01,
    )
    assert cap.capacity["m"] * pm.throughput == pytest.approx(pm.deliverable, rel=0.10)


def two_models():
    """Two models that share a cluster of 2 A and 6 B; one runs whole on B only slowly."""
    a = tiny_model("a", {("A", 1): A1, ("B", 1): B1, ("B", 2): B1}, [1000.0])
    b = tiny_model("b", {("A", 1): A1, ("B", 1): B1, ("B", 2): B1}, [1000.0])
    return [a, b], tiny_cluster([("A", 2, 1, (1,)), ("B", 6, 2, (1, 2))])


def test_maximise_delivers_at_least_the_fluid_plan_and_is_deterministic():
    models, cluster = two_models()
    req = request(models, cluster, 30_000)
    planned = make_plan(req)
    again = make_plan(req)
    assert planned.to_dict()["models"] == again.to_dict()["models"]
    d = planned.meta["delivery"]
    assert d["mode"] == "maximise" and d["variants"][0]["name"] == "fluid"
    assert d["fluid_bound"] >= planned.objective >= planned.deliverable > 0
    # the fluid plan, stated the same way (same seeds), delivers no more
    fluid = make_plan(replace(req, delivery="state"))
    assert fluid.objective == pytest.approx(d["fluid_bound"])
    assert planned.deliverable >= fluid.deliverable * (1 - 1e-9)
    # every model's figures: deliverable within its fluid throughput
    for m in planned.models:
        assert m.deliverable is not None and 0 < m.deliverable <= m.throughput


def test_a_cluster_that_lets_models_share_gpus_is_also_planned_without():
    # Halves of B for both models: where models may share a GPU, every half is planned 1.5x
    # slower (the interference factor); kept on GPUs of their own, a model's two halves run
    # as profiled. Allowing more must not deliver less: the unmixed plan is a variant
    models, cluster = two_models()
    mixed = replace(cluster, mixed_model_interference=1.5)
    planned = make_plan(request(models, mixed, 30_000))
    d = planned.meta["delivery"]
    assert "unmixed" in [v["name"] for v in d["variants"]]
    assert d["variant"].startswith("unmixed")
    assert planned.cluster.mixed_model_interference is None  # the plan says what it is
    planned.verify({m.name: m for m in models})
    fluid = next(v for v in d["variants"] if v["name"] == "fluid")
    assert planned.deliverable > fluid["deliverable"]
    plain = make_plan(request(models, cluster, 30_000)).meta["delivery"]["variants"]
    assert "unmixed" not in [v["name"] for v in plain]


def test_a_searched_margin_is_kept_only_where_it_delivers_more():
    # Whole models (np) on one A (4 ms) and four B (16 ms), SLO 24 ms: holding back 40% of
    # it (14.4 ms left) rules the B out; holding back 20% (19.2 ms) lets them serve too
    m = tiny_model("m", {("A", 1): A1, ("B", 1): B1}, [1000.0])
    cluster = tiny_cluster([("A", 1, 1, (1,)), ("B", 4, 2, (1,))])
    req = replace(request([m], cluster, 24_000, strategy="np"), margin=0.4)
    alone = make_plan(req)
    assert alone.gpus_used() == {"A": 1} and alone.margin == 0.4
    searched = make_plan(replace(req, search_margins=(0.2,)))
    d = searched.meta["delivery"]
    assert searched.margin == 0.2 and d["variant"].startswith("margin0.2")
    assert searched.gpus_used().get("B", 0) > 0
    assert searched.deliverable > 1.2 * alone.deliverable
    # the bound stated is the request margin's, and the line printed says so
    assert d["fluid_bound"] == pytest.approx(alone.meta["delivery"]["fluid_bound"])
    assert d["fluid_margin"] == 0.4 and searched.objective > d["fluid_bound"]
    assert "at margin 0.4" in delivery_line(searched)
    # a margin that cannot make any plan is passed over; one out of range is refused
    assert make_plan(replace(req, search_margins=(0.95,))).margin == 0.4
    with pytest.raises(PoolpipeError, match="search margins"):
        replace(req, search_margins=(1.0,))
    with pytest.raises(PoolpipeError, match="--delivery maximise"):
        replace(req, search_margins=(0.2,), delivery="state")


def test_idle_gpus_go_to_pools_and_never_beyond_the_cluster():
    # "a" runs on A only (250 req/s on the one A), "b" whole on a B (125 req/s each): the
    # max-min plan gives b the two B it needs to match a, and leaves four idle
    a = tiny_model("a", {("A", 1): A1}, [1000.0])
    b = tiny_model("b", {("A", 1): A1, ("B", 1): B1}, [1000.0])
    cluster = tiny_cluster([("A", 1, 1, (1,)), ("B", 6, 2, (1,))])
    plan = make_plan(request([a, b], cluster, 30_000, delivery="off"))
    (pb,) = plan.models[1].pipelines
    (q,) = pb.partitions
    assert q.gpu == "B"
    two = replace(pb, partitions=(replace(q, vgpus=2),), throughput=2 * q.vgpu_throughput)
    mb = replace(plan.models[1], pipelines=(two,), throughput=two.throughput)
    plan = replace(plan, models=(plan.models[0], mb))  # (the MILP may give b all six)
    assert plan.gpus_used() == {"A": 1, "B": 2}
    filled = fill_idle(plan)
    assert filled is not None and fits(filled)
    before = {(m.name, i, d): q.vgpus for m in plan.models for i, p in enumerate(m.pipelines)
              for d, q in enumerate(p.partitions)}  # fmt: skip
    after = {(m.name, i, d): q.vgpus for m in filled.models for i, p in enumerate(m.pipelines)
             for d, q in enumerate(p.partitions)}  # fmt: skip
    assert before.keys() == after.keys() and all(after[k] >= before[k] for k in before)
    assert sum(after.values()) > sum(before.values())
    assert all(
        fm.throughput >= pm.throughput for fm, pm in zip(filled.models, plan.models, strict=True)
    )
    assert filled.gpus_used() == {"A": 1, "B": 6}  # b's pool took the idle B
    # a full cluster has nothing to give
    full = fill_idle(filled)
    assert full is None or fits(full)
    assert fill_idle(full or filled) is None


def test_idle_gpus_are_spread_where_a_pipelines_least_pool_is_full():
    # block 0 runs on B only, block 1 on A only: every pipeline is B -> A. The one A is the
    # pool whose estimate is least, and it cannot grow; B vGPUs beside it do not raise that
    # estimate, but waiting in the B pool takes the slack both share: the idle Bs go there
    # anyway, and nothing goes beyond the cluster
    m = tiny_model(
        "m",
        {("A", 1): [[50_000.0, 60_000.0], [2000.0, 3000.0]],
         ("B", 1): [[8000.0, 12_000.0], [90_000.0, 100_000.0]]},
        [1000.0],
    )  # fmt: skip
    small = tiny_cluster([("A", 1, 1, (1,)), ("B", 3, 1, (1,))])
    plan = make_plan(request([m], small, 30_000, delivery="off"))
    (p,) = plan.models[0].pipelines
    assert [q.gpu for q in p.partitions] == ["B", "A"]
    grown = replace(plan, cluster=tiny_cluster([("A", 1, 1, (1,)), ("B", 6, 1, (1,))]))
    used = grown.gpus_used()
    filled = fill_idle(grown)
    assert filled is not None and fits(filled)
    assert filled.gpus_used() == {"A": 1, "B": 6}
    (fp,) = filled.models[0].pipelines
    assert fp.partitions[0].vgpus == p.partitions[0].vgpus + 6 - used["B"]
    assert fp.partitions[1].vgpus == p.partitions[1].vgpus
    assert fill_idle(filled) is None


def test_a_cost_plan_serves_its_rates_in_simulation():
    m = tiny_model("m", {("A", 1): A1, ("B", 1): B1}, [1000.0])
    cluster = tiny_cluster([("A", 4, 1, (1,)), ("B", 8, 1, (1,))])
    rates = (600.0,)
    kw = {"objective": "cost", "rates": rates, "prices": {"A": 3.0, "B": 0.5}}
    sized = make_plan(request([m], cluster, 12_000, **kw))
    fluid = make_plan(request([m], cluster, 12_000, delivery="off", **kw))
    assert sized.meta["cost_per_hour"] >= fluid.meta["cost_per_hour"]
    assert min(sized.meta["delivery"]["on_time_at_rates"].values()) >= 0.99
    # checked by runs the planner did not make
    topo = simulated_topology(sized, {"m": m})
    assert min(attainment_at(topo, rates, seeds=(41, 42), duration_s=40.0)) >= 0.99
    assert sized.models[0].deliverable >= rates[0] * 0.97


def test_an_application_cost_plan_keeps_its_rates_on_time():
    # googlenet-v3, then repvgg-b3 on its two crops, within 80 ms on hc2-small: the cheapest
    # joint split's plan for 50 req/s, sized on what it delivers, keeps 99% on time at 50
    # in runs the planner did not make
    from pathlib import Path

    from poolpipe.domain.apps import parse_apps
    from poolpipe.domain.cluster import load_clusters
    from poolpipe.domain.profiles import load_ppipe_dir
    from poolpipe.planner.apps import AppPlanRequest, app_plan_document, cheapest_by_split_sized
    from poolpipe.planner.deliverable import app_attainment_at

    group2 = Path(__file__).resolve().parents[1] / "data" / "ppipe-gpu-group2"
    profiles = {p.name: p for p in load_ppipe_dir(group2)}
    edge = {"from": "googlenet-v3-pytorch", "to": "repvgg-b3", "fanout": 2}
    apps = parse_apps({"apps": [{"name": "cars", "slo_ms": 80, "edges": [edge]}]}, "t", profiles)
    cluster = load_clusters(group2 / "clusters.toml")["hc2-small"]
    req = AppPlanRequest(tuple(apps), profiles, cluster, time_limit_s=300)
    rates = {"cars": 50.0}
    plans, sizing = cheapest_by_split_sized(req, rates, {"L4": 0.56, "T4": 0.35})
    joint = plans["joint"]
    assert joint is not None and sizing.served, sizing.rounds
    assert sizing.on_time["joint"]["cars"] >= 0.99
    assert set(sizing.on_time) == {"joint", "equal", "proportional", "nexus"}
    # each round asked the MILPs for more where the last kept less than 99%
    asked = [r["asked"]["cars"] for r in sizing.rounds]
    assert asked[0] == 50.0 and asked == sorted(asked)
    assert joint.rates["cars"] == pytest.approx(asked[-1]) or len(asked) == 1
    doc, parts = app_plan_document(req, joint)
    assert app_attainment_at(doc, parts, req.apps, rates, seeds=(31, 32))["cars"] >= 0.985


def test_the_figures_are_kept_in_json_and_the_warehouse(tmp_path):
    m = tiny_model("m", {("A", 1): A1}, [1000.0])
    plan = make_plan(request([m], tiny_cluster([("A", 2, 1, (1,))]), 10_000, delivery="state"))
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.models[0].deliverable == plan.models[0].deliverable
    assert back.deliverable == plan.deliverable and back.meta["delivery"]["mode"] == "state"
    with Warehouse.open(tmp_path / "wh.duckdb") as wh:
        pid = wh.store_plan(plan)
        row = wh.con.execute(
            "SELECT p.deliverable, m.deliverable FROM plans p JOIN plan_models m USING "
            "(plan_id) WHERE plan_id = ?",
            [pid],
        ).fetchone()
    assert row == (pytest.approx(plan.deliverable), pytest.approx(plan.models[0].deliverable))
    off = make_plan(request([m], tiny_cluster([("A", 2, 1, (1,))]), 10_000, delivery="off"))
    assert off.deliverable is None and "delivery" not in off.meta
    assert Plan.from_dict(json.loads(off.to_json())).models[0].deliverable is None


def test_a_measurement_names_seeds_and_runs():
    m = tiny_model("m", {("A", 1): A1}, [1000.0])
    plan = make_plan(request([m], tiny_cluster([("A", 2, 1, (1,))]), 10_000, delivery="off"))
    d = measure(plan, {"m": m}, seeds=(5,), requests=500)
    assert d.seeds == (5,) and d.simulations > 0 and d.arrivals == "poisson"
    assert 0 < d.load[0] <= 1 and d.rates[0] == pytest.approx(d.load[0] * plan.models[0].throughput)
