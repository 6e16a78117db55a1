"""A plan made ready to load: its topology, the layout of its partitions on nodes, and
the partition files cut out of the onboarded model (warehouse reads, ONNX surgery)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from poolpipe.domain.entry import Segment, plan_segments
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import PartitionFile, make_partition
from poolpipe.runtime.placement import Layout, layout
from poolpipe.scheduler import build_topology
from poolpipe.scheduler.topology import Topology
from poolpipe.store.plan_inputs import served_profiles, warehouse_models
from poolpipe.store.warehouse import Warehouse
from triton_backend.node.repository import node_onnx_path, write_node_onnx
from triton_backend.router.core import ModelIO

# make_partition's arguments: whole model, model, block layers, start, end, out dir, tag,
# offset (a segment's first block in the whole model)
PartitionJob = tuple[Path, str, list[tuple[int, int]], int, int, Path, str, int]


def partition_jobs(
    wh: Warehouse,
    lay: Layout,
    out_dir: Path,
    base: Mapping[str, str] | None = None,
    segments: Mapping[str, Segment] | None = None,
) -> dict[str, PartitionJob]:
    """make_partition's arguments for every partition of the layout (warehouse reads only).
    `base`: the warehouse's model for a plan model that is another's (an application's
    part or a segment: plan_inputs.warehouse_models); `segments`: where a plan model's
    blocks begin in its model's (domain.entry.plan_segments)."""
    jobs: dict[str, PartitionJob] = {}
    for p in lay.placements:
        if p.partition in jobs:
            continue
        seg = (segments or {}).get(p.model)
        model = (base or {}).get(p.model, p.model)
        whole = wh.whole_model_file(model)
        if whole is None or not whole.is_file():
            raise PoolpipeError(
                f"model {model} has no onboarded files; run: poolpipe onboard MODEL.onnx "
                f"--name {model}"
            )
        layers = wh.block_layers(model)
        offset = seg.start if seg is not None else 0
        jobs[p.partition] = (whole, p.model, layers, p.start, p.end, out_dir, p.tag, offset)
    return jobs


def check_serves_all(plan: Plan) -> None:
    """A clear error where `plan` gives some model no pipeline (nothing could serve it)."""
    unserved = [m.name for m in plan.models if not m.pipelines]
    if unserved:
        raise PoolpipeError(
            f"the {plan.strategy} plan for cluster {plan.cluster.name} serves "
            f"{', '.join(unserved)} nowhere (no pipeline fits: too few GPUs for the SLOs "
            "and rates); plan a larger cluster, or leave those models out"
        )


def prepare(
    plan: Plan, warehouse: str | Path | None, workspace: Path, tag: str, isolated: bool = False
) -> tuple[Topology, Layout, dict[str, PartitionFile]]:
    """Topology, layout and partition files of `plan`. `isolated`: cut the partitions out
    of the whole model in a separate process, as a rollout does while this process serves:
    the ONNX surgery is seconds of pure-Python work that would otherwise hold the GIL from
    the router (measured: 3.4 s of CPU for two ResNet-50 partitions)."""
    check_serves_all(plan)
    base = warehouse_models(plan)
    segments = plan_segments(plan.meta)
    with Warehouse.open(warehouse) as wh:
        profiles = served_profiles(wh, plan)
        topo = build_topology(plan, profiles)
        lay = layout(topo, tag)
        jobs = partition_jobs(wh, lay, workspace / "partitions", base, segments)
    if not isolated:
        return topo, lay, {name: make_partition(*args) for name, args in jobs.items()}
    return topo, lay, cut_isolated(jobs)


def cut_isolated(jobs: dict[str, PartitionJob]) -> dict[str, PartitionFile]:
    """Each job's partition cut in a process of its own (spawned: the caller may be a
    serving router with threads). When one fails, the error comes out and the partitions
    already cut are deleted: a failed rollout leaves no files of its generation."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_cut, *args) for name, args in jobs.items()}
        try:
            return {name: f.result() for name, f in futures.items()}
        except BaseException:
            for f in futures.values():
                f.cancel()
            # the cuts that ended (the one running is waited for) leave no files behind
            remove_files(
                f.result() for f in futures.values() if not f.cancelled() and not f.exception()
            )
            raise


def remove_files(parts: Iterable[PartitionFile]) -> None:
    """Delete partitions' files from the workspace: each one's ONNX file and the file its
    CPU nodes run (write_node_onnx), where they exist."""
    for part in parts:
        for path in (part.path, node_onnx_path(part)):
            path.unlink(missing_ok=True)


def _cut(*args: Any) -> PartitionFile:
    """make_partition, and beside it the file a CPU node runs (write_node_onnx)."""
    part = make_partition(*args)
    write_node_onnx(part)
    return part


def model_io(topo: Topology, lay: Layout, parts: dict[str, PartitionFile]) -> list[ModelIO]:
    ios = []
    for m in topo.models:
        pipe = topo.pipelines[m.pipelines[0]]
        first = parts[lay.pool_partition[pipe.pools[0]]]
        last = parts[lay.pool_partition[pipe.pools[-1]]]
        ios.append(ModelIO(m.name, first.inputs, last.outputs))
    return ios
