"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

# Ended intervals are dropped from the lists once this many have gathered at their front.
_DROP_AFTER: Final = 16


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by (start, end, key).

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.

    Three parallel lists rather than a list of (start, end, key) tuples: compiled
    (native.py), a float read from a list is one unboxing, from a tuple in a list a tuple
    too, and inserting in order compares floats instead of tuples. The table is the lists
    from `head` on: `forget_before` moves `head` past the intervals that ended and drops
    them from the lists in batches (a vGPU's table is a queue: one at a time, they would
    cost a list shift and often a reallocation each). A hot loop may hold on to the lists
    and read them from `head` (it must not modify them).
    """

    __slots__ = ("ends", "head", "keys", "name", "starts")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.keys: list[int] = []  # identifies the reservation for feedback correction
        self.head = 0

    def __len__(self) -> int:
        return len(self.starts) - self.head

    def intervals(self) -> list[tuple[float, float]]:
        h = self.head
        return list(zip(self.starts[h:], self.ends[h:], strict=True))

    def forget_before(self, now: float) -> None:
        """Drop the intervals at the front that ended by `now`: they cannot matter to any
        later query. (One that ended behind a longer one goes once it reaches the front;
        queries skip it meanwhile, as they skip any interval over before their time.)"""
        ends = self.ends
        n = len(ends)
        h = self.head
        while h < n and ends[h] <= now:
            h += 1
        if h >= _DROP_AFTER:
            del self.starts[:h]
            del ends[:h]
            del self.keys[:h]
            h = 0
        self.head = h

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration`."""
        cand = t
        starts, ends = self.starts, self.ends
        for i in range(self.head, len(starts)):
            e = ends[i]
            if e <= cand:
                continue
            if starts[i] >= cand + duration:
                break
            cand = e
        return cand

    def reserve(self, start: float, end: float, key: int) -> None:
        """Insert in (start, end, key) order, after any equal one."""
        starts, ends, keys = self.starts, self.ends, self.keys
        h = self.head
        i = len(starts)
        while i > h:  # from the end: new reservations mostly start after the others
            s = starts[i - 1]
            if s < start:
                break
            if s == start:
                e = ends[i - 1]
                if e < end or (e == end and keys[i - 1] <= key):
                    break
            i -= 1
        starts.insert(i, start)
        ends.insert(i, end)
        keys.insert(i, key)

    def correct(self, key: int, start: float, end: float, now: float) -> bool:
        """Replace reservation `key` by what really happened (or is happening).

        Returns False if the key is unknown (already forgotten); the actual interval is still
        recorded when it reaches past `now`.
        """
        keys = self.keys
        found = False
        for i in range(self.head, len(keys)):
            if keys[i] == key:
                del keys[i]
                del self.starts[i]
                del self.ends[i]
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
