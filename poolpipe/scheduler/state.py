"""The reservation data plane's state, as named records: what a probe answers (`Probe`),
where everything is (`ClusterIndex`), the reservation tables (`Tables`) and the pools'
latencies as the probe reads them (`Latencies`).

The layers above read these: the bounds (bounds.py) < the probe memo (memo.py) < the probe
(probe.py) < the queues and the batching policy (adaptive.py). Compiled (native.py): a
record's float and int fields are unboxed, and the per-vGPU ones unboxed vectors
(librt.vecs: a list's ints past 256 are objects of their own, and at a thousand GPUs each
read is a cache miss).
"""

from __future__ import annotations

import math
from typing import Final

from librt.vecs import vec
from mypy_extensions import i64, mypyc_attr

from poolpipe.scheduler.messages import Hop
from poolpipe.scheduler.reservations import LastEnds, ReservationTable
from poolpipe.scheduler.topology import Topology, latency_tables


@mypyc_attr(acyclic=True)
class Probe:
    """Where and when a batch would run if dispatched now."""

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
        # (a kept path answered again at this time, its hops not yet copied
        # (ProbeMemo.hops); -inf: `path` is the probe's)
        self.kept_from = kept_from


# What a probe with a cut returns when the pipeline cannot finish before it.
LOST: Final = Probe(math.inf, math.inf, math.inf, [])


class ClusterIndex:
    """Where everything is, from the topology (fixed for the plane's life): per vGPU its
    server, pool and place in its pool's scan orders; per pool its vGPUs in scan order
    (`flat`, a first hop's) and grouped by server (one transfer slot per server, a later
    hop's); per pipeline and model what a probe walks."""

    __slots__ = (
        "down_groups",
        "first",
        "flat",
        "flat_index",
        "group_of",
        "groups",
        "gsrv",
        "gvg",
        "inputs",
        "later",
        "pipe_batch",
        "pipe_pools",
        "pipes",
        "pool_of",
        "server_of",
    )

    def __init__(self, topo: Topology) -> None:
        self.server_of = vec[i64]([v.server for v in topo.vgpus])
        self.pool_of = vec[i64]([v.pool for v in topo.vgpus])
        # per pool: its vGPUs grouped by server, and each server's index among them
        self.groups: list[list[tuple[int, list[int]]]] = []
        group_index: list[dict[int, int]] = []
        for pool in topo.pools:
            by_server: dict[int, list[int]] = {}
            for v in pool.vgpus:
                by_server.setdefault(topo.vgpus[v].server, []).append(v)
            self.groups.append(list(by_server.items()))
            group_index.append({srv: i for i, srv in enumerate(by_server)})
        self.flat = [vec[i64](pool.vgpus) for pool in topo.pools]
        self.gsrv = [vec[i64]([srv for srv, _ in groups]) for groups in self.groups]
        self.gvg = [[vec[i64](vgs) for _, vgs in groups] for groups in self.groups]
        self.flat_index = vec[i64]([0] * len(topo.vgpus))  # per vGPU: its index in flat
        for flat in self.flat:
            for i, v in enumerate(flat):
                self.flat_index[v] = i
        self.group_of = vec[i64](  # per vGPU: its server's index in its pool's groups
            [group_index[v.pool][v.server] for v in topo.vgpus]
        )
        # which scan a pool needs: a pipeline's first pool (its vGPUs), a later one (its
        # servers' groups), or both; a first pool whose requests' inputs cross its server's
        # downlink (topology.with_inputs) is probed like a later one whose feature map comes
        # from outside the cluster
        self.first = [False] * len(topo.pools)
        self.later = [False] * len(topo.pools)
        self.inputs = [False] * len(topo.pools)
        for pipe in topo.pipelines:
            for d, pid in enumerate(pipe.pools):
                if d == 0 and not topo.pools[pid].transfer_in_us > 0:
                    self.first[pid] = True
                else:
                    self.later[pid] = True
                    self.inputs[pid] = d == 0
        # per server: the (pool, group) of the later pools' groups on it
        self.down_groups: list[list[tuple[int, int]]] = [[] for _ in topo.servers]
        for pid in range(len(topo.pools)):
            if self.later[pid]:
                for g, srv in enumerate(self.gsrv[pid]):
                    self.down_groups[srv].append((pid, g))
        self.pipes: list[list[int]] = [list(m.pipelines) for m in topo.models]
        self.pipe_pools = [vec[i64](pipe.pools) for pipe in topo.pipelines]
        self.pipe_batch = vec[i64]([pipe.batch for pipe in topo.pipelines])


class Tables:
    """The reservation tables of every vGPU and every server's uplink and downlink, each
    set's latest ends in one vector (LastEnds: a scan skips a table free from then), and
    per server the count of reservations made on its uplink and its downlink (the link
    versions a kept probe is checked against: memo.py)."""

    __slots__ = (
        "down_version",
        "downend",
        "downlink",
        "up_version",
        "upend",
        "uplink",
        "vend",
        "vgpu",
    )

    def __init__(self, topo: Topology) -> None:
        self.vend = LastEnds(len(topo.vgpus))
        self.upend = LastEnds(len(topo.servers))
        self.downend = LastEnds(len(topo.servers))
        self.vgpu = [
            ReservationTable(f"vgpu{v.id}", self.vend, i) for i, v in enumerate(topo.vgpus)
        ]
        self.uplink = [
            ReservationTable(f"up{s.id}", self.upend, i) for i, s in enumerate(topo.servers)
        ]
        self.downlink = [
            ReservationTable(f"down{s.id}", self.downend, i) for i, s in enumerate(topo.servers)
        ]
        self.up_version = vec[i64]([0] * len(topo.servers))
        self.down_version = vec[i64]([0] * len(topo.servers))


class Latencies:
    """The pools' latencies as the probe reads them, read anew when a live router measures
    them anew (`read`): per pool its latency at batch b, its transfer in per sample, its
    shortest stage and its offset; per pipeline at its planned batch what lies ahead of and
    after each hop, its latency with no waiting, and the largest batch it may grow to; per
    model what its pipelines serve at each batch up to their planned ones (`serves`)."""

    __slots__ = (
        "ahead",
        "grow_to",
        "lat",
        "lat_min",
        "no_wait",
        "offset",
        "rest",
        "serves",
        "tin",
    )

    def __init__(self, topo: Topology) -> None:
        self.lat: list[vec[float]] = []
        self.tin = vec[float]()
        self.lat_min = vec[float]()
        self.offset = vec[float]()
        self.ahead: list[vec[float]] = []
        self.rest: list[vec[float]] = []
        self.no_wait: list[float] = []
        self.grow_to: list[int] = []
        self.serves: list[vec[float]] = []
        self.read(topo)

    def read(self, topo: Topology) -> None:
        self.no_wait, self.grow_to = _per_pipeline(topo)
        self.lat = [vec[float](lat) for lat in latency_tables(topo)]
        self.serves = [vec[float](x) for x in serves_per_batch(topo, self.lat)]
        self.tin = vec[float]([float(pool.transfer_in_us) for pool in topo.pools])
        self.lat_min = vec[float]([min(lat[1:], default=0.0) for lat in self.lat])
        # Per pool: a feature map's transfer into it starts no earlier than this after the
        # probe (the earlier pools' shortest stages; bounds.Bounds.touch_down).
        offset = [math.inf] * len(topo.pools)
        for pipe in topo.pipelines:
            ahead = 0.0
            for pid in pipe.pools:
                offset[pid] = min(offset[pid], ahead)
                ahead += self.lat_min[pid]
        self.offset = vec[float]([x if x < math.inf else 0.0 for x in offset])
        # Per pipeline and hop d at the planned batch b: the earlier pools' stages and the
        # transfers up to d's. A probe's wait is its finish less `now` and every stage and
        # transfer of the path, and it finishes no earlier than hop d's start (at or after
        # its pool's least bound) plus the stages and transfers after it: so its wait is at
        # least that bound less `now` and this (Bounds.wait_bound).
        self.ahead = []
        self.rest = []
        for pipe in topo.pipelines:
            b = pipe.batch
            before: list[float] = []
            x = 0.0
            for pid in pipe.pools:
                x += b * self.tin[pid]
                before.append(x)
                x += self.lat[pid][b]
            self.ahead.append(vec[float](before))
            # and what follows each hop: the later pools' transfers and stages
            after = [0.0] * len(pipe.pools)
            x = 0.0
            for d in range(len(pipe.pools) - 1, 0, -1):
                pid = pipe.pools[d]
                x += self.lat[pid][b] + b * self.tin[pid]
                after[d - 1] = x
            self.rest.append(vec[float](after))


def serves_per_batch(topo: Topology, lat: list[vec[float]]) -> list[list[float]]:
    """Per model, at each batch b up to its pipelines' largest planned one ([b], index 0
    unused): the requests per µs its pipelines serve when every batch is of b (of
    min(b, planned) on a pipeline planned smaller), each pipeline at its slowest pool's
    vGPUs (transfers not counted)."""
    out = []
    for m in topo.models:
        top = max((topo.pipelines[p].batch for p in m.pipelines), default=0)
        per = [0.0] * (top + 1)
        for b in range(1, top + 1):
            for p in m.pipelines:
                pipe = topo.pipelines[p]
                n = min(b, pipe.batch)
                per[b] += min(
                    (len(topo.pools[pid].vgpus) * n / lat[pid][n] if lat[pid][n] > 0 else math.inf)
                    for pid in pipe.pools
                )
        out.append(per)
    return out


def _per_pipeline(topo: Topology) -> tuple[list[float], list[int]]:
    """Per pipeline, from the pools' latencies: the latency at its planned batch with no
    waiting (a bound for pruning probes, and admission's test), and the largest batch it may
    grow to under a backlog (one-partition pipelines only: adaptive.py)."""
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
