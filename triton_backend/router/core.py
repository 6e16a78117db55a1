"""The router: poolpipe's serving runtime driven by the real clock, behind the router's own
Triton (the door: a Python-backend model per served model name that clients call over
KServe v2 HTTP/gRPC, see door/inbox.py), with an executor on the stage-worker nodes.

Every serving policy (deadlines, decisions, outcomes, failures and retries, node return,
recalibration, flush migration, the reply margin) is `poolpipe.runtime`'s; this module is
I/O and composition. `RouterCore` runs the runtime in one thread with its own event loop
(the runtime is a plain, single-threaded state machine); the door's socket is served on
that loop, so a request reaches the runtime without another thread hop. Its executor
(executor.py) composes a hop transport (transport.py: relay or chain) with a stage client
(stages.py, kserve_http.py: KServe v2 HTTP or gRPC). Every request is answered once: its
outputs, a drop (deadline cannot be met; the message starts with DROP_MARKER), or a stage
failure (FAIL_MARKER). docs/request-path.md follows a request through all of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import (
    ArrivalStamps,
    BadRequest,
    Clock,
    MarginMeter,
    ModelStats,
    RuntimeConfig,
    ServedPlan,
    ServingRuntime,
    SwitchResult,
    Window,
    capped_slo_us,
    default_flush_timeout_us,
)
from poolpipe.runtime.health import NODE_STATES
from triton_backend import TRANSPORTS
from triton_backend.node.watch import watch_node
from triton_backend.router.answers import AnswerInbox
from triton_backend.router.clocks import NodeClocks
from triton_backend.router.executor import NodeExecutor
from triton_backend.router.kserve_http import HttpFirstStages
from triton_backend.router.served import (
    BAD_REQUEST_MARKER,
    DROP_MARKER,
    FAIL_MARKER,
    REFUSED_MARKER,
    ClientRequest,
    ModelIO,
    Reply,
    RequestRow,
    RouterPlan,
    served_plan,
)
from triton_backend.router.stages import StageClient
from triton_backend.router.timers import precise_event_loop
from triton_backend.router.tracing import RequestTrace, TraceConfig, Tracing, wall_ns
from triton_backend.router.transport import ChainTransport, HopTransport, RelayTransport

__all__ = [
    "BAD_REQUEST_MARKER",
    "DROP_MARKER",
    "FAIL_MARKER",
    "REFUSED_MARKER",
    "LoopClock",
    "ModelIO",
    "RouterCore",
    "RouterPlan",
    "served_plan",
]

if TYPE_CHECKING:
    from triton_backend.router.apps import RouterApps

T = TypeVar("T")

log = logging.getLogger("poolpipe.router")

# Every node in service is checked this often (s): one restarted empty is refilled, one
# not ready leaves service, traffic or not (RuntimeConfig.node_sweep_every_us).
NODE_SWEEP_S = 1.0
# What a drain waits for its node's batches to end, at most (s).
DRAIN_TIMEOUT_S = 60.0


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The router loop's unhandled exceptions. gRPC's asyncio poller reports a closed
    channel's descriptor (EBADF) when a node check's channel closes as its node dies: no
    fault, not shown. Anything else is logged on one line, not as a traceback."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno == 9:
        return
    log.error("router loop: %s%s", context.get("message"), f" ({exc!r})" if exc else "")


class LoopClock(Clock):
    """The event loop's clock, in µs since the router started."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.t0_ns = time.monotonic_ns()  # CLOCK_MONOTONIC at this clock's 0

    def now(self) -> float:
        return (time.monotonic_ns() - self.t0_ns) / 1e3

    def at(self, monotonic_ns: int) -> float:
        """A CLOCK_MONOTONIC time (any process of this host) on this clock."""
        return (monotonic_ns - self.t0_ns) / 1e3

    def call_at(self, t_us: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(max(0.0, (t_us - self.now()) / 1e6), fn)


_frozen = [0]  # routers started in this process and not stopped
_frozen_lock = threading.Lock()  # routers start and stop from any thread


def _freeze_heap() -> None:
    """Keep what the process holds at a router's start out of the collector's full passes.
    A full collection walks every object of the heap (everything imported: several hundred
    thousand objects in a test process) with the GIL held, so the router's loop stands still
    meanwhile: 100-440 ms on a busy 2-core host, and requests that came in then were past
    their deadline when the loop had them. Frozen, those objects are not walked again; the
    ones the router makes while serving are, as before."""
    with _frozen_lock:
        if _frozen[0] == 0:
            gc.collect()
            gc.freeze()
        _frozen[0] += 1


def _thaw_heap() -> None:
    """The last router of the process stopped: its heap is collected as usual again."""
    with _frozen_lock:
        _frozen[0] -= 1
        if _frozen[0] == 0:
            gc.unfreeze()


async def _cancel_the_rest() -> None:
    """Cancel what still runs on the loop (stage calls of requests nobody will be answered
    now) and wait for it to end, so that a stopped router's tasks are not destroyed while
    pending (each of those was logged as an error: 276 after bench-serving's burst)."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


class RouterCore:
    """The runtime on the real clock, in its own thread and event loop; every method may be
    called from any thread."""

    def __init__(
        self,
        served: ServedPlan,
        stage_timeout_s: float = 30.0,
        margin: MarginMeter | None = None,
        recalibrate: bool = True,
        transport: str = "router",
        key: str | None = None,
        stages: Callable[[asyncio.AbstractEventLoop], StageClient] | None = None,
        node_sweep_s: float = NODE_SWEEP_S,
        stamps: ArrivalStamps | None = None,
        answers: str | None = None,
        tracing: TraceConfig | None = None,
    ):
        """`margin`: what the reply margin is learnt with (its floor until it has samples;
        the floor and ceiling equal for a fixed margin). `transport`: how a batch's hops
        travel ("router": each from here; "chain": node to node, signed with `key`).
        `stages`: makes the stage client on the router's loop (default: KServe v2 HTTP
        where a node's HTTP address is known (use_http), gRPC otherwise; chains over
        HTTP where known too, each node sending the next its feature map the same way).
        `node_sweep_s`: every node in service is checked this often (0: only after
        a call to it failed). `stamps`: how a load balancer's arrival stamps are taken (the
        clock bound and the longest wait; it counts what became of them). `answers`: where a
        chain's last node sends the model's outputs, the router's inbox address "HOST:PORT"
        (answers.py; None: back along the chain). `tracing`: where the requests' traces are
        exported and which (tracing.py); None: none are."""
        if transport not in TRANSPORTS:
            raise PoolpipeError(f"unknown transport {transport!r}; choose {', '.join(TRANSPORTS)}")
        self._loop = precise_event_loop()
        self.clock = LoopClock(self._loop)
        self.inbox: AnswerInbox | None = None
        self.feeds: dict[str, str] = {}  # node -> its feed (its watch address; node/feed.py)
        client = (
            stages(self._loop) if stages is not None else HttpFirstStages(self._loop, self.feeds)
        )
        hops: HopTransport
        # nodes' clocks against the router's, probed from when they are watched (clocks.py)
        self._closing = asyncio.Event()
        self.clocks = NodeClocks(self._loop, self._closing)
        if transport == "chain":
            self.inbox = AnswerInbox(answers) if answers is not None else None
            hops = ChainTransport(
                key,
                on_overhead=self._observe_path,
                inbox=self.inbox,
                http_of=getattr(client, "http_address", lambda node: None),
                feed_of=self.feeds.get,
                node_time=self._node_time,
            )
        else:
            hops = RelayTransport()
        self.stages = client
        self.executor = NodeExecutor(self._loop, hops, client, stage_timeout_s)
        self.margin = margin or MarginMeter()
        self.stamps = stamps or ArrivalStamps()
        # requests that carried their client's deadline, by whether it ended their SLO
        self.client_deadlines: Counter[str] = Counter({"shortened": 0, "kept": 0})
        # requests with a NaN or infinite input value, by model (served as sent: counted)
        self.nonfinite: Counter[str] = Counter()
        # set (from any thread) once the router is told to stop: nodes leaving are expected
        self.stopping = False
        self.runtime = ServingRuntime(
            served,
            self.clock,
            self.executor,
            RuntimeConfig(
                reply_margin_us=self.margin.margin_us,
                recalibrate=recalibrate,
                record_stage_factors=True,
                node_sweep_every_us=node_sweep_s * 1e6,
            ),
        )
        # every change of a node's state, newest last: (wall time, node, state, why)
        self.node_events: deque[tuple[datetime, str, str, str]] = deque(maxlen=500)
        # by state entered, each from 0 (a series from the first scrape)
        self.node_changes: Counter[str] = Counter(dict.fromkeys(NODE_STATES, 0))
        self.node_names: dict[str, str] = {}  # node address -> its name, for the log
        self.runtime.on_node_change(self._node_changed)
        self._tracing: Tracing | None = None  # kept while tracing is paused too
        if tracing is not None:
            t0_ns = self.clock.t0_ns
            self._tracing = Tracing(tracing, self._loop, self.clock.now, lambda: wall_ns() + t0_ns)
            self.executor.trace(self._tracing)
        self._watches: dict[str, asyncio.Task] = {}
        self.watching: set[str] = set()  # nodes whose watch connection is open now
        self._thread = threading.Thread(target=self._run_loop, name="poolpipe-router", daemon=True)
        self._frozen = False  # whether start() froze the heap (stop() thaws it)
        # the served plan's applications (triton_backend/router/apps.py), where it has some
        self.apps: RouterApps | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def use_http(self, addresses: Mapping[str, str]) -> None:
        """Call these nodes (gRPC address -> KServe v2 HTTP address) over HTTP."""
        if isinstance(self.stages, HttpFirstStages):
            self.stages.http.addresses.update(addresses)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RouterCore:
        _freeze_heap()
        self._frozen = True
        self._thread.start()
        if self._tracing is not None:
            self._tracing.start()
        return self

    def trace_requests(self, on: bool) -> None:
        """Trace the requests that come from now on, or not (a router started with
        tracing; its exporter runs on while paused). Requests already taken keep theirs."""
        tracing = self._tracing
        if tracing is None:
            raise PoolpipeError("this router was started without tracing (--trace-endpoint)")

        self._call(lambda: self.executor.trace(tracing if on else None))

    @property
    def tracing(self) -> Tracing | None:
        """The requests' notes while the router traces (the executor's); None otherwise."""
        return self.executor.tracing

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(_loop_exception)
        self._loop.run_forever()

    def stop(self) -> None:
        if self._tracing is not None:  # what is noted goes out before the loop stops
            self._tracing.close()
        if self._thread.is_alive():
            self._call(self._stop_watching)
            asyncio.run_coroutine_threadsafe(self.executor.close(), self._loop).result(10)
            if self.inbox is not None:
                asyncio.run_coroutine_threadsafe(self.inbox.close(), self._loop).result(10)
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if self._frozen:
            self._frozen = False
            _thaw_heap()

    def _call(self, fn: Callable[[], T], timeout_s: float | None = 10.0) -> T:
        """Run `fn` on the router's thread (where the runtime lives) and return its result."""
        if not self._thread.is_alive():
            return fn()
        fut: cf.Future = cf.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout_s)

    # ------------------------------------------------------------------ what is served

    @property
    def stats(self) -> dict[str, ModelStats]:
        """Each served model's counters, and each application's (its requests as wholes)
        where the plan has some."""
        apps = self.apps
        if apps is None:
            return self.runtime.stats
        return {**self.runtime.stats, **apps.coordinator.stats}

    def batch_members(self) -> dict[str, dict[str, Any]]:
        """Per application part model: its batches by their members' applications
        (runtime/apps.py BatchMembers; empty where the plan serves no application)."""
        apps = self.apps
        if apps is None:
            return {}
        return self._call(apps.coordinator.members.document)

    def down_nodes(self) -> set[str]:
        return self._call(self.runtime.down_nodes)

    def drained_nodes(self) -> set[str]:
        return self._call(self.runtime.drained_nodes)

    def live_throughput(self) -> dict[str, float]:
        return self._call(self.runtime.live_throughput)

    def models_without_path(self, timeout_s: float = 1.0) -> list[str]:
        """Models of the plan with no live path now (asked on the loop, within `timeout_s`)."""
        topo = self.runtime.topo
        return sorted(topo.models[i].name for i in self._call(self.runtime.without_path, timeout_s))

    def models_unservable(self, timeout_s: float = 1.0) -> list[str]:
        """Models of the plan whose SLO, less the measured reply margin, leaves no time to
        serve a request in (their requests are refused; asked on the loop)."""
        topo = self.runtime.topo
        return sorted(topo.models[i].name for i in self._call(self.runtime.unservable, timeout_s))

    def in_flight(self) -> int:
        return self.runtime.in_flight()

    # ------------------------------------------------------------------ nodes

    def _node_changed(self, node: str, state: str, why: str, t_us: float) -> None:
        """A node's state changed (on the router's loop): logged with the time, counted."""
        when = datetime.now()
        self.node_events.append((when, node, state, why))
        self.node_changes[state] += 1
        name = self.node_names.get(node, node)
        where = f"node {name}" + (f" ({node})" if name != node else "")
        if self.stopping:  # a Ctrl-C reaches the nodes too: their end is expected
            log.info("%s %s as the router stops%s", where, state, f": {why}" if why else "")
            return
        log.warning("%s %s%s", where, state, f": {why}" if why else "")

    def watch(self, addresses: Mapping[str, str]) -> None:
        """Hold a watch connection to each node (address -> its watch address, see
        node/watch.py): the moment one breaks, its node leaves service. The same address
        takes the feature maps chains send the node (node/feed.py)."""
        self.feeds.update(addresses)

        def start() -> None:
            for node, address in addresses.items():
                if node in self._watches or self._closing.is_set():
                    continue
                self._watches[node] = self._loop.create_task(
                    watch_node(
                        address,
                        partial(self._watch_lost, node),
                        partial(self._watch_open, node),
                        self._closing,
                    )
                )
                self.clocks.watch(node, address)

        self._call(start)

    def _clock_of(self, node: str) -> dict[str, float | None]:
        offset, rtt = self.clocks.offset_ns(node), self.clocks.round_trip_ns(node)
        if offset is None or rtt is None:
            return {"clock_offset_us": None, "clock_error_us": None}
        return {"clock_offset_us": round(offset / 1e3, 1), "clock_error_us": round(rtt / 2e3, 1)}

    def _node_time(self, node: str, t_us: float) -> int | None:
        """The router's time `t_us` on the node's clock (ns), where known (clocks.py)."""
        return self.clocks.node_time(node, self.clock.t0_ns + int(t_us * 1e3))

    def _watch_open(self, node: str) -> None:
        self.watching.add(node)
        self.runtime.node_watched(node)

    def _watch_lost(self, node: str, why: str) -> None:
        self.watching.discard(node)
        self.runtime.node_lost(node, why)

    def _stop_watching(self) -> None:
        self._closing.set()
        self.runtime.stop_sweep()

    def node_states(self) -> list[dict[str, object]]:
        """Every node of the plan served (and any still out of service): its state (in
        service, down, drained), since when (ISO time; None: since the router started),
        the batches on it now, how long it has run no stage (`idle_s`: one packing
        leaves idle at a low load can be drained and released; poolpipe advise), and its
        clock against the router's (`clock_offset_us`, `clock_error_us`: at most that far
        off; None where not known, and its hops are sent `after_us` alone; clocks.py)."""

        def read() -> list[dict[str, object]]:
            rt = self.runtime
            out: list[dict[str, object]] = []
            down, drained, since = rt.down_nodes(), rt.drained_nodes(), rt.node_since()
            now_us, now = self.clock.now(), time.time()
            for node in sorted(set(rt.served.vgpu_node.values()) | down | drained):
                t = since.get(node)
                state = "down" if node in down else "drained" if node in drained else "in service"
                out.append(
                    {
                        "node": self.node_names.get(node, node),
                        "address": node,
                        "state": state,
                        "since": None
                        if t is None
                        else datetime.fromtimestamp(now - (now_us - t) / 1e6).isoformat(
                            timespec="seconds"
                        ),
                        "batches": rt.node_jobs(node),
                        "idle_s": round(rt.node_idle_us(node, now_us) / 1e6, 1),
                        **self._clock_of(node),
                    }
                )
            return out

        return self._call(read)

    def drain(self, node: str, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, object]:
        """Take `node` (its address) out of new batches and wait (at most `timeout_s`) for
        those on it to end. Returns {node, batches_left, waited_s}."""
        t0 = time.monotonic()
        left = self._call(lambda: self.runtime.drain(node))
        while left and time.monotonic() - t0 < timeout_s:
            time.sleep(0.02)
            left = self._call(lambda: self.runtime.node_jobs(node))
        return {"node": node, "batches_left": left, "waited_s": round(time.monotonic() - t0, 3)}

    def undrain(self, node: str) -> None:
        self._call(lambda: self.runtime.undrain(node))

    # ------------------------------------------------------------------ intake

    def take(
        self,
        model: str,
        arrays: Sequence[np.ndarray],
        slo_ms: object,
        arrived_ns: int,
        reply: Reply,
        deadline_ns: int | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        """One client request, on the router's loop (the door's socket is served there):
        its input tensors in the model's input order, `slo_ms` as the client sent it (or
        None for the model's SLO), when the door saw it (CLOCK_MONOTONIC ns), and the
        client's own deadline where it sent one (same clock: the SLO ends there if that
        comes first; an application's requests keep their plan's). Answered through
        `reply`, once. `trace`: its notes, where the router traces it (tracing.py). A
        request the runtime refuses at the door raises BadRequest at once (nothing
        queued)."""
        apps = self.apps
        if apps is not None and model in apps.ios:
            apps.take(model, arrays, slo_ms, self.clock.at(arrived_ns), reply)
            return
        io = self.runtime.served.adapter.io.get(model)
        n = int(arrays[0].shape[0]) if io and arrays and arrays[0].ndim else 0
        index, slo_us = self.runtime.check(model, n, slo_ms)
        assert io is not None  # check() refuses unknown models
        if len(arrays) != len(io.inputs):
            raise BadRequest(f"{model}: expected {len(io.inputs)} input tensors")
        if deadline_ns is not None:
            own = self.runtime.topo.models[index].slo_us if slo_us is None else slo_us
            slo_us = capped_slo_us(own, arrived_ns, deadline_ns)
            self.client_deadlines["shortened" if slo_us < own else "kept"] += 1
        request = ClientRequest(io, n, reply, trace)
        arrived = self.clock.at(arrived_ns)
        rt = self.runtime
        for i in range(n):
            rt.add(index, RequestRow(request, i, [a[i : i + 1] for a in arrays]), slo_us, arrived)
        rt.decide()

    def traces(self, model: str) -> bool:
        """Whether requests of `model` are traced: tracing is on and it is not an
        application (whose parts are requests of their own)."""
        apps = self.apps
        return self.tracing is not None and (apps is None or model not in apps.ios)

    def observe_door(self, ingress_ns: int | None, egress_ns: Sequence[int]) -> None:
        """Ingress and egress times the door measured (on the router's loop): the reply
        margin follows them."""
        m = self.margin
        if m.observe(
            None if ingress_ns is None else ingress_ns / 1e3, [e / 1e3 for e in egress_ns]
        ):
            self.runtime.reply_margin_us = m.margin_us

    def _observe_path(self, overhead_us: float) -> None:
        """A chain's overhead (on the router's loop): the reply margin follows it."""
        if self.margin.observe(None, path_us=[overhead_us]):
            self.runtime.reply_margin_us = self.margin.margin_us

    def restart_margin(self) -> None:
        """The reply margin from new samples only (MarginMeter.restart)."""

        def restart() -> None:
            self.margin.restart()
            self.runtime.reply_margin_us = self.margin.margin_us

        self._call(restart)

    def margin_figures(self) -> dict[str, float]:
        return self._call(self.margin.figures)

    # ------------------------------------------------------------------ statistics

    def reset_stats(self) -> None:
        """Counters, windows, busy times and stage factors from zero; what recalibration
        has learnt stays."""
        self._call(self.runtime.reset_stats)

    def take_stage_factors(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan, measured compute time of the stage calls since the
        last call that found their vGPU idle, over the pool's latency as served
        (`base_topo`, before any recalibration): what the simulator draws
        execution times from to predict this router (SimConfig.stage_factors). Waiting in a
        node's queue is left to the simulator; what remains is how much slower stages run
        under load than when they were calibrated one at a time (on a shared host, mostly
        each other's CPU)."""
        return self._call(self.runtime.take_stage_factors)

    def take_answer_delays(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan (a pipeline's last), how much later than reserved
        its batches were answered, beyond their stages' own time, since the last call: what
        the simulator delays its answers by to predict this router (SimConfig.answer_delays;
        ServingRuntime.take_answer_delays)."""
        return self._call(self.runtime.take_answer_delays)

    def recalibrations(self) -> int:
        """How many times live recalibration has rescaled a pool's latencies so far."""
        return self._call(lambda: self.runtime.recalibrations)

    def take_chain_overheads(self) -> list[float]:
        """The overhead (µs) of each chain answered since the last call (_chain_times)."""

        def take() -> list[float]:
            hops = self.executor.transport
            if not isinstance(hops, ChainTransport):
                return []
            out = list(hops.overheads_us)
            hops.overheads_us.clear()
            return out

        return self._call(take)

    def take_window(self) -> Window:
        """What happened since the last call: one row per model and one per pool (the live
        figures for the warehouse's per-minute statistics)."""
        return self._call(self.runtime.take_window)

    def use_app_budgets(self, budgets_us: Mapping[str, Mapping[str, float]]) -> None:
        """A plan of the same applications rolled out: its budgets from now on."""
        apps = self.apps
        if apps is not None:
            self._call(lambda: apps.use_budgets(budgets_us))

    # ------------------------------------------------------------------ plan switch

    def switch(self, served: ServedPlan, flush_timeout_s: float | None = None) -> SwitchResult:
        """Pipeline-flush migration to a new plan (blocks until done; see
        ServingRuntime.switch). Default flush timeout: two of the longest SLO and a second."""
        done: cf.Future = cf.Future()

        def begin() -> None:
            timeout_us = (
                default_flush_timeout_us(self.runtime.topo, served.topo)
                if flush_timeout_s is None
                else flush_timeout_s * 1e6
            )
            self.runtime.switch(served, timeout_us, done.set_result)

        self._call(begin)
        return done.result()
