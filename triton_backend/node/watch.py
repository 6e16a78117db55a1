"""A node's process, watched by its router over one TCP connection.

`poolpipe node` listens on a watch port (`NodeWatch`) and holds every connection made to it
without writing a byte. The router keeps one open to each node that has a watch address
(`watch_node`): when the node's process ends, however it ends (`kill -9`, the OOM killer, a
crash, a stop), the kernel closes the connection and the router takes the node out of
service at that moment, before a stage call on it fails or waits out its Triton's shutdown.
A node stopping on purpose closes its watch first, so that no new batch reaches it while it
finishes what it has. TCP keepalive finds a peer that vanished without a word (a host
powered off, a cable pulled) within WATCH_KEEPALIVE_S.

The watch carries nothing but the connection's life: it needs no token. A connection that
opens with feed.FEED_MAGIC is a chain's hop sending a feature map and its call to the
node's feed instead (feed.py): the same port, so that every address that names a node's
process names its feed too."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable

from poolpipe.domain.tier import split_address
from triton_backend.node.feed import FEED_MAGIC, FeedRegion, serve_time_only

# A vanished peer is found after this long at most (keepalive: idle, then probes).
WATCH_KEEPALIVE_S = 5.0
# A watch that could not connect, or whose connection broke, tries again after this long.
WATCH_RETRY_S = 0.5


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(WATCH_KEEPALIVE_S) - 2)


class NodeWatch:
    """The node's side: listens on (`address`, `port`; 0: a free one) and holds the
    connections routers make, and serves those that open as a feed (`feed`: the node's
    region, where it has one). `close()` closes them all (the routers take the node out of
    service at once) and stops listening."""

    def __init__(self, address: str, port: int = 0, feed: FeedRegion | None = None):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, port))
        self._sock.listen(64)
        self.address = address
        self.port: int = self._sock.getsockname()[1]
        self.feed = feed
        self._held: set[socket.socket] = set()  # watchers
        self._feeding: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="poolpipe-watch", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def watchers(self) -> int:
        """Connections held now (routers watching, and connections not yet seen closed)."""
        with self._lock:
            return len(self._held)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            _keepalive(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._held.add(conn)
            threading.Thread(
                target=self._connection, args=(conn,), name="poolpipe-watch-conn", daemon=True
            ).start()

    def _connection(self, conn: socket.socket) -> None:
        """A watcher sends nothing: its first bytes come when it closes (b""). A feed's are
        FEED_MAGIC (on a node without a feed, only the clock's ``T`` is answered);
        anything else is closed."""
        try:
            first = b""
            while len(first) < len(FEED_MAGIC):
                chunk = conn.recv(len(FEED_MAGIC) - len(first))
                if not chunk or not FEED_MAGIC.startswith(first + chunk):
                    return
                first += chunk
            with self._lock:
                self._held.discard(conn)
                if self._closed:
                    return
                self._feeding.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.feed is None:
                serve_time_only(conn)  # the router's clock probes alone (feed.py, ``T``)
            else:
                self.feed.serve(conn)
        except OSError:
            pass  # the sender went away, or the watch closed
        finally:
            with self._lock:
                self._held.discard(conn)
                self._feeding.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held = [*self._held, *self._feeding]
            self._held, self._feeding = set(), set()
        for c in held:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


async def watch_node(
    address: str,
    lost: Callable[[str], None],
    watched: Callable[[], None],
    closing: asyncio.Event,
    retry_s: float = WATCH_RETRY_S,
) -> None:
    """The router's side, on its loop until `closing` is set: keep a connection to the
    watch port at `address`: `watched()` each time one opens, `lost(why)` each time one
    that was open breaks. A node that cannot be reached is retried every `retry_s` (its
    checks tell whether it serves)."""
    host, port = split_address(address)
    while not closing.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closing.wait(), retry_s)
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)
        watched()
        ended = asyncio.ensure_future(reader.read(1))
        stop = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait({ended, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            writer.close()
        if closing.is_set():
            ended.cancel()
            return
        why = "its process ended (watch connection closed)"
        with contextlib.suppress(Exception):
            if ended.exception() is not None:
                why = f"its watch connection broke ({ended.exception()})"
        lost(why)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(closing.wait(), retry_s)
