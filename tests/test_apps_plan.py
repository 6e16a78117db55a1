"""Planning applications: latency budgets chosen jointly with the pools (real MILPs on
hand-checkable models), checked against every split of a grid planned one by one."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from poolpipe.domain.apps import parse_apps
from poolpipe.errors import InfeasibleError, PoolpipeError
from poolpipe.planner import apps as apps_planner
from poolpipe.planner.apps import (
    SPLITS,
    AppPlanRequest,
    _alone,
    _candidate_fn,
    cheapest_apps,
    cheapest_by_split,
    fixed_split,
    nexus_split,
    plan_apps,
)
from tests.conftest import tiny_cluster, tiny_model

# one block each; columns: batch 1..4 (µs) on GPU "A"
P = tiny_model("p", {("A", 1): [[2000.0, 3000.0, 4000.0, 5000.0]]}, [])
Q = tiny_model("q", {("A", 1): [[8000.0, 9000.0, 10000.0, 11000.0]]}, [])


def _request(text: dict, gpus: int = 2, grid: int = 10) -> AppPlanRequest:
    apps = parse_apps(text, "test", ["p", "q"])
    return AppPlanRequest(
        tuple(apps),
        {"p": P, "q": Q},
        tiny_cluster([("A", gpus, 1, (1,))]),
        grid=grid,
        margin=0.0,
        mip_gap=1e-9,
    )


CHAIN = {"apps": [{"name": "a", "slo_ms": 20, "edges": [{"from": "p", "to": "q"}]}]}


def test_the_joint_split_gives_q_the_time_it_needs():
    # Two GPUs, one per model. Equal split, 10 ms each: q runs batch 3 (10 ms): 300/s.
    # Joint: p 4 ms (batch 3, 750/s), q 16 ms (batch 4, 11 ms: 364/s): 364/s.
    req = _request(CHAIN)
    joint = plan_apps(req)
    assert joint.objective == pytest.approx(4 / 0.011)
    assert joint.budgets[("a", "q")] >= 11_000 and sum(joint.budgets.values()) <= 20_000
    equal = plan_apps(req, "equal")
    assert equal.budgets == {("a", "p"): 10_000, ("a", "q"): 10_000}
    assert equal.objective == pytest.approx(3 / 0.010)
    prop = plan_apps(req, "proportional")  # 2:8 of 20 ms: 4 ms and 16 ms, as the joint
    assert prop.budgets == {("a", "p"): 4_000, ("a", "q"): 16_000}
    assert joint.objective >= max(equal.objective, prop.objective) - 1e-6
    assert joint.gpus_used == {"A": 2} and joint.rates["a"] == pytest.approx(joint.objective)


@pytest.mark.parametrize("fanout", [1, 2])
@pytest.mark.parametrize("gpus", [2, 3, 5])
def test_the_joint_split_is_the_best_split_of_the_grid(fanout, gpus):
    """Every pair of grid budgets that fits the SLO, planned as a fixed split: none serves
    more than the joint MILP, and the best serves as much."""
    spec = {
        "apps": [{"name": "a", "slo_ms": 20, "edges": [{"from": "p", "to": "q", "fanout": fanout}]}]
    }
    req = _request(spec, gpus)
    joint = plan_apps(req)
    best = 0.0
    grid = [2_000.0 * k for k in range(1, 11)]
    for bp, bq in itertools.product(grid, grid):
        if bp + bq > 20_000:
            continue
        try:
            fixed = plan_apps(req, budgets={("a", "p"): bp, ("a", "q"): bq})
        except InfeasibleError:
            continue
        best = max(best, fixed.objective)
    assert joint.objective == pytest.approx(best, rel=1e-6)
    assert joint.served[("a", "q")] >= fanout * joint.rates["a"] * (1 - 1e-6)


TWO_APPS = {
    "apps": [
        {"name": "a", "slo_ms": 20, "edges": [{"from": "p", "to": "q", "fanout": 2}]},
        {"name": "b", "slo_ms": 30, "weight": 2, "edges": [{"from": "q", "to": "p"}]},
    ]
}


@pytest.mark.parametrize("spec", [CHAIN, TWO_APPS], ids=["chain", "two-apps"])
@pytest.mark.parametrize("gpus", [(1, 2), (2, 3)])
def test_the_split_search_and_the_joint_milp_agree(monkeypatch, spec, gpus):
    """The joint split found split by split (each maximal split of the grid planned by the
    group planner, highest LP bound first) serves what the one MILP over every budget
    does, both proven."""
    req = _two_types(*gpus, spec=spec)
    searched = plan_apps(req)
    monkeypatch.setattr(apps_planner, "SEARCH_SPLITS_UP_TO", 0)  # the joint MILP alone
    milp = plan_apps(req)
    assert searched.status == milp.status == "optimal"
    assert searched.objective == pytest.approx(milp.objective, rel=1e-6)
    for a in req.apps:
        paths = a.paths()
        assert all(sum(searched.budgets[(a.name, m)] for m in p) <= a.slo_us + 1e-6 for p in paths)
        assert searched.rates[a.name] >= a.weight * searched.objective * (1 - 1e-9)


def test_a_split_search_out_of_time_still_answers_with_its_gap():
    """No time left after the LP bounds: the split of the highest bound is planned all the
    same (a plan, never none), and the answer says how far from proven it is."""
    req = replace(_two_types(2, 3, spec=TWO_APPS), time_limit_s=1e-9)
    plan = plan_apps(req)
    assert plan.objective > 0 and plan.split == "joint"
    assert plan.status in ("optimal", "time_limit")
    assert (plan.gap == 0.0) == (plan.status == "optimal")


def test_fan_in_paths_share_the_slo_and_a_model_too_slow_is_named():
    diamond = {
        "apps": [
            {
                "name": "d",
                "slo_ms": 30,
                "edges": [
                    {"from": "p", "to": "q"},
                    {"from": "p", "to": "r"},
                    {"from": "q", "to": "r"},
                ],
            }
        ]
    }
    r = tiny_model("r", {("A", 1): [[1000.0, 1500.0, 2000.0, 2500.0]]}, [])
    apps = parse_apps(diamond, "test", ["p", "q", "r"])
    req = AppPlanRequest(
        tuple(apps), {"p": P, "q": Q, "r": r}, tiny_cluster([("A", 3, 1, (1,))]), margin=0.0
    )
    plan = plan_apps(req)
    b = plan.budgets
    assert b[("d", "p")] + b[("d", "q")] + b[("d", "r")] <= 30_000 + 1e-6
    assert fixed_split(apps[0], "equal", {"p": 1, "q": 1, "r": 1}) == {
        "p": 10_000.0,
        "q": 10_000.0,
        "r": 10_000.0,
    }
    tight = {"apps": [{"name": "a", "slo_ms": 9, "edges": [{"from": "p", "to": "q"}]}]}
    with pytest.raises(InfeasibleError, match=r"along p -> q .* sum to 10.8 ms, more than"):
        plan_apps(_request(tight))  # p needs 2.7 ms of the 0.9 ms steps, q 8.1 ms
    tighter = {"apps": [{"name": "a", "slo_ms": 7, "edges": [{"from": "p", "to": "q"}]}]}
    with pytest.raises(InfeasibleError, match="model q meets none of its budgets"):
        plan_apps(_request(tighter))


# Two GPU types: A as above, B twice as slow and a third of the price.
P2 = tiny_model(
    "p",
    {
        ("A", 1): [[2000.0, 3000.0, 4000.0, 5000.0]],
        ("B", 1): [[4000.0, 6000.0, 8000.0, 10000.0]],
    },
    [],
)
Q2 = tiny_model(
    "q",
    {
        ("A", 1): [[8000.0, 9000.0, 10000.0, 11000.0]],
        ("B", 1): [[16000.0, 18000.0, 20000.0, 22000.0]],
    },
    [],
)


def _two_types(a: int, b: int, spec: dict = CHAIN, grid: int = 10) -> AppPlanRequest:
    pools = [(g, n, 1, (1,)) for g, n in (("A", a), ("B", b)) if n]
    return AppPlanRequest(
        tuple(parse_apps(spec, "test", ["p", "q"])),
        {"p": P2, "q": Q2},
        tiny_cluster(pools),
        grid=grid,
        margin=0.0,
        mip_gap=1e-9,
    )


@pytest.mark.parametrize("gpus", [(1, 2), (2, 3), (1, 4)])
def test_nexus_split_is_the_cheapest_split_by_each_model_alone(gpus):
    """Nexus's split-then-plan: the budgets of least summed cost (requests per request over
    what the model serves alone on the whole cluster at that budget), checked by brute
    force over the grid; the joint split serves at least what it serves."""
    req = _two_types(*gpus, grid=8)
    alone = _candidate_fn(req)
    grid = [2_500.0 * k for k in range(1, 9)]
    thr = {(m, b): _alone(req, alone(m, b)) for m in "pq" for b in grid}

    def cost(bp: float, bq: float) -> float:
        return 1 / thr[("p", bp)] + 1 / thr[("q", bq)]

    fits = [
        (bp, bq)
        for bp, bq in itertools.product(grid, grid)
        if bp + bq <= 20_000 and thr[("p", bp)] > 0 and thr[("q", bq)] > 0
    ]
    least = min(cost(*f) for f in fits)
    split = nexus_split(req)
    assert cost(split[("a", "p")], split[("a", "q")]) == pytest.approx(least, rel=1e-9)
    nexus = plan_apps(req, "nexus")
    assert nexus.budgets == split
    joint = plan_apps(req)
    assert joint.objective >= nexus.objective * (1 - 1e-6)
    # started from nexus's plan (as the CLI does), the same optimum
    assert plan_apps(req, start=nexus).objective == pytest.approx(joint.objective, rel=1e-6)


@pytest.mark.parametrize("rate", [150.0, 300.0, 500.0])
def test_the_cheapest_gpus_are_the_cheapest_counts_that_serve_the_rate(rate):
    """The cost objective against brute force: every count of A (price 3) and B (price 1)
    GPUs, each planned max-min; the cheapest counts that serve `rate` cost what the cost
    MILP finds (budgets chosen jointly either way)."""
    prices = {"A": 3.0, "B": 1.0}
    cheapest = cheapest_apps(_two_types(3, 4), {"a": rate}, prices)
    best = None
    for a, b in itertools.product(range(4), range(5)):
        if a + b == 0:
            continue
        try:
            served = plan_apps(_two_types(a, b)).objective
        except InfeasibleError:
            continue
        if served >= rate * (1 - 1e-9):
            price = 3.0 * a + 1.0 * b
            best = price if best is None else min(best, price)
    assert best is not None and cheapest.cost_per_hour == pytest.approx(best)
    assert cheapest.status == "optimal" and cheapest.rates == {"a": pytest.approx(rate)}
    assert cheapest.served[("a", "q")] >= rate * (1 - 1e-6)
    whole = cheapest_apps(_two_types(3, 4), {"a": rate}, prices, whole=True)
    assert all(len(c.partitions) == 1 for ps in whole.pipelines.values() for c, _ in ps)
    assert whole.cost_per_hour >= cheapest.cost_per_hour - 1e-9


def test_the_joint_cost_from_a_fixed_split_never_costs_more_than_it():
    """On a grid of two budgets (10 or 20 ms: only 10 + 10 fits the 20 ms SLO) the joint
    cost MILP finds 3 GPUs for 350 req/s (q at 10 ms: batch 3, 300/s a GPU); the
    proportional split (4 + 16 ms, off that grid) needs 2 (p batch 3 in 4 ms, q batch 4 in
    11 ms). Started from it the joint split returns it: never dearer than its start."""
    req = _request(CHAIN, gpus=4, grid=2)
    rates, prices = {"a": 350.0}, {"A": 1.0}
    prop = cheapest_apps(req, rates, prices, "proportional")
    assert prop.cost_per_hour == 2.0 and prop.budgets[("a", "q")] == 16_000
    assert cheapest_apps(req, rates, prices).cost_per_hour == 3.0
    joint = cheapest_apps(req, rates, prices, start=prop)
    assert joint.split == "joint" and joint.cost_per_hour == 2.0
    assert joint.budgets == prop.budgets and joint.pipelines == prop.pipelines
    assert joint.status == "optimal" and joint.gap == 0.0  # nothing on the grid is cheaper
    # a start on the grid is the MILP's own start: the same cost or less
    equal = cheapest_apps(req, rates, prices, "equal")
    assert cheapest_apps(req, rates, prices, start=equal).cost_per_hour <= equal.cost_per_hour
    with pytest.raises(PoolpipeError, match="a plan of the cost objective"):
        cheapest_apps(req, rates, prices, start=plan_apps(req))
    # every split at once: the fixed ones, then the joint one from the cheapest of them
    by_split = cheapest_by_split(req, rates, prices)
    assert list(by_split) == list(SPLITS)
    assert by_split["proportional"].budgets == prop.budgets
    assert by_split["joint"].cost_per_hour == 2.0  # alone, the joint MILP's grid gives 3


def test_rates_beyond_the_cluster_and_bad_cost_inputs_are_named():
    req = _two_types(1, 1)
    with pytest.raises(InfeasibleError, match=r"cannot serve these rates .* at most \d+\.\d% of"):
        cheapest_apps(req, {"a": 10_000.0}, {"A": 3.0, "B": 1.0})
    with pytest.raises(InfeasibleError, match=r"cannot serve these rates .* at most \d+\.\d% of"):
        cheapest_by_split(req, {"a": 10_000.0}, {"A": 3.0, "B": 1.0})  # no split can
    with pytest.raises(PoolpipeError, match="no price for GPU type"):
        cheapest_apps(req, {"a": 10.0}, {"A": 3.0})
    with pytest.raises(PoolpipeError, match=r"rates: give one per application .* missing: a"):
        cheapest_apps(req, {"b": 10.0}, {"A": 3.0, "B": 1.0})
    with pytest.raises(PoolpipeError, match="rates must be finite req/s > 0"):
        cheapest_apps(req, {"a": -1.0}, {"A": 3.0, "B": 1.0})


def test_counted_inputs_hold_the_first_pools_to_their_nic():
    """count_inputs: each part's request inputs cross its first server's NIC, as the live
    router sends them. p's 0.5 MB at 1 Gbit/s take 4 ms a request on its one GPU's NIC:
    at most 250/s where uncounted the chain serves 4 / 11 ms = 364/s; the plan document
    says so and verifies with them counted. A model of unknown input size is named."""
    from poolpipe.errors import ProfileError
    from poolpipe.planner.apps import app_plan_document

    sized = {"p": replace(P, input_bytes=5e5), "q": replace(Q, input_bytes=1e3)}
    apps = parse_apps(CHAIN, "test", ["p", "q"])
    cluster = tiny_cluster([("A", 2, 1, (1,))], bandwidth_gbps=1.0)
    plain = AppPlanRequest(tuple(apps), sized, cluster, margin=0.0, mip_gap=1e-9)
    counted = replace(plain, count_inputs=True)
    assert plan_apps(plain).objective == pytest.approx(4 / 0.011)
    got = plan_apps(counted)
    assert 0 < got.objective <= 250.0 + 1e-6
    doc, _ = app_plan_document(counted, got)  # verified, inputs counted
    assert doc.counts_inputs and not app_plan_document(plain, plan_apps(plain))[0].counts_inputs
    (p_part,) = [m for m in doc.models if m.name.endswith(".p")]
    assert p_part.throughput <= 250.0 + 1e-6  # its NIC, not its compute
    with pytest.raises(ProfileError, match="size of its inputs is not known"):
        plan_apps(replace(counted, profiles={"p": P, "q": Q}))
