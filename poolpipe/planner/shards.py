"""Shards of a cluster for a router tier: each router drives a disjoint set of GPUs (one
owner per reservation table) and is planned for its own shard, which holds as many GPUs
of every type as the others (split_cluster), or whatever split makes the shards'
objectives sum highest (search_split). What splitting costs (a pipeline can no longer
pool GPUs of two shards, and each shard serves the whole mix) is `sharding_loss`: the
shards' summed objective against the whole cluster's, each planned exactly."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from poolpipe.domain.cluster import Cluster
from poolpipe.errors import ClusterError, InfeasibleError, PoolpipeError
from poolpipe.planner.exact import enumerate_candidates, model_costs
from poolpipe.planner.formulation import _add_packing, _add_pipelines
from poolpipe.planner.request import PlanRequest
from poolpipe.planner.solvers import Milp, solve

SPLITS = ("gpu", "server", "search")
# GPUs of one type search_split moves at once (a shard's objective moves in steps: one GPU
# often changes nothing, several do)
MOVE_SIZES = (1, 2, 3, 4, 6, 8)


def split_cluster(cluster: Cluster, k: int, by: str = "gpu") -> list[Cluster]:
    """`k` shards of `cluster`. by "server": whole servers, per GPU type (largest first)
    each to the shard with the fewest GPUs of that type, ties to the one with the fewest
    GPUs in all; by "gpu": each type's GPUs as evenly as they go (a server's GPUs may serve
    two routers; each still has its share of the server's NIC, as the planner assumes, so
    a shard keeps the type's GPUs per server). ClusterError where a shard gets no GPU."""
    if k < 1:
        raise ClusterError(f"shards: need at least 1, got {k}")
    if by not in SPLITS[:2]:
        raise ClusterError(f"shards: split by {by!r}? choose gpu or server (search: search_split)")
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
    return [_shard(cluster, c, i, k, keep_per_server=by == "gpu") for i, c in enumerate(counts)]


def _shard(cluster: Cluster, counts: dict[str, int], i: int, k: int, keep_per_server: bool):
    return replace(
        cluster,
        name=f"{cluster.name}/shard{i + 1}of{k}",
        pools=tuple(
            replace(
                p,
                count=counts[p.gpu],
                gpus_per_server=p.gpus_per_server
                if keep_per_server
                else min(p.gpus_per_server, counts[p.gpu]),
            )
            for p in cluster.pools
            if counts.get(p.gpu)
        ),
    )


def search_split(
    cluster: Cluster,
    k: int,
    objective: Callable[[Cluster], float],
    max_moves: int = 200,
    start: Sequence[Mapping[str, int]] | None = None,
) -> list[Cluster]:
    """`k` shards of `cluster` whose objectives (`objective(shard)`: the planner's, req/s
    per unit of weight; 0 where it cannot serve the models) sum highest, found by local
    search from the even split by GPU: move MOVE_SIZES GPUs of a type from one shard to
    another while the best such move raises the sum (a shard keeps a GPU at least, and
    one that serves the mix keeps serving it: a router whose shard cannot is no router).
    With routers weighted by their shards' objectives (weight agents), that sum is what
    the tier serves; shards may then differ in size and mix of types. Each shard's
    objective is asked once per GPU counts. `start`: GPUs per type of each shard to search
    from instead (shards_bound's split: a local search from the even split can stop far
    from it)."""
    if start is None:
        counts = [{p.gpu: p.count for p in sh.pools} for sh in split_cluster(cluster, k, "gpu")]
    else:
        counts = [dict(c) for c in start]
        _check_counts(cluster, k, counts)
    types = [p.gpu for p in cluster.pools]
    for c in counts:
        for t in types:
            c.setdefault(t, 0)
    known: dict[tuple[int, ...], float] = {}

    def value(c: dict[str, int]) -> float:
        key = tuple(c[t] for t in types)
        if key not in known:
            known[key] = objective(_shard(cluster, c, 0, k, True)) if any(key) else 0.0
        return known[key]

    for _ in range(max_moves):
        best, move = 0.0, None
        for t, n, a, b in itertools.product(types, MOVE_SIZES, range(k), range(k)):
            if a == b or counts[a][t] < n or sum(counts[a].values()) == n:
                continue  # (a router keeps a GPU at least)
            before = value(counts[a]) + value(counts[b])
            ca, cb = {**counts[a], t: counts[a][t] - n}, {**counts[b], t: counts[b][t] + n}
            if value(ca) <= 0 < value(counts[a]):
                continue  # every router serves: a shard that could stays able to
            gain = value(ca) + value(cb) - before
            if gain > best + 1e-9:
                best, move = gain, (a, b, ca, cb)
        if move is None:
            break
        a, b, ca, cb = move
        counts[a], counts[b] = ca, cb
    return [_shard(cluster, c, i, k, True) for i, c in enumerate(counts)]


def _check_counts(cluster: Cluster, k: int, counts: Sequence[Mapping[str, int]]) -> None:
    """GPU counts of `k` shards that hold every GPU of `cluster` once, each shard one at
    least; ClusterError naming what is wrong."""
    if len(counts) != k:
        raise ClusterError(f"shards: {k} wanted, {len(counts)} GPU counts given")
    for p in cluster.pools:
        got = sum(c.get(p.gpu, 0) for c in counts)
        if got != p.count:
            raise ClusterError(
                f"cluster {cluster.name}: the shards hold {got} {p.gpu} GPUs, it has {p.count}"
            )
    if any(not any(c.values()) for c in counts):
        raise ClusterError("shards: each needs a GPU at least")


@dataclass(frozen=True)
class ShardingLoss:
    whole: float  # the objective planned for the whole cluster
    # per shard, planned for it alone: each model's throughput per unit of weight
    shards: tuple[tuple[float, ...], ...]
    split: tuple[Cluster, ...] = ()  # the shards

    @property
    def together(self) -> float:
        """The shards' objective together: the least over models of their summed
        throughput per unit of weight (a shard may have room beyond its own objective
        for some models)."""
        return min(sum(col) for col in zip(*self.shards, strict=True))

    @property
    def summed(self) -> float:
        """The shards' objectives summed: what the tier serves of the mix with each router
        weighted by its shard's objective (each router gets the whole mix)."""
        return sum(min(col) if col else 0.0 for col in self.shards)

    @property
    def loss(self) -> float:
        """The share of the whole cluster's objective the shards lose (summed)."""
        return 1.0 - self.summed / self.whole if self.whole > 0 else 0.0

    @property
    def loss_together(self) -> float:
        """The same against `together` (an upper bound: models' room pooled across shards)."""
        return 1.0 - self.together / self.whole if self.whole > 0 else 0.0


def sharding_loss(
    cluster: Cluster,
    k: int,
    plan: Callable[[Cluster], tuple[float, tuple[float, ...]]],
    by: str = "gpu",
    start: Sequence[Mapping[str, int]] | None = None,
) -> ShardingLoss:
    """`plan(cluster)`: the planner's objective for a cluster and each model's throughput
    per unit of weight under that plan (the caller plans). A shard on which the models
    cannot be served within their SLOs (InfeasibleError) serves nothing. `start`: where
    the search ("search") starts (search_split)."""
    whole, per_model = plan(cluster)
    planned: dict[tuple, tuple[float, ...]] = {}  # by GPU counts: the search asked already

    def each(shard: Cluster) -> tuple[float, ...]:
        key = tuple((p.gpu, p.count, p.gpus_per_server) for p in shard.pools)
        if key not in planned:
            try:
                planned[key] = plan(shard)[1]
            except InfeasibleError:
                planned[key] = (0.0,) * len(per_model)
        return planned[key]

    if by == "search":
        split = search_split(cluster, k, lambda sh: min(each(sh)), start=start)
    else:
        split = split_cluster(cluster, k, by)
    return ShardingLoss(whole, tuple(each(sh) for sh in split), tuple(split))


# the least a shard serves per unit of weight in shards_bound: every router serves the mix
_SERVES = 1e-3


@dataclass(frozen=True)
class ShardBound:
    """What `k` shards of a cluster can serve at most, summed (each shard's objective:
    req/s per unit of weight, every model served), over every split of its GPUs at once.
    `found`: the best split the MILP met (`counts`, per shard GPUs per type, the shards in
    falling objective), as it planned them; `bound`: no split's shards, each planned for
    itself, sum more (never above the whole cluster's objective, `whole`)."""

    k: int
    whole: float
    found: float
    bound: float
    counts: tuple[dict[str, int], ...]
    status: str
    seconds: float

    @property
    def least_loss(self) -> float:
        """The least share of the whole cluster's objective any split of it loses."""
        return max(0.0, 1.0 - self.bound / self.whole) if self.whole > 0 else 0.0


def shards_bound(req: PlanRequest, k: int, whole: float) -> ShardBound:
    """One MILP over `k` copies of the group MILP (formulation.py), one per shard, each
    with its own GPU counts (variables summing to the cluster's), maximising the shards'
    objectives summed, each shard serving every model (at least _SERVES per unit of
    weight: a router whose shard serves nothing is no router); shards in falling
    objective (they are alike: the order breaks the symmetry). `whole`: the cluster's own
    objective, planned at once (a sum above it is no bound).

    It bounds every split planned shard by shard (sharding_loss) whose shards keep each
    type's GPUs per server (split by GPU, searched): a shard's candidate pipelines are a
    subset of the ones here, which are enumerated without the batch-fill wait (a shard's
    arrival estimate, lower than the cluster's, only lengthens that wait and so drops
    pipelines); a shard's plan is one copy's solution, its GPU counts the copy's. (A
    shard of fewer GPUs than a server holds, split by whole servers, gets more of the NIC
    per GPU, which this does not cover.) The bound is HiGHS's, at optimality or at the
    request's time limit."""
    if k < 1:
        raise ClusterError(f"shards: need at least 1, got {k}")
    if req.strategy not in ("ppipe", "np") or req.objective != "maxmin":
        raise PoolpipeError(
            f"a bound on sharding covers the ppipe and np strategies' max-min objective, "
            f"not {req.strategy} / {req.objective}"
        )
    whole_gpus = req.strategy == "np"
    free = replace(req, batch_wait=False)
    costs = model_costs(free, [None] * len(req.models), whole_gpus_only=whole_gpus)
    cands = enumerate_candidates(free, costs, 1 if whole_gpus else req.max_partitions)[1]
    count = {p.gpu: p.count for p in req.cluster.pools}
    milp = Milp()
    zs: list[int] = []
    gpus: list[dict[str, int]] = []
    for _ in range(k):
        z = milp.add_var(cost=1.0, lower=_SERVES)
        xs, _ns, buckets = _add_pipelines(milp, cands, count, req.packing, req.cluster.mixes_models)
        for m, xm in enumerate(xs):
            milp.add_row({z: req.weights[m], **{x: -1.0 for x in xm}}, upper=0.0)
        mine = {g: milp.add_var(upper=n, integer=True) for g, n in count.items()}
        for g, terms in _add_packing(milp, buckets, count, req.packing).items():
            milp.add_row({**terms, mine[g]: -1.0}, upper=0.0)
        milp.add_row(dict.fromkeys(mine.values(), 1.0), lower=1.0)  # a GPU at least
        zs.append(z)
        gpus.append(mine)
    for g, n in count.items():
        milp.add_row({shard[g]: 1.0 for shard in gpus}, upper=float(n))
    for a, b in itertools.pairwise(zs):
        milp.add_row({a: 1.0, b: -1.0}, lower=0.0)
    r = solve(milp, req.solver, req.time_limit_s, req.mip_gap, req.threads)
    if r.status == "infeasible":
        raise InfeasibleError(
            f"cluster {req.cluster.name}: {k} shards cannot each serve every model within "
            "its SLO; use fewer shards"
        )
    counts: tuple[dict[str, int], ...] = ()
    found = 0.0
    if r.values is not None:
        counts = tuple({g: round(r.values[v]) for g, v in shard.items()} for shard in gpus)
        found = r.objective
    bound = min(r.bound, whole) if math.isfinite(r.bound) else whole
    return ShardBound(k, whole, found, bound, counts, r.status, r.seconds)
