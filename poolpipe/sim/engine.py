"""Deterministic discrete-event simulation of a plan's cluster, driving a data plane from
`poolpipe.scheduler` on virtual time.

Every vGPU, uplink and downlink executes its jobs in the order of their reserved start times,
each as soon as its input is there and the previous job has finished; execution may run
faster or slower than reserved (jitter), and the data plane hears what really happened
through the same reports the live router sends. Entries of the event queue are
(time, priority, sequence, ...), so ties break the same way on every run.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from poolpipe.scheduler import DataPlane, Decisions, Dispatch, Request, StageReport, Topology
from poolpipe.sim.metrics import DROPPED, LATE, ON_TIME, PENDING, SimResult, summarize

# event priorities at equal times: finished work frees resources before new work is decided
_END, _WAKE = 0, 2


class _Job:
    """One transfer or one compute of a dispatched batch."""

    __slots__ = (
        "compute",
        "d",
        "dur",
        "hop",
        "key",
        "ready",
        "ready_at",
        "res",
        "succ",
        "t0",
        "tr",
    )

    def __init__(
        self, key: float, res: tuple[int, ...], dur: float, d: Dispatch, hop: int, compute: bool
    ):
        self.key = key  # reserved start: the order in which each resource runs its jobs
        self.res = res
        self.dur = dur
        self.ready = False
        self.succ: _Job | None = None
        self.d = d
        self.hop = hop
        self.compute = compute
        self.ready_at = 0.0
        self.t0 = 0.0  # actual start
        self.tr: tuple[float, float] | None = None  # actual transfer into a compute job


@dataclass(frozen=True)
class SimConfig:
    duration_s: float = 30.0
    seed: int = 1
    jitter: float = 0.0  # coefficient of variation of execution time (lognormal, mean 1)
    # Measured execution-time factors per pool (actual / reserved compute time, as a live
    # router records them; indexed by pool id): a compute of a pool that has some takes its
    # reserved time times one of them, drawn at random, instead of the lognormal jitter.
    stage_factors: tuple[tuple[float, ...], ...] = ()
    # Held back from every deadline the data plane schedules for, as the live router holds
    # it back for a request's way in and out; a request still counts as on time when it
    # finishes by arrival + SLO, as the router counts it.
    reply_margin_us: float = 0.0


class Simulator:
    """One run: build with a topology, a fresh data plane and arrivals; call `run()` once."""

    def __init__(
        self,
        topo: Topology,
        data_plane: DataPlane,
        arrival_us: np.ndarray,
        arrival_model: np.ndarray,
        config: SimConfig,
    ):
        self.topo = topo
        self.dp = data_plane
        self.arrival_us = [float(t) for t in arrival_us]
        self.arrival_model = [int(m) for m in arrival_model]
        self.config = config
        self._rng = random.Random(config.seed * 7919 + 17)
        V, S = len(topo.vgpus), len(topo.servers)
        self._V, self._S = V, S
        self._queue: list[list[tuple[float, int, _Job]]] = [[] for _ in range(V + 2 * S)]
        self._busy = [False] * (V + 2 * S)
        self._server_of = [v.server for v in topo.vgpus]
        self._events: list[tuple] = []
        self._seq = 0
        n = len(self.arrival_us)
        self.outcome = [PENDING] * n
        self.finish_us = [math.nan] * n
        # lognormal execution-time factor with mean 1 and CV `jitter`
        self._sigma = math.sqrt(math.log1p(config.jitter**2)) if config.jitter > 0 else 0.0
        self._margin = config.reply_margin_us  # scheduled for, not counted against
        self.drop_reasons: Counter[str] = Counter()
        self.vgpu_busy_us = [0.0] * V
        # per pool: batches run and requests in them (for the mean batch size)
        self.pool_batches = [0] * len(topo.pools)
        self.pool_requests = [0] * len(topo.pools)
        self.transfer_wait_us = 0.0
        self.transfers = 0
        self.sched_seconds = 0.0
        self.sched_per_batch: list[float] = []  # wall s per dispatched batch, per decide call
        self.batches = 0
        self._wake_at = math.inf
        self.now = 0.0

    # ------------------------------------------------------------------ main loop

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        ev = self._events
        times, models = self.arrival_us, self.arrival_model
        slo = [m.slo_us - self.config.reply_margin_us for m in self.topo.models]
        dp = self.dp
        i, n = 0, len(times)
        while i < n or ev:
            if i < n and (not ev or times[i] < ev[0][0]):
                t = times[i]
                self.now = t
                m = models[i]
                dp.add_request(Request(i, m, t, t + slo[m]), t)
                i += 1
                self._decide(t)
                continue
            entry = heapq.heappop(ev)
            t = entry[0]
            self.now = t
            if entry[1] == _END:
                self._end(entry[3], t)
            elif t == self._wake_at:
                self._wake_at = math.inf
                self._decide(t)
        wall = time.perf_counter() - wall0
        return summarize(self, wall)

    def _decide(self, now: float) -> None:
        t0 = time.perf_counter()
        dec = self.dp.decide(now)
        dt = time.perf_counter() - t0
        self.sched_seconds += dt
        if dec.dispatches:
            self.sched_per_batch.append(dt / len(dec.dispatches))
        self._apply(dec, now)

    def _apply(self, dec: Decisions, now: float) -> None:
        for drop in dec.drops:
            self.outcome[drop.request.id] = DROPPED
            self.drop_reasons[drop.reason] += 1
        for d in dec.dispatches:
            self._start_dispatch(d, now)
        w = dec.wake_at_us
        if w is not None and w != self._wake_at:
            self._wake_at = max(w, now)
            self._push(self._wake_at, _WAKE, None)

    def _push(self, t: float, prio: int, job: _Job | None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, prio, self._seq, job))

    # ------------------------------------------------------------------ execution

    def _start_dispatch(self, d: Dispatch, now: float) -> None:
        pools = self.topo.pools
        V, S = self._V, self._S
        if d.hops[0].pool == self.topo.pipelines[d.pipeline].pools[0]:
            self.batches += 1
        prev: _Job | None = None
        first: _Job | None = None
        sigma = self._sigma
        factors = self.config.stage_factors
        n_req = len(d.requests)
        pool_batches, pool_requests = self.pool_batches, self.pool_requests
        server_of = self._server_of
        for h, hop in enumerate(d.hops):
            p = hop.pool
            pool_batches[p] += 1
            pool_requests[p] += n_req
            dur = pools[p].latency_us[d.batch]
            if p < len(factors) and factors[p]:
                dur *= self._rng.choice(factors[p])
            elif sigma > 0:
                dur *= self._rng.lognormvariate(-sigma * sigma / 2, sigma)
            compute = _Job(hop.start_us, (hop.vgpu,), dur, d, h, True)
            if hop.transfer_end_us > hop.transfer_start_us:
                tr = _Job(
                    hop.transfer_start_us,
                    (V + server_of[hop.src_vgpu], V + S + server_of[hop.vgpu]),
                    hop.transfer_end_us - hop.transfer_start_us,
                    d,
                    h,
                    False,
                )
                tr.succ = compute
                self._enqueue(tr)
                head = tr
            else:
                head = compute
            self._enqueue(compute)
            if prev is not None:
                prev.succ = head
            else:
                first = head
            prev = compute
        assert first is not None
        first.ready = True
        first.ready_at = now
        self._try_start(first, now)

    def _enqueue(self, job: _Job) -> None:
        self._seq += 1
        for r in job.res:
            heapq.heappush(self._queue[r], (job.key, self._seq, job))

    def _try_start(self, job: _Job, now: float) -> None:
        if not job.ready:
            return
        busy, queue = self._busy, self._queue
        for r in job.res:
            if busy[r] or queue[r][0][2] is not job:
                return
        for r in job.res:
            heapq.heappop(queue[r])
            busy[r] = True
        job.t0 = now
        self._push(now + job.dur, _END, job)
        if job.compute:
            tr = job.tr
            if tr is None:
                report = StageReport(job.d.id, job.hop, now, None)
            else:
                report = StageReport(job.d.id, job.hop, now, None, tr[0], tr[1])
            self.dp.on_stage_started(report, now)
        else:
            self.transfer_wait_us += now - job.ready_at
            self.transfers += 1

    def _end(self, job: _Job, now: float) -> None:
        busy, queue = self._busy, self._queue
        for r in job.res:
            busy[r] = False
        d = job.d
        decide = False
        if job.compute:
            v = job.res[0]
            self.vgpu_busy_us[v] += now - job.t0
            decide = self.dp.on_stage_done(StageReport(d.id, job.hop, job.t0, now), now)
            if job.hop == len(d.hops) - 1 and d.final:
                outcome, finish, margin = self.outcome, self.finish_us, self._margin
                for req in d.requests:
                    finish[req.id] = now
                    outcome[req.id] = ON_TIME if now <= req.deadline_us + margin else LATE
        succ = job.succ
        if succ is not None:
            if not job.compute:
                succ.tr = (job.t0, now)
            succ.ready = True
            succ.ready_at = now
            self._try_start(succ, now)
        for r in job.res:
            if queue[r] and not busy[r]:
                self._try_start(queue[r][0][2], now)
        if decide:
            self._decide(now)
