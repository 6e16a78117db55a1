"""Shards of a cluster for a router tier (poolpipe.planner.shards): each router's GPUs,
split by GPU or by whole server, and what planning each shard alone costs against the
whole cluster (real MILPs on a hand-checkable model)."""

from __future__ import annotations

import pytest

from poolpipe.errors import ClusterError, InfeasibleError
from poolpipe.planner import make_plan
from poolpipe.planner.shards import search_split, sharding_loss, split_cluster
from tests.conftest import tiny_cluster, tiny_model
from tests.test_planner_tiny import A1, B1, SMALL_BOUNDARY, request

HC2_LIKE = [("L4", 25, 4, (1, 2)), ("T4", 75, 2, (1,))]


@pytest.mark.parametrize("by", ["gpu", "server"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_shards_hold_every_gpu_once_and_as_evenly_as_they_go(by, k):
    whole = tiny_cluster(HC2_LIKE)
    shards = split_cluster(whole, k, by)
    assert len(shards) == k
    for pool in whole.pools:
        counts = [s.pool(pool.gpu).count for s in shards]
        assert sum(counts) == pool.count
        # by GPU: within one; by server: within one server's worth
        spread = 1 if by == "gpu" else pool.gpus_per_server
        assert max(counts) - min(counts) <= spread, counts
        assert all(s.pool(pool.gpu).shares == pool.shares for s in shards)
    if by == "server":  # whole servers: at most one shard holds a partial one per type
        for pool in whole.pools:
            partial = [s for s in shards if s.pool(pool.gpu).count % pool.gpus_per_server]
            assert len(partial) <= 1 + (pool.count % pool.gpus_per_server > 0)


def test_too_many_shards_for_the_servers_are_refused():
    with pytest.raises(ClusterError, match="use fewer shards"):
        split_cluster(tiny_cluster([("A", 4, 4, (1,))]), 2, "server")
    assert len(split_cluster(tiny_cluster([("A", 4, 4, (1,))]), 2, "gpu")) == 2
    with pytest.raises(ClusterError, match="choose gpu or server"):
        split_cluster(tiny_cluster([("A", 4, 4, (1,))]), 2, "rack")


def test_sharding_loss_is_what_the_shards_lose_together():
    """Two A and two B GPUs, the model of test_planner_tiny: block 0 on B (200/s), block 1
    on A (250/s) per pipeline. Whole: 400 req/s; each half (one A, one B) 200: no loss. A
    pool that fed another across the split loses."""
    m = tiny_model("m", {("A", 1): A1, ("B", 1): B1}, SMALL_BOUNDARY)

    def plan(cluster):
        made = make_plan(request(m, cluster, 12000))
        return made.objective, tuple(x.throughput / x.weight for x in made.models)

    even = sharding_loss(tiny_cluster([("A", 2, 1, (1,)), ("B", 2, 1, (1,))]), 2, plan)
    assert even.whole == pytest.approx(400.0)
    assert even.together == pytest.approx(400.0) and even.loss == pytest.approx(0.0)
    # one A, two B: whole, the B pool (two vGPUs, 400/s on block 0) feeds the A (250/s):
    # 250. Halves: (A, B) serves 200, a B alone cannot meet the SLO (25 ms): 20% lost
    lopsided = sharding_loss(tiny_cluster([("A", 1, 1, (1,)), ("B", 2, 1, (1,))]), 2, plan)
    assert lopsided.whole == pytest.approx(250.0)
    assert lopsided.shards[1] == (0.0,)
    assert lopsided.loss == pytest.approx(0.2)


def test_a_searched_split_sums_at_least_the_even_one_and_keeps_every_gpu():
    """search_split starts from the even split and moves a GPU only where the shards'
    objectives sum higher; every GPU stays in some shard and no shard is left empty (its
    router would drive nothing)."""
    m = tiny_model("m", {("A", 1): A1, ("B", 1): B1}, SMALL_BOUNDARY)

    def objective(cluster) -> float:
        try:
            return make_plan(request(m, cluster, 12000)).objective
        except InfeasibleError:
            return 0.0

    for pools in ([("A", 1, 1, (1,)), ("B", 2, 1, (1,))], [("A", 2, 1, (1,)), ("B", 3, 1, (1,))]):
        cluster = tiny_cluster(pools)
        even = sum(objective(sh) for sh in split_cluster(cluster, 2, "gpu"))
        found = search_split(cluster, 2, objective)
        assert sum(objective(sh) for sh in found) >= even - 1e-6
        assert all(sh.pools for sh in found)
        served = [objective(sh) > 0 for sh in split_cluster(cluster, 2, "gpu")]
        still = [objective(sh) > 0 for sh in found]
        assert all(b or not a for a, b in zip(served, still, strict=True))  # none stops
        for p in cluster.pools:
            assert sum(q.count for sh in found for q in sh.pools if q.gpu == p.gpu) == p.count
