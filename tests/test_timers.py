"""The router's event loop (triton_backend/timers.py): epoll's wait spent in select() with
a microsecond timeout. What is checked is behaviour, not speed: a ready socket ends the
wait at once with its event, nothing ready ends it with none, and timers never fire
before their time, in order."""

from __future__ import annotations

import selectors
import socket
import time

import pytest

from triton_backend.timers import SELECT_LIMIT, PreciseEpollSelector, precise_event_loop


def test_a_ready_socket_ends_the_wait_with_its_event_and_none_ends_it_empty():
    a, b = socket.socketpair()
    sel = PreciseEpollSelector()
    try:
        sel.register(a, selectors.EVENT_READ, "a")
        assert sel.select(0.002) == []  # nothing ready: the timeout ends it
        b.send(b"x")
        t0 = time.monotonic()
        got = sel.select(30.0)
        assert [(k.data, ev) for k, ev in got] == [("a", selectors.EVENT_READ)]
        assert time.monotonic() - t0 < 15.0  # not the whole timeout
        assert [k.data for k, _ in sel.select(None)] == ["a"]  # still ready: no wait
    finally:
        sel.close()
        a.close()
        b.close()


def test_timers_fire_in_order_and_never_early():
    loop = precise_event_loop()
    fired: list[tuple[float, float]] = []
    try:
        start = loop.time()
        for delay in (0.0013, 0.0003, 0.0001, 0.0021):
            due = start + delay
            loop.call_at(due, lambda due=due: fired.append((due, loop.time())))
        loop.call_at(start + 0.01, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert [d for d, _ in fired] == sorted(d for d, _ in fired)
    assert all(at >= due for due, at in fired), fired


def test_an_epoll_descriptor_beyond_selects_range_waits_as_epoll_does():
    """select() takes descriptors below FD_SETSIZE only: a loop made in a process with that
    many files open still waits (to the millisecond) rather than failing."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = SELECT_LIMIT + 64
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"this process may open {hard} files, the test needs {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []
    a, b = socket.socketpair()
    try:
        while not held or held[-1] < SELECT_LIMIT:
            held.append(os.dup(a.fileno()))
        sel = PreciseEpollSelector()
        try:
            assert sel.fileno() >= SELECT_LIMIT
            sel.register(a, selectors.EVENT_READ, "a")
            assert sel.select(0.002) == []
            b.send(b"x")
            assert [k.data for k, _ in sel.select(5.0)] == ["a"]
        finally:
            sel.close()
    finally:
        for fd in held:
            os.close(fd)
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
