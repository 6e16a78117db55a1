"""The overdue watch: a request whose batch is still running when its SLO runs out is
answered then, dropped, instead of late (RuntimeConfig.drop_overdue). One timer for all
running batches: a heap of (earliest SLO end among the batch's waiting requests, batch)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, cast

from poolpipe.runtime.heap import EventHeap
from poolpipe.runtime.ports import Clock, Job, Timer

# A batch is looked at this long after its earliest SLO end: later than the SLO, never by
# a few µs of round-off.
OVERDUE_AFTER_US: Final = 1.0


class OverdueWatch:
    """Running jobs by their earliest SLO end. When that time has passed for a job still
    running, `overdue(job, now)` answers what has run out and returns the job's next SLO
    end (inf: nothing left to watch). A job that ends is let go at once (`ended`): its
    entry stays until its turn, holding nothing (a job held until its SLO end kept its
    requests and hops in memory that long, and freed them cold)."""

    __slots__ = ("_at", "_clock", "_heap", "_overdue", "_seq", "_timer")

    def __init__(self, clock: Clock, overdue: Callable[[Job, float], float]):
        self._clock = clock
        self._overdue = overdue
        self._heap = EventHeap()  # running jobs by earliest SLO end, then when added
        self._seq = 0
        self._timer: Timer | None = None
        self._at = math.inf  # the due time the timer is set for

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, job: Job, due_us: float) -> None:
        self._seq += 1
        job.watch_slot = self._heap.push(due_us, self._seq, job)
        if due_us < self._at:
            self._arm(due_us)

    def ended(self, job: Job) -> None:
        """`job` ended: nothing of it is watched any more."""
        if job.watch_slot >= 0:
            self._heap.release(job.watch_slot)
            job.watch_slot = -1

    def _arm(self, due_us: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = due_us
        self._timer = self._clock.call_at(due_us + OVERDUE_AFTER_US, self._fire)

    def _fire(self) -> None:
        self._timer, self._at = None, math.inf
        now = self._clock.now()
        heap = self._heap
        while len(heap):
            item = heap.first_item()
            if item is not None and heap.first_t() >= now:
                break
            heap.pop()
            if item is None:
                continue  # ended
            job = cast(Job, item)
            job.watch_slot = -1
            nxt = self._overdue(job, now)
            if nxt < math.inf:
                self._seq += 1
                if job.ended:  # (ended by its answers: watched no more, as `ended` does)
                    heap.push(nxt, self._seq, None)
                else:
                    job.watch_slot = heap.push(nxt, self._seq, job)
        if len(heap):
            self._arm(heap.first_t())
