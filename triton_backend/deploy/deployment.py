"""Bring a plan up and keep it serving: its partitions uploaded to one stage-worker node per
physical GPU of its topology (the nodes of an inventory, wherever they run, or nodes this
process starts on loopback and describes by an inventory of its own), calibrated, with the
router (the serving runtime on the real clock) and its front door in front; roll out new
plans; take it down.

The steps live in their own modules: prepare (topology, layout, partition files), load
(attach to nodes, upload models), calibration, router, frontend (the router's Triton and
door)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from poolpipe.client.control import node_key
from poolpipe.domain.apps import plan_applications, served_parts
from poolpipe.domain.inventory import Inventory
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import PartitionFile
from poolpipe.runtime import (
    DEFAULT_MARGIN_CEILING_US,
    DEFAULT_MARGIN_FLOOR_US,
    ArrivalStamps,
    MarginMeter,
    ServedPlan,
    slo_room_warnings,
)
from poolpipe.runtime.placement import Layout
from poolpipe.scheduler import make_data_plane
from poolpipe.scheduler.topology import Topology, on_servers, with_inputs, with_latencies
from triton_backend import (
    DOOR_QUEUE,
    DOOR_RING_MB,
    ROUTER_INSTANCES,
    TRANSPORT_CHOICES,
    TRANSPORTS,
)
from triton_backend.deploy.load import (
    LocalNodes,
    Supervisor,
    attach,
    load_layout,
    unload_all,
)
from triton_backend.deploy.prepare import model_io, prepare, remove_files
from triton_backend.env import is_loopback, signals_held, triton_home
from triton_backend.node.triton import RemoteNode, RepositoryAPI, TritonNode, refuse_taken_ports
from triton_backend.router.answers import parse_address
from triton_backend.router.apps import RouterApps
from triton_backend.router.calibration import calibrate, warm
from triton_backend.router.core import DRAIN_TIMEOUT_S, ModelIO, RouterCore, served_plan
from triton_backend.router.door.server import Frontend
from triton_backend.router.served import input_bytes
from triton_backend.router.tracing import TraceConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """How a deployment serves (Deployment.up's keywords, as resolved)."""

    plane: str  # the data plane (scheduler.DATA_PLANES)
    max_batch: int  # the largest batch a partition model takes
    wake_guard_us: float  # the data plane's wake guard floor
    reply_margin_us: float  # the reply margin's floor ...
    reply_margin_max_us: float  # ... and its ceiling
    key: str | None  # the nodes' key (derived from the token); None: nothing restricted
    transport: str  # "router" or "chain" ("auto" resolved)
    # a chain's answer: to the router's inbox at this "HOST:PORT" ("auto" resolved), or
    # back along the chain (None)
    answers: str | None = None


def _served(
    live: Topology,
    lay: Layout,
    nodes: dict[str, RepositoryAPI],
    ios: list[ModelIO],
    options: ServeOptions,
) -> ServedPlan:
    """What the router needs to serve a calibrated topology on these nodes."""
    return served_plan(
        live,
        make_data_plane(options.plane, live, wake_guard_us=options.wake_guard_us),
        lay.pool_partition,
        {v: nodes[n].node_id for v, n in lay.vgpu_node.items()},
        ios,
    )


def _watch(core: RouterCore, nodes: dict[str, RepositoryAPI]) -> None:
    """The router names the nodes in its log and watches those with a watch address."""
    core.node_names.update({n.node_id: n.name for n in nodes.values()})
    core.watch({n.node_id: a for n in nodes.values() if (a := n.watch_address) is not None})


def _applications(core: RouterCore, plan: Plan, ios: list[ModelIO]) -> list[ModelIO]:
    """The plan's applications at the router's door (their tensors), where it has some."""
    apps, recorded = plan_applications(plan.meta, f"plan {plan.strategy}/{plan.cluster.name}")
    if not apps:
        return []
    core.apps = RouterApps(
        core.runtime,
        core.clock,
        apps,
        {a.name: recorded[a.name]["budgets_us"] for a in apps},
        {io.name: io for io in ios},
        {a.name: served_parts(a.name, recorded[a.name]) for a in apps},
    )
    return list(core.apps.ios.values())


def _http_addresses(nodes: dict[str, RepositoryAPI]) -> dict[str, str]:
    """The router's name of a node (its gRPC address, and GPU: RepositoryAPI.node_id) -> its
    KServe v2 HTTP address, for the nodes whose HTTP address is known."""
    return {n.node_id: a for n in nodes.values() if (a := n.http_address) is not None}


ROLLOUT_RESULTS = ("done", "rolled back", "refused")  # RolloutResult.status


@dataclass(frozen=True)
class RolloutResult:
    status: str  # "done", "rolled back" (what was loaded is unloaded) or "refused" (nothing was)
    reason: str
    plan_from: str
    plan_to: str
    prepare_s: float  # rendering, loading and calibrating while the old plan serves
    downtime_ms: float  # intake paused
    held: int  # requests that arrived during the switch (served after it)
    failed: int  # requests the flush could not finish (answered with an error)


@dataclass
class Deployment:
    plan: Plan
    topo: Topology
    layout: Layout
    nodes: dict[str, RepositoryAPI]  # by the layout's node names
    core: RouterCore
    workspace: Path
    ios: list[ModelIO]
    options: ServeOptions
    generation: int = 0
    frontend: Frontend | None = field(default=None, repr=False)
    control: Callable[[dict], dict] | None = field(default=None, repr=False)
    calibration: dict[tuple, float] = field(default_factory=dict, repr=False)
    parts: dict = field(default_factory=dict, repr=False)  # partition files by model name
    inventory: Inventory | None = None  # the nodes attached to
    operator_down: frozenset[str] = frozenset()  # nodes its inventory marked down
    local: LocalNodes | None = field(default=None, repr=False)  # nodes this process runs
    supervisor: Supervisor | None = field(default=None, repr=False)  # restarts dead ones
    # "NODE: MODEL" of the partitions an earlier router of these models had left on the
    # attached nodes, unloaded at start-up
    cleaned: list[str] = field(default_factory=list)
    # the router whose partition models these are (serve --router): their names carry it,
    # so that a router adopting a lost router's nodes, or handing them back, tells whose
    # models a node holds; None: a router alone
    owner: str | None = None
    fenced: list[str] = field(default_factory=list)  # what fence unloaded, "NODE: ..."
    _restarting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def http_port(self) -> int:
        return self.frontend.http_port if self.frontend else 0

    @property
    def grpc_port(self) -> int:
        return self.frontend.grpc_port if self.frontend else 0

    @property
    def http_url(self) -> str:
        """host:port of the router's KServe v2 HTTP endpoint."""
        return self.frontend.node.http_url if self.frontend else ""

    @property
    def grpc_url(self) -> str:
        """host:port of the router's KServe v2 gRPC endpoint."""
        return self.frontend.node.grpc_url if self.frontend else ""

    def call_overhead_us(self) -> float | None:
        """What a stage call on the nodes took beyond its blocks' profiled run: the live
        stage time at a batch of one less the profiled one, the least over the pools (µs);
        None where neither is known."""
        gaps = [
            live.latency_us[1] - planned.latency_us[1]
            for live, planned in zip(self.core.runtime.topo.pools, self.topo.pools, strict=True)
            if len(live.latency_us) > 1 and len(planned.latency_us) > 1
            and live.latency_us[1] > 0 and planned.latency_us[1] > 0
        ]  # fmt: skip
        return max(0.0, min(gaps)) if gaps else None

    def down_nodes(self) -> list[dict[str, str]]:
        """The nodes the router has taken out of service (failed, not back yet: it keeps
        checking them, also once a rollout has left them out), as {node, device, grpc}."""
        down = self.core.down_nodes()
        known = (
            [
                (g.name, device, g.node_id)
                for device, gpus in self.inventory.gpus_by_device().items()
                for g in gpus
            ]
            if self.inventory is not None
            else [(n.name, n.device, n.node_id) for n in self.nodes.values()]
        )
        out = {a: {"node": name, "device": dev, "grpc": a} for name, dev, a in known if a in down}
        return list(out.values())

    def node_address(self, name: str) -> str:
        """The address the router knows node `name` by (its gRPC host:port, "/gpuI" after it
        for a GPU of a node of several); a name not among the plan's nodes is a
        PoolpipeError listing them."""
        for n in self.nodes.values():
            if name in (n.name, n.node_id):
                return n.node_id
        known = ", ".join(sorted({n.name for n in self.nodes.values()}))
        raise PoolpipeError(f"no node {name!r} serves the plan here; its nodes: {known}")

    def drain(self, name: str, timeout_s: float | None = None) -> dict[str, object]:
        """Take node `name` out of new batches and wait for those on it to end (RouterCore
        .drain); it stays out (also across rollouts) until undrain."""
        address = self.node_address(name)
        out = self.core.drain(address, DRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
        log.warning("node %s drained: %s batch(es) left on it", name, out["batches_left"])
        return {**out, "node": name}

    def undrain(self, name: str) -> None:
        self.core.undrain(self.node_address(name))  # the router logs the change

    def _inventory_now(self) -> Inventory | None:
        """The inventory with the nodes now out of service marked down (as well as those
        its operator marked), so that a rollout places nothing on them."""
        if self.inventory is None or self.local is not None:
            return self.inventory  # local nodes are started (or restarted) for the layout
        down = {d["node"] for d in self.down_nodes()}
        drained = self.core.drained_nodes()
        down |= {
            g.name
            for gpus in self.inventory.gpus_by_device().values()
            for g in gpus
            if g.node_id in drained
        }
        return replace(self.inventory, down=self.operator_down | down)

    @property
    def triton_metrics_url(self) -> str | None:
        """host:port of the router's Triton's own Prometheus metrics."""
        if self.frontend is None:
            return None
        node = self.frontend.node
        host = node.address if ":" not in node.address else f"[{node.address}]"
        return f"{host}:{node.metrics_port}"

    @property
    def warmed(self) -> int:
        """Warm-up requests answered at start-up."""
        return self.frontend.warmed if self.frontend else 0

    @classmethod
    def up(
        cls,
        plan: Plan,
        warehouse: str | Path | None,
        workspace: Path,
        *,
        plane: str = "reservation",
        router_instances: int = ROUTER_INSTANCES,
        door_ring_mb: float = DOOR_RING_MB,
        door_ring_dir: str | Path | None = None,
        door_queue: int = DOOR_QUEUE,
        max_batch: int = 8,
        wake_guard_us: float = 5000.0,
        reply_margin_us: float = DEFAULT_MARGIN_FLOOR_US,
        reply_margin_max_us: float | None = None,
        control: Callable[[dict], dict] | None = None,
        listen: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        triton_metrics_port: int = 0,
        inventory: Inventory | None = None,
        token: str | None = None,
        transport: str = "router",
        chain_answers: str = "auto",
        supervise: bool = False,
        arrival_stamps: ArrivalStamps | None = None,
        owner: str | None = None,
        tracing: TraceConfig | None = None,
    ) -> Deployment:
        """`control`: answers JSON commands sent to the router's `poolpipe_control` model
        (rollouts and statistics from other processes); none when not given.
        `router_instances`: Python-backend instances of each served model's door (each
        hands requests over at once; two by default, so that one is free while the other
        runs: ROUTER_INSTANCES). `door_ring_mb`: each door instance's shared memory for
        inputs (0: inputs go down the door's socket), in `door_ring_dir` (default
        /dev/shm, else the door's folder). `door_queue`: the
        requests each door's queue in the router's Triton holds at most, more refused (0: no
        bound); one waits there no longer than the longest SLO served, then is refused.
        `reply_margin_us` / `reply_margin_max_us`: the floor and the ceiling of the reply
        margin, which the router measures (its ingress + egress p99) and holds back from
        every request's deadline; the ceiling defaults to the larger of the floor and 25 ms.
        `listen`, `http_port`, `grpc_port`: where clients reach the router (0: a free port);
        `triton_metrics_port`: its Triton's own metrics (0: a free port).
        `inventory`: the running nodes to serve on; without one, this process starts a node
        per GPU of the plan on loopback and writes their inventory to the workspace.
        `token`: the secret shared with the nodes (their management APIs expect the key
        derived from it; nodes this process starts are restricted so, and so is the
        router's own Triton); None: nothing restricted.
        `transport`: "router" (each hop sent from the router; feature maps pass through it),
        "chain" (feature maps node to node; the router sends inputs, gets outputs), or
        "auto": "router" when every node has a loopback address, else "chain".
        `chain_answers` (chain transport): where a chain's last node sends the model's
        outputs: "HOST:PORT", the router's inbox (router/answers.py; PORT 0: any free port;
        HOST 0.0.0.0: every interface, each node told the address its host is routed to);
        "auto": 127.0.0.1:0 when every node is on loopback, else 0.0.0.0:0; "back": back
        along the chain, across every earlier node's NIC.
        `supervise`: restart the nodes this process runs when they exit on their own
        (Supervisor; `poolpipe serve` does), instead of leaving it to restart_node.
        `arrival_stamps`: how a load balancer's arrival stamps are taken (default bounds).
        `owner`: the router of a router tier this is (its name tags its partition models:
        owned_by). `tracing`: where the router exports its requests' traces, and which
        (router/tracing.py); None: no traces."""
        workspace = Path(workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        ceiling = (
            max(reply_margin_us, DEFAULT_MARGIN_CEILING_US)
            if reply_margin_max_us is None
            else reply_margin_max_us
        )
        margin = MarginMeter(reply_margin_us, ceiling)  # checks floor <= ceiling first
        key = None if token is None else node_key(token)
        local = (
            None
            if inventory is not None
            else LocalNodes(
                workspace,
                plan.cluster.bandwidth_gbps,
                key,
                None if tracing is None else tracing.endpoint,
            )
        )
        # before anything starts: a leftover on the router's ports is named, not reused
        refuse_taken_ports(
            "the router",
            listen,
            {"HTTP port": http_port, "gRPC port": grpc_port, "metrics port": triton_metrics_port},
        )
        dep: Deployment | None = None
        loaded: list[tuple[RepositoryAPI, str]] = []
        cleaned: list[str] = []
        triton_home(workspace)  # once, before the nodes start side by side
        try:
            topo, lay, parts = prepare(plan, warehouse, workspace, generation_tag(owner, 0))
            ios = model_io(topo, lay, parts)
            topo = _with_inputs(topo, plan, ios)
            nodes, inventory, topo = _attach(topo, lay, inventory, local, workspace, key)
            urls = [n.grpc_url for n in nodes.values()]
            options = ServeOptions(
                plane,
                max_batch,
                wake_guard_us,
                reply_margin_us,
                ceiling,
                key,
                resolve_transport(transport, urls),
                resolve_answers(chain_answers, urls),
            )
            if local is None:  # attached nodes: what an earlier router of these models left
                cleaned = _unload_left_behind(nodes, [m.name for m in plan.models], owner)
            load_layout(lay, parts, nodes, max_batch, loaded)
            log.info("loaded %d partition model(s) on %d node(s)", len(loaded), len(nodes))
            fenced = fence_off(nodes, [m.name for m in plan.models], owner)
            warm(lay, nodes, parts)
            known: dict[tuple, float] = {}
            bandwidth = plan.cluster.bandwidth_gbps
            live = with_latencies(
                topo, calibrate(topo, lay, nodes, parts, known=known, bandwidth_gbps=bandwidth)
            )
            log.info("measured the stage times on the nodes; starting the router")
            core = RouterCore(
                _served(live, lay, nodes, ios, options),
                margin=margin,
                transport=options.transport,
                key=key,
                stamps=arrival_stamps,
                answers=options.answers,
                tracing=tracing,
            ).start()
            core.use_http(_http_addresses(nodes))
            _watch(core, nodes)
            door_ios = ios + _applications(core, plan, ios)
            dep = cls(plan, topo, lay, nodes, core, workspace, ios, options, control=control)
            dep.calibration, dep.parts = known, parts
            dep.inventory, dep.local = inventory, local
            dep.cleaned, dep.owner, dep.fenced = cleaned, owner, fenced
            dep.operator_down = inventory.down
            core.executor.on_empty_node = dep._refill_url
            dep.frontend = Frontend(
                core,
                door_ios,
                workspace,
                router_instances,
                control,
                listen,
                http_port,
                grpc_port,
                key,
                triton_metrics_port,
                door_ring_mb,
                None if door_ring_dir is None else Path(door_ring_dir),
                door_queue,
            ).start()
            if supervise and local is not None:
                dep.supervisor = Supervisor(
                    lambda: local.nodes, dep._restart_dead, stopping=lambda: core.stopping
                ).start()
            return dep
        except BaseException:
            if dep is not None:
                dep.down()
            elif local is not None:
                local.stop()
            else:  # attached nodes run on: take off them what was loaded
                unload_all(loaded)
            raise

    def rollout(
        self,
        plan: Plan,
        warehouse: str | Path | None,
        flush_timeout_s: float | None = None,
        force: bool = False,
    ) -> RolloutResult:
        """Move to `plan` with pipeline-flush migration: load the new partition models on
        every node while the old ones serve, pause intake, flush, switch, resume, unload the
        old models. A failure before the switch unloads what was loaded and keeps the old
        plan serving; the result says why. A plan whose SLO, less the reply margin the
        router measures now, is shorter than its fastest pipeline is refused before
        anything is loaded (every request would be dropped or refused); `force` rolls it
        out anyway (logged)."""
        tag = generation_tag(self.owner, self.generation + 1)
        names = lambda p: ",".join(m.name for m in p.models)  # noqa: E731
        label_from = f"{self.plan.strategy}:{names(self.plan)}@gen{self.generation}"
        label_to = f"{plan.strategy}:{names(plan)}@gen{self.generation + 1}"
        t0 = time.perf_counter()
        why = _cannot_replace(self.plan, plan)
        no_room = slo_room_warnings(plan, self.core.runtime.reply_margin_us)
        if no_room and force:
            log.warning("rolled out by force although %s", "; ".join(map(str, no_room)))
        elif no_room:
            why = why or (
                "; ".join(w.refusal() for w in no_room) + " (--force rolls it out anyway)"
            )
        if why:  # before anything is cut or loaded
            return RolloutResult("refused", why, label_from, label_to, 0.0, 0, 0, 0)
        loaded: list[tuple[RepositoryAPI, str]] = []
        started: list[TritonNode] = []
        parts: dict[str, PartitionFile] = {}
        opt = self.options
        try:
            topo, lay, parts = prepare(plan, warehouse, self.workspace, tag, isolated=True)
            served = {io.name: io for io in self.ios}
            ios = model_io(topo, lay, parts)
            for io in ios:
                if io != served[io.name]:
                    raise PoolpipeError(f"{io.name}: the new plan's tensors differ")
            topo = _with_inputs(topo, plan, ios)
            if self.local is not None:
                started = self.local.ensure(lay)
            nodes, inventory, topo = _attach(
                topo, lay, self._inventory_now(), self.local, self.workspace, opt.key
            )
            load_layout(lay, parts, nodes, opt.max_batch, loaded)
            self.fence(nodes)
            warm(lay, nodes, parts)
            cal = calibrate(
                topo,
                lay,
                nodes,
                parts,
                known=self.calibration,
                bandwidth_gbps=plan.cluster.bandwidth_gbps,
            )
            live = with_latencies(topo, cal)
            prepare_s = time.perf_counter() - t0
            self.core.use_http(_http_addresses(nodes))
            _watch(self.core, nodes)
            res = self.core.switch(_served(live, lay, nodes, ios, opt), flush_timeout_s)
        except Exception as exc:
            unload_all(loaded)
            if self.local is not None:
                self.local.stop(started)
            remove_files(parts.values())  # the new generation's cuts
            return RolloutResult(
                "rolled back", str(exc), label_from, label_to, time.perf_counter() - t0, 0, 0, 0
            )
        recorded = plan_applications(plan.meta)[1]
        if recorded:  # the new plan's budgets for the application requests that come now
            self.core.use_app_budgets({a: r["budgets_us"] for a, r in recorded.items()})

        old, old_nodes, old_parts = self.layout, self.nodes, self.parts
        self.plan, self.topo, self.layout, self.parts = plan, topo, lay, parts
        self.nodes, self.inventory = nodes, inventory
        self.generation += 1
        # the node removes an unloaded model's files
        unload_all((old_nodes[p.node], p.partition) for p in old.placements)
        remove_files(old_parts.values())  # and this workspace the old generation's cuts
        if self.local is not None:  # nodes the new plan does not use
            self.local.stop([n for name, n in self.local.nodes.items() if name not in self.nodes])
        return RolloutResult(
            "done",
            "",
            label_from,
            label_to,
            prepare_s,
            res.downtime_us / 1e3,
            res.held,
            res.failed,
        )

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.plan.models]

    def reshard(self, inventory: Inventory) -> None:
        """Make `inventory` (this router's new shard of a router tier: nodes adopted from a
        router gone, or fewer, handed back) what the next rollout places on. That rollout
        fences the router gone off the nodes it adopts (fence)."""
        names = {n.name for n in inventory.nodes}
        self.operator_down = (self.operator_down & names) | inventory.down
        self.inventory = replace(inventory, down=self.operator_down)

    def join(self, node: dict[str, Any], server: dict[str, Any] | None = None) -> dict[str, Any]:
        """A node that joins (an autoscaler's, an operator's): `node` as an inventory's
        [[nodes]] table, `server` its [[servers]] table where the inventory lacks it. It
        must answer with this router's key; the next rollout may place on it (the next
        re-plan plans for it). Nothing changes where it is refused."""
        inv = self._own_inventory("join")
        grown = inv.joined(node, server)
        new = grown.nodes[-1]
        if not RemoteNode.of(new.each_gpu()[0], self.options.key).live():
            raise PoolpipeError(
                f"node {new.name} does not answer at {new.grpc}: start it there first "
                "(poolpipe node), with this router's token"
            )
        self.inventory = replace(grown, down=self.operator_down)
        log.warning("node %s (%s, %s) joined the inventory", new.name, new.device, new.grpc)
        return {"node": new.name, "device": new.device, "nodes": len(grown.nodes)}

    def release(self, name: str) -> dict[str, Any]:
        """Node `name` leaves the inventory (given back): refused while the plan served
        places a partition on it (roll out a plan without it first: the load-replan flow's
        cost objective, `poolpipe advise`), so nothing it runs is lost; no batch is on it
        then (the flush migration ended its last ones)."""
        inv = self._own_inventory("release")
        serving = {self.nodes[p.node].name for p in self.layout.placements}
        if name in serving:
            raise PoolpipeError(
                f"node {name} runs the plan served (partitions on it): roll out a plan without "
                "it first (poolpipe advise names the nodes a plan for the load leaves idle)"
            )
        self.inventory = replace(inv.released(name), down=self.operator_down - {name})
        self.operator_down = self.operator_down - {name}
        log.warning("node %s released from the inventory", name)
        return {"node": name, "nodes": len(self.inventory.nodes)}

    def _own_inventory(self, what: str) -> Inventory:
        if self.inventory is None or self.local is not None:
            raise PoolpipeError(
                f"cannot {what} a node: this router starts its own nodes (serve --nodes "
                "INVENTORY serves an inventory nodes join and leave)"
            )
        return self.inventory

    def fence(self, nodes: dict[str, RepositoryAPI]) -> list[str]:
        """fence_off on this router's nodes, once its partitions are loaded there."""
        out = fence_off(nodes, self.model_names, self.owner)
        self.fenced += out
        return out

    def take_stage_factors(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the plan served, measured time of the stage calls since the last
        call that found their vGPU idle, over the pool's latency as served
        (RouterCore.take_stage_factors)."""
        return self.core.take_stage_factors()

    def take_answer_delays(self) -> tuple[tuple[float, ...], ...]:
        """Per pool (a pipeline's last), how much later than reserved its batches were
        answered beyond their stages' own time, since the last call
        (RouterCore.take_answer_delays)."""
        return self.core.take_answer_delays()

    def restart_node(self, name: str) -> None:
        """Start a stopped or crashed local node again on its ports and load its partition
        models (the operator restarts remote ones); the router notices it answering and
        puts its vGPUs back in service."""
        node = self.nodes[name]
        if not isinstance(node, TritonNode):
            raise PoolpipeError(f"node {name} runs elsewhere ({node.grpc_url}); restart it there")
        self._restart(node, name, only_if_dead=False)

    def _restart_dead(self, name: str) -> None:
        """The supervisor's restart: only if the node is still down (restart_node may have
        been quicker)."""
        node = self.nodes.get(name)
        if isinstance(node, TritonNode):
            self._restart(node, name, only_if_dead=True)

    def _restart(self, node: TritonNode, name: str, only_if_dead: bool) -> None:
        with self._restarting:  # one restart of a node at a time
            if only_if_dead and node.alive:
                return
            node.stop()
            node.start()
            self._refill(name)

    @property
    def node_restarts(self) -> dict[str, int]:
        """Restarts of nodes that exited on their own, per node (supervised deployments)."""
        return dict(self.supervisor.restarts) if self.supervisor is not None else {}

    def _refill(self, name: str) -> None:
        """Load node `name`'s partition models of the plan being served onto it (uploaded)
        and warm them: a node back from a crash or restart answers without them."""
        only = Layout(
            tuple(s for s in self.layout.nodes if s.name == name),
            self.layout.placements,
            self.layout.vgpu_node,
            self.layout.pool_partition,
            self.layout.partition_latency_us,
        )
        load_layout(only, self.parts, self.nodes, self.options.max_batch, loaded=[])
        warm(self.layout, self.nodes, self.parts, only=name)

    def _refill_url(self, url: str) -> None:
        """The router's watch found the node at `url` answering without its models."""
        name = next((n for n, node in self.nodes.items() if node.node_id == url), None)
        if name is None or isinstance(self.nodes[name], TritonNode):
            return  # local nodes come back through restart_node, which loads them
        try:
            held = foreign_partitions([self.nodes[name]], self.model_names, self.owner)
            if held:  # fenced: another router of the tier has adopted it
                log.warning(
                    "node %s now holds router %s's models: this router leaves it alone",
                    name,
                    ", ".join(sorted({other for _, other, _ in held})),
                )
                return
            self._refill(name)
            log.info("node %s answered again without its models: loaded them", name)
        except Exception as exc:  # the watch tries again at its next look
            log.warning("node %s is back but its models did not load: %s", name, exc)

    def down(self) -> None:
        with signals_held():  # stopping half the nodes would leave the rest running
            self._down()

    def _down(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.frontend is not None:
            self.frontend.stop()  # clients are answered no more
            self.frontend = None
        self.core.stop()
        log.info("router stopped")
        if self.local is not None:
            self.local.stop()
        else:  # attached nodes keep running: take this deployment's models off them
            unload_all((self.nodes[p.node], p.partition) for p in self.layout.placements)
            log.info("unloaded this router's models from %d attached node(s)", len(self.nodes))

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def generation_tag(owner: str | None, generation: int) -> str:
    """What ends the names of a generation's partition models: "g3", or "r1-g3" for router
    r1 of a router tier."""
    return f"g{generation}" if owner is None else f"{owner}-g{generation}"


def owned_by(partition: str) -> str | None:
    """The router whose partition model this is (generation_tag); None: untagged."""
    tag = partition.rpartition("__")[2]
    owner, sep, gen = tag.rpartition("-g")
    return owner if sep and gen.isdigit() else None


def foreign_partitions(
    nodes: Iterable[RepositoryAPI], models: list[str], owner: str | None
) -> list[tuple[RepositoryAPI, str, str]]:
    """Partition models of `models` on the nodes that another router of the tier loaded:
    (node, that router, model) of each."""
    prefixes = tuple(f"{m}__b" for m in models)
    return [
        (node, other, model)
        for node in nodes
        for model in node.models()
        if model.startswith(prefixes) and (other := owned_by(model)) is not None and other != owner
    ]


def fence_off(nodes: dict[str, RepositoryAPI], models: list[str], owner: str | None) -> list[str]:
    """Unload from `nodes` (router `owner`'s, its own partition models of `models` just
    loaded there: its claim) those that another router of the tier left: that router's
    calls fail from now on (Triton checks the model's name on every call), and should it
    still run, its reload of "its" node finds the claim and leaves the node alone
    (Deployment._refill_url). Only then does `owner` drive the node. Returns "NODE: router
    OWNER's MODEL" of each, also logged."""
    if owner is None:
        return []
    out = []
    for node, other, model in foreign_partitions(nodes.values(), models, owner):
        node.unload(model)
        out.append(f"{node.name}: router {other}'s {model}")
    if out:
        log.warning("fenced off the routers gone: unloaded %s", ", ".join(out))
    return out


def _unload_left_behind(
    nodes: dict[str, RepositoryAPI], models: list[str], owner: str | None = None
) -> list[str]:
    """Unload the partitions of `models` that the nodes already have (an earlier router of
    these models died or was killed without taking them off): "NODE: MODEL" of each, also
    logged. A router of a tier (`owner`) leaves another router's to Deployment.fence, once
    its own are loaded. Listing a node's models needs its key: a token that does not
    match fails here, before anything is loaded."""
    prefixes = tuple(f"{m}__b" for m in models)
    out = []
    for node in nodes.values():
        for model in node.models():
            other = owned_by(model)
            if owner is not None and other is not None and other != owner:
                continue
            if model.startswith(prefixes):
                node.unload(model)
                out.append(f"{node.name}: {model}")
    if out:
        log.warning("unloaded what an earlier router left on the nodes: %s", ", ".join(out))
    return out


def _cannot_replace(served: Plan, new: Plan) -> str:
    """Why `new` cannot replace `served` on a running router ('' if it can): it must serve
    every model served now, and no other."""
    now, then = {m.name for m in served.models}, {m.name for m in new.models}
    if now - then:
        return (
            f"the new plan does not serve {', '.join(sorted(now - then))}, which this router "
            "serves: a rollout keeps every served model (plan them all, or start a router "
            "for the models that stay)"
        )
    if then - now:
        return (
            f"the new plan serves {', '.join(sorted(then - now))}, which this router does "
            "not: start a new router for new models (poolpipe serve)"
        )
    apps_now, apps_then = (
        [replace(a, weight=1.0) for a in plan_applications(p.meta)[0]] for p in (served, new)
    )
    if apps_now != apps_then:
        return (
            "the new plan's applications differ from those this router serves (their "
            "graphs or SLOs): a rollout may change their mix, budgets and pipelines only; "
            "start a new router for other applications"
        )
    return ""


def _with_inputs(topo: Topology, plan: Plan, ios: list[ModelIO]) -> Topology:
    """`topo` with each pipeline's first partition receiving its requests' inputs over its
    server's downlink at the plan's NIC bandwidth (the router sends them there: the data
    plane reserves the link for them, calibration times the compute apart from them)."""
    return with_inputs(topo, input_bytes(ios), plan.cluster.bandwidth_gbps)


def _attach(
    topo: Topology,
    lay: Layout,
    inventory: Inventory | None,
    local: LocalNodes | None,
    workspace: Path,
    key: str | None,
) -> tuple[dict[str, RepositoryAPI], Inventory, Topology]:
    """The nodes behind the layout: those of `inventory`, or `local`'s (started for the
    layout first, their inventory written to the workspace). One attach path either way.
    Beside them the inventory, and `topo` on the inventory's servers (topology.on_servers:
    the NICs the router reserves are those of the servers the nodes are on)."""
    if local is not None:
        local.ensure(lay)
        inventory = local.inventory()
        (workspace / "inventory.toml").write_text(inventory.to_toml())
        nodes, servers = attach(lay, inventory, dict(local.nodes), key)
    else:
        assert inventory is not None
        nodes, servers = attach(lay, inventory, key=key)
    return nodes, inventory, on_servers(topo, servers)


def resolve_answers(answers: str, urls: Iterable[str]) -> str | None:
    """The router's inbox for chains' answers (Deployment.up's `chain_answers`) for nodes
    at these gRPC addresses: "HOST:PORT", or None for "back"."""
    if answers == "back":
        return None
    if answers == "auto":
        return "127.0.0.1:0" if _all_loopback(urls) else "0.0.0.0:0"
    parse_address(answers)  # a clear error for a bad one, before anything is served
    return answers


def resolve_transport(transport: str, urls: Iterable[str]) -> str:
    """The transport for nodes at these gRPC addresses ("host:port"): "auto" is "router"
    when all of them are on loopback (the router's own host: feature maps cross no NIC
    either way, and a hop from the router is the cheaper path), else "chain"."""
    if transport != "auto":
        if transport not in TRANSPORTS:
            choices = ", ".join(TRANSPORT_CHOICES)
            raise PoolpipeError(f"unknown transport {transport!r}; choose {choices}")
        return transport
    return "router" if _all_loopback(urls) else "chain"


def _all_loopback(urls: Iterable[str]) -> bool:
    """Whether every one of these gRPC addresses ("host:port") is on loopback."""
    return all(is_loopback(u.rpartition(":")[0] or u) for u in urls)
