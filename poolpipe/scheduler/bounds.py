"""Lower bounds on when each vGPU and server group can start a stage (E3, E4 of
docs/design/dataplane-exactness.md, the facts cited below by number), kept in a tree per
pool so that a probe skips, in O(log n), every run of members that cannot beat the best
found so far; and per pool the record of its last probe that found every vGPU booked
(E8). The layer above the state records (state.py) and below the probe memo (memo.py).
"""

from __future__ import annotations

import math

from librt.vecs import vec
from mypy_extensions import i64, mypyc_attr

from poolpipe.scheduler.state import ClusterIndex, Latencies, Tables


@mypyc_attr(acyclic=True)
class BoundTree:
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


class Bounds:
    """Per vGPU a lower bound on when it can start a stage of its pool (`touch`), per later
    pool's server group one on when a transfer into the server can end (`touch_down`), and
    per pool the bounds in scan order: of its vGPUs (`ftree`, a first hop's) and of its
    servers' groups (`gtree`). They hold for probes from `bound_from` on (E3)."""

    __slots__ = (
        "booked_from",
        "booked_lat",
        "booked_t",
        "bound_from",
        "dlb",
        "ftree",
        "gtree",
        "hop_trees",
        "index",
        "lat",
        "lb",
        "tables",
    )

    def __init__(self, index: ClusterIndex, tables: Tables, lat: Latencies) -> None:
        self.index = index
        self.tables = tables
        self.lat = lat
        n_pools = len(index.flat)
        self.lb = vec[float]([-math.inf] * len(index.pool_of))
        self.ftree = [BoundTree(len(flat)) for flat in index.flat]
        self.gtree = [BoundTree(len(groups)) for groups in index.groups]
        self.bound_from = -math.inf  # every bound holds for probes from this time on
        # Per pool and server group (a later pool's): a lower bound on when a transfer into
        # the server can end, as a start bound of the group's vGPUs. A feature map's
        # transfer starts no earlier than lat.offset[pool] after the probe, where the
        # downlink is booked ahead by the batches already sent: without it a busy
        # downlink's server looked as good as its idle vGPUs, and a probe scanned a third
        # of a 63-server pool for the earliest transfer.
        self.dlb = [vec[float]([-math.inf] * len(groups)) for groups in index.groups]
        # Per pool, from its last probe that found no vGPU free at once: no vGPU of the pool
        # can start a stage of booked_lat µs at or after booked_t before booked_from.
        # Reservations only push starts later, and later times or longer stages start no
        # earlier, so it holds until a correction frees a table of the pool (-inf: unknown).
        self.booked_from = vec[float]([-math.inf] * n_pools)
        self.booked_t = vec[float]([0.0] * n_pools)
        self.booked_lat = vec[float]([0.0] * n_pools)
        # per pipeline, the bound tree its probe scans at each hop (wait_bound)
        self.hop_trees = [
            [
                self.ftree[pid] if d == 0 and not index.inputs[pid] else self.gtree[pid]
                for d, pid in enumerate(pools)
            ]
            for pools in index.pipe_pools
        ]

    def touch(self, v: i64, now: float) -> None:
        """vGPU v's table changed at `now`: its bound anew, and its pool's trees."""
        index = self.index
        pid = index.pool_of[v]
        x = self.tables.vgpu[v].earliest_slot(now, self.lat.lat_min[pid])
        lbs = self.lb
        if lbs[v] != x:
            lbs[v] = x
            if index.first[pid]:
                self.ftree[pid].set(index.flat_index[v], x)
            if index.later[pid]:
                self.group_bound(pid, index.group_of[v])
        if now > self.bound_from:
            self.bound_from = now

    def group_bound(self, pid: i64, g: i64) -> None:
        """Server group g of pool pid: its bound anew (its vGPUs' least, or its downlink's)."""
        lbs = self.lb
        m = math.inf
        for u in self.index.gvg[pid][g]:
            y = lbs[u]
            if y < m:
                m = y
        d = self.dlb[pid][g]
        self.gtree[pid].set(g, d if d > m else m)

    def touch_down(self, srv: i64, now: float) -> None:
        """Server srv's downlink table changed at `now`: the bounds of its groups anew. A
        transfer of at least one sample into pool pid starts no earlier than `now` plus
        the pool's offset, so the vGPU's stage no earlier than its end."""
        groups = self.index.down_groups[srv]
        if not groups:
            return
        down = self.tables.downlink[srv]
        lat = self.lat
        for pid, g in groups:
            tin = lat.tin[pid]
            if tin > 0:
                x = down.earliest_slot(now + lat.offset[pid], tin) + tin
                if x != self.dlb[pid][g]:
                    self.dlb[pid][g] = x
                    self.group_bound(pid, g)
        if now > self.bound_from:
            self.bound_from = now

    def rebound(self, now: float) -> None:
        """Every bound anew from `now` (a probe earlier than the last change, new latencies)."""
        if now == -math.inf:
            return  # nothing bounded yet
        self.bound_from = -math.inf
        index = self.index
        for srv in range(len(index.down_groups)):
            self.touch_down(srv, now)
        for v in range(len(index.pool_of)):
            self.touch(v, now)
        for pid in range(len(index.groups)):
            if index.later[pid]:
                for g in range(len(index.groups[pid])):
                    self.group_bound(pid, g)

    def set_booked(self, pid: i64, least: float, t: float, lat: float) -> None:
        """A probe at `t` scanned every vGPU of pool pid: none starts a stage of `lat` µs
        before `least`."""
        self.booked_from[pid] = least
        self.booked_t[pid] = t
        self.booked_lat[pid] = lat

    def booked_past(self, pid: i64, now: float, wait: float, lat: float) -> bool:
        """(E8.) No vGPU of pool pid can start a stage of `lat` µs within `wait` of `now`."""
        return (
            self.booked_from[pid] - now > wait
            and now >= self.booked_t[pid]
            and lat >= self.booked_lat[pid]
        )

    def wait_bound(self, pi: i64, now: float) -> float:
        """A lower bound on the wait of pipeline pi's probe at its planned batch at `now`
        (-inf when the bounds may not hold at `now`)."""
        if now < self.bound_from:
            return -math.inf
        trees = self.hop_trees[pi]
        ahead = self.lat.ahead[pi]
        most = -math.inf
        for d in range(len(trees)):
            x = trees[d].lowest() - now - ahead[d]
            if x > most:
                most = x
        return most
