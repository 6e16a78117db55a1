"""The runtime's executor on stage-worker nodes: a hop transport (how a batch's hops travel:
transport.py) composed with a stage client (how a node is called: stages.py,
kserve_http.py), the vGPU gates both share, the node checks, and the answers handed back to
the clients' requests. It runs on the router's event loop; nothing here is a policy."""

from __future__ import annotations

import asyncio
import heapq
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
from triton_backend.router.served import RequestRow, RouterPlan
from triton_backend.router.stages import StageClient
from triton_backend.router.transport import HopTransport


class Gate:
    """One vGPU's stage calls: one at a time, in the order of their reserved starts (a
    call whose turn has come waits for nothing else; one whose earlier turns are still on
    their way waits for them). A call may free the gate ahead (`release_after`: when its
    inputs will have reached the vGPU): the next turn is not given before then, and no
    timer is set unless a turn waits for it."""

    __slots__ = ("busy", "free_at", "heap", "loop", "seq", "timer", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.heap: list[tuple[float, int]] = []
        self.busy = False
        self.free_at = 0.0  # loop.time() from which the gate is free (release_after)
        self.timer: asyncio.TimerHandle | None = None  # a waiting turn's, until free_at
        self.seq = 0
        self.waiting: dict[int, asyncio.Future] = {}

    def add(self, start_us: float) -> tuple[float, int]:
        """A turn at this reserved start (its token)."""
        self.seq += 1
        token = (start_us, self.seq)
        heapq.heappush(self.heap, token)
        return token

    async def turn(self, token: tuple[float, int]) -> None:
        """Wait until the gate is this token's (then it is busy until `release`)."""
        if not self.busy and self.heap[0] == token and self.loop.time() >= self.free_at:
            heapq.heappop(self.heap)
            self.busy = True
            return
        fut = self.loop.create_future()
        self.waiting[token[1]] = fut
        self._next()  # (its turn may have come but for free_at: a timer then)
        await fut  # the gate is ours when this resolves

    def release(self) -> None:
        self.busy = False
        self._next()

    def release_after(self, delay_s: float) -> None:
        """Free the gate `delay_s` from now."""
        self.free_at = self.loop.time() + delay_s
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
        if self.busy or not self.heap or self.heap[0][1] not in self.waiting:
            return
        if self.loop.time() < self.free_at:
            if self.timer is None:
                self.timer = self.loop.call_at(self.free_at, self._freed)
            return
        fut = self.waiting.pop(self.heap[0][1])
        heapq.heappop(self.heap)
        self.busy = True
        fut.set_result(None)

    def _freed(self) -> None:
        self.timer = None
        self._next()


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
        self.rt: ServingRuntime

    def bind(self, runtime: ServingRuntime) -> None:
        self.rt = runtime

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
        self._spawn(self.transport.start(job, self))

    def answer(self, entry: Entry, outcome: Outcome, reason: str) -> None:
        row: RequestRow = entry.payload
        row.request.settle(row.row, outcome, reason, entry.result)

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
        dropped: the plan served now is checked by its own sweep."""
        live, ready = await self.stages.ready(node, sorted(models))
        if not self.rt.serves(served):
            return
        if live and not ready and self.on_empty_node and node not in self._refilling:
            self._refilling.add(node)
            refill = self.loop.run_in_executor(None, self.on_empty_node, node)
            refill.add_done_callback(lambda f: self._refilling.discard(node))
        why = "no answer" if not live else "its models are not loaded" if not ready else ""
        if self.rt.node_checked(node, None if live is None else ready, why, served):
            self.stages.forget(node)  # its old connections went with its failure
