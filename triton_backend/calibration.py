"""Calibration: each pool's latency at every batch size as the router sees it, measured
over gRPC on the nodes that serve it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from poolpipe.offline.partitions import PartitionFile
from poolpipe.runtime.placement import Layout
from poolpipe.scheduler.topology import Topology
from triton_backend.nodes import RepositoryAPI


def calibrate(
    topo: Topology,
    lay: Layout,
    nodes: dict[str, RepositoryAPI],
    parts: dict[str, PartitionFile],
    reps: int = 5,
    known: dict[tuple, float] | None = None,
) -> dict[int, tuple[float, ...]]:
    """Each pool's latency at every batch size as the router sees it: one stage call over
    gRPC to a node of the pool (compute plus the call's own cost), median of `reps`.
    `known` (updated in place) holds earlier measurements by (device, model, blocks, batch):
    a rollout measures only partitions the serving plan does not already run."""
    import tritonclient.grpc as grpcclient

    from triton_backend.repository import kserve_dtype

    measured = known if known is not None else {}
    out: dict[int, tuple[float, ...]] = {}
    for pool in topo.pools:
        name = lay.pool_partition[pool.id]
        node = nodes[lay.vgpu_node[pool.vgpus[0]]]
        part = parts[name]
        client = node.grpc_client()
        lats = [float("nan")]
        rng = np.random.default_rng(0)
        for b in range(1, len(pool.latency_us)):
            key = (node.device, part.model, part.start, part.end, b)
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
                    client.infer(name, inputs)
                    if r:
                        times.append((time.perf_counter() - t0) * 1e6)
                measured[key] = float(np.median(times))
            lats.append(measured[key])
        client.close()
        out[pool.id] = tuple(lats)
    return out


def warm(
    lay: Layout,
    nodes: dict[str, RepositoryAPI],
    parts: dict[str, PartitionFile],
    max_batch: int,
    only: str | None = None,
) -> None:
    """One call at every batch size to every instance of every partition (of node `only`):
    an ONNX Runtime session's first runs at a shape cost several times a warm one, and a
    node must not take the router's deadlines with cold instances (calibration times one
    node per pool; a restarted node starts cold)."""
    import tritonclient.grpc as grpcclient

    from triton_backend.repository import kserve_dtype

    def one(node: RepositoryAPI, name: str, b: int) -> None:
        part = parts[name]
        client = node.grpc_client()
        try:
            inputs = []
            for t in part.inputs:
                i = grpcclient.InferInput(t.name, [b, *t.dims], kserve_dtype(np.dtype(t.dtype)))
                i.set_data_from_numpy(np.zeros((b, *t.dims), t.dtype))
                inputs.append(i)
            client.infer(name, inputs)
        finally:
            client.close()

    calls = [
        (nodes[p.node], p.partition, b)
        for p in lay.placements
        if only is None or p.node == only
        for b in range(1, max_batch + 1)
        for _ in range(p.instances)
    ]
    width = max((p.instances for p in lay.placements), default=1)
    with ThreadPoolExecutor(max(1, width)) as pool:
        for _ in pool.map(lambda c: one(*c), calls):
            pass
