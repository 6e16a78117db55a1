"""The router's event loop (triton_backend/router/timers.py): uvloop with its timers kept in a
heap woken by a timerfd, or asyncio's loop with epoll's wait spent in select() with a
microsecond timeout. What is checked is behaviour, not speed: a ready socket ends the
wait at once with its event, nothing ready ends it with none, timers never fire before
their time and fire in order (near ones and those libuv holds until they are near),
cancelled ones never, and a failing callback is reported without stopping the rest. And the
vGPU gates freed ahead (gates.Gate.release_after) give no turn before their time."""

from __future__ import annotations

import asyncio
import selectors
import socket
import sys
import time

import pytest

from triton_backend.router import timers
from triton_backend.router.gates import Gate
from triton_backend.router.timers import (
    SELECT_LIMIT,
    PreciseEpollSelector,
    PreciseLoop,
    coarse_call_later,
    loop_kind,
    precise_event_loop,
)

needs_uvloop = pytest.mark.skipif(
    timers._Base is asyncio.SelectorEventLoop or not sys.platform.startswith("linux"),
    reason="uvloop is not installed here (the router runs asyncio's loop)",
)


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


@needs_uvloop
def test_the_router_loop_is_uvloop_with_timerfd_timers():
    loop = precise_event_loop()
    try:
        assert isinstance(loop, PreciseLoop)
        assert loop_kind(loop) == "uvloop, timerfd timers"
    finally:
        loop.close()


@pytest.mark.parametrize("make", [precise_event_loop, asyncio.new_event_loop])
def test_a_coarse_timer_fires_within_a_millisecond_of_its_time_and_a_cancelled_one_never(make):
    loop = make()
    fired: list[tuple[str, float]] = []
    try:
        start = loop.time()
        coarse_call_later(loop, 0.02, lambda: fired.append(("a", loop.time())))
        gone = coarse_call_later(loop, 0.01, lambda: fired.append(("gone", loop.time())))
        coarse_call_later(loop, 0.005, lambda: fired.append(("b", loop.time())))
        gone.cancel()
        loop.call_at(start + 0.05, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert [k for k, _ in fired] == ["b", "a"]
    for (_, at), delay in zip(fired, (0.005, 0.02), strict=True):
        assert at - start >= delay - 0.0015, fired  # libuv's milliseconds, at most 1 early


@needs_uvloop
def test_near_and_far_timers_fire_in_order_never_early_and_cancelled_ones_never(monkeypatch):
    """Far timers (libuv's until they are near) are made far at 3 ms here so that the test
    takes milliseconds: both kinds interleaved fire in the order of their times."""
    monkeypatch.setattr(timers, "FAR_NS", 3_000_000)
    monkeypatch.setattr(timers, "HANDOVER_NS", 2_000_000)
    loop = precise_event_loop()
    fired: list[tuple[float, float]] = []
    cancelled: list[float] = []
    try:
        start = loop.time()
        delays = (0.0131, 0.0003, 0.0001, 0.0021, 0.0062, 0.0044, 0.0, 0.0205, 0.0089)
        for delay in delays:
            due = start + delay
            loop.call_at(due, lambda due=due: fired.append((due, time.monotonic())))
        for delay in (0.0002, 0.0071):  # one near, one far: neither fires
            loop.call_later(delay, cancelled.append, delay).cancel()
        loop.call_at(start + 0.03, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert [d for d, _ in fired] == sorted(start + d for d in delays)
    assert all(at >= due for due, at in fired), fired
    assert cancelled == []


@pytest.mark.parametrize("make", [precise_event_loop, asyncio.new_event_loop])
def test_timers_already_due_fire_in_the_order_of_their_times_not_of_their_setting(make):
    """What a busy host makes of timers set a little apart: by the time the later ones are
    set, earlier-set ones may already be due. They fire in the order of their times, after
    what was ready, as asyncio's own loop has them."""
    loop = make()
    fired: list[str] = []
    try:
        now = loop.time()
        loop.call_soon(fired.append, "ready")
        loop.call_at(now - 0.001, fired.append, "-1 ms")
        loop.call_at(now - 0.003, fired.append, "-3 ms")
        loop.call_at(now + 0.0004, fired.append, "+0.4 ms")
        loop.call_at(now - 0.002, fired.append, "-2 ms")
        loop.call_at(now + 0.02, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert fired == ["ready", "-3 ms", "-2 ms", "-1 ms", "+0.4 ms"]


@needs_uvloop
def test_a_failing_timer_is_reported_and_the_others_still_fire():
    loop = precise_event_loop()
    seen: list[str] = []
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    def boom() -> None:
        raise ValueError("boom")

    try:
        loop.call_later(0.0005, boom)
        loop.call_later(0.0005, seen.append, "after")
        loop.call_later(0.002, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert seen == ["after"]
    assert [type(c["exception"]) for c in reported] == [ValueError]


@needs_uvloop
def test_sleep_and_wait_for_keep_time_on_the_loop():
    async def main() -> tuple[float, bool]:
        t0 = time.monotonic()
        await asyncio.sleep(0.0015)
        slept = time.monotonic() - t0
        try:
            await asyncio.wait_for(asyncio.sleep(1.0), 0.002)
        except TimeoutError:
            return slept, True
        return slept, False

    loop = precise_event_loop()
    try:
        slept, timed_out = loop.run_until_complete(main())
    finally:
        loop.close()
    assert slept >= 0.0015
    assert timed_out


def test_a_gate_freed_ahead_gives_no_turn_before_its_time():
    """release_after(d): the next turn waits until d has passed (by a timer, set only
    because a turn waits); a turn that comes after that takes the gate at once."""

    async def main() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        gate = Gate(loop)
        first, second, third = gate.add(1.0), gate.add(2.0), gate.add(3.0)
        await gate.turn(first)
        t0 = loop.time()
        gate.release_after(0.004)
        assert gate.timer is None  # nobody waits yet: no timer
        await gate.turn(second)
        waited = loop.time() - t0
        gate.release_after(0.001)
        await asyncio.sleep(0.003)
        t1 = loop.time()
        await gate.turn(third)  # its time has passed: at once
        return waited, loop.time() - t1, gate.timer is None

    loop = precise_event_loop()
    try:
        waited, at_once, no_timer = loop.run_until_complete(main())
    finally:
        loop.close()
    assert waited >= 0.004
    assert at_once < 0.001
    assert no_timer


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
