"""A multi-host cluster on one machine (docs/design/cluster.md, "The emulated cluster"): one Linux
network namespace per server, each with its own address on a private bridge and a NIC
limited by `tc` in both directions (the namespace end limits the server's uplink, the
bridge end its downlink: the NIC model of the planner and the scheduler made physical),
stage-worker nodes (`poolpipe node`, one per GPU: several per server on their own ports)
started inside each, and the inventory that lists them. The router runs in the root
namespace and reaches the nodes by address only. `from_cluster` builds a clusters-file
preset (servers of `gpus_per_server` GPUs each), optionally time-dilated: NICs at the
preset's bandwidth / D.

Needs root (CAP_NET_ADMIN) and the `ip` and `tc` tools; `unavailable()` says why not where
they are missing. Everything made is torn down on exit, also after a failure."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.inventory import Inventory, InventoryNode, InventoryServer
from poolpipe.errors import PoolpipeError
from triton_backend.env import signals_held
from triton_backend.node.triton import (
    RemoteNode,
    descendants,
    model_folders,
    reap,
    shm_regions,
    still_running,
)

GRPC_PORT, HTTP_PORT, METRICS_PORT = 8001, 8000, 8002  # Triton's defaults, a server's first node
WATCH_PORT = 8003  # the node process's watch port (triton_backend.node.watch)
SLOT_PORTS = 10  # a server's node k uses the ports above + 10 k
STAGES_METRIC = re.compile(r"^poolpipe_emulated_stages_total\{([^}]*)\} (\S+)$", re.M)
MAPS_METRIC = re.compile(r"^poolpipe_feature_maps_total\{([^}]*)\} (\S+)$", re.M)
# tc counts a frame's bytes; the planner's bandwidth, and the data plane's reserved
# transfers, a feature map's. A full TCP segment carries 1,448 bytes (timestamps on) in a
# 1,514-byte frame (IP 1,500 + Ethernet 14): a NIC that is to move B bytes of payload a
# second is given B * 1514 / 1448, else every transfer overran its reservation by 4.6% and
# on a link booked back to back each one pushed the next (docs/serving.md).
FRAME_PER_PAYLOAD = 1514 / 1448


def tc_rate(mbit_s: float) -> str:
    """tc's rate for a NIC that carries `mbit_s` Mbit/s of TCP payload."""
    return f"{max(1, round(mbit_s * FRAME_PER_PAYLOAD * 1000))}kbit"


class EmulationError(PoolpipeError):
    pass


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}")
    return res


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool is missing (iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"pp-probe-{uuid.uuid4().hex[:6]}"
    res = _run("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` was refused: {res.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _tx_rx_bytes(device: str) -> tuple[int, int]:
    """(bytes sent, bytes received) by network interface `device` so far."""
    stats = Path("/sys/class/net") / device / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no interface here has an address in."""
    used = []
    for line in _run("ip", "-o", "-4", "addr").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    for third in range(200, 256):
        net = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise EmulationError("no free 10.213.x.0/24 subnet for the emulated cluster")


@dataclass
class EmulatedNode:
    """One node slot: the `slot`-th node of server `server` (its namespace, address, NIC)."""

    index: int
    server: int
    slot: int
    namespace: str
    address: str
    veth: str  # bridge end, in the root namespace (its tx is the server's downlink)
    peer: str  # namespace end
    node: subprocess.Popen | None = field(default=None, repr=False)
    node_name: str = ""
    device: str = ""
    gpus: int = 1  # GPUs its node serves (poolpipe node --gpus)

    def port(self, base: int) -> int:
        return base + SLOT_PORTS * self.slot


class EmulatedCluster:
    """Namespaces with `bandwidth_gbps` NICs, as many as `servers` (a count: one node slot
    each; a list: the node slots of each server); use as a context manager. Node slots are
    numbered across the servers in order (`nodes`)."""

    def __init__(
        self,
        servers: int | list[int],
        workspace: Path,
        bandwidth_gbps: float = 1.0,
        link_scale: tuple[float, float] = (1.0, 1.0),
    ):
        slots = [1] * servers if isinstance(servers, int) else list(servers)
        if not slots or min(slots) < 1:
            raise EmulationError(
                f"an emulated cluster needs at least one server of at least one node, got {servers}"
            )
        if len(link_scale) != 2 or not all(x > 0 and math.isfinite(x) for x in link_scale):
            raise EmulationError(
                "the links' scale needs two finite factors > 0 (uplink, downlink), got "
                f"{link_scale}"
            )
        self.bandwidth_gbps = bandwidth_gbps
        # what the NICs are shaped to, against `bandwidth_gbps` (the plan's): a probe of
        # how much the links' own timing costs (scripts/bench_links.py); 1, 1 elsewhere
        self.link_scale = (float(link_scale[0]), float(link_scale[1]))
        self.workspace = Path(workspace)
        self.tag = f"pp{uuid.uuid4().hex[:5]}"  # interface names stay within 15 characters
        self.bridge = f"{self.tag}br"
        self.subnet: ipaddress.IPv4Network | None = None
        self.router_address = ""
        self.nodes: list[EmulatedNode] = []
        self.devices: list[str] = []  # from_cluster: each node slot's device type
        self.gpus: list[int] = [1] * sum(slots)  # each node slot's GPUs
        self._slots = slots
        self._made: list[tuple[str, ...]] = []  # teardown commands, last first
        self._clients = 0  # client namespaces added (add_client)

    @classmethod
    def from_cluster(
        cls,
        cluster: Cluster,
        workspace: Path,
        time_scale: float = 1.0,
        node_per_server: bool = False,
        link_scale: tuple[float, float] = (1.0, 1.0),
    ) -> EmulatedCluster:
        """A server per `gpus_per_server` GPUs of each pool of `cluster` (a clusters-file
        preset), a node slot per GPU (`devices` says its type; with `node_per_server`, one
        slot per server, `gpus` its GPUs), NICs at the cluster's bandwidth / `time_scale`
        (time-dilated emulation: docs/design/emulation.md), shaped at `link_scale` (uplink,
        downlink) times that."""
        if time_scale <= 0:
            raise EmulationError(f"the time scale must be > 0, got {time_scale:g}")
        slots: list[int] = []
        devices: list[str] = []
        gpus: list[int] = []
        for pool in cluster.pools:
            left = pool.count
            while left > 0:
                n = min(left, pool.gpus_per_server)
                slots.append(1 if node_per_server else n)
                devices += [pool.gpu] * (1 if node_per_server else n)
                gpus += [n] if node_per_server else [1] * n
                left -= n
        if not slots:
            raise EmulationError(f"cluster {cluster.name} has no GPUs")
        em = cls(slots, workspace, cluster.bandwidth_gbps / time_scale, link_scale)
        em.devices = devices
        em.gpus = gpus
        return em

    @property
    def servers(self) -> int:
        return len(self._slots)

    # ------------------------------------------------------------------ set-up

    def __enter__(self) -> EmulatedCluster:
        why = unavailable()
        if why:
            raise EmulationError(f"cannot emulate a cluster here: {why}")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self.subnet = free_subnet()
        hosts = list(self.subnet.hosts())
        self.router_address = str(hosts[0])
        prefix = self.subnet.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "addr", "add", f"{self.router_address}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        up, down = (tc_rate(self.bandwidth_gbps * 1000 * x) for x in self.link_scale)
        for k, slots in enumerate(self._slots):
            s = EmulatedNode(
                len(self.nodes), k, 0, f"{self.tag}-s{k}", str(hosts[9 + k]),
                f"{self.tag}v{k}", f"{self.tag}p{k}",
            )  # fmt: skip
            self._namespace(s.namespace, s.veth, s.peer, s.address, (up, down))
            self.nodes += [replace(s, index=len(self.nodes) + j, slot=j) for j in range(slots)]

    def _namespace(
        self,
        namespace: str,
        veth: str,
        peer: str,
        address: str,
        rates: tuple[str, str],
        burst: str = "256kb",
    ) -> None:
        """A namespace on the bridge at `address`, its NIC limited to `rates` (tc's: tc_rate;
        uplink, downlink), `burst` passing at once: the namespace end its uplink, the bridge
        end its downlink."""
        assert self.subnet is not None
        _run("ip", "netns", "add", namespace)
        self._made.append(("ip", "netns", "del", namespace))
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        self._made.append(("ip", "link", "del", veth))
        _run("ip", "link", "set", peer, "netns", namespace)
        inside = ("ip", "netns", "exec", namespace)
        _run(*inside, "ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", peer)
        _run(*inside, "ip", "link", "set", peer, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        up, down = rates
        for cmd, dev, r in (("tc",), veth, down), ((*inside, "tc"), peer, up):
            _run(*cmd, "qdisc", "add", "dev", dev, "root", "tbf", "rate", r,
                 "burst", burst, "latency", "100ms")  # fmt: skip

    def add_client(self, mbit_s: float) -> tuple[str, str]:
        """A client host of its own: a namespace on the cluster's network whose NIC carries
        `mbit_s` (its uplink; its downlink alike), no more than 2 ms of it at once (a
        feature map takes its size's time on it); (namespace, address). The router must
        listen on `router_address` for it to reach it. Torn down with the cluster."""
        if self.subnet is None:
            raise EmulationError("add clients to an emulated cluster that is set up (with)")
        if not (mbit_s > 0):
            raise EmulationError(f"a client's link needs a rate > 0 Mbit/s, got {mbit_s}")
        k = self._clients
        if 9 + self.servers + k >= self.subnet.num_addresses - 2:
            raise EmulationError(f"no address left in {self.subnet} for client {k}")
        self._clients += 1
        hosts = list(self.subnet.hosts())
        namespace, address = f"{self.tag}-c{k}", str(hosts[-1 - k])
        rate = tc_rate(mbit_s)
        burst = f"{max(2_000, round(mbit_s * 1e6 / 8 * 0.002))}b"  # 2 ms, at least a frame
        self._namespace(
            namespace, f"{self.tag}c{k}", f"{self.tag}q{k}", address, (rate, rate), burst
        )
        return namespace, address

    # ------------------------------------------------------------------ nodes

    def start_node(
        self,
        node: int,
        device: str,
        name: str | None = None,
        wait: bool = True,
        token_file: Path | None = None,
        emulate: bool = False,
        time_scale: float = 1.0,
        gpus: int | None = None,
    ) -> RemoteNode | None:
        """Start `poolpipe node` for node slot `node` inside its server's namespace on the
        server's address and the slot's ports (its management APIs restricted by
        `token_file`'s token when given; `gpus`: the GPUs it serves, else the slot's), and
        (with `wait`) wait until the router's namespace reaches its gRPC port."""
        s = self.nodes[node]
        s.device, s.node_name = device, name or f"s{s.server}-n{s.slot}"
        s.gpus = self.gpus[node] if gpus is None else gpus
        log = self.workspace / f"{s.node_name}.out"
        self.workspace.mkdir(parents=True, exist_ok=True)
        cmd = [
            "ip", "netns", "exec", s.namespace,
            sys.executable, "-m", "poolpipe_cli", "node",
            "--device", device, "--name", s.node_name, "--listen", s.address,
            "--grpc-port", str(s.port(GRPC_PORT)), "--http-port", str(s.port(HTTP_PORT)),
            "--metrics-port", str(s.port(METRICS_PORT)),
            "--watch-port", str(s.port(WATCH_PORT)),
            "--workspace", str(self.workspace / s.node_name),
            *(["--token-file", str(token_file)] if token_file else []),
            *(["--emulate", "--time-scale", repr(time_scale)] if emulate else []),
            *(["--gpus", str(s.gpus)] if s.gpus != 1 else []),
        ]  # fmt: skip
        with open(log, "ab") as out:
            s.node = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self.wait_node(node) if wait else None

    def wait_node(self, node: int, timeout_s: float = 90.0) -> RemoteNode:
        s = self.nodes[node]
        remote = RemoteNode(
            s.node_name,
            s.device,
            f"{s.address}:{s.port(GRPC_PORT)}",
            f"s{s.server}",
            http=f"{s.address}:{s.port(HTTP_PORT)}",
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if s.node is not None and s.node.poll() is not None:
                tail = (self.workspace / f"{s.node_name}.out").read_text(errors="replace")
                raise EmulationError(f"node {s.node_name} exited: {tail[-800:]}")
            if remote.live(1.0):
                return remote
            time.sleep(0.2)
        raise EmulationError(f"node {s.node_name} did not answer within {timeout_s:.0f} s")

    def stop_node(self, node: int, sig: int = signal.SIGTERM) -> None:
        """Stop node slot `node`'s node (SIGKILL: as a crash, its Triton killed with it)."""
        s = self.nodes[node]
        if s.node is None or s.node.poll() is not None:
            return
        below = descendants(s.node.pid)
        regions = shm_regions(below)  # a killed group's stubs no longer name them
        folders = model_folders(below)
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGKILL:
                os.killpg(s.node.pid, signal.SIGKILL)
            else:
                s.node.send_signal(sig)
        try:
            s.node.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.node.pid, signal.SIGKILL)
            s.node.wait()
        reap(
            below,
            grace_s=0.0 if sig == signal.SIGKILL else 5.0,
            regions=regions,
            folders=folders,
        )

    def kill_node_process(self, node: int, wait_s: float = 30.0) -> None:
        """SIGKILL node slot `node`'s `poolpipe node` process alone (as the OOM killer
        would): its tritonserver, told by its parent-death signal, shuts down on its own;
        wait (at most `wait_s`) for it and its stubs to be gone, then remove what is left."""
        s = self.nodes[node]
        if s.node is None or s.node.poll() is not None:
            return
        below = descendants(s.node.pid)
        regions, folders = shm_regions(below), model_folders(below)
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.node.pid, signal.SIGKILL)
        s.node.wait()
        deadline = time.monotonic() + wait_s
        while still_running(below) and time.monotonic() < deadline:
            time.sleep(0.05)
        reap(below, grace_s=0.0, regions=regions, folders=folders)

    def inventory(self) -> Inventory:
        return Inventory(
            tuple(InventoryServer(f"s{k}", self.bandwidth_gbps) for k in range(self.servers)),
            tuple(
                InventoryNode(
                    s.node_name,
                    f"s{s.server}",
                    s.device,
                    f"{s.address}:{s.port(GRPC_PORT)}",
                    http=f"{s.address}:{s.port(HTTP_PORT)}",
                    watch=f"{s.address}:{s.port(WATCH_PORT)}",
                    gpus=s.gpus,
                )
                for s in self.nodes
                if s.node is not None
            ),
            str(self.workspace / "inventory.toml"),
        )

    def write_inventory(self) -> Path:
        path = self.workspace / "inventory.toml"
        path.write_text(self.inventory().to_toml())
        return path

    def server_node(self, server: int) -> int:
        """The first node slot of server `server`."""
        return next(s.index for s in self.nodes if s.server == server)

    def link_bytes(self, server: int) -> tuple[int, int]:
        """(bytes to server `server`, bytes from it) through its NIC so far."""
        return _tx_rx_bytes(self.nodes[self.server_node(server)].veth)

    def emulated_stages(self) -> tuple[float, float]:
        """(on time, late) emulated stages the running nodes have counted so far
        (poolpipe_emulated_stages_total, from each node's metrics port): late where the
        host, not the emulated GPU, ended a stage beyond max(0.3 ms, 2%) of its due time."""
        counts = [0.0, 0.0]
        for text in self._metrics():
            for m in STAGES_METRIC.finditer(text):
                counts['late="true"' in m.group(1)] += float(m.group(2))
        return counts[0], counts[1]

    def feature_maps(self) -> tuple[float, float]:
        """(through the next node's feed, inline) feature maps the running nodes have sent
        on over HTTP so far (poolpipe_feature_maps_total; node/feed.py)."""
        counts = [0.0, 0.0]
        for text in self._metrics():
            for m in MAPS_METRIC.finditer(text):
                counts['via="inline"' in m.group(1)] += float(m.group(2))
        return counts[0], counts[1]

    def _metrics(self) -> list[str]:
        """Each running node's metrics page (Prometheus text)."""
        import httpx

        pages = []
        for s in self.nodes:
            if s.node is None or s.node.poll() is not None:
                continue
            url = f"http://{s.address}:{s.port(METRICS_PORT)}/metrics"
            with contextlib.suppress(httpx.HTTPError):
                pages.append(httpx.get(url, timeout=5).text)
        return pages

    def router_bytes(self) -> int:
        """Bytes through the router's interface (the cluster's bridge) so far, both ways."""
        return sum(_tx_rx_bytes(self.bridge))

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        with signals_held():  # a second Ctrl-C must not leave namespaces or nodes behind
            self._close()

    def _close(self) -> None:
        def stop(k: int) -> None:
            with contextlib.suppress(Exception):
                self.stop_node(k)

        if self.nodes:  # side by side (the router's stop and this took 12 s for 7 in turn)
            with ThreadPoolExecutor(min(16, len(self.nodes))) as pool:
                list(pool.map(stop, range(len(self.nodes))))
        while self._made:
            _run(*self._made.pop(), check=False)
        self.nodes = []
