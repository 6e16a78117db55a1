"""An event loop whose timers fire on time to the microsecond, not the millisecond.

asyncio's default loop on Linux waits with epoll, whose timeout CPython rounds up to the
millisecond: a timer due in 0.3 ms fires after 1 ms, one due in 1.3 ms after 2; on average
half a millisecond late (measured: arrivals handed to the router by its timers reached it
0.55 ms after their stamps at p50). The router's timers are its data plane's last moments
and its transports' reserved send times, so at undilated time (real GPUs, SLOs of 10-100
ms) the wake guard had to cover that. Here the wait for the next timer is spent in
select() on the epoll file descriptor itself (a timeout in microseconds; it wakes when any
registered file is ready), then epoll is asked without waiting.
"""

from __future__ import annotations

import asyncio
import select
import selectors

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


def precise_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop whose timers keep microseconds (epoll where the platform has it)."""
    if hasattr(selectors, "EpollSelector"):
        return asyncio.SelectorEventLoop(PreciseEpollSelector())
    return asyncio.new_event_loop()
