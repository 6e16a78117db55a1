"""The data plane's wake guard, learnt from what the runtime sees: how late the clock's
timers fire and how far batches overrun their reservations.

A batch held for more requests waits until its last moment; when the wake-up comes later
than the plane's guard allowed, or stages run longer than reserved, its requests miss.
The guard grows by the p99 of each (recomputed every few samples, capped), so held batches
go out that much earlier. The simulator's timers are never late; a busy live host's are.
"""

from __future__ import annotations

from collections import deque

from poolpipe.runtime.intake import p99

# Samples kept (the last WAKE_WINDOW of each), and how often the p99 is recomputed.
WAKE_WINDOW, WAKE_EVERY = 256, 8
WAKE_LATE_CAP_US = 20_000.0  # the most the timers' lateness adds to the guard
OVERRUN_CAP_US = 20_000.0  # the most the batches' overrun adds


class WakeGuard:
    """What the plane's wake guard holds back beyond its floor (`extra_us`): the p99 of the
    timers' lateness (`late_us`) plus the p99 of the overrun of batches whose stages all
    found their vGPU idle (`overrun_us`). Each `*_seen` call returns True when `extra_us`
    changed, and the plane must then be told (DataPlane.set_wake_lateness)."""

    __slots__ = ("_late", "_late_n", "_over", "_over_n", "late_us", "overrun_us")

    def __init__(self) -> None:
        self._late: deque[float] = deque(maxlen=WAKE_WINDOW)
        self._over: deque[float] = deque(maxlen=WAKE_WINDOW)
        self._late_n = self._over_n = 0  # samples taken (each window recomputed every few)
        self.late_us = 0.0
        self.overrun_us = 0.0

    @property
    def extra_us(self) -> float:
        return self.late_us + self.overrun_us

    def wake_seen(self, late_us: float) -> bool:
        """A wake-up fired `late_us` after it was asked for."""
        self._late.append(max(0.0, late_us))
        self._late_n += 1
        if self._late_n % WAKE_EVERY:
            return False
        late = min(WAKE_LATE_CAP_US, p99(self._late))
        if late == self.late_us:
            return False
        self.late_us = late
        return True

    def overrun_seen(self, over_us: float) -> bool:
        """A batch whose stages all found their vGPU idle ended `over_us` after its
        reserved end (stages slower than reserved, transfers, the executor's own path)."""
        self._over.append(max(0.0, over_us))
        self._over_n += 1
        if self._over_n % WAKE_EVERY:
            return False
        over = min(OVERRUN_CAP_US, p99(self._over))
        if over == self.overrun_us:
            return False
        self.overrun_us = over
        return True
