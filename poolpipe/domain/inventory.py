"""What a deployment's hosts hold: servers (each with one NIC) and the stage-worker nodes
on them (one Triton endpoint per GPU, reached by address). Read from TOML:

    [[servers]]                 # hosts; the nodes of one server share its NIC
    name = "s0"
    bandwidth_gbps = 1
    [[nodes]]                   # one Triton stage-worker endpoint
    name = "s0-n0"
    server = "s0"
    device = "cpu-1t"           # device type as profiled in the warehouse
    grpc = "10.0.0.2:8001"      # where the router and other nodes reach it
    http = "10.0.0.2:8000"      # optional: its KServe v2 HTTP address (the router's
                                # stage calls take less CPU over it; gRPC without it)
    watch = "10.0.0.2:8003"     # optional: its `poolpipe node` process's watch port: the
                                # router holds a connection there and takes the node out
                                # of service the moment it breaks (the process died)
    shares = [1]                # optional: vGPU shares the planner may use on it
    gpus = 4                    # optional: GPUs this node serves from one Triton (1);
                                # each is a node to the router: "s0-n0/gpu2" in `down`

The planner plans for an inventory (`cluster()`: device counts, nodes per server and NIC
bandwidth follow from it); the router attaches to its nodes (`assign()`)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.gpus import gpu_node, split_gpu
from poolpipe.domain.tier import (
    BalancerSpec,
    InventoryRouter,
    check_tier,
    parse_tier,
    shard_assignment,
    tier_toml,
)
from poolpipe.domain.tomlfile import need as need_field
from poolpipe.domain.tomlfile import only_known, read_toml
from poolpipe.errors import ClusterError

T = TypeVar("T")

_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


class InventoryError(ClusterError):
    pass


@dataclass(frozen=True)
class InventoryServer:
    name: str
    bandwidth_gbps: float


@dataclass(frozen=True)
class InventoryNode:
    name: str
    server: str
    device: str
    grpc: str  # host:port
    shares: tuple[int, ...] = (1,)
    http: str | None = None  # host:port of its KServe v2 HTTP endpoint, where given
    watch: str | None = None  # host:port of its process's watch port, where given
    memory_gb: float | None = None  # its GPU's memory, where given (else the device's spec)
    gpus: int = 1  # GPUs it serves from one Triton (poolpipe node --gpus)

    def each_gpu(self) -> tuple[InventoryGpu, ...]:
        """Its GPUs: itself for a node of one GPU, "NAME/gpu0" .. for a node of several."""
        if self.gpus == 1:
            return (InventoryGpu(self, None),)
        return tuple(InventoryGpu(self, i) for i in range(self.gpus))


@dataclass(frozen=True)
class InventoryGpu:
    """One GPU of a node: what the plan's GPU of its device type runs on."""

    node: InventoryNode
    gpu: int | None  # its index on a node of several; None on a node of one

    @property
    def name(self) -> str:
        return gpu_node(self.node.name, self.gpu)

    @property
    def node_id(self) -> str:
        """What the router knows it by (RepositoryAPI.node_id): its node's gRPC address,
        with the GPU's index on a node of several."""
        return gpu_node(self.node.grpc, self.gpu)


@dataclass(frozen=True)
class Inventory:
    servers: tuple[InventoryServer, ...]
    nodes: tuple[InventoryNode, ...]
    source: str = "inventory"  # the file it came from (for messages)
    down: frozenset[str] = field(default_factory=frozenset)  # node names marked down
    routers: tuple[InventoryRouter, ...] = ()  # the router tier (tier.py), where given
    balancer: BalancerSpec | None = None
    # different models may share a physical GPU, at this latency factor on a shared GPU's
    # vGPUs (Cluster.mixed_model_interference; None: never)
    mixed_model_interference: float | None = None

    def __post_init__(self) -> None:
        where = self.source
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise InventoryError(f"{where}: a server name is listed twice ({names})")
        for s in self.servers:
            if not s.bandwidth_gbps > 0:
                raise InventoryError(
                    f"{where}: server {s.name}: bandwidth_gbps must be > 0, got {s.bandwidth_gbps}"
                )
        seen: dict[str, str] = {}
        for n in self.nodes:
            if n.name in seen:
                raise InventoryError(f"{where}: node name {n.name!r} is listed twice")
            seen[n.name] = n.grpc
            if n.server not in names:
                raise InventoryError(
                    f"{where}: node {n.name}: server {n.server!r} is not among [[servers]] "
                    f"({', '.join(names) or 'none'})"
                )
            for field_, address in (("grpc", n.grpc), ("http", n.http), ("watch", n.watch)):
                if address is not None and not _is_address(address):
                    raise InventoryError(
                        f"{where}: node {n.name}: {field_} = {address!r} is not HOST:PORT"
                    )
            if not n.shares or any(v < 1 for v in n.shares):
                raise InventoryError(f"{where}: node {n.name}: shares must be integers >= 1")
            if isinstance(n.gpus, bool) or not isinstance(n.gpus, int) or n.gpus < 1:
                raise InventoryError(
                    f"{where}: node {n.name}: gpus = {n.gpus!r} is not an integer >= 1 (the "
                    "GPUs it serves from one Triton)"
                )
        addresses = [n.grpc for n in self.nodes]
        if len(set(addresses)) != len(addresses):
            raise InventoryError(f"{where}: two nodes share one gRPC address")
        for device, nodes in self.by_device().items():
            if len({n.shares for n in nodes}) > 1:
                raise InventoryError(f"{where}: nodes of device {device} list different shares")
            if len({n.memory_gb for n in nodes}) > 1:
                raise InventoryError(
                    f"{where}: nodes of device {device} give different memory_gb (a device "
                    "type is one GPU model: name the larger ones another device)"
                )
        check_tier(self.routers, self.balancer, seen, where, _is_address)
        gpus = {n.name: n.gpus for n in self.nodes}
        for d in sorted(self.down - set(seen)):
            node, gpu = split_gpu(d)
            if node not in gpus:
                raise InventoryError(f"{where}: a node marked down is not listed: {d!r}")
            if gpu is None or gpus[node] == 1 or gpu >= gpus[node]:
                raise InventoryError(
                    f"{where}: {d!r} marked down: node {node} has "
                    + (f"GPUs {node}/gpu0 .. {node}/gpu{gpus[node] - 1}" if gpus[node] > 1
                       else "one GPU (mark the node itself down)")
                )  # fmt: skip

    def by_device(self, live_only: bool = False) -> dict[str, list[InventoryNode]]:
        """Nodes per device type, in server order then as listed: the i-th is the plan's
        GPU i of that type."""
        order = {s.name: i for i, s in enumerate(self.servers)}
        out: dict[str, list[InventoryNode]] = defaultdict(list)
        for n in sorted(self.nodes, key=lambda n: order[n.server]):  # stable: as listed
            if not (live_only and n.name in self.down):
                out[n.device].append(n)
        return dict(out)

    def gpus_by_device(self, live_only: bool = False) -> dict[str, list[InventoryGpu]]:
        """GPUs per device type, dealt over their servers in turn (each server's first GPU,
        in server order, then each one's second, ...; a server's GPUs node by node as
        by_device lists them): the i-th is the plan's GPU i of that type, on the server the
        plan's layout deals it to (scheduler.topology._lay_out: GPU i on the type's server
        i mod servers), so that the links the router reserves are the NICs its bytes cross.
        `live_only`: without the nodes and GPUs marked down."""
        out: dict[str, list[InventoryGpu]] = {}
        for device, nodes in self.by_device(live_only).items():
            gpus = [g for n in nodes for g in n.each_gpu()]
            if live_only:
                gpus = [g for g in gpus if g.name not in self.down]
            if gpus:
                out[device] = dealt(gpus, lambda g: g.node.server)
        return out

    def gpu_count(self) -> int:
        """GPUs listed (a node of several counts each)."""
        return sum(n.gpus for n in self.nodes)

    def cluster(self, name: str | None = None) -> Cluster:
        """The cluster the planner sees: per device type the GPUs not marked down, as many
        GPUs per server as the fullest server holds, and the slowest server's NIC."""
        per_device = self.gpus_by_device(live_only=True)
        if not per_device:
            raise InventoryError(f"{self.source}: no node left to plan for")
        pools = []
        for device, gpus in sorted(per_device.items()):
            per_server: dict[str, int] = defaultdict(int)
            for g in gpus:
                per_server[g.node.server] += 1
            pools.append(
                GpuPool(
                    device,
                    len(gpus),
                    max(per_server.values()),
                    gpus[0].node.shares,
                    memory_gb=gpus[0].node.memory_gb,
                )
            )
        bandwidth = min(s.bandwidth_gbps for s in self.servers)
        return Cluster(
            name or Path(self.source).stem,
            bandwidth,
            tuple(pools),
            mixed_model_interference=self.mixed_model_interference,
        )

    def mark_down(self, names: set[str]) -> Inventory:
        return replace(self, down=self.down | frozenset(names))

    def joined(self, node: Mapping[str, Any], server: Mapping[str, Any] | None = None) -> Inventory:
        """This inventory with a node that joins it: `node` an [[nodes]] table's keys,
        `server` a [[servers]] table for its server where not listed yet; an InventoryError
        where the node is not one a whole inventory could list beside these."""
        servers = [{"name": s.name, "bandwidth_gbps": s.bandwidth_gbps} for s in self.servers]
        where = f"{self.source}, node {node.get('name', '?')!r} joining"
        one = parse_inventory({"servers": [*servers, *([dict(server)] if server else [])],
                               "nodes": [dict(node)]}, where)  # fmt: skip
        return replace(self, servers=one.servers, nodes=(*self.nodes, *one.nodes))

    def released(self, name: str) -> Inventory:
        """This inventory without node `name` (given back), and without a server left with
        no node."""
        if name not in {n.name for n in self.nodes}:
            known = ", ".join(n.name for n in self.nodes)
            raise InventoryError(f"{self.source}: no node {name!r} to release (nodes: {known})")
        nodes = tuple(n for n in self.nodes if n.name != name)
        if not nodes:
            raise InventoryError(f"{self.source}: {name} is its last node; it cannot go")
        held = {n.server for n in nodes}
        return replace(
            self,
            servers=tuple(s for s in self.servers if s.name in held),
            nodes=nodes,
            down=frozenset(d for d in self.down if split_gpu(d)[0] != name),
        )

    def shard(self, name: str, names: tuple[str, ...] | None = None) -> Inventory:
        """What router `name` drives: its nodes (every node where it lists none; `names`
        where given: what it drives now, shard_assignment) on the servers that hold them,
        with itself as its router tier."""
        r = self.router(name)
        if names is not None:
            r = replace(r, nodes=tuple(names))
        if not r.nodes:
            return self
        mine = set(r.nodes)
        nodes = tuple(n for n in self.nodes if n.name in mine)
        servers = {n.server for n in nodes}
        return replace(
            self,
            servers=tuple(s for s in self.servers if s.name in servers),
            nodes=nodes,
            down=frozenset(d for d in self.down if d in mine or split_gpu(d)[0] in mine),
            source=f"{self.source} (router {name}'s shard)",
            routers=(r,),
        )

    def assignment(self, live: set[str]) -> dict[str, tuple[str, ...]]:
        """The nodes each of the `live` routers drives (tier.shard_assignment)."""
        return shard_assignment(self.routers, {n.name: n.device for n in self.nodes}, live)

    def router(self, name: str) -> InventoryRouter:
        """The router of that name; InventoryError listing those there are."""
        for r in self.routers:
            if r.name == name:
                return r
        there = ", ".join(r.name for r in self.routers) or "none: no [[routers]]"
        raise InventoryError(f"{self.source}: no router {name!r} ({there})")

    def to_toml(self) -> str:
        lines = []
        if self.mixed_model_interference is not None:
            lines += [f"mixed_model_interference = {self.mixed_model_interference:g}", ""]
        if self.down:
            names = ", ".join(f'"{d}"' for d in sorted(self.down))
            lines += [f"down = [{names}]", ""]
        for s in self.servers:
            lines += [
                "[[servers]]",
                f'name = "{s.name}"',
                f"bandwidth_gbps = {s.bandwidth_gbps:g}",
                "",
            ]
        for n in self.nodes:
            lines += [
                "[[nodes]]",
                f'name = "{n.name}"',
                f'server = "{n.server}"',
                f'device = "{n.device}"',
                f'grpc = "{n.grpc}"',
            ]
            if n.http is not None:
                lines.append(f'http = "{n.http}"')
            if n.watch is not None:
                lines.append(f'watch = "{n.watch}"')
            if n.shares != (1,):
                lines.append(f"shares = [{', '.join(str(v) for v in n.shares)}]")
            if n.memory_gb is not None:
                lines.append(f"memory_gb = {n.memory_gb:g}")
            if n.gpus != 1:
                lines.append(f"gpus = {n.gpus}")
            lines.append("")
        lines += tier_toml(self.routers, self.balancer)
        return "\n".join(lines)


def load_inventory(path: str | Path) -> Inventory:
    """An inventory file; InventoryError names the file and the field that is wrong."""
    path = Path(path)
    data = read_toml(path, "inventory", InventoryError)
    return parse_inventory(data, str(path))


def parse_inventory(data: dict, source: str = "inventory") -> Inventory:
    def need(entry: dict, key: str, what: str, kind: type):
        return need_field(entry, key, what, source, kind, InventoryError)

    def known(entry: dict, keys: set[str], what: str) -> None:
        only_known(entry, keys, what, source, InventoryError)

    known(
        data,
        {"servers", "nodes", "down", "routers", "balancer", "mixed_model_interference"},
        "top level",
    )
    servers, nodes = [], []
    for i, s in enumerate(_tables(data, "servers", source)):
        what = f"[[servers]] #{i + 1}"
        known(s, {"name", "bandwidth_gbps"}, what)
        servers.append(
            InventoryServer(need(s, "name", what, str), need(s, "bandwidth_gbps", what, float))
        )
    for i, n in enumerate(_tables(data, "nodes", source)):
        what = f"[[nodes]] #{i + 1}"
        name = need(n, "name", what, str)
        what = f"node {name}"
        known(
            n,
            {"name", "server", "device", "grpc", "http", "watch", "shares", "memory_gb", "gpus"},
            what,
        )
        memory = n.get("memory_gb")
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int | float) or not memory > 0
        ):
            raise InventoryError(f"{source}: {what}: memory_gb = {memory!r} is not a number > 0")
        shares = n.get("shares", [1])
        if not isinstance(shares, list) or not all(isinstance(v, int) for v in shares):
            raise InventoryError(f"{source}: {what}: shares = {shares!r} is not a list of integers")
        nodes.append(
            InventoryNode(
                name,
                need(n, "server", what, str),
                need(n, "device", what, str),
                need(n, "grpc", what, str),
                tuple(shares),
                _optional(n, "http", what, source),
                _optional(n, "watch", what, source),
                None if memory is None else float(memory),
                n.get("gpus", 1),
            )
        )
    down = data.get("down", [])
    if not isinstance(down, list) or not all(isinstance(d, str) for d in down):
        raise InventoryError(f"{source}: down = {down!r} is not a list of node (or GPU) names")
    if not nodes:
        raise InventoryError(f"{source}: no [[nodes]]")
    routers, balancer = parse_tier(data, source, need, known, _tables)
    mixed = data.get("mixed_model_interference")
    if mixed is not None and (isinstance(mixed, bool) or not isinstance(mixed, int | float)):
        raise InventoryError(
            f"{source}: mixed_model_interference = {mixed!r} is not a number (a latency factor "
            ">= 1 for vGPUs of GPUs that different models share)"
        )
    return Inventory(
        tuple(servers),
        tuple(nodes),
        source,
        frozenset(down),
        routers,
        balancer,
        None if mixed is None else float(mixed),
    )


def _is_address(address: str) -> bool:
    return bool(_ADDRESS.match(address)) and 0 < int(address.rsplit(":", 1)[1]) < 65536


def _optional(table: dict, key: str, what: str, source: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise InventoryError(f"{source}: {what}: {key} = {value!r} is not a string")
    return value


def _tables(data: dict, key: str, source: str) -> list[dict]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InventoryError(f"{source}: {key} must be an array of tables ([[{key}]])")
    return value


def dealt(items: Sequence[T], server: Callable[[T], Hashable]) -> list[T]:
    """`items` (GPUs, or node slots, listed server by server; `server` names an item's)
    dealt over their servers in turn: every server's first, in the order the servers first
    appear, then every server's second, ... The plan's GPU i of a type is the i-th so dealt,
    as its layout deals GPU i to the type's server i mod servers."""
    first: dict[Hashable, int] = {}
    held: dict[Hashable, int] = defaultdict(int)
    keyed = []
    for k, item in enumerate(items):
        s = server(item)
        keyed.append((held[s], first.setdefault(s, len(first)), k))
        held[s] += 1
    return [items[k] for _, _, k in sorted(keyed)]


def assign(
    nodes: dict[str, tuple[str, int]], inv: Inventory, what: str = "the plan"
) -> dict[str, InventoryGpu]:
    """The inventory GPU behind each of a layout's nodes (name -> (device, index of that
    device's GPU)): GPU i of a device is the device's i-th live GPU (Inventory
    .gpus_by_device). InventoryError, before anything is loaded, when the inventory lacks a
    device or has too few GPUs of one."""
    live = inv.gpus_by_device(live_only=True)
    need: dict[str, int] = defaultdict(int)
    for device, i in nodes.values():
        need[device] = max(need[device], i + 1)
    short = [
        f"{device}: needs {n}, has {len(live.get(device, []))}"
        for device, n in sorted(need.items())
        if len(live.get(device, [])) < n
    ]
    if short:
        raise InventoryError(
            f"{what} needs more GPUs than {inv.source} has live ({'; '.join(short)}); "
            "add nodes or plan for this inventory (poolpipe plan ... --inventory FILE)"
        )
    return {name: live[device][i] for name, (device, i) in nodes.items()}
