"""The reservation-based data plane of docs/design/dataplane.md: probe every pipeline, pick
the one with the least waiting, take the largest batch that meets the oldest request's
deadline, and then drop, wait until the last moment, or reserve the path and dispatch. At a
light load (LIGHT_LOAD) a short batch waits only until its pipeline can start it (at once
where it is idle): no batch is needed to keep up, and holding would only spend the
requests' time.

Two refinements under overload: a new oldest request that misses its deadline at the planned
batch only because the pipelines are booked up is dropped rather than served in a smaller,
less efficient batch (admission); and when the topology carries latencies above the plan's
batch (`build_topology(..., larger_batches=True)`), a full batch for a one-partition pipeline
whose vGPUs are booked ahead is held until its start and then grows to the largest batch that
still meets the deadline. (Not for multi-partition pipelines: holding gives up the links the
path had, and larger batches send larger transfers; fcn-d6 on hc3-large at load 0.85 fell
from 0.989 to 0.955 on time with it.)

Two variants share the machinery: `eager` (dispatch whatever is queued, never wait) and
`deferred` (Symphony's window: dispatch once one more request could no longer fit).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Final

from librt.vecs import vec
from mypy_extensions import i64

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler.bounds import Bounds
from poolpipe.scheduler.memo import ProbeMemo
from poolpipe.scheduler.messages import (
    DROP_CANNOT_MEET,
    DROP_DEADLINE_PASSED,
    DROP_OVERLOAD,
    DataPlane,
    Decisions,
    Dispatch,
    Drop,
    Request,
    StageReport,
)
from poolpipe.scheduler.probe import LOST, Probe, Prober
from poolpipe.scheduler.state import ClusterIndex, Latencies, Tables
from poolpipe.scheduler.topology import Pipeline, Topology

POLICIES: Final = ("adaptive", "eager", "deferred")
# Wake up this long before the computed last moment, so float round-off cannot turn an
# on-time dispatch into a late one (µs).
WAKE_GUARD_US: Final = 1.0
# The shortest hold worth a wake-up (µs): a slack above the guard by less than this is a
# round-off of the last wake (now + slack - guard == now in floating point), and a hold
# for it would wake the driver at the same instant for ever (a virtual clock never moves).
MIN_HOLD_US: Final = 1e-3
# Light load (docs/design/dataplane.md): where the model's arrival rate is at most this
# share of what its pipelines serve at the batch queued, a batch short of its planned size
# is held only until its pipeline can start it (requests arriving meanwhile join it), not
# for its last moment: no batch is needed to keep up, so a longer hold would only spend the
# requests' time. 0: always hold for the last moment (the published plane).
LIGHT_LOAD: Final = 0.5
# Load-proportional packing (probe.Prober.pack): of equally good vGPUs, the lowest-numbered
# takes the batch, so at a low load the highest stay idle and can be released (Symphony's
# rule). False: equally good vGPUs take turns (the plane's `spread` form).
PACK: Final = True
# Packing holds only while the model's arrival rate is at most this share of the rate its
# plan serves it at; above it equally good vGPUs take turns. Packed under load, a pool's
# first vGPUs and their server's NIC are reserved back to back, and a slip of the host there
# delays every batch behind it: hc2-large at 64 emulated GPUs (D = 40) served ppipe 598 req/s
# live packed and 924 with turns (docs/serving.md). Below it the highest vGPUs of a pool go
# idle and can be given back (./run bench-packing: at a tenth and at 0.3 of capacity).
PACK_LOAD: Final = 1 / 3
# The arrival rate's time constant (µs): an exponentially decaying count of arrivals.
RATE_WINDOW_US: Final = 1e6


class _Queue:
    """A model's requests in deadline order: a list from `head` on (compiled, a deque's
    methods are Python calls); the taken ones at its front are dropped in batches."""

    __slots__ = ("head", "items")

    def __init__(self) -> None:
        self.items: list[Request] = []
        self.head = 0

    def __len__(self) -> int:
        return len(self.items) - self.head

    def __iter__(self) -> Iterator[Request]:
        return iter(self.items[self.head :])

    def at(self, i: int) -> Request:
        return self.items[self.head + i]

    def append(self, req: Request) -> None:
        self.items.append(req)

    def insert(self, i: int, req: Request) -> None:
        self.items.insert(self.head + i, req)

    def popleft(self) -> Request:
        items = self.items
        req = items[self.head]
        h = self.head + 1
        if h == len(items):
            items.clear()  # (compiled: a call, where `del items[:]` made a slice object)
            h = 0
        elif h >= 64:
            del items[:h]
            h = 0
        self.head = h
        return req


class _InFlight:
    """Dispatches not yet ended, by id. Ids are handed out one after another, so a list
    from `base` on (None: ended) rather than a dict (compiled, a dict boxed every id);
    the ended ones at its front are dropped in batches."""

    __slots__ = ("base", "head", "items")

    def __init__(self) -> None:
        self.base = 0  # the id of items[0]
        self.head = 0  # items before it have ended
        self.items: list[Dispatch | None] = []

    def add(self, d: Dispatch) -> None:
        """The next id's dispatch (ids are added in order, none skipped)."""
        self.items.append(d)

    def get(self, did: int) -> Dispatch | None:
        i = did - self.base
        if i < self.head or i >= len(self.items):
            return None
        return self.items[i]

    def pop(self, did: int) -> Dispatch | None:
        d = self.get(did)
        if d is None:
            return None
        items = self.items
        items[did - self.base] = None
        h, n = self.head, len(items)
        while h < n and items[h] is None:
            h += 1
        # (dropped once they are half the list, not each time some end: with hundreds in
        # flight, moving them down often costs more than the room it frees)
        if h >= 64 and 2 * h >= n:
            del items[:h]
            self.base += h
            h = 0
        self.head = h
        return d


class _Models:
    """Per model: its queue in deadline order and its batching state (compiled: the
    per-model numbers unboxed vectors, librt.vecs, where a list's floats and large ints
    were objects made at every write)."""

    __slots__ = (
        "admitted",
        "arrived",
        "arrived_at",
        "dirty",
        "lead",
        "probes_since",
        "queues",
        "until_start",
        "wake",
    )

    def __init__(self, n: int) -> None:
        self.queues = [_Queue() for _ in range(n)]
        self.dirty = [False] * n  # to be decided at the next decide()
        self.wake = vec[float]([math.inf] * n)  # the model's batch is held until then, ...
        # ... for its vGPUs to be free (a backlog: arrivals alone do not end the hold), or
        # for its last moment (each arrival decides it again)
        self.until_start = [False] * n
        self.probes_since = vec[i64]([0] * n)  # Prober.probes at its last dispatch
        self.lead = [0] * n  # the index of its pipeline chosen last
        # id of the head admitted at its planned batch (docs/design/dataplane.md)
        self.admitted = vec[i64]([-1] * n)
        # arrivals, each decaying with RATE_WINDOW_US, as of `arrived_at` (the last one)
        self.arrived = vec[float]([0.0] * n)
        self.arrived_at = vec[float]([0.0] * n)

    def all_dirty(self) -> None:
        for m in range(len(self.dirty)):
            self.dirty[m] = True


class ReservationScheduler(DataPlane):
    """The reservation data plane: per model a queue in deadline order and the batching
    policy; the probe, reserve and correct (probe.Prober) on the reservation tables of
    every vGPU and every server's uplink and downlink (state.Tables)."""

    def __init__(
        self,
        topo: Topology,
        policy: str = "adaptive",
        max_queue: int | None = None,
        wake_guard_us: float = WAKE_GUARD_US,
        reference: bool = False,
        light_load: float = LIGHT_LOAD,
        pack: bool = PACK,
        pack_load: float = PACK_LOAD,
    ):
        if policy not in POLICIES:
            raise PoolpipeError(f"unknown batching policy {policy!r}; choose {', '.join(POLICIES)}")
        if max_queue is not None and max_queue < 1:
            raise PoolpipeError(f"max_queue must be >= 1, got {max_queue}")
        if not 0.0 <= light_load < 1.0:
            raise PoolpipeError(f"light_load must be in [0, 1), got {light_load}")
        name = policy if policy != "adaptive" else "reservation"
        super().__init__("reference" if reference and name == "reservation" else name, topo)
        self.policy = policy
        self.max_queue = max_queue
        # A waiting batch wakes this long before its last moment: a live driver's timers
        # fire late by up to about a millisecond, the simulator's never do.
        self.wake_guard_us = wake_guard_us
        self.wake_guard_floor_us = wake_guard_us  # set_wake_lateness adds to it
        self.light_load = light_load if policy == "adaptive" else 0.0  # baselines as published
        # the layers, each owning its state: bounds < memo < probe (docs/design/dataplane.md)
        self.index = ClusterIndex(topo)
        self.tables = Tables(topo)
        self.lat = Latencies(topo)
        self.bounds = Bounds(self.index, self.tables, self.lat)
        self.memo = ProbeMemo(self.index, self.tables, self.lat)
        self.prober = Prober(self.index, self.tables, self.lat, self.bounds, self.memo)
        self.prober.pack = pack
        # arrivals per µs above which model m's vGPUs take turns (PACK_LOAD; inf: never)
        self._pack_below = vec[float]([pack_load * m.throughput / 1e6 for m in topo.models])
        # The specification (reference.py): every probe by the plain rule, every pipeline
        # probed in the model's order; the fast plane must decide exactly as this does.
        self.reference = reference
        if reference:
            self.prober.plain = True
            self.prober.prune = False
        self.models = _Models(len(topo.models))
        self._rejected: list[Drop] = []
        self._inflight = _InFlight()
        self._next_dispatch = 0

    # ------------------------------------------------------------------ contract

    def add_request(self, req: Request, now: float) -> bool:
        m = req.model
        models = self.models
        q = models.queues[m]
        if self.light_load > 0.0:
            models.arrived[m] = self._arrivals(m, now) + 1.0
            models.arrived_at[m] = now
        if self.max_queue is not None and len(q) >= self.max_queue:
            self._rejected.append(Drop(req, DROP_OVERLOAD))
            return True
        n = len(q)
        if n == 0 or q.at(n - 1).deadline_us <= req.deadline_us:
            q.append(req)
        else:
            # Deadline order: a request with a shorter SLO (or one that arrived earlier but
            # reached the plane later) goes before the longer ones, so that every batch,
            # the queue's first b, meets each of its members' deadlines when it meets the
            # head's. (FIFO sent such a request in a batch timed for its elders: late.)
            i = n - 1
            while i > 0 and q.at(i - 1).deadline_us > req.deadline_us:
                i -= 1
            q.insert(i, req)
        if models.wake[m] == math.inf or not models.until_start[m]:
            # A batch held for its last moment is decided again with the newcomer: a larger
            # batch takes longer, so its last moment is earlier (woken at the smaller batch's,
            # the head went alone and the rest missed their deadlines behind it: a ResNet-50
            # alone on one real H200 vGPU, 50 req/s, 17% dropped)
            models.dirty[m] = True
            return True
        # joins a batch held until its vGPUs are free (a backlog): nothing to decide unless
        # another model is due
        return any(dirty for dirty in models.dirty)  # (compiled: a loop, not a call)

    def decide(self, now: float) -> Decisions:
        out = Decisions([], [], None)
        if self._rejected:
            out.drops.extend(self._rejected)
            self._rejected.clear()
        models = self.models
        dirty, wakes = models.dirty, models.wake
        M = len(dirty)
        while True:
            before = len(out.dispatches)
            for m in range(M):
                if dirty[m] or wakes[m] <= now:
                    dirty[m] = False
                    wakes[m] = math.inf
                    self._decide_model(m, now, out)
            if M == 1 or len(out.dispatches) == before:
                break
            # Links are shared across models: the slack a waiting model computed before
            # these reservations may be gone, so it looks again.
            dispatches = out.dispatches
            again = False
            for m in range(M):
                if wakes[m] < math.inf and not any(
                    dispatches[j].model == m for j in range(before, len(dispatches))
                ):
                    dirty[m] = again = True
            if not again:
                break
        wake = math.inf
        for w in wakes:
            if w < wake:
                wake = w
        out.wake_at_us = wake if wake < math.inf else None
        self.probes = self.prober.probes
        return out

    def drain(self) -> None:
        """Stop waiting for fuller batches: every queued request goes out at its next
        decision (a rollout flushes the old plan this way instead of waiting an SLO)."""
        self.policy = "eager"
        self.models.all_dirty()

    def set_wake_lateness(self, late_us: float) -> None:
        self.wake_guard_us = self.wake_guard_floor_us + max(0.0, late_us)

    def set_latencies(self, topo: Topology) -> None:
        """Plan with the pools' latencies of `topo`, the same topology measured anew (a live
        router recalibrating under load); what is already reserved stays as it is."""
        self.topo = topo
        self.lat.read(topo)
        self.prober.invalidate()
        self.models.all_dirty()

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        """Take a vGPU out of (or back into) service: while down it is reserved forever, so
        no probe picks it; what it had reserved stays until the driver reports it done."""
        self.prober.corrected(vgpu, -1 - vgpu, now, math.inf if down else now, now)
        self.models.all_dirty()

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        """Release what the failed hop and the later ones still hold from `now` on."""
        d = self._inflight.pop(dispatch)
        if d is None:
            return
        self.prober.release(d, hop, now)
        self.models.all_dirty()

    def on_stage_started(self, report: StageReport, now: float) -> None:
        d = self._inflight.get(report.dispatch)
        if d is not None:
            self.prober.correct(d, report, now)

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        d = self._inflight.get(report.dispatch)
        if d is not None:
            self.prober.correct(d, report, now)
            if report.hop == len(d.hops) - 1:
                self._inflight.pop(report.dispatch)
        return False

    # ------------------------------------------------------------------ probe

    @property
    def prune_pipelines(self) -> bool:
        """Skip and cut probes by the bounds and the memo (False: the plain rule's probes,
        for the equivalence tests)."""
        return self.prober.prune

    @prune_pipelines.setter
    def prune_pipelines(self, on: bool) -> None:
        self.prober.prune = on

    def probe(self, pipe: Pipeline, b: int, now: float) -> Probe:
        """Where and when a batch of b would run on `pipe` if dispatched now. Nothing is
        reserved; the answer is kept to answer a later probe the same (memo.py)."""
        pr = self._probe(pipe.id, b, now, math.inf)
        self.probes = self.prober.probes
        if pr.kept_from == -math.inf:
            return pr
        return Probe(pr.wait_us, pr.finish_us, pr.start_us, self.memo.hops(pr))

    def _probe(self, pi: int, b: int, now: float, cut: float) -> Probe:
        return self.prober.probe(pi, b, now, cut)

    # ------------------------------------------------------------------ batching loop

    def _decide_model(self, m: int, now: float, out: Decisions) -> None:
        models = self.models
        q = models.queues[m]
        pipe_batch, no_wait = self.index.pipe_batch, self.lat.no_wait
        while len(q) > 0:
            head = q.at(0)
            if head.deadline_us <= now:
                q.popleft()
                out.drops.append(Drop(head, DROP_DEADLINE_PASSED))
                continue
            # 1. the pipeline with the least waiting at its planned batch
            pipe, pr = self._choose(m, now)
            # 2. the largest batch that meets the head's deadline
            planned = pipe_batch[pipe]
            b = planned
            if (
                self.policy == "adaptive"
                and pr.finish_us > head.deadline_us
                and models.admitted[m] != head.id
                and now + no_wait[pipe] <= head.deadline_us
            ):
                # Admission: a new head that misses at the planned batch only because the
                # pipelines are booked up is dropped, not served in a smaller batch: that
                # batch would spend GPU time the queued and coming requests need. (The
                # published data plane does the same; googlenet on hc2-large at load 0.95:
                # 0.980 -> 0.988 on time.)
                q.popleft()
                out.drops.append(Drop(head, DROP_CANNOT_MEET))
                continue
            models.admitted[m] = head.id  # from now on it may go in a smaller batch
            while pr.finish_us > head.deadline_us and b > 1:
                b -= 1
                pr = self._probe(pipe, b, now, math.inf)
            rescue = pr.finish_us > head.deadline_us
            if rescue:
                rescued = self._rescue(m, pipe, head.deadline_us, len(q), now)
                if rescued is None:
                    q.popleft()
                    out.drops.append(Drop(head, DROP_CANNOT_MEET))
                    continue
                pipe, b, pr = rescued
                planned = pipe_batch[pipe]
            # 3. wait for more requests, or dispatch
            n = len(q)
            top = self.lat.grow_to[pipe]
            if self.policy == "adaptive" and b == planned < top and n >= b and not rescue:
                # Backlog (a one-partition pipeline whose topology has latencies above the
                # plan's batch): its vGPUs are booked until `start`. Hold the batch until then,
                # so that requests arriving meanwhile can join it, then send the largest batch
                # that meets the head's deadline. Not for a head rescued to this pipeline: a
                # hold stops the model's queue behind it, and under a backlog every head came
                # to be one the model's slower pipelines could no longer meet, so they idled
                # while the fastest held the whole queue (colorization-v2's four pipelines on
                # hc2-large at 90% of its max-min rates: 39% on time from second 18 on).
                start = pr.start_us
                if start > now + 2 * self.wake_guard_us:
                    models.wake[m] = start - self.wake_guard_us
                    models.until_start[m] = True
                    return
                while n > b < top:
                    grown = self._probe(pipe, b + 1, now, math.inf)
                    if grown.finish_us > head.deadline_us:
                        break
                    b, pr = b + 1, grown
            if n < b:
                pn = self._probe(pipe, n, now, math.inf)
                if self.policy != "eager" and pn.finish_us <= head.deadline_us:
                    if self.policy == "deferred":
                        # Symphony: go once a batch of n + 1 could no longer make it.
                        slack = head.deadline_us - self._probe(pipe, n + 1, now, math.inf).finish_us
                    else:
                        slack = head.deadline_us - pn.finish_us
                    if self._light(m, n, now):
                        # no batch needed to keep up: wait only until the pipeline can start
                        # it (requests arriving meanwhile join), not for its last moment
                        slack = min(slack, pn.start_us - now)
                    if slack - self.wake_guard_us > MIN_HOLD_US:
                        models.wake[m] = now + slack - self.wake_guard_us
                        models.until_start[m] = False
                        return
                if pn.finish_us <= head.deadline_us:
                    b, pr = n, pn
                # else latency is not monotone in b here: send the n on b's timing
            self._dispatch(m, pipe, b, pr, now, out)

    def _arrivals(self, m: int, now: float) -> float:
        """Model m's arrivals, each weighed exp(-age / RATE_WINDOW_US), as of `now`."""
        models = self.models
        age = now - models.arrived_at[m]
        return models.arrived[m] * math.exp(-age / RATE_WINDOW_US) if age > 0 else models.arrived[m]

    def arrival_rate(self, m: int, now: float) -> float:
        """Model m's arrival rate as this plane estimates it (requests per µs; 0 where
        light_load is off: it does not count)."""
        return self._arrivals(m, now) / RATE_WINDOW_US

    def _light(self, m: int, n: int, now: float) -> bool:
        """Is holding model m's batch of n for more requests worthless? The model's arrivals
        are at most `light_load` of what its pipelines serve at batches of n: no batch is
        needed to keep up."""
        if self.light_load == 0.0:
            return False
        return self.arrival_rate(m, now) <= self.light_load * self.lat.serves[m][n]

    def _busy(self, m: int, now: float) -> bool:
        """Does model m arrive above PACK_LOAD of the rate its plan serves it at? Then its
        pools' equally good vGPUs take turns, packed or not (a plane that does not count
        arrivals, light_load 0, always packs)."""
        return self.arrival_rate(m, now) > self._pack_below[m]

    def _choose(self, m: int, now: float) -> tuple[int, Probe]:
        """The model's pipeline with the least waiting at its planned batch (then the
        earliest finish, then the first in the model's list), and its probe. The one chosen
        last is probed first: it is most often the best, and the best so far skips the
        others whose bounds say they wait longer, and cuts the probes of the rest (E8)."""
        if self.reference:
            return self._choose_plain(m, now)
        pipes = self.index.pipes[m]
        pipe_batch, pipe_pools = self.index.pipe_batch, self.index.pipe_pools
        no_wait, lats = self.lat.no_wait, self.lat.lat
        bounds = self.bounds
        prune = self.prober.prune
        K = len(pipes)
        k0 = kb = self.models.lead[m]
        pipe = pipes[kb]
        pr = self._probe(pipe, pipe_batch[pipe], now, math.inf)
        for j in range(1, K):
            k = k0 + j if k0 + j < K else k0 + j - K
            other = pipes[k]
            if pr.wait_us == 0.0 and (
                pr.finish_us <= now + no_wait[other]
                if k > kb
                else pr.finish_us < now + no_wait[other]
            ):
                continue  # `other` cannot wait less, nor finish earlier without waiting
            first = pipe_pools[other][0]
            margin = 1e-3 + abs(now) * 1e-12  # above the round-off of a probe's sums (µs)
            if bounds.booked_past(first, now, pr.wait_us, lats[first][pipe_batch[other]]):
                continue  # its first pool is booked past `pipe`'s wait: it must wait more
            if prune and bounds.wait_bound(other, now) > pr.wait_us + margin:
                continue  # a pool of it is booked past `pipe`'s wait
            # it wins only by finishing before this (its wait then below the best's)
            cut = math.inf
            if pr.wait_us < math.inf and prune:
                cut = now + pr.wait_us + no_wait[other] + margin
            po = self._probe(other, pipe_batch[other], now, cut)
            if po.wait_us < pr.wait_us or (
                po.wait_us == pr.wait_us
                and (po.finish_us < pr.finish_us or (po.finish_us == pr.finish_us and k < kb))
            ):
                pipe, pr, kb = other, po, k
        self.models.lead[m] = kb
        return pipe, pr

    def _choose_plain(self, m: int, now: float) -> tuple[int, Probe]:
        """_choose's specification: every pipeline of the model probed at its planned batch,
        in the model's order; the least wait, then the earliest finish, then the first."""
        pipe_batch = self.index.pipe_batch
        best = -1
        best_pr = LOST
        for other in self.index.pipes[m]:
            pr = self._probe(other, pipe_batch[other], now, math.inf)
            if (
                best < 0
                or pr.wait_us < best_pr.wait_us
                or (pr.wait_us == best_pr.wait_us and pr.finish_us < best_pr.finish_us)
            ):
                best, best_pr = other, pr
        return best, best_pr

    def _rescue(
        self, m: int, chosen: int, deadline_us: float, queued: int, now: float
    ) -> tuple[int, int, Probe] | None:
        """Another of the model's pipelines that still meets a head the chosen one cannot
        (at the largest batch up to its planned one and the queue): the least waiting at
        its planned batch is not always one that makes a late head's deadline. A head held
        for a pipeline whose planned batch is larger (so it waits less per request) was
        woken for it, then sent to the one with no wait and dropped there: repvgg-b3 on
        emulated hc2-large@32 lost 3 of 26 requests at a light load, live and simulated."""
        for pipe in self.index.pipes[m]:
            if pipe == chosen:
                continue
            b = min(self.index.pipe_batch[pipe], queued)
            while b >= 1:
                pr = self._probe(pipe, b, now, math.inf)
                if pr.finish_us <= deadline_us:
                    return pipe, b, pr
                b -= 1
        return None

    def _dispatch(self, m: int, pipe: int, b: int, pr: Probe, now: float, out: Decisions) -> None:
        models = self.models
        q = models.queues[m]
        did = self._next_dispatch
        self._next_dispatch += 1
        path = self.memo.hops(pr)
        self.prober.reserve(path, did, now, self.prober.pack and self._busy(m, now))
        reqs = [q.popleft() for _ in range(min(b, len(q)))]
        # the probe's hops are the dispatch's: a probe is made fresh and used once
        probes = self.prober.probes
        d = Dispatch(did, m, pipe, b, reqs, path, True, probes - models.probes_since[m])
        models.probes_since[m] = probes
        self._inflight.add(d)
        out.dispatches.append(d)
