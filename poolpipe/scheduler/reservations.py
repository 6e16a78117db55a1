"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from librt.vecs import append, vec
from mypy_extensions import i64

# Ended intervals are dropped from the vectors once this many have gathered at their front.
_DROP_AFTER: Final = 16


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by (start, end, key).

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.

    Interval i (from `head` on) is `iv[2i]`, `iv[2i + 1]` (its start and end) with its key
    at `keys[i]`: unboxed vectors (librt.vecs, compiled: the floats lie in one buffer,
    where a list of interval objects put each in an object of its own, a cache miss apiece
    once a thousand GPUs' tables outgrow the cache). `forget_before` moves `head` past the
    intervals that ended and drops them in batches (a vGPU's table is a queue: one at a
    time, each would cost a shift). A hot loop may read `iv` from `2 * head` on (it must
    not modify it).
    """

    __slots__ = ("head", "iv", "keys", "memo_at", "memo_dur", "memo_t", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.iv: vec[float] = vec[float]()
        self.keys: vec[i64] = vec[i64]()
        self.head: i64 = 0
        # earliest_slot's last answer (memo_t, memo_dur) -> memo_at, while the table is
        # unchanged: any t in [memo_t, memo_at] gets memo_at for that duration (a free slot
        # earlier than memo_at and at least t would be at least memo_t too)
        self.memo_t = 0.0
        self.memo_at = -1.0
        self.memo_dur = -1.0

    def __len__(self) -> int:
        return len(self.keys) - self.head

    def intervals(self) -> list[tuple[float, float]]:
        iv = self.iv
        return [(iv[2 * i], iv[2 * i + 1]) for i in range(self.head, len(self.keys))]

    def forget_before(self, now: float) -> None:
        """Drop the intervals at the front that ended by `now`: they cannot matter to any
        later query. (One that ended behind a longer one goes once it reaches the front;
        queries skip it meanwhile, as they skip any interval over before their time.)"""
        iv = self.iv
        n: i64 = len(self.keys)
        h: i64 = self.head
        while h < n and iv[2 * h + 1] <= now:
            h += 1
        if h != self.head:
            self.memo_at = -1.0  # (a query of the past would now find the dropped free)
        if h >= _DROP_AFTER:
            self.iv = iv[2 * h :]
            self.keys = self.keys[h:]
            h = 0
        self.head = h

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration`."""
        if duration == self.memo_dur and self.memo_t <= t <= self.memo_at:
            return self.memo_at
        cand = t
        iv = self.iv
        i: i64
        for i in range(2 * self.head, len(iv), 2):
            e = iv[i + 1]
            if e <= cand:
                continue
            if iv[i] >= cand + duration:
                break
            cand = e
        self.memo_t, self.memo_dur, self.memo_at = t, duration, cand
        return cand

    def reserve(self, start: float, end: float, key: i64) -> None:
        """Insert in (start, end, key) order, after any equal one."""
        self.memo_at = -1.0
        iv = self.iv
        keys = self.keys
        h: i64 = self.head
        n: i64 = len(keys)
        i: i64 = n
        while i > h:  # from the end: new reservations mostly start after the others
            s = iv[2 * i - 2]
            if s < start:
                break
            if s == start:
                e = iv[2 * i - 1]
                if e < end or (e == end and keys[i - 1] <= key):
                    break
            i -= 1
        iv = append(append(iv, start), end)
        keys = append(keys, key)
        if i < n:  # (rare: a reservation before the last one) shift the later ones up
            j: i64 = n
            while j > i:
                iv[2 * j] = iv[2 * j - 2]
                iv[2 * j + 1] = iv[2 * j - 1]
                keys[j] = keys[j - 1]
                j -= 1
            iv[2 * i] = start
            iv[2 * i + 1] = end
            keys[i] = key
        self.iv = iv
        self.keys = keys

    def correct(self, key: i64, start: float, end: float, now: float) -> bool:
        """Replace reservation `key` by what really happened (or is happening).

        Returns False if the key is unknown (already forgotten); the actual interval is still
        recorded when it reaches past `now`.
        """
        self.memo_at = -1.0
        iv = self.iv
        keys = self.keys
        n: i64 = len(keys)
        found = False
        i: i64
        j: i64
        for i in range(self.head, n):
            if keys[i] == key:
                for j in range(i, n - 1):  # shift the later ones down over it
                    iv[2 * j] = iv[2 * j + 2]
                    iv[2 * j + 1] = iv[2 * j + 3]
                    keys[j] = keys[j + 1]
                self.iv = iv[: 2 * n - 2]
                self.keys = keys[: n - 1]
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
