"""The load a served plan carries, observed against its envelope.

`ArrivalRates` keeps each model's arrival rate over sliding windows (RATE_WINDOWS_S) from
samples of its cumulative arrival count, taken about once a second by whoever drives it (the
router; a simulation). `Envelope` holds the served plan's deliverable rates (Plan.models'
`deliverable`: what each model serves with >= 99% of requests on time, at the plan's mix)
and says when the load leaves them (`check`):

- `above`: a model's rate over the short window above `high` of its deliverable rate (once
  that window has been sampled);
- `below`: every model's rate over the long window below `low` of its deliverable rate,
  without a break for `hold_s` (a lull of a few minutes is not a reason to re-plan);
- `mix`: the observed mix (each model's share of the arrivals over the long window) away
  from the plan's weights by more than `mix_shift` (total variation distance: half the sum
  of the shares' differences), once the long window holds `mix_min_requests` arrivals.

Each kind fires once when the load leaves the envelope that way and again only after it has
come back well inside (`above`: every model at or below REARM of `high`; `mix`: within REARM
of `mix_shift`; `below`: any model at or above `low`, and then `hold_s` below again), so that
a load on a threshold does not fire at every sample. Nothing here reads a clock: times are
the caller's (µs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from poolpipe.errors import PoolpipeError

RATE_WINDOWS_S = (10.0, 60.0, 300.0)
ABOVE, BELOW, MIX = "above", "below", "mix"
REARM = 0.9


class ArrivalRates:
    """Per model, its arrival rate (req/s) over each of `windows_s`, from samples of its
    cumulative arrival count. A window longer than the time sampled so far is measured over
    what there is (from the first sample)."""

    def __init__(self, models: int, windows_s: Sequence[float] = RATE_WINDOWS_S):
        if not windows_s or any(not w > 0 for w in windows_s):
            raise PoolpipeError(f"rate windows must be > 0 s, got {list(windows_s)}")
        self.models = models
        self.windows_s = tuple(sorted(windows_s))
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def sample(self, now_us: float, arrivals: Sequence[int]) -> None:
        """The cumulative arrivals of every model as of `now_us` (a count that went down, a
        new plan's counters, starts the windows anew)."""
        if len(arrivals) != self.models:
            raise PoolpipeError(f"{len(arrivals)} arrival counts for {self.models} models")
        counts = tuple(int(a) for a in arrivals)
        if self._samples:
            t0, last = self._samples[-1]
            if now_us < t0 or any(c < p for c, p in zip(counts, last, strict=True)):
                self._samples.clear()
        self._samples.append((now_us, counts))
        oldest = now_us - self.windows_s[-1] * 1e6
        # keep one sample at or before the longest window's start
        while len(self._samples) > 2 and self._samples[1][0] <= oldest:
            self._samples.popleft()

    def sampled_s(self) -> float:
        """Seconds between the first sample kept and the last."""
        if len(self._samples) < 2:
            return 0.0
        return (self._samples[-1][0] - self._samples[0][0]) / 1e6

    def rates(self, window_s: float) -> tuple[float, ...]:
        """Each model's arrivals per second over the last `window_s` (over what was
        sampled, where that is shorter; zeros before two samples)."""
        if len(self._samples) < 2:
            return (0.0,) * self.models
        now, last = self._samples[-1]
        start = now - window_s * 1e6
        t0, first = self._samples[0]
        for t, counts in self._samples:  # the latest sample at or before the window's start
            if t > start:
                break
            t0, first = t, counts
        span = (now - t0) / 1e6
        if span <= 0:
            return (0.0,) * self.models
        return tuple((c - f) / span for c, f in zip(last, first, strict=True))

    def arrived(self, window_s: float) -> int:
        """Arrivals of all models over the last `window_s` (as `rates` measures it)."""
        if len(self._samples) < 2:
            return 0
        span = min(window_s, self.sampled_s())
        return round(sum(self.rates(window_s)) * span)


@dataclass(frozen=True)
class EnvelopeConfig:
    high: float = 0.9  # a model above this share of its deliverable rate (short window)
    low: float = 0.4  # every model below this share (long window) ...
    hold_s: float = 600.0  # ... for this long
    mix_shift: float = 0.2  # total variation distance between observed and planned mix
    mix_min_requests: int = 200  # arrivals in the long window before the mix is judged
    short_s: float = RATE_WINDOWS_S[1]
    long_s: float = RATE_WINDOWS_S[2]

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise PoolpipeError(
                f"envelope shares must satisfy 0 < low < high, got low {self.low}, high {self.high}"
            )
        if not 0 < self.mix_shift <= 1:
            raise PoolpipeError(f"mix_shift must be in (0, 1], got {self.mix_shift}")
        if self.hold_s < 0 or not 0 < self.short_s <= self.long_s:
            raise PoolpipeError(
                f"need hold_s >= 0 and 0 < short_s <= long_s, got {self.hold_s}, "
                f"{self.short_s}, {self.long_s}"
            )


@dataclass(frozen=True)
class EnvelopeEvent:
    kind: str  # ABOVE | BELOW | MIX
    models: tuple[str, ...]
    at_us: float
    rates: tuple[float, ...]  # req/s per model, over the window the kind is judged on
    deliverable: tuple[float, ...]
    mix: tuple[float, ...]  # observed shares (long window)
    planned_mix: tuple[float, ...]
    why: str


class Envelope:
    """A served plan's envelope (module docstring): `check` after each ArrivalRates sample."""

    def __init__(
        self,
        names: Sequence[str],
        deliverable: Sequence[float],
        weights: Sequence[float],
        config: EnvelopeConfig | None = None,
    ):
        if not len(names) == len(deliverable) == len(weights) or not names:
            raise PoolpipeError(
                f"an envelope needs a deliverable rate and a weight per model, got "
                f"{len(names)} models, {len(deliverable)} rates, {len(weights)} weights"
            )
        if any(not (d > 0 and math.isfinite(d)) for d in deliverable):
            raise PoolpipeError(
                f"deliverable rates must be > 0 req/s, got {list(deliverable)} for "
                f"{list(names)} (a plan without deliverable figures: plan it with --delivery)"
            )
        total = float(sum(weights))
        if not total > 0 or any(w < 0 for w in weights):
            raise PoolpipeError(f"weights must be >= 0 and not all 0, got {list(weights)}")
        self.names = tuple(names)
        self.deliverable = tuple(float(d) for d in deliverable)
        self.planned_mix = tuple(w / total for w in weights)
        self.config = config or EnvelopeConfig()
        self._out = {ABOVE: False, BELOW: False, MIX: False}
        self._below_since: float | None = None

    def shares(self, rates: Sequence[float]) -> tuple[float, ...]:
        """Each model's rate as a share of its deliverable rate."""
        return tuple(r / d for r, d in zip(rates, self.deliverable, strict=True))

    def check(self, now_us: float, arrivals: ArrivalRates) -> list[EnvelopeEvent]:
        """The events the load's latest sample gives (module docstring)."""
        c = self.config
        short = arrivals.rates(c.short_s)
        long = arrivals.rates(c.long_s)
        total = sum(long)
        mix = tuple(r / total for r in long) if total > 0 else self.planned_mix
        out: list[EnvelopeEvent] = []

        def fire(kind: str, rates: tuple[float, ...], why: str) -> None:
            if not self._out[kind]:
                out.append(
                    EnvelopeEvent(
                        kind,
                        self.names,
                        now_us,
                        rates,
                        self.deliverable,
                        mix,
                        self.planned_mix,
                        why,
                    )
                )
            self._out[kind] = True

        shares = self.shares(short)
        over = [i for i, s in enumerate(shares) if s > c.high]
        if over and arrivals.sampled_s() >= c.short_s:  # (a second's count is all noise)
            fire(
                ABOVE,
                short,
                ", ".join(
                    f"{self.names[i]} {short[i]:.1f} req/s over the last {c.short_s:g} s, "
                    f"above {c.high:g} of its deliverable {self.deliverable[i]:.1f}"
                    for i in over
                ),
            )
        elif all(s <= REARM * c.high for s in shares):
            self._out[ABOVE] = False
        full = arrivals.sampled_s() >= c.long_s
        if full and all(s < c.low for s in self.shares(long)):
            if self._below_since is None:
                self._below_since = now_us
            if now_us - self._below_since >= c.hold_s * 1e6:
                fire(
                    BELOW,
                    long,
                    f"every model below {c.low:g} of its deliverable rate for "
                    f"{(now_us - self._below_since) / 1e6:.0f} s (over {c.long_s:g}-s "
                    "windows): "
                    + ", ".join(
                        f"{n} {r:.1f} of {d:.1f} req/s"
                        for n, r, d in zip(self.names, long, self.deliverable, strict=True)
                    ),
                )
        else:
            self._below_since = None
            self._out[BELOW] = False
        distance = 0.5 * sum(abs(a - b) for a, b in zip(mix, self.planned_mix, strict=True))
        if arrivals.arrived(c.long_s) >= c.mix_min_requests and distance > c.mix_shift:
            fire(
                MIX,
                long,
                f"the mix {_shares(self.names, mix)} is {distance:.2f} away from the plan's "
                f"{_shares(self.names, self.planned_mix)} (more than {c.mix_shift:g})",
            )
        elif distance <= REARM * c.mix_shift:
            self._out[MIX] = False
        return out


def _shares(names: Sequence[str], mix: Sequence[float]) -> str:
    return "/".join(f"{m:.2f}" for m in mix) + f" ({'/'.join(names)})"
