"""Put a layout's partitions on stage-worker nodes: find the node behind each of the
layout's nodes in an inventory (attach), start local ones first where this process runs
the deployment itself (LocalNodes), and upload and load the partition models through each
node's model repository API (recorded, so that a failure can be undone)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from poolpipe.domain.inventory import (
    Inventory,
    InventoryError,
    InventoryGpu,
    InventoryNode,
    InventoryServer,
    assign,
)
from poolpipe.offline.partitions import PartitionFile
from poolpipe.runtime.placement import Layout
from triton_backend.node.repository import device_class, partition_files, upload_config
from triton_backend.node.triton import (
    RemoteNode,
    RepositoryAPI,
    TritonNode,
    stop_nodes,
    trace_options,
)

log = logging.getLogger(__name__)
RESTART_BACKOFF_MAX_S = 30.0  # the longest wait between two tries to restart a node


def attach(
    lay: Layout,
    inv: Inventory,
    have: dict[str, RepositoryAPI] | None = None,
    key: str | None = None,
) -> tuple[dict[str, RepositoryAPI], dict[tuple[str, int], str]]:
    """The node behind each of the layout's nodes (by layout node name): GPU i of a device
    type is the inventory's i-th live GPU of that type (a node of several GPUs is one
    RemoteNode per GPU); beside it, the inventory server each layout GPU sits on
    (gpu_servers). Nodes in `have` (by inventory name) are used as they are; the
    others are reached by address. InventoryError, before
    anything is loaded, when the inventory has too few nodes or one does not answer.
    `key`: what the nodes' restricted APIs expect (poolpipe.client.control.node_key)."""
    picked = _picked(lay, inv)
    have = have or {}
    out: dict[str, RepositoryAPI] = {}
    for name, g in picked.items():
        out[name] = have.get(g.name) or RemoteNode.of(g, key)

    def answers(node: RepositoryAPI) -> bool:
        return node.live()

    by_address = {n.grpc_url: n for n in out.values()}  # a node of several GPUs once
    with ThreadPoolExecutor(max(1, min(16, len(by_address)))) as pool:
        dead = [
            f"{node.name} ({node.grpc_url})"
            for node, ok in zip(
                by_address.values(), pool.map(answers, by_address.values()), strict=True
            )
            if not ok
        ]
    if dead:
        raise InventoryError(
            f"{inv.source}: node(s) not answering on gRPC: {', '.join(dead)}; start them "
            "(poolpipe node ...) or mark them down"
        )
    return out, _servers(lay, picked)


def _picked(lay: Layout, inv: Inventory) -> dict[str, InventoryGpu]:
    """The inventory GPU behind each of the layout's nodes (by layout node name)."""
    return assign({s.name: (s.gpu, s.physical) for s in lay.nodes}, inv)


def _servers(lay: Layout, picked: dict[str, InventoryGpu]) -> dict[tuple[str, int], str]:
    return {(s.gpu, s.physical): picked[s.name].node.server for s in lay.nodes}


def gpu_servers(lay: Layout, inv: Inventory) -> dict[tuple[str, int], str]:
    """The inventory server each of the layout's GPUs (type, physical index) sits on, as
    attach assigns them: what the router reserves NICs by (topology.on_servers)."""
    return _servers(lay, _picked(lay, inv))


def load_layout(
    lay: Layout,
    parts: dict[str, PartitionFile],
    nodes: dict[str, RepositoryAPI],
    max_batch: int,
    loaded: list[tuple[RepositoryAPI, str]],
) -> None:
    """Upload every placement's partition model to its node and load it (each recorded in
    `loaded` once loaded, so that a failure can be undone); nodes side by side. Every
    partition but a model's last declares the model's outputs too (chains of nodes)."""
    last: dict[str, str] = {}
    for p in sorted(lay.placements, key=lambda p: p.end):
        last[p.model] = p.partition

    def bring_up(spec_name: str, gpu: str) -> None:
        node = nodes[spec_name]
        cpu, threads = device_class(gpu)
        for p in lay.placements:
            if p.node == spec_name:
                text, files = partition_files(
                    parts[p.partition],
                    instances=p.instances,
                    threads=threads,
                    cpu=cpu,
                    max_batch=max_batch,
                    final_outputs=parts[last[p.model]].outputs,
                    key=node.key,
                    latency_us=() if cpu else lay.partition_latency_us[(p.partition, p.node)],
                    device=gpu,
                )
                node.load(p.partition, upload_config(text, p.partition), files)
                loaded.append((node, p.partition))

    with ThreadPoolExecutor(max(1, len(lay.nodes))) as pool:
        list(pool.map(lambda s: bring_up(s.name, s.gpu), lay.nodes))


def unload_all(models: Iterable[tuple[RepositoryAPI, str]]) -> None:
    """Unload each (node, model name), nodes side by side (a node's models in turn); one
    that fails stays loaded (the node may be gone): what unloads it is tidying up, not
    serving. A router stops in the time its slowest node takes, not in their sum."""
    by_node: dict[str, list[tuple[RepositoryAPI, str]]] = {}
    for node, name in models:
        by_node.setdefault(node.grpc_url, []).append((node, name))

    def off(pairs: list[tuple[RepositoryAPI, str]]) -> None:
        for node, name in pairs:
            with contextlib.suppress(Exception):
                node.unload(name)

    if by_node:
        with ThreadPoolExecutor(min(16, len(by_node))) as pool:
            list(pool.map(off, by_node.values()))


class LocalNodes:
    """The nodes of a deployment this process runs itself (the local demo and `poolpipe
    serve` without --nodes): one tritonserver per node of a layout, on loopback, named as
    the layout's nodes, described by an inventory like any other cluster."""

    def __init__(
        self,
        workspace: Path,
        bandwidth_gbps: float,
        key: str | None = None,
        trace_endpoint: str | None = None,
    ):
        """`trace_endpoint`: where the nodes export the spans of traced stage calls
        (node/triton.py trace_options; None: they trace nothing)."""
        self.workspace = Path(workspace)
        self.key = key
        self.trace_endpoint = trace_endpoint
        self.bandwidth_gbps = bandwidth_gbps
        self.nodes: dict[str, TritonNode] = {}
        self._where: dict[str, tuple[int, int]] = {}  # node -> (server, GPU index)

    def ensure(self, lay: Layout) -> list[TritonNode]:
        """Start the layout's nodes that are not running yet (side by side); returns them
        (stop them to undo)."""
        new = []
        for spec in lay.nodes:
            if spec.name not in self.nodes:
                repo = self.workspace / "repos" / spec.name  # stays empty: models are uploaded
                self.nodes[spec.name] = TritonNode(
                    spec.name,
                    spec.gpu,
                    repo,
                    self.workspace,
                    key=self.key,
                    options=trace_options(self.trace_endpoint, spec.name),
                )
                self._where[spec.name] = (spec.server, spec.physical)
                new.append(self.nodes[spec.name])
        try:
            with ThreadPoolExecutor(max(1, len(new))) as pool:
                list(pool.map(lambda n: n.start(), new))
        except BaseException:
            self.stop(new)
            raise
        return new

    def stop(self, nodes: list[TritonNode] | None = None) -> None:
        nodes = list(self.nodes.values()) if nodes is None else nodes
        for n in nodes:  # out of the books first: a supervisor must not restart them
            self.nodes.pop(n.name, None)
            self._where.pop(n.name, None)
        stop_nodes(nodes)

    def inventory(self) -> Inventory:
        """Node i of each device type is the layout's GPU i of that type."""
        servers = sorted({s for s, _ in self._where.values()})
        return Inventory(
            tuple(InventoryServer(f"s{s}", self.bandwidth_gbps) for s in servers),
            tuple(
                InventoryNode(
                    n.name,
                    f"s{self._where[n.name][0]}",
                    n.device,
                    n.grpc_url,
                    http=n.http_address,
                )
                for n in sorted(self.nodes.values(), key=lambda n: self._where[n.name])
            ),
            str(self.workspace / "inventory.toml"),
        )


class Supervisor:
    """Restarts the local nodes of a deployment that exit without being stopped (a crash,
    an OOM kill): checks every `every_s`; a node that was seen running and is gone is
    restarted through `restart(name)` (start and load its models), and after a failed
    try waits 1, 2, 4 ... RESTART_BACKOFF_MAX_S before the next. Restarts and failed tries
    are counted per node and logged. While `stopping()` says so (the deployment is told to
    stop: a terminal's Ctrl-C reaches its nodes too) nothing is restarted."""

    def __init__(
        self,
        nodes: Callable[[], dict[str, TritonNode]],
        restart: Callable[[str], None],
        every_s: float = 0.5,
        stopping: Callable[[], bool] = lambda: False,
    ):
        self._nodes = nodes
        self._restart = restart
        self._stopping = stopping
        self.every_s = every_s
        self.restarts: Counter[str] = Counter()
        self.failed_tries: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._next_try: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="poolpipe-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._seen = {name for name, node in self._nodes().items() if node.alive}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(60)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, node in list(self._nodes().items()):
                if self._stop.is_set() or self._stopping():
                    break
                if node.alive:
                    self._seen.add(name)
                    continue
                if name not in self._seen or time.monotonic() < self._next_try.get(name, 0.0):
                    continue  # still starting, or waiting out its backoff
                self._try(name)

    def _try(self, name: str) -> None:
        log.warning("node %s exited without being stopped: restarting it", name)
        try:
            self._restart(name)
        except Exception as exc:  # tried again after the backoff
            delay = self._backoff.get(name, 1.0)
            self._backoff[name] = min(2 * delay, RESTART_BACKOFF_MAX_S)
            self._next_try[name] = time.monotonic() + delay
            self.failed_tries[name] += 1
            log.warning("node %s did not restart (%s); next try in %.0f s", name, exc, delay)
            return
        self._backoff.pop(name, None)
        self.restarts[name] += 1
        log.warning("node %s restarted (%d time(s) so far)", name, self.restarts[name])
