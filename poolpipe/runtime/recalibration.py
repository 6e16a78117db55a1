"""Live recalibration: start-up calibration times each partition one call at a time, but
under load stage workers that share a host's cores run slower. After every `every` stage
calls of a pool that found their vGPU idle, the median of measured / reserved time, when it
leaves 1 ± `band`, scales that pool's latencies (every batch size) for all later
reservations, within `RECALIBRATE_MAX` either way of the latencies the plan was served with.
"""

from __future__ import annotations

import statistics

from poolpipe.scheduler.topology import Topology, with_latencies

RECALIBRATE_EVERY = 20
RECALIBRATE_BAND = 0.1
# Stages measured far slower (a host's cores taken by an overload) would otherwise leave
# no batch fitting any SLO, and with nothing run, nothing measured to bring them back.
RECALIBRATE_MAX = 2.0


class Recalibrator:
    """One served plan's pool latency scales, learnt from stage calls (`observe`)."""

    __slots__ = ("_recent", "band", "base", "every", "scale", "topo")

    def __init__(
        self, base: Topology, every: int = RECALIBRATE_EVERY, band: float = RECALIBRATE_BAND
    ):
        self.base = base  # as served: scales apply to these latencies
        self.topo = base  # as scaled so far
        self.every = every
        self.band = band
        self.scale = [1.0] * len(base.pools)  # each pool's latencies / its served ones
        self._recent: list[list[float]] = [[] for _ in base.pools]

    def observe(self, pool: int, factor: float) -> Topology | None:
        """A stage call of `pool` that found its vGPU idle took `factor` times its reserved
        time. Returns the topology with the pool's latencies scaled anew when the pool's
        recent median left the band (None otherwise)."""
        recent = self._recent[pool]
        recent.append(factor)
        if len(recent) < self.every:
            return None
        f = statistics.median(recent)
        recent.clear()
        if abs(f - 1.0) <= self.band:
            return None
        scale = min(RECALIBRATE_MAX, max(1.0 / RECALIBRATE_MAX, self.scale[pool] * f))
        if scale == self.scale[pool]:
            return None
        self.scale[pool] = scale
        base = self.base.pools[pool].latency_us
        self.topo = with_latencies(self.topo, {pool: tuple(x * scale for x in base)})
        return self.topo
