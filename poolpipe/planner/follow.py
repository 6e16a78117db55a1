"""Capacity that follows the load: when to plan again, for what rates, and whether to roll
the new plan out.

`LoadFollower` is driven by its caller (a simulated day, scripts/bench_load_following.py; a
router's load watch) with each model's cumulative arrivals about every few seconds. It keeps
the rates (runtime.envelope.ArrivalRates) and the served plan's envelope and asks for a plan
(`Want`) when

- the load leaves the envelope: `above` (a model over `high` of its deliverable rate),
  `mix` (the mix moved), `below` (every model under `low` of it for `hold_s`); or
- `check_s` has passed since the served plan was chosen (a load that drifts inside the
  envelope: fewer GPUs may serve it now);

but never sooner than `min_interval_s` after the last plan rolled out (no flapping): a want
that comes sooner waits for it. The rates asked for are each model's larger of its short-
and long-window rates, times 1 + `headroom` (the caller plans the cheapest GPUs for them:
planner/advise.py). `judge` rolls the new plan out where it is needed (the event was `above`
or `mix`, or the served plan delivers less than the rates asked for) or saves at least
`shrink` of the served plan's cost; otherwise the served plan stays and the envelope goes
on.

Pure: times are the caller's (s), nothing is planned or served here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.envelope import ABOVE, MIX, ArrivalRates, Envelope, EnvelopeConfig

CHECK = "check"  # the periodic look for a cheaper plan


@dataclass(frozen=True)
class FollowConfig:
    headroom: float = 0.2  # plan for the observed rates x (1 + this)
    min_interval_s: float = 1800.0  # at most one rollout per this long
    check_s: float = 1800.0  # look for a cheaper plan this often
    shrink: float = 0.1  # roll a cheaper plan out only where it saves this share of the cost
    # the envelope of a plan sized for its rates: above at 0.9 of what it delivers; below
    # where every model is under 0.6 of it for 10 minutes
    envelope: EnvelopeConfig = field(
        default_factory=lambda: EnvelopeConfig(high=0.9, low=0.6, hold_s=600.0)
    )

    def __post_init__(self) -> None:
        if not (self.headroom >= 0 and math.isfinite(self.headroom)):
            raise PoolpipeError(f"headroom must be >= 0, got {self.headroom}")
        if self.min_interval_s < 0 or not self.check_s > 0:
            raise PoolpipeError(
                f"need min_interval_s >= 0 and check_s > 0, got {self.min_interval_s}, "
                f"{self.check_s}"
            )
        if not 0 <= self.shrink < 1:
            raise PoolpipeError(f"shrink must be in [0, 1), got {self.shrink}")


@dataclass(frozen=True)
class Want:
    """A plan asked for: why (an envelope event's kind, or CHECK), what was seen, and the
    rates (req/s per model) to plan for."""

    kind: str
    why: str
    at_s: float
    rates: dict[str, float]


class LoadFollower:
    """Module docstring. `served(names, deliverable, weights, cost, gpus, now_s)` after each
    rollout (and once at the start); `observe(now_s, arrivals)` at each sample; `judge` on the
    plan planned for a Want."""

    def __init__(self, names: Sequence[str], config: FollowConfig | None = None):
        self.names = tuple(names)
        self.config = config or FollowConfig()
        self.rates = ArrivalRates(len(self.names))
        self._envelope: Envelope | None = None
        self._chosen_s = -math.inf  # when the served plan was chosen (rolled out or kept)
        self._rolled_s = -math.inf  # when a plan was last rolled out
        self._pending: tuple[str, str] | None = None  # a want waiting for the interval
        self.cost = math.inf
        self.gpus: dict[str, int] = {}

    def served(
        self,
        deliverable: Sequence[float],
        weights: Sequence[float],
        cost: float,
        gpus: Mapping[str, int],
        now_s: float,
        rolled_out: bool = True,
    ) -> None:
        """The plan served from `now_s` (rolled out, or kept after a judge): its envelope
        starts anew."""
        self._envelope = Envelope(self.names, deliverable, weights, self.config.envelope)
        self.cost, self.gpus = float(cost), dict(gpus)
        self._chosen_s = now_s
        if rolled_out:
            self._rolled_s = now_s
        self._pending = None

    def observe(self, now_s: float, arrivals: Sequence[int]) -> Want | None:
        """The cumulative arrivals per model as of `now_s`: a Want where a plan is due."""
        self.rates.sample(now_s * 1e6, arrivals)
        if self._envelope is None:
            raise PoolpipeError("LoadFollower.served must be called before observe")
        for e in self._envelope.check(now_s * 1e6, self.rates):
            if self._pending is None or e.kind in (ABOVE, MIX):
                self._pending = (e.kind, e.why)
        if self._pending is None and now_s - self._chosen_s >= self.config.check_s:
            self._pending = (CHECK, f"{self.config.check_s:g} s since the plan was chosen")
        if self._pending is None or now_s - self._rolled_s < self.config.min_interval_s:
            return None
        kind, why = self._pending
        c = self.config.envelope
        short, long = self.rates.rates(c.short_s), self.rates.rates(c.long_s)
        rates = {
            n: max(a, b) * (1 + self.config.headroom)
            for n, a, b in zip(self.names, short, long, strict=True)
        }
        return Want(kind, why, now_s, rates)

    def judge(self, want: Want, cost: float, gpus: Mapping[str, int]) -> tuple[bool, str]:
        """Roll out the plan planned for `want` (its cost and GPUs per type)? And why."""
        assert self._envelope is not None, "served() first"
        delivers = dict(zip(self.names, self._envelope.deliverable, strict=True))
        short = short_of(delivers, want.rates)
        return judge(
            want.kind, want.why, cost, gpus, self.cost, self.gpus, self.config.shrink, short
        )

    def kept(self, now_s: float) -> None:
        """The served plan stays after a judge said no: the next check in check_s."""
        self._chosen_s = now_s
        self._pending = None


def short_of(delivers: Mapping[str, float | None], asked: Mapping[str, float]) -> list[str] | None:
    """The models whose rate asked for is above what the served plan delivers (`delivers`,
    per model): judge's `short`; None where the plan states nothing for some model."""
    if any(delivers.get(n) is None for n in asked):
        return None
    return [n for n, rate in asked.items() if rate > float(delivers[n] or 0.0)]


def judge(
    kind: str,
    why: str,
    cost: float,
    gpus: Mapping[str, int],
    served_cost: float,
    served_gpus: Mapping[str, int],
    shrink: float,
    short: Sequence[str] | None = None,
) -> tuple[bool, str]:
    """Roll out a plan planned for the load (its `cost` per hour and `gpus` per type) in place
    of the served one, asked for because of `kind` (an envelope event's, or CHECK)? And why:
    on a rise or a mix shift always; where the served plan delivers less than the rates
    asked for some models (`short`); where the new one saves at least `shrink` of the cost.
    `short` None (the served plan states nothing it delivers): where the served plan lacks
    GPUs of a type the new one uses. A plan that only moves work between GPU types, the
    served one delivering what is asked, stays (no flip-flop between types)."""
    if kind in (ABOVE, MIX):
        return True, f"{kind}: {why}"
    if short is None:
        lacking = [g for g, n in gpus.items() if n > served_gpus.get(g, 0)]
        if lacking:
            return True, f"{kind}: the load needs more {', '.join(sorted(lacking))}"
    elif short:
        return True, f"{kind}: the plan served delivers less than asked for {', '.join(short)}"
    if cost <= (1 - shrink) * served_cost:
        return True, f"{kind}: {cost:g} per hour against {served_cost:g}"
    return False, (
        f"{kind}: the plan for the load costs {cost:g} per hour against {served_cost:g} "
        f"served (less than {shrink:.0%} saved)"
    )
