"""Outcome counters per served model, and windows over them (what happened since the last
look): the live figures behind the warehouse's per-minute statistics and Prometheus."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from poolpipe.scheduler import Topology

COUNTS = ("arrivals", "on_time", "late", "dropped", "failed", "refused")


@dataclass
class ModelStats:
    arrivals: int = 0
    on_time: int = 0
    late: int = 0
    dropped: int = 0
    failed: int = 0
    refused: int = 0  # at the door: the plan served cannot serve them (intake.Unservable)
    retried: int = 0
    latency_us: list[float] = field(default_factory=list)  # of answered requests
    batch_sizes: Counter[int] = field(default_factory=Counter)  # requests per batch sent

    def clear(self) -> None:
        """From zero, in place (entries in flight keep counting here)."""
        self.arrivals = self.on_time = self.late = self.dropped = self.failed = 0
        self.refused = 0
        self.retried = 0
        self.latency_us.clear()
        self.batch_sizes.clear()

    def counts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COUNTS}


@dataclass(frozen=True)
class ModelWindow:
    """One served model's figures over a window (a row of the warehouse's serving_stats)."""

    model: str
    arrivals: int
    on_time: int
    late: int
    dropped: int
    failed: int
    refused: int  # at the door: the plan served cannot serve them
    p50_ms: float | None  # latency of the requests answered with a result (None: none)
    p99_ms: float | None
    mean_batch: float | None  # requests per batch sent (None: no batch)


@dataclass(frozen=True)
class PoolWindow:
    """One pool of the serving plan over a window (a row of serving_pool_busy)."""

    model: str
    pool: int
    gpu_type: str
    block_start: int
    block_end: int
    vgpus: int
    busy_ms: float  # stage time summed over the pool's vGPUs


@dataclass(frozen=True)
class Window:
    """What happened since the last look: a row per model and one per pool."""

    models: list[ModelWindow]
    pools: list[PoolWindow]

    def model(self, name: str) -> ModelWindow:
        return next(m for m in self.models if m.model == name)


@dataclass
class _Mark:
    counts: dict[str, int]
    latencies: int
    batch_sizes: Counter[int]


class Windows:
    """Remembers where the last window ended, per model and per pool."""

    def __init__(self) -> None:
        self._models: dict[str, _Mark] = {}
        self._busy: dict[int, float] = {}

    def model_rows(self, stats: dict[str, ModelStats]) -> list[ModelWindow]:
        """Per model since the last call: counts, latency p50/p99 (ms), mean batch."""
        rows = []
        for name, s in stats.items():
            last = self._models.get(name) or _Mark(dict.fromkeys(COUNTS, 0), 0, Counter())
            lat = np.asarray(s.latency_us[last.latencies :]) / 1e3
            batches = s.batch_sizes - last.batch_sizes
            n_batches = sum(batches.values())
            counts = s.counts()
            rows.append(
                ModelWindow(
                    model=name,
                    **{k: counts[k] - last.counts[k] for k in COUNTS},
                    p50_ms=float(np.percentile(lat, 50)) if lat.size else None,
                    p99_ms=float(np.percentile(lat, 99)) if lat.size else None,
                    mean_batch=(
                        sum(b * n for b, n in batches.items()) / n_batches if n_batches else None
                    ),
                )
            )
            self._models[name] = _Mark(counts, len(s.latency_us), Counter(s.batch_sizes))
        return rows

    def pool_rows(self, topo: Topology, busy_us: list[float]) -> list[PoolWindow]:
        """Per pool of the serving plan since the last call: busy time (ms)."""
        rows = []
        for p in topo.pools:
            busy = busy_us[p.id] - self._busy.get(p.id, 0.0)
            self._busy[p.id] = busy_us[p.id]
            rows.append(
                PoolWindow(
                    model=topo.models[p.model].name,
                    pool=p.id,
                    gpu_type=p.gpu,
                    block_start=p.start,
                    block_end=p.end,
                    vgpus=len(p.vgpus),
                    busy_ms=busy / 1e3,
                )
            )
        return rows

    def restart_pools(self) -> None:
        """A new plan's pools: busy time counts from zero."""
        self._busy = {}
