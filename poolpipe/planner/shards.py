"""Shards of a cluster for a router tier: each router drives a disjoint set of GPUs (one
owner per reservation table) and is planned for its own shard, which holds as many GPUs
of every type as the others (split_cluster). What splitting costs (a pipeline can no
longer pool GPUs of two shards, and each shard serves the whole mix) is `sharding_loss`:
the shards' summed objective against the whole cluster's, each planned exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from poolpipe.domain.cluster import Cluster
from poolpipe.errors import ClusterError, InfeasibleError

SPLITS = ("gpu", "server")


def split_cluster(cluster: Cluster, k: int, by: str = "gpu") -> list[Cluster]:
    """`k` shards of `cluster`. by "server": whole servers, per GPU type (largest first)
    each to the shard with the fewest GPUs of that type, ties to the one with the fewest
    GPUs in all; by "gpu": each type's GPUs as evenly as they go (a server's GPUs may serve
    two routers; each still has its share of the server's NIC, as the planner assumes, so
    a shard keeps the type's GPUs per server). ClusterError where a shard gets no GPU."""
    if k < 1:
        raise ClusterError(f"shards: need at least 1, got {k}")
    if by not in SPLITS:
        raise ClusterError(f"shards: split by {by!r}? choose {' or '.join(SPLITS)}")
    counts = [dict.fromkeys((p.gpu for p in cluster.pools), 0) for _ in range(k)]
    for pool in cluster.pools:
        if by == "gpu":
            units = [1] * pool.count
        else:
            full, rest = divmod(pool.count, pool.gpus_per_server)
            units = [pool.gpus_per_server] * full + ([rest] if rest else [])
        for size in units:
            i = min(range(k), key=lambda s: (counts[s][pool.gpu], sum(counts[s].values()), s))
            counts[i][pool.gpu] += size
    empty = [i for i, c in enumerate(counts) if not any(c.values())]
    if empty:
        what = "GPUs" if by == "gpu" else "servers"
        raise ClusterError(
            f"cluster {cluster.name}: {k} shards, too few {what} for each to get one: use "
            "fewer shards"
        )
    keep_per_server = by == "gpu"
    return [
        replace(
            cluster,
            name=f"{cluster.name}/shard{i + 1}of{k}",
            pools=tuple(
                replace(
                    p,
                    count=c[p.gpu],
                    gpus_per_server=p.gpus_per_server
                    if keep_per_server
                    else min(p.gpus_per_server, c[p.gpu]),
                )
                for p in cluster.pools
                if c[p.gpu]
            ),
        )
        for i, c in enumerate(counts)
    ]


@dataclass(frozen=True)
class ShardingLoss:
    whole: float  # the objective planned for the whole cluster
    # per shard, planned for it alone: each model's throughput per unit of weight
    shards: tuple[tuple[float, ...], ...]

    @property
    def together(self) -> float:
        """The shards' objective together: the least over models of their summed
        throughput per unit of weight (a shard may have room beyond its own objective
        for some models)."""
        return min(sum(col) for col in zip(*self.shards, strict=True))

    @property
    def loss(self) -> float:
        """The share of the whole cluster's objective the shards lose together."""
        return 1.0 - self.together / self.whole if self.whole > 0 else 0.0


def sharding_loss(
    cluster: Cluster,
    k: int,
    plan: Callable[[Cluster], tuple[float, tuple[float, ...]]],
    by: str = "gpu",
) -> ShardingLoss:
    """`plan(cluster)`: the planner's objective for a cluster and each model's throughput
    per unit of weight under that plan (the caller plans). A shard on which the models
    cannot be served within their SLOs (InfeasibleError) serves nothing."""
    whole, per_model = plan(cluster)
    shards = []
    for shard in split_cluster(cluster, k, by):
        try:
            shards.append(plan(shard)[1])
        except InfeasibleError:
            shards.append((0.0,) * len(per_model))
    return ShardingLoss(whole, tuple(shards))
