"""How the router calls a stage-worker node: the `StageClient` protocol, its errors, and its
gRPC implementation (KServe v2 HTTP in kserve_http.py). A client is driven from the
router's event loop; nodes are named by their gRPC address (their identity in a plan's
ServedPlan.vgpu_node and in the inventory), and a client that speaks another protocol maps
that to its own address for the node.

Whoever calls needs to know one thing of a failure: did the node fail to serve (it cannot
be reached, or answered with an error: take it out of service), or did it not answer in
time (`StageTimeout`: a node too busy to answer is not a dead one)?"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from poolpipe.domain.gpus import on_node
from triton_backend.node.repository import kserve_dtype

CALLER_THREADS = 512  # most gRPC stage calls in flight at once (see GrpcStages)
CHECK_TIMEOUT_S = 1.0  # a node check's calls wait this long for an answer


class StageCallError(Exception):
    """A stage call that failed: the node's error message, or what went wrong on the way.
    The node counts as failed (unreachable or unable to serve the call)."""

    def message(self) -> str:
        return str(self)


class StageUnreachable(StageCallError):
    """The node could not be reached (nobody listens, the network refused or timed out
    before a connection was made)."""


class StageTimeout(StageCallError):
    """The node took the call but gave no answer within the stage timeout: too busy, or
    hung; not known to be dead."""


# A stage's inputs in the partition's order, (tensor name, array) each; its outputs by name.
Inputs = Sequence[tuple[str, np.ndarray]]
Outputs = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class StageCall:
    """One inference call of a partition model."""

    model: str  # the partition model's name on the node
    inputs: Inputs
    timeout_s: float  # no answer by then: StageTimeout
    parameters: Mapping[str, str] | None = None  # the request's (a chain's path, budget, ...)
    outputs: Sequence[str] | None = None  # only these outputs (default: all of them)
    trace: str | None = None  # a W3C traceparent the call carries to the node (tracing.py)


class StageClient(Protocol):
    """Calls stage-worker nodes (KServe v2 inference). Every coroutine runs on the loop the
    client was made for."""

    async def infer(self, node: str, call: StageCall) -> Outputs:
        """The outputs of `call` on `node`; a StageCallError (StageTimeout,
        StageUnreachable) when it fails."""
        ...

    async def ready(self, node: str, models: Sequence[str]) -> tuple[bool | None, bool]:
        """(live, ready): whether `node` answers at all (None: it took the check but gave
        no answer in time: busy, or hung; not known to be dead), and whether every one of
        `models` is loaded and ready there."""
        ...

    def forget(self, node: str) -> None:
        """Drop what is kept for `node` (its connections): it failed, or came back."""
        ...

    async def close(self) -> None: ...


def grpc_error(exc: BaseException) -> StageCallError:
    """A tritonclient gRPC exception as the stage error it is."""
    message, status = getattr(exc, "message", None), getattr(exc, "status", None)
    text = message() if callable(message) else str(exc)
    status = str(status()) if callable(status) else ""
    if "DEADLINE_EXCEEDED" in status:
        return StageTimeout(str(text))
    if "UNAVAILABLE" in status:
        return StageUnreachable(str(text))
    return StageCallError(str(text))


class GrpcStages:
    """Stage calls over KServe v2 gRPC with tritonclient's synchronous client, each on a
    reused caller thread and settled on the loop. Measured with bench-serving's part 1 (one
    call at a time): the client's gRPC futures started a thread of gRPC's per call whenever
    no other call was in flight on the channel, which was most of the router's CPU per
    request (the asyncio client is about 0.3 ms per call slower still). Node checks use a
    fresh asyncio channel each (an old one may be in gRPC's reconnect back-off)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._clients: dict[str, Any] = {}
        # stage calls block one of these threads each (a call per vGPU at a time, and
        # chains in flight: threads are started only when none is idle)
        self._callers = cf.ThreadPoolExecutor(CALLER_THREADS, thread_name_prefix="poolpipe-call")

    def _client(self, node: str) -> Any:
        c = self._clients.get(node)
        if c is None:
            import tritonclient.grpc as grpcclient

            c = self._clients[node] = grpcclient.InferenceServerClient(on_node(node, "")[0])
        return c

    async def infer(self, node: str, call: StageCall) -> Outputs:
        import tritonclient.grpc as grpcclient

        wire = []
        for name, x in call.inputs:
            t = grpcclient.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
            t.set_data_from_numpy(x)
            wire.append(t)
        kw: dict[str, Any] = {"client_timeout": call.timeout_s}
        if call.parameters is not None:
            kw["parameters"] = dict(call.parameters)
        if call.outputs is not None:
            kw["outputs"] = [grpcclient.InferRequestedOutput(n) for n in call.outputs]
        if call.trace is not None:
            kw["headers"] = {"traceparent": call.trace}
        client = self._client(node)
        try:
            result = await self.loop.run_in_executor(
                self._callers, partial(client.infer, on_node(node, call.model)[1], wire, **kw)
            )
        except Exception as exc:
            raise grpc_error(exc) from None
        names = call.outputs or [o.name for o in result.get_response().outputs]
        return {n: result.as_numpy(n) for n in names}

    async def ready(self, node: str, models: Sequence[str]) -> tuple[bool | None, bool]:
        import tritonclient.grpc.aio as grpcaio

        node, models = on_node(node, "")[0], [on_node(node, m)[1] for m in models]
        probe = grpcaio.InferenceServerClient(node)
        live: bool | None = False
        ready = False
        try:
            live = ready = bool(await probe.is_server_live(client_timeout=CHECK_TIMEOUT_S))
            for m in models:
                ready = ready and await probe.is_model_ready(m, client_timeout=CHECK_TIMEOUT_S)
        except Exception as exc:
            ready = False
            if isinstance(grpc_error(exc), StageTimeout):
                live = None
        finally:
            await probe.close()
        return live, bool(ready)

    def forget(self, node: str) -> None:
        old = self._clients.pop(node, None)
        if old is not None:
            old.close()

    async def close(self) -> None:
        self._callers.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
        self._clients.clear()
