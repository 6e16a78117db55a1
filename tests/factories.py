"""Hand-built topologies and requests for stepping data planes without a plan or a clock."""

from __future__ import annotations

from collections.abc import Sequence

from poolpipe.scheduler import Request, Topology
from poolpipe.scheduler.topology import Model, Pipeline, Pool, Server, VGpu


def make_topology(
    stages: Sequence[tuple[Sequence[int], Sequence[float], float]],
    *,
    batch: int = 1,
    slo_us: float = 100.0,
    throughput: float = 100.0,
    inputs: float = 0.0,
) -> Topology:
    """One model, one pipeline. Each stage: (server of each vGPU, latency per batch 1..B,
    transfer-in µs per sample). Servers are numbered from 0 and all hold GPU type "G".
    `inputs`: the first stage's transfer-in, its requests' inputs (topology.with_inputs)."""
    return make_pipelines(
        [stages], batch=batch, slo_us=slo_us, throughput=throughput, inputs=inputs
    )


def make_pipelines(
    pipelines: Sequence[Sequence[tuple[Sequence[int], Sequence[float], float]]],
    *,
    batch: int = 1,
    slo_us: float = 100.0,
    throughput: float = 100.0,
    inputs: float = 0.0,
) -> Topology:
    """One model, a pipeline per entry, each its stages as for make_topology (every stage
    a pool of its own; the first one's transfer-in is `inputs`, its requests' inputs)."""
    servers = sorted({s for stages in pipelines for st in stages for s in st[0]})
    vgpus: list[VGpu] = []
    pools: list[Pool] = []
    pipes: list[Pipeline] = []
    for i, stages in enumerate(pipelines):
        first = len(pools)
        for d, (on, lats, tau) in enumerate(stages):
            ids = []
            for srv in on:
                ids.append(len(vgpus))
                vgpus.append(VGpu(len(vgpus), len(pools), "G", 1, len(vgpus), srv))
            pools.append(
                Pool(
                    len(pools),
                    0,
                    i,
                    d,
                    "G",
                    1,
                    d,
                    d + 1,
                    tuple(ids),
                    (float("nan"), *lats),
                    inputs if d == 0 else tau,
                )
            )
        pipes.append(Pipeline(i, 0, i, batch, tuple(range(first, len(pools))), throughput, 0.0))
    model = Model(0, "m", slo_us, 1.0, throughput, tuple(range(len(pipes))))
    return Topology(
        cluster_name="hand",
        servers=tuple(Server(s, "G", s) for s in servers),
        vgpus=tuple(vgpus),
        pools=tuple(pools),
        pipelines=tuple(pipes),
        models=(model,),
        gpu_counts={"G": len(vgpus)},
    )


def make_requests(n: int, *, start_us: float = 0.0, gap_us: float = 0.0, slo_us: float = 100.0):
    return [Request(i, 0, start_us + i * gap_us, start_us + i * gap_us + slo_us) for i in range(n)]
