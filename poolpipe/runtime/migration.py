"""Pipeline-flush migration, the runtime's way from one plan to the next: intake pauses (new
requests are held, none dropped), every queued request is sent out at once, the batches in
flight finish (at most a flush timeout; what is left then fails explicitly), the runtime
switches to the new plan, and the held requests are taken in arrival order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.ports import ServedPlan, Timer
from poolpipe.scheduler.topology import Topology

SWITCHED_AWAY = "the plan was switched before this request could finish"


def default_flush_timeout_us(old: Topology, new: Topology) -> float:
    """How long a flush may wait for the old plan's requests: two of the longest SLO of
    either plan, and a second for the switch itself."""
    return 2 * max(m.slo_us for m in (*old.models, *new.models)) + 1e6


@dataclass(frozen=True)
class SwitchResult:
    downtime_us: float  # intake paused
    held: int  # requests that arrived meanwhile (served after the switch)
    failed: int  # requests the flush could not finish in time (answered with an error)


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request that arrived while intake was paused, taken once the switch is done."""

    model: str  # by name: its index may differ in the new plan
    slo_us: float | None  # its own SLO, or None for the model's
    payload: Any
    arrived_us: float


@dataclass
class Switch:
    """A switch under way: to which plan, since when, and who hears how it went."""

    served: ServedPlan
    t0: float
    on_done: Callable[[SwitchResult], None]
    timer: Timer | None = None  # completes the switch when the flush takes too long
    done: bool = False


class FlushMigration:
    """The state of a migration: whether intake is paused, the requests held meanwhile, and
    the switch under way (one at a time)."""

    __slots__ = ("held", "paused", "switch")

    def __init__(self) -> None:
        self.paused = False
        self.held: list[HeldRequest] = []
        self.switch: Switch | None = None

    @property
    def finishing(self) -> bool:
        """A switch is under way and has not completed yet."""
        return self.switch is not None and not self.switch.done

    def begin(
        self, served: ServedPlan, now: float, on_done: Callable[[SwitchResult], None]
    ) -> Switch:
        """Pause intake for a switch to `served`."""
        if self.switch is not None:
            raise PoolpipeError("a plan switch is already under way; wait for it to finish")
        self.paused = True
        self.switch = Switch(served, now, on_done)
        return self.switch

    def hold(self, request: HeldRequest) -> None:
        self.held.append(request)

    def finish(self) -> Switch | None:
        """The switch to complete now (its timeout cancelled); None when none is left to
        complete (it completed already, or none began)."""
        sw = self.switch
        if sw is None or sw.done:
            return None
        sw.done = True
        if sw.timer is not None:
            sw.timer.cancel()
        return sw

    def resume(self) -> list[HeldRequest]:
        """Intake resumes: the requests held meanwhile, in arrival order."""
        held, self.held = self.held, []
        self.paused = False
        self.switch = None
        return held
