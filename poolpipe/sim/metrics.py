"""What a simulation run measured: per-model outcomes (on time / late / dropped; a late
completion is a miss), latency percentiles, GPU-class utilization, batch sizes, transfer
waits, and the data plane's own cost (probes and scheduling time per batch)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from poolpipe.sim.engine import Simulator

# SLO attainment that counts as "serving the load" in capacity searches.
ATTAINMENT_TARGET = 0.99
# What became of each request (a late completion is a miss).
ON_TIME, LATE, DROPPED, PENDING = 0, 1, 2, 3


@dataclass(frozen=True)
class ModelOutcome:
    name: str
    arrived: int
    on_time: int
    late: int
    dropped: int
    latency_p50_us: float  # of completed requests (late ones included)
    latency_p99_us: float
    rate_per_s: float  # offered load

    @property
    def attainment(self) -> float:
        return self.on_time / self.arrived if self.arrived else 1.0


@dataclass(frozen=True)
class SimResult:
    data_plane: str
    duration_s: float  # arrival window
    makespan_s: float  # until the last request was answered
    models: tuple[ModelOutcome, ...]
    utilization: dict[str, float]  # per GPU type: busy GPU-time / (makespan x GPUs of type)
    mean_batch: dict[str, float]  # per pool label (model/pipeline/partition): mean requests
    transfer_wait_us_mean: float
    probes_per_batch: float
    sched_us_per_batch_median: float
    sched_us_per_batch_mean: float
    batches: int
    wall_s: float
    drop_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def arrived(self) -> int:
        return sum(m.arrived for m in self.models)

    @property
    def attainment(self) -> float:
        arrived = self.arrived
        return sum(m.on_time for m in self.models) / arrived if arrived else 1.0

    @property
    def requests_per_wall_s(self) -> float:
        return self.arrived / self.wall_s if self.wall_s > 0 else float("inf")

    def model(self, name: str) -> ModelOutcome:
        return next(m for m in self.models if m.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for m, md in zip(self.models, d["models"], strict=True):
            md["attainment"] = m.attainment
        d["attainment"] = self.attainment
        d["requests_per_wall_s"] = self.requests_per_wall_s
        return d


def summarize(sim: Simulator, wall_s: float) -> SimResult:
    topo = sim.topo
    outcome = np.asarray(sim.outcome, dtype=np.int8)
    model = np.asarray(sim.arrival_model, dtype=np.int64)
    arrival = np.asarray(sim.arrival_us)
    finish = np.asarray(sim.finish_us)
    duration_s = sim.config.duration_s
    makespan_us = max(sim.now, duration_s * 1e6)
    models = []
    for m in topo.models:
        mask = model == m.index
        o = outcome[mask]
        lat = (finish[mask] - arrival[mask])[o != DROPPED]
        lat = lat[np.isfinite(lat)]
        models.append(
            ModelOutcome(
                name=m.name,
                arrived=int(mask.sum()),
                on_time=int((o == ON_TIME).sum()),
                late=int((o == LATE).sum()),
                dropped=int((o == DROPPED).sum()),
                latency_p50_us=float(np.percentile(lat, 50)) if lat.size else float("nan"),
                latency_p99_us=float(np.percentile(lat, 99)) if lat.size else float("nan"),
                rate_per_s=float(mask.sum()) / duration_s,
            )
        )
    busy: dict[str, float] = defaultdict(float)
    for v in topo.vgpus:
        busy[v.gpu] += sim.vgpu_busy_us[v.id] / v.share
    utilization = {
        gpu: busy.get(gpu, 0.0) / (makespan_us * count) if count else 0.0
        for gpu, count in topo.gpu_counts.items()
    }
    mean_batch = {}
    for pool in topo.pools:
        total = sim.pool_batches[pool.id]
        if total:
            label = f"{topo.models[pool.model].name}/p{pool.pipeline}/{pool.position}:{pool.gpu}"
            mean_batch[label] = sim.pool_requests[pool.id] / total
    per_batch = sim.sched_per_batch
    batches = max(sim.batches, 1)
    return SimResult(
        data_plane=sim.dp.name,
        duration_s=duration_s,
        makespan_s=makespan_us / 1e6,
        models=tuple(models),
        utilization=utilization,
        mean_batch=mean_batch,
        transfer_wait_us_mean=sim.transfer_wait_us / sim.transfers if sim.transfers else 0.0,
        probes_per_batch=sim.dp.probes / batches,
        sched_us_per_batch_median=statistics.median(per_batch) * 1e6 if per_batch else 0.0,
        sched_us_per_batch_mean=sim.sched_seconds * 1e6 / batches,
        batches=sim.batches,
        wall_s=wall_s,
        drop_reasons=dict(sim.drop_reasons),
    )
