"""Re-planning warm-started from the serving plan (planner/warm.py): the serving plan fitted
to the GPUs left is a feasible plan for them, and the search started from it ends where a
cold one does."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest, exact, make_plan
from poolpipe.planner.exact import enumerate_candidates, model_costs
from poolpipe.planner.formulation import chosen_fits, chosen_objective
from poolpipe.planner.warm import warm_chosen
from tests.test_planner_properties import SETTINGS, check_invariants, instances, pair_request


def _fitted(req: PlanRequest, serving):
    """warm.py's plan for `req` from `serving`, as the planner sees it."""
    lam = [m.est_throughput for m in make_plan(dataclasses.replace(req, warm_start=None)).models]
    costs = model_costs(req, lam, whole_gpus_only=False)
    _, cands = enumerate_candidates(req, costs, req.max_partitions)
    names = [m.name for m in req.models]
    return warm_chosen(serving, names, cands, list(req.weights), req.cluster, req.packing)


@SETTINGS
@given(
    instances(n_models=2),
    st.sampled_from(["per-share", "per-position"]),
    st.sampled_from(["A", "B"]),
    st.integers(1, 3),
    st.booleans(),
)
def test_warm_start_fits_the_gpus_left_and_ends_where_a_cold_plan_does(
    inst, packing, lost_type, lost, prune_first
):
    models, cluster, slos = inst
    req = pair_request(inst, packing=packing, margin=0.0, mip_gap=1e-9, batch_wait=False)
    try:
        serving = make_plan(req)
    except PoolpipeError:
        return  # no plan to start from
    lost = min(lost, cluster.pool(lost_type).count)
    less = dataclasses.replace(req, cluster=cluster.without({lost_type: lost}))
    try:
        cold = make_plan(less)
    except PoolpipeError:
        return
    # both paths of the exact solve: LP-bound pruning first (tiny instances skip it)
    saved = exact.PRUNE_ABOVE
    exact.PRUNE_ABOVE = 0 if prune_first else saved
    try:
        warm = make_plan(dataclasses.replace(less, warm_start=serving))
    finally:
        exact.PRUNE_ABOVE = saved
    assert warm.objective == pytest.approx(cold.objective, rel=1e-6, abs=1e-6)
    check_invariants(warm, models, slos)
    fitted = _fitted(less, serving)
    start = warm.meta.get("warm_start_objective")
    assert (fitted is None) == (start is None)
    if fitted is not None:
        chosen, objective = fitted
        assert chosen_fits(chosen, less.cluster, packing)
        assert objective == pytest.approx(chosen_objective(chosen, list(less.weights)))
        assert 0 < start <= warm.objective * (1 + 1e-9)


@SETTINGS
@given(instances(n_models=2), st.sampled_from(["per-share", "per-position"]))
def test_a_plan_that_still_fits_is_its_own_warm_start(inst, packing):
    req = pair_request(inst, packing=packing, margin=0.0, mip_gap=1e-9, batch_wait=False)
    try:
        serving = make_plan(req)
    except PoolpipeError:
        return
    if serving.objective <= 0:
        return  # a model served nothing: no plan to start from
    again = make_plan(dataclasses.replace(req, warm_start=serving))
    assert again.meta["warm_start_objective"] == pytest.approx(serving.objective, rel=1e-9)
    assert again.objective == pytest.approx(serving.objective, rel=1e-6)


def test_a_warm_start_of_other_models_is_ignored_and_cost_refuses_one(tiny_pair):
    req, other = tiny_pair
    serving = make_plan(other)
    plan = make_plan(dataclasses.replace(req, warm_start=serving))
    assert "warm_start_objective" not in plan.meta
    assert plan.objective == pytest.approx(make_plan(req).objective)
    with pytest.raises(PoolpipeError, match="warm start applies to max-min"):
        dataclasses.replace(
            req, objective="cost", rates=(1.0, 1.0), prices={"A": 1.0, "B": 1.0}, warm_start=plan
        )


@pytest.fixture
def tiny_pair():
    """Two requests on one cluster: models m0, m1 and models n0, n1."""
    from tests.conftest import tiny_cluster, tiny_model

    tables = {("A", 1): [[4000.0], [4000.0]], ("B", 1): [[5000.0], [20000.0]]}
    cluster = tiny_cluster([("A", 2, 1, (1,)), ("B", 4, 1, (1,))], 10.0)

    def request(prefix: str) -> PlanRequest:
        models = tuple(tiny_model(f"{prefix}{i}", tables, [1000.0]) for i in range(2))
        return PlanRequest(
            delivery="off",  # the fluid MILP alone
            models=models,
            weights=(0.5, 0.5),
            slos_us=(30_000.0, 30_000.0),
            cluster=cluster,
            margin=0.0,
            mip_gap=1e-9,
            batch_wait=False,
        )

    return request("m"), request("n")
