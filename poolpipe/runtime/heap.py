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
    """An entry of a heap: ordered by `t`, then by `k` (a sequence number, unique); `item`
    is what it holds. (Entries of exactly this class are the cheapest to check when read
    back from a list; a subclass may be an entry too.)"""

    __slots__ = ("item", "k", "t")

    def __init__(self, t: float, k: int, item: object = None) -> None:
        self.t = t
        self.k = k
        self.item = item


def push(heap: list[Keyed], entry: Keyed) -> None:
    heap.append(entry)
    i = len(heap) - 1
    t, k = entry.t, entry.k
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[parent]
        if t > p.t or (t == p.t and k > p.k):  # not before its parent (keys are unique)
            break
        heap[i] = p
        i = parent
    heap[i] = entry


def pop(heap: list[Keyed]) -> Keyed:
    """Take the least entry (the heap must not be empty)."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    _sift_down(heap, 0, last)
    return first


def _sift_down(heap: list[Keyed], i: int, entry: Keyed) -> None:
    """Place `entry` at slot `i` or below, moving smaller children up."""
    n = len(heap)
    t, k = entry.t, entry.k
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        c = heap[child]
        right = child + 1
        if right < n:
            r = heap[right]
            if r.t < c.t or (r.t == c.t and r.k < c.k):
                child, c = right, r
        if c.t > t or (c.t == t and c.k > k):  # the entry goes here
            break
        heap[i] = c
        i = child
    heap[i] = entry


def heapify(heap: list[Keyed]) -> None:
    for i in range(len(heap) // 2 - 1, -1, -1):
        _sift_down(heap, i, heap[i])
