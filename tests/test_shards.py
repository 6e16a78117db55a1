"""Shards of a cluster for a router tier (poolpipe.planner.shards): each router's GPUs,
split by GPU or by whole server, and what planning each shard alone costs against the
whole cluster (real MILPs on a hand-checkable model)."""

from __future__ import annotations

import pytest

from poolpipe.errors import ClusterError, InfeasibleError
from poolpipe.planner import make_plan
from poolpipe.planner.shards import search_split, sharding_loss, shards_bound, split_cluster
from tests.conftest import tiny_cluster, tiny_model
from tests.test_planner_tiny import A1, B1, SMALL_BOUNDARY, request

HC2_LIKE = [("L4", 25, 4, (1, 2)), ("T4", 75, 2, (1,))]
TINY = tiny_model("m", {("A", 1): A1, ("B", 1): B1}, SMALL_BOUNDARY)


def objective(cluster) -> float:
    """The tiny model's objective planned on `cluster` (12 ms SLO); 0 where it cannot be
    served."""
    try:
        return make_plan(request(TINY, cluster, 12000)).objective
    except InfeasibleError:
        return 0.0


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


def test_the_joint_bound_is_the_best_split_found_by_brute_force():
    """shards_bound: one MILP over every split. Two A and three B GPUs, the model of
    test_planner_tiny (block 0 on B 200/s, block 1 on A 250/s; A alone 125/s): whole 500
    (three B feed two A). Two shards each need an A: (A, 2 B) 250 + (A, B) 200 = 450, the
    best of every split planned shard by shard (checked by enumerating them): 10% lost at
    least. Two A and two B split into halves lose nothing; one A cannot make two shards."""
    m = TINY

    cluster = tiny_cluster([("A", 2, 1, (1,)), ("B", 3, 1, (1,))])
    whole = objective(cluster)
    assert whole == pytest.approx(500.0)
    got = shards_bound(request(m, cluster, 12000), 2, whole)
    assert got.status == "optimal"
    assert got.bound == pytest.approx(450.0, rel=1e-6)
    assert got.found == pytest.approx(450.0, rel=1e-6)
    assert got.least_loss == pytest.approx(0.1, rel=1e-5)
    assert [c["A"] for c in got.counts] == [1, 1] and [c["B"] for c in got.counts] == [2, 1]
    best = 0.0
    for a in range(3):
        for b in range(4):
            halves = [{"A": a, "B": b}, {"A": 2 - a, "B": 3 - b}]
            if not all(any(h.values()) for h in halves):
                continue
            shards = [tiny_cluster([(g, n, 1, (1,)) for g, n in h.items() if n]) for h in halves]
            served = [objective(sh) for sh in shards]
            if all(v > 0 for v in served):  # every router serves
                best = max(best, sum(served))
    assert best == pytest.approx(got.bound, rel=1e-6)

    def plan(c):
        return objective(c), (objective(c),)

    found = sharding_loss(cluster, 2, plan, by="search")
    assert found.summed <= got.bound * (1 + 1e-9)
    # the search from the bound's own split keeps it: nothing sums more
    joint = sharding_loss(cluster, 2, plan, by="search", start=got.counts)
    assert joint.summed == pytest.approx(got.bound, rel=1e-6)
    with pytest.raises(ClusterError, match="the shards hold 3 A GPUs, it has 2"):
        sharding_loss(cluster, 2, plan, by="search", start=[{"A": 2, "B": 1}, {"A": 1, "B": 2}])
    with pytest.raises(ClusterError, match="each needs a GPU"):
        sharding_loss(cluster, 2, plan, by="search", start=[{"A": 2, "B": 3}, {"A": 0}])

    even = tiny_cluster([("A", 2, 1, (1,)), ("B", 2, 1, (1,))])
    assert shards_bound(request(m, even, 12000), 2, 400.0).least_loss == pytest.approx(0.0)
    one_a = tiny_cluster([("A", 1, 1, (1,)), ("B", 2, 1, (1,))])
    with pytest.raises(InfeasibleError, match="use fewer shards"):
        shards_bound(request(m, one_a, 12000), 2, 250.0)


def test_nodes_are_dealt_whole_servers_first_and_counts_must_add_up():
    from poolpipe.domain.tier import nodes_for_counts

    nodes = [(f"a{i}", "L4", "s0") for i in range(4)] + [
        ("b0", "L4", "s1"),
        ("c0", "T4", "s2"),
        ("c1", "T4", "s2"),
        ("d0", "T4", "s3"),
    ]
    got = nodes_for_counts(nodes, [{"L4": 1, "T4": 2}, {"L4": 4, "T4": 1}])
    # the 4-GPU server goes whole to the shard wanting 4 L4, the 2-GPU one to the shard
    # wanting 2 T4
    assert got == [("b0", "c0", "c1"), ("a0", "a1", "a2", "a3", "d0")]
    split = nodes_for_counts(nodes, [{"L4": 3, "T4": 1}, {"L4": 2, "T4": 2}])
    assert sorted(n for shard in split for n in shard) == sorted(n for n, _, _ in nodes)
    assert [sum(n.startswith(("a", "b")) for n in s) for s in split] == [3, 2]
    with pytest.raises(ClusterError, match="T4: the shards want 2 GPUs, the inventory has 3"):
        nodes_for_counts(nodes, [{"L4": 5, "T4": 1}, {"T4": 1}])


def test_poolpipe_shards_writes_each_routers_nodes_into_the_inventory(tmp_path, capsys):
    """The CLI on a small L4 + T4 inventory with three routers, the shipped group-2
    profiles: every node to exactly one router, the shards' GPUs as the search found them,
    and the written inventory loads again; `--bound` bounds every split, the one written
    among them."""
    import re
    from pathlib import Path

    from poolpipe.domain.inventory import load_inventory
    from poolpipe.domain.profiles import load_ppipe_dir
    from poolpipe.store.warehouse import Warehouse
    from poolpipe_cli import main

    group2 = Path(__file__).resolve().parents[1] / "data" / "ppipe-gpu-group2"
    wh = tmp_path / "wh.duckdb"
    with Warehouse.open(wh) as w:
        w.store_profiles(load_ppipe_dir(group2))
    servers = [("s0", "L4", 4), ("s1", "L4", 2)] + [(f"t{i}", "T4", 2) for i in range(6)]
    lines, port = [], 9000
    for s, device, n in servers:
        lines += [f'[[servers]]\nname = "{s}"\nbandwidth_gbps = 10']
        for i in range(n):
            port += 1
            lines += [
                f'[[nodes]]\nname = "{s}-{i}"\nserver = "{s}"\ndevice = "{device}"\n'
                f'grpc = "10.0.0.1:{port}"\nshares = [1, 2]'
            ]
    lines += ['[balancer]\nhttp = "127.0.0.1:8000"\ngrpc = "127.0.0.1:8001"']
    # a shard of two L4s serves the three models only where they may share a GPU (this test
    # is about the split: sharing at no cost; by default each model needs an L4 of its own)
    lines.insert(0, "mixed_model_interference = 1.0\n")
    for r in range(3):
        lines += [
            f'[[routers]]\nname = "r{r}"\nhttp = "10.0.1.{r}:8000"\ngrpc = "10.0.1.{r}:8001"\n'
            f'ready = "10.0.1.{r}:8002"'
        ]
    inv = tmp_path / "inventory.toml"
    inv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "split.toml"
    rc = main(
        [
            "--warehouse",
            str(wh),
            "shards",
            "--inventory",
            str(inv),
            "--models",
            "colorization-v2,googlenet-v3-pytorch,repvgg-b3",
            "--weights",
            "0.30,0.33,0.37",
            "--slo-scale",
            "5",
            "-o",
            str(out),
            "--bound",
        ]
    )
    assert rc == 0
    text = " ".join(capsys.readouterr().out.split())
    summed = float(re.search(r"summed ([0-9.]+): sharding loss", text).group(1))
    bound = re.search(
        r"no split among 3 routers loses less than [0-9.]+% \((.*?); summed at most ([0-9.]+)\)",
        text,
    )
    assert bound is not None, text
    assert float(bound.group(2)) >= summed - 0.05
    split = load_inventory(out)
    dealt = [n for r in split.routers for n in r.nodes]
    assert sorted(dealt) == sorted(n.name for n in split.nodes)  # each node once
    assert all(r.nodes for r in split.routers)
    for r in split.routers:  # each shard can serve the mix on its own
        shard = split.shard(r.name).cluster()
        assert sum(p.count for p in shard.pools) == len(r.nodes)
    assert main(["--warehouse", str(wh), "shards", "--inventory", str(inv), "--models", "x"]) == 2
