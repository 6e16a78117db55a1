"""The overdue watch: a request whose batch is still running when its SLO runs out is
answered then, dropped, instead of late (RuntimeConfig.drop_overdue). One timer for all
running batches: a heap of (earliest SLO end among the batch's waiting requests, batch)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, cast

from poolpipe.runtime.heap import Keyed, pop, push
from poolpipe.runtime.ports import Clock, Job, Timer

# A batch is looked at this long after its earliest SLO end: later than the SLO, never by
# a few µs of round-off.
OVERDUE_AFTER_US: Final = 1.0


class OverdueWatch:
    """Running jobs by their earliest SLO end. When that time has passed for a job still
    running, `overdue(job, now)` answers what has run out and returns the job's next SLO
    end (inf: nothing left to watch). Jobs that ended meanwhile are skipped."""

    __slots__ = ("_at", "_clock", "_heap", "_overdue", "_seq", "_timer")

    def __init__(self, clock: Clock, overdue: Callable[[Job, float], float]):
        self._clock = clock
        self._overdue = overdue
        self._heap: list[Keyed] = []  # running jobs by earliest SLO end, then when added
        self._seq = 0
        self._timer: Timer | None = None
        self._at = math.inf  # the due time the timer is set for

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, job: Job, due_us: float) -> None:
        self._seq += 1
        push(self._heap, Keyed(due_us, self._seq, job))
        if due_us < self._at:
            self._arm(due_us)

    def _arm(self, due_us: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = due_us
        self._timer = self._clock.call_at(due_us + OVERDUE_AFTER_US, self._fire)

    def _fire(self) -> None:
        self._timer, self._at = None, math.inf
        now = self._clock.now()
        heap = self._heap
        while heap:
            head = heap[0]
            job = cast(Job, head.item)
            if not (job.ended or head.t < now):
                break
            pop(heap)
            if job.ended:
                continue
            nxt = self._overdue(job, now)
            if nxt < math.inf:
                self._seq += 1
                push(heap, Keyed(nxt, self._seq, job))
        if heap:
            self._arm(heap[0].t)
