"""Property-based tests: random tiny instances against an independent brute force, and
plan invariants (GPU counts, SLO, batch unification, contiguity) recomputed from scratch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poolpipe.domain.costs import ModelCosts
from poolpipe.errors import InfeasibleError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.decompose import reach
from poolpipe.planner.exact import enumerate_candidates
from poolpipe.planner.formulation import chosen_fits, chosen_objective, fit_by_swaps
from poolpipe.planner.knapsack import knapsack_bound
from poolpipe.planner.pruning import candidate_bounds
from tests.conftest import tiny_cluster, tiny_model

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instances(draw, n_models=1, shares_a=(1, 2)):
    blocks = draw(st.integers(2, 3))
    pools = [
        ("A", draw(st.integers(1, 2)), draw(st.integers(1, 2)), shares_a),
        ("B", draw(st.integers(1, 2)), draw(st.integers(1, 2)), (1,)),
    ]
    lat = st.integers(200, 20000)
    models = []
    for m in range(n_models):
        tables = {}
        for gpu, share, nb in (("A", 1, 2), ("A", 2, 1), ("B", 1, 2)):
            tables[(gpu, share)] = [[float(draw(lat)) for _ in range(nb)] for _ in range(blocks)]
        boundary = [
            float(draw(st.sampled_from([0, 1e3, 2e5, 1e6, 4e6]))) for _ in range(blocks - 1)
        ]
        models.append(tiny_model(f"m{m}", tables, boundary))
    bw = draw(st.sampled_from([1.0, 10.0]))
    slos = [float(draw(st.integers(2000, 60000))) for _ in models]
    return models, tiny_cluster(pools, bandwidth_gbps=bw), slos


def brute_force_single(model, cluster, budget, max_partitions=2, packing="per-share"):
    """Best Σ_c min_d n_d t_d over all vGPU assignments, by search."""
    B = model.num_blocks
    tau = [s * 8 / (cluster.bandwidth_gbps * 1e9) * 1e6 for s in model.boundary_bytes]
    pools = {p.gpu: p for p in cluster.pools}
    kvs = [(g, v) for g, p in pools.items() for v in p.shares if (g, v) in model.tables]
    pipes = []
    for D in range(1, max_partitions + 1):
        for cuts in itertools.combinations(range(1, B), D - 1):
            bounds = (0, *cuts, B)
            for sig in itertools.product(kvs, repeat=D):
                nb = min(model.tables[kv].max_batch for kv in sig)
                for b in range(1, nb + 1):
                    parts, e2e = [], 0.0
                    for d, (g, v) in enumerate(sig):
                        i, j = bounds[d], bounds[d + 1]
                        lat = sum(
                            max(model.tables[(g, v)].latency_us[x, b - 1], 1.0) for x in range(i, j)
                        )
                        t = b * 1e6 / lat
                        h = pools[g].gpus_per_server
                        if i > 0 and tau[i - 1] > 0:
                            t = min(t, 1e6 / (tau[i - 1] * v * h))
                        if j < B and tau[j - 1] > 0:
                            t = min(t, 1e6 / (tau[j - 1] * v * h))
                            e2e += b * tau[j - 1]
                        e2e += lat
                        parts.append((g, v, t))
                    if e2e <= budget + 1e-9:
                        pipes.append(parts)
    if not pipes:
        return None

    # per-share: (gpu, share) holds vGPUs; per-position: (gpu, position) holds GPUs in 12ths
    def fits(use):
        per = {}
        for (g, key), n in use.items():
            per[g] = per.get(g, 0) + math.ceil(n / (key if packing == "per-share" else 12))
        return all(per[g] <= pools[g].count for g in per)

    def bucket(d, g, v, n):
        return ((g, v), n) if packing == "per-share" else ((g, d), n * 12 // v)

    best = 0.0

    def dfs(k, use, value):
        nonlocal best
        best = max(best, value)
        if k == len(pipes):
            return
        dfs(k + 1, use, value)
        parts = pipes[k]
        caps = [pools[g].count * v for g, v, _ in parts]
        for ns in itertools.product(*[range(1, c + 1) for c in caps]):
            new = dict(use)
            for d, ((g, v, _), n) in enumerate(zip(parts, ns, strict=True)):
                key, amount = bucket(d, g, v, n)
                new[key] = new.get(key, 0) + amount
            if fits(new):
                dfs(k + 1, new, value + min(n * t for (_, _, t), n in zip(parts, ns, strict=True)))

    dfs(0, {}, 0.0)
    return best


@SETTINGS
@given(instances(), st.sampled_from(["per-share", "per-position"]))
def test_ppipe_matches_brute_force(inst, packing):
    (model,), cluster, (slo,) = inst
    req = single_request(model, cluster, slo, packing, mip_gap=1e-9, max_partitions=2)
    expected = brute_force_single(model, cluster, slo, packing=packing)
    if expected is None:
        with pytest.raises(InfeasibleError, match="m0"):
            make_plan(req)
        return
    plan = make_plan(req)
    assert plan.objective == pytest.approx(expected, rel=1e-6)


def check_invariants(plan, models, slos):
    """Recompute, without poolpipe's cost code, what every plan must satisfy."""
    by_name = {m.name: m for m in models}
    cluster = plan.cluster
    pools = {p.gpu: p for p in cluster.pools}
    per_share: dict[tuple[str, int, str], int] = {}  # (GPU, share, model: "" if they mix)
    per_pos: dict[tuple[str, int, str], float] = {}
    for mp, slo in zip(plan.models, slos, strict=True):
        model = by_name[mp.name]
        tau = [s * 8 / (cluster.bandwidth_gbps * 1e9) * 1e6 for s in model.boundary_bytes]
        budget = slo - math.floor(plan.margin * slo + 0.5)
        total = 0.0
        for p in mp.pipelines:
            parts = p.partitions
            assert 1 <= len(parts) <= plan.max_partitions
            assert parts[0].start == 0 and parts[-1].end == model.num_blocks  # contiguity
            assert all(a.end == b.start and a.start < a.end for a, b in itertools.pairwise(parts))
            e2e = 0.0
            cap = math.inf
            for d, q in enumerate(parts):
                assert q.share in pools[q.gpu].shares
                nic = tau and 1e6 / (q.share * pools[q.gpu].gpus_per_server)
                for edge in ([q.start - 1] if q.start > 0 else []) + (
                    [q.end - 1] if q.end < model.num_blocks else []
                ):
                    if tau[edge] > 0:
                        cap = min(cap, q.vgpus * nic / tau[edge])
                table = model.tables[(q.gpu, q.share)].latency_us
                assert p.batch <= table.shape[1]  # one batch for the whole pipeline
                lat = float(np.maximum(table[q.start : q.end, p.batch - 1], 1).sum())
                e2e += lat + (p.batch * tau[q.end - 1] if d < len(parts) - 1 else 0.0)
                cap = min(cap, q.vgpus * p.batch * 1e6 / lat)
                owner = "" if cluster.mixes_models else mp.name  # a GPU holds one model's
                share_key = (q.gpu, q.share, owner)
                per_share[share_key] = per_share.get(share_key, 0) + q.vgpus
                key = (mp.name, d, q.gpu)
                per_pos[key] = per_pos.get(key, 0.0) + q.vgpus / q.share
            if mp.est_throughput and p.batch > 1:
                e2e += 1.3e6 * (p.batch - 1) / mp.est_throughput
            assert e2e <= budget * (1 + 1e-9)
            assert p.throughput <= cap * (1 + 1e-9)
            total += p.throughput
        assert mp.throughput == pytest.approx(total)
    if plan.packing == "per-share":
        used: dict[str, int] = {}
        for (g, v, _), n in per_share.items():
            used[g] = used.get(g, 0) + math.ceil(n / v - 1e-9)
    else:
        used = {}
        for (_, _, g), x in per_pos.items():
            used[g] = used.get(g, 0) + math.ceil(x - 1e-9)
    for g, n in used.items():
        assert n <= pools[g].count


def single_request(model, cluster, slo: float, packing: str, **options) -> PlanRequest:
    """One model alone, planned without margin or batch wait (what the brute force scores)."""
    return PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=(model,), weights=(1.0,), slos_us=(slo,), cluster=cluster, margin=0.0,
        batch_wait=False, packing=packing, **options,
    )  # fmt: skip


def pair_request(inst, **options) -> PlanRequest:
    models, cluster, slos = inst
    return PlanRequest(
        delivery="off",  # the fluid MILP alone
        models=tuple(models),
        weights=(0.4, 0.6),
        slos_us=tuple(slos),
        cluster=cluster,
        **options,
    )


@SETTINGS
@given(
    instances(n_models=2),
    st.sampled_from(["ppipe", "np", "dart-r"]),
    st.sampled_from(["per-share", "per-position"]),
    st.floats(0.0, 0.5),
)
def test_every_plan_respects_constraints(inst, strategy, packing, margin):
    models, _, slos = inst
    req = pair_request(inst, strategy=strategy, packing=packing, margin=margin)
    try:
        plan = make_plan(req)
    except InfeasibleError:
        return
    check_invariants(plan, models, slos)
    assert plan.objective == pytest.approx(min(m.throughput / m.weight for m in plan.models))


@SETTINGS
@given(instances(n_models=2), st.integers(2, 3))
def test_per_model_decomposition_is_exact(inst, max_partitions):
    """The decomposition that closes per-position gaps (decompose.reach) against the group
    MILP: a plan at the group optimum exists, one 0.1% above it does not."""
    models, cluster, slos = inst
    req = pair_request(
        inst,
        packing="per-position",
        margin=0.0,
        batch_wait=False,
        mip_gap=1e-9,
        max_partitions=max_partitions,
    )
    try:
        plan = make_plan(req)
    except InfeasibleError:
        return
    costs = [ModelCosts(m, cluster, slo, 0.0, None) for m, slo in zip(models, slos, strict=True)]
    _, cands = enumerate_candidates(req, costs, max_partitions)
    z = plan.objective
    if z > 0:
        above = reach(cands, list(req.weights), cluster, z * 1.001, "highs", 60.0)
        assert above.status == "infeasible"
        below = reach(cands, list(req.weights), cluster, z * (1 - 1e-9), "highs", 60.0)
        assert below.status == "feasible"
        assert below.objective >= z * (1 - 1e-6)
        assert below.chosen is not None
        used: dict[str, int] = {}
        for picked, w in zip(below.chosen, req.weights, strict=True):  # the plan it returns
            served = sum(
                min(n * p.vgpu_throughput for n, p in zip(counts, c.partitions, strict=True))
                for c, counts in picked
            )
            assert served >= w * z * (1 - 1e-6)
            per_pos: dict[tuple[int, str], float] = {}
            for c, counts in picked:
                for d, (p, n) in enumerate(zip(c.partitions, counts, strict=True)):
                    per_pos[(d, p.gpu)] = per_pos.get((d, p.gpu), 0.0) + n / p.share
            for (_, g), x in per_pos.items():
                used[g] = used.get(g, 0) + math.ceil(x - 1e-9)
        assert all(used[p.gpu] <= p.count for p in cluster.pools if p.gpu in used)


@SETTINGS
@given(
    st.sampled_from([(1, 2), (1,)]).flatmap(
        lambda sh: st.tuples(instances(shares_a=sh), st.just(sh))
    ),
    st.sampled_from(["per-share", "per-position"]),
)
def test_knapsack_bound_is_valid_and_tight_on_whole_gpus(inst_shares, packing):
    """The knapsack bound (knapsack.py) against the brute force: for any incumbent z0 below
    the optimum, max(z0, bound) is at least the optimum and the bound at most the LP's. On
    whole GPUs only (no bucket rounding to relax) it is the optimum itself."""
    ((model,), cluster, (slo,)), shares = inst_shares
    _check_single_knapsack(model, cluster, slo, packing, shares)


@SETTINGS
@given(
    st.sampled_from([(1, 2), (1,)]).flatmap(
        lambda sh: st.tuples(instances(n_models=2, shares_a=sh), st.just(sh))
    ),
    st.sampled_from(["per-share", "per-position"]),
)
def test_knapsack_bound_of_a_pair_is_valid_and_tight_on_whole_gpus(inst_shares, packing):
    """The same for two models (per-model knapsacks combined, the max-min bisected),
    against the group MILP solved to a 1e-9 gap."""
    inst, shares = inst_shares
    req = pair_request(inst, packing=packing, margin=0.0, batch_wait=False, mip_gap=1e-9)
    try:
        best = make_plan(req).objective
    except InfeasibleError:
        return
    _check_knapsack(req, best, shares)


@st.composite
def three_type_instances(draw):
    """One model on three GPU types (A also at share 2), one or two GPUs each."""
    blocks = draw(st.integers(2, 3))
    lat = st.integers(200, 20000)
    tables = {}
    for gpu, share, nb in (("A", 1, 2), ("A", 2, 1), ("B", 1, 2), ("C", 1, 1)):
        tables[(gpu, share)] = [[float(draw(lat)) for _ in range(nb)] for _ in range(blocks)]
    boundary = [float(draw(st.sampled_from([0, 1e3, 1e6]))) for _ in range(blocks - 1)]
    shares = {"A": (1, 2), "B": (1,), "C": (1,)}
    pools = [(g, draw(st.integers(1, 2)), draw(st.integers(1, 2)), shares[g]) for g in "ABC"]
    cluster = tiny_cluster(pools, bandwidth_gbps=draw(st.sampled_from([1.0, 10.0])))
    return tiny_model("m0", tables, boundary), cluster, float(draw(st.integers(2000, 60000)))


@SETTINGS
@given(three_type_instances(), st.sampled_from(["per-share", "per-position"]))
def test_knapsack_bound_on_three_types_is_valid(inst, packing):
    """Three GPU types: the knapsack keeps the types the LP prices, folding all but one into
    a surrogate capacity when all three are (knapsack._grid). A relaxation either way: for
    any incumbent below the optimum, max(z0, bound) is at least the brute force's optimum."""
    model, cluster, slo = inst
    _check_single_knapsack(model, cluster, slo, packing, (1, 2))  # A at shares 1 and 2


def test_a_surrogate_grids_round_off_never_lifts_one_models_bound_above_the_lps():
    """A case the random draws found: B is exact, A and C folded into the surrogate
    capacity; its floored costs let the knapsack reach 3601.44 where the LP's dual bound,
    tight here, is 3601.22. The bound is the lower of the two."""
    model = tiny_model(
        "m0",
        {
            ("A", 1): [[10448.0, 200.0], [9676.0, 20000.0], [200.0, 9713.0]],
            ("A", 2): [[12929.0], [16457.0], [811.0]],
            ("B", 1): [[200.0, 200.0], [200.0, 200.0], [200.0, 200.0]],
            ("C", 1): [[12785.0], [1571.0], [551.0]],
        },
        [1e6, 1e6],
    )
    pools = [("A", 2, 1, (1, 2)), ("B", 1, 1, (1,)), ("C", 2, 1, (1,))]
    _check_single_knapsack(model, tiny_cluster(pools, 1.0), 43595.0, "per-share", (1, 2))


def test_knapsack_folds_priced_types_into_a_surrogate_capacity():
    """The grid (knapsack._grid): two types stay exact; of three or more, unpriced types
    drop and, when more than two are priced, the most valuable stays exact and the rest
    are folded by their duals, each option costing the floor of its weighted GPUs."""
    from poolpipe.planner.knapsack import SURROGATE_CELLS, _grid

    counts, unit = np.array([4.0, 10.0, 10.0]), np.array([12, 2, 1])
    cap = (counts * unit).astype(int)
    assert _grid(np.array([5.0, 1.0, 1.0])[:2], counts[:2], unit[:2], cap[:2]).exact == [0, 1]
    unpriced = _grid(np.array([5.0, 0.0, 1.0]), counts, unit, cap)
    assert (unpriced.exact, unpriced.folded, list(unpriced.cap)) == ([0, 2], [], [48, 10])
    grid = _grid(np.array([5.0, 1.0, 1.0]), counts, unit, cap)  # A: 20 of dual value
    assert (grid.exact, grid.folded) == ([0], [1, 2])
    assert list(grid.cap) == [48, SURROGATE_CELLS]
    # 3 half B-GPUs (1.5 of 20 dual units) and 5 C-GPUs (5 of 20): 6.5 / 20 of the cells;
    # all of B and C: all of them. Round-off may cost an option one cell less, never more.
    costs = grid.costs(np.array([[12, 3, 5], [0, 20, 10]]))
    assert costs[:, 0].tolist() == [12, 0]
    for cost, exact in zip(costs[:, 1], (6.5 / 20 * SURROGATE_CELLS, SURROGATE_CELLS), strict=True):
        assert math.floor(exact) - 1 <= cost <= math.floor(exact)


def _check_single_knapsack(model, cluster, slo: float, packing: str, shares) -> None:
    """_check_knapsack for one model, against the brute force."""
    req = single_request(model, cluster, slo, packing)
    best = brute_force_single(model, cluster, slo, packing=packing)
    if best is None:
        return
    _check_knapsack(req, best, shares)


def _check_knapsack(req: PlanRequest, best: float, shares: tuple[int, ...]) -> None:
    costs = [
        ModelCosts(m, req.cluster, slo, 0.0, None)
        for m, slo in zip(req.models, req.slos_us, strict=True)
    ]
    _, cands = enumerate_candidates(req, costs, 2)
    weights = list(req.weights)
    cb = candidate_bounds(cands, weights, req.cluster)
    for z0 in (0.0, best * 0.999, best):
        kb = knapsack_bound(cands, weights, cb, req.cluster, z0)
        assert kb is not None
        assert max(z0, kb.bound) >= best * (1 - 1e-9)
        assert kb.bound <= cb.dual_bound * (1 + 1e-9)
        if kb.chosen is not None and chosen_fits(kb.chosen, req.cluster, req.packing):
            assert chosen_objective(kb.chosen, weights) <= best * (1 + 1e-9) + 1e-9  # a plan
        elif kb.chosen is not None:
            # swapped into a plan that fits, serving at least as much: still a plan
            fixed = fit_by_swaps(kb.chosen, cands, req.cluster, req.packing)
            if fixed is not None:
                assert chosen_fits(fixed, req.cluster, req.packing)
                z = chosen_objective(fixed, weights)
                assert chosen_objective(kb.chosen, weights) * (1 - 1e-9) - 1e-9 <= z
                assert z <= best * (1 + 1e-9) + 1e-9
        if z0 == 0.0 and shares == (1,):
            assert kb.bound == pytest.approx(best, rel=1e-6, abs=1e-6)
            # nothing to relax: the knapsacks' own solution is an optimal plan
            assert kb.chosen is not None and chosen_fits(kb.chosen, req.cluster, req.packing)
            assert chosen_objective(kb.chosen, weights) >= best * (1 - 1e-6) - 1e-6
