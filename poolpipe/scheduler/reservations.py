"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by (start, end, key).

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.

    Three parallel lists rather than a list of (start, end, key) tuples: compiled
    (native.py), a float read from a list is one unboxing, from a tuple in a list a tuple
    too, and inserting in order compares floats instead of tuples. The list objects never
    change, so a hot loop may hold on to them (it must not modify them).
    """

    __slots__ = ("ends", "keys", "name", "starts")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.keys: list[int] = []  # identifies the reservation for feedback correction

    def __len__(self) -> int:
        return len(self.starts)

    def intervals(self) -> list[tuple[float, float]]:
        return list(zip(self.starts, self.ends))

    def forget_before(self, now: float) -> None:
        """Drop intervals that ended by `now`; they cannot matter to any later query."""
        ends = self.ends
        if not ends or ends[0] > now:
            return
        n = len(ends)
        k = 1  # ended intervals are nearly always a prefix: ends rise with starts
        while k < n and ends[k] <= now:
            k += 1
        starts, keys = self.starts, self.keys
        if k == 1:  # the usual case; pop(0) is a native call, a slice deletion is not
            starts.pop(0)
            ends.pop(0)
            keys.pop(0)
        else:
            del starts[:k]
            del ends[:k]
            del keys[:k]
        for e in ends:
            if e <= now:  # one more behind a longer one: keep only those still running
                kept = [i for i in range(len(ends)) if ends[i] > now]
                starts[:] = [starts[i] for i in kept]
                keys[:] = [keys[i] for i in kept]
                ends[:] = [ends[i] for i in kept]
                return

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration`."""
        cand = t
        starts, ends = self.starts, self.ends
        for i in range(len(starts)):
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
        i = len(starts)
        while i > 0:  # from the end: new reservations mostly start after the others
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
        for i in range(len(keys)):
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
