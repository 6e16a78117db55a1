"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from mypy_extensions import mypyc_attr

# Ended intervals are dropped from the lists once this many have gathered at their front.
_DROP_AFTER: Final = 16


@mypyc_attr(acyclic=True)
class Busy:
    """One reservation [start, end) of a table, `key` naming it for feedback correction (a
    native class: compiled, its floats are read straight from the object, where a list of
    floats boxes each one)."""

    __slots__ = ("end", "key", "start")

    def __init__(self, start: float, end: float, key: int) -> None:
        self.start = start
        self.end = end
        self.key = key


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by (start, end, key).

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.

    A list of `Busy` objects from `head` on: `forget_before` moves `head` past the intervals
    that ended and drops them from the list in batches (a vGPU's table is a queue: one at a
    time, they would cost a list shift and often a reallocation each). A hot loop may hold
    on to the list and read it from `head` (it must not modify it).
    """

    __slots__ = ("busy", "head", "memo_at", "memo_dur", "memo_t", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.busy: list[Busy] = []
        self.head = 0
        # earliest_slot's last answer (memo_t, memo_dur) -> memo_at, while the table is
        # unchanged: any t in [memo_t, memo_at] gets memo_at for that duration (a free slot
        # earlier than memo_at and at least t would be at least memo_t too)
        self.memo_t = 0.0
        self.memo_at = -1.0
        self.memo_dur = -1.0

    def __len__(self) -> int:
        return len(self.busy) - self.head

    def intervals(self) -> list[tuple[float, float]]:
        return [(b.start, b.end) for b in self.busy[self.head :]]

    def forget_before(self, now: float) -> None:
        """Drop the intervals at the front that ended by `now`: they cannot matter to any
        later query. (One that ended behind a longer one goes once it reaches the front;
        queries skip it meanwhile, as they skip any interval over before their time.)"""
        busy = self.busy
        n = len(busy)
        h = self.head
        while h < n and busy[h].end <= now:
            h += 1
        if h != self.head:
            self.memo_at = -1.0  # (a query of the past would now find the dropped free)
        if h >= _DROP_AFTER:
            del busy[:h]
            h = 0
        self.head = h

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration`."""
        if duration == self.memo_dur and self.memo_t <= t <= self.memo_at:
            return self.memo_at
        cand = t
        busy = self.busy
        for i in range(self.head, len(busy)):
            b = busy[i]
            e = b.end
            if e <= cand:
                continue
            if b.start >= cand + duration:
                break
            cand = e
        self.memo_t, self.memo_dur, self.memo_at = t, duration, cand
        return cand

    def reserve(self, start: float, end: float, key: int) -> None:
        """Insert in (start, end, key) order, after any equal one."""
        self.memo_at = -1.0
        busy = self.busy
        h = self.head
        i = len(busy)
        while i > h:  # from the end: new reservations mostly start after the others
            b = busy[i - 1]
            s = b.start
            if s < start:
                break
            if s == start:
                e = b.end
                if e < end or (e == end and b.key <= key):
                    break
            i -= 1
        busy.insert(i, Busy(start, end, key))

    def correct(self, key: int, start: float, end: float, now: float) -> bool:
        """Replace reservation `key` by what really happened (or is happening).

        Returns False if the key is unknown (already forgotten); the actual interval is still
        recorded when it reaches past `now`.
        """
        self.memo_at = -1.0
        busy = self.busy
        found = False
        for i in range(self.head, len(busy)):
            if busy[i].key == key:
                del busy[i]
                found = True
                break
        if end > now:
            self.reserve(start, end, key)
        return found


def earliest_common_slot(tables: Sequence[ReservationTable], t: float, duration: float) -> float:
    """Earliest start >= t at which every table is free for `duration` at the same time."""
    cand = t
    n = len(tables)
    agreed = 0  # how many tables in a row found `cand` free
    i = 0
    while agreed < n:
        s = tables[i].earliest_slot(cand, duration)
        if s > cand:
            cand = s
            agreed = 1
        else:
            agreed += 1
        i = i + 1 if i + 1 < n else 0
    return cand
