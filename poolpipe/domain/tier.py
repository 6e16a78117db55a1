"""The router tier of an inventory: the routers (`poolpipe serve` processes, each a
KServe v2 front end with its readiness check) and the load balancer in front of them. From
the same TOML as the nodes:

    [balancer]                  # where clients reach the cluster (HAProxy)
    http = "0.0.0.0:8000"       # KServe v2 HTTP
    grpc = "0.0.0.0:8001"       # KServe v2 gRPC (h2)
    stats = "127.0.0.1:8404"    # optional: HAProxy's statistics page
    check_ms = 500              # optional: ask each router's readiness this often (500)
    fall = 2                    # optional: failed checks before a router gets no requests (2)
    rise = 2                    # optional: passed checks before it gets them again (2)
    [[routers]]
    name = "r0"
    http = "10.0.0.2:8000"      # its Triton's KServe v2 HTTP and gRPC (serve --http-port ...)
    grpc = "10.0.0.2:8001"
    ready = "10.0.0.2:8002"     # its readiness check (serve --ready-port)
    weight = 1                  # optional: its share of the requests, relative (1)
    agent = "10.0.0.2:8003"     # optional: its weight agent (serve --agent-port): HAProxy
                                # scales `weight` by what its shard serves now
    nodes = ["s0-n0", "s0-n1"]  # its shard: the nodes only it drives (one owner per node)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from poolpipe.errors import ClusterError

MAX_WEIGHT = 256  # HAProxy's
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class TierError(ClusterError):
    pass


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port), an IPv6 host without its brackets (as sockets take it)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class BalancerSpec:
    http: str  # host:port clients reach over HTTP
    grpc: str  # host:port clients reach over gRPC
    stats: str | None = None  # host:port of HAProxy's statistics page, where given
    check_ms: int = 500
    fall: int = 2
    rise: int = 2


@dataclass(frozen=True)
class InventoryRouter:
    name: str
    http: str
    grpc: str
    ready: str
    weight: int = 1
    nodes: tuple[str, ...] = ()  # its shard; () with a single router: every node
    agent: str | None = None  # host:port of its weight agent (HAProxy's agent-check), if any


def check_tier(
    routers: tuple[InventoryRouter, ...],
    balancer: BalancerSpec | None,
    node_names: Iterable[str],
    where: str,
    is_address,
) -> None:
    """TierError naming the entry and the fix, for what cannot be deployed: names or
    addresses used twice, a node unknown or given to two routers, several routers without
    shards, weights HAProxy refuses."""
    known = set(node_names)
    names = [r.name for r in routers]
    if len(set(names)) != len(names):
        raise TierError(f"{where}: a router name is listed twice ({', '.join(names)})")
    if routers and balancer is None:
        raise TierError(f"{where}: [[routers]] need a [balancer] (where clients reach them)")
    taken: dict[str, str] = {}
    owner: dict[str, str] = {}
    for r in routers:
        if not _NAME.fullmatch(r.name):
            raise TierError(
                f"{where}: router {r.name!r}: a router's name is letters, digits, '_' and "
                "'-' (it tags the partition models it loads on its nodes)"
            )
        addresses = [("http", r.http), ("grpc", r.grpc), ("ready", r.ready)]
        for field_, address in addresses + ([("agent", r.agent)] if r.agent else []):
            if not is_address(address):
                raise TierError(
                    f"{where}: router {r.name}: {field_} = {address!r} is not HOST:PORT"
                )
            if address in taken:
                raise TierError(
                    f"{where}: router {r.name}: {field_} = {address} is also {taken[address]}; "
                    "each port of each router its own"
                )
            taken[address] = f"router {r.name}'s {field_}"
        if not 1 <= r.weight <= MAX_WEIGHT:
            raise TierError(
                f"{where}: router {r.name}: weight = {r.weight} is not within 1..{MAX_WEIGHT}"
            )
        for node in r.nodes:
            if node not in known:
                raise TierError(
                    f"{where}: router {r.name}: node {node!r} is not among [[nodes]] "
                    f"({', '.join(sorted(known)) or 'none'})"
                )
            if node in owner:
                raise TierError(
                    f"{where}: node {node} is given to routers {owner[node]} and {r.name}: a "
                    "node is driven by one router (its vGPUs' reservation tables have one "
                    "owner); list it under one of them"
                )
            owner[node] = r.name
    if len(routers) > 1:
        bare = [r.name for r in routers if not r.nodes]
        if bare:
            raise TierError(
                f"{where}: router(s) {', '.join(bare)} list no nodes: with several routers "
                "each drives its own shard (nodes = [...]; `poolpipe shards --inventory "
                "FILE --models ...` writes a split planned for the most throughput)"
            )
    if balancer is not None:
        for field_, address in (("http", balancer.http), ("grpc", balancer.grpc)):
            if not is_address(address):
                raise TierError(f"{where}: [balancer]: {field_} = {address!r} is not HOST:PORT")
        if balancer.stats is not None and not is_address(balancer.stats):
            raise TierError(f"{where}: [balancer]: stats = {balancer.stats!r} is not HOST:PORT")
        ports = [a for a in (balancer.http, balancer.grpc, balancer.stats) if a is not None]
        if len(set(ports)) < len(ports):
            raise TierError(f"{where}: [balancer]: http, grpc and stats need a port each")
        for field_, v, least in (
            ("check_ms", balancer.check_ms, 10),
            ("fall", balancer.fall, 1),
            ("rise", balancer.rise, 1),
        ):
            if v < least:
                raise TierError(f"{where}: [balancer]: {field_} = {v} must be at least {least}")


def parse_tier(
    data: dict, source: str, need, known, tables
) -> tuple[tuple[InventoryRouter, ...], BalancerSpec | None]:
    """The [[routers]] and [balancer] of an inventory's TOML (the inventory parser's
    helpers: `need` a typed key, `known` keys, `tables` an array of tables)."""
    routers = []
    for i, r in enumerate(tables(data, "routers", source)):
        what = f"[[routers]] #{i + 1}"
        name = need(r, "name", what, str)
        what = f"router {name}"
        known(r, {"name", "http", "grpc", "ready", "weight", "nodes", "agent"}, what)
        nodes = r.get("nodes", [])
        if not isinstance(nodes, list) or not all(isinstance(v, str) for v in nodes):
            raise TierError(f"{source}: {what}: nodes = {nodes!r} is not a list of node names")
        routers.append(
            InventoryRouter(
                name,
                need(r, "http", what, str),
                need(r, "grpc", what, str),
                need(r, "ready", what, str),
                need(r, "weight", what, int) if "weight" in r else 1,
                tuple(nodes),
                need(r, "agent", what, str) if "agent" in r else None,
            )
        )
    balancer = None
    if "balancer" in data:
        b = data["balancer"]
        what = "[balancer]"
        if not isinstance(b, dict):
            raise TierError(f"{source}: balancer must be a table ([balancer])")
        known(b, {"http", "grpc", "stats", "check_ms", "fall", "rise"}, what)
        stats = b.get("stats")
        if stats is not None and not isinstance(stats, str):
            raise TierError(f"{source}: {what}: stats = {stats!r} is not a string")
        checks = {
            k: need(b, k, what, int) if k in b else default
            for k, default in (("check_ms", 500), ("fall", 2), ("rise", 2))
        }
        balancer = BalancerSpec(
            need(b, "http", what, str), need(b, "grpc", what, str), stats, **checks
        )
    return tuple(routers), balancer


def tier_toml(routers: tuple[InventoryRouter, ...], balancer: BalancerSpec | None) -> list[str]:
    """The lines of [balancer] and [[routers]] as parse_tier reads them."""
    lines = []
    if balancer is not None:
        lines += ["[balancer]", f'http = "{balancer.http}"', f'grpc = "{balancer.grpc}"']
        if balancer.stats is not None:
            lines.append(f'stats = "{balancer.stats}"')
        lines += [f"check_ms = {balancer.check_ms}", f"fall = {balancer.fall}"]
        lines += [f"rise = {balancer.rise}", ""]
    for r in routers:
        lines += [
            "[[routers]]",
            f'name = "{r.name}"',
            f'http = "{r.http}"',
            f'grpc = "{r.grpc}"',
            f'ready = "{r.ready}"',
            f"weight = {r.weight}",
        ]
        if r.agent:
            lines.append(f'agent = "{r.agent}"')
        if r.nodes:
            names = ", ".join(f'"{n}"' for n in r.nodes)
            lines.append(f"nodes = [{names}]")
        lines.append("")
    return lines


def shard_assignment(
    routers: tuple[InventoryRouter, ...],
    devices: dict[str, str],
    live: Iterable[str],
) -> dict[str, tuple[str, ...]]:
    """Which nodes each live router drives when only `live` routers are left: its own
    shard, and the nodes of the routers gone dealt out among the live ones, one device type
    at a time (each adopter gets GPUs of every type it can, so that its pools stay mixed),
    the next node to the live router with the fewest nodes (ties: inventory order). A pure
    function of the inventory and the live set: every router that sees the same live set
    computes the same shards, and a router that comes back gets its own shard again.
    `devices`: node name -> device type, in the inventory's order."""
    alive = [r for r in routers if r.name in set(live)]
    if not alive:
        return {}
    out: dict[str, list[str]] = {r.name: list(r.nodes) for r in alive}
    orphans = [n for r in routers if r.name not in out for n in r.nodes]
    by_type: dict[str, list[str]] = {}
    for n in orphans:
        by_type.setdefault(devices[n], []).append(n)
    order = {r.name: i for i, r in enumerate(alive)}
    for device in sorted(by_type):
        for n in by_type[device]:
            have = {name: sum(devices[m] == device for m in nodes) for name, nodes in out.items()}
            to = min(out, key=lambda name: (have[name], len(out[name]), order[name]))
            out[to].append(n)
    return {name: tuple(nodes) for name, nodes in out.items()}


def nodes_for_counts(
    nodes: Iterable[tuple[str, str, str]], counts: list[dict[str, int]]
) -> list[tuple[str, ...]]:
    """Nodes (name, device type, server) dealt to shards that want `counts[i][type]` GPUs
    of each type (a split the planner searched: poolpipe.planner.shards.search_split):
    type by type, whole servers first, largest first, each to the shard that still wants
    the most of that type and can take the server whole; then the nodes left one by one to
    the shard that wants the most. ClusterError where the counts do not add up to the
    nodes of a type."""
    by_type: dict[str, dict[str, list[str]]] = {}
    for name, device, server in nodes:
        by_type.setdefault(device, {}).setdefault(server, []).append(name)
    out: list[list[str]] = [[] for _ in counts]
    for device, servers in sorted(by_type.items()):
        want = [c.get(device, 0) for c in counts]
        total = sum(len(ns) for ns in servers.values())
        if sum(want) != total:
            raise ClusterError(
                f"{device}: the shards want {sum(want)} GPUs, the inventory has {total}"
            )
        left: list[str] = []
        for _, names in sorted(servers.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            fits = [i for i in range(len(counts)) if want[i] >= len(names)]
            if fits:
                i = max(fits, key=lambda i: (want[i], -i))
                out[i] += names
                want[i] -= len(names)
            else:
                left += names
        for name in left:
            i = max(range(len(counts)), key=lambda i: (want[i], -i))
            out[i].append(name)
            want[i] -= 1
    return [tuple(ns) for ns in out]


class TierView:
    """Which routers of a tier are live, as one of them sees it from its peers' readiness
    checks (any answer, ready or not, means the peer runs and drives its shard): a peer is
    gone once it has not answered for `gone_after_s` since its last answer, or, never seen,
    for `start_grace_s` since this view began (the tier starting router by router). Times
    are the caller's clock, in seconds."""

    def __init__(
        self, me: str, peers: Iterable[str], gone_after_s: float, start_grace_s: float, now: float
    ):
        self.me = me
        self.gone_after_s, self.start_grace_s = gone_after_s, start_grace_s
        self.began = now
        self.last: dict[str, float | None] = {p: None for p in peers if p != me}

    def saw(self, peer: str, answered: bool, now: float) -> None:
        if answered:
            self.last[peer] = now

    def gone(self, now: float) -> frozenset[str]:
        out = set()
        for peer, last in self.last.items():
            since, wait = (self.began, self.start_grace_s) if last is None else (last, 0.0)
            if now - since >= max(wait, self.gone_after_s):
                out.add(peer)
        return frozenset(out)

    def live(self, now: float) -> frozenset[str]:
        return frozenset({self.me, *self.last}) - self.gone(now)
