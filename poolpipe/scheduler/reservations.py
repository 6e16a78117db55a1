"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by start.

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.
    """

    __slots__ = ("iv", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        # (start, end, key): key identifies the reservation for feedback correction. The list
        # object never changes, so a hot loop may hold on to it (it must not modify it).
        self.iv: list[tuple[float, float, int]] = []

    def __len__(self) -> int:
        return len(self.iv)

    def intervals(self) -> list[tuple[float, float]]:
        return [(s, e) for s, e, _ in self.iv]

    def forget_before(self, now: float) -> None:
        """Drop intervals that ended by `now`; they cannot matter to any later query."""
        iv = self.iv
        if iv and iv[0][1] <= now:
            iv[:] = [x for x in iv if x[1] > now]

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration`."""
        cand = t
        for s, e, _ in self.iv:
            if e <= cand:
                continue
            if s >= cand + duration:
                break
            cand = e
        return cand

    def reserve(self, start: float, end: float, key: int) -> None:
        insort(self.iv, (start, end, key))

    def correct(self, key: int, start: float, end: float, now: float) -> bool:
        """Replace reservation `key` by what really happened (or is happening).

        Returns False if the key is unknown (already forgotten); the actual interval is still
        recorded when it reaches past `now`.
        """
        iv = self.iv
        found = False
        for i, x in enumerate(iv):
            if x[2] == key:
                del iv[i]
                found = True
                break
        if end > now:
            insort(iv, (start, end, key))
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
