"""The probe's specification: docs/design/dataplane.md's plain rule, written with nothing but
`earliest_slot` and `earliest_common_slot` over every candidate, ties included. The fast
probe (probe.py) must answer exactly this (E1-E9 of docs/design/dataplane-exactness.md say
why it does); `--data-plane reference` serves with it, and `--data-plane checked` runs both
planes side by side and stops at the first decision where they differ (checked.py).

Each hop takes the vGPU with the least (key, start), first in scan order from the pool's
rotating start: for a first hop its vGPUs, for a later hop its servers' groups (one
transfer slot per server). The key is the stage's finish, or, where a feature map goes on
to another pool, the slot on the vGPU's server's uplink for it.
"""

from __future__ import annotations

import math

from librt.vecs import vec
from mypy_extensions import i64

from poolpipe.scheduler.messages import Hop
from poolpipe.scheduler.reservations import ReservationTable, earliest_common_slot
from poolpipe.scheduler.state import LOST, ClusterIndex, Latencies, Probe, Tables


def plain_probe(
    index: ClusterIndex, tables: Tables, lat: Latencies, rr: vec[i64], pi: int, b: int, now: float
) -> Probe:
    """Where and when a batch of b would run on pipeline pi if dispatched at `now` (`rr`:
    per pool, where its scan starts); LOST where a pool has no vGPU in service (each
    reserved for ever: set_vgpu_down)."""
    pools = index.pipe_pools[pi]
    t, wait, prev, first_start = now, 0.0, -1, now
    path: list[Hop] = []
    for d in range(len(pools)):
        pid = pools[d]
        stage = lat.lat[pid][b]
        out = b * lat.tin[pools[d + 1]] if d + 1 < len(pools) else 0.0
        if prev < 0 and not index.inputs[pid]:
            hop = _first_hop(index, tables, pid, stage, out, t, rr[pid])
            first_start = hop.start_us
        else:
            hop = _later_hop(index, tables, pid, stage, b * lat.tin[pid], out, t, prev, rr[pid])
            if prev < 0 and hop.end_us < math.inf:
                first_start = hop.transfer_start_us  # the batch leaves when its inputs are sent
        if hop.end_us == math.inf:
            return LOST
        wait += (hop.transfer_start_us - t) + (hop.start_us - hop.transfer_end_us)
        t = hop.end_us
        prev = hop.vgpu
        path.append(hop)
    return Probe(wait, t, first_start, path)


def _send_on(tables: Tables, srv: int, finish: float, out: float) -> float:
    """A choice's key: its finish, or the uplink's slot for the feature map it sends on."""
    return tables.uplink[srv].earliest_slot(finish, out) if out else finish


def _first_hop(
    index: ClusterIndex, tables: Tables, pid: int, stage: float, out: float, t: float, r: int
) -> Hop:
    flat = index.flat[pid]
    n = len(flat)
    best_key, best_start, best_v = math.inf, math.inf, -1
    for i in range(n):
        v = flat[(r + i) % n]
        s = tables.vgpu[v].earliest_slot(t, stage)
        key = _send_on(tables, index.server_of[v], s + stage, out)
        if best_v < 0 or key < best_key or (key == best_key and s < best_start):
            best_key, best_start, best_v = key, s, v
    return Hop(pid, best_v, -1, t, t, best_start, best_start + stage)


def _later_hop(
    index: ClusterIndex,
    tables: Tables,
    pid: int,
    stage: float,
    dur: float,
    out: float,
    t: float,
    prev: int,
    r: int,
) -> Hop:
    """The feature map of vGPU `prev` (prev < 0: the requests' inputs from outside the
    cluster) ready at `t`, `dur` µs on the wire."""
    groups = index.groups[pid]
    up: list[ReservationTable] = [] if prev < 0 else [tables.uplink[index.server_of[prev]]]
    best: Hop | None = None
    best_key = math.inf
    for i in range(len(groups)):
        srv, vgs = groups[(r + i) % len(groups)]
        links = [*up, tables.downlink[srv]]
        sent = earliest_common_slot(links, t, dur) if dur > 0 else t
        for v in vgs:
            ts, te = sent, sent + dur
            while True:
                table = tables.vgpu[v]
                s = table.earliest_slot(te, stage)
                # A feature map in before the compute reserved ahead of it on v is due to
                # start would overtake that one's (a node runs its queue in arrival order):
                # it is sent to arrive once that one starts.
                ahead = _latest_start_before(table, s)
                if prev < 0 or ahead <= te:
                    break
                ts = max(t, ahead - dur)
                ts = earliest_common_slot(links, ts, dur) if dur > 0 else ts
                te = max(ts + dur, ahead)  # (at least then, whatever the round-off)
            key = _send_on(tables, srv, s + stage, out)
            f = s + stage
            if best is None or key < best_key or (key == best_key and f < best.end_us):
                best_key = key
                best = Hop(pid, v, prev, ts, te, s, f)
    assert best is not None, "a pool has at least one vGPU"
    return best


def _latest_start_before(table: ReservationTable, s: float) -> float:
    """The latest start of a reservation of `table` before `s` (-inf: none)."""
    latest = -math.inf
    for a, _ in table.intervals():
        if a < s and a > latest:
            latest = a
    return latest


__all__ = ["plain_probe"]
