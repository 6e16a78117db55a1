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


class _Recent:
    """The p99 of the last WAKE_WINDOW samples, recomputed every WAKE_EVERY, at most `cap`."""

    __slots__ = ("cap", "n", "p99_us", "positive", "samples")

    def __init__(self, cap_us: float):
        self.cap = cap_us
        self.samples: deque[float] = deque(maxlen=WAKE_WINDOW)
        self.n = 0  # samples taken (the window is recomputed every few)
        self.positive = 0  # samples above 0 in the window
        self.p99_us = 0.0

    def add(self, us: float) -> bool:
        """Take a sample (below 0 counts as 0); True when the p99 changed."""
        samples = self.samples
        if len(samples) == WAKE_WINDOW and samples[0] > 0.0:
            self.positive -= 1  # (the oldest leaves the window)
        if us > 0.0:
            self.positive += 1
            samples.append(us)
        else:
            samples.append(0.0)
        self.n += 1
        if self.n % WAKE_EVERY:
            return False
        # a window of zeros (the simulator's timers, an idle host's) has a p99 of 0
        new = min(self.cap, p99(samples)) if self.positive else 0.0
        if new == self.p99_us:
            return False
        self.p99_us = new
        return True


class WakeGuard:
    """What the plane's wake guard holds back beyond its floor (`extra_us`): the p99 of the
    timers' lateness (`late_us`) plus the p99 of the overrun of batches whose stages all
    found their vGPU idle (`overrun_us`). Each `*_seen` call returns True when `extra_us`
    changed, and the plane must then be told (DataPlane.set_wake_lateness)."""

    __slots__ = ("_late", "_over")

    def __init__(self) -> None:
        self._late = _Recent(WAKE_LATE_CAP_US)
        self._over = _Recent(OVERRUN_CAP_US)

    @property
    def late_us(self) -> float:
        return self._late.p99_us

    @property
    def overrun_us(self) -> float:
        return self._over.p99_us

    @property
    def extra_us(self) -> float:
        return self._late.p99_us + self._over.p99_us

    def wake_seen(self, late_us: float) -> bool:
        """A wake-up fired `late_us` after it was asked for."""
        return self._late.add(late_us)

    def overrun_seen(self, over_us: float) -> bool:
        """A batch whose stages all found their vGPU idle ended `over_us` after its
        reserved end (stages slower than reserved, transfers, the executor's own path)."""
        return self._over.add(over_us)
