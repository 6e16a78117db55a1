"""The router: poolpipe's serving runtime driven by the real clock, with an executor that
runs each batch along its path of stage workers through tritonclient's asyncio gRPC client,
behind a PyTriton model per served model name that clients call over KServe v2 HTTP/gRPC.

Every serving policy (deadlines, decisions, outcomes, failures and retries, node return,
recalibration, flush migration) is `poolpipe.runtime`'s; this module is I/O. `RouterCore`
runs the runtime in one thread with its own event loop (the runtime is a plain,
single-threaded state machine); PyTriton's inference callables, which run on their own
threads, hand requests over and wait on futures. Every request is answered: its outputs, a
`Dropped` error (deadline cannot be met; the message starts with DROP_MARKER), or a
`StageFailed` error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import TensorSpec
from poolpipe.runtime import (
    DROPPED,
    FAILED,
    Entry,
    Job,
    ModelStats,
    RuntimeConfig,
    ServedPlan,
    ServingRuntime,
    SwitchResult,
)
from poolpipe.scheduler import DataPlane
from poolpipe.scheduler.topology import Topology
from triton_backend.repository import kserve_dtype

DROP_MARKER = "POOLPIPE_DROPPED"
BAD_REQUEST_MARKER = "POOLPIPE_BAD_REQUEST"
FAIL_MARKER = "POOLPIPE_STAGE_FAILED"

T = TypeVar("T")


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


@dataclass
class _Payload:
    """One client row: its reply handle and tensors (inputs kept for a retry)."""

    future: cf.Future
    inputs: list[np.ndarray]
    tensors: list[np.ndarray] = field(default_factory=list)  # after the last stage run


class LoopClock:
    """The event loop's clock, in µs since the router started."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._t0 = time.monotonic_ns()

    def now(self) -> float:
        return (time.monotonic_ns() - self._t0) / 1e3

    def call_at(self, t_us: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(max(0.0, (t_us - self.now()) / 1e6), fn)


class TritonExecutor:
    """Runs each batch hop by hop through the stage workers' gRPC endpoints and answers
    the clients' futures."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stage_timeout_s: float):
        self.loop = loop
        self.stage_timeout_s = stage_timeout_s
        self._clients: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
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
            import tritonclient.grpc.aio as grpcaio

            c = self._clients[url] = grpcaio.InferenceServerClient(url)
        return c

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    # ------------------------------------------------------------------ the port

    def run(self, job: Job) -> None:
        self._spawn(self._run(job))

    def answer(self, entry: Entry, outcome: int, reason: str) -> None:
        fut = entry.payload.future
        if fut.done():
            return
        if outcome == DROPPED:
            fut.set_exception(Dropped(f"{DROP_MARKER}: {reason}"))
        elif outcome == FAILED:
            fut.set_exception(StageFailed(f"{FAIL_MARKER}: {reason}"))
        else:
            fut.set_result(entry.result)

    def check_node(self, node: str, served: ServedPlan) -> None:
        plan: RouterPlan = served.adapter
        models = {
            plan.pool_partition[served.topo.vgpus[v].pool]
            for v, url in served.vgpu_node.items()
            if url == node
        }
        self._spawn(self._check(node, models))

    # ------------------------------------------------------------------ I/O

    async def _run(self, job: Job) -> None:
        import tritonclient.grpc as grpcclient

        rt, served, d = self.rt, job.served, job.dispatch
        plan: RouterPlan = served.adapter
        topo = served.topo
        io = plan.io[topo.models[d.model].name]
        entries = job.entries
        end_block = topo.pools[topo.pipelines[d.pipeline].pools[-1]].end
        for h, hop in enumerate(d.hops):
            pool = topo.pools[hop.pool]
            partition = plan.pool_partition[hop.pool]
            first, last = pool.start == 0, pool.end == end_block
            rows = [e.payload.inputs if first else e.payload.tensors for e in entries]
            inputs = []
            for k in range(len(rows[0])):
                x = np.concatenate([r[k] for r in rows])
                name = io.inputs[k].name if first else f"in_{k}"
                t = grpcclient.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
                t.set_data_from_numpy(x)
                inputs.append(t)
            start = rt.clock.now()
            rt.hop_started(job, h, start)
            try:
                result = await self._client(served.vgpu_node[hop.vgpu]).infer(
                    partition, inputs, client_timeout=self.stage_timeout_s
                )
            except Exception as exc:
                rt.hop_failed(job, h, f"{partition}: {exc}")
                return
            end = rt.clock.now()
            outs = _outputs(result, [t.name for t in io.outputs] if last else None)
            for i, e in enumerate(entries):
                e.payload.tensors = [o[i : i + 1] for o in outs]
                if last:
                    e.result = {
                        t.name: v for t, v in zip(io.outputs, e.payload.tensors, strict=True)
                    }
            rt.hop_done(job, h, start, end)

    async def _check(self, url: str, models: set[str]) -> None:
        """Is the node live with its models ready? (A fresh channel: the old one may be in
        gRPC's reconnect back-off.)"""
        import tritonclient.grpc.aio as grpcaio

        probe = grpcaio.InferenceServerClient(url)
        try:
            ready = await probe.is_server_live(client_timeout=1.0)
            for m in models:
                ready = ready and await probe.is_model_ready(m, client_timeout=1.0)
        except Exception:
            ready = False
        finally:
            await probe.close()
        if ready:
            old = self._clients.pop(url, None)
            if old is not None:
                await old.close()
        self.rt.node_checked(url, bool(ready))


class RouterCore:
    """The runtime on the real clock, in its own thread and event loop; every method may be
    called from any thread."""

    def __init__(
        self,
        served: ServedPlan,
        stage_timeout_s: float = 30.0,
        reply_margin_us: float = 0.0,
        recalibrate: bool = True,
    ):
        self._loop = asyncio.new_event_loop()
        self.clock = LoopClock(self._loop)
        self.executor = TritonExecutor(self._loop, stage_timeout_s)
        self.runtime = ServingRuntime(
            served,
            self.clock,
            self.executor,
            RuntimeConfig(
                reply_margin_us=reply_margin_us,
                recalibrate=recalibrate,
                record_stage_factors=True,
            ),
        )
        self._thread = threading.Thread(target=self._run_loop, name="poolpipe-router", daemon=True)

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

    def in_flight(self) -> int:
        return self.runtime.in_flight()

    # ------------------------------------------------------------------ intake

    def submit(
        self, model: str, inputs: dict[str, np.ndarray], slo_ms: object = None
    ) -> list[cf.Future]:
        """Enqueue every row of `inputs` as one request (at `slo_ms`, the client's parameter
        as sent, or the model's SLO); thread-safe. A request the runtime refuses at the door
        raises BadRequest at once. Each future resolves to that row's outputs ({name: array
        with a batch of 1}) or raises Dropped/StageFailed."""
        io = self.io.get(model)
        arrays = [np.asarray(inputs[t.name]) for t in io.inputs] if io else []
        n = int(arrays[0].shape[0]) if arrays and arrays[0].ndim else 0
        _, slo_us = self.runtime.check(model, n, slo_ms)
        payloads = [_Payload(cf.Future(), [a[i : i + 1] for a in arrays]) for i in range(n)]
        self._loop.call_soon_threadsafe(self._add, model, payloads, slo_us)
        return [p.future for p in payloads]

    def _add(self, model: str, payloads: list[_Payload], slo_us: float | None) -> None:
        self.runtime.submit(self.runtime.topo.model_index(model), payloads, slo_us)

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


def _outputs(result: Any, names: list[str] | None) -> list[np.ndarray]:
    """The response's tensors in order: by name for the model's outputs, else out_0, ..."""
    if names is None:
        names = sorted(
            (o.name for o in result.get_response().outputs), key=lambda s: int(s.split("_")[1])
        )
    return [result.as_numpy(n) for n in names]
