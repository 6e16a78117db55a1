"""An event loop whose timers fire on time to the microsecond, not the millisecond.

The router's timers are its data plane's last moments and its transports' reserved send
times, so at undilated time (real GPUs, SLOs of 10-100 ms) a timer half a millisecond late
is half a millisecond of every SLO (the wake guard must cover it) and one early sends a
batch before its reservation.

The router's loop is uvloop's (libuv: the loop, its sockets' transports and the handles'
machinery in C; the router's CPU per request with a trivial stage about 9% less than on
asyncio's loop, where they are Python). libuv counts time in milliseconds (a timer due in
0.3 ms fires at once, one due in 1.3 ms after 1), so this loop keeps every timer of its
own (`call_later`, `call_at`, and so `asyncio.sleep` and `wait_for`) in a heap here and
wakes for the earliest with a timerfd armed to the nanosecond (CLOCK_MONOTONIC, absolute);
its clock (`time()`) is CLOCK_MONOTONIC too.

Where uvloop or timerfd is missing, asyncio's loop with `PreciseEpollSelector`: asyncio
waits with epoll, whose timeout CPython rounds up to the millisecond (on average half a
millisecond late); that selector spends the wait for the next timer in select() on the
epoll file descriptor itself (a timeout in microseconds; it wakes when any registered file
is ready), then asks epoll without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import heapq
import os
import select
import selectors
import sys
import time
from collections.abc import Callable
from typing import Any

# select() takes descriptors below this (FD_SETSIZE); an epoll descriptor at or above it
# waits as plain epoll does, to the millisecond
SELECT_LIMIT = 1024


class PreciseEpollSelector(selectors.EpollSelector):
    """EpollSelector with microsecond timeouts (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._precise = self.fileno() < SELECT_LIMIT

    def select(self, timeout: float | None = None) -> list:
        if timeout is not None and timeout > 0 and self._precise:
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


# ------------------------------------------------------------------ timerfd (Linux)

_CLOCK_MONOTONIC = 1  # time.monotonic_ns()'s clock on Linux
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class TimerFd:
    """A CLOCK_MONOTONIC timerfd: `arm(ns)` makes it readable at that time (absolute)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        self._settime.restype = ctypes.c_int
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd: int = fd
        self._spec = _Itimerspec()
        self._spec_ref = ctypes.byref(self._spec)

    def arm(self, ns: int) -> None:
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(max(ns, 1), 1_000_000_000)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, self._spec_ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):  # (a deadline moved since it woke)
            os.read(self.fd, 8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# A timer due later than this is left to libuv (its own timers, in C, to the millisecond)
# until HANDOVER before its time, then kept in the heap: a stage call's timeout, set and
# cancelled at every call, costs no timerfd and no Python heap
FAR_NS = 20_000_000
HANDOVER_NS = 5_000_000


class PreciseTimer:
    """A timer of `PreciseLoop` (what `call_at` returns: `cancel()`, `cancelled()`,
    `when()` as asyncio's TimerHandle)."""

    __slots__ = ("_args", "_callback", "_cancelled", "_context", "_loop", "_native", "_when")

    def __init__(
        self,
        when: float,
        callback: Callable[..., Any],
        args: tuple,
        context: contextvars.Context | None,
        loop: Any,
    ):
        self._when = when
        self._callback: Callable[..., Any] | None = callback
        self._args = args
        self._context = context
        self._loop = loop
        self._cancelled = False
        self._native: Any = None  # libuv's timer that hands it to the heap (a far one)

    def when(self) -> float:
        return self._when

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._callback = None
            self._args = ()
            if self._native is not None:
                self._native.cancel()
                self._native = None
            else:
                self._loop._timer_cancelled()

    def _run(self) -> None:
        callback, args = self._callback, self._args
        if callback is None:
            return
        try:
            if self._context is None:
                callback(*args)
            else:
                self._context.run(callback, *args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.call_exception_handler(
                {"message": f"Exception in callback {callback!r}", "exception": exc}
            )

    def __repr__(self) -> str:
        state = " cancelled" if self._cancelled else ""
        return f"<PreciseTimer when={self._when:.6f}{state} {self._callback!r}>"


def _uvloop_class() -> type | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.Loop


_Base: Any = _uvloop_class() or asyncio.SelectorEventLoop


class PreciseLoop(_Base):
    """uvloop's loop with its timers kept here and woken by a timerfd (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._timerfd = TimerFd()
        # (due ns, sequence, timer): equal times fire in the order they were set
        self._timers: list[tuple[int, int, PreciseTimer]] = []
        self._timer_seq = 0
        self._armed_ns = 0  # the timerfd's deadline (0: none)
        self._timers_cancelled = 0
        self.add_reader(self._timerfd.fd, self._fire)

    def time(self) -> float:
        return time.monotonic()

    def call_later(
        self,
        delay: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> Any:
        return self.call_at(time.monotonic() + delay, callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> Any:
        ns = int(when * 1e9)
        timer = PreciseTimer(when, callback, args, context, self)
        ahead = ns - time.monotonic_ns()
        if ahead > FAR_NS:  # libuv's timer brings it here a little before its time
            timer._native = super().call_later((ahead - HANDOVER_NS) / 1e9, self._near, timer)
            return timer
        self._push(ns, timer)
        return timer

    def coarse_call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Any:
        """libuv's own timer, to the millisecond (it may fire up to 1 ms early or late): for
        deadlines of seconds set and cancelled at every call (a stage call's timeout), in C
        with no heap or timerfd of this loop."""
        return super().call_later(delay, callback, *args)

    def _near(self, timer: PreciseTimer) -> None:
        timer._native = None
        self._push(int(timer._when * 1e9), timer)

    def _push(self, ns: int, timer: PreciseTimer) -> None:
        # one already due goes here too (the timerfd, armed in the past, is ready at once):
        # after what is ready now, and due ones fire in the order of their times as
        # asyncio's do, not in the order they were set
        self._timer_seq += 1
        heapq.heappush(self._timers, (ns, self._timer_seq, timer))
        if self._armed_ns == 0 or ns < self._armed_ns:
            self._armed_ns = ns
            self._timerfd.arm(ns)

    def _timer_cancelled(self) -> None:
        self._timers_cancelled += 1
        timers = self._timers
        if self._timers_cancelled > 100 and 2 * self._timers_cancelled > len(timers):
            self._timers = [t for t in timers if not t[2]._cancelled]
            heapq.heapify(self._timers)
            self._timers_cancelled = 0

    def _fire(self) -> None:
        self._timerfd.drain()
        now = time.monotonic_ns()
        timers = self._timers
        due = []
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            if timer._cancelled:
                self._timers_cancelled -= 1
            else:
                due.append(timer)
        self._armed_ns = 0
        if timers:
            self._armed_ns = timers[0][0]
            self._timerfd.arm(self._armed_ns)
        for timer in due:
            timer._run()

    def close(self) -> None:
        if self._timerfd.fd >= 0 and not self.is_closed():
            self.remove_reader(self._timerfd.fd)
            self._timerfd.close()
        super().close()


def coarse_call_later(
    loop: asyncio.AbstractEventLoop, delay: float, callback: Callable[..., Any], *args: Any
) -> Any:
    """`loop.call_later` where a millisecond either way does not matter (a timeout of
    seconds): on `PreciseLoop` libuv's own timer, the cheapest this loop has."""
    coarse = getattr(loop, "coarse_call_later", None)
    if coarse is None:
        return loop.call_later(delay, callback, *args)
    return coarse(delay, callback, *args)


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """Which of this module's loops `loop` is, in words (status and benchmarks)."""
    if isinstance(loop, PreciseLoop) and _Base is not asyncio.SelectorEventLoop:
        return "uvloop, timerfd timers"
    return "asyncio, precise epoll selector"


def precise_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop whose timers keep microseconds: uvloop with timerfd timers where
    both exist (Linux with uvloop installed), asyncio's with the precise epoll selector
    otherwise (epoll's rounding where the platform has no epoll)."""
    if _Base is not asyncio.SelectorEventLoop and sys.platform.startswith("linux"):
        try:
            return PreciseLoop()
        except (OSError, AttributeError):  # no timerfd here
            pass
    if hasattr(selectors, "EpollSelector"):
        return asyncio.SelectorEventLoop(PreciseEpollSelector())
    return asyncio.new_event_loop()
