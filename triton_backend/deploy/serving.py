"""A serving process: a deployment of one plan plus what operations need around it —
per-minute statistics into the warehouse, Prometheus metrics beside Triton's own, and the
`poolpipe_control` model through which other processes roll out plans and read figures."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from poolpipe.client.control import authorised, node_key
from poolpipe.domain.inventory import Inventory
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.planner.advise import IDLE_S, read_published, releasable_nodes
from poolpipe.runtime.envelope import EnvelopeConfig, EnvelopeEvent
from poolpipe.scheduler.messages import DROP_REASONS
from poolpipe.scheduler.topology import planned_utilisation
from poolpipe.store.warehouse import Warehouse, store_rows_durably, store_tables_durably
from triton_backend import REPLAN_GRACE_S
from triton_backend.deploy.deployment import ROLLOUT_RESULTS, Deployment, RolloutResult
from triton_backend.deploy.envelope import LoadWatch
from triton_backend.deploy.peers import TierMember
from triton_backend.env import free_ports, signals_held
from triton_backend.node.triton import refuse_taken_ports
from triton_backend.router.core import RouterCore
from triton_backend.router.readiness import DRAINING, NOT_READY, READY, ReadinessServer, WeightAgent

# How long the statistics and rollout writers wait for a warehouse another process holds
# before they spool their rows beside it (Warehouse.open writes them in later).
STATS_WAIT_S = 2.0
# After the last request of a draining router is answered, this long for the answer to
# leave its Triton before it stops (s; the door's egress p99 is a few ms).
DRAIN_EGRESS_S = 0.1

log = logging.getLogger("poolpipe.serve")


class RouterCollector:
    """Prometheus collector reading the router's counters at scrape time (no hot-path cost)."""

    def __init__(self, server: ServingProcess):
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        core = self.server.deployment.core
        req = CounterMetricFamily(
            "poolpipe_requests", "Requests by model and outcome", labels=["model", "outcome"]
        )
        for name, s in core.stats.items():
            for outcome, n in s.counts().items():
                req.add_metric([name, outcome], n)
        yield req
        yield GaugeMetricFamily(
            "poolpipe_in_flight", "Requests queued or running", value=core.in_flight()
        )
        busy = CounterMetricFamily(
            "poolpipe_pool_busy_seconds", "Stage time per pool", labels=["model", "pool", "gpu"]
        )
        for p in core.runtime.topo.pools:
            name = core.runtime.topo.models[p.model].name
            busy.add_metric([name, str(p.id), p.gpu], core.runtime.pool_busy_us()[p.id] / 1e6)
        yield busy
        yield GaugeMetricFamily(
            "poolpipe_plan_generation", "Rollouts so far", value=self.server.deployment.generation
        )
        live = GaugeMetricFamily(
            "poolpipe_model_ready",
            "1 while some pipeline of the model has a live node in every pool (readiness: "
            "Triton reports its loaded models ready for good)",
            labels=["model"],
        )
        try:
            without = core.runtime.without_path()
        except RuntimeError:  # changed under the scrape: the next one reads it
            without = set()
        for i, m in enumerate(core.runtime.topo.models):
            live.add_metric([m.name], 0.0 if i in without else 1.0)
        yield live
        yield GaugeMetricFamily(
            "poolpipe_reply_margin_seconds",
            "Held back from every deadline for the answer's way out (measured)",
            value=core.runtime.reply_margin_us / 1e6,
        )
        state = GaugeMetricFamily(
            "poolpipe_node_state",
            "1 for each node's state now (in service, down, drained)",
            labels=["node", "address", "state"],
        )
        idle = GaugeMetricFamily(
            "poolpipe_node_idle_seconds",
            "How long each node has run no stage (packed batches leave the highest idle at a "
            "low load: one idle for long can be drained and released)",
            labels=["node", "address"],
        )
        nodes = core.node_states()  # (read once a scrape: the runtime's loop answers it)
        for node in nodes:
            for st in ("in service", "down", "drained"):
                labels = [str(node["node"]), str(node["address"]), st]
                state.add_metric(labels, float(node["state"] == st))
            idle_s = node["idle_s"]
            assert isinstance(idle_s, float)
            idle.add_metric([str(node["node"]), str(node["address"])], idle_s)
        yield state
        yield idle
        changes = CounterMetricFamily(
            "poolpipe_node_changes",
            "Changes of nodes' states, by the state entered",
            labels=["state"],
        )
        for st, k in sorted(core.node_changes.items()):
            changes.add_metric([st], k)
        yield changes
        stamps = CounterMetricFamily(
            "poolpipe_arrival_stamps",
            "Load balancers' arrival stamps by what became of them (used; ignored: ahead of "
            "the router's clock by more than the bound, stale, malformed)",
            labels=["outcome"],
        )
        for outcome, k in sorted(core.stamps.counts.items()):
            stamps.add_metric([outcome], k)
        yield stamps
        deadlines = CounterMetricFamily(
            "poolpipe_client_deadlines",
            "Requests that carried their client's deadline (gRPC's, through the balancer), "
            "by whether it ended their SLO (shortened) or left it as it was (kept)",
            labels=["outcome"],
        )
        for outcome, k in sorted(core.client_deadlines.items()):
            deadlines.add_metric([outcome], k)
        yield deadlines
        nonfinite = CounterMetricFamily(
            "poolpipe_nonfinite_inputs",
            "Requests whose inputs held a NaN or an infinite value (served as sent), by model",
            labels=["model"],
        )
        for name in core.stats:
            nonfinite.add_metric([name], core.nonfinite[name])
        yield nonfinite
        rollouts = CounterMetricFamily(
            "poolpipe_rollouts",
            "Rollouts by result (done, rolled back, refused)",
            labels=["result"],
        )
        for st, k in sorted(self.server.rollouts.items()):
            rollouts.add_metric([st], k)
        yield rollouts
        yield from self._plan_figures(core)
        yield from self._gpu_figures(nodes)
        yield from self._load_figures()
        yield from self._writer_figures()
        yield from self._trace_figures(core)

    def _plan_figures(self, core):
        """What the plan served says, beside what is observed: per model its planned and
        deliverable req/s, per pool its vGPUs and its planned utilisation at the deliverable
        load (what recording rules compare the busy seconds with); drops by reason; the
        reply margin's ceiling."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        drops = CounterMetricFamily(
            "poolpipe_drops", "Requests dropped, by the data plane's reason", labels=["reason"]
        )
        counted = core.runtime.drop_reasons
        for reason in sorted({*DROP_REASONS, *counted}):
            drops.add_metric([reason], counted.get(reason, 0))
        yield drops
        yield GaugeMetricFamily(
            "poolpipe_reply_margin_ceiling_seconds",
            "The most the reply margin may grow to (at it, answers are slower than it allows)",
            value=core.margin.ceiling_us / 1e6,
        )
        topo = core.runtime.topo
        plan = {m.name: m for m in self.server.deployment.plan.models}
        planned = GaugeMetricFamily(
            "poolpipe_model_planned_rps", "The plan's fluid throughput per model", labels=["model"]
        )
        deliverable = GaugeMetricFamily(
            "poolpipe_model_deliverable_rps",
            "What the plan states it serves at 99% on time per model (its fluid throughput "
            "where it states none)",
            labels=["model"],
        )
        loads = []
        for m in topo.models:
            stated = plan[m.name].deliverable if m.name in plan else None
            load = m.throughput if stated is None else float(stated)
            loads.append(load)
            planned.add_metric([m.name], m.throughput)
            deliverable.add_metric([m.name], load)
        yield planned
        yield deliverable
        vgpus = GaugeMetricFamily(
            "poolpipe_pool_vgpus", "vGPUs of each pool", labels=["model", "pool", "gpu"]
        )
        util = GaugeMetricFamily(
            "poolpipe_pool_planned_utilisation",
            "Each pool's planned busy fraction per vGPU at its model's deliverable load",
            labels=["model", "pool", "gpu"],
        )
        for p, u in zip(topo.pools, planned_utilisation(topo, loads), strict=True):
            labels = [topo.models[p.model].name, str(p.id), p.gpu]
            vgpus.add_metric(labels, len(p.vgpus))
            util.add_metric(labels, u)
        yield vgpus
        yield util

    def _gpu_figures(self, nodes: list[dict[str, object]]):
        """What an autoscaler acts on: GPUs per type the plan served uses; those the load
        needs by the last advice (with its headroom and when it was given); of the router's
        `nodes` (RouterCore.node_states), those that can be released now
        (planner/advise.py's releasable_nodes)."""
        from prometheus_client.core import GaugeMetricFamily

        in_use = GaugeMetricFamily(
            "poolpipe_gpus_in_use", "GPUs per type the plan served uses", labels=["gpu"]
        )
        for gpu, n in sorted(self.server.deployment.plan.gpus_used().items()):
            in_use.add_metric([gpu], n)
        yield in_use
        a = self.server.advice
        if a is not None and a["needed"] is not None:
            needed = GaugeMetricFamily(
                "poolpipe_gpus_needed",
                "GPUs per type that serve the observed load x (1 + headroom), sized on what "
                "they deliver, by the last advice (the load-replan flow; poolpipe advise "
                "--publish)",
                labels=["gpu"],
            )
            for gpu in sorted(set(a["needed"]) | set(a["in_use"])):
                needed.add_metric([gpu], a["needed"].get(gpu, 0))
            yield needed
            yield GaugeMetricFamily(
                "poolpipe_gpus_needed_headroom",
                "The share above the observed load the last advice sized GPUs for",
                value=a["headroom"],
            )
        if a is not None:
            yield GaugeMetricFamily(
                "poolpipe_advice_timestamp_seconds",
                "When the router was last told what the load needs (Unix time)",
                value=a["at_s"],
            )
        releasable = GaugeMetricFamily(
            "poolpipe_node_releasable",
            f"1 for each node that can be released now: drained with no batch on it, or in "
            f"service with none and no stage for {IDLE_S:g} s (drain it, then release it)",
            labels=["node", "address", "action"],
        )
        for free in releasable_nodes(nodes, IDLE_S):
            releasable.add_metric([str(free["node"]), str(free["address"]), free["action"]], 1.0)
        yield releasable

    def _load_figures(self):
        """The load observed (envelope.LoadWatch): per model its arrival rate over each
        window and its share of the plan's envelope; the envelope's events by kind."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        watch = self.server.load
        fig = watch.figures()
        rate = GaugeMetricFamily(
            "poolpipe_arrival_rate",
            "Arrivals per second over a sliding window, by model",
            labels=["model", "window"],
        )
        share = GaugeMetricFamily(
            "poolpipe_load_share",
            f"Arrivals over the last {watch.config.short_s:g} s as a share of what the plan "
            "states it serves at 99% on time (its envelope)",
            labels=["model"],
        )
        for name, m in fig["models"].items():
            for window, r in m["req_s"].items():
                rate.add_metric([name, window], r)
            if m["share"] is not None:  # (a plan that states no deliverable req/s: none)
                share.add_metric([name], m["share"])
        yield rate
        yield share
        events = CounterMetricFamily(
            "poolpipe_envelope_events",
            "Times the load left the plan's envelope, by kind (above, below, mix)",
            labels=["kind"],
        )
        for kind, k in sorted(fig["events"].items()):
            events.add_metric([kind], k)
        yield events

    def _writer_figures(self):
        """The statistics writer: its interval, when it last wrote to the warehouse, and
        the windows it spooled beside a warehouse another process held."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily(
            "poolpipe_stats_interval_seconds",
            "How often the router writes its statistics to the warehouse",
            value=self.server.stats_interval_s,
        )
        yield GaugeMetricFamily(
            "poolpipe_stats_last_write_timestamp_seconds",
            "When the router's statistics last reached the warehouse (Unix time; its start "
            "until the first window)",
            value=self.server.stats_written_at,
        )
        spooled = CounterMetricFamily(
            "poolpipe_stats_spooled",
            "Statistics windows spooled beside a warehouse another process held (written "
            "in at its next open)",
        )
        spooled.add_metric([], self.server.stats_spooled)
        yield spooled

    def _trace_figures(self, core: RouterCore):
        """The requests' traces handed to the exporter, and those dropped because it was
        behind; none where the router does not trace."""
        from prometheus_client.core import CounterMetricFamily

        tracing = core.tracing
        if tracing is None:
            return
        traces = CounterMetricFamily(
            "poolpipe_traces",
            "Requests' traces by what became of them: sent to the exporter process, or "
            "dropped (the exporter was behind)",
            labels=["result"],
        )
        traces.add_metric(["sent"], tracing.sent)
        traces.add_metric(["dropped"], tracing.dropped)
        yield traces


class ServingProcess:
    def __init__(
        self,
        plan: Plan,
        warehouse: str | Path | None,
        workspace: Path,
        *,
        name: str = "local",
        plan_id: int | None = None,
        stats_interval_s: float = 60.0,
        metrics_port: int | None = None,
        ready_port: int | None = None,
        agent_port: int | None = None,
        stop_grace_s: float = 0.0,
        token: str | None = None,
        replan_on_failure: Callable[[str, str], dict] | None = None,
        replan_grace_s: float = REPLAN_GRACE_S,
        tier: tuple[Inventory, str] | None = None,
        adopt_after_s: float = 3.0,
        on_reshard: Callable[[str, str, str], dict] | None = None,
        envelope: EnvelopeConfig | None = None,
        on_load_event: Callable[[str, EnvelopeEvent], None] | None = None,
        **options: Any,
    ):
        """`token`: control commands must carry it (poolpipe.client.send_control(token=)),
        and the nodes' and the router's Triton management APIs expect the key derived from
        it; None: anyone who reaches the router may control it. `replan_on_failure`:
        called with the router's gRPC address and what happened whenever the set of nodes
        out of service has changed and stayed so for `replan_grace_s` (a node lost, or
        back), to re-plan (flows.replan.on_failure: the re-planning flow); returns its
        decision. None: only the nightly runs re-plan. `ready_port`: where a load
        balancer's health check asks whether this router serves (router/readiness.py; 0: a free
        port; None: not served). `agent_port`: where HAProxy's agent-check asks for this
        router's weight (WeightAgent: the percentage of its first plan's objective its
        nodes in service serve now; 0: a free port; None: not served). `stop_grace_s`: on
        close, how long the readiness check answers 404 (draining) while the router still
        serves, before it waits for the requests it has and stops (a balancer's checks send
        new ones elsewhere meanwhile, so that a planned stop fails no request). `tier`:
        (the inventory with its router tier, this router's name): it serves that router's
        shard (its partition models carry its name), waits at start-up until no live peer
        holds a node of it, and follows its peers (peers.TierMember): a peer that has not
        answered its readiness check for `adopt_after_s` (0: never adopt) is gone, and this
        router adopts its part of that peer's nodes, re-planned and rolled out by
        `on_reshard` (flows.replan.on_reshard), and hands them back when the peer answers again.
        `envelope`: when the observed load leaves the served plan's (envelope.LoadWatch);
        `on_load_event`: called with the router's gRPC address and each such event
        (flows.replan.load_event_emitter)."""
        self.warehouse = warehouse
        self.token = token
        self.name = name
        self.plan_id = plan_id
        self.stats_interval_s = stats_interval_s
        self._lock = threading.Lock()  # one rollout at a time
        # the router's own HTTP ports, on the address its clients reach it at: a port taken
        # is named before anything starts
        self.metrics_address = str(options.get("listen", "127.0.0.1"))
        refuse_taken_ports(
            "the router",
            self.metrics_address,
            {
                "metrics port": metrics_port or 0,
                "readiness port": ready_port or 0,
                "weight agent port": agent_port or 0,
            },
        )
        self._closing = False
        self.ready: ReadinessServer | None = None
        self.agent: WeightAgent | None = None
        self.stop_grace_s = stop_grace_s
        self._stop = threading.Event()
        self.member: TierMember | None = None
        self.deployment: Deployment = None  # type: ignore[assignment]  # (set just below)
        if tier is not None:
            inv, me = tier
            key = None if token is None else node_key(token)
            self.member = TierMember(inv, me, Path(workspace), key, adopt_after_s, on_reshard)
            options.setdefault("inventory", inv.shard(me))
        try:
            if ready_port is not None:  # before the nodes: a peer may wait on its answer
                self.ready = ReadinessServer(self.metrics_address, ready_port, self.readiness)
            if self.member is not None:
                self.member.wait_for_shard([m.name for m in plan.models], self._stop)
            self.deployment = Deployment.up(
                plan,
                warehouse,
                workspace,
                control=self.control,
                token=token,
                owner=tier[1] if tier is not None else None,
                **options,
            )
        except BaseException:
            if self.ready is not None:
                self.ready.close()
            raise
        # the mix and what the first plan serves of it, on its nodes as calibrated
        names, weights = [m.name for m in plan.models], [m.weight for m in plan.models]
        self._mix = (names, weights, self._live_objective(names, weights))
        self._window_start = datetime.now()
        self.started = datetime.now()
        self.stats_written_at = time.time()  # (the start, until the first window)
        self.stats_spooled = 0
        # by result, each from 0 (a series from the first scrape)
        self.rollouts: Counter[str] = Counter(dict.fromkeys(ROLLOUT_RESULTS, 0))
        # the last windows flushed: (start, seconds, {model: its row}), newest last
        self.recent: deque[tuple[datetime, float, dict[str, dict]]] = deque(maxlen=5)
        self._unservable_said = -1e18  # when the log last said the plan cannot serve
        self._nonfinite_said: dict[str, int] = {}  # requests with NaN inputs, as last logged
        self._stats_thread = threading.Thread(target=self._stats_loop, daemon=True)
        self._stats_thread.start()
        self.load = LoadWatch(
            lambda: self.deployment.core.stats,
            lambda: self.deployment.plan,
            envelope,
            on_event=None
            if on_load_event is None
            else lambda e: on_load_event(self.deployment.grpc_url, e),
        )
        self.load.start()
        self.replans: list[dict] = []  # decisions of the re-plans after failures
        # the last advice given (control op "advice": the load-replan flow, poolpipe advise
        # --publish): GPUs per type the load needs, exported beside those in use
        self.advice: dict[str, Any] | None = None
        self.replan_on_failure, self.replan_grace_s = replan_on_failure, replan_grace_s
        if replan_on_failure is not None:
            self._failure_thread = threading.Thread(target=self._failure_loop, daemon=True)
            self._failure_thread.start()
        self.metrics_port = None
        try:
            if metrics_port is not None:
                from prometheus_client import ProcessCollector, start_http_server
                from prometheus_client.registry import CollectorRegistry

                registry = CollectorRegistry()
                registry.register(RouterCollector(self))
                # the router process's CPU, memory and open files (process_*)
                ProcessCollector(registry=registry)
                self.metrics_port = metrics_port or free_ports(1)[0]
                start_http_server(self.metrics_port, addr=self.metrics_address, registry=registry)
            if agent_port is not None:
                self.agent = WeightAgent(self.metrics_address, agent_port, self.weight_percent)
            if self.member is not None and adopt_after_s > 0:
                self._tier_thread = threading.Thread(
                    target=self.member.follow,
                    args=(self.deployment, self._lock, self._stop),
                    name="poolpipe-tier",
                    daemon=True,
                )
                self._tier_thread.start()
        except BaseException:
            self.close()
            raise

    def readiness(self) -> tuple[str, str, dict]:
        """Whether a load balancer should send this router requests: not while it stops
        (draining: it still serves what it has), nor while its Triton is not running or a
        model of its plan has no live path (its requests would fail here while another
        router may serve them)."""
        dep = self.deployment
        if dep is None:
            waiting = self.member.waiting if self.member is not None else ""
            return NOT_READY, f"starting{': ' + waiting if waiting else ''}", {}
        more = {"deployment": self.name, "plan_id": self.plan_id, "generation": dep.generation}
        if self._closing:
            return DRAINING, "the router is stopping: it serves only what it has", more
        if dep.frontend is None or not dep.frontend.node.alive:
            return NOT_READY, "the router's Triton (its KServe v2 front end) is not running", more
        without = dep.core.models_without_path()
        if without:
            return NOT_READY, f"no live path for model(s) {', '.join(without)}", more
        refused = dep.core.models_unservable()
        if refused:
            return NOT_READY, unservable_reason(refused, dep.core.runtime.reply_margin_us), more
        return READY, "a live path for every model", more

    def weight_percent(self) -> str:
        """What this router's weight agent answers HAProxy: the objective its plan serves
        on the nodes in service now, as a percentage of its first plan's (200% once it
        has adopted as many GPUs again and re-planned; 0% with no live path)."""
        names, weights, first = self._mix
        now = self._live_objective(names, weights)
        return f"{max(0, round(100 * now / first)) if first > 0 else 100}%"

    def _live_objective(self, names: list[str], weights: list[float]) -> float:
        """The planner's objective (least req/s per weight) on the nodes in service now."""
        live = self.deployment.core.live_throughput()
        return min(live.get(n, 0.0) / w for n, w in zip(names, weights, strict=True))

    # ------------------------------------------------------------------ statistics

    def _stats_loop(self) -> None:
        while not self._stop.wait(self.stats_interval_s):
            with contextlib.suppress(Exception):
                self.flush_stats()
            with contextlib.suppress(Exception):
                self._say_unservable()
            with contextlib.suppress(Exception):
                self._say_nonfinite()

    def _say_nonfinite(self) -> None:
        """A log line with each statistics window in which requests brought NaN or infinite
        input values (served as sent: a model's answer to them is the client's business,
        but an operator sees a client sending them)."""
        dep = self.deployment
        if dep is None:
            return
        now = dict(dep.core.nonfinite)
        new = {m: k - self._nonfinite_said.get(m, 0) for m, k in now.items()}
        self._nonfinite_said = now
        if any(new.values()):
            log.warning(
                "requests with NaN or infinite input values (served as sent): %s",
                ", ".join(f"{m} {k}" for m, k in sorted(new.items()) if k),
            )

    def _say_unservable(self) -> None:
        """A log line a minute at most (with each statistics window) while the plan served
        refuses every request of a model (rolled out by force, or a reply margin grown
        since)."""
        dep = self.deployment
        now = time.monotonic()
        if dep is None or now - self._unservable_said < UNSERVABLE_EVERY_S:
            return
        refused = dep.core.models_unservable()
        if refused:
            log.warning("%s", unservable_reason(refused, dep.core.runtime.reply_margin_us))
            self._unservable_said = now

    def flush_stats(self) -> int:
        """Write the window since the last flush to the warehouse; returns rows written."""
        core: RouterCore = self.deployment.core
        start, now = self._window_start, datetime.now()
        window = core.take_window()
        self._window_start = now
        seconds = (now - start).total_seconds()
        base = {
            "minute": start.replace(microsecond=0),
            "seconds": seconds,
            "deployment": self.name,
            "plan_id": self.plan_id,
        }
        measured = max(0.0, core.runtime.reply_margin_us - core.margin.floor_us)  # beyond its floor
        overhead = self.deployment.call_overhead_us()
        margin = {
            "reply_measured_ms": measured / 1e3,
            "call_overhead_ms": None if overhead is None else overhead / 1e3,
        }
        rows = [{**base, **asdict(m), **margin} for m in window.models]
        busy = [{**base, **asdict(p)} for p in window.pools]
        self.recent.append((start, seconds, {m.model: asdict(m) for m in window.models}))

        # another process may hold the warehouse: wait a little, else spool (nothing lost)
        if store_tables_durably(
            self.warehouse, {"serving_stats": rows, "serving_pool_busy": busy}, STATS_WAIT_S
        ):
            self.stats_written_at = time.time()
        else:
            self.stats_spooled += 1
        return len(rows) + len(busy)

    # ------------------------------------------------------------------ failures

    def _failure_loop(self) -> None:
        """Re-plan when the nodes out of service differ from those the serving plan was
        last planned around and have stayed so for the grace period."""
        planned_for: frozenset[str] = frozenset()
        seen, since = planned_for, time.monotonic()
        while not self._stop.wait(min(1.0, self.replan_grace_s / 4)):
            try:
                down = frozenset(d["node"] for d in self.deployment.down_nodes())
            except Exception:  # stopping
                continue
            now = time.monotonic()
            if down != seen:
                seen, since = down, now
            elif down != planned_for and now - since >= self.replan_grace_s:
                planned_for = down
                self.replan_after_failure(down)

    def replan_after_failure(self, down: frozenset[str]) -> dict:
        """Re-plan for the nodes in service now (`replan_on_failure`, in this process)."""
        what = f"node(s) {', '.join(sorted(down))} down" if down else "every node back"
        log.warning("%s: re-planning for the nodes in service", what)
        try:
            assert self.replan_on_failure is not None
            decision = self.replan_on_failure(self.deployment.grpc_url, what)
        except Exception as exc:  # the flow's own error, shown; serving goes on
            decision = {"trigger": what, "rolled_out": False, "why": f"failed: {exc}"}
        outcome = (
            f"rolled out plan {decision.get('plan_id')}"
            if decision.get("rolled_out")
            else decision.get("why") or decision.get("reason") or "not rolled out"
        )
        if "new_objective" in decision:
            outcome += (
                f" (objective of the serving plan on the nodes in service "
                f"{decision['serving_objective']:.4g}, of a plan for them "
                f"{decision['new_objective']:.4g})"
            )
        log.warning("re-planned after %s: %s", what, outcome)
        self.replans.append(decision)
        return decision

    # ------------------------------------------------------------------ control

    def control(self, cmd: dict) -> dict:
        if not authorised(cmd, self.token):
            return {
                "ok": False,
                "error": "refused: control commands need this router's token "
                "(--token-file, or $POOLPIPE_TOKEN_FILE where the command runs)",
            }
        op = cmd.get("op")
        if op == "rollout":
            return self.rollout_plan_id(int(cmd["plan_id"]), force=bool(cmd.get("force")))
        if op == "stats":
            s = self.deployment.core.stats
            return {
                "ok": True,
                "plan_id": self.plan_id,
                "generation": self.deployment.generation,
                "node_restarts": self.deployment.node_restarts,
                "models": {k: v.counts() for k, v in s.items()},
            }
        if op == "health":
            dep = self.deployment
            return {
                "ok": True,
                "plan_id": self.plan_id,
                "generation": dep.generation,
                "down": dep.down_nodes(),
                "live_throughput": dep.core.live_throughput(),
            }
        if op == "plan":
            return {
                "ok": True,
                "plan_id": self.plan_id,
                "plan": json.loads(self.deployment.plan.to_json()),
            }
        if op == "inventory":
            inv = self.deployment.inventory
            return {
                "ok": True,
                "deployment": self.name,
                "inventory": None if inv is None else inv.to_toml(),
            }
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "advice":
            got = read_published(cmd.get("advice") or {})
            self.advice = {**got, "at": datetime.now().isoformat(timespec="seconds"),
                           "at_s": time.time()}  # fmt: skip
            return {"ok": True}
        if op == "drain":
            timeout = cmd.get("timeout_s")
            return {"ok": True, **self.deployment.drain(str(cmd.get("node")), timeout)}
        if op == "undrain":
            self.deployment.undrain(str(cmd.get("node")))
            return {"ok": True, "node": cmd.get("node")}
        if op == "join":
            node, server = cmd.get("node"), cmd.get("server")
            if not isinstance(node, dict) or not isinstance(server, dict | None):
                raise PoolpipeError("join: give node (an inventory [[nodes]] table) as an object")
            return {"ok": True, **self.deployment.join(node, server)}
        if op == "release":
            return {"ok": True, **self.deployment.release(str(cmd.get("node")))}
        raise PoolpipeError(
            f"unknown control op {op!r}; use rollout, stats, health, plan, inventory, status, "
            "advice, drain, undrain, join or release"
        )

    def status(self) -> dict[str, Any]:
        """What an operator looks at: the plan and its generation, every node's state and
        since when, per model the req/s and attainment of the last windows and since the
        start, the reply margin, the ports."""
        dep, core = self.deployment, self.deployment.core
        windows = [
            {
                "start": start.isoformat(timespec="seconds"),
                "seconds": round(seconds, 1),
                "models": {
                    name: {
                        "req_s": round(r["arrivals"] / seconds, 2) if seconds > 0 else 0.0,
                        "arrivals": r["arrivals"],
                        "attainment": round(r["on_time"] / r["arrivals"], 4)
                        if r["arrivals"]
                        else None,
                        "dropped": r["dropped"],
                        "failed": r["failed"],
                        "refused": r["refused"],
                        "p99_ms": r["p99_ms"],
                    }
                    for name, r in rows.items()
                },
            }
            for start, seconds, rows in self.recent
        ]
        since_start = (datetime.now() - self.started).total_seconds()
        return {
            "deployment": self.name,
            "plan_id": self.plan_id,
            "generation": dep.generation,
            "started": self.started.isoformat(timespec="seconds"),
            "nodes": core.node_states(),
            "node_changes": dict(core.node_changes),
            "live_throughput": core.live_throughput(),
            "models": {
                name: {
                    **st.counts(),
                    "req_s": round(st.arrivals / since_start, 2) if since_start > 0 else 0.0,
                    "attainment": round(st.on_time / st.arrivals, 4) if st.arrivals else None,
                }
                for name, st in core.stats.items()
            },
            "windows": windows,
            "batch_members": core.batch_members(),
            "reply_margin_ms": round(core.runtime.reply_margin_us / 1e3, 3),
            "arrival_stamps": dict(core.stamps.counts),
            "client_deadlines": dict(core.client_deadlines),
            "nonfinite_inputs": dict(core.nonfinite),
            "load": self.load.figures(),
            "advice": self.advice,
            "tier": None
            if self.member is None
            else {
                "router": self.member.name,
                "shard": list(self.member.shard),
                "reshards": self.member.reshards[-5:],
            },
            "rollouts": dict(self.rollouts),
            "ports": {
                "http": dep.http_url,
                "grpc": dep.grpc_url,
                "metrics": f"{self.metrics_address}:{self.metrics_port}"
                if self.metrics_port
                else None,
                "triton_metrics": dep.triton_metrics_url,
                "ready": f"{self.metrics_address}:{self.ready.port}" if self.ready else None,
                "weight_agent": f"{self.metrics_address}:{self.agent.port}" if self.agent else None,
            },
        }

    def rollout_plan_id(self, plan_id: int, force: bool = False) -> dict:
        plan = _load_plan(self.warehouse, plan_id)  # waits out a busy warehouse
        result = self.rollout(plan, plan_id, force=force)
        return {"ok": result.status == "done", **asdict(result)}

    def rollout(self, plan: Plan, plan_id: int | None = None, force: bool = False) -> RolloutResult:
        with self._lock:
            self.flush_stats()  # the old plan's figures end here
            result = self.deployment.rollout(plan, self.warehouse, force=force)
            self.rollouts[result.status] += 1
            log.log(  # an operator's rollout done is news, not a warning
                logging.INFO if result.status == "done" else logging.WARNING,
                "rollout of plan %s: %s%s",
                plan_id if plan_id is not None else "(unstored)",
                result.status,
                f": {result.reason}" if result.reason else f" in {result.downtime_ms:.1f} ms",
            )
            if result.status == "done":
                self.plan_id = plan_id
                # the new plan's rates from its counts now: its watch would otherwise start
                # at its next tick, after requests sent the moment the rollout returned,
                # and count none of them
                self.load.sample(time.monotonic() * 1e6)
            row = {
                "rolled_at": datetime.now().replace(microsecond=0),
                "deployment": self.name,
                "plan_id": plan_id,
                **asdict(result),
            }
            # recorded as it happened, now or (warehouse busy) on the next open
            store_rows_durably(self.warehouse, "rollouts", [row], wait_s=STATS_WAIT_S)
            return result

    def close(self) -> None:
        with signals_held():  # the last statistics and every node, whatever arrives
            self._closing = True  # a balancer's next health check sends requests elsewhere
            self.deployment.core.stopping = True  # nodes leaving from now on are expected
            self._stop.set()
            if getattr(self, "load", None) is not None:
                self.load.stop()
            if self.ready is not None:
                if self.stop_grace_s > 0:
                    self._drain()
                self.ready.close()
            if self.agent is not None:
                self.agent.close()
            with contextlib.suppress(Exception):
                self.flush_stats()
                log.info("stopping: the last statistics are in the warehouse")
            self.deployment.down()

    def _drain(self) -> None:
        """Serve on for the grace (a balancer's checks see it draining and send nothing
        new), then until the requests it has are answered: each is within its SLO."""
        core = self.deployment.core
        log.info(
            "stopping: not ready for %.1f s (a load balancer sends elsewhere), then answering "
            "what is in flight",
            self.stop_grace_s,
        )
        time.sleep(self.stop_grace_s)
        longest_s = max(m.slo_us for m in core.runtime.topo.models) / 1e6
        deadline = time.monotonic() + longest_s + 1.0
        while core.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(DRAIN_EGRESS_S)  # the last answers on their way out of the door

    def __enter__(self) -> ServingProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


UNSERVABLE_EVERY_S = 60.0  # how often the log says that the plan refuses a model's requests


def unservable_reason(models: list[str], reply_margin_us: float) -> str:
    return (
        f"the plan cannot serve {', '.join(models)}: the SLO less the measured reply margin "
        f"({reply_margin_us / 1e3:.2f} ms) leaves no pipeline time to serve a request in, so "
        "every request is refused; roll out a plan that fits"
    )


def _load_plan(warehouse: str | Path | None, plan_id: int) -> Plan:
    from poolpipe.store.plan_inputs import check_plan

    with Warehouse.open(warehouse) as wh:
        return check_plan(wh, wh.load_plan(plan_id), f"plan {plan_id}", plan_id)
