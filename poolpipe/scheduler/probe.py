"""The probe, reserve and correct of the reservation data plane (docs/design/dataplane.md):
where and when a batch would run on a pipeline if dispatched now, each hop the vGPU with
the least (key, start), first in scan order, its key the finish or, where a feature map
goes on, the uplink's slot for it; the path reserved when the batch goes; the tables
corrected by what really ran.

The fast code decides as that plain rule does (E1-E9 of
docs/design/dataplane-exactness.md, cited by number): it skips members by their bounds
(bounds.py), answers from kept probes (memo.py), and cuts a probe short where it cannot
win. The layer above the memo and below the batching policy (adaptive.py).
"""

from __future__ import annotations

import math
from typing import Final

from librt.vecs import vec
from mypy_extensions import i64

from poolpipe.scheduler.bounds import Bounds
from poolpipe.scheduler.memo import Kept, ProbeMemo
from poolpipe.scheduler.messages import Dispatch, Hop, StageReport
from poolpipe.scheduler.reference import plain_probe
from poolpipe.scheduler.reservations import ReservationTable
from poolpipe.scheduler.state import LOST, ClusterIndex, Latencies, Probe, Tables

# A probe cut short cuts this much later than asked (µs), so that its LOST, kept, answers
# the model's next decisions too: their cuts move by round-off where the lead pipeline's
# kept probe answers them at a later time. (A path that finishes between the two cuts
# loses the comparison all the same: E9.)
CUT_SLACK_US: Final = 1e-3


def reservation_key(dispatch: i64, hop: i64) -> i64:
    """Key of a hop's compute reservation; its transfer's is this + 1 (a pipeline has at
    most topology.MAX_HOPS hops, checked where its topology is made)."""
    return dispatch * 64 + hop * 2


class Prober:
    """Probes, reserves and corrects on the tables (state.Tables), keeping the bounds and
    the memo up to date with every change."""

    __slots__ = (
        "bounds",
        "index",
        "lat",
        "memo",
        "pack",
        "plain",
        "probes",
        "prune",
        "rr",
        "tables",
    )

    def __init__(
        self,
        index: ClusterIndex,
        tables: Tables,
        lat: Latencies,
        bounds: Bounds,
        memo: ProbeMemo,
    ) -> None:
        self.index = index
        self.tables = tables
        self.lat = lat
        self.bounds = bounds
        self.memo = memo
        self.probes: i64 = 0  # probes made (not answered from the memo)
        # per pool: where its next scan starts, so that equally good vGPUs and NICs take turns
        self.rr = vec[i64]([0] * len(index.flat))
        # Load-proportional packing: every scan starts at the pool's first vGPU (group), so
        # of equally good choices the lowest-numbered takes the batch and the highest stay
        # idle at a low load (False, or a dispatch reserved `busy`: equally good choices
        # take turns, `rr`).
        self.pack = False
        # Skip a compared pipeline whose pools' bounds put its wait above the best one's, and
        # cut its probe short where it cannot finish first (False: probe every pipeline not
        # skipped otherwise, in full; the equivalence tests' plain rule).
        self.prune = True
        # every probe by the specification (reference.plain_probe): the reference plane
        self.plain = False

    # ------------------------------------------------------------------ probe

    def probe(self, pi: int, b: int, now: float, cut: float) -> Probe:
        """Where and when a batch of b would run on pipeline pi if dispatched now. Nothing is
        reserved. The hot path: typed locals (compiled, floats stay unboxed).

        `cut` (at the planned batch only; inf: none): a finish the caller has no use for.
        Where every choice of a hop would finish the path at or after it (the hop's end, or
        the uplink slot for the next transfer, plus every later stage and transfer), the
        probe stops and returns LOST (E6). Otherwise each hop is chosen as without it: the
        choice is the least (key, start) first in scan order, and `cut` only starts the
        search lower. A kept answer that holds is given again (E5, E6: memo.py)."""
        if self.plain:
            self.probes += 1
            return plain_probe(self.index, self.tables, self.lat, self.rr, pi, b, now)
        memo = self.memo
        kept = memo.kept[pi]
        if self.prune:
            answered = memo.answer(kept, b, now, cut)
            if answered is not None:
                return answered
            cut += CUT_SLACK_US  # (inf stays inf)
        self.probes += 1
        bounds = self.bounds
        if now < bounds.bound_from:
            bounds.rebound(now)  # a probe of the past (tests): the bounds hold from `now` on
        index = self.index
        lats, tin = self.lat.lat, self.lat.tin
        t = now
        wait = 0.0
        path: list[Hop] = []
        prev: i64 = -1
        first_start = now
        links: i64 = 0  # the versions of the links its choices read (memo.path_links)
        pipe_pools = index.pipe_pools[pi]
        npools = len(pipe_pools)
        uplink, server_of = self.tables.uplink, index.server_of
        up_version, down_version = self.tables.up_version, self.tables.down_version
        upend = self.tables.upend.v
        rest = self.lat.rest[pi]
        for d in range(npools):
            pid = pipe_pools[d]
            lat = lats[pid][b]
            # no choice whose key is at or above this can finish before `cut`
            cut_key = cut - rest[d] if cut < math.inf else math.inf
            # Look one transfer ahead: among vGPUs finishing equally early, prefer one whose
            # server can send the result on at once (the greedy rule would ignore the NIC).
            out = b * tin[pipe_pools[d + 1]] if d + 1 < npools else 0.0
            if prev < 0 and not index.inputs[pid]:
                hop = self.first_hop(pid, lat, out, t, cut_key)
                if hop is None:
                    return self._lost(kept, b, now, cut, math.inf if d == 0 else first_start, path)
                first_start = hop.start_us
                wait += hop.start_us - t
            else:
                # a feature map from vGPU `prev`, or (prev < 0) the requests' inputs from
                # outside the cluster: the receiving server's downlink alone
                dur = b * tin[pid]
                t_up = t
                if prev >= 0 and dur > 0 and upend[server_of[prev]] > t:
                    t_up = uplink[server_of[prev]].earliest_slot(t, dur)
                hop = self.later_hop(pid, lat, dur, out, t, t_up, prev, cut_key)
                if hop is None:
                    if d == 1 and self.lost_whatever_first(pid, b, t_up, dur, cut_key):
                        return self._lost(kept, b, now, cut, math.inf, [])
                    return self._lost(kept, b, now, cut, math.inf if d == 0 else first_start, path)
                # (memo.path_links, summed as the path is made)
                if prev >= 0:
                    links += up_version[server_of[prev]]
                links += down_version[server_of[hop.vgpu]]
                if prev < 0:
                    first_start = hop.transfer_start_us  # the batch leaves when its inputs are sent
                wait += (hop.transfer_start_us - t) + (hop.start_us - hop.transfer_end_us)
            path.append(hop)
            t = hop.end_us
            prev = hop.vgpu  # the vGPU that holds the batch now
        if self.prune:
            memo.keep(kept, b, now, path, links, first_start)
        return Probe(wait, t, first_start, path)

    def _lost(
        self, kept: Kept, b: i64, now: float, cut: float, until: float, path: list[Hop]
    ) -> Probe:
        if self.prune:
            return self.memo.lost(kept, b, now, cut, until, path)
        return LOST

    def first_hop(self, pid: i64, lat: float, out: float, t: float, cut_key: float) -> Hop | None:
        """A first hop's choice in pool pid at `t` (its vGPUs, in scan order from rr[pid]),
        None where no choice's key is below `cut_key`. Records the pool booked where every
        vGPU was scanned (E8)."""
        tables, uplink = self.tables.vgpu, self.tables.uplink
        vend, upend = self.tables.vend.v, self.tables.upend.v
        server_of = self.index.server_of
        flat = self.index.flat[pid]
        tree = self.bounds.ftree[pid]
        r = self.rr[pid]
        i: i64
        p: i64
        best_key, best_start, best_v = cut_key, math.inf, -1
        least = math.inf  # the earliest start of any vGPU of the pool
        every = True
        # A seed: the vGPU of the least bound, most likely the best. What it would give
        # bounds the scan (which alone decides, ties in scan order included).
        seed = math.inf
        if tree.lowest() < math.inf:
            v = flat[tree.argmin()]
            least = tables[v].earliest_slot(t, lat) if vend[v] > t else t
            f = least + lat
            srv = server_of[v]
            seed = uplink[srv].earliest_slot(f, out) if out and upend[srv] > f else f
        # The vGPUs in scan order from r; the tree skips those whose bound says they can
        # neither beat the seed or the best so far nor lower `least` (E4).
        n = len(flat)
        bounds, leaves = tree.least, tree.size
        p = 0
        while p < n:
            # (the next member read here: where it qualifies, it is what tree.scan would
            # answer; a run of idle vGPUs at a thousand GPUs did not need it)
            i = r + p if r + p < n else r + p - n
            x = bounds[leaves + i]
            if not (x < least or (x + lat < best_key and x + lat <= seed)):
                p = tree.scan(p, r, least, lat, best_key, seed)
                if p >= n:
                    break
                i = r + p if r + p < n else r + p - n
            v = flat[i]
            p += 1
            s = tables[v].scan(t, lat)[0] if vend[v] > t else t
            if s < least:
                least = s
            if s + lat >= best_key:  # key >= s + lat: cannot win, not even a tie
                continue
            f = s + lat
            srv = server_of[v]
            key = uplink[srv].earliest_slot(f, out) if out and upend[srv] > f else f
            if key < best_key or (key == best_key and s < best_start):
                best_key, best_start, best_v = key, s, v
                if key <= t + lat:
                    every = False
                    break
        if every:  # every vGPU scanned
            self.bounds.set_booked(pid, least, t, lat)
        if best_v < 0:
            return None
        return Hop(pid, best_v, -1, t, t, best_start, best_start + lat)

    def later_hop(
        self,
        pid: i64,
        lat: float,
        dur: float,
        out: float,
        t: float,
        t_up: float,
        prev: i64,
        cut_key: float,
    ) -> Hop | None:
        """A later hop's choice in pool pid (its servers' groups in scan order from rr[pid],
        as for a first hop): the feature map of vGPU `prev` (prev < 0: the requests' inputs
        from outside the cluster) ready at `t`, its uplink free for `dur` µs from `t_up`;
        None where no choice's key is below `cut_key`."""
        tables, uplink, downlink = self.tables.vgpu, self.tables.uplink, self.tables.downlink
        vend, upend, downend = self.tables.vend.v, self.tables.upend.v, self.tables.downend.v
        server_of = self.index.server_of
        up: ReservationTable | None = uplink[server_of[prev]] if prev >= 0 else None
        floor = t_up + dur + lat  # nothing can finish earlier
        r = self.rr[pid]
        gsrv, gvg = self.index.gsrv[pid], self.index.gvg[pid]
        tree = self.bounds.gtree[pid]
        p: i64
        g: i64
        # the best so far (None: none below the cut yet), and its key
        best: Hop | None = None
        best_key = cut_key
        n = len(gsrv)
        bounds, leaves = tree.least, tree.size
        p = 0
        while p < n:
            g = r + p if r + p < n else r + p - n
            if not bounds[leaves + g] + lat < best_key:  # (tree.scan's test, read here)
                p = tree.scan(p, r, -math.inf, lat, best_key, math.inf)
                if p >= n:
                    break
                g = r + p if r + p < n else r + p - n
            p += 1
            srv = gsrv[g]
            vgs = gvg[g]
            # Skip the server when none of its vGPUs could beat the best even if the
            # transfer ended as early as it can (slots only move later with time: E1).
            lb = math.inf
            for v in vgs:
                s = floor - lat
                if vend[v] > s:
                    s = tables[v].scan(s, lat)[0]
                if s < lb:
                    lb = s
            if lb + lat >= best_key:
                continue
            down = downlink[srv]
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
            if te + lat >= best_key:
                continue
            srv_up = uplink[srv]
            for v in vgs:
                vts, vte = ts, te  # this vGPU's transfer (see below)
                while True:
                    s = vte
                    if vend[v] <= s:
                        break  # free from s on (and anything reserved starts before vte)
                    s, prior = tables[v].scan(s, lat)
                    if prior <= vte or prev < 0:
                        break
                    # A feature map in before the compute reserved ahead of it on v is due
                    # to start could overtake that one's (a node runs its queue in arrival
                    # order): it arrives once that one starts.
                    vts = max(t, prior - dur)
                    if dur > 0 and up is not None:  # (prev >= 0: it is not None)
                        vts = self._common_slot(up, server_of[prev], down, srv, vts, dur)
                    # (at least then: (prior - dur) + dur may round below prior, and the same
                    # stage overtaken again for ever; g3 on hc1-large, dart-r)
                    vte = max(vts + dur, prior)
                f = s + lat
                if f >= best_key:
                    continue
                key = srv_up.earliest_slot(f, out) if out and upend[srv] > f else f
                if key < best_key or (key == best_key and (best is None or f < best.end_us)):
                    best_key = key
                    best = Hop(pid, v, prev, vts, vte, s, f)
                    if s <= te:
                        break
            if best_key <= floor:
                break
        return best

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
        upend, downend = self.tables.upend.v, self.tables.downend.v
        t = up.earliest_slot(t, dur) if upend[up_srv] > t else t
        while True:
            x = down.earliest_slot(t, dur) if downend[down_srv] > t else t
            if x == t:
                return t
            t = up.earliest_slot(x, dur) if upend[up_srv] > x else x
            if t == x:
                return t

    def lost_whatever_first(
        self, pid: i64, b: int, sent: float, dur: float, cut_key: float
    ) -> bool:
        """(E7.) A probe that lost at its second hop (pool `pid`, the feature map sent at
        `sent` on the uplink its first hop chose) would lose whatever its first hop: no vGPU
        of the pool could finish a stage before `cut_key` even with the map sent at `sent`
        and that uplink free from then on. Then it loses at any later time while no table
        it reads is corrected (kept as LOST until then, not only until its first hop would
        start): every first hop sends at or after `sent`, and every slot found from `sent`
        is one a later probe's starts at or after. A server's vGPUs whose group bound
        already ends a stage at or after the cut are not read (the scan's own test)."""
        lat = self.lat.lat[pid][b]
        server_of, tables = self.index.server_of, self.tables.vgpu
        tree, gvg = self.bounds.gtree[pid], self.index.gvg[pid]
        n = len(gvg)
        g = tree.next_below(0, -math.inf, lat, cut_key, math.inf)
        while g < n:
            for v in gvg[g]:
                x = sent
                if dur > 0:
                    x = self.tables.downlink[server_of[v]].earliest_slot(sent, dur) + dur
                if tables[v].earliest_slot(x, lat) + lat < cut_key:
                    return False
            g = tree.next_below(g + 1, -math.inf, lat, cut_key, math.inf)
        return True

    # ------------------------------------------------------------------ reserve / correct

    def reserve(self, path: list[Hop], did: i64, now: float, busy: bool = False) -> None:
        """Reserve dispatch `did`'s hops; each pool's next scan starts after its choice, or,
        packing and not `busy` (its model's load is light: adaptive.PACK_LOAD), at its
        first vGPU (group)."""
        index, tables, bounds = self.index, self.tables, self.bounds
        server_of = index.server_of
        # (every hop's vGPU is of the one pipeline; its pools' scans start elsewhere now)
        self.memo.vkept[path[0].vgpu].changes += 1
        for h in range(len(path)):
            hop = path[h]
            key = reservation_key(did, h)
            v, src = hop.vgpu, hop.src_vgpu
            table = tables.vgpu[v]
            table.forget_before(now)
            table.reserve(hop.start_us, hop.end_us, key)
            bounds.touch(v, now)
            ts, te = hop.transfer_start_us, hop.transfer_end_us
            if te > ts:
                if src >= 0:  # (the inputs come from outside: no uplink of ours)
                    up = tables.uplink[server_of[src]]
                    up.forget_before(now)
                    up.reserve(ts, te, key + 1)
                    tables.up_version[server_of[src]] += 1
                down = tables.downlink[server_of[v]]
                down.forget_before(now)
                down.reserve(ts, te, key + 1)
                tables.down_version[server_of[v]] += 1
                bounds.touch_down(server_of[v], now)
            pid = hop.pool
            if self.pack and not busy:
                self.rr[pid] = 0
                continue
            if src < 0 and not index.inputs[pid]:
                self.rr[pid] = (index.flat_index[v] + 1) % len(index.flat[pid])
            else:
                self.rr[pid] = (index.group_of[v] + 1) % len(index.groups[pid])

    def corrected(self, v: i64, key: i64, start: float, end: float, now: float) -> None:
        """Reservation `key` of vGPU v replaced by [start, end) (ReservationTable.correct):
        a correction may free time (E1), so v's bound is computed anew and its pool's booked
        record forgotten."""
        self.tables.vgpu[v].correct(key, start, end, now)
        self.memo.vkept[v].changes += 1
        self.bounds.touch(v, now)
        self.bounds.booked_from[self.index.pool_of[v]] = -math.inf

    def transfer_corrected(self, hop: Hop, key: i64, start: float, end: float, now: float) -> None:
        """The transfer into `hop` (reservation key + 1) replaced by [start, end) on the
        sending server's uplink and the receiving one's downlink."""
        server_of, tables, memo = self.index.server_of, self.tables, self.memo
        if hop.src_vgpu >= 0:
            tables.uplink[server_of[hop.src_vgpu]].correct(key + 1, start, end, now)
            memo.changed(memo.upkept[server_of[hop.src_vgpu]])
        tables.downlink[server_of[hop.vgpu]].correct(key + 1, start, end, now)
        memo.changed(memo.downkept[server_of[hop.vgpu]])
        self.bounds.touch_down(server_of[hop.vgpu], now)

    def release(self, d: Dispatch, hop: i64, now: float) -> None:
        """What hop `hop` of dispatch d and the later ones hold, released from `now` on."""
        for h in range(hop, len(d.hops)):
            key = reservation_key(d.id, h)
            x = d.hops[h]
            self.corrected(x.vgpu, key, now, now, now)
            if x.transfer_end_us > x.transfer_start_us:
                self.transfer_corrected(x, key, now, now, now)

    def correct(self, d: Dispatch, report: StageReport, now: float) -> None:
        """Feedback correction. Intervals that are over by `now` cannot affect any later
        probe, so a report that changes nothing from `now` on is not written."""
        hop = d.hops[report.hop]
        key = reservation_key(report.dispatch, report.hop)
        start, end = report.start_us, report.end_us
        length = hop.end_us - hop.start_us
        if end is None:  # started: assume it runs as long as reserved
            if start != hop.start_us:
                self.corrected(hop.vgpu, key, start, start + length, now)
        elif start + length > now:  # done before its assumed end: free the rest
            self.corrected(hop.vgpu, key, start, end, now)
        ts, te = report.transfer_start_us, report.transfer_end_us
        if ts is not None and te is not None and (hop.transfer_end_us > now or te > now):
            # the transfer ended before its reservation did: free the rest
            self.transfer_corrected(hop, key, ts, te, now)

    def invalidate(self) -> None:
        """New latencies: every bound anew, no kept probe holds."""
        self.bounds.rebound(self.bounds.bound_from)  # the shortest stages may be shorter now
        for kept in self.memo.kept:
            kept.changes += 1


__all__ = ["CUT_SLACK_US", "LOST", "Kept", "Probe", "Prober", "reservation_key"]
