"""Reservation tables: the future busy intervals of one resource (a vGPU, an uplink, a downlink).

Times are plain floats (µs) handed in by the caller; nothing here reads a clock. Tables stay
short (intervals that ended before `now` are forgotten), so linear scans are the fast path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from librt.vecs import append, vec
from mypy_extensions import i64

# Ended intervals are moved out of a table's buffer once this many have gathered at its
# front, or sooner, once they are as many as the live ones (the move then copies no more
# than it drops, and a vGPU's few live intervals stay in the same lines of its buffer).
_DROP_AFTER: Final = 4


class LastEnds:
    """For each table of a set (a scheduler's vGPUs, uplinks or downlinks): no interval
    it holds ends after `v[i]` (the latest end it was given; corrections and forgetting
    leave it, so it only ever errs late). Where `v[i]` is at or before t, the table is
    free from t on, and a scan knows so without reading the table: at a thousand GPUs each
    table is a cold object with a cold buffer, and this vector, one per set, stays in the
    cache (compiled: librt.vecs, unboxed)."""

    __slots__ = ("v",)

    def __init__(self, n: int) -> None:
        self.v: vec[float] = vec[float]([-math.inf] * n)


class ReservationTable:
    """Busy intervals [start, end) of one resource, sorted by (start, end, key).

    Intervals may overlap after feedback correction (a stage that ran late); every query
    treats the table as the union of its intervals, so overlaps only make it conservative.

    Interval i (from `head` on, below `end` // 3) is `iv[3i]`, `iv[3i + 1]` (its start and
    end) and its key `iv[3i + 2]` (a float: keys stay below 2**53, exact), in one unboxed
    vector (librt.vecs, compiled: a table's numbers lie in one buffer, where a list of
    interval objects put each in an object of its own, a cache miss apiece once a thousand
    GPUs' tables outgrow the cache). `forget_before` moves `head` past the intervals that
    ended and, every few, moves the rest to the front of the buffer, in place. The buffer
    is never cut: what lies from `end` on is room, written over by later reservations (a
    slice made an exact copy that the next reservations outgrew and copied again; a
    thousand GPUs' tables, each a buffer moving through memory, were a few cold lines per
    request). A hot loop may read `iv` from `3 * head` to `end` (it must not modify it).
    """

    __slots__ = ("end", "ends", "head", "index", "iv", "memo_at", "memo_dur", "memo_t", "name")

    def __init__(self, name: str = "", ends: LastEnds | None = None, index: int = 0) -> None:
        self.name = name
        self.ends = ends  # (optional) where this table's latest end is kept, at `index`
        self.index: i64 = index
        self.iv: vec[float] = vec[float]()
        self.head: i64 = 0
        self.end: i64 = 0  # the numbers in use: iv[:end] (from 3 * head on, the live ones)
        # earliest_slot's last answer (memo_t, memo_dur) -> memo_at, while the table is
        # unchanged: any t in [memo_t, memo_at] gets memo_at for that duration (a free slot
        # earlier than memo_at and at least t would be at least memo_t too)
        self.memo_t = 0.0
        self.memo_at = -1.0
        self.memo_dur = -1.0

    def __len__(self) -> int:
        return self.end // 3 - self.head

    def intervals(self) -> list[tuple[float, float]]:
        iv = self.iv
        return [(iv[i], iv[i + 1]) for i in range(3 * self.head, self.end, 3)]

    def forget_before(self, now: float) -> None:
        """Drop the intervals at the front that ended by `now`: they cannot matter to any
        later query. (One that ended behind a longer one goes once it reaches the front;
        queries skip it meanwhile, as they skip any interval over before their time.)"""
        iv = self.iv
        n: i64 = self.end
        i: i64 = 3 * self.head
        while i < n and iv[i + 1] <= now:
            i += 3
        h: i64 = i // 3
        if h != self.head:
            self.memo_at = -1.0  # (a query of the past would now find the dropped free)
        if h >= _DROP_AFTER or (h > 0 and i >= n - i):
            j: i64
            for j in range(i, n):  # the rest to the front
                iv[j - i] = iv[j]
            self.end = n - i
            h = 0
        self.head = h

    def earliest_slot(self, t: float, duration: float) -> float:
        """Earliest start >= t at which the resource is free for `duration` (its memo:
        E2 of docs/design/dataplane-exactness.md)."""
        if duration == self.memo_dur and self.memo_t <= t <= self.memo_at:
            return self.memo_at
        cand = self.scan(t, duration)[0]
        self.memo_t, self.memo_dur, self.memo_at = t, duration, cand
        return cand

    def scan(self, t: float, duration: float) -> tuple[float, float]:
        """The slot scan (the one the probe runs too, without earliest_slot's memo): the
        earliest start >= t at which the resource is free for `duration`, and the latest
        start of an interval before that slot in the table's order (-inf: none)."""
        cand = t
        prior = -math.inf
        iv = self.iv
        i: i64
        for i in range(3 * self.head, self.end, 3):
            e = iv[i + 1]
            if e <= cand:
                prior = iv[i]
                continue
            if iv[i] >= cand + duration:
                break
            prior = iv[i]
            cand = e
        return cand, prior

    def reserve(self, start: float, end: float, key: i64) -> None:
        """Insert in (start, end, key) order, after any equal one."""
        self.memo_at = -1.0
        ends = self.ends
        if ends is not None and end > ends.v[self.index]:
            ends.v[self.index] = end
        k = float(key)
        iv = self.iv
        h: i64 = 3 * self.head
        n: i64 = self.end
        i: i64 = n
        while i > h:  # from the end: new reservations mostly start after the others
            s = iv[i - 3]
            if s < start:
                break
            if s == start:
                e = iv[i - 2]
                if e < end or (e == end and iv[i - 1] <= k):
                    break
            i -= 3
        if n + 3 <= len(iv):  # room in the buffer
            iv[n] = start
            iv[n + 1] = end
            iv[n + 2] = k
        else:
            iv = append(append(append(iv, start), end), k)
            self.iv = iv
        self.end = n + 3
        if i < n:  # (rare: a reservation before the last one) shift the later ones up
            j: i64 = n + 2
            while j >= i + 3:
                iv[j] = iv[j - 3]
                j -= 1
            iv[i] = start
            iv[i + 1] = end
            iv[i + 2] = k

    def correct(self, key: i64, start: float, end: float, now: float) -> bool:
        """Replace reservation `key` by what really happened (or is happening).

        Returns False if the key is unknown (already forgotten); the actual interval is still
        recorded when it reaches past `now`.
        """
        self.memo_at = -1.0
        k = float(key)
        iv = self.iv
        n: i64 = self.end
        found = False
        i: i64
        j: i64
        for i in range(3 * self.head, n, 3):
            if iv[i + 2] == k:
                for j in range(i, n - 3):  # shift the later ones down over it
                    iv[j] = iv[j + 3]
                self.end = n - 3
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
