"""Why a plan delivers what it does: one simulation at given rates (each model at its
deliverable rate, by default), watched at the data plane, read back per pool and link.

For every batch dispatched the plane's reservations say when its requests waited and where:
queued before dispatch, for a vGPU of each pool, for the links into it. Per pool: how busy
its vGPUs were, how long batches waited for one (p50/p99), the batches and their mean size;
per server link (uplink, downlink): how busy, how long transfers waited. Per model: its share
on time, its drops by reason, and the resource that limits it: of the pools and links on its
pipelines' paths, the one where its requests' 99th-percentile wait is longest (a model that
waits nowhere is limited by its pools' slowest, the busiest of them). Without jitter a
batch runs as reserved, so these are what happened.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from poolpipe.scheduler import (
    DataPlane,
    Decisions,
    Dispatch,
    PlaneWrapper,
    Topology,
    make_data_plane,
)
from poolpipe.sim.arrivals import ArrivalSpec, generate
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import SimResult


@dataclass
class PoolUse:
    pool: int
    model: str
    pipeline: int  # index among the model's pipelines
    position: int
    gpu: str
    share: int
    vgpus: int
    blocks: tuple[int, int]
    utilisation: float  # busy vGPU time / (vGPUs x the run)
    batches: int
    mean_batch: float
    wait_p50_us: float  # a batch's wait for a vGPU of the pool once it could start there
    wait_p99_us: float


@dataclass
class LinkUse:
    server: int
    gpu: str  # the GPU type of the server
    direction: str  # "up" (feature maps out) or "down" (feature maps and inputs in)
    utilisation: float
    transfers: int
    wait_p50_us: float  # a transfer's wait for this link (and the other end's)
    wait_p99_us: float


@dataclass
class ModelUse:
    name: str
    rate: float  # req/s offered
    arrived: int
    on_time: float  # share
    drops: dict[str, int]  # reason -> requests (the plane's; "in its batch": the runtime's)
    queue_p50_us: float  # a request's wait before its batch was dispatched
    queue_p99_us: float
    limit: str  # the resource that limits it (see the module)
    why: str


@dataclass
class Explanation:
    duration_s: float
    seed: int
    models: list[ModelUse]
    pools: list[PoolUse]
    links: list[LinkUse]
    result: SimResult = field(repr=False)


class _Watch(PlaneWrapper):
    """A data plane that records what it decides: each dispatch with the time it was made,
    each drop with its reason."""

    def __init__(self, inner: DataPlane):
        super().__init__(inner)
        self.made: list[tuple[float, Dispatch]] = []
        self.dropped: list[tuple[int, str]] = []

    def decide(self, now: float) -> Decisions:
        dec = super().decide(now)
        for d in dec.dispatches:
            self.made.append((now, d))
        for x in dec.drops:
            self.dropped.append((x.request.model, x.reason))
        return dec


def _p(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def explain(
    topo: Topology,
    rates: Sequence[float],
    *,
    duration_s: float = 30.0,
    seed: int = 1,
    data_plane: str = "reservation",
) -> Explanation:
    """Simulate `topo` with Poisson arrivals at `rates` (req/s per model, topo's order) and
    say where its requests waited (module docstring)."""
    names = [m.name for m in topo.models]
    times, which = generate(ArrivalSpec("poisson"), list(rates), duration_s, seed, names)
    watch = _Watch(make_data_plane(data_plane, topo))
    result = Simulator(topo, watch, times, which, SimConfig(duration_s, seed=seed)).run()
    span_us = max(result.makespan_s, duration_s) * 1e6

    busy: dict[int, float] = defaultdict(float)  # pool -> busy µs
    batches: dict[int, int] = defaultdict(int)
    requests: dict[int, int] = defaultdict(int)
    waits: dict[int, list[float]] = defaultdict(list)  # pool -> waits for a vGPU
    link_busy: dict[tuple[int, str], float] = defaultdict(float)  # (server, dir) -> µs
    link_n: dict[tuple[int, str], int] = defaultdict(int)
    link_waits: dict[tuple[int, str], list[float]] = defaultdict(list)
    queued: dict[int, list[float]] = defaultdict(list)  # model -> request waits
    by_model_waits: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    vgpu_server = [v.server for v in topo.vgpus]
    for now, d in watch.made:
        for r in d.requests:
            queued[r.model].append(now - r.arrival_us)
        ready = now
        for hop in d.hops:
            pool = hop.pool
            if hop.src_vgpu >= 0 or hop.transfer_end_us > hop.transfer_start_us:
                length = hop.transfer_end_us - hop.transfer_start_us
                wait = max(0.0, hop.transfer_start_us - ready)
                ends = [(vgpu_server[hop.vgpu], "down")]
                if hop.src_vgpu >= 0:
                    ends.append((vgpu_server[hop.src_vgpu], "up"))
                for key in ends:
                    link_busy[key] += length
                    link_n[key] += 1
                    link_waits[key].append(wait)
                    by_model_waits[d.model][f"{key[1]}link of server {key[0]}"].append(wait)
                ready = hop.transfer_end_us
            wait = max(0.0, hop.start_us - ready)
            waits[pool].append(wait)
            by_model_waits[d.model][f"pool {pool}"].append(wait)
            busy[pool] += hop.end_us - hop.start_us
            batches[pool] += 1
            requests[pool] += len(d.requests)
            ready = hop.end_us

    index_in_model = {p.id: topo.pipelines[p.pipeline].index for p in topo.pools}
    pools = [
        PoolUse(
            pool=p.id,
            model=names[p.model],
            pipeline=index_in_model[p.id],
            position=p.position,
            gpu=p.gpu,
            share=p.share,
            vgpus=len(p.vgpus),
            blocks=(p.start, p.end),
            utilisation=busy[p.id] / (span_us * len(p.vgpus)) if p.vgpus else 0.0,
            batches=batches[p.id],
            mean_batch=requests[p.id] / batches[p.id] if batches[p.id] else 0.0,
            wait_p50_us=_p(waits[p.id], 50),
            wait_p99_us=_p(waits[p.id], 99),
        )
        for p in topo.pools
    ]
    server_gpu = {s.id: s.gpu for s in topo.servers}
    links = [
        LinkUse(
            server=srv,
            gpu=server_gpu.get(srv, "?"),
            direction=direction,
            utilisation=link_busy[(srv, direction)] / span_us,
            transfers=link_n[(srv, direction)],
            wait_p50_us=_p(link_waits[(srv, direction)], 50),
            wait_p99_us=_p(link_waits[(srv, direction)], 99),
        )
        for srv, direction in sorted(link_busy)
    ]
    drops: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for model, reason in watch.dropped:
        drops[model][reason] += 1
    models = []
    for k, m in enumerate(result.models):
        plane = sum(drops[k].values())
        reasons = dict(drops[k])
        if m.dropped + m.late > plane:
            reasons["in its batch (late, or dropped by the runtime)"] = m.dropped + m.late - plane
        limit, why = _limit(k, topo, pools, by_model_waits[k])
        models.append(
            ModelUse(
                name=m.name,
                rate=float(rates[k]),
                arrived=m.arrived,
                on_time=m.attainment,
                drops=reasons,
                queue_p50_us=_p(queued[k], 50),
                queue_p99_us=_p(queued[k], 99),
                limit=limit,
                why=why,
            )
        )
    return Explanation(duration_s, seed, models, pools, links, result)


def _limit(
    model: int, topo: Topology, pools: list[PoolUse], waits: dict[str, list[float]]
) -> tuple[str, str]:
    """The resource on model's paths where its requests' p99 wait is longest; with no wait
    anywhere, its busiest pool."""
    worst = max(waits.items(), key=lambda kv: _p(kv[1], 99), default=None)
    if worst is not None and _p(worst[1], 99) > 0:
        name, xs = worst
        if name.startswith("pool "):
            pid = int(name.split()[1])
            p = pools[pid]
            return _pool_name(p), (
                f"batches wait up to {_p(xs, 99) / 1e3:.1f} ms (p99) for one of its "
                f"{p.vgpus} vGPUs, {p.utilisation:.0%} busy"
            )
        return name, f"transfers wait up to {_p(xs, 99) / 1e3:.1f} ms (p99) for the link"
    own = [p for p in pools if topo.pools[p.pool].model == model]
    if not own:
        return "-", "no pipeline"
    p = max(own, key=lambda p: p.utilisation)
    return _pool_name(p), f"no wait; its busiest pool, {p.utilisation:.0%} busy"


def _pool_name(p: PoolUse) -> str:
    share = "" if p.share == 1 else f"/{p.share}"
    return f"pipeline {p.pipeline} [{p.blocks[0]},{p.blocks[1]}) {p.gpu}{share}×{p.vgpus}"
