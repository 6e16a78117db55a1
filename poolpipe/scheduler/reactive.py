"""The reactive data plane of the paper's ablation (§7.4): no reservations, each pool batches on
its own when one of its vGPUs is idle.

Requests are spread over a model's pipelines by smooth weighted round-robin on planned
throughput. The first pool of a pipeline forms a batch: the largest one (up to the planned
batch) whose compute still meets the oldest request's share of the SLO for that stage. The
batch then flows through the later pools intact (re-batching would gather feature maps from
several vGPUs), queueing FIFO at each until one of its vGPUs is idle.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from poolpipe.scheduler.messages import (
    DROP_CANNOT_MEET,
    DROP_DEADLINE_PASSED,
    DROP_OVERLOAD,
    DataPlane,
    Decisions,
    Dispatch,
    Drop,
    Hop,
    Request,
    StageReport,
)
from poolpipe.scheduler.topology import Topology


@dataclass(slots=True)
class _Batch:
    requests: list[Request]
    batch: int
    src_vgpu: int  # where its feature map sits (-1 before the first stage)


class ReactiveScheduler(DataPlane):
    def __init__(self, topo: Topology, max_queue: int | None = None):
        super().__init__("reactive", topo)  # (it never probes: probes stays 0)
        self.max_queue = max_queue
        self.busy = [False] * len(topo.vgpus)
        self.down: set[int] = set()  # vGPUs out of service
        # per pool: its first-stage request queue or later-stage batch queue
        self.req_queue: dict[int, deque[Request]] = {
            pipe.pools[0]: deque() for pipe in topo.pipelines
        }
        self.batch_queue: dict[int, deque[_Batch]] = {p.id: deque() for p in topo.pools}
        self._rr = [0] * len(topo.pools)
        self._credit = [[0.0] * len(m.pipelines) for m in topo.models]
        self._stage_frac = _stage_fractions(topo)
        self._dirty: set[int] = set()
        self._rejected: list[Drop] = []
        self._inflight: dict[int, tuple[Dispatch, _Batch]] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ contract

    def add_request(self, req: Request, now: float) -> bool:
        model = self.topo.models[req.model]
        credit = self._credit[req.model]
        # smooth weighted round-robin over the model's pipelines
        best = 0
        for i, pid in enumerate(model.pipelines):
            credit[i] += self.topo.pipelines[pid].throughput
            if credit[i] > credit[best]:
                best = i
        credit[best] -= model.throughput
        pipe = self.topo.pipelines[model.pipelines[best]]
        first = pipe.pools[0]
        q = self.req_queue[first]
        if self.max_queue is not None and len(q) >= self.max_queue:
            self._rejected.append(Drop(req, DROP_OVERLOAD))
            return True
        q.append(req)
        self._dirty.add(first)
        return True

    def decide(self, now: float) -> Decisions:
        out = Decisions(drops=self._rejected)
        self._rejected = []
        for pid in sorted(self._dirty):
            self._serve_pool(pid, now, out)
        self._dirty.clear()
        return out

    def drain(self) -> None:
        """Nothing to do: the reactive plane never waits for a fuller batch."""
        self._dirty.update(self.req_queue)

    def set_wake_lateness(self, late_us: float) -> None:
        """Nothing to do: the reactive plane never holds a batch for more requests."""

    def set_latencies(self, topo: Topology) -> None:
        self.topo = topo
        self._stage_frac = _stage_fractions(topo)

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        entry = self._inflight.pop(dispatch, None)
        if entry is not None:  # one hop per dispatch here: its vGPU is free again
            x = entry[0].hops[0]
            self.busy[x.vgpu] = False
            self._dirty.add(x.pool)

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        if down:
            self.down.add(vgpu)
        else:
            self.down.discard(vgpu)
        self._dirty.add(self.topo.vgpus[vgpu].pool)

    def on_stage_started(self, report: StageReport, now: float) -> None:
        pass  # nothing is reserved, so nothing to correct

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        d, batch = self._inflight.pop(report.dispatch)
        hop = d.hops[0]
        self.busy[hop.vgpu] = False
        self._dirty.add(hop.pool)
        if not d.final:
            pipe = self.topo.pipelines[d.pipeline]
            nxt = pipe.pools[self.topo.pools[hop.pool].position + 1]
            self.batch_queue[nxt].append(_Batch(batch.requests, batch.batch, hop.vgpu))
            self._dirty.add(nxt)
        return True

    # ------------------------------------------------------------------ pools

    def _idle_vgpu(self, pid: int) -> int:
        vgpus = self.topo.pools[pid].vgpus
        n = len(vgpus)
        r = self._rr[pid]
        for i in range(n):
            v = vgpus[(r + i) % n]
            if not self.busy[v] and v not in self.down:
                self._rr[pid] = (r + i + 1) % n
                return v
        return -1

    def _serve_pool(self, pid: int, now: float, out: Decisions) -> None:
        pool = self.topo.pools[pid]
        pipe = self.topo.pipelines[pool.pipeline]
        slo = self.topo.models[pool.model].slo_us
        later = self.batch_queue[pid]
        first = self.req_queue.get(pid)
        while later or first:
            v = self._idle_vgpu(pid)
            if v < 0:
                return
            if later:
                batch: _Batch | None = later.popleft()
            else:
                batch = None
                while first and batch is None:
                    batch = self._form_batch(first, pipe.batch, pool.latency_us, slo, pid, now, out)
                if batch is None:
                    return
            assert batch is not None
            self._send(pool.id, pipe.id, v, batch, now, out)

    def _form_batch(
        self,
        q: deque[Request],
        planned: int,
        lat: tuple[float, ...],
        slo: float,
        pid: int,
        now: float,
        out: Decisions,
    ) -> _Batch | None:
        head = q[0]
        if head.deadline_us <= now:
            out.drops.append(Drop(q.popleft(), DROP_DEADLINE_PASSED))
            return None
        stage_deadline = head.arrival_us + slo * self._stage_frac[pid]
        b = min(len(q), planned)
        while b > 1 and now + lat[b] > stage_deadline:
            b -= 1
        if now + lat[b] > head.deadline_us:
            out.drops.append(Drop(q.popleft(), DROP_CANNOT_MEET))
            return None
        return _Batch([q.popleft() for _ in range(b)], b, -1)

    def _send(self, pid: int, pipe_id: int, v: int, batch: _Batch, now: float, out: Decisions):
        pool = self.topo.pools[pid]
        pipe = self.topo.pipelines[pipe_id]
        dur = batch.batch * pool.transfer_in_us if batch.src_vgpu >= 0 else 0.0
        lat = pool.latency_us[batch.batch]
        hop = Hop(pid, v, batch.src_vgpu, now, now + dur, now + dur, now + dur + lat)
        d = Dispatch(
            id=next(self._ids),
            model=pool.model,
            pipeline=pipe_id,
            batch=batch.batch,
            requests=batch.requests,
            hops=[hop],
            final=pid == pipe.pools[-1],
            probes=0,
        )
        self.busy[v] = True
        self._inflight[d.id] = (d, batch)
        out.dispatches.append(d)


def _stage_fractions(topo: Topology) -> dict[int, float]:
    """Per pool: the planned latency up to and including its stage, as a fraction of the
    pipeline's (the stage's share of the SLO)."""
    frac: dict[int, float] = {}
    for pipe in topo.pipelines:
        lats = [topo.pools[p].latency_us[pipe.batch] for p in pipe.pools]
        total = sum(lats)
        acc = 0.0
        for p, lat in zip(pipe.pools, lats, strict=True):
            acc += lat
            frac[p] = acc / total
    return frac
