"""`poolpipe advise`'s core (planner/advise.py): the GPUs the observed load needs, against
hand-computed plans, and the nodes that can be released now."""

from __future__ import annotations

import math

import pytest

from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.advise import advise, published, read_published, releasable_nodes

MODEL = "googlenet-v3-pytorch"


def _np_plan(profiles, count: int):
    """The whole-model (np) max-min plan of MODEL on `count` T4s, fluid (no simulation)."""
    cluster = Cluster("t4s", 10.0, (GpuPool("T4", count, 4),))
    p = profiles[MODEL]
    req = PlanRequest(
        models=(p,), weights=(1.0,), slos_us=(10 * p.reference_latency_us,), cluster=cluster,
        strategy="np", delivery="off",
    )  # fmt: skip
    return make_plan(req), cluster


def test_advise_asks_for_the_gpus_a_hand_computed_plan_needs(ppipe_profiles):
    """np on one GPU type: one T4 serves X req/s (the one-GPU plan), so a load L served
    with headroom h needs ceil(L (1 + h) / X) T4s; the plan in use holds all 8."""
    one, _ = _np_plan(ppipe_profiles, 1)
    per_gpu = one.models[0].throughput
    served, cluster = _np_plan(ppipe_profiles, 8)
    assert served.gpus_used() == {"T4": 8}
    for load, h in ((0.3 * per_gpu, 0.2), (2.4 * per_gpu, 0.2), (1.9 * per_gpu, 0.0)):
        a = advise(served, ppipe_profiles, {MODEL: load}, cluster, headroom=h, delivery="off")
        want = math.ceil(load * (1 + h) / per_gpu - 1e-9)
        assert a.needed == {"T4": want}, (load, h)
        assert a.in_use == {"T4": 8} and a.available == {"T4": 8}
        assert a.change() == {"T4": want - 8}
        assert a.asked[MODEL] == pytest.approx(load * (1 + h))
        assert not a.priced and a.cost_per_hour == pytest.approx(want)  # 1 per GPU
        assert a.served_cost_per_hour == 8.0
        assert a.why_not is None
    # more than the cluster offers: no advice but the reason
    a = advise(served, ppipe_profiles, {MODEL: 9 * per_gpu}, cluster, delivery="off")
    assert a.needed is None and a.change() == {} and "rate" in (a.why_not or "")


def test_advise_names_bad_input(ppipe_profiles):
    served, cluster = _np_plan(ppipe_profiles, 2)
    with pytest.raises(PoolpipeError, match="not serve"):
        advise(served, ppipe_profiles, {"nope": 1.0}, cluster, delivery="off")
    with pytest.raises(PoolpipeError, match="req/s >= 0"):
        advise(served, ppipe_profiles, {MODEL: -1.0}, cluster, delivery="off")
    with pytest.raises(PoolpipeError, match="headroom"):
        advise(served, ppipe_profiles, {MODEL: 1.0}, cluster, headroom=-0.1, delivery="off")
    with pytest.raises(PoolpipeError, match="no profile"):
        advise(served, {}, {MODEL: 1.0}, cluster, delivery="off")


def test_a_model_seen_at_no_load_keeps_a_pipeline(ppipe_profiles):
    served, cluster = _np_plan(ppipe_profiles, 4)
    a = advise(served, ppipe_profiles, {}, cluster, delivery="off")
    assert a.rates == {MODEL: 0.0} and a.asked[MODEL] > 0
    assert a.needed == {"T4": 1}


def test_releasable_nodes_are_idle_long_enough_with_no_batch():
    nodes = [
        {"node": "T4-0", "address": "a:1", "state": "in service", "batches": 2, "idle_s": 0.0},
        {"node": "T4-1", "address": "a:2", "state": "in service", "batches": 0, "idle_s": 5.0},
        {"node": "T4-2", "address": "a:3", "state": "in service", "batches": 0, "idle_s": 90.0},
        {"node": "T4-3", "address": "a:4", "state": "drained", "batches": 0, "idle_s": 1.0},
        {"node": "T4-4", "address": "a:5", "state": "drained", "batches": 1, "idle_s": 0.0},
        {"node": "T4-5", "address": "a:6", "state": "down", "batches": 0, "idle_s": 999.0},
        {"node": "T4-6", "address": "a:7", "state": "in service", "batches": 1, "idle_s": 99.0},
    ]
    got = {n["node"]: n["action"] for n in releasable_nodes(nodes, 60.0)}
    assert got == {"T4-2": "drain, then release", "T4-3": "release"}
    assert {n["node"] for n in releasable_nodes(nodes, 1.0)} == {"T4-1", "T4-2", "T4-3"}


def test_an_advice_a_router_is_told_is_read_back_and_bad_fields_are_named(ppipe_profiles):
    """What the load-replan flow and `poolpipe advise --publish` send a router (published)
    reads back as sent; a field that is not counts, a share or rates is named."""
    one, _ = _np_plan(ppipe_profiles, 1)
    served, cluster = _np_plan(ppipe_profiles, 8)
    a = advise(served, ppipe_profiles, {MODEL: 1.5 * one.models[0].throughput}, cluster,
               delivery="off")  # fmt: skip
    doc = published(a)
    back = read_published(doc)
    assert back["needed"] == {"T4": 2} and back["in_use"] == {"T4": 8} and back == doc
    over = advise(served, ppipe_profiles, {MODEL: 9 * one.models[0].throughput}, cluster,
                  delivery="off")  # fmt: skip
    assert read_published(published(over))["needed"] is None  # the reason instead
    for key, bad, says in (
        ("needed", {"T4": -1}, "needed must map GPU types to counts >= 0"),
        ("in_use", {"T4": 1.5}, "in_use must map GPU types to counts >= 0"),
        ("available", None, "available must map"),
        ("headroom", "a lot", "headroom must be a share >= 0"),
        ("rates", {MODEL: math.inf}, "rates must map models to req/s >= 0"),
    ):
        with pytest.raises(PoolpipeError, match=says):
            read_published({**doc, key: bad})
