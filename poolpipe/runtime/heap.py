"""Binary min-heaps: of keyed objects (the simulator's resource queues: its works are
Keyed), and of items under unboxed keys (EventHeap: the simulator's event queue, the
overdue watch).

heapq on (time, tie-break, item) tuples made a tuple per entry and compared tuples through
the interpreter's rich comparison; here each entry is a native object whose two keys are
compared as machine numbers (compiled: native.py). Keys must be unique, (t, k) pairs
ordered lexicographically: with unique keys every heap pops in the same order, so this
one pops exactly what heapq did.
"""

from __future__ import annotations

from librt.vecs import append, vec
from librt.vecs import pop as vpop
from mypy_extensions import i64, mypyc_attr


@mypyc_attr(acyclic=True)
class Keyed:
    """An entry of a heap: ordered by `t`, then by `k` (a sequence number, unique). What it
    stands for is a subclass's (the simulator's _Work). `acyclic` (compiled: not tracked by
    the cyclic garbage collector): a subclass must never be part of a reference cycle."""

    __slots__ = ("k", "t")

    def __init__(self, t: float, k: int) -> None:
        self.t = t
        self.k = k


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
    if len(heap) == 1:
        # (a list popped empty reallocates its items to 0 bytes, which pymalloc leaves
        # to the C library, and so the next push's too: the simulator's resource queues,
        # empty and one long by turns, lived in malloc's heap. Cleared, the list frees
        # its items and takes new ones from pymalloc.)
        last = heap[0]
        heap.clear()
        return last
    last = heap.pop()
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


class Slots:
    """Items that keep their index (slot) while they are held: a free slot (None in
    `items`) is taken again first, the last freed first, so `items` stays as long as the
    most ever held at once (compiled: no dict, no int object per item). The event heap's
    items (EventHeap, written out); the runtime's requests in flight."""

    __slots__ = ("free", "items")

    def __init__(self) -> None:
        self.items: list[object] = []
        self.free: vec[i64] = vec[i64]()  # slots of `items` not in use

    def __len__(self) -> int:
        """How many are held."""
        return len(self.items) - len(self.free)

    def take(self, item: object) -> i64:
        """Hold `item`; its slot."""
        if len(self.free):
            self.free, slot = vpop(self.free)
            self.items[slot] = item
            return slot
        self.items.append(item)
        return i64(len(self.items) - 1)

    def release(self, slot: i64) -> None:
        """Let go of the item in `slot`; the slot is free."""
        self.items[slot] = None
        self.free = append(self.free, slot)


class EventHeap:
    """A min-heap of items by unique (t, k) keys, the keys unboxed: entry i's are `ts[i]`
    and `ks[i]`, its item `items[slots[i]]` (librt.vecs, compiled: one buffer each).

    What a heap of Keyed does, without an object per entry: a sift moves numbers in three
    buffers, where it read each Keyed it passed (the simulator's queue of a thousand GPUs
    holds some 900 events, their entries long out of the cache by their turn), and an item
    stays in its slot of `items` until it is popped (a free slot is taken again first).
    With unique keys it pops exactly what heapq would."""

    __slots__ = ("free", "items", "ks", "slots", "ts")

    def __init__(self) -> None:
        self.ts: vec[float] = vec[float]()
        self.ks: vec[i64] = vec[i64]()
        self.slots: vec[i64] = vec[i64]()
        self.items: list[object] = []
        self.free: vec[i64] = vec[i64]()  # slots of `items` not in use, the last freed last

    def __len__(self) -> int:
        return len(self.ts)

    def first_t(self) -> float:
        """The least entry's t (the heap must not be empty)."""
        return self.ts[0]

    def push(self, t: float, k: i64, item: object) -> int:
        """Add `item` under (t, k); returns its slot (see `release`)."""
        # (Slots.take, written out: a Slots of its own is one more object and call on
        # every push of the event loop)
        if len(self.free):
            self.free, slot = vpop(self.free)
            self.items[slot] = item
        else:
            slot = i64(len(self.items))
            self.items.append(item)
        ts = append(self.ts, t)
        ks = append(self.ks, k)
        slots = append(self.slots, slot)
        self._settle(ts, ks, slots, i64(len(ts) - 1), t, k, slot)
        return slot

    def _settle(
        self, ts: vec[float], ks: vec[i64], slots: vec[i64], i: i64, t: float, k: i64, slot: i64
    ) -> None:
        """Entry (t, k, slot) at i or above it (it rises past every parent it goes before),
        and the vectors (a push or pop may have moved them) kept."""
        while i > 0:
            parent = (i - 1) >> 1
            pt = ts[parent]
            if t > pt or (t == pt and k > ks[parent]):  # not before its parent
                break
            ts[i] = pt
            ks[i] = ks[parent]
            slots[i] = slots[parent]
            i = parent
        ts[i] = t
        ks[i] = k
        slots[i] = slot
        self.ts, self.ks, self.slots = ts, ks, slots

    def first_item(self) -> object:
        """The least entry's item (the heap must not be empty)."""
        return self.items[self.slots[0]]

    def release(self, slot: int) -> None:
        """Let go of the item in `slot` (an entry still in the heap) ahead of its turn: its
        entry stays, and pops None."""
        self.items[slot] = None

    def pop(self) -> object:
        """Take the least entry's item (the heap must not be empty)."""
        ts, ks, slots = self.ts, self.ks, self.slots
        first = slots[0]
        item = self.items[first]
        self.items[first] = None
        self.free = append(self.free, first)
        ts, t = vpop(ts)
        ks, k = vpop(ks)
        slots, slot = vpop(slots)
        n: i64 = len(ts)
        if n:
            # The last entry goes in the top's place, bottom-up: the hole moves down to a
            # leaf along the lesser children (one comparison a level, not two), and the
            # entry rises from there (an event queue's last entry, among the latest, rarely
            # rises far).
            i: i64 = 0
            child: i64 = 1
            while child < n:
                right = child + 1
                if right < n:
                    ct, rt = ts[child], ts[right]
                    if rt < ct or (rt == ct and ks[right] < ks[child]):
                        child = right
                ts[i] = ts[child]
                ks[i] = ks[child]
                slots[i] = slots[child]
                i = child
                child = 2 * i + 1
            self._settle(ts, ks, slots, i, t, k, slot)
        else:
            self.ts, self.ks, self.slots = ts, ks, slots
        return item

    def pending(self) -> list[object]:
        """The items in the heap, in no order."""
        return [self.items[self.slots[i]] for i in range(len(self.slots))]
