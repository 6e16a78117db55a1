"""The runtime's executor on stage-worker nodes: a hop transport (how a batch's hops travel:
transport.py) composed with a stage client (how a node is called: stages.py,
kserve_http.py), the vGPU gates both share (gates.py), the node checks, and the answers
handed back to the clients' requests. It runs on the router's event loop; nothing here is a
policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from poolpipe.runtime import (
    Entry,
    Executor,
    Job,
    Outcome,
    PlanUsage,
    ServedPlan,
    ServingRuntime,
)
from triton_backend.router.gates import Gate
from triton_backend.router.served import RequestRow, RouterPlan
from triton_backend.router.stages import StageClient
from triton_backend.router.tracing import TracedRuntime, Tracing
from triton_backend.router.transport import HopTransport


class NodeExecutor(Executor):
    """Runs the runtime's jobs on stage-worker nodes with `transport` and `stages`, each
    stage call waiting at most `stage_timeout_s`. `on_empty_node`: called (off the loop,
    blocking) with a failed node that answers again without its models (restarted empty,
    e.g. by its operator) to load them; None: wait for them."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: HopTransport,
        stages: StageClient,
        stage_timeout_s: float,
    ):
        self.loop = loop
        self.transport = transport
        self.stages = stages
        self.stage_timeout_s = stage_timeout_s
        self.on_empty_node: Callable[[str], None] | None = None
        self._refilling: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._checks: set[asyncio.Task] = set()  # node checks in flight
        self._gates: dict[int, dict[int, Gate]] = {}  # generation -> vGPU -> its turns
        self.tracing: Tracing | None = None  # the requests' notes, when traced
        self.rt: ServingRuntime

    def bind(self, runtime: ServingRuntime) -> None:
        self.rt = runtime

    def trace(self, tracing: Tracing | None) -> None:
        """Note every batch, hop and answer of traced requests from now on (None: stop)."""
        self.tracing = tracing
        rt = self.rt.runtime if isinstance(self.rt, TracedRuntime) else self.rt
        self.rt = rt if tracing is None else TracedRuntime(rt, tracing)  # type: ignore[assignment]

    def gate(self, generation: int, vgpu: int) -> Gate:
        """The turns of `vgpu` of the plan of that generation."""
        gates = self._gates.get(generation)
        if gates is None:
            gates = self._gates[generation] = {}
        gate = gates.get(vgpu)
        if gate is None:
            gate = gates[vgpu] = Gate(self.loop)
        return gate

    @property
    def generations_kept(self) -> list[int]:
        """The plans whose vGPU gates are kept (those with jobs since they began)."""
        return sorted(self._gates)

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._checks):  # a node check in flight ends here, not mid-close
            task.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)
        await self.stages.close()

    # ------------------------------------------------------------------ the port

    def run(self, job: Job) -> None:
        if self.tracing is not None:
            self.tracing.dispatched(job)
        self._spawn(self.transport.start(job, self))

    def answer(self, entry: Entry, outcome: Outcome, reason: str) -> None:
        row: RequestRow = entry.payload
        request = row.request
        if request.trace is not None:
            request.trace.tracing.ended(request.trace, row.row, outcome, reason)
        request.settle(row.row, outcome, reason, entry.result)

    def check_node(self, node: str, served: ServedPlan) -> None:
        plan: RouterPlan = served.adapter
        models = {
            plan.pool_partition[served.topo.vgpus[v].pool]
            for v, url in served.vgpu_node.items()
            if url == node
        }
        task = self.loop.create_task(self._check(node, models, served))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def retire(self, usage: PlanUsage) -> None:
        self._gates.pop(usage.generation, None)

    # ------------------------------------------------------------------ node checks

    async def _check(self, node: str, models: set[str], served: ServedPlan) -> None:
        """Is the node live with its models ready? One live without them is refilled; one
        that gave no answer in time is reported as such (None: busy is not dead). A check
        that outlived its plan (a rollout ended and unloaded the models it looked for) is
        told to the runtime, which drops its answer (the plan served now is checked by its
        own sweep) but asks a node still down again."""
        live, ready = await self.stages.ready(node, sorted(models))
        current = self.rt.serves(served)
        if current and live and not ready and self.on_empty_node and node not in self._refilling:
            self._refilling.add(node)
            refill = self.loop.run_in_executor(None, self.on_empty_node, node)
            refill.add_done_callback(lambda f: self._refilling.discard(node))
        why = "no answer" if not live else "its models are not loaded" if not ready else ""
        if self.rt.node_checked(node, None if live is None else ready, why, served):
            self.stages.forget(node)  # its old connections went with its failure
