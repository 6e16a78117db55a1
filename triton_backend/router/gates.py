"""The vGPU gates a router's hop transports take turns at, shared with the executor that
owns them (one per vGPU of each served plan)."""

from __future__ import annotations

import asyncio
import heapq


class Gate:
    """One vGPU's stage calls: one at a time, in the order of their reserved starts (a
    call whose turn has come waits for nothing else; one whose earlier turns are still on
    their way waits for them). A call may free the gate ahead (`release_after`: when its
    inputs will have reached the vGPU): the next turn is not given before then, and no
    timer is set unless a turn waits for it."""

    __slots__ = ("busy", "free_at", "heap", "loop", "seq", "timer", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.heap: list[tuple[float, int]] = []
        self.busy = False
        self.free_at = 0.0  # loop.time() from which the gate is free (release_after)
        self.timer: asyncio.TimerHandle | None = None  # a waiting turn's, until free_at
        self.seq = 0
        self.waiting: dict[int, asyncio.Future] = {}

    def add(self, start_us: float) -> tuple[float, int]:
        """A turn at this reserved start (its token)."""
        self.seq += 1
        token = (start_us, self.seq)
        heapq.heappush(self.heap, token)
        return token

    async def turn(self, token: tuple[float, int]) -> None:
        """Wait until the gate is this token's (then it is busy until `release`)."""
        if not self.busy and self.heap[0] == token and self.loop.time() >= self.free_at:
            heapq.heappop(self.heap)
            self.busy = True
            return
        fut = self.loop.create_future()
        self.waiting[token[1]] = fut
        self._next()  # (its turn may have come but for free_at: a timer then)
        await fut  # the gate is ours when this resolves

    def release(self) -> None:
        self.busy = False
        self._next()

    def release_after(self, delay_s: float) -> None:
        """Free the gate `delay_s` from now."""
        self.free_at = self.loop.time() + delay_s
        self.busy = False
        self._next()

    def forget(self, token: tuple[float, int]) -> None:
        """A turn that will not be taken (its job was dropped or failed)."""
        if token in self.heap:
            self.heap.remove(token)
            heapq.heapify(self.heap)
            self.waiting.pop(token[1], None)
            self._next()

    def _next(self) -> None:
        if self.busy or not self.heap or self.heap[0][1] not in self.waiting:
            return
        if self.loop.time() < self.free_at:
            if self.timer is None:
                self.timer = self.loop.call_at(self.free_at, self._freed)
            return
        fut = self.waiting.pop(self.heap[0][1])
        heapq.heappop(self.heap)
        self.busy = True
        fut.set_result(None)

    def _freed(self) -> None:
        self.timer = None
        self._next()
