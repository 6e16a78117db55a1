"""How a dispatched batch's hops travel to the stage-worker nodes (the `HopTransport`s):

- `RelayTransport` ("router"): every hop is sent from the router; a stage's outputs come
  back to the router and go out again to the next stage's node.
- `ChainTransport` ("chain"): the batch goes to its first node with the rest of its path;
  each node sends its feature map straight to the next (python_onnx_model.py), and the
  model's outputs come back once, with each hop's measured times: straight from the last
  node to the router's inbox (answers.py) where the router has one, else back along the
  chain. The router's NIC carries inputs and outputs only.

A transport reserves its vGPU turns when the executor hands it a job (`start`, in the
runtime's dispatch order) and returns the coroutine that runs the job; it calls the nodes
through the executor's StageClient and reports every hop to the runtime. Neither knows
HTTP from gRPC, nor which stage client it has (a fake one in the tests)."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import numpy as np

from poolpipe.client.control import chain_signature
from poolpipe.domain.gpus import on_node
from poolpipe.runtime import Job, ServingRuntime
from triton_backend import HOPS_OUTPUT
from triton_backend.router.answers import Answer, AnswerInbox
from triton_backend.router.gates import Gate
from triton_backend.router.served import RouterPlan
from triton_backend.router.stages import (
    Outputs,
    StageCall,
    StageCallError,
    StageClient,
    StageTimeout,
)
from triton_backend.router.tracing import Tracing

# Chain overheads kept for take_chain_overheads (the latest this many).
KEPT_OVERHEADS = 4096


class HopHost(Protocol):
    """What a transport uses of the executor that runs its jobs (NodeExecutor)."""

    rt: ServingRuntime
    stages: StageClient
    stage_timeout_s: float
    tracing: Tracing | None  # the requests' notes, when the router traces

    def gate(self, generation: int, vgpu: int) -> Gate: ...


class HopTransport(Protocol):
    name: str  # as `--transport` names it

    def start(self, job: Job, ex: HopHost) -> Coroutine[Any, Any, None]:
        """Take the job's turns on its vGPUs now (the order of these calls is the order of
        the turns' reserved starts at each vGPU); the coroutine runs the job."""
        ...


async def _until(clock: Any, t_us: float) -> None:
    """Sleep until the router's clock reads `t_us` (at once when it has passed)."""
    left = t_us - clock.now()
    if left > 0:
        await asyncio.sleep(left / 1e6)


def _stacked(rows: list[np.ndarray]) -> np.ndarray:
    """A batch's rows as one tensor; one row is sent as it is (a 4.3-MB copy less)."""
    return rows[0] if len(rows) == 1 else np.concatenate(rows)


def _inputs_us(hop: Any, h: int) -> float:
    """How long hop `h`'s requests' inputs are reserved on its server's downlink (a first
    hop whose topology times them: scheduler.topology.with_inputs; 0 otherwise). Such a hop
    is sent at its transfer's reserved start, not before (another batch's transfer may
    hold the link until then), and its vGPU's next turn may be sent once the compute is
    due to begin: the node's queue keeps the order."""
    return hop.transfer_end_us - hop.transfer_start_us if h == 0 else 0.0


def _compute_start(hop: Any, sent: float, sending: float) -> float:
    """When a hop sent at `sent` starts computing, as far as the router knows: at once
    where nothing is timed on its way in; else once its inputs are in (`sending` after
    `sent`), and not before its reserved start: inputs may be reserved to arrive while the
    vGPU still runs the turn before (the node's queue keeps the order), and reporting the
    inputs' arrival as the start would move the reservation earlier, freeing a slot the
    vGPU does not have for the next batch (which then starts late by that much)."""
    return max(sent + sending, hop.start_us) if sending else sent


def _node_failed(exc: BaseException) -> bool:
    """A stage call that timed out leaves its node in service (too busy is not dead)."""
    return not isinstance(exc, StageTimeout)


class RelayTransport:
    """Each hop from the router, on its vGPU when its turn comes there (one stage call at a
    time per vGPU, in the order of reserved starts, as the simulator runs them): a call
    sent to a busy node would wait in its queue, out of the runtime's sight, while the
    runtime took the vGPU for free."""

    name = "router"

    def start(self, job: Job, ex: HopHost) -> Coroutine[Any, Any, None]:
        gen = job.generation
        turns = []
        for hop in job.dispatch.hops:
            gate = ex.gate(gen, hop.vgpu)
            turns.append((gate, gate.add(hop.start_us)))
        return self._run(job, ex, turns)

    async def _run(
        self, job: Job, ex: HopHost, turns: list[tuple[Gate, tuple[float, int]]]
    ) -> None:
        rt, served, d = ex.rt, job.served, job.dispatch
        clock, stages, timeout_s = rt.clock, ex.stages, ex.stage_timeout_s
        plan: RouterPlan = served.adapter
        topo = served.topo
        io = plan.io[topo.models[d.model].name]
        entries = job.entries
        end_block = topo.pools[topo.pipelines[d.pipeline].pools[-1]].end
        taken = 0  # turns taken so far
        try:
            for h, hop in enumerate(d.hops):
                pool = topo.pools[hop.pool]
                partition = plan.pool_partition[hop.pool]
                first, last = pool.start == 0, pool.end == end_block
                rows = [e.payload.inputs if first else e.payload.tensors for e in entries]
                inputs = [
                    (io.inputs[k].name if first else f"in_{k}", _stacked([r[k] for r in rows]))
                    for k in range(len(rows[0]))
                ]
                gate, token = turns[h]
                await gate.turn(token)
                taken = h + 1
                sending = _inputs_us(hop, h)
                released = False  # the gate's, at the compute's start (inputs sent)
                try:
                    if sending:
                        await _until(clock, hop.transfer_start_us)
                    sent = clock.now()
                    start = _compute_start(hop, sent, sending)
                    if start - hop.start_us > job.slack_us and not rt.hop_late(job, h, start):
                        return  # dropped: the rest of its path is released
                    if sending:
                        rt.hop_started(job, h, start, sent, sent + sending)
                        gate.release_after(sending / 1e6)
                        released = True
                    else:
                        rt.hop_started(job, h, start)
                    try:
                        trace = None if ex.tracing is None else ex.tracing.traceparent(job, h)
                        call = StageCall(partition, inputs, timeout_s, trace=trace)
                        result = await stages.infer(served.vgpu_node[hop.vgpu], call)
                    except Exception as exc:
                        rt.hop_failed(job, h, f"{partition}: {exc}", _node_failed(exc))
                        return
                    end = clock.now()
                    start = min(start, end)  # (inputs faster than their reservation)
                finally:
                    if not released:
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
            for gate, token in turns[taken:]:  # turns it will not take
                gate.forget(token)


class ChainTransport:
    """The job's path as a chain of nodes: its batch to the first node when its turn comes
    there, with the rest of the path (signed with `key` when given: the nodes' key); the
    first vGPU's turn ends when its hop's reserved time is up (the nodes after it take
    hops as feature maps arrive, in Triton's queue). When the answer is back, every hop is
    reported with the times the nodes measured (durations exact; the gaps between hosts,
    whose clocks differ, taken as reserved), or the hop that failed. A one-hop job goes by
    `relay`. `stages`: the client for the chain's first call (default: the executor's).
    `on_overhead(us)`: each chain's overhead (see chain_times), as it is measured.
    `inbox`: where the last node sends the model's outputs (the calls back along the chain
    then carry the hops' times alone); None: the outputs come back along the chain.
    `http_of(node)`: a node's KServe v2 HTTP address where known, which the node before it
    sends the feature map to (python_onnx_model.py: `_HttpHops`); gRPC where None.
    `feed_of(node)`: the node's feed (its process's watch address, node/feed.py) where
    known: the node before writes large maps into its shared memory there.
    `node_time(node, t_us)`: the router's time `t_us` on the node's clock (ns), or None where
    not known (clocks.py): the hop after it then carries ``at_ns``, when to send."""

    name = "chain"

    def __init__(
        self,
        key: str | None = None,
        stages: StageClient | None = None,
        on_overhead: Callable[[float], None] = lambda us: None,
        inbox: AnswerInbox | None = None,
        http_of: Callable[[str], str | None] = lambda node: None,
        feed_of: Callable[[str], str | None] = lambda node: None,
        node_time: Callable[[str, float], int | None] = lambda node, t_us: None,
    ):
        self.key = key
        self.node_time = node_time
        self.stages = stages
        self.http_of = http_of
        self.feed_of = feed_of
        self.on_overhead = on_overhead
        self.inbox = inbox
        self.relay = RelayTransport()
        self.overheads_us: deque[float] = deque(maxlen=KEPT_OVERHEADS)

    def start(self, job: Job, ex: HopHost) -> Coroutine[Any, Any, None]:
        hops = job.dispatch.hops
        if len(hops) == 1:
            return self.relay.start(job, ex)
        gate = ex.gate(job.generation, hops[0].vgpu)
        return self._run(job, ex, gate, gate.add(hops[0].start_us))

    async def _run(self, job: Job, ex: HopHost, gate: Gate, token: tuple[float, int]) -> None:
        rt, served, d = ex.rt, job.served, job.dispatch
        plan: RouterPlan = served.adapter
        io = plan.io[served.topo.models[d.model].name]
        entries = job.entries
        inputs = [  # (one request's inputs as they lie: in its door's ring, no copy)
            (spec.name, _stacked([e.payload.inputs[k] for e in entries]))
            for k, spec in enumerate(io.inputs)
        ]
        # each hop's feature map leaves at its transfer's reserved start: so long after the
        # sending hop's compute began, and where the sending node's clock is known against
        # the router's, at that time on its clock if sooner (a stage that began late but
        # ended in time sends in its slot; clocks.py)
        hops: list[dict[str, Any]] = []
        for k, nxt in enumerate(d.hops[1:]):
            # (a GPU of a node of several: the node's address, the model named for the GPU)
            node = served.vgpu_node[nxt.vgpu]
            url, model = on_node(node, plan.pool_partition[nxt.pool])
            after = round(max(0.0, nxt.transfer_start_us - d.hops[k].start_us), 1)
            hop = {"url": url, "model": model, "after_us": after}
            at = self.node_time(served.vgpu_node[d.hops[k].vgpu], nxt.transfer_start_us)
            if at is not None:
                hop["at_ns"] = at
            http = self.http_of(node)
            if http:  # the node before sends it over KServe v2 HTTP (cheaper for MBs)
                hop["http"] = http
                feed = self.feed_of(node)
                if feed:  # ... its bytes through the node's feed
                    hop["feed"] = feed
            hops.append(hop)
        names = [t.name for t in io.outputs]
        inbox, answer_id, answered = self.inbox, "", None
        if inbox is not None:  # the last node answers the router itself
            await inbox.start()
            answer_id, answered = inbox.expect()
            hops.append({"answer": inbox.address_for(hops[-1]["url"]), "id": answer_id})
        back = [] if inbox is not None else names  # what comes back along the chain
        path = json.dumps(hops)
        params = {"poolpipe_next": path, "poolpipe_outputs": json.dumps(back)}
        if self.key is not None:
            params["poolpipe_sig"] = chain_signature(self.key, path)
        hop0 = d.hops[0]
        await gate.turn(token)
        sending = _inputs_us(hop0, 0)
        if sending:
            await _until(rt.clock, hop0.transfer_start_us)
        sent = rt.clock.now()
        start = _compute_start(hop0, sent, sending)
        if start - hop0.start_us > job.slack_us and not rt.hop_late(job, 0, start):
            gate.release()
            if inbox is not None:
                inbox.forget(answer_id)  # no answer comes
            return  # dropped: the rest of its path is released
        turn_us = sending if sending else hop0.end_us - hop0.start_us
        gate.release_after(max(0.0, turn_us / 1e6))
        if sending:
            rt.hop_started(job, 0, start, sent, sent + sending)
        else:
            rt.hop_started(job, 0, start)
        # the chain's time: until the last SLO of its requests runs out; nobody forwards
        # a feature map with none left
        params["poolpipe_budget_us"] = str(int(max(e.due_us for e in entries) - sent))
        stages = self.stages or ex.stages
        try:
            call = StageCall(
                plan.pool_partition[hop0.pool],
                inputs,
                ex.stage_timeout_s,
                parameters=params,
                outputs=[*back, HOPS_OUTPUT],
                trace=None if ex.tracing is None else ex.tracing.traceparent(job, 0),
            )
            calling = stages.infer(served.vgpu_node[hop0.vgpu], call)
            if answered is None:
                result = await calling
            else:
                answer = await _answered(calling, answered, len(d.hops) - 1, ex.stage_timeout_s)
        except Exception as exc:
            failed, why = failed_hop(exc)
            out_of_time = _out_of_time(why)
            times = reserved_times(d.hops, min(start, rt.clock.now()))
            for h in range(1, failed + 1):
                rt.hop_done(job, h - 1, *times[h - 1])
                if h < failed or not out_of_time:
                    rt.hop_started(job, h, times[h][0])
            if out_of_time and not rt.hop_late(job, failed):
                return  # its requests' SLOs ran out on the way: dropped, the path let go
            partition = plan.pool_partition[d.hops[failed].pool]
            rt.hop_failed(job, failed, f"{partition}: {why}", _node_failed(exc))
            return
        finally:
            if inbox is not None:
                inbox.forget(answer_id)
        now = rt.clock.now()
        if answered is None:
            outs, measured = _outputs(result, names), result[HOPS_OUTPUT][0]
        else:
            outs, measured = [answer.tensors[n] for n in names], np.array(answer.rows)
        times, overhead = chain_times(d.hops, measured, sent, now)
        self.overheads_us.append(overhead)
        self.on_overhead(overhead)
        for i, e in enumerate(entries):
            e.payload.tensors = [o[i : i + 1] for o in outs]
            e.result = {t.name: v for t, v in zip(io.outputs, e.payload.tensors, strict=True)}
        for h, (s_us, e_us) in enumerate(times):
            if h:
                rt.hop_started(job, h, s_us)
            rt.hop_done(job, h, s_us, e_us)


async def _answered(
    calling: Coroutine[Any, Any, Outputs], answer: asyncio.Future[Answer], last: int, wait_s: float
) -> Answer:
    """A chain's answer, sent to the router's inbox by its last hop (`last`), once it is
    there; the call along the chain (its hops' times, or which hop failed) goes on in the
    background when the answer comes first. A call that failed raises as the chain's
    failure; one that succeeded without the answer arriving in `wait_s` fails the last hop."""
    call = asyncio.ensure_future(calling)
    either: set[asyncio.Future[Any]] = {call, answer}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if answer.done() and not answer.cancelled():
        call.add_done_callback(lambda c: c.cancelled() or c.exception())  # nothing left to do
        return answer.result()
    call.result()  # the chain's failure, where it failed
    try:
        return await asyncio.wait_for(asyncio.shield(answer), wait_s)
    except (TimeoutError, asyncio.CancelledError):
        raise StageCallError(
            f"POOLPIPE_HOP {last}: its answer did not reach the router's inbox in {wait_s:g} s"
        ) from None


def failed_hop(exc: BaseException) -> tuple[int, str]:
    """Which hop of a chain failed ("POOLPIPE_HOP k: why" from the nodes; 0 otherwise:
    the first node did not answer)."""
    text = exc.message() if callable(getattr(exc, "message", None)) else str(exc)  # type: ignore[attr-defined]
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


def reserved_times(hops: Sequence[Any], start: float) -> list[tuple[float, float]]:
    """Each hop's (start, end) as reserved, shifted to begin at `start`."""
    shift = start - hops[0].start_us
    return [(h.start_us + shift, h.end_us + shift) for h in hops]


def chain_times(
    hops: Sequence[Any], measured: np.ndarray, sent: float, back: float
) -> tuple[list[tuple[float, float]], float]:
    """Each hop's (start, end) on the router's clock from what the nodes measured (start,
    end, sent ns per hop, each on its own host's clock), and the chain's overhead: how
    much later the answer came than the reservations' end, the path shifted to when it
    was sent (from its inputs' reserved start where they are timed: _inputs_us). A hop
    that waited for its vGPU or its link until its reserved start is on time; what the
    nodes' forwarding, their stubs and the answer's way back take beyond the reserved
    transfers is not (the reply margin holds its p99 back, see MarginMeter; negative:
    the chain ran ahead of its reservations). Placed back from when the answer came,
    never before the batch (and its reserved inputs) could have reached the first node."""
    n = len(hops)
    took = [max(0.0, float(measured[3 * h + 1] - measured[3 * h]) / 1e3) for h in range(n)]
    gaps = [_inputs_us(hops[0], 0)] + [h.transfer_end_us - h.transfer_start_us for h in hops[1:]]
    first = hops[0].transfer_start_us if gaps[0] else hops[0].start_us
    overhead = back - (sent + hops[-1].end_us - first)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * n
    floor = min(back, sent + gaps[0])
    end = back
    for h in range(n - 1, -1, -1):
        begin = max(floor, end - took[h])
        times[h] = (begin, max(begin, end))
        end = max(floor, begin - gaps[h])
    return times, overhead


def _outputs(result: Outputs, names: list[str] | None) -> list[np.ndarray]:
    """The answer's tensors in order: by name for the model's outputs, else out_0, out_1,
    ... (a partition's feature maps)."""
    if names is None:
        names = sorted(result, key=lambda s: int(s.split("_")[1]))
    return [result[n] for n in names]
