"""The probe memo: per pipeline and batch size its last probe, kept to answer the next one
the same while it holds (E5 of docs/design/dataplane-exactness.md), and its last probe cut
short (LOST), kept to answer the next cut as short (E6, E7); and what ends them: the
corrections of the tables a pipeline's probes read, its own dispatches, new latencies, and
new reservations on the links a kept path used (`path_links`). The layer above the bounds
(bounds.py) and below the probe (probe.py).
"""

from __future__ import annotations

import math

from librt.vecs import vec
from mypy_extensions import i64

from poolpipe.scheduler.messages import Hop
from poolpipe.scheduler.state import LOST, ClusterIndex, Latencies, Probe, Tables


class Kept:
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


class ProbeMemo:
    """Every pipeline's Kept, and which of them each table's changes end: a vGPU's (its
    pipeline's), a server's uplink (the pipelines whose pools on it send a feature map on)
    and downlink (those whose later pools on it receive one, or the inputs)."""

    __slots__ = ("downkept", "index", "kept", "tables", "upkept", "vkept")

    def __init__(self, index: ClusterIndex, tables: Tables, lat: Latencies) -> None:
        self.index = index
        self.tables = tables
        n_servers = len(tables.uplink)
        pipe_of_pool = [0] * len(index.flat)
        for pi, pools in enumerate(index.pipe_pools):
            for pid in pools:
                pipe_of_pool[pid] = pi
        # (sized by the largest batch all of its pools have a latency for)
        most = [len(x) - 1 for x in lat.lat]
        self.kept = [Kept(min(most[pid] for pid in pools)) for pools in index.pipe_pools]
        self.vkept = [self.kept[pipe_of_pool[pid]] for pid in index.pool_of]
        self.upkept: list[list[Kept]] = [[] for _ in range(n_servers)]  # per server
        self.downkept: list[list[Kept]] = [[] for _ in range(n_servers)]
        for pi, pools in enumerate(index.pipe_pools):
            kept = self.kept[pi]
            for d, pid in enumerate(pools):
                for v in index.flat[pid]:
                    srv = index.server_of[v]
                    if d + 1 < len(pools) and kept not in self.upkept[srv]:
                        self.upkept[srv].append(kept)
                    if index.later[pid] and kept not in self.downkept[srv]:
                        self.downkept[srv].append(kept)

    def answer(self, kept: Kept, b: i64, now: float, cut: float) -> Probe | None:
        """A pipeline's kept probe at batch b (`kept`: the pipeline's), as a probe made at
        `now` with `cut` would answer, where one holds (see probe.Prober.probe); None where
        none does."""
        changes = kept.changes
        if (
            kept.at[b] == changes
            and kept.now[b] <= now <= kept.start[b]
            and kept.links[b] == self.path_links(kept.path[b])
        ):
            return self.reuse(kept, b, now)
        if (
            kept.lost[b] == changes
            and kept.lost_now[b] <= now <= kept.lost_until[b]
            and cut <= kept.lost_cut[b]
            and kept.lost_links[b] == self.prefix_links(kept.lost_path[b])
        ):
            return LOST
        return None

    def keep(
        self, kept: Kept, b: i64, now: float, path: list[Hop], links: i64, start: float
    ) -> None:
        """A pipeline's probe at batch b made at `now`: `path`, starting at `start`, its
        links' versions then `links` (path_links, summed as the path was made)."""
        kept.at[b] = kept.changes
        kept.links[b] = links
        kept.now[b] = now
        kept.start[b] = start
        kept.path[b] = path

    def lost(
        self, kept: Kept, b: i64, now: float, cut: float, until: float, path: list[Hop]
    ) -> Probe:
        """LOST, kept to answer probes at `until` at the latest (E6, E7), while the hops
        chosen before the one that lost (`path`) hold (prefix_links)."""
        kept.lost_links[b] = self.prefix_links(path)
        kept.lost_path[b] = path
        kept.lost[b] = kept.changes
        kept.lost_now[b] = now
        kept.lost_until[b] = until
        kept.lost_cut[b] = cut
        return LOST

    def reuse(self, kept: Kept, b: i64, now: float) -> Probe:
        """The probe at batch b kept from `kept.now[b]`, as a probe made at `now` would
        answer (E5): the same path, its first hop's wait counted from `now`. A cut probe
        gets the whole path where it might have been LOST: a path that could not finish
        before the cut loses the comparison either way. The wait is summed as the probe
        sums it (the same floats). Its hops are copied only for a dispatch (hops): most
        answers kept are compared and let go."""
        old = kept.path[b]
        h0 = old[0]
        if self.index.inputs[h0.pool]:
            wait = (h0.transfer_start_us - now) + (h0.start_us - h0.transfer_end_us)
        else:
            wait = h0.start_us - now
        t = h0.end_us
        for d in range(1, len(old)):
            x = old[d]
            wait += (x.transfer_start_us - t) + (x.start_us - x.transfer_end_us)
            t = x.end_us
        return Probe(wait, t, kept.start[b], old, now)

    def hops(self, pr: Probe) -> list[Hop]:
        """The hops of probe `pr` as a dispatch takes them: a kept path answered again at
        `kept_from` is the same path, its first hop (a vGPU's, whose batch leaves as it
        starts) made at that time."""
        old = pr.path
        if pr.kept_from == -math.inf:
            return old
        h0 = old[0]
        path: list[Hop] = []
        if self.index.inputs[h0.pool]:
            path.append(h0)
        else:
            now = pr.kept_from
            path.append(Hop(h0.pool, h0.vgpu, -1, now, now, h0.start_us, h0.end_us))
        for d in range(1, len(old)):
            path.append(old[d])
        return path

    def path_links(self, path: list[Hop]) -> i64:
        """The versions of the links a path's choices read, summed (versions only grow:
        the sum is the same while each is): the uplink each hop's feature map leaves by
        (the one the hop before chose to send on) and the downlink it comes in by."""
        server_of, inputs = self.index.server_of, self.index.inputs
        up, down = self.tables.up_version, self.tables.down_version
        n: i64 = 0
        for h in range(len(path)):
            hop = path[h]
            src = hop.src_vgpu
            if src >= 0:
                n += up[server_of[src]] + down[server_of[hop.vgpu]]
            elif inputs[hop.pool]:
                n += down[server_of[hop.vgpu]]
        return n

    def prefix_links(self, path: list[Hop]) -> i64:
        """path_links of the hops before one that lost, and the uplink the last of them
        chose to send on (a reservation there may move that choice)."""
        if not len(path):
            return 0
        return self.path_links(path) + self.tables.up_version[self.index.server_of[path[-1].vgpu]]

    def changed(self, readers: list[Kept]) -> None:
        """A table was corrected (it may have freed time), or new latencies came: no kept
        probe of the pipelines that read it holds."""
        for kept in readers:
            kept.changes += 1
