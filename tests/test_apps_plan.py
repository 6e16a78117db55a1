"""Planning applications: latency budgets chosen jointly with the pools (real MILPs on
hand-checkable models), checked against every split of a grid planned one by one."""

from __future__ import annotations

import itertools

import pytest

from poolpipe.domain.apps import parse_apps
from poolpipe.errors import InfeasibleError
from poolpipe.planner.apps import AppPlanRequest, fixed_split, plan_apps
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
