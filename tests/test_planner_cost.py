"""The cost objective: hand-checkable instances (prices against speed, the SLO, NIC limits),
infeasible rates, and a brute force over every sub-cluster of tiny 3-type clusters."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poolpipe.errors import InfeasibleError, PoolpipeError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.formulation import served as served_by
from tests.conftest import tiny_cluster, tiny_model
from tests.test_planner_properties import SETTINGS, brute_force_single, instances

# Fast GPU "A": 4 ms per block; slow GPU "B": 5 ms for block 0, 20 ms for block 1 (batch 1).
# Whole model: A 8 ms (125 req/s per GPU), B 25 ms (40 req/s). Block 0 on B then block 1
# on A: 9 ms, 200 req/s on B, 250 on A.
A1 = [[4000.0], [4000.0]]
B1 = [[5000.0], [20000.0]]
PRICES = {"A": 3.0, "B": 0.5}


def model(boundary=(1000.0,)):
    return tiny_model("m", {("A", 1): A1, ("B", 1): B1}, list(boundary))


def cost_request(m, slo_us, rate, strategy="ppipe", bandwidth_gbps=10.0, prices=PRICES, **kw):
    return PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=(m,),
        weights=(1.0,),
        slos_us=(slo_us,),
        cluster=tiny_cluster([("A", 2, 1, (1,)), ("B", 4, 1, (1,))], bandwidth_gbps),
        strategy=strategy,
        margin=0.0,
        mip_gap=1e-9,
        batch_wait=False,
        objective="cost",
        rates=(rate,),
        prices=prices,
        **kw,
    )


def test_a_cheap_slow_gpu_beats_an_expensive_fast_one_until_the_slo_tightens():
    # SLO 30 ms: B runs the whole model (25 ms); 80 req/s on 2 B cost 1.0 an hour, against
    # 3.0 for one A (125 req/s) and 3.5 for the B -> A pipeline.
    loose = make_plan(cost_request(model(), 30_000, 80.0))
    assert loose.meta["cost_per_hour"] == pytest.approx(1.0)
    assert loose.gpus_used() == {"B": 2}
    assert loose.models[0].throughput >= 80.0
    # SLO 12 ms: B's 25 ms no longer fit; one A (3.0) beats B -> A (3.5)
    tight = make_plan(cost_request(model(), 12_000, 80.0))
    assert tight.meta["cost_per_hour"] == pytest.approx(3.0)
    assert tight.gpus_used() == {"A": 1}


def test_pipelining_is_cheapest_at_a_high_rate_and_the_alternatives_are_priced():
    # 200 req/s within 12 ms: two whole A (6.0) against one B -> A pipeline (3.5).
    plan = make_plan(cost_request(model(), 12_000, 200.0))
    assert plan.meta["cost_per_hour"] == pytest.approx(3.5)
    assert plan.gpus_used() == {"A": 1, "B": 1}
    (pipe,) = plan.models[0].pipelines
    assert [(q.gpu, q.start, q.end) for q in pipe.partitions] == [("B", 0, 1), ("A", 1, 2)]
    assert plan.meta["np_cost_per_hour"] == pytest.approx(6.0)
    # one type alone: A runs the whole model twice (6.0); B cannot meet 12 ms
    assert plan.meta["single_type_cost_per_hour"] == {"A": pytest.approx(6.0), "B": None}
    assert plan.models[0].weight == 1.0 and plan.objective >= 200.0


def test_a_nic_bound_pipeline_loses_to_whole_gpus():
    # 0.75 MB over 1 Gbit/s: 6 ms per sample, so each vGPU of the B -> A pipeline moves at
    # most 166.7 samples/s; within 16 ms (5 + 6 + 4 fit) 200 req/s need 2 B and 2 A (7.0),
    # more than two whole A (6.0). With a small feature map it is 3.5 again.
    bound = make_plan(cost_request(model([0.75e6]), 16_000, 200.0, bandwidth_gbps=1.0))
    assert bound.meta["cost_per_hour"] == pytest.approx(6.0)
    assert bound.gpus_used() == {"A": 2}
    free = make_plan(cost_request(model([1000.0]), 16_000, 200.0, bandwidth_gbps=1.0))
    assert free.meta["cost_per_hour"] == pytest.approx(3.5)


def test_np_strategy_prices_whole_models_only():
    plan = make_plan(cost_request(model(), 12_000, 200.0, strategy="np"))
    assert plan.meta["cost_per_hour"] == pytest.approx(6.0)
    assert all(len(p.partitions) == 1 for p in plan.models[0].pipelines)


def test_rates_beyond_the_cluster_name_the_model_and_its_most():
    # All of the cluster within 12 ms: B -> A pipelines, the 2 A's block 1 at 250 req/s
    # each, so 500 req/s at most (the max-min plan of the model alone says how much).
    most = make_plan(
        PlanRequest(
            delivery="off",  # the fluid MILP alone
            models=(model(),),
            weights=(1.0,),
            slos_us=(12_000,),
            cluster=cost_request(model(), 12_000, 1.0).cluster,
            margin=0.0,
            mip_gap=1e-9,
            batch_wait=False,
        )
    ).objective
    with pytest.raises(InfeasibleError, match=rf"m asks 1,000.0 req/s, at most {most:,.1f} alone"):
        make_plan(cost_request(model(), 12_000, 1000.0))


def test_rates_each_servable_alone_but_not_together():
    m1, m2 = model(), tiny_model("n", {("A", 1): A1, ("B", 1): B1}, [1000.0])
    req = cost_request(m1, 12_000, 1.0)
    both = PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=(m1, m2),
        weights=(1.0, 1.0),
        slos_us=(12_000, 12_000),
        cluster=req.cluster,
        margin=0.0,
        mip_gap=1e-9,
        batch_wait=False,
        objective="cost",
        rates=(300.0, 300.0),
        prices=PRICES,
    )
    # 500 req/s alone each (see above), 500 together: 250 of each 300, 83.3%
    with pytest.raises(InfeasibleError, match=r"alone but not all together: at most 83\.3%"):
        make_plan(both)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rates": None}, r"needs a rate \(req/s\) for each of \['m'\]"),
        ({"rates": (-1.0,)}, r"rates must be finite req/s > 0, got m=-1\.0"),
        ({"prices": {"A": 1.0}}, r"missing B .*--prices A=PRICE,B=PRICE"),
        ({"prices": {"A": 1.0, "B": 0.0}}, r"prices must be finite amounts > 0, got B=0\.0"),
        ({"strategy": "dart-r"}, "not dart-r"),
    ],
)
def test_bad_cost_inputs_are_named(change, message):
    import dataclasses

    base = cost_request(model(), 12_000, 10.0)
    with pytest.raises(PoolpipeError, match=message):
        dataclasses.replace(base, **change)


# ----------------------------------------------------------------------------- brute force


@st.composite
def three_type_instances(draw):
    blocks = draw(st.integers(2, 3))
    lat = st.integers(500, 20000)
    tables = {(g, 1): [[float(draw(lat))] for _ in range(blocks)] for g in ("A", "B", "C")}
    boundary = [float(draw(st.sampled_from([0, 1e3, 1e6]))) for _ in range(blocks - 1)]
    m = tiny_model("m0", tables, boundary)
    pools = [(g, draw(st.integers(1, 2)), draw(st.integers(1, 2)), (1,)) for g in "ABC"]
    cluster = tiny_cluster(pools, bandwidth_gbps=draw(st.sampled_from([1.0, 10.0])))
    prices = {g: float(draw(st.integers(1, 9))) for g in "ABC"}
    slo = float(draw(st.integers(3000, 60000)))
    return m, cluster, prices, slo, draw(st.floats(0.05, 1.2))


@SETTINGS
@given(three_type_instances())
def test_cost_matches_the_cheapest_sub_cluster_found_by_brute_force(inst):
    # The cheapest plan serving a rate uses some n_k <= N_k GPUs of each type, and is then a
    # plan of the sub-cluster of those GPUs: brute force every sub-cluster's best throughput
    # (an independent search) and keep the cheapest one that reaches the rate.
    m, cluster, prices, slo, fraction = inst
    full = brute_force_single(m, cluster, slo)
    if not full:
        return
    rate = fraction * full
    best = None
    for counts in itertools.product(*[range(p.count + 1) for p in cluster.pools]):
        sub = tiny_cluster(
            [
                (p.gpu, n, p.gpus_per_server, p.shares)
                for p, n in zip(cluster.pools, counts, strict=True)
            ],
            cluster.bandwidth_gbps,
        )
        served = brute_force_single(m, sub, slo) or 0.0
        if served >= rate * (1 - 1e-9):
            price = sum(prices[p.gpu] * n for p, n in zip(cluster.pools, counts, strict=True))
            best = price if best is None else min(best, price)
    req = PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=(m,),
        weights=(1.0,),
        slos_us=(slo,),
        cluster=cluster,
        margin=0.0,
        batch_wait=False,
        mip_gap=1e-9,
        objective="cost",
        rates=(rate,),
        prices=prices,
    )
    if best is None:
        with pytest.raises(InfeasibleError, match="m0 asks"):
            make_plan(req)
        return
    plan = make_plan(req)
    assert plan.meta["cost_per_hour"] == pytest.approx(best)
    assert plan.models[0].throughput >= rate * (1 - 1e-6)


def test_exclude_plans_for_the_surviving_gpus_and_names_bad_counts():
    from poolpipe.errors import ClusterError

    cluster = cost_request(model(), 12_000, 1.0).cluster
    less = cluster.without({"A": 1})
    assert [(p.gpu, p.count) for p in less.pools] == [("A", 1), ("B", 4)]
    req = PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=(model(),),
        weights=(1.0,),
        slos_us=(12_000,),
        cluster=less,
        margin=0.0,
        mip_gap=1e-9,
        batch_wait=False,
    )
    # one A left: one B -> A pipeline, block 1 on the A at 250 req/s, block 0 on 2 B
    assert make_plan(req).objective == pytest.approx(250.0)
    with pytest.raises(ClusterError, match="cannot exclude 3 A GPUs: cluster tiny has 2"):
        cluster.without({"A": 3})


def test_prices_become_whole_units_for_the_solver():
    from poolpipe.planner.formulation import price_units

    assert price_units({"A": 2.48, "B": 0.6}) == ({"A": 248.0, "B": 60.0}, 100.0)
    assert price_units({"A": 3.0}) == ({"A": 3.0}, 1.0)
    third = {"A": 1 / 3}
    assert price_units(third) == (third, 1.0)


# ------------------------------------------------- per-position: the split by models


@SETTINGS
@given(instances(n_models=2), st.floats(0.1, 1.3), st.booleans())
def test_cost_by_models_equals_the_cost_milp(inst, fraction, one_type):
    """Per-position plans share only the GPU counts: decompose.cheapest_split prices every
    split of them among the models. It must find what the cost MILP finds (the MILP is
    forced by declaring the cluster not decomposable), NIC limits, shares and all."""
    from poolpipe.planner import cost

    req = _cost_request(inst, one_type, fraction, step=1.0, packing="per-position")
    if req is None:
        return
    rates = req.rates
    assert rates is not None

    def plan_or_none(decomposable):
        saved = cost.decomposable
        cost.decomposable = decomposable
        try:
            return make_plan(req)
        except InfeasibleError:
            return None
        finally:
            cost.decomposable = saved

    split = plan_or_none(cost.decomposable)
    milp = plan_or_none(lambda cluster, packing: False)
    assert (split is None) == (milp is None)
    if split is None:
        return
    assert split.solver.proof == "decomposition"
    for key in ("cost_per_hour", "np_cost_per_hour"):
        assert _same_cost(split.meta[key], milp.meta[key]), key
    singles = split.meta["single_type_cost_per_hour"], milp.meta["single_type_cost_per_hour"]
    assert singles[0].keys() == singles[1].keys()
    assert all(_same_cost(singles[0][g], singles[1][g]) for g in singles[0]), singles
    for m, r in zip(split.models, rates, strict=True):
        assert m.throughput >= r * (1 - 1e-9)


def _cost_request(inst, one_type: bool, fraction: float, step: float, **options):
    """The cost request of a two-model instance (on its first GPU type only with
    `one_type`): rates `fraction` of what its max-min plan serves each model, prices
    step·i + 2 per GPU type i; None when the max-min plan leaves a model unserved."""
    models, cluster, slos = inst
    if one_type:
        cluster = tiny_cluster(
            [(p.gpu, p.count, p.gpus_per_server, p.shares) for p in cluster.pools[:1]],
            cluster.bandwidth_gbps,
        )
    base = PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=tuple(models),
        weights=(0.4, 0.6),
        slos_us=tuple(slos),
        cluster=cluster,
        margin=0.0,
        mip_gap=1e-9,
        batch_wait=False,
        **options,
    )
    try:
        most = make_plan(base)
    except PoolpipeError:
        return None
    if most.objective <= 0:
        return None  # some model cannot be served at all
    return dataclasses.replace(
        base,
        objective="cost",
        rates=tuple(fraction * m.throughput for m in most.models),
        prices={p.gpu: step * i + 2 for i, p in enumerate(cluster.pools)},
    )


def _same_cost(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and a == pytest.approx(b, rel=1e-9)
    )


# ------------------------------------------- per-share: proven by the max-min planner


@SETTINGS
@given(instances(n_models=2), st.floats(0.1, 1.0), st.booleans())
def test_a_dearer_plan_is_improved_and_the_cheapest_proven_by_gpu_counts(inst, fraction, one_type):
    """cost._prove_by_counts, handed a plan one GPU dearer than the cheapest (the cost
    MILP's, proven on these tiny instances), must find the cheapest (or one as cheap) and
    prove it: no GPU counts that cost less serve the rates (max-min objective below 1)."""
    from poolpipe.planner import cost
    from poolpipe.planner.strategies import estimate_arrival_rates

    made = _cost_request(inst, one_type, fraction, step=3.0)
    if made is None:
        return
    req, cluster, prices = cost.rate_shares(made), made.cluster, made.prices
    lam, _ = estimate_arrival_rates(req)
    P = req.max_partitions
    best = cost.cheapest(req, lam, P, False, cluster)
    assert best is not None and best.solved.result.status == "optimal"
    dearer = dataclasses.replace(best, cost_per_hour=best.cost_per_hour + max(prices.values()))
    proven = cost._prove_by_counts(req, lam, P, False, cluster, dearer, float("inf"))
    assert proven is not None and proven.solved.result.status == "optimal"
    assert proven.cost_per_hour == pytest.approx(best.cost_per_hour, rel=1e-9)
    served = [sum(served_by(c, n) for c, n in picked) for picked in proven.solved.chosen]
    assert all(s >= r * (1 - 1e-6) for s, r in zip(served, req.rates, strict=True))
