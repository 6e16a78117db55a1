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
    batch_sizes: dict[int, int] = field(default_factory=dict)  # requests per batch sent

    def clear(self) -> None:
        """From zero, in place (entries in flight keep counting here)."""
        self.arrivals = self.on_time = self.late = self.dropped = self.failed = 0
        self.refused = 0
        self.retried = 0
        self.latency_us.clear()
        self.batch_sizes.clear()

    def counts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COUNTS}


@dataclass
class EpochStats(ModelStats):
    """A model's counters for the requests of one window (Windows.epoch); the runtime counts
    each event here and in `total`, the model's cumulative counters."""

    total: ModelStats = field(default_factory=ModelStats, repr=False, compare=False)


def _settled(s: ModelStats) -> bool:
    return s.on_time + s.late + s.dropped + s.failed + s.refused >= s.arrivals


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


# A window whose requests are not all answered after this many looks is given out as it is.
MAX_PENDING_LOOKS = 10


class Windows:
    """Windows by arrival: each look closes the requests taken since the last one into an
    epoch (every model's counters for them: EpochStats, whose `total` is the model's
    cumulative counters, which the runtime counts into as well), and gives out the epochs
    whose requests are all answered — so that a row's outcomes are those of its own
    arrivals, never more. A request still in flight when its window closes is given out,
    with its window, at a later look (one of at most MAX_PENDING_LOOKS). Pool busy time
    is per look."""

    def __init__(self, totals: dict[str, ModelStats]) -> None:
        self._totals = totals
        self.current: dict[str, EpochStats] = {}
        self._pending: list[tuple[int, dict[str, EpochStats]]] = []  # (looks, epoch)
        self._busy: dict[int, float] = {}

    def epoch(self, name: str) -> EpochStats:
        """Model `name`'s counters for the requests taken now."""
        s = self.current.get(name)
        if s is None:
            total = self._totals.setdefault(name, ModelStats())
            s = self.current[name] = EpochStats(total=total)
        return s

    @property
    def pending(self) -> int:
        """Closed windows not given out yet (requests of theirs still in flight)."""
        return len(self._pending)

    def model_rows(self) -> list[ModelWindow]:
        """Close the window and give out, per model, the epochs now answered: counts,
        latency p50/p99 (ms), mean batch."""
        closed, self.current = self.current, {}
        out: list[dict[str, EpochStats]] = []
        keep = []
        for looks, ep in [*self._pending, (0, closed)]:
            if looks + 1 >= MAX_PENDING_LOOKS or all(_settled(s) for s in ep.values()):
                out.append(ep)
            else:
                keep.append((looks + 1, ep))
        self._pending = keep
        rows = []
        for name in self._totals:
            parts = [ep[name] for ep in out if name in ep]
            lat = np.asarray([x for p in parts for x in p.latency_us]) / 1e3
            batches: Counter[int] = Counter()
            for p in parts:
                batches.update(p.batch_sizes)
            n_batches = sum(batches.values())
            rows.append(
                ModelWindow(
                    model=name,
                    **{k: sum(getattr(p, k) for p in parts) for k in COUNTS},
                    p50_ms=float(np.percentile(lat, 50)) if lat.size else None,
                    p99_ms=float(np.percentile(lat, 99)) if lat.size else None,
                    mean_batch=(
                        sum(b * n for b, n in batches.items()) / n_batches if n_batches else None
                    ),
                )
            )
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
