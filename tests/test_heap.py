"""The heaps of poolpipe/runtime/heap.py pop exactly what heapq pops."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.runtime.heap import EventHeap, Keyed, pop, push

# a push (a time from a few, so that equal times are common) or a pop (None)
OPS = st.lists(st.one_of(st.none(), st.sampled_from([0.0, 1.5, 2.0, 7.25, -3.0])), max_size=200)


@given(OPS)
@settings(max_examples=300, deadline=None)
def test_both_heaps_pop_what_heapq_pops(ops):
    ref: list[tuple[float, int, str]] = []
    keyed: list[Keyed] = []
    events = EventHeap()
    for k, t in enumerate(ops):
        if t is not None:
            # unique keys, in no particular order
            key = (k * 7919) % 1009
            heapq.heappush(ref, (t, key, f"item {k}"))
            push(keyed, Keyed(t, key))
            events.push(t, key, f"item {k}")
        elif ref:
            want_t, want_k, want = heapq.heappop(ref)
            assert events.first_t() == want_t
            assert events.pop() == want
            got = pop(keyed)
            assert (got.t, got.k) == (want_t, want_k)
        assert len(events) == len(ref) == len(keyed)
        assert sorted(map(str, events.pending())) == sorted(item for _, _, item in ref)
    while ref:
        assert events.pop() == heapq.heappop(ref)[2]
    assert len(events) == 0
