"""A binary min-heap of keyed objects: the simulator's event queue and resource queues, and
the overdue watch.

heapq on (time, tie-break, item) tuples made a tuple per entry and compared tuples through
the interpreter's rich comparison; here each entry is a native object whose two keys are
compared as machine numbers (compiled: native.py). Keys must be unique, (t, k) pairs
ordered lexicographically: with unique keys every heap pops in the same order, so this
one pops exactly what heapq did.
"""

from __future__ import annotations


class Keyed:
    """An entry of a heap: ordered by `t`, then by `k` (a sequence number, unique)."""

    __slots__ = ("k", "t")

    def __init__(self, t: float, k: int) -> None:
        self.t = t
        self.k = k


def _before(a: Keyed, b: Keyed) -> bool:
    return a.t < b.t or (a.t == b.t and a.k < b.k)


def push(heap: list[Keyed], item: Keyed) -> None:
    heap.append(item)
    i = len(heap) - 1
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[parent]
        if not _before(item, p):
            break
        heap[i] = p
        i = parent
    heap[i] = item


def pop(heap: list[Keyed]) -> Keyed:
    """Take the least entry (the heap must not be empty)."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    _sift_down(heap, 0, last)
    return first


def _sift_down(heap: list[Keyed], i: int, item: Keyed) -> None:
    """Place `item` at slot `i` or below, moving smaller children up."""
    n = len(heap)
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        c = heap[child]
        right = child + 1
        if right < n:
            r = heap[right]
            if _before(r, c):
                child, c = right, r
        if not _before(c, item):
            break
        heap[i] = c
        i = child
    heap[i] = item


def heapify(heap: list[Keyed]) -> None:
    for i in range(len(heap) // 2 - 1, -1, -1):
        _sift_down(heap, i, heap[i])
