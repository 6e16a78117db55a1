"""Load a layout onto stage-worker nodes: render each partition's repository, start the
nodes that are not running yet, and load the partition models (recorded, so that a failure
can be undone)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from poolpipe.offline.partitions import PartitionFile
from poolpipe.runtime.placement import Layout
from triton_backend.nodes import TritonNode
from triton_backend.prepare import threads_of
from triton_backend.repository import render_partition


def load_layout(
    lay: Layout,
    parts: dict[str, PartitionFile],
    nodes: dict[str, TritonNode],
    workspace: Path,
    max_batch: int,
    loaded: list[tuple[TritonNode, str]],
    started: list[TritonNode],
) -> None:
    """Render every placement into its node's repository, start the nodes that are not
    running yet and load the partition models (recorded in `loaded` and `started`, so that
    a failure can be undone)."""
    for spec in lay.nodes:
        if spec.name not in nodes:
            repo = workspace / "repos" / spec.name
            shutil.rmtree(repo, ignore_errors=True)
            nodes[spec.name] = node = TritonNode(spec.name, spec.gpu, repo, workspace)
            started.append(node)
        node = nodes[spec.name]
        for p in lay.placements:
            if p.node == spec.name:
                render_partition(
                    parts[p.partition],
                    node.repo,
                    instances=p.instances,
                    threads=threads_of(spec.gpu),
                    max_batch=max_batch,
                )

    def bring_up(node: TritonNode) -> None:
        if not node.alive:
            node.start()
        for p in lay.placements:
            if p.node == node.name:
                node.load(p.partition)
                loaded.append((node, p.partition))

    todo = [nodes[s.name] for s in lay.nodes]
    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        list(pool.map(bring_up, todo))
