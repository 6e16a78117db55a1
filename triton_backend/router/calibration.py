"""Calibration: each pool's latency at every batch size as the router sees it, measured
over gRPC on the nodes that serve it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from poolpipe.domain.costs import transfer_us_per_sample
from poolpipe.offline.partitions import PartitionFile, row_bytes
from poolpipe.runtime.placement import Layout
from poolpipe.scheduler.topology import Pool, Topology
from triton_backend.node.repository import device_class
from triton_backend.node.triton import RepositoryAPI


def calibrate(
    topo: Topology,
    lay: Layout,
    nodes: dict[str, RepositoryAPI],
    parts: dict[str, PartitionFile],
    reps: int = 5,
    known: dict[tuple, float] | None = None,
    bandwidth_gbps: float = 0.0,
) -> dict[int, tuple[float, ...]]:
    """Each pool's latency at every batch size as the router sees it: one stage call over
    gRPC to a node of the pool (compute plus the call's own cost; less the transfers the
    data plane reserves apart, and the outputs' way back at `bandwidth_gbps`, the plan's
    NICs: _compute_us), median of `reps`.
    `known` (updated in place) holds earlier measurements by (device, share, model, blocks,
    batch):
    a rollout measures only partitions the serving plan does not already run. Pools on
    CPU device classes are measured one after another (they share this host's cores);
    pools on GPU types, one node at a time each but nodes side by side (a GPU's time is
    its own; emulated ones at time scale D take D times as long to measure)."""
    measured = known if known is not None else {}
    out: dict[int, tuple[float, ...]] = {}
    by_node: dict[str, list] = {}
    for pool in topo.pools:
        by_node.setdefault(lay.vgpu_node[pool.vgpus[0]], []).append(pool)

    def node_pools(node_name: str) -> None:
        for pool in by_node[node_name]:
            out[pool.id] = _pool_latencies(
                pool, lay, nodes[node_name], parts, reps, measured, bandwidth_gbps
            )

    gpu = [n for n in by_node if not device_class(nodes[n].device)[0]]
    for n in by_node:
        if n not in gpu:
            node_pools(n)
    with ThreadPoolExecutor(max(1, len(gpu))) as side_by_side:
        list(side_by_side.map(node_pools, gpu))
    return out


def _pool_latencies(
    pool,
    lay: Layout,
    node: RepositoryAPI,
    parts: dict,
    reps: int,
    measured: dict,
    bandwidth_gbps: float,
) -> tuple[float, ...]:
    import tritonclient.grpc as grpcclient

    from triton_backend.node.repository import kserve_dtype

    name = lay.pool_partition[pool.id]
    part = parts[name]
    # the outputs' way back to the router, per sample: a feature map, or the model's answer
    out_bytes = row_bytes(part.outputs)
    back_us = transfer_us_per_sample(out_bytes, bandwidth_gbps) if bandwidth_gbps > 0 else 0.0
    client = node.grpc_client()
    lats = [float("nan")]
    rng = np.random.default_rng(0)
    try:
        for b in range(1, len(pool.latency_us)):
            # (a partition at two shares of one GPU type runs at two speeds)
            key = (node.device, pool.share, part.model, part.start, part.end, b)
            if key not in measured:
                inputs = []
                for t in part.inputs:
                    x = rng.standard_normal((b, *t.dims)).astype(t.dtype)
                    i = grpcclient.InferInput(t.name, list(x.shape), kserve_dtype(x.dtype))
                    i.set_data_from_numpy(x)
                    inputs.append(i)
                times = []
                for r in range(reps + 1):
                    t0 = time.perf_counter()
                    client.infer(node.model_name(name), inputs)
                    if r:
                        times.append((time.perf_counter() - t0) * 1e6)
                measured[key] = float(np.median(times))
            lats.append(_compute_us(pool, b, measured[key], b * back_us))
    finally:
        client.close()
    return tuple(lats)


# A first pool's compute is the call less its inputs' reserved transfer, but never less
# than this share of the call (a NIC faster than the plan says would leave nothing).
COMPUTE_FLOOR = 0.25


def _compute_us(pool: Pool, b: int, call_us: float, back_us: float = 0.0) -> float:
    """What a pool's vGPU is reserved for at batch b, from a call from the router that
    took `call_us`: the call less what crossed the node's NIC on the way, which the data
    plane reserves on the links apart (the pool's transfer in: a feature map, or a first
    pool's requests' inputs where the topology times them, topology.with_inputs) or which
    a served batch does not send to the router (`back_us`: the outputs' way back, a
    feature map the next node gets instead). Measured on emulated hc2-small: colorization's
    L4 stage called in 303 ms, of which 8 ms its inputs and 34 ms its feature map back;
    reserved at the call, every stage ran 20-40% short of its reservation until
    recalibration caught up, minutes into serving. Never below a quarter of the call (a
    NIC faster than the plan says would leave nothing)."""
    apart = b * pool.transfer_in_us + back_us
    if not apart > 0:
        return call_us
    return max(call_us - apart, COMPUTE_FLOOR * call_us)


def warm(
    lay: Layout,
    nodes: dict[str, RepositoryAPI],
    parts: dict[str, PartitionFile],
    only: str | None = None,
) -> None:
    """One call at every batch size (up to the largest its pools on the node may run: an
    emulated node knows its latencies up to that batch only) to every instance
    of every partition (of node `only`):
    an ONNX Runtime session's first runs at a shape cost several times a warm one, and a
    node must not take the router's deadlines with cold instances (calibration times one
    node per pool; a restarted node starts cold)."""
    import tritonclient.grpc as grpcclient

    from triton_backend.node.repository import kserve_dtype

    def one(node: RepositoryAPI, name: str, b: int) -> None:
        part = parts[name]
        client = node.grpc_client()
        try:
            inputs = []
            for t in part.inputs:
                i = grpcclient.InferInput(t.name, [b, *t.dims], kserve_dtype(np.dtype(t.dtype)))
                i.set_data_from_numpy(np.zeros((b, *t.dims), t.dtype))
                inputs.append(i)
            client.infer(node.model_name(name), inputs)
        finally:
            client.close()

    calls = [
        (nodes[p.node], p.partition, b)
        for p in lay.placements
        if only is None or p.node == only
        for b in range(1, len(lay.partition_latency_us[(p.partition, p.node)]) + 1)
        for _ in range(p.instances)
    ]
    width = max((p.instances for p in lay.placements), default=1)
    if not any(device_class(s.gpu)[0] for s in lay.nodes):
        width = min(32, len(calls))  # GPU nodes (emulated ones sleep): all side by side
    with ThreadPoolExecutor(max(1, width)) as pool:
        for _ in pool.map(lambda c: one(*c), calls):
            pass
