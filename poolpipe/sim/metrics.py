"""What a simulation run measured: per-model outcomes (on time / late / dropped / failed; a
late completion is a miss), the same per second of simulated time (by arrival), latency
percentiles, GPU-class utilization, batch sizes, transfer waits, rollouts, and the data
plane's own cost (probes and scheduling time per batch)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from poolpipe.runtime import DROPPED, FAILED, LATE, ON_TIME, PENDING, PlanUsage, ServingRuntime
from poolpipe.scheduler import Topology

# SLO attainment that counts as "serving the load" in capacity searches.
ATTAINMENT_TARGET = 0.99
__all__ = ["ATTAINMENT_TARGET", "DROPPED", "FAILED", "LATE", "ON_TIME", "PENDING"]


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
    failed: int = 0  # a stage failed with no live path or no attempt left

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
    # per second of simulated time, by arrival: {model: {arrived: [...], on_time: [...], ...}}
    per_second: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    events: tuple[dict[str, Any], ...] = ()  # scenario events as they happened
    rollouts: tuple[dict[str, Any], ...] = ()  # each with its simulated downtime
    # per physical GPU ("T4#3": the type's fourth): busy GPU-time / makespan; 0.0 for one
    # that ran nothing (packing leaves those idle at a low load: they can be released)
    gpu_busy: dict[str, float] = field(default_factory=dict)

    @property
    def gpus_idle(self) -> int:
        """GPUs that ran no stage at all."""
        return sum(1 for b in self.gpu_busy.values() if b == 0.0)

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


COUNTED = (("on_time", ON_TIME), ("late", LATE), ("dropped", DROPPED), ("failed", FAILED))


class _Config(Protocol):
    @property
    def duration_s(self) -> float: ...


class _Cluster(Protocol):
    @property
    def retired(self) -> Sequence[PlanUsage]: ...
    @property
    def transfer_wait_us(self) -> float: ...
    @property
    def transfers(self) -> int: ...


class _Plane(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def probes(self) -> int: ...


class _MeteredPlane(_Plane, Protocol):
    @property
    def seconds(self) -> float: ...
    @property
    def per_batch(self) -> Any: ...  # wall s per dispatched batch (an unboxed vector)


class FinishedRun(Protocol):
    """What `summarize` reads of a finished run (the simulator's: engine.Simulator)."""

    @property
    def outcome(self) -> np.ndarray: ...
    @property
    def finish_us(self) -> np.ndarray: ...
    @property
    def arrival_us(self) -> Any: ...  # by request (unboxed vectors)
    @property
    def arrival_model(self) -> Any: ...
    @property
    def now(self) -> float: ...
    @property
    def config(self) -> _Config: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def cluster(self) -> _Cluster: ...
    @property
    def dp(self) -> _Plane: ...
    @property
    def planes(self) -> Sequence[_MeteredPlane]: ...
    @property
    def events(self) -> Sequence[dict[str, Any]]: ...
    @property
    def rollouts(self) -> Sequence[dict[str, Any]]: ...


def summarize(sim: FinishedRun, rt: ServingRuntime, wall_s: float) -> SimResult:
    outcome = np.asarray(sim.outcome, dtype=np.int8)
    model = np.asarray(sim.arrival_model, dtype=np.int64)
    arrival = np.asarray(sim.arrival_us)
    finish = np.asarray(sim.finish_us)
    duration_s = sim.config.duration_s
    makespan_us = max(sim.now, duration_s * 1e6)
    second = (arrival // 1e6).astype(np.int64)
    seconds = max(1, int(np.ceil(duration_s)))
    models, per_second = [], {}
    for index, name in enumerate(m.name for m in sim.topo.models):
        mask = model == index
        o = outcome[mask]
        lat = (finish[mask] - arrival[mask])[(o == ON_TIME) | (o == LATE)]
        lat = lat[np.isfinite(lat)]
        models.append(
            ModelOutcome(
                name=name,
                arrived=int(mask.sum()),
                on_time=int((o == ON_TIME).sum()),
                late=int((o == LATE).sum()),
                dropped=int((o == DROPPED).sum()),
                latency_p50_us=float(np.percentile(lat, 50)) if lat.size else float("nan"),
                latency_p99_us=float(np.percentile(lat, 99)) if lat.size else float("nan"),
                rate_per_s=float(mask.sum()) / duration_s,
                failed=int((o == FAILED).sum()),
            )
        )
        s = second[mask]
        series = {"arrived": np.bincount(s, minlength=seconds)}
        for key, code in COUNTED:
            series[key] = np.bincount(s[o == code], minlength=seconds)
        per_second[name] = {k: v.tolist() for k, v in series.items()}
    busy: dict[str, float] = defaultdict(float)
    gpu_busy = {f"{g}#{k}": 0.0 for g, count in sim.topo.gpu_counts.items() for k in range(count)}
    mean_batch = {}
    # every plan served, in order: those retired, and those the runtime still keeps
    usages = sorted([*sim.cluster.retired, *rt.usage()], key=lambda u: u.generation)
    for use in usages:
        topo = use.served.topo
        for v in topo.vgpus:
            busy[v.gpu] += use.vgpu_busy_us[v.id] / v.share
            gpu = f"{v.gpu}#{v.physical}"
            gpu_busy[gpu] = gpu_busy.get(gpu, 0.0) + use.vgpu_busy_us[v.id] / v.share / makespan_us
        for pool in topo.pools:
            total = use.pool_batches[pool.id]
            if total:
                label = (
                    f"{topo.models[pool.model].name}/p{pool.pipeline}/{pool.position}:{pool.gpu}"
                )
                mean_batch[label] = use.pool_requests[pool.id] / total
    utilization = {
        gpu: busy.get(gpu, 0.0) / (makespan_us * count) if count else 0.0
        for gpu, count in sim.topo.gpu_counts.items()
    }
    per_batch = [x for p in sim.planes for x in p.per_batch]
    batches = max(rt.batches, 1)
    cluster = sim.cluster
    return SimResult(
        data_plane=sim.dp.name,
        duration_s=duration_s,
        makespan_s=makespan_us / 1e6,
        models=tuple(models),
        utilization=utilization,
        mean_batch=mean_batch,
        transfer_wait_us_mean=(
            cluster.transfer_wait_us / cluster.transfers if cluster.transfers else 0.0
        ),
        probes_per_batch=sum(p.probes for p in sim.planes) / batches,
        sched_us_per_batch_median=statistics.median(per_batch) * 1e6 if per_batch else 0.0,
        sched_us_per_batch_mean=sum(p.seconds for p in sim.planes) * 1e6 / batches,
        batches=rt.batches,
        wall_s=wall_s,
        drop_reasons=dict(rt.drop_reasons),
        per_second=per_second,
        events=tuple(sim.events),
        rollouts=tuple(sim.rollouts),
        gpu_busy=gpu_busy,
    )
