"""Each node's clock against the router's: when a chain's hop sends its feature map.

The router reserves every transfer on its own clock. A chain's hop forwards its feature map
from the node it ran on, whose clock is its host's: told only "so long after your stage
began" (a hop's ``after_us``), a stage that began late sends late, into the slot the router
reserved for the next transfer on the link, and both are pushed (docs/serving.md). Told
also when the transfer is reserved on its own clock (``at_ns``), a node whose stage began
late but ended before then sends on time.

`NodeClocks` keeps each node's CLOCK_MONOTONIC against the router's: it asks the node's
watch port for its time every PROBE_S (``T``, node/feed.py) and takes, of the last
PROBES_KEPT answers, the one that came back soonest, the node's time then less the middle
of the round trip (Cristian's algorithm: off by at most half that round trip). A node whose
best round trip was over MAX_RTT_NS, or that has not answered, gets no ``at_ns``: it sends
at ``after_us`` as before. Nodes on one host share one clock (their offset is 0 within the
round trip); on others, the offset is what their clocks were started at, and a drift of
100 ppm moves it 1.6 ms over the probes kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from poolpipe.domain.tier import split_address
from triton_backend.node.feed import FEED_MAGIC

log = logging.getLogger("poolpipe.router")

PROBE_S = 1.0  # a node's clock asked this often
PROBES_KEPT = 16  # the best of this many answers is the offset
PROBE_TIMEOUT_S = 2.0  # an answer later than this ends the connection (and is tried again)
MAX_RTT_NS = 4_000_000  # a node whose best round trip was longer gets no `at_ns`
_FIRST = 4  # answers asked at once when a connection opens


class NodeClocks:
    """Nodes' clocks against this process's CLOCK_MONOTONIC, probed on `loop` until
    `closing` is set."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, closing: asyncio.Event, period_s: float = PROBE_S
    ):
        self.loop = loop
        self.closing = closing
        self.period_s = period_s
        self._where: dict[str, str] = {}  # node -> its watch address (a node's GPUs: one)
        self._samples: dict[str, deque[tuple[int, int]]] = {}  # address -> (round trip, offset)
        self._best: dict[str, tuple[int, int]] = {}
        self._tasks: dict[str, asyncio.Task] = {}  # address -> its probes

    def offset_ns(self, node: str) -> int | None:
        """The node's clock less this process's (ns), or None where not known well enough."""
        best = self._best.get(self._where.get(node, ""))
        return None if best is None or best[0] > MAX_RTT_NS else best[1]

    def round_trip_ns(self, node: str) -> int | None:
        """The best round trip the offset was taken from (twice its largest error)."""
        best = self._best.get(self._where.get(node, ""))
        return None if best is None else best[0]

    def node_time(self, node: str, monotonic_ns: int) -> int | None:
        """This process's CLOCK_MONOTONIC time `monotonic_ns` on the node's clock."""
        offset = self.offset_ns(node)
        return None if offset is None else monotonic_ns + offset

    def watch(self, node: str, address: str) -> None:
        """Probe the node at its watch address (host:port) from now on (on the loop; the
        GPUs of a node of several share their node's probes)."""
        self._where[node] = address
        if address not in self._tasks and not self.closing.is_set():
            self._tasks[address] = self.loop.create_task(self._probe(address))

    def _add(self, address: str, rtt: int, offset: int) -> None:
        kept = self._samples.setdefault(address, deque(maxlen=PROBES_KEPT))
        kept.append((rtt, offset))
        self._best[address] = min(kept)

    async def _probe(self, address: str) -> None:
        host, port = split_address(address)
        while not self.closing.is_set():
            writer = None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), PROBE_TIMEOUT_S
                )
                writer.write(FEED_MAGIC)
                self._samples.pop(address, None)  # (a node started again: its clock anew)
                self._best.pop(address, None)
                k = 0
                while not self.closing.is_set():
                    t0 = time.monotonic_ns()
                    writer.write(b"T")
                    got = await asyncio.wait_for(reader.readexactly(8), PROBE_TIMEOUT_S)
                    t1 = time.monotonic_ns()
                    theirs = int.from_bytes(got, "big")
                    self._add(address, t1 - t0, theirs - (t0 + t1) // 2)
                    k += 1
                    if k >= _FIRST:
                        await self._pause()
            except (OSError, EOFError, TimeoutError) as exc:
                log.debug("clock of the node at %s: %s", address, exc)
            finally:
                if writer is not None:
                    writer.close()
            await self._pause()

    async def _pause(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closing.wait(), self.period_s)
