"""The physical layout a plan runs on: servers, GPUs carved into vGPUs, and one pool of vGPUs
per (pipeline, partition), with each pool's latency at every batch size it may run.

Built once from a `Plan` and the profiles; the scheduler, the simulator and the live router
all read the same `Topology`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from poolpipe.domain.costs import ModelCosts, transfer_us_per_sample
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import ClusterError, UnknownNameError


@dataclass(frozen=True)
class Server:
    id: int
    gpu: str  # every GPU of a server is of one type
    index: int  # server number within its GPU type


@dataclass(frozen=True)
class VGpu:
    id: int
    pool: int  # the pool (pipeline partition) this vGPU serves
    gpu: str
    share: int  # 1/share of a physical GPU
    physical: int  # index of the physical GPU within its type
    server: int


@dataclass(frozen=True)
class Pool:
    """The vGPUs that run one partition of one pipeline; any of them may take any batch."""

    id: int
    model: int
    pipeline: int  # index within the model's pipelines
    position: int  # partition index within the pipeline
    gpu: str
    share: int
    start: int  # blocks [start, end)
    end: int
    vgpus: tuple[int, ...]
    latency_us: tuple[float, ...]  # [b]: compute latency at batch b (index 0 unused)
    # per sample: receiving the feature map; for a pipeline's first partition, the request's
    # inputs from the router over its server's downlink (with_inputs; 0: not modelled)
    transfer_in_us: float


@dataclass(frozen=True)
class Pipeline:
    id: int  # index into Topology.pipelines
    model: int
    index: int
    batch: int  # the plan's unified batch size
    pools: tuple[int, ...]
    throughput: float  # planned req/s
    latency_us: float  # planned end-to-end latency


@dataclass(frozen=True)
class Model:
    index: int
    name: str
    slo_us: float
    weight: float
    throughput: float  # planned req/s
    pipelines: tuple[int, ...]  # indices into Topology.pipelines


# The most partitions a pipeline may have: the data plane keys a hop's reservations
# dispatch * 64 + hop * 2 (+ 1 for its transfer; probe.reservation_key), and the runtime
# keeps a job's hops that found their vGPU idle in one 64-bit mask (ports.Job.idle).
MAX_HOPS = 31


@dataclass(frozen=True)
class Topology:
    cluster_name: str
    servers: tuple[Server, ...]
    vgpus: tuple[VGpu, ...]
    pools: tuple[Pool, ...]
    pipelines: tuple[Pipeline, ...]
    models: tuple[Model, ...]
    gpu_counts: Mapping[str, int]  # physical GPUs per type in the cluster
    overcommitted_gpus: int = 0  # GPUs whose shares sum above 1 (per-position plans only)

    def __post_init__(self) -> None:
        for p in self.pipelines:
            if len(p.pools) > MAX_HOPS:
                raise ClusterError(
                    f"{self.models[p.model].name}: a pipeline of {len(p.pools)} partitions; "
                    f"the data plane serves at most {MAX_HOPS} (plan with fewer: "
                    "--max-partitions)"
                )

    def model_index(self, name: str) -> int:
        for m in self.models:
            if m.name == name:
                return m.index
        raise UnknownNameError(
            f"no model {name!r} in the plan; it has {[m.name for m in self.models]}"
        )


def build_topology(
    plan: Plan, profiles: Mapping[str, ModelProfile], larger_batches: bool = False
) -> Topology:
    """Lay the plan's vGPUs onto GPUs (first-fit decreasing) and the GPUs onto servers.

    `larger_batches`: give each pool its profiled latencies above the plan's batch too, so the
    data plane may grow batches under a backlog (the simulator; a live deployment calibrates
    the planned batches only)."""
    models, pipelines, pools, pool_demand = _plan_pools(plan, profiles, larger_batches)
    servers, vgpus, overcommitted = _lay_out(plan, pools, pool_demand)
    return Topology(
        cluster_name=plan.cluster.name,
        servers=tuple(servers),
        vgpus=tuple(vgpus),
        pools=tuple(pools),
        pipelines=tuple(pipelines),
        models=tuple(models),
        gpu_counts={p.gpu: p.count for p in plan.cluster.pools},
        overcommitted_gpus=overcommitted,
    )


def _plan_pools(
    plan: Plan, profiles: Mapping[str, ModelProfile], larger_batches: bool
) -> tuple[list[Model], list[Pipeline], list[Pool], list[tuple[int, int, int]]]:
    """The plan's models, pipelines and pools (their vGPUs not yet laid out), and each
    pool's demand: (pool id, share, vGPUs)."""
    cluster = plan.cluster
    models: list[Model] = []
    pipelines: list[Pipeline] = []
    pools: list[Pool] = []
    pool_demand: list[tuple[int, int, int]] = []  # (pool id, share, vgpus)
    for mi, m in enumerate(plan.models):
        if m.name not in profiles:
            raise UnknownNameError(
                f"plan model {m.name!r} has no profile; import it (poolpipe profiles import-ppipe)"
            )
        costs = ModelCosts(profiles[m.name], cluster, m.slo_us, plan.margin, None)
        pipe_ids = []
        for pi, pp in enumerate(m.pipelines):
            pool_ids = []
            for d, part in enumerate(pp.partitions):
                kv = costs.kv_index(part.gpu, part.share)
                lats = [math.nan] + [
                    costs.partition_latency_us(kv, b, part.start, part.end)
                    for b in range(1, costs.max_batch + 1)
                ]
                # larger_batches: latencies above the plan's batch stay while profiled, and
                # the data plane may run such batches under a backlog (adaptive.py).
                top = len(lats) if larger_batches else pp.batch + 1
                lats = lats[: next((b for b in range(pp.batch + 1, top) if not lats[b] > 0), top)]
                if len(lats) <= pp.batch or any(not lat > 0 for lat in lats[1:]):
                    raise ClusterError(
                        f"{m.name}: partition {part.start}-{part.end} on {part.gpu}/{part.share}"
                        f" has no profiled latency for every batch 1..{pp.batch}"
                    )
                tau_in = 0.0 if part.start == 0 else float(costs.tau_us[part.start - 1])
                pid = len(pools)
                pools.append(
                    Pool(
                        id=pid,
                        model=mi,
                        pipeline=len(pipelines),
                        position=d,
                        gpu=part.gpu,
                        share=part.share,
                        start=part.start,
                        end=part.end,
                        vgpus=(),
                        latency_us=tuple(lats),
                        transfer_in_us=tau_in,
                    )
                )
                pool_demand.append((pid, part.share, part.vgpus))
                pool_ids.append(pid)
            pipe_ids.append(len(pipelines))
            pipelines.append(
                Pipeline(
                    id=len(pipelines),
                    model=mi,
                    index=pi,
                    batch=pp.batch,
                    pools=tuple(pool_ids),
                    throughput=pp.throughput,
                    latency_us=pp.latency_us,
                )
            )
        models.append(
            Model(
                index=mi,
                name=m.name,
                slo_us=m.slo_us,
                weight=m.weight,
                throughput=m.throughput,
                pipelines=tuple(pipe_ids),
            )
        )
    return models, pipelines, pools, pool_demand


def _lay_out(
    plan: Plan, pools: list[Pool], pool_demand: list[tuple[int, int, int]]
) -> tuple[list[Server], list[VGpu], int]:
    """The pools' vGPUs laid onto GPUs (first-fit decreasing) and the GPUs onto servers:
    the servers, the vGPUs, and how many GPUs are overcommitted; `pools` get their vGPUs."""
    cluster = plan.cluster
    servers: list[Server] = []
    vgpus: list[VGpu] = []
    pool_vgpus: dict[int, list[int]] = {pid: [] for pid, _, _ in pool_demand}
    overcommitted = 0
    for cpool in cluster.pools:
        demand = [d for d in pool_demand if pools[d[0]].gpu == cpool.gpu]
        if not demand:
            continue
        unit = math.lcm(*(share for _, share, _ in demand))  # capacity of one GPU, in units
        free: list[int] = []  # remaining units per physical GPU opened so far
        owner: list[tuple[int, ...]] = []  # per physical GPU: the group whose vGPUs it holds
        placed: list[tuple[int, int, int]] = []  # (pool, share, physical gpu)
        # GPUs go to one group of pools each, as the plan's packing rule counts them
        # (_gpu_group); within a group, whole GPUs first, then halves, ...: first-fit
        # decreasing keeps shares together.
        for pid, share, n in sorted(
            demand, key=lambda d: (_gpu_group(plan, pools[d[0]]), d[1], d[0])
        ):
            size = unit // share
            group = _gpu_group(plan, pools[pid])
            for _ in range(n):
                g = next((i for i, f in enumerate(free) if f >= size and owner[i] == group), None)
                if g is None:
                    if len(free) < cpool.count:
                        free.append(unit)
                        owner.append(group)
                        g = len(free) - 1
                    else:
                        # The per-position rule rounds each position's GPUs separately, so
                        # mixed shares may not pack; run on the group's least-loaded GPU
                        # instead (any GPU's, where the group has none).
                        mine = [i for i in range(len(free)) if owner[i] == group]
                        g = max(mine or range(len(free)), key=lambda i: free[i])
                        if free[g] >= 0:
                            overcommitted += 1
                free[g] -= size
                placed.append((pid, share, g))
        # Deal the GPUs out over all of the type's servers in turn: a pool's vGPUs then sit
        # on many servers, and the NIC load of senders and receivers is spread evenly.
        base = len(servers)
        num_servers = math.ceil(cpool.count / cpool.gpus_per_server)
        for s in range(min(num_servers, len(free))):
            servers.append(Server(id=base + s, gpu=cpool.gpu, index=s))
        for pid, share, g in placed:
            vid = len(vgpus)
            server = base + g % num_servers
            vgpus.append(VGpu(vid, pid, cpool.gpu, share, g, server))
            pool_vgpus[pid].append(vid)
    for pid, vids in pool_vgpus.items():
        pools[pid] = replace(pools[pid], vgpus=tuple(vids))
    return servers, vgpus, overcommitted


def on_servers(topo: Topology, server_of: Mapping[tuple[str, int], str]) -> Topology:
    """`topo` with its GPUs on the servers they run on: `server_of` names the server of each
    (GPU type, physical GPU) that a vGPU uses (an inventory's: deploy/load.gpu_servers). The
    layout deals a type's GPU i to the type's server i mod servers, each as full as the
    fullest server; where an inventory's servers hold different counts, its GPU i sits
    elsewhere, and the router must reserve the NICs that GPU's bytes cross. Servers are
    numbered type by type as the layout numbers them, in the order their GPUs first come;
    where the inventory's servers are the layout's, `topo` itself comes back."""
    first: dict[str, int] = {}  # type -> its first server's id in the layout
    for s in topo.servers:
        first.setdefault(s.gpu, s.id)
    servers: list[Server] = []
    index: dict[tuple[str, str], int] = {}  # (type, server name) -> server id
    for v in sorted(topo.vgpus, key=lambda v: (first[v.gpu], v.physical)):
        key = (v.gpu, server_of[(v.gpu, v.physical)])
        if key not in index:
            index[key] = len(servers)
            mine = sum(s.gpu == v.gpu for s in servers)
            servers.append(Server(id=len(servers), gpu=v.gpu, index=mine))
    vgpus = tuple(
        replace(v, server=index[(v.gpu, server_of[(v.gpu, v.physical)])]) for v in topo.vgpus
    )
    if tuple(servers) == topo.servers and vgpus == topo.vgpus:
        return topo
    return replace(topo, servers=tuple(servers), vgpus=vgpus)


def _gpu_group(plan: Plan, pool: Pool) -> tuple[int, ...]:
    """Which pools' vGPUs may share a physical GPU, as the plan's packing counts GPUs:
    per-position, a model's partitions at one position; per-share, a model's (every
    pool's, where the cluster lets models share GPUs: Cluster.mixed_model_interference)."""
    if plan.packing == "per-position":
        return (pool.model, pool.position)
    if plan.cluster.mixes_models:
        return ()
    owner = plan.owner(plan.models[pool.model].name)
    return (next(i for i, m in enumerate(plan.models) if plan.owner(m.name) == owner),)


def latency_tables(topo: Topology) -> list[list[float]]:
    """Per pool, its latency at each batch size as a list of floats (index 0 unused): what
    the compiled hot path reads (native.py: a list of floats, not a dataclass's tuple)."""
    return [[float(x) for x in pool.latency_us] for pool in topo.pools]


def with_latencies(topo: Topology, latency_us: Mapping[int, tuple[float, ...]]) -> Topology:
    """The same topology with some pools' latencies (per batch, index 0 unused) replaced, as
    measured on the live system (calibration)."""
    pools = tuple(
        replace(p, latency_us=tuple(latency_us[p.id])) if p.id in latency_us else p
        for p in topo.pools
    )
    return replace(topo, pools=pools)


def filled(topo: Topology) -> Topology:
    """Piccolo's dummy requests: a batch smaller than its pipeline's planned batch filled up to
    it with dummy requests, so that every stage runs, and is reserved for, the planned
    batch's latency whatever the requests it carries (larger batches, run under a backlog,
    as they were). The simulator's `--dummy-fill` (measured in scripts/bench_dummy_fill.py)."""
    lats: dict[int, tuple[float, ...]] = {}
    for pl in topo.pipelines:
        for pid in pl.pools:
            lat = topo.pools[pid].latency_us
            full = lat[pl.batch]
            lats[pid] = tuple(max(x, full) if 0 < b < pl.batch else x for b, x in enumerate(lat))
    return with_latencies(topo, lats)


def with_inputs(
    topo: Topology, input_bytes: Mapping[str, float], bandwidth_gbps: float
) -> Topology:
    """The same topology with each pipeline's first partition receiving its model's request
    inputs (`input_bytes` per sample, by model name) over its server's downlink at
    `bandwidth_gbps`: the data plane then reserves that link for them as for a feature map
    (the router's own NIC is not modelled). The planner's transfer model (the paper's)
    leaves them out; a live router sends them, and on a server that receives several
    models' inputs (hc2-small's one L4 server) they are most of what its NIC carries."""
    if not bandwidth_gbps > 0:
        raise ClusterError(f"bandwidth must be > 0 Gbit/s to time inputs, got {bandwidth_gbps}")
    pools = list(topo.pools)
    for i, p in enumerate(topo.pools):
        name = topo.models[p.model].name
        if p.position == 0 and name in input_bytes:  # the planner's tau for them
            tau = transfer_us_per_sample(float(input_bytes[name]), bandwidth_gbps)
            pools[i] = replace(p, transfer_in_us=tau)
    return replace(topo, pools=tuple(pools))


def simulated_topology(plan: Plan, profiles: Mapping[str, ModelProfile]) -> Topology:
    """The topology the simulator runs `plan` on: latencies above the plan's batch too (the
    data plane may grow batches under a backlog), and where the plan counts each request's
    inputs on its first server's NIC (Plan.counts_inputs), those inputs on that server's
    downlink, as the planner counted them."""
    topo = build_topology(plan, profiles, larger_batches=True)
    if not plan.counts_inputs:
        return topo
    sizes = {m.name: profiles[m.name].input_bytes for m in plan.models}
    known = {name: size for name, size in sizes.items() if size is not None}
    return with_inputs(topo, known, plan.cluster.bandwidth_gbps)


def planned_utilisation(topo: Topology, loads: Sequence[float]) -> list[float]:
    """Each pool's planned busy fraction per vGPU when model m receives `loads[m]` req/s:
    the model's load split over its pipelines as their planned throughputs, a request
    costing a pool its batch's latency over the batch. At a model's planned throughput its
    bottleneck pools are at 1; at its deliverable load, at what the plan holds back."""
    out = []
    for p in topo.pools:
        model = topo.models[p.model]
        pl = topo.pipelines[model.pipelines[p.pipeline]]
        share = pl.throughput / model.throughput if model.throughput > 0 else 0.0
        per_request_s = p.latency_us[pl.batch] / pl.batch / 1e6
        out.append(loads[p.model] * share * per_request_s / max(1, len(p.vgpus)))
    return out
