"""Where a plan's partitions run: one stage-worker node per physical GPU of the topology,
and on each node one partition model per (model, blocks) with one instance per vGPU.

Pure data from a `Topology`; the Triton adapter renders and starts what this describes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from poolpipe.offline.partitions import partition_name
from poolpipe.scheduler.topology import Topology


@dataclass(frozen=True)
class NodeSpec:
    name: str  # e.g. "cpu-1t-0": device type and the physical GPU's index
    gpu: str
    physical: int
    server: int


@dataclass(frozen=True)
class Placement:
    node: str
    model: str
    start: int  # blocks [start, end)
    end: int
    instances: int  # vGPUs of this partition on this node
    tag: str = ""  # rollout generation

    @property
    def partition(self) -> str:
        return partition_name(self.model, self.start, self.end, self.tag)


@dataclass(frozen=True)
class Layout:
    nodes: tuple[NodeSpec, ...]
    placements: tuple[Placement, ...]
    vgpu_node: dict[int, str]  # vGPU id -> node name
    pool_partition: dict[int, str]  # pool id -> partition model name
    # (partition, node) -> its profiled latency (µs) at batch 1, 2, ... on that node's vGPU
    # share: what an emulated GPU node completes its batches by (it travels with the
    # partition). Per node, not per device type: one partition may run at two shares.
    partition_latency_us: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)


def node_name(gpu: str, physical: int) -> str:
    return f"{gpu}-{physical}"


def vgpu_nodes(topo: Topology) -> dict[int, str]:
    """Each vGPU's node: one node per physical GPU (its failure domain)."""
    return {v.id: node_name(v.gpu, v.physical) for v in topo.vgpus}


def layout(topo: Topology, tag: str = "") -> Layout:
    nodes: dict[str, NodeSpec] = {}
    vgpu_node: dict[int, str] = {}
    count: Counter[tuple[str, str, int, int]] = Counter()
    for v in topo.vgpus:
        name = node_name(v.gpu, v.physical)
        nodes.setdefault(name, NodeSpec(name, v.gpu, v.physical, v.server))
        vgpu_node[v.id] = name
        pool = topo.pools[v.pool]
        model = topo.models[pool.model].name
        count[(name, model, pool.start, pool.end)] += 1
    placements = tuple(
        Placement(node, model, start, end, n, tag)
        for (node, model, start, end), n in sorted(count.items())
    )
    pool_partition = {
        p.id: partition_name(topo.models[p.model].name, p.start, p.end, tag) for p in topo.pools
    }
    latency: dict[tuple[str, str], tuple[float, ...]] = {}
    for v in topo.vgpus:
        # one partition model per (node, partition): where its pools differ (two batch
        # sizes: one table a prefix of the other; two shares of one GPU), the slower at
        # each batch, up to the larger batch (an emulated node refuses a batch beyond it)
        pool = topo.pools[v.pool]
        key = (pool_partition[pool.id], vgpu_node[v.id])
        latency[key] = _slower(latency.get(key, ()), tuple(float(x) for x in pool.latency_us[1:]))
    return Layout(
        tuple(sorted(nodes.values(), key=lambda n: n.name)),
        placements,
        vgpu_node,
        pool_partition,
        latency,
    )


def _slower(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    """Two latency tables (batch 1, 2, ...) merged: the slower at each batch both hold, then
    the longer one's rest."""
    longer = a if len(a) >= len(b) else b
    return tuple(max(x, y) for x, y in zip(a, b, strict=False)) + longer[min(len(a), len(b)) :]
