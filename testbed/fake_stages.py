"""A StageClient without Triton: nodes that run each partition as a plain function of its
inputs and take a given time for it on the event loop, so that the router's executor (its
transports, vGPU gates, hop reports and chain timing) can be tested with no server.

Each node runs one call at a time (a model instance), in the order calls reach it.
A call to a node that is `down` cannot reach it (StageUnreachable); one that takes longer
than the call's timeout is a StageTimeout. A call carrying a chain (`poolpipe_next`) runs
every hop of it, node by node, and answers the whole model's outputs with each hop's
(start, end, sent) times, as python_onnx_model.py does; a hop whose node is down fails the
chain there ("POOLPIPE_HOP k: ..."), one with no budget left is not forwarded, and a feature
map is forwarded no sooner than its hop's "after_us" after the hop before it began.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from triton_backend import HOPS_OUTPUT
from triton_backend.router.stages import (
    Outputs,
    StageCall,
    StageCallError,
    StageTimeout,
    StageUnreachable,
)


@dataclass(frozen=True)
class FakePartition:
    """What one partition does: its outputs from its inputs (arrays in order), their
    names (out_0, ... between stages; the model's own names for the last partition), and
    how long a batch of n rows takes (seconds)."""

    run: Callable[[list[np.ndarray]], list[np.ndarray]]
    outputs: tuple[str, ...]
    seconds: Callable[[int], float]


@dataclass(frozen=True)
class Call:
    """A partition run on a node (times on the loop's clock, seconds): the call reached the
    node at `sent_s`, waited for the node's one instance, ran from `start_s` to `end_s`."""

    node: str
    model: str
    rows: int
    sent_s: float
    start_s: float
    end_s: float


@dataclass
class FakeStages:
    """Nodes running `partitions` (by model name), on the loop it is given."""

    loop: asyncio.AbstractEventLoop
    partitions: Mapping[str, FakePartition]
    down: set[str] = field(default_factory=set)  # nodes that cannot be reached
    slow: dict[str, float] = field(default_factory=dict)  # node -> extra seconds per call
    calls: list[Call] = field(default_factory=list)  # every partition run, in order
    http: dict[str, str] = field(default_factory=dict)  # node -> its HTTP address, if any
    chains: list[list[dict]] = field(default_factory=list)  # every chain's hops, in order
    _busy: dict[str, asyncio.Lock] = field(default_factory=dict)  # a node runs one at a time

    async def infer(self, node: str, call: StageCall) -> Outputs:
        params = dict(call.parameters or {})
        xs = [x for _, x in call.inputs]
        if "poolpipe_next" in params:
            work = self._chain(node, call.model, xs, params)
        else:
            work = self._run(node, call.model, xs)
        try:
            result = await asyncio.wait_for(work, call.timeout_s)
        except TimeoutError:
            raise StageTimeout(f"no answer from {node} in {call.timeout_s:g} s") from None
        return {n: result[n] for n in call.outputs} if call.outputs is not None else result

    def http_address(self, node: str) -> str | None:
        return self.http.get(node)

    async def _run(self, node: str, model: str, xs: list[np.ndarray]) -> dict[str, np.ndarray]:
        return (await self._timed(node, model, xs))[0]

    async def _timed(
        self, node: str, model: str, xs: list[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """The partition's outputs, and when it started and ended (CLOCK_MONOTONIC ns, as
        a node measures them: its wait in the node's queue left out)."""
        if node in self.down:
            raise StageUnreachable(f"cannot reach {node}: connection refused")
        part = self.partitions[model]
        rows = len(xs[0])
        sent = self.loop.time()
        async with self._busy.setdefault(node, asyncio.Lock()):
            start, start_ns = self.loop.time(), time.monotonic_ns()
            await asyncio.sleep(part.seconds(rows) + self.slow.get(node, 0.0))
            self.calls.append(Call(node, model, rows, sent, start, self.loop.time()))
            end_ns = time.monotonic_ns()
        return dict(zip(part.outputs, part.run(xs), strict=True)), start_ns, end_ns

    async def _chain(
        self, node: str, model: str, xs: list[np.ndarray], params: dict[str, str]
    ) -> dict[str, np.ndarray]:
        hops = [{"url": node, "model": model}, *json.loads(params["poolpipe_next"])]
        self.chains.append(hops)
        names = json.loads(params["poolpipe_outputs"])
        budget_ns = float(params.get("poolpipe_budget_us", "inf")) * 1e3
        t0 = time.monotonic_ns()
        times: list[int] = []
        outs: dict[str, np.ndarray] = {}
        start = t0
        for k, hop in enumerate(hops):
            if k:  # forwarded no sooner than its "after_us" after the last hop began
                wait_ns = start + float(hop.get("after_us", 0)) * 1e3 - time.monotonic_ns()
                if wait_ns > 0:
                    await asyncio.sleep(wait_ns / 1e9)
                times[-1] = time.monotonic_ns()  # the last hop's "sent"
            if k and time.monotonic_ns() - t0 >= budget_ns:
                raise StageCallError(f"POOLPIPE_HOP {k}: POOLPIPE_DEADLINE: no time left")
            try:
                outs, start, end = await self._timed(hop["url"], hop["model"], xs)
            except StageCallError as exc:
                raise StageCallError(f"POOLPIPE_HOP {k}: {hop['url']}: {exc}") from None
            times += [start, end, end]
            xs = [outs[n] for n in self.partitions[hop["model"]].outputs]
        rows = len(next(iter(outs.values())))
        return {
            **{n: outs[n] for n in names},
            HOPS_OUTPUT: np.tile(np.array(times, np.int64), (rows, 1)),
        }

    async def ready(self, node: str, models: Sequence[str]) -> tuple[bool | None, bool]:
        live = node not in self.down
        return live, live and all(m in self.partitions for m in models)

    def forget(self, node: str) -> None:
        pass

    async def close(self) -> None:
        pass
