"""The router: poolpipe's serving runtime driven by the real clock, with an executor that
runs each batch along its path of stage workers through tritonclient's gRPC client,
behind the router's own Triton (the door: a Python-backend model per served model name that
clients call over KServe v2 HTTP/gRPC, see door.py).

Every serving policy (deadlines, decisions, outcomes, failures and retries, node return,
recalibration, flush migration, the reply margin) is `poolpipe.runtime`'s; this module is
I/O. `RouterCore` runs the runtime in one thread with its own event loop (the runtime is a
plain, single-threaded state machine); the door's socket is served on that loop, so a
request reaches the runtime without another thread hop. Every request is answered once: its
outputs, a drop (deadline cannot be met; the message starts with DROP_MARKER), or a stage
failure (FAIL_MARKER).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import heapq
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from poolpipe.client.control import chain_signature
from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import TensorSpec
from poolpipe.runtime import (
    DROPPED,
    FAILED,
    BadRequest,
    Entry,
    Job,
    MarginMeter,
    ModelStats,
    RuntimeConfig,
    ServedPlan,
    ServingRuntime,
    SwitchResult,
)
from poolpipe.scheduler import DataPlane
from poolpipe.scheduler.topology import Topology
from triton_backend import TRANSPORTS
from triton_backend.kserve_http import HttpStage
from triton_backend.repository import HOPS_OUTPUT, kserve_dtype

DROP_MARKER = "POOLPIPE_DROPPED"
BAD_REQUEST_MARKER = "POOLPIPE_BAD_REQUEST"
FAIL_MARKER = "POOLPIPE_STAGE_FAILED"
CALLER_THREADS = 512  # most stage calls in flight at once (see TritonExecutor._callers)

T = TypeVar("T")


@dataclass(frozen=True)
class ModelIO:
    """A served model's tensors as clients see them (batch dimension first)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class RouterPlan:
    """The router's own data for a served plan (ServedPlan.adapter)."""

    pool_partition: Mapping[int, str]  # pool id -> partition model name
    io: Mapping[str, ModelIO]  # served model name -> its tensors


def served_plan(
    topo: Topology,
    plane: DataPlane,
    pool_partition: Mapping[int, str],
    vgpu_url: Mapping[int, str],
    io: Sequence[ModelIO],
) -> ServedPlan:
    """What the runtime serves a plan with: each vGPU's node is its gRPC address."""
    by_name = {m.name: m for m in io}
    for m in topo.models:
        if m.name not in by_name:
            raise PoolpipeError(f"router: no tensor description for plan model {m.name}")
    return ServedPlan(topo, plane, dict(vgpu_url), RouterPlan(pool_partition, by_name))


# How the door answers a request: outputs (in the model's output order) or None, the
# error's code (None, "INVALID_ARG", "UNAVAILABLE" or "INTERNAL") and its message.
Reply = Callable[[list[np.ndarray] | None, str | None, str], None]

_CODES = {DROPPED: ("UNAVAILABLE", DROP_MARKER), FAILED: ("INTERNAL", FAIL_MARKER)}


class _Request:
    """One client request of n rows: answered once, when every row is done or at the first
    row that is dropped or fails."""

    __slots__ = ("io", "reply", "rows", "waiting")

    def __init__(self, io: ModelIO, n: int, reply: Reply):
        self.io = io
        self.reply: Reply | None = reply
        self.rows: list[dict[str, np.ndarray] | None] = [None] * n
        self.waiting = n

    def settle(self, row: int, outcome: int, reason: str, result: Any) -> None:
        reply = self.reply
        if reply is None:
            return
        if outcome in _CODES:
            self.reply = None
            code, marker = _CODES[outcome]
            reply(None, code, f"{marker}: {reason}")
            return
        self.rows[row] = result
        self.waiting -= 1
        if self.waiting == 0:
            self.reply = None
            rows = self.rows
            if len(rows) == 1:
                outs = [rows[0][t.name] for t in self.io.outputs]  # type: ignore[index]
            else:
                outs = [np.concatenate([r[t.name] for r in rows]) for t in self.io.outputs]  # type: ignore[index]
            reply(outs, None, "")


@dataclass
class _Payload:
    """One client row: its request, its place there, and its tensors (inputs kept for a
    retry)."""

    request: _Request
    row: int
    inputs: list[np.ndarray]
    tensors: list[np.ndarray] = field(default_factory=list)  # after the last stage run


class _Gate:
    """One vGPU's stage calls: one at a time, in the order of their reserved starts (a
    call whose turn has come waits for nothing else; one whose earlier turns are still on
    their way waits for them)."""

    __slots__ = ("busy", "heap", "loop", "seq", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.heap: list[tuple[float, int]] = []
        self.busy = False
        self.seq = 0
        self.waiting: dict[int, asyncio.Future] = {}

    def add(self, start_us: float) -> tuple[float, int]:
        self.seq += 1
        token = (start_us, self.seq)
        heapq.heappush(self.heap, token)
        return token

    async def turn(self, token: tuple[float, int]) -> None:
        if not self.busy and self.heap[0] == token:
            heapq.heappop(self.heap)
            self.busy = True
            return
        fut = self.loop.create_future()
        self.waiting[token[1]] = fut
        await fut  # the gate is ours when this resolves

    def release(self) -> None:
        self.busy = False
        self._next()

    def forget(self, token: tuple[float, int]) -> None:
        """A turn that will not be taken (its job was dropped or failed)."""
        if token in self.heap:
            self.heap.remove(token)
            heapq.heapify(self.heap)
            self.waiting.pop(token[1], None)
            self._next()

    def _next(self) -> None:
        if self.busy or not self.heap:
            return
        fut = self.waiting.pop(self.heap[0][1], None)
        if fut is not None:
            heapq.heappop(self.heap)
            self.busy = True
            fut.set_result(None)


class LoopClock:
    """The event loop's clock, in µs since the router started."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._t0 = time.monotonic_ns()

    def now(self) -> float:
        return (time.monotonic_ns() - self._t0) / 1e3

    def at(self, monotonic_ns: int) -> float:
        """A CLOCK_MONOTONIC time (any process of this host) on this clock."""
        return (monotonic_ns - self._t0) / 1e3

    def call_at(self, t_us: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(max(0.0, (t_us - self.now()) / 1e6), fn)


class TritonExecutor:
    """Runs each batch through the stage workers' gRPC endpoints and answers the clients'
    futures. `transport`: "router" sends every hop from here (feature maps come back to the
    router between stages); "chain" sends the batch to its first node with the rest of its
    path, and each node sends its feature map straight to the next (python_onnx_model.py):
    the router's NIC carries inputs and outputs only. `key` signs chains (the nodes'
    key; None: unsigned)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stage_timeout_s: float,
        transport: str = "router",
        key: str | None = None,
    ):
        if transport not in TRANSPORTS:
            raise PoolpipeError(f"unknown transport {transport!r}; choose {', '.join(TRANSPORTS)}")
        self.loop = loop
        self.stage_timeout_s = stage_timeout_s
        self.transport = transport
        self.key = key
        self.chain_overheads_us: deque[float] = deque(maxlen=4096)  # see _chain_times
        self.on_overhead: Callable[[float], None] = lambda us: None
        # a failed node that answers again without its models (restarted empty, e.g. by its
        # operator): given its URL, loads them (blocking; run off the loop); None: wait
        self.on_empty_node: Callable[[str], None] | None = None
        self._refilling: set[str] = set()
        self._clients: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
        self._gates: dict[tuple[int, int], _Gate] = {}  # (generation, vGPU) -> its turns
        # stage calls block one of these threads each (a call per vGPU at a time, and chains
        # in flight: threads are started only when none is idle)
        self._callers = cf.ThreadPoolExecutor(CALLER_THREADS, thread_name_prefix="poolpipe-call")
        # a node's gRPC address -> its KServe v2 HTTP address, where known (stage calls)
        self.http: dict[str, str] = {}
        self._http_stages: dict[str, HttpStage] = {}
        self.rt: ServingRuntime

    def bind(self, runtime: ServingRuntime) -> None:
        self.rt = runtime

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _client(self, url: str) -> Any:
        c = self._clients.get(url)
        if c is None:
            import tritonclient.grpc as grpcclient

            c = self._clients[url] = grpcclient.InferenceServerClient(url)
        return c

    def _infer(self, url: str, model: str, inputs: list, **kw: Any) -> asyncio.Future:
        """A stage call: the synchronous client's blocking call on a reused caller thread,
        settled on the loop. Measured with bench-serving's part 1 (one call at a time):
        the client's gRPC futures started a thread of gRPC's per call whenever no other
        call was in flight on the channel, which was most of the router's CPU per request
        (the asyncio client is about 0.3 ms per call slower still)."""
        client = self._client(url)
        return self.loop.run_in_executor(
            self._callers,
            partial(client.infer, model, inputs, client_timeout=self.stage_timeout_s, **kw),
        )

    async def _stage(self, url: str, model: str, inputs: list[tuple[str, np.ndarray]]) -> Any:
        """One stage call of (name, array) inputs: over KServe v2 HTTP where the node's
        HTTP address is known (`http`; see kserve_http.py for why), else over gRPC."""
        address = self.http.get(url)
        if address is not None:
            stage = self._http_stages.get(address)
            if stage is None:
                stage = self._http_stages[address] = HttpStage(self.loop, address)
            return await stage.infer(model, inputs, self.stage_timeout_s)
        import tritonclient.grpc as grpcclient

        wire = []
        for name, x in inputs:
            t = grpcclient.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
            t.set_data_from_numpy(x)
            wire.append(t)
        return await self._infer(url, model, wire)

    async def close(self) -> None:
        for stage in self._http_stages.values():
            stage.close()
        self._http_stages.clear()
        self._callers.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    # ------------------------------------------------------------------ the port

    def run(self, job: Job) -> None:
        gen = id(job.generation)
        tokens = []
        chain = self.transport == "chain" and len(job.dispatch.hops) > 1
        for hop in job.dispatch.hops[:1] if chain else job.dispatch.hops:
            gate = self._gates.get((gen, hop.vgpu))
            if gate is None:
                gate = self._gates[(gen, hop.vgpu)] = _Gate(self.loop)
            tokens.append(gate.add(hop.start_us))
        self._spawn(self._run_chain(job, tokens[0]) if chain else self._run(job, tokens))

    def answer(self, entry: Entry, outcome: int, reason: str) -> None:
        p: _Payload = entry.payload
        p.request.settle(p.row, outcome, reason, entry.result)

    def check_node(self, node: str, served: ServedPlan) -> None:
        plan: RouterPlan = served.adapter
        models = {
            plan.pool_partition[served.topo.vgpus[v].pool]
            for v, url in served.vgpu_node.items()
            if url == node
        }
        self._spawn(self._check(node, models))

    # ------------------------------------------------------------------ I/O

    async def _run(self, job: Job, tokens: list[tuple[float, int]]) -> None:
        """The job's hops in order, each on its vGPU when its turn comes there (one stage
        call at a time per vGPU, in the order of reserved starts, as the simulator runs
        them): a call sent to a busy node would wait in its queue, out of the runtime's
        sight, while the runtime took the vGPU for free."""
        rt, served, d = self.rt, job.served, job.dispatch
        plan: RouterPlan = served.adapter
        topo = served.topo
        io = plan.io[topo.models[d.model].name]
        entries = job.entries
        end_block = topo.pools[topo.pipelines[d.pipeline].pools[-1]].end
        gen = id(job.generation)
        taken = 0  # turns taken so far
        try:
            for h, hop in enumerate(d.hops):
                pool = topo.pools[hop.pool]
                partition = plan.pool_partition[hop.pool]
                first, last = pool.start == 0, pool.end == end_block
                rows = [e.payload.inputs if first else e.payload.tensors for e in entries]
                inputs = [
                    (
                        io.inputs[k].name if first else f"in_{k}",
                        np.concatenate([r[k] for r in rows]) if len(rows) > 1 else rows[0][k],
                    )
                    for k in range(len(rows[0]))
                ]
                gate = self._gates[(gen, hop.vgpu)]
                await gate.turn(tokens[h])
                taken = h + 1
                try:
                    start = rt.clock.now()
                    if start - hop.start_us > job.slack_us and not rt.hop_late(job, h):
                        return  # dropped: the rest of its path is released
                    rt.hop_started(job, h, start)
                    try:
                        result = await self._stage(served.vgpu_node[hop.vgpu], partition, inputs)
                    except Exception as exc:
                        rt.hop_failed(job, h, f"{partition}: {exc}")
                        return
                    end = rt.clock.now()
                finally:
                    gate.release()
                outs = _outputs(result, [t.name for t in io.outputs] if last else None)
                for i, e in enumerate(entries):
                    e.payload.tensors = [o[i : i + 1] for o in outs]
                    if last:
                        e.result = {
                            t.name: v for t, v in zip(io.outputs, e.payload.tensors, strict=True)
                        }
                rt.hop_done(job, h, start, end)
        finally:
            for k in range(taken, len(d.hops)):  # turns it will not take
                self._gates[(gen, d.hops[k].vgpu)].forget(tokens[k])

    async def _run_chain(self, job: Job, token: tuple[float, int]) -> None:
        """The job's path as a chain of nodes: its batch to the first node when its turn
        comes there, with the rest of the path; the first vGPU's turn ends when its hop's
        reserved time is up (the nodes after it take hops as feature maps arrive, in
        Triton's queue). When the answer is back, every hop is reported with the times the
        nodes measured (durations exact; the gaps between hosts, whose clocks differ,
        taken as reserved), or the hop that failed."""
        import tritonclient.grpc as grpcclient

        rt, served, d = self.rt, job.served, job.dispatch
        plan: RouterPlan = served.adapter
        io = plan.io[served.topo.models[d.model].name]
        entries = job.entries
        inputs = []
        for k, spec in enumerate(io.inputs):
            x = np.concatenate([e.payload.inputs[k] for e in entries])
            t = grpcclient.InferInput(spec.name, list(x.shape), kserve_dtype(x.dtype))
            t.set_data_from_numpy(x)
            inputs.append(t)
        path = json.dumps(
            [
                {"url": served.vgpu_node[h.vgpu], "model": plan.pool_partition[h.pool]}
                for h in d.hops[1:]
            ]
        )
        names = [t.name for t in io.outputs]
        params = {"poolpipe_next": path, "poolpipe_outputs": json.dumps(names)}
        if self.key is not None:
            params["poolpipe_sig"] = chain_signature(self.key, path)
        wanted = [grpcclient.InferRequestedOutput(n) for n in [*names, HOPS_OUTPUT]]
        hop0 = d.hops[0]
        gate = self._gates[(id(job.generation), hop0.vgpu)]
        await gate.turn(token)
        start = rt.clock.now()
        if start - hop0.start_us > job.slack_us and not rt.hop_late(job, 0):
            gate.release()
            return  # dropped: the rest of its path is released
        self.loop.call_later(max(0.0, (hop0.end_us - hop0.start_us) / 1e6), gate.release)
        rt.hop_started(job, 0, start)
        # the chain's time: until the last SLO of its requests runs out; nobody forwards
        # a feature map with none left
        params["poolpipe_budget_us"] = str(int(max(e.due_us for e in entries) - start))
        try:
            result = await self._infer(
                served.vgpu_node[hop0.vgpu],
                plan.pool_partition[hop0.pool],
                inputs,
                outputs=wanted,
                parameters=params,
            )
        except Exception as exc:
            failed, why = _failed_hop(exc)
            out_of_time = _out_of_time(why)
            times = _reserved_times(d.hops, start)
            for h in range(1, failed + 1):
                rt.hop_done(job, h - 1, *times[h - 1])
                if h < failed or not out_of_time:
                    rt.hop_started(job, h, times[h][0])
            if out_of_time and not rt.hop_late(job, failed):
                return  # its requests' SLOs ran out on the way: dropped, the path let go
            rt.hop_failed(job, failed, f"{plan.pool_partition[d.hops[failed].pool]}: {why}")
            return
        back = rt.clock.now()
        outs = _outputs(result, names)
        times, overhead = _chain_times(d.hops, result.as_numpy(HOPS_OUTPUT)[0], start, back)
        self.chain_overheads_us.append(overhead)
        self.on_overhead(overhead)
        for i, e in enumerate(entries):
            e.payload.tensors = [o[i : i + 1] for o in outs]
            e.result = {t.name: v for t, v in zip(io.outputs, e.payload.tensors, strict=True)}
        for h, (s_us, e_us) in enumerate(times):
            if h:
                rt.hop_started(job, h, s_us)
            rt.hop_done(job, h, s_us, e_us)

    async def _check(self, url: str, models: set[str]) -> None:
        """Is the node live with its models ready? (A fresh channel: the old one may be in
        gRPC's reconnect back-off.)"""
        import tritonclient.grpc.aio as grpcaio

        probe = grpcaio.InferenceServerClient(url)
        live = ready = False
        try:
            live = ready = await probe.is_server_live(client_timeout=1.0)
            for m in models:
                ready = ready and await probe.is_model_ready(m, client_timeout=1.0)
        except Exception:
            ready = False
        finally:
            await probe.close()
        if live and not ready and self.on_empty_node and url not in self._refilling:
            self._refilling.add(url)
            refill = self.loop.run_in_executor(None, self.on_empty_node, url)
            refill.add_done_callback(lambda f: self._refilling.discard(url))
        if ready:
            old = self._clients.pop(url, None)
            if old is not None:
                old.close()
        self.rt.node_checked(url, bool(ready))


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
    ):
        """`margin`: what the reply margin is learnt with (its floor until it has samples;
        the floor and ceiling equal for a fixed margin)."""
        self._loop = asyncio.new_event_loop()
        self.clock = LoopClock(self._loop)
        self.executor = TritonExecutor(self._loop, stage_timeout_s, transport, key)
        self.executor.on_overhead = self._observe_path
        self.margin = margin or MarginMeter()
        self.runtime = ServingRuntime(
            served,
            self.clock,
            self.executor,
            RuntimeConfig(
                reply_margin_us=self.margin.margin_us,
                recalibrate=recalibrate,
                record_stage_factors=True,
            ),
        )
        self._thread = threading.Thread(target=self._run_loop, name="poolpipe-router", daemon=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RouterCore:
        self._thread.start()
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.executor.close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

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
    def served(self) -> ServedPlan:
        return self.runtime.served

    @property
    def topo(self) -> Topology:
        return self.runtime.topo

    @property
    def io(self) -> Mapping[str, ModelIO]:
        return self.runtime.served.adapter.io

    @property
    def stats(self) -> dict[str, ModelStats]:
        return self.runtime.stats

    @property
    def pool_busy_us(self) -> list[float]:
        return self.runtime.gen.pool_busy_us

    @property
    def recalibrations(self) -> int:
        return self.runtime.recalibrations

    @property
    def recoveries(self) -> int:
        return self.runtime.recoveries

    def down_nodes(self) -> set[str]:
        return self._call(self.runtime.down_nodes)

    def live_throughput(self) -> dict[str, float]:
        return self._call(self.runtime.live_throughput)

    def in_flight(self) -> int:
        return self.runtime.in_flight()

    # ------------------------------------------------------------------ intake

    def take(
        self,
        model: str,
        arrays: Sequence[np.ndarray],
        slo_ms: object,
        arrived_ns: int,
        reply: Reply,
    ) -> None:
        """One client request, on the router's loop (the door's socket is served there):
        its input tensors in the model's input order, `slo_ms` as the client sent it (or
        None for the model's SLO), when the door saw it (CLOCK_MONOTONIC ns). Answered
        through `reply`, once. A request the runtime refuses at the door raises BadRequest
        at once (nothing queued)."""
        io = self.io.get(model)
        n = int(arrays[0].shape[0]) if io and arrays and arrays[0].ndim else 0
        index, slo_us = self.runtime.check(model, n, slo_ms)
        assert io is not None  # check() refuses unknown models
        if len(arrays) != len(io.inputs):
            raise BadRequest(f"{model}: expected {len(io.inputs)} input tensors")
        request = _Request(io, n, reply)
        arrived = self.clock.at(arrived_ns)
        rt = self.runtime
        for i in range(n):
            rt.add(index, _Payload(request, i, [a[i : i + 1] for a in arrays]), slo_us, arrived)
        rt.decide()

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
        """Per pool of the serving plan, measured over reserved compute time of the stage
        calls since the last call that found their vGPU idle: what the simulator draws
        execution times from to predict this router (SimConfig.stage_factors). Waiting in a
        node's queue is left to the simulator; what remains is how much slower stages run
        under load than when they were calibrated one at a time (on a shared host, mostly
        each other's CPU)."""
        return self._call(self.runtime.take_stage_factors)

    def take_chain_overheads(self) -> list[float]:
        """The overhead (µs) of each chain answered since the last call (_chain_times)."""

        def take() -> list[float]:
            out = list(self.executor.chain_overheads_us)
            self.executor.chain_overheads_us.clear()
            return out

        return self._call(take)

    def take_window(self) -> tuple[list[dict], list[dict]]:
        """What happened since the last call: one row per model and one per pool (the live
        figures for the warehouse's per-minute statistics)."""
        return self._call(self.runtime.take_window)

    # ------------------------------------------------------------------ plan switch

    def switch(self, served: ServedPlan, flush_timeout_s: float | None = None) -> SwitchResult:
        """Pipeline-flush migration to a new plan (blocks until done; see
        ServingRuntime.switch). Default flush timeout: two of the longest SLO and a second."""
        from poolpipe.runtime.core import default_flush_timeout_us

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


def _failed_hop(exc: BaseException) -> tuple[int, str]:
    """Which hop of a chain failed ("POOLPIPE_HOP k: why" from the nodes; 0 otherwise:
    the first node did not answer)."""
    text = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    text = str(text)
    if text.startswith("POOLPIPE_HOP "):
        k, _, why = text[len("POOLPIPE_HOP ") :].partition(":")
        if k.strip().isdigit():
            return int(k), why.strip()
    return 0, text


def _out_of_time(why: str) -> bool:
    """A chain's hop not run for want of time (the hop before it had none left to forward
    its feature map), not for a node's failure."""
    return "POOLPIPE_DEADLINE" in why


def _reserved_times(hops: Sequence[Any], start: float) -> list[tuple[float, float]]:
    """Each hop's (start, end) as reserved, shifted to begin at `start`."""
    shift = start - hops[0].start_us
    return [(h.start_us + shift, h.end_us + shift) for h in hops]


def _chain_times(
    hops: Sequence[Any], measured: np.ndarray, sent: float, back: float
) -> tuple[list[tuple[float, float]], float]:
    """Each hop's (start, end) on the router's clock from what the nodes measured (start,
    end, sent ns per hop, each on its own host's clock), and the chain's overhead: the
    time from sending to the answer that neither the measured computes nor the reserved
    transfers explain (the nodes' forwarding, their queues, the answer's way back: the
    reply margin holds its p99 back, see MarginMeter). Placed back from when the answer
    came, never before the batch was sent."""
    n = len(hops)
    took = [max(0.0, float(measured[3 * h + 1] - measured[3 * h]) / 1e3) for h in range(n)]
    gaps = [h.transfer_end_us - h.transfer_start_us for h in hops[1:]]
    overhead = (back - sent) - sum(took) - sum(gaps)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * n
    end = back
    for h in range(n - 1, -1, -1):
        begin = max(sent, end - took[h])
        times[h] = (begin, max(begin, end))
        end = max(sent, begin - (gaps[h - 1] if h else 0.0))
    return times, overhead


def _outputs(result: Any, names: list[str] | None) -> list[np.ndarray]:
    """The response's tensors in order: by name for the model's outputs, else out_0, ...
    (`result`: a tritonclient result, or arrays by name from kserve_http)."""
    by_name = isinstance(result, dict)
    if names is None:
        found = result if by_name else (o.name for o in result.get_response().outputs)
        names = sorted(found, key=lambda s: int(s.split("_")[1]))
    get = result.__getitem__ if by_name else result.as_numpy
    return [get(n) for n in names]
