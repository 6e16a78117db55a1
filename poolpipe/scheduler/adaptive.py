"""The reservation-based data plane of docs/design/dataplane.md: probe every pipeline, pick
the one with the least waiting, take the largest batch that meets the oldest request's
deadline, and then drop, wait until the last moment, or reserve the path and dispatch.

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
from mypy_extensions import i64, mypyc_attr

from poolpipe.errors import PoolpipeError
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
from poolpipe.scheduler.reservations import LastEnds, ReservationTable
from poolpipe.scheduler.topology import Pipeline, Topology, latency_tables

POLICIES: Final = ("adaptive", "eager", "deferred")
# Wake up this long before the computed last moment, so float round-off cannot turn an
# on-time dispatch into a late one (µs).
WAKE_GUARD_US: Final = 1.0
# The shortest hold worth a wake-up (µs): a slack above the guard by less than this is a
# round-off of the last wake (now + slack - guard == now in floating point), and a hold
# for it would wake the driver at the same instant for ever (a virtual clock never moves).
MIN_HOLD_US: Final = 1e-3
# A probe cut short cuts this much later than asked (µs), so that its LOST, kept, answers
# the model's next decisions too: their cuts move by round-off where the lead pipeline's
# kept probe answers them at a later time. (A path that finishes between the two cuts
# loses the comparison all the same: E9.)
CUT_SLACK_US: Final = 1e-3


@mypyc_attr(acyclic=True)
class Probe:
    """Where and when a batch would run if dispatched now (a native class: probe() is the
    hot path, and a compiled class's float fields are unboxed)."""

    __slots__ = ("finish_us", "kept_from", "path", "start_us", "wait_us")

    def __init__(
        self,
        wait_us: float,
        finish_us: float,
        start_us: float,
        path: list[Hop],
        kept_from: float = -math.inf,
    ):
        self.wait_us = wait_us  # time spent waiting for resources along the path
        self.finish_us = finish_us
        self.start_us = start_us  # when it would start on its first vGPU
        self.path = path  # the hops as they would be reserved (a dispatch takes them)
        # (the scheduler's own: a kept path answered again at this time, its hops not yet
        # copied (ReservationScheduler._hops); -inf: `path` is the probe's)
        self.kept_from = kept_from


# What a probe with a cut returns when the pipeline cannot finish before it.
LOST: Final = Probe(math.inf, math.inf, math.inf, [])


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


class _Kept:
    """A pipeline's last probe at each batch size, kept to answer the next (_reuse), its
    last probe cut short (LOST), kept to answer the next cut as short, and the count of
    the changes that end them (compiled: fields in place, the per-batch ones unboxed
    vectors)."""

    __slots__ = (
        "at",
        "changes",
        "links",
        "lost",
        "lost_cut",
        "lost_links",
        "lost_now",
        "lost_path",
        "lost_until",
        "now",
        "path",
        "start",
    )

    def __init__(self, batches: int) -> None:
        # corrections of the tables its probes read (they may free time), its own
        # dispatches (its pools' scans start elsewhere), new latencies; reservations on
        # its links end a kept answer only where it used the link (_path_links)
        self.changes = 0
        # per batch size b (1 to batches): the kept probe's
        self.at = vec[i64]([-1] * (batches + 1))  # `changes` when it was made (-1: none)
        self.links = vec[i64]([0] * (batches + 1))  # its path's links' versions then
        self.now = vec[float]([0.0] * (batches + 1))  # when it was made
        self.start = vec[float]([0.0] * (batches + 1))  # its path's start
        self.path: list[list[Hop]] = [[] for _ in range(batches + 1)]
        # its last probe that came back LOST: `changes` then (-1: none), when, until when
        # it holds, its cut, the hops chosen before the one that lost and their links'
        # versions then (_prefix_links)
        self.lost = vec[i64]([-1] * (batches + 1))
        self.lost_now = vec[float]([0.0] * (batches + 1))
        self.lost_until = vec[float]([0.0] * (batches + 1))
        self.lost_cut = vec[float]([0.0] * (batches + 1))
        self.lost_links = vec[i64]([0] * (batches + 1))
        self.lost_path: list[list[Hop]] = [[] for _ in range(batches + 1)]


@mypyc_attr(acyclic=True)
class _BoundTree:
    """Lower bounds of a pool's members (its vGPUs, or its servers' groups of them) in scan
    order, with every subtree's minimum: the probe skips, in O(log n), every run of members
    that cannot beat the best found so far instead of scanning their tables one by one
    (E3, E4 of docs/design/dataplane-exactness.md, the facts cited below by number).

    A member's bound is when its vGPU (or the earliest of the group's) could start the
    pool's shortest stage at or after the time it was last computed (`_touch`): a probe at a
    later time, or of a longer stage, starts no earlier (reservations only push starts later,
    and the scheduler recomputes a bound whenever a correction frees a table).

    Node j (1 the root, 2j and 2j + 1 its children, the members' leaves from `size` on)
    holds the least bound under it (`least[j]`) and the first member holding it
    (`arg[j]`): unboxed vectors (librt.vecs, compiled: a thousand GPUs' trees in a few
    buffers, where an object per node left each one cold)."""

    __slots__ = ("arg", "least", "n", "size")

    def __init__(self, n: int) -> None:
        size: i64 = 1
        while size < n:
            size *= 2
        self.n: i64 = n
        self.size: i64 = size
        # leaves from `size` on, a member's -inf (no bound yet); padding stays +inf
        least = vec[float]([math.inf] * (2 * size))
        arg = vec[i64]([0] * (2 * size))
        for i in range(size):
            least[size + i] = -math.inf if i < n else math.inf
            arg[size + i] = i
        for j in range(size - 1, 0, -1):
            c = 2 * j + 1 if least[2 * j + 1] < least[2 * j] else 2 * j
            least[j] = least[c]
            arg[j] = arg[c]
        self.least = least
        self.arg = arg

    def set(self, i: i64, x: float) -> None:
        least, arg = self.least, self.arg
        j: i64 = i + self.size
        least[j] = x
        j >>= 1
        while j >= 1:
            c = 2 * j + 1 if least[2 * j + 1] < least[2 * j] else 2 * j
            x, a = least[c], arg[c]
            if least[j] == x and arg[j] == a:
                return  # the ancestors keep theirs
            least[j] = x
            arg[j] = a
            j >>= 1

    def lowest(self) -> float:
        return self.least[1]

    def argmin(self) -> int:
        """The first member with the least bound."""
        return self.arg[1]

    def scan(self, p: i64, r: i64, least: float, lat: float, best: float, seed: float) -> i64:
        """The first member at or after offset p of the scan order that starts at member r
        ([r, n), then [0, r)) that next_below would take, as its offset in that order; n
        when none is left."""
        n = self.n
        if r + p < n:
            j = self.next_below(r + p, least, lat, best, seed)
            if j < n:
                return j - r
            p = n - r
        if p >= n:
            return n
        j = self.next_below(p - (n - r), least, lat, best, seed)
        return j + n - r if j < r else n

    def next_below(self, i: i64, least: float, lat: float, best: float, seed: float) -> i64:
        """The first member at or after i whose bound x has x < least, or x + lat < best and
        x + lat <= seed (floating-point addition is monotone, so a subtree's minimum answers
        for the subtree), or n."""
        n = self.n
        if i >= n:
            return n
        least_of, size = self.least, self.size
        j: i64 = i + size
        while True:
            x = least_of[j]
            y = x + lat
            if x < least or (y < best and y <= seed):
                break
            while j & 1:  # a right child: the next range starts after the parent's
                j >>= 1
            if j == 0:
                return n
            j += 1
        while j < size:  # down to the first member that qualifies
            j *= 2
            x = least_of[j]
            y = x + lat
            if not (x < least or (y < best and y <= seed)):
                j += 1
        return j - size


def _reservation_key(dispatch: int, hop: int) -> int:
    """Key of a hop's compute reservation; its transfer's is this + 1 (a pipeline has at
    most topology.MAX_HOPS hops, checked where its topology is made)."""
    return dispatch * 64 + hop * 2


class ReservationScheduler(DataPlane):
    """Reservation tables for every vGPU and every server's uplink and downlink."""

    def __init__(
        self,
        topo: Topology,
        policy: str = "adaptive",
        max_queue: int | None = None,
        wake_guard_us: float = WAKE_GUARD_US,
    ):
        if policy not in POLICIES:
            raise PoolpipeError(f"unknown batching policy {policy!r}; choose {', '.join(POLICIES)}")
        if max_queue is not None and max_queue < 1:
            raise PoolpipeError(f"max_queue must be >= 1, got {max_queue}")
        super().__init__(policy if policy != "adaptive" else "reservation", topo)
        self.policy = policy
        self.max_queue = max_queue
        # A waiting batch wakes this long before its last moment: a live driver's timers
        # fire late by up to about a millisecond, the simulator's never do.
        self.wake_guard_us = wake_guard_us
        self.wake_guard_floor_us = wake_guard_us  # set_wake_lateness adds to it
        # (with each set's latest ends in one vector: a probe skips a table free from then)
        self._vend = LastEnds(len(topo.vgpus))
        self._upend = LastEnds(len(topo.servers))
        self._downend = LastEnds(len(topo.servers))
        self.vgpu_table = [
            ReservationTable(f"vgpu{v.id}", self._vend, i) for i, v in enumerate(topo.vgpus)
        ]
        self.uplink = [
            ReservationTable(f"up{s.id}", self._upend, i) for i, s in enumerate(topo.servers)
        ]
        self.downlink = [
            ReservationTable(f"down{s.id}", self._downend, i) for i, s in enumerate(topo.servers)
        ]
        self.server_of = vec[i64]([v.server for v in topo.vgpus])
        # Per pool: its vGPUs grouped by server (one transfer slot per server), and a
        # rotating start so that equally good vGPUs and NICs take turns.
        self._groups: list[list[tuple[int, list[int]]]] = []
        group_index: list[dict[int, int]] = []  # per pool: server -> index in _groups
        for pool in topo.pools:
            by_server: dict[int, list[int]] = {}
            for v in pool.vgpus:
                by_server.setdefault(topo.vgpus[v].server, []).append(v)
            self._groups.append(list(by_server.items()))
            group_index.append({srv: i for i, srv in enumerate(by_server)})
        # (per vGPU, server and pool: unboxed vectors, librt.vecs: a list's ints past 256
        # are objects of their own, and at a thousand GPUs each read is a cache miss)
        self._flat = [vec[i64](pool.vgpus) for pool in topo.pools]
        self._gsrv = [vec[i64]([srv for srv, _ in groups]) for groups in self._groups]
        self._gvg = [[vec[i64](vgs) for _, vgs in groups] for groups in self._groups]
        self._flat_index = vec[i64]([0] * len(topo.vgpus))  # per vGPU: its index in _flat
        for flat in self._flat:
            for i, v in enumerate(flat):
                self._flat_index[v] = i
        self._pool_of = vec[i64]([v.pool for v in topo.vgpus])
        self._group_of = vec[i64](  # per vGPU: its server's index in its pool's _groups
            [group_index[v.pool][v.server] for v in topo.vgpus]
        )
        # Per vGPU a lower bound on when it can start a stage of its pool (_touch), and per
        # pool the bounds in scan order: of its vGPUs (a first hop) and its servers' groups.
        self._lb = vec[float]([-math.inf] * len(topo.vgpus))
        self._ftree = [_BoundTree(len(flat)) for flat in self._flat]
        self._gtree = [_BoundTree(len(groups)) for groups in self._groups]
        self._bound_from = -math.inf  # every bound holds for probes from this time on
        # which tree a pool needs: the first pool of a pipeline, a later one (or both)
        self._first = [False] * len(topo.pools)
        self._later = [False] * len(topo.pools)
        # per pool: a first pool whose requests' inputs cross its server's downlink
        # (topology.with_inputs), probed like a later pool whose feature map comes from
        # outside the cluster (a server's group at a time: one transfer slot per server)
        self._inputs = [False] * len(topo.pools)
        for pipe in topo.pipelines:
            for d, pid in enumerate(pipe.pools):
                if d == 0 and not topo.pools[pid].transfer_in_us > 0:
                    self._first[pid] = True
                else:
                    self._later[pid] = True
                    self._inputs[pid] = d == 0
        # Per pool and server group (a later pool's): a lower bound on when a transfer into
        # the server can end (_touch_down), as a start bound of the group's vGPUs. A feature
        # map's transfer starts no earlier than _offset[pool] after the probe (the earlier
        # pools' shortest stages), where the downlink is booked ahead by the batches already
        # sent: without it a busy downlink's server looked as good as its idle vGPUs, and a
        # probe scanned a third of a 63-server pool for the earliest transfer.
        self._dlb = [vec[float]([-math.inf] * len(groups)) for groups in self._groups]
        self._down_groups: list[list[tuple[int, int]]] = [[] for _ in topo.servers]
        for pid in range(len(topo.pools)):
            if self._later[pid]:
                for g, srv in enumerate(self._gsrv[pid]):
                    self._down_groups[srv].append((pid, g))
        self._offset = vec[float]([0.0] * len(topo.pools))
        self._rr = vec[i64]([0] * len(topo.pools))
        # Per pool, from its last probe that found no vGPU free at once: no vGPU of the pool
        # can start a stage of _booked_lat µs at or after _booked_t before _booked_from.
        # Reservations only push starts later, and later times or longer stages start no
        # earlier, so it holds until a correction frees a table of the pool (-inf: unknown).
        self._booked_from = vec[float]([-math.inf] * len(topo.pools))
        self._booked_t = vec[float]([0.0] * len(topo.pools))
        self._booked_lat = vec[float]([0.0] * len(topo.pools))
        # Skip a compared pipeline whose pools' bounds put its wait above the best one's, and
        # cut its probe short where it cannot finish first (False: probe every pipeline not
        # skipped otherwise, in full; the equivalence tests' plain rule).
        self.prune_pipelines = True
        self._ahead: list[vec[float]] = []  # _read_latencies
        self._rest: list[vec[float]] = []  # _read_latencies
        self._pipes: list[list[int]] = [list(m.pipelines) for m in topo.models]
        self._pipe_pools = [vec[i64](pipe.pools) for pipe in topo.pipelines]
        self._pipe_batch = vec[i64]([pipe.batch for pipe in topo.pipelines])
        # per pipeline, the bound tree its probe scans at each hop (_wait_bound)
        self._hop_trees = [
            [
                self._ftree[pid] if d == 0 and not self._inputs[pid] else self._gtree[pid]
                for d, pid in enumerate(pipe.pools)
            ]
            for pipe in topo.pipelines
        ]
        self._lat: list[vec[float]] = []  # per pool: its latency at batch b (set_latencies)
        self._tin = vec[float]()  # per pool: its transfer in, per sample
        self._lat_min = vec[float]()
        # A probe's answer kept per pipeline and batch for a later probe at that batch
        # (_reuse), with the count of corrections to the tables its probes read (_Kept):
        # its vGPUs', the uplinks of its servers that send a feature map on (a pool with a
        # next one), and the downlinks of those that receive one or the inputs (a later
        # pool's); and per link, the reservations made on it (_path_links).
        pipe_of_pool = [0] * len(topo.pools)
        for pipe in topo.pipelines:
            for pid in pipe.pools:
                pipe_of_pool[pid] = pipe.id
        self._read_latencies(topo)
        # (sized by the largest batch all of its pools have a latency for)
        most = [len(lat) - 1 for lat in self._lat]
        self._kept = [_Kept(min(most[pid] for pid in pipe.pools)) for pipe in topo.pipelines]
        self._vkept = [self._kept[pipe_of_pool[v.pool]] for v in topo.vgpus]
        self._upkept: list[list[_Kept]] = [[] for _ in topo.servers]  # per server
        self._downkept: list[list[_Kept]] = [[] for _ in topo.servers]
        # per server: reservations made on its uplink, and on its downlink
        self._up_version = vec[i64]([0] * len(topo.servers))
        self._down_version = vec[i64]([0] * len(topo.servers))
        for pipe in topo.pipelines:
            kept = self._kept[pipe.id]
            for d, pid in enumerate(pipe.pools):
                for v in topo.pools[pid].vgpus:
                    srv = topo.vgpus[v].server
                    if d + 1 < len(pipe.pools) and kept not in self._upkept[srv]:
                        self._upkept[srv].append(kept)
                    if self._later[pid] and kept not in self._downkept[srv]:
                        self._downkept[srv].append(kept)
        M = len(topo.models)
        self.queues = [_Queue() for _ in range(M)]
        self._dirty = [False] * M
        # (per model: unboxed vectors, librt.vecs: a list's floats and large ints were
        # objects made at every write)
        self._wake = vec[float]([math.inf] * M)  # the model's batch is held until then, ...
        # ... for its vGPUs to be free (a backlog: arrivals alone do not end the hold), or
        # for its last moment (each arrival decides it again)
        self._until_start = [False] * M
        self._probes_since = vec[i64]([0] * M)
        self._lead = [0] * M  # per model: the index of its pipeline chosen last
        # id of the head admitted at its planned batch (docs/design/dataplane.md)
        self._admitted = vec[i64]([-1] * M)
        self._rejected: list[Drop] = []
        self._inflight = _InFlight()
        self._next_dispatch = 0

    # ------------------------------------------------------------------ contract

    def add_request(self, req: Request, now: float) -> bool:
        m = req.model
        q = self.queues[m]
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
        if self._wake[m] == math.inf or not self._until_start[m]:
            # A batch held for its last moment is decided again with the newcomer: a larger
            # batch takes longer, so its last moment is earlier (woken at the smaller batch's,
            # the head went alone and the rest missed their deadlines behind it: a ResNet-50
            # alone on one real H200 vGPU, 50 req/s, 17% dropped)
            self._dirty[m] = True
            return True
        # joins a batch held until its vGPUs are free (a backlog): nothing to decide unless
        # another model is due
        return any(dirty for dirty in self._dirty)  # (compiled: a loop, not a call)

    def decide(self, now: float) -> Decisions:
        out = Decisions([], [], None)
        if self._rejected:
            out.drops.extend(self._rejected)
            self._rejected.clear()
        M = len(self.queues)
        while True:
            before = len(out.dispatches)
            for m in range(M):
                if self._dirty[m] or self._wake[m] <= now:
                    self._dirty[m] = False
                    self._wake[m] = math.inf
                    self._decide_model(m, now, out)
            if M == 1 or len(out.dispatches) == before:
                break
            # Links are shared across models: the slack a waiting model computed before
            # these reservations may be gone, so it looks again.
            dispatches = out.dispatches
            again = False
            for m in range(M):
                if self._wake[m] < math.inf and not any(
                    dispatches[j].model == m for j in range(before, len(dispatches))
                ):
                    self._dirty[m] = again = True
            if not again:
                break
        wake = math.inf
        for w in self._wake:
            if w < wake:
                wake = w
        out.wake_at_us = wake if wake < math.inf else None
        return out

    def drain(self) -> None:
        """Stop waiting for fuller batches: every queued request goes out at its next
        decision (a rollout flushes the old plan this way instead of waiting an SLO)."""
        self.policy = "eager"
        for m in range(len(self.queues)):
            self._dirty[m] = True

    def set_wake_lateness(self, late_us: float) -> None:
        self.wake_guard_us = self.wake_guard_floor_us + max(0.0, late_us)

    def set_latencies(self, topo: Topology) -> None:
        """Plan with the pools' latencies of `topo`, the same topology measured anew (a live
        router recalibrating under load); what is already reserved stays as it is."""
        self.topo = topo
        self._read_latencies(topo)
        self._rebound(self._bound_from)  # the shortest stages may be shorter now
        for kept in self._kept:
            kept.changes += 1  # no kept probe holds
        for m in range(len(self.queues)):
            self._dirty[m] = True

    def _read_latencies(self, topo: Topology) -> None:
        self._no_wait_us, self._grow_to = _per_pipeline(topo)
        self._lat = [vec[float](lat) for lat in latency_tables(topo)]
        self._tin = vec[float]([float(pool.transfer_in_us) for pool in topo.pools])
        self._lat_min = vec[float]([min(lat[1:], default=0.0) for lat in self._lat])
        offset = [math.inf] * len(topo.pools)
        for pipe in topo.pipelines:
            ahead = 0.0
            for pid in pipe.pools:
                offset[pid] = min(offset[pid], ahead)
                ahead += self._lat_min[pid]
        self._offset = vec[float]([x if x < math.inf else 0.0 for x in offset])
        # Per pipeline and hop d at the planned batch b: the earlier pools' stages and the
        # transfers up to d's. A probe's wait is its finish less `now` and every stage and
        # transfer of the path, and it finishes no earlier than hop d's start (at or after
        # its pool's least bound) plus the stages and transfers after it: so its wait is at
        # least that bound less `now` and this (_wait_bound).
        self._ahead = []
        self._rest = []
        for pipe in topo.pipelines:
            b = pipe.batch
            before: list[float] = []
            x = 0.0
            for pid in pipe.pools:
                x += b * self._tin[pid]
                before.append(x)
                x += self._lat[pid][b]
            self._ahead.append(vec[float](before))
            # and what follows each hop: the later pools' transfers and stages
            after = [0.0] * len(pipe.pools)
            x = 0.0
            for d in range(len(pipe.pools) - 1, 0, -1):
                pid = pipe.pools[d]
                x += self._lat[pid][b] + b * self._tin[pid]
                after[d - 1] = x
            self._rest.append(vec[float](after))

    def _touch(self, v: int, now: float) -> None:
        """vGPU v's table changed at `now`: its bound anew, and its pool's trees."""
        pid = self._pool_of[v]
        x = self.vgpu_table[v].earliest_slot(now, self._lat_min[pid])
        lbs = self._lb
        if lbs[v] != x:
            lbs[v] = x
            if self._first[pid]:
                self._ftree[pid].set(self._flat_index[v], x)
            if self._later[pid]:
                self._group_bound(pid, self._group_of[v])
        if now > self._bound_from:
            self._bound_from = now

    def _group_bound(self, pid: int, g: int) -> None:
        """Server group g of pool pid: its bound anew (its vGPUs' least, or its downlink's)."""
        lbs = self._lb
        m = math.inf
        for u in self._gvg[pid][g]:
            y = lbs[u]
            if y < m:
                m = y
        d = self._dlb[pid][g]
        self._gtree[pid].set(g, d if d > m else m)

    def _touch_down(self, srv: int, now: float) -> None:
        """Server srv's downlink table changed at `now`: the bounds of its groups anew. A
        transfer of at least one sample into pool pid starts no earlier than `now` plus
        the pool's offset, so the vGPU's stage no earlier than its end."""
        groups = self._down_groups[srv]
        if not groups:
            return
        down = self.downlink[srv]
        for pid, g in groups:
            tin = self._tin[pid]
            if tin > 0:
                x = down.earliest_slot(now + self._offset[pid], tin) + tin
                if x != self._dlb[pid][g]:
                    self._dlb[pid][g] = x
                    self._group_bound(pid, g)
        if now > self._bound_from:
            self._bound_from = now

    def _corrected(self, v: int, key: int, start: float, end: float, now: float) -> None:
        """Reservation `key` of vGPU v replaced by [start, end) (ReservationTable.correct):
        a correction may free time, so v's bound is computed anew and its pool's booked
        record forgotten."""
        self.vgpu_table[v].correct(key, start, end, now)
        self._vkept[v].changes += 1
        self._touch(v, now)
        self._booked_from[self._pool_of[v]] = -math.inf

    def _rebound(self, now: float) -> None:
        """Every bound anew from `now` (a probe earlier than the last change, new latencies)."""
        if now == -math.inf:
            return  # nothing bounded yet
        self._bound_from = -math.inf
        for srv in range(len(self.downlink)):
            self._touch_down(srv, now)
        for v in range(len(self.vgpu_table)):
            self._touch(v, now)
        for pid in range(len(self._groups)):
            if self._later[pid]:
                for g in range(len(self._groups[pid])):
                    self._group_bound(pid, g)

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        """Take a vGPU out of (or back into) service: while down it is reserved forever, so
        no probe picks it; what it had reserved stays until the driver reports it done."""
        self._corrected(vgpu, -1 - vgpu, now, math.inf if down else now, now)
        for m in range(len(self.queues)):
            self._dirty[m] = True

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        """Release what the failed hop and the later ones still hold from `now` on."""
        d = self._inflight.pop(dispatch)
        if d is None:
            return
        for h in range(hop, len(d.hops)):
            key = _reservation_key(dispatch, h)
            x = d.hops[h]
            self._corrected(x.vgpu, key, now, now, now)
            if x.transfer_end_us > x.transfer_start_us:
                if x.src_vgpu >= 0:
                    self.uplink[self.server_of[x.src_vgpu]].correct(key + 1, now, now, now)
                    self._changed(self._upkept[self.server_of[x.src_vgpu]])
                self.downlink[self.server_of[x.vgpu]].correct(key + 1, now, now, now)
                self._changed(self._downkept[self.server_of[x.vgpu]])
                self._touch_down(self.server_of[x.vgpu], now)
        for m in range(len(self.queues)):
            self._dirty[m] = True

    def on_stage_started(self, report: StageReport, now: float) -> None:
        self._correct(report, now)

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        d = self._correct(report, now)
        if d is not None and report.hop == len(d.hops) - 1:
            self._inflight.pop(report.dispatch)
        return False

    # ------------------------------------------------------------------ probe / reserve

    def probe(self, pipe: Pipeline, b: int, now: float) -> Probe:
        """Where and when a batch of b would run on `pipe` if dispatched now. Nothing is
        reserved; the answer is kept to answer a later probe the same (_reuse)."""
        pr = self._probe(pipe.id, b, now, math.inf)
        if pr.kept_from == -math.inf:
            return pr
        return Probe(pr.wait_us, pr.finish_us, pr.start_us, self._hops(pr))

    def _probe(self, pi: int, b: int, now: float, cut: float) -> Probe:
        """probe() of pipeline `pi`. The hot path: slot scans inlined, ranges of indexes
        rather than slices, and typed locals (compiled, floats stay unboxed).

        Exactness: E5, E6 and E7 (docs/design/dataplane-exactness.md), as argued here.

        `cut` (at the planned batch only; inf: none): a finish the caller has no use for.
        Where every choice of a hop would finish the path at or after it (the hop's end, or
        the uplink slot for the next transfer, plus every later stage and transfer), the
        probe stops and returns LOST. Otherwise each hop is chosen as without it: the
        choice is the least (key, start) first in scan order, and `cut` only starts the
        search lower.

        A probe at the same batch made earlier is answered again (_reuse) while its path
        starts no earlier than `now`, no table it reads has been corrected nor its pipeline
        dispatched, and the links its path uses have no new reservation (others' only
        delay choices that lost). So is one that came back LOST, for a cut no later than
        its own, while no table it reads has been corrected nor its pipeline dispatched:
        at a later time, or with more reserved, every choice of the first hop starts, ends
        and sends on no earlier, so where none could finish before the cut, none can; and
        where a later hop's could not, the hops before it are chosen the same while the
        first starts no earlier than `now` and their links (and the uplink the last of
        them sends on) have no new reservation (_reuse), and every choice of the hop that
        lost finishes no earlier."""
        kept = self._kept[pi]
        if self.prune_pipelines:
            changes = kept.changes
            if (
                kept.at[b] == changes
                and kept.now[b] <= now <= kept.start[b]
                and kept.links[b] == self._path_links(kept.path[b])
            ):
                return self._reuse(kept, b, now)
            if (
                kept.lost[b] == changes
                and kept.lost_now[b] <= now <= kept.lost_until[b]
                and cut <= kept.lost_cut[b]
                and kept.lost_links[b] == self._prefix_links(kept.lost_path[b])
            ):
                return LOST
            cut += CUT_SLACK_US  # (inf stays inf)
        self.probes += 1
        if now < self._bound_from:
            self._rebound(now)  # a probe of the past (tests): the bounds hold from `now` on
        tables = self.vgpu_table
        lats, tin = self._lat, self._tin
        # (machine integers, compiled: the indexes into the vectors, without a check of
        # an arbitrary-precision int at every step)
        i: i64
        p: i64
        g: i64
        t = now
        wait = 0.0
        path: list[Hop] = []
        prev: i64 = -1
        first_start = now
        versions: i64 = 0  # the versions of the links its choices read (_path_links)
        pipe_pools = self._pipe_pools[pi]
        npools = len(pipe_pools)
        uplink, server_of = self.uplink, self.server_of
        # a table whose latest end is at or before a time is free from it (LastEnds)
        vend, upend, downend = self._vend.v, self._upend.v, self._downend.v
        rest = self._rest[pi]
        for d in range(npools):
            pid = pipe_pools[d]
            lat = lats[pid][b]
            # no choice whose key is at or above this can finish before `cut`
            cut_key = cut - rest[d] if cut < math.inf else math.inf
            # Look one transfer ahead: among vGPUs finishing equally early, prefer one whose
            # server can send the result on at once (the greedy rule would ignore the NIC).
            out = b * tin[pipe_pools[d + 1]] if d + 1 < npools else 0.0
            if prev < 0 and not self._inputs[pid]:
                r = self._rr[pid]
                flat = self._flat[pid]
                tree = self._ftree[pid]
                best_key, best_s, best_v = cut_key, math.inf, -1
                least = math.inf  # the earliest start of any vGPU of the pool
                every = True
                # A seed: the vGPU of the least bound, most likely the best. What it would
                # give bounds the scan (which alone decides, ties in scan order included).
                seed = math.inf
                if tree.lowest() < math.inf:
                    v = flat[tree.argmin()]
                    least = tables[v].earliest_slot(t, lat) if vend[v] > t else t
                    f = least + lat
                    srv = server_of[v]
                    seed = uplink[srv].earliest_slot(f, out) if out and upend[srv] > f else f
                # The vGPUs in scan order from r; the tree skips those whose bound says they
                # can neither beat the seed or the best so far nor lower `least`.
                n = len(flat)
                bounds, leaves = tree.least, tree.size
                p = 0
                while p < n:
                    # (the next member read here: where it qualifies, it is what tree.scan
                    # would answer; a run of idle vGPUs at a thousand GPUs did not need it)
                    i = r + p if r + p < n else r + p - n
                    x = bounds[leaves + i]
                    if not (x < least or (x + lat < best_key and x + lat <= seed)):
                        p = tree.scan(p, r, least, lat, best_key, seed)
                        if p >= n:
                            break
                        i = r + p if r + p < n else r + p - n
                    v = flat[i]
                    p += 1
                    s = t  # vgpu_table[v].earliest_slot(t, lat), inlined: the hot path
                    if vend[v] > s:
                        tab = tables[v]
                        iv = tab.iv
                        for i in range(3 * tab.head, tab.end, 3):
                            e = iv[i + 1]
                            if e <= s:
                                continue
                            if iv[i] >= s + lat:
                                break
                            s = e
                    if s < least:
                        least = s
                    if s + lat >= best_key:  # key >= s + lat: cannot win, not even a tie
                        continue
                    f = s + lat
                    srv = server_of[v]
                    key = uplink[srv].earliest_slot(f, out) if out and upend[srv] > f else f
                    if key < best_key or (key == best_key and s < best_s):
                        best_key, best_s, best_v = key, s, v
                        if key <= t + lat:
                            every = False
                            break
                if every:  # every vGPU scanned
                    self._booked_from[pid] = least
                    self._booked_t[pid] = t
                    self._booked_lat[pid] = lat
                if best_v < 0 and cut < math.inf:
                    return self._lost(kept, b, now, cut, math.inf if d == 0 else first_start, path)
                path.append(Hop(pid, best_v, -1, t, t, best_s, best_s + lat))
                first_start = best_s
                wait += best_s - t
                t = best_s + lat
            else:
                # a feature map from vGPU `prev`, or (prev < 0) the requests' inputs from
                # outside the cluster: the receiving server's downlink alone
                dur = b * tin[pid]
                up: ReservationTable | None = uplink[server_of[prev]] if prev >= 0 else None
                t_up = t
                if up is not None and dur > 0 and upend[server_of[prev]] > t:
                    t_up = up.earliest_slot(t, dur)
                floor = t_up + dur + lat  # nothing can finish earlier
                r = self._rr[pid]
                gsrv, gvg = self._gsrv[pid], self._gvg[pid]
                tree = self._gtree[pid]
                # the best so far: key, finish, vgpu, transfer start and end, start
                bk, bf, bv, bts, bte, bs = cut_key, math.inf, -1, 0.0, 0.0, 0.0
                n = len(gsrv)
                bounds, leaves = tree.least, tree.size
                p = 0
                while p < n:  # the servers in scan order from r, as for a first hop
                    g = r + p if r + p < n else r + p - n
                    if not bounds[leaves + g] + lat < bk:  # (tree.scan's test, read here)
                        p = tree.scan(p, r, -math.inf, lat, bk, math.inf)
                        if p >= n:
                            break
                        g = r + p if r + p < n else r + p - n
                    p += 1
                    srv = gsrv[g]
                    vgs = gvg[g]
                    # Skip the server when none of its vGPUs could beat the best even if the
                    # transfer ended as early as it can (slots only move later with time).
                    lb = math.inf
                    for v in vgs:
                        s = floor - lat  # vgpu_table[v].earliest_slot(t_up + dur, lat)
                        if vend[v] > s:
                            tab = tables[v]
                            iv = tab.iv
                            for i in range(3 * tab.head, tab.end, 3):
                                e = iv[i + 1]
                                if e <= s:
                                    continue
                                if iv[i] >= s + lat:
                                    break
                                s = e
                        if s < lb:
                            lb = s
                    if lb + lat >= bk:
                        continue
                    down = self.downlink[srv]
                    # earliest_common_slot((up, down), t_up, dur): `up` is free at t_up
                    ts = t_up
                    while dur > 0:
                        x = down.earliest_slot(ts, dur) if downend[srv] > ts else ts
                        if x == ts or up is None:
                            ts = x
                            break
                        ts = up.earliest_slot(x, dur) if upend[server_of[prev]] > x else x
                        if ts == x:
                            break
                    te = ts + dur
                    if te + lat >= bk:
                        continue
                    srv_up = uplink[srv]
                    for v in vgs:
                        vts, vte = ts, te  # this vGPU's transfer (see below)
                        while True:
                            s = vte  # vgpu_table[v].earliest_slot(vte, lat), inlined
                            ps = -math.inf  # the latest start reserved on v before s
                            if vend[v] <= s:
                                break  # free from s on (and any ps is before vte)
                            tab = tables[v]
                            iv = tab.iv
                            for i in range(3 * tab.head, tab.end, 3):
                                e = iv[i + 1]
                                if e <= s:
                                    ps = iv[i]
                                    continue
                                if iv[i] >= s + lat:
                                    break
                                ps = iv[i]
                                s = e
                            if ps <= vte or prev < 0:
                                break
                            # A feature map in before the compute reserved ahead of it on v
                            # is due to start could overtake that one's (a node runs its
                            # queue in arrival order): it arrives once that one starts.
                            vts = max(t, ps - dur)
                            if dur > 0 and up is not None:  # (prev >= 0: it is not None)
                                vts = self._common_slot(up, server_of[prev], down, srv, vts, dur)
                            # (at least then: (ps - dur) + dur may round below ps, and the
                            # same stage overtaken again for ever; g3 on hc1-large, dart-r)
                            vte = max(vts + dur, ps)
                        f = s + lat
                        if f >= bk:
                            continue
                        key = srv_up.earliest_slot(f, out) if out and upend[srv] > f else f
                        if key < bk or (key == bk and f < bf):
                            bk, bf, bv, bts, bte, bs = key, f, v, vts, vte, s
                            if s <= te:
                                break
                    if bk <= floor:
                        break
                if bv < 0 and cut < math.inf:
                    if d == 1 and self._lost_whatever_first(pid, b, t_up, dur, cut_key):
                        return self._lost(kept, b, now, cut, math.inf, [])
                    return self._lost(kept, b, now, cut, math.inf if d == 0 else first_start, path)
                path.append(Hop(pid, bv, prev, bts, bte, bs, bf))
                # (_path_links, summed as the path is made)
                if prev >= 0:
                    versions += self._up_version[server_of[prev]]
                versions += self._down_version[server_of[bv]]
                if prev < 0:
                    first_start = bts  # the batch leaves when its inputs are sent
                wait += (bts - t) + (bs - bte)
                t = bf
            prev = path[-1].vgpu  # the vGPU that holds the batch now
        if self.prune_pipelines:
            kept.at[b] = kept.changes
            kept.links[b] = versions
            kept.now[b] = now
            kept.start[b] = first_start
            kept.path[b] = path
        return Probe(wait, t, first_start, path)

    def _lost(
        self, kept: _Kept, b: int, now: float, cut: float, until: float, path: list[Hop]
    ) -> Probe:
        """LOST, kept to answer probes at `until` at the latest (see _probe), while the
        hops chosen before the one that lost (`path`) hold (_prefix_links)."""
        if self.prune_pipelines:
            kept.lost_links[b] = self._prefix_links(path)
            kept.lost_path[b] = path
            kept.lost[b] = kept.changes
            kept.lost_now[b] = now
            kept.lost_until[b] = until
            kept.lost_cut[b] = cut
        return LOST

    def _common_slot(
        self,
        up: ReservationTable,
        up_srv: i64,
        down: ReservationTable,
        down_srv: i64,
        t: float,
        dur: float,
    ) -> float:
        """earliest_common_slot((up, down), t, dur), written out: a slot on the uplink, then
        on each in turn until both agree (a table free from its latest end on not read)."""
        upend, downend = self._upend.v, self._downend.v
        t = up.earliest_slot(t, dur) if upend[up_srv] > t else t
        while True:
            x = down.earliest_slot(t, dur) if downend[down_srv] > t else t
            if x == t:
                return t
            t = up.earliest_slot(x, dur) if upend[up_srv] > x else x
            if t == x:
                return t

    def _lost_whatever_first(
        self, pid: int, b: int, sent: float, dur: float, cut_key: float
    ) -> bool:
        """(E7.) A probe that lost at its second hop (pool `pid`, the feature map sent at `sent` on
        the uplink its first hop chose) would lose whatever its first hop: no vGPU of the
        pool could finish a stage before `cut_key` even with the map sent at `sent` and that
        uplink free from then on. Then it loses at any later time while no table it reads is
        corrected (kept as LOST until then, not only until its first hop would start):

        `sent` is the least of the first hop's choices' uplink slots (its key: the choice
        is the least key); later, or with more reserved, each choice's stage and uplink slot
        are no earlier, so every first hop sends at or after `sent`. The map then comes in
        on the receiving server's downlink no earlier than this downlink's slot from `sent`,
        and its stage starts no earlier than the vGPU's slot from there (a common slot with
        the sending uplink, or a transfer put after a stage reserved ahead of it, starts no
        earlier). Every slot found from `sent` is one a later probe's starts at or after
        (from at least `now` then, where forgetting the past changes nothing). A server's
        vGPUs whose group bound already ends a stage at or after the cut are not read (the
        scan's own test: the bound is below each slot found from `sent`)."""
        lat = self._lat[pid][b]
        server_of, tables = self.server_of, self.vgpu_table
        tree, gvg = self._gtree[pid], self._gvg[pid]
        n = len(gvg)
        g = tree.next_below(0, -math.inf, lat, cut_key, math.inf)
        while g < n:
            for v in gvg[g]:
                x = sent
                if dur > 0:
                    x = self.downlink[server_of[v]].earliest_slot(sent, dur) + dur
                if tables[v].earliest_slot(x, lat) + lat < cut_key:
                    return False
            g = tree.next_below(g + 1, -math.inf, lat, cut_key, math.inf)
        return True

    def _reuse(self, kept: _Kept, b: int, now: float) -> Probe:
        """The probe at batch b kept from `kept.now[b]`, as a probe made at `now` would
        answer: the same path, its first hop's wait counted from `now` (E5).

        Exact while no table the probe reads has been corrected nor its pipeline dispatched
        (`kept.changes`), no link its path uses has a new reservation (`kept.links`), and its
        path starts at or after `now`. A reservation on any other table can only move a
        losing choice's slots later. And a first hop's earliest start (or transfer) on each
        vGPU at or after `now` is the one at or after the earlier time wherever that one is
        not before `now` (the chosen vGPU's), and no earlier elsewhere, so each vGPU's key
        and start are where they were or later and the chosen one is still the least first
        in scan order; the later hops follow from the first hop's end alone. A cut probe
        gets the whole path where it might have been LOST: a path that could not finish
        before the cut loses the comparison either way. The wait is summed as the probe
        sums it (the same floats). Its hops are copied only for a dispatch (_hops): most
        answers kept are compared and let go."""
        old = kept.path[b]
        h0 = old[0]
        if self._inputs[h0.pool]:
            wait = (h0.transfer_start_us - now) + (h0.start_us - h0.transfer_end_us)
        else:
            wait = h0.start_us - now
        t = h0.end_us
        for d in range(1, len(old)):
            x = old[d]
            wait += (x.transfer_start_us - t) + (x.start_us - x.transfer_end_us)
            t = x.end_us
        return Probe(wait, t, kept.start[b], old, now)

    def _hops(self, pr: Probe) -> list[Hop]:
        """The hops of probe `pr` as a dispatch takes them: a kept path answered again at
        `kept_from` is the same path, its first hop (a vGPU's, whose batch leaves as it
        starts) made at that time."""
        old = pr.path
        if pr.kept_from == -math.inf:
            return old
        h0 = old[0]
        path: list[Hop] = []
        if self._inputs[h0.pool]:
            path.append(h0)
        else:
            now = pr.kept_from
            path.append(Hop(h0.pool, h0.vgpu, -1, now, now, h0.start_us, h0.end_us))
        for d in range(1, len(old)):
            path.append(old[d])
        return path

    def _path_links(self, path: list[Hop]) -> i64:
        """The versions of the links a path's choices read, summed (versions only grow:
        the sum is the same while each is): the uplink each hop's feature map leaves by
        (the one the hop before chose to send on) and the downlink it comes in by."""
        server_of = self.server_of
        n: i64 = 0
        for h in range(len(path)):
            hop = path[h]
            src = hop.src_vgpu
            if src >= 0:
                n += self._up_version[server_of[src]] + self._down_version[server_of[hop.vgpu]]
            elif self._inputs[hop.pool]:
                n += self._down_version[server_of[hop.vgpu]]
        return n

    def _prefix_links(self, path: list[Hop]) -> i64:
        """_path_links of the hops before one that lost, and the uplink the last of them
        chose to send on (a reservation there may move that choice)."""
        if not len(path):
            return 0
        return self._path_links(path) + self._up_version[self.server_of[path[-1].vgpu]]

    def _changed(self, readers: list[_Kept]) -> None:
        """A link was corrected (it may have freed time): no kept probe of the pipelines
        that read it holds."""
        for kept in readers:
            kept.changes += 1

    def _reserve(self, path: list[Hop], did: int, now: float) -> None:
        server_of = self.server_of
        # (every hop's vGPU is of the one pipeline; its pools' scans start elsewhere now)
        self._vkept[path[0].vgpu].changes += 1
        for h in range(len(path)):
            hop = path[h]
            key = did * 64 + h * 2  # _reservation_key(did, h), inlined
            v, src = hop.vgpu, hop.src_vgpu
            table = self.vgpu_table[v]
            table.forget_before(now)
            table.reserve(hop.start_us, hop.end_us, key)
            self._touch(v, now)
            ts, te = hop.transfer_start_us, hop.transfer_end_us
            if te > ts:
                if src >= 0:  # (the inputs come from outside: no uplink of ours)
                    up = self.uplink[server_of[src]]
                    up.forget_before(now)
                    up.reserve(ts, te, key + 1)
                    self._up_version[server_of[src]] += 1
                down = self.downlink[server_of[v]]
                down.forget_before(now)
                down.reserve(ts, te, key + 1)
                self._down_version[server_of[v]] += 1
                self._touch_down(server_of[v], now)
            # The next probe of this pool starts after the chosen vGPU / server.
            pid = hop.pool
            if src < 0 and not self._inputs[pid]:
                self._rr[pid] = (self._flat_index[v] + 1) % len(self._flat[pid])
            else:
                idx = self._group_of[v]
                self._rr[pid] = (idx + 1) % len(self._groups[pid])

    def _correct(self, report: StageReport, now: float) -> Dispatch | None:
        """Feedback correction. Intervals that are over by `now` cannot affect any later
        probe, so a report that changes nothing from `now` on is not written."""
        d = self._inflight.get(report.dispatch)
        if d is None:
            return None
        hop = d.hops[report.hop]
        key = report.dispatch * 64 + report.hop * 2  # _reservation_key, inlined
        start, end = report.start_us, report.end_us
        length = hop.end_us - hop.start_us
        if end is None:  # started: assume it runs as long as reserved
            if start != hop.start_us:
                self._corrected(hop.vgpu, key, start, start + length, now)
        elif start + length > now:  # done before its assumed end: free the rest
            self._corrected(hop.vgpu, key, start, end, now)
        ts, te = report.transfer_start_us, report.transfer_end_us
        if ts is not None and te is not None and (hop.transfer_end_us > now or te > now):
            # the transfer ended before its reservation did: free the rest
            if hop.src_vgpu >= 0:
                self.uplink[self.server_of[hop.src_vgpu]].correct(key + 1, ts, te, now)
                self._changed(self._upkept[self.server_of[hop.src_vgpu]])
            self.downlink[self.server_of[hop.vgpu]].correct(key + 1, ts, te, now)
            self._changed(self._downkept[self.server_of[hop.vgpu]])
            self._touch_down(self.server_of[hop.vgpu], now)
        return d

    # ------------------------------------------------------------------ batching loop

    def _decide_model(self, m: int, now: float, out: Decisions) -> None:
        q = self.queues[m]
        pipes = self._pipes[m]
        pipe_batch, no_wait = self._pipe_batch, self._no_wait_us
        while len(q) > 0:
            head = q.at(0)
            if head.deadline_us <= now:
                q.popleft()
                out.drops.append(Drop(head, DROP_DEADLINE_PASSED))
                continue
            # 1. the pipeline with the least waiting at its planned batch (then the earliest
            # finish, then the first in the model's list). The one chosen last is probed
            # first: it is most often the best, and the best so far skips the others whose
            # bounds say they wait longer (E8).
            K = len(pipes)
            k0 = kb = self._lead[m]
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
                first = self._pipe_pools[other][0]
                margin = 1e-3 + abs(now) * 1e-12  # above the round-off of a probe's sums (µs)
                if (
                    self._booked_from[first] - now > pr.wait_us
                    and now >= self._booked_t[first]
                    and self._lat[first][pipe_batch[other]] >= self._booked_lat[first]
                ):
                    continue  # its first pool is booked past `pipe`'s wait: it must wait more
                if self._wait_bound(other, now) > pr.wait_us + margin:
                    continue  # a pool of it is booked past `pipe`'s wait
                # it wins only by finishing before this (its wait then below the best's)
                cut = math.inf
                if pr.wait_us < math.inf and self.prune_pipelines:
                    cut = now + pr.wait_us + no_wait[other] + margin
                po = self._probe(other, pipe_batch[other], now, cut)
                if po.wait_us < pr.wait_us or (
                    po.wait_us == pr.wait_us
                    and (po.finish_us < pr.finish_us or (po.finish_us == pr.finish_us and k < kb))
                ):
                    pipe, pr, kb = other, po, k
            self._lead[m] = kb
            # 2. the largest batch that meets the head's deadline
            planned = pipe_batch[pipe]
            b = planned
            if (
                self.policy == "adaptive"
                and pr.finish_us > head.deadline_us
                and self._admitted[m] != head.id
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
            self._admitted[m] = head.id  # from now on it may go in a smaller batch
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
            top = self._grow_to[pipe]
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
                    self._wake[m] = start - self.wake_guard_us
                    self._until_start[m] = True
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
                    if slack - self.wake_guard_us > MIN_HOLD_US:
                        self._wake[m] = now + slack - self.wake_guard_us
                        self._until_start[m] = False
                        return
                if pn.finish_us <= head.deadline_us:
                    b, pr = n, pn
                # else latency is not monotone in b here: send the n on b's timing
            self._dispatch(m, pipe, b, pr, now, out)

    def _wait_bound(self, pi: int, now: float) -> float:
        """A lower bound on the wait of pipeline pi's probe at its planned batch at `now`
        (-inf when the bounds may not hold at `now`, or are off)."""
        if now < self._bound_from or not self.prune_pipelines:
            return -math.inf
        trees = self._hop_trees[pi]
        ahead = self._ahead[pi]
        most = -math.inf
        for d in range(len(trees)):
            x = trees[d].lowest() - now - ahead[d]
            if x > most:
                most = x
        return most

    def _rescue(
        self, m: int, chosen: int, deadline_us: float, queued: int, now: float
    ) -> tuple[int, int, Probe] | None:
        """Another of the model's pipelines that still meets a head the chosen one cannot
        (at the largest batch up to its planned one and the queue): the least waiting at
        its planned batch is not always one that makes a late head's deadline. A head held
        for a pipeline whose planned batch is larger (so it waits less per request) was
        woken for it, then sent to the one with no wait and dropped there: repvgg-b3 on
        emulated hc2-large@32 lost 3 of 26 requests at a light load, live and simulated."""
        for pipe in self._pipes[m]:
            if pipe == chosen:
                continue
            b = min(self._pipe_batch[pipe], queued)
            while b >= 1:
                pr = self._probe(pipe, b, now, math.inf)
                if pr.finish_us <= deadline_us:
                    return pipe, b, pr
                b -= 1
        return None

    def _dispatch(self, m: int, pipe: int, b: int, pr: Probe, now: float, out: Decisions) -> None:
        q = self.queues[m]
        did = self._next_dispatch
        self._next_dispatch += 1
        path = self._hops(pr)
        self._reserve(path, did, now)
        reqs = [q.popleft() for _ in range(min(b, len(q)))]
        # the probe's hops are the dispatch's: a probe is made fresh and used once
        d = Dispatch(did, m, pipe, b, reqs, path, True, self.probes - self._probes_since[m])
        self._probes_since[m] = self.probes
        self._inflight.add(d)
        out.dispatches.append(d)


def _per_pipeline(topo: Topology) -> tuple[list[float], list[int]]:
    """Per pipeline, from the pools' latencies: the latency at its planned batch with no
    waiting (a bound for pruning probes, and admission's test), and the largest batch it may
    grow to under a backlog (one-partition pipelines only, see the module)."""
    no_wait = [
        sum(
            topo.pools[p].latency_us[pipe.batch] + pipe.batch * topo.pools[p].transfer_in_us
            for p in pipe.pools
        )
        for pipe in topo.pipelines
    ]
    grow_to = [
        len(topo.pools[pipe.pools[0]].latency_us) - 1 if len(pipe.pools) == 1 else pipe.batch
        for pipe in topo.pipelines
    ]
    return no_wait, grow_to
