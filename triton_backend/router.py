"""The router: poolpipe's scheduler driven by the real clock, dispatching batches along the
chosen path of stage workers with tritonclient's asyncio gRPC client, behind a PyTriton
model per served model name that clients call over KServe v2 HTTP/gRPC.

`RouterCore` owns the data plane and runs in one thread with its own event loop (the
scheduler is a plain, single-threaded state machine); PyTriton's inference callables, which
run on their own threads, hand requests over and wait on futures. Every request is answered:
its outputs, a `Dropped` error (deadline cannot be met; the message starts with DROP_MARKER),
or a `StageFailed` error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import TensorSpec
from poolpipe.scheduler import DataPlane, Decisions, Dispatch, Request, StageReport
from poolpipe.scheduler.topology import Topology, with_latencies
from triton_backend.repository import kserve_dtype

# Held back from every request's deadline for its way into the router and its answer's way
# back (PyTriton's proxy and gRPC, both ways), which the router cannot see. Measured on the
# 2-core machine with 32 router instances at 20-60 req/s: ingress + egress p99 20-28 ms
# (`./run bench-serving`). With 10 ms, 20-25% of the answers the router had on time reached
# the client late.
REPLY_MARGIN_US = 25_000.0

# Live recalibration: after this many stage calls of a pool that found their vGPU idle, the
# median of measured / reserved time, when outside 1 +- RECALIBRATE_BAND, scales the pool's
# latencies (every batch size) for all later reservations. Start-up calibration times one
# call at a time; under load, stage workers that share a host's cores run slower.
RECALIBRATE_EVERY = 20
RECALIBRATE_BAND = 0.1

DROP_MARKER = "POOLPIPE_DROPPED"
FAIL_MARKER = "POOLPIPE_STAGE_FAILED"


class Dropped(Exception):
    """The request was not served because its deadline could not be met."""


class StageFailed(Exception):
    """A stage worker failed while serving the request's batch."""


@dataclass(frozen=True)
class ModelIO:
    """A served model's tensors as clients see them (batch dimension first)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass
class _Req:
    req: Request
    future: cf.Future
    tensors: list[np.ndarray]  # what the next partition reads (one row each)
    due_us: float  # arrival + SLO (the scheduler plans for req.deadline_us, a bit earlier)
    inputs: list[np.ndarray] = field(default_factory=list)  # the client's, for a retry
    attempts: int = 1


@dataclass
class ModelStats:
    arrivals: int = 0
    on_time: int = 0
    late: int = 0
    dropped: int = 0
    failed: int = 0
    retried: int = 0
    latency_us: list[float] = field(default_factory=list)
    batch_sizes: Counter[int] = field(default_factory=Counter)


@dataclass(frozen=True)
class ServedPlan:
    """Everything the router serves one plan with; a rollout swaps it whole, and a dispatch
    runs to its end on the one it was made with."""

    topo: Topology
    plane: DataPlane
    pool_partition: Mapping[int, str]  # pool id -> partition model name
    vgpu_url: Mapping[int, str]  # vGPU id -> its node's gRPC address
    io: Mapping[str, ModelIO]  # served model name -> its tensors

    @classmethod
    def of(
        cls,
        topo: Topology,
        plane: DataPlane,
        pool_partition: Mapping[int, str],
        vgpu_url: Mapping[int, str],
        io: Sequence[ModelIO],
    ) -> ServedPlan:
        by_name = {m.name: m for m in io}
        for m in topo.models:
            if m.name not in by_name:
                raise PoolpipeError(f"router: no tensor description for plan model {m.name}")
        return cls(topo, plane, pool_partition, vgpu_url, by_name)


class RouterCore:
    def __init__(
        self,
        served: ServedPlan,
        stage_timeout_s: float = 30.0,
        reply_margin_us: float = 0.0,
        recalibrate: bool = True,
    ):
        self.served = served
        topo = served.topo
        self.stage_timeout_s = stage_timeout_s
        # The answer still has to travel back through Triton to the client after the last
        # stage: the scheduler plans every request to be done this much before its SLO.
        self.reply_margin_us = reply_margin_us
        self.stats = {m.name: ModelStats() for m in topo.models}
        self.pool_busy_us = [0.0] * len(topo.pools)
        self._ids = itertools.count()
        self._reqs: dict[int, _Req] = {}
        self._t0 = time.monotonic_ns()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="poolpipe-router", daemon=True)
        self._clients: dict[str, object] = {}
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at = math.inf
        self._tasks: set[asyncio.Task] = set()
        self._down: set[str] = set()  # stage nodes (URLs) out of service
        self._calls: Counter[tuple[str, int]] = Counter()  # stage calls in flight per vGPU
        # per pool of the serving plan: measured over reserved compute time of stage calls
        # that found their vGPU idle (see take_stage_factors)
        self._stage_factors: defaultdict[int, list[float]] = defaultdict(list)
        self.recalibrate = recalibrate
        self._recent: defaultdict[int, list[float]] = defaultdict(list)  # since last check
        self.recalibrations = 0
        self.recoveries = 0
        self._window_marks: dict[str, tuple] = {}
        self._busy_marks: dict[int, float] = {}
        self._paused = False
        # requests that arrived while intake was paused: (model, arrays, futures, slo, time)
        self._pending: list[tuple[str, list[np.ndarray], list[cf.Future], float | None, float]]
        self._pending = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RouterCore:
        self._thread.start()
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def stop(self) -> None:
        async def close() -> None:
            for c in self._clients.values():
                await c.close()  # type: ignore[attr-defined]

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # the serving plan's parts, as the rest of the router reads them
    @property
    def topo(self) -> Topology:
        return self.served.topo

    @property
    def dp(self) -> DataPlane:
        return self.served.plane

    @property
    def io(self) -> Mapping[str, ModelIO]:
        return self.served.io

    @property
    def pool_partition(self) -> Mapping[int, str]:
        return self.served.pool_partition

    @property
    def vgpu_url(self) -> Mapping[int, str]:
        return self.served.vgpu_url

    def now_us(self) -> float:
        return (time.monotonic_ns() - self._t0) / 1e3

    def in_flight(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------------ intake

    def submit(
        self, model: str, inputs: dict[str, np.ndarray], slo_us: float | None = None
    ) -> list[cf.Future]:
        """Enqueue every row of `inputs` as one request; thread-safe. Each future resolves to
        that row's outputs ({name: array with a batch of 1}) or raises Dropped/StageFailed."""
        io = self.io.get(model)
        if io is None:
            raise PoolpipeError(f"router: unknown model {model!r}; serving {sorted(self.io)}")
        arrays = [np.asarray(inputs[t.name]) for t in io.inputs]
        n = int(arrays[0].shape[0])
        futures: list[cf.Future] = [cf.Future() for _ in range(n)]
        self._loop.call_soon_threadsafe(self._add, model, arrays, futures, slo_us)
        return futures

    def _add(
        self,
        model: str,
        arrays: list[np.ndarray],
        futures: list[cf.Future],
        slo_us: float | None,
        arrived_us: float | None = None,
    ) -> None:
        now = self.now_us()
        if self._paused:
            self._pending.append((model, arrays, futures, slo_us, now))
            return
        if arrived_us is not None:
            now = arrived_us  # held during a switch: its time in the queue counts
        mi = self.topo.model_index(model)
        slo = slo_us if slo_us is not None else self.topo.models[mi].slo_us
        stats = self.stats[model]
        for i, fut in enumerate(futures):
            req = Request(next(self._ids), mi, now, now + slo - self.reply_margin_us)
            rows = [a[i : i + 1] for a in arrays]
            self._reqs[req.id] = _Req(req, fut, rows, now + slo, rows)
            stats.arrivals += 1
            self.dp.add_request(req, now)
        self._decide()

    # ------------------------------------------------------------------ statistics

    def reset_stats(self) -> None:
        """Counters, windows, busy times and stage factors from zero (thread-safe); what
        recalibration has learnt stays."""

        async def reset() -> None:
            self.stats = {m.name: ModelStats() for m in self.topo.models}
            self.pool_busy_us = [0.0] * len(self.topo.pools)
            self._window_marks, self._busy_marks = {}, {}
            self._stage_factors.clear()

        asyncio.run_coroutine_threadsafe(reset(), self._loop).result(10)

    def take_stage_factors(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan, measured over reserved compute time of the stage
        calls since the last call (thread-safe): what the simulator draws execution times
        from to predict this router (poolpipe.sim.engine.SimConfig.stage_factors). Only
        calls that found their vGPU idle count, so waiting in a node's queue is left to the
        simulator; what remains is how much slower stages run under load than when they were
        calibrated one at a time (on a shared host, mostly each other's CPU)."""

        async def take() -> tuple[tuple[float, ...], ...]:
            out = tuple(tuple(self._stage_factors[p.id]) for p in self.topo.pools)
            self._stage_factors.clear()
            return out

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(10)

    def take_window(self) -> tuple[list[dict], list[dict]]:
        """What happened since the last call (thread-safe): one row per model (arrivals,
        on time, late, dropped, failed, latency p50/p99 ms, mean batch) and one per pool
        (busy ms). The live figures for the warehouse's per-minute statistics."""
        fut = asyncio.run_coroutine_threadsafe(self._take_window(), self._loop)
        return fut.result(10)

    async def _take_window(self) -> tuple[list[dict], list[dict]]:
        models = []
        for name, s in self.stats.items():
            last = self._window_marks.get(name, (0, 0, 0, 0, 0, 0, Counter()))
            lat = np.asarray(s.latency_us[last[5] :]) / 1e3
            batches = s.batch_sizes - last[6]
            n_batches = sum(batches.values())
            models.append(
                {
                    "model": name,
                    "arrivals": s.arrivals - last[0],
                    "on_time": s.on_time - last[1],
                    "late": s.late - last[2],
                    "dropped": s.dropped - last[3],
                    "failed": s.failed - last[4],
                    "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
                    "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
                    "mean_batch": (
                        sum(b * n for b, n in batches.items()) / n_batches if n_batches else None
                    ),
                }
            )
            self._window_marks[name] = (
                s.arrivals,
                s.on_time,
                s.late,
                s.dropped,
                s.failed,
                len(s.latency_us),
                Counter(s.batch_sizes),
            )
        pools = []
        for p in self.topo.pools:
            busy = self.pool_busy_us[p.id] - self._busy_marks.get(p.id, 0.0)
            self._busy_marks[p.id] = self.pool_busy_us[p.id]
            pools.append(
                {
                    "model": self.topo.models[p.model].name,
                    "pool": p.id,
                    "gpu_type": p.gpu,
                    "block_start": p.start,
                    "block_end": p.end,
                    "vgpus": len(p.vgpus),
                    "busy_ms": busy / 1e3,
                }
            )
        return models, pools

    # ------------------------------------------------------------------ plan switch

    def switch(self, served: ServedPlan, flush_timeout_s: float) -> dict[str, float]:
        """Pipeline-flush migration to a new plan (thread-safe; blocks until done): pause
        intake (new requests wait, none is dropped), let every queued and in-flight request
        of the old plan finish, switch, then resume with the held requests. Returns the
        downtime (µs), the requests held, and those the flush could not finish in time
        (failed explicitly)."""
        fut = asyncio.run_coroutine_threadsafe(self._switch(served, flush_timeout_s), self._loop)
        return fut.result()

    async def _switch(self, served: ServedPlan, flush_timeout_s: float) -> dict[str, float]:
        t0 = self.now_us()
        self._paused = True
        drain = getattr(self.dp, "drain", None)
        if drain is not None:  # queued requests leave now instead of waiting for company
            drain()
            self._decide()
        deadline = t0 + flush_timeout_s * 1e6
        while self._reqs and self.now_us() < deadline:
            await asyncio.sleep(0.0005)
        left = list(self._reqs.values())
        self._fail(left, "the plan was switched before this request could finish")
        if self._wake is not None:
            self._wake.cancel()
        self._wake, self._wake_at = None, math.inf
        self.served = served
        for m in served.topo.models:
            self.stats.setdefault(m.name, ModelStats())
        self.pool_busy_us = [0.0] * len(served.topo.pools)
        self._busy_marks = {}
        self._stage_factors.clear()  # pool ids of the old plan
        self._recent.clear()
        now = self.now_us()
        for v, u in served.vgpu_url.items():
            if u in self._down:  # still failed: out of the new plan's tables too
                served.plane.set_vgpu_down(v, True, now)
        held, self._pending = self._pending, []
        self._paused = False
        for model, arrays, futures, slo, arrived in held:
            self._add(model, arrays, futures, slo, arrived)
        t1 = self.now_us()
        return {
            "downtime_us": t1 - t0,
            "held": float(sum(len(f) for *_, f, _, _ in held)),
            "failed": float(len(left)),
        }

    # ------------------------------------------------------------------ decisions

    def _decide(self) -> None:
        now = self.now_us()
        dec: Decisions = self.dp.decide(now)
        for drop in dec.drops:
            r = self._reqs.pop(drop.request.id, None)
            if r is not None:
                self.stats[self.topo.models[r.req.model].name].dropped += 1
                r.future.set_exception(Dropped(f"{DROP_MARKER}: {drop.reason}"))
        for d in dec.dispatches:
            task = self._loop.create_task(self._run_dispatch(d))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if dec.wake_at_us is not None and dec.wake_at_us != self._wake_at:
            if self._wake is not None:
                self._wake.cancel()
            self._wake_at = dec.wake_at_us
            delay = max(0.0, (dec.wake_at_us - now) / 1e6)
            self._wake = self._loop.call_later(delay, self._on_wake)

    def _on_wake(self) -> None:
        self._wake, self._wake_at = None, math.inf
        self._decide()

    def _observe(self, pool: int, factor: float) -> None:
        """A stage call's measured / reserved time: kept for the simulator, and when the
        pool's recent median leaves the band, its latencies are scaled by it."""
        self._stage_factors[pool].append(factor)
        recent = self._recent[pool]
        recent.append(factor)
        if len(recent) < RECALIBRATE_EVERY:
            return
        f = float(np.median(recent))
        recent.clear()
        set_latencies = getattr(self.dp, "set_latencies", None)
        if not self.recalibrate or set_latencies is None or abs(f - 1.0) <= RECALIBRATE_BAND:
            return
        topo = self.topo
        lats = tuple(x * f for x in topo.pools[pool].latency_us)
        new = with_latencies(topo, {pool: lats})
        set_latencies(new)
        self.served = replace(self.served, topo=new)
        self.recalibrations += 1

    # ------------------------------------------------------------------ execution

    def _client(self, url: str):
        c = self._clients.get(url)
        if c is None:
            import tritonclient.grpc.aio as grpcaio

            c = self._clients[url] = grpcaio.InferenceServerClient(url)
        return c

    async def _run_dispatch(self, d: Dispatch) -> None:
        import tritonclient.grpc as grpcclient

        reqs = [self._reqs[r.id] for r in d.requests if r.id in self._reqs]
        if not reqs:
            return
        # this dispatch runs to its end on the plan it was made with, even across a rollout
        served, busy = self.served, self.pool_busy_us
        topo, dp, pool_partition, vgpu_url = (
            served.topo,
            served.plane,
            served.pool_partition,
            served.vgpu_url,
        )
        name = topo.models[d.model].name
        io = served.io[name]
        self.stats[name].batch_sizes[len(reqs)] += 1
        for h, hop in enumerate(d.hops):
            pool = topo.pools[hop.pool]
            partition = pool_partition[hop.pool]
            last = pool.end == topo.pools[topo.pipelines[d.pipeline].pools[-1]].end
            first = pool.start == 0
            inputs = []
            for k in range(len(reqs[0].tensors)):
                x = np.concatenate([r.tensors[k] for r in reqs])
                in_name = io.inputs[k].name if first else f"in_{k}"
                t = grpcclient.InferInput(in_name, list(x.shape), kserve_dtype(x.dtype))
                t.set_data_from_numpy(x)
                inputs.append(t)
            start = self.now_us()
            # a call sent while the vGPU is still busy waits in the node's queue first
            slot = (partition, hop.vgpu)
            idle = self._calls[slot] == 0
            self._calls[slot] += 1
            dp.on_stage_started(StageReport(d.id, h, start, None), start)
            try:
                result = await self._client(vgpu_url[hop.vgpu]).infer(
                    partition, inputs, client_timeout=self.stage_timeout_s
                )
            except Exception as exc:
                self._calls[slot] -= 1
                now = self.now_us()
                dp.on_stage_done(StageReport(d.id, h, start, now), now)
                self._stage_failed(dp, vgpu_url[hop.vgpu], reqs, f"{partition}: {exc}")
                return
            end = self.now_us()
            self._calls[slot] -= 1
            busy[hop.pool] += end - start
            if idle and dp is self.dp:
                self._observe(hop.pool, (end - start) / max(1.0, hop.end_us - hop.start_us))
            if dp.on_stage_done(StageReport(d.id, h, start, end), end) and dp is self.dp:
                self._decide()
            names = [t.name for t in io.outputs] if last else None
            outs = _outputs(result, names)
            for i, r in enumerate(reqs):
                r.tensors = [o[i : i + 1] for o in outs]
        if d.final:
            now = self.now_us()
            stats = self.stats[name]
            for r in reqs:
                self._reqs.pop(r.req.id, None)
                stats.latency_us.append(now - r.req.arrival_us)
                if now <= r.due_us:
                    stats.on_time += 1
                else:
                    stats.late += 1
                r.future.set_result({t.name: v for t, v in zip(io.outputs, r.tensors, strict=True)})

    def _stage_failed(self, dp: DataPlane, url: str, reqs: list[_Req], why: str) -> None:
        """A stage call failed: every vGPU of that node leaves the reservation tables at once,
        the batch's requests start over on another path (once), else they fail explicitly;
        one whose deadline has passed meanwhile is dropped by the scheduler like any late
        request (a deadline miss, not a failure: a live path remains). The node is watched
        until it answers again."""
        now = self.now_us()
        if dp is self.dp and url not in self._down:
            self._down.add(url)
            for v, u in self.vgpu_url.items():
                if u == url:
                    dp.set_vgpu_down(v, True, now)
            task = self._loop.create_task(self._watch(url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        retry = []
        for r in reqs:
            if r.req.id not in self._reqs:
                continue
            if dp is self.dp and r.attempts < 2:
                r.attempts += 1
                r.tensors = r.inputs
                retry.append(r)
                self.stats[self.topo.models[r.req.model].name].retried += 1
            else:
                self._fail([r], f"{why} (node {url}; no attempt left to retry)")
        if retry:
            live = self._has_live_path(retry[0].req.model)
            for r in retry:
                if live:
                    self.dp.add_request(r.req, now)
                else:
                    self._fail([r], f"no live path for this model: {why} (node {url})")
            self._decide()

    def _has_live_path(self, model: int) -> bool:
        down = {v for v, u in self.vgpu_url.items() if u in self._down}
        topo = self.topo
        return any(
            all(any(v not in down for v in topo.pools[p].vgpus) for p in topo.pipelines[i].pools)
            for i in topo.models[model].pipelines
        )

    async def _watch(self, url: str, every_s: float = 0.5) -> None:
        """Poll a failed node until it is ready again; then its vGPUs return to service."""
        import tritonclient.grpc.aio as grpcaio

        while url in self._down:
            await asyncio.sleep(every_s)
            probe = grpcaio.InferenceServerClient(url)
            models = {
                self.pool_partition[self.topo.vgpus[v].pool]
                for v, u in self.vgpu_url.items()
                if u == url
            }
            try:
                ready = await probe.is_server_live(client_timeout=1.0)
                for m in models:
                    ready = ready and await probe.is_model_ready(m, client_timeout=1.0)
            except Exception:
                ready = False
            finally:
                await probe.close()
            if ready:
                old = self._clients.pop(url, None)  # its channel may be in back-off
                if old is not None:
                    await old.close()  # type: ignore[attr-defined]
                self._down.discard(url)
                now = self.now_us()
                for v, u in self.vgpu_url.items():
                    if u == url:
                        self.dp.set_vgpu_down(v, False, now)
                self.recoveries += 1
                self._decide()

    def _fail(self, reqs: list[_Req], why: str) -> None:
        for r in reqs:
            if self._reqs.pop(r.req.id, None) is not None:
                self.stats[self.topo.models[r.req.model].name].failed += 1
                r.future.set_exception(StageFailed(f"{FAIL_MARKER}: {why}"))


def _outputs(result, names: list[str] | None) -> list[np.ndarray]:
    """The response's tensors in order: by name for the model's outputs, else out_0, ..."""
    if names is None:
        names = sorted(
            (o.name for o in result.get_response().outputs), key=lambda s: int(s.split("_")[1])
        )
    return [result.as_numpy(n) for n in names]
