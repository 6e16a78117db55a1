"""Feature maps into a node past its Triton's HTTP front end.

A chain's hop sends its feature map to the next node's model over KServe v2 HTTP. Triton's
HTTP front end reads a large body in small pieces: a 2.7 MB map reached a Python-backend
model 8.7 ms after it was sent on loopback, 1.7 ms through the feed (p50, `./run
bench-ingress --parts sizes`; a TCP socket alone 0.9). So a `poolpipe node` keeps a feed:
a shared-memory region registered with its Triton (system shared memory, `FEED_REGION`),
filled over its watch port. The sending hop (or the router, for a batch's inputs) writes
the map there over one TCP connection (`FeedRegion` places it, the node's reply says
where) and then calls the model over HTTP as before, its inputs naming the region, offset
and size instead of carrying the bytes; Triton hands them to the model as any input. When
the call has come back the sender frees the place.

On a connection to the watch port (watch.py) the sender first writes FEED_MAGIC; then
messages, each one byte of kind and fixed fields (big-endian):

- ``P`` size (u64), then size bytes: place them. The reply: offset (u64) and a ticket
  (u64), or NO_ROOM and 0 where the region has no room (the bytes are read and dropped;
  the sender sends the map inline instead).
- ``F`` offset (u64), ticket (u64): that place is free again. No reply. A free whose ticket
  is not the place's is ignored, so that nobody frees a place they did not get.

A place not freed within FEED_HOLD_S (a sender that died) is freed when room is needed.
The region's file is removed once Triton has it mapped: nothing is left in /dev/shm when
the node dies, however it dies.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import secrets
import socket
import struct
import threading
import time

FEED_MAGIC = b"POOLPIPE-FEED/1\n"
FEED_REGION = "poolpipe_feed"  # the region's name in the node's Triton
NO_ROOM = (1 << 64) - 1
FEED_ALIGN = 64  # every place starts at a multiple of this
FEED_HOLD_S = 120.0  # a place is freed after this long at most (twice a hop's timeout)
FEED_MB = 256  # the region's size unless the node is told otherwise (--feed-mb)
_U64 = struct.Struct(">Q")
_PLACED = struct.Struct(">QQ")


class FeedError(OSError):
    pass


class FeedSpace:
    """Places in a region of `size` bytes: first fit over the free extents, merged again on
    free; each place with a random ticket that its free must give."""

    def __init__(self, size: int, hold_s: float = FEED_HOLD_S, clock=time.monotonic):
        self.size = size
        self.hold_s = hold_s
        self.clock = clock
        self.free_at: list[int] = [0]  # free extents' starts, sorted
        self.free_len: dict[int, int] = {0: size}
        self.held: dict[int, tuple[int, int, float]] = {}  # offset -> (size, ticket, since)
        self.lock = threading.Lock()

    def place(self, n: int) -> tuple[int, int] | None:
        """(offset, ticket) of n bytes, or None without room."""
        need = max(FEED_ALIGN, -(-n // FEED_ALIGN) * FEED_ALIGN)
        with self.lock:
            got = self._first_fit(need)
            if got is None and self._expire():
                got = self._first_fit(need)
            if got is None:
                return None
            ticket = secrets.randbits(63) + 1
            self.held[got] = (need, ticket, self.clock())
            return got, ticket

    def free(self, offset: int, ticket: int) -> bool:
        with self.lock:
            held = self.held.get(offset)
            if held is None or held[1] != ticket:
                return False
            del self.held[offset]
            self._release(offset, held[0])
            return True

    @property
    def in_use(self) -> int:
        with self.lock:
            return sum(h[0] for h in self.held.values())

    def _first_fit(self, need: int) -> int | None:
        for start in self.free_at:
            length = self.free_len[start]
            if length >= need:
                self.free_at.remove(start)
                del self.free_len[start]
                if length > need:
                    bisect.insort(self.free_at, start + need)
                    self.free_len[start + need] = length - need
                return start
        return None

    def _expire(self) -> bool:
        now = self.clock()
        old = [o for o, (_, _, since) in self.held.items() if now - since > self.hold_s]
        for o in old:
            self._release(o, self.held.pop(o)[0])
        return bool(old)

    def _release(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self.free_at, offset)
        end = offset + length
        if i < len(self.free_at) and self.free_at[i] == end:  # merge the extent after
            length += self.free_len.pop(end)
            self.free_at.pop(i)
        if i > 0 and self.free_at[i - 1] + self.free_len[self.free_at[i - 1]] == offset:
            before = self.free_at[i - 1]  # ... and the one before
            self.free_len[before] += length
            return
        self.free_at.insert(i, offset)
        self.free_len[offset] = length


class FeedRegion:
    """The node's feed: a shared-memory file of `size_mb` mapped here, its places
    (FeedSpace). `register(client, headers)` hands it to the node's Triton and removes its
    name; `close()` unmaps it."""

    def __init__(self, size_mb: int = FEED_MB, root: str = "/dev/shm"):
        if size_mb < 1:
            raise ValueError(f"a feed of {size_mb} MB: give at least 1")
        size = size_mb << 20
        self.key = f"/poolpipe_feed_{os.getpid()}_{secrets.token_hex(4)}"
        self.path = root + self.key
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.view = memoryview(self.map)
        self.space = FeedSpace(size)
        self.placed = 0  # maps placed, and those refused for want of room
        self.refused = 0

    def register(self, client, headers: dict[str, str] | None) -> None:
        """Register the region with the node's Triton (`client`: its tritonclient HTTP
        client), then remove its name (Triton and this process keep it mapped)."""
        try:
            client.register_system_shared_memory(
                FEED_REGION, self.key, self.space.size, headers=headers
            )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def serve(self, conn: socket.socket) -> None:
        """Serve one sender's connection (its FEED_MAGIC read) until it closes."""
        view = self.view
        while True:
            kind = conn.recv(1)
            if not kind:
                return
            if kind == b"P":
                (n,) = _U64.unpack(_recv_exactly(conn, 8))
                got = self.space.place(n) if 0 < n <= self.space.size else None
                if got is None:
                    self.refused += 1
                    _drop(conn, n)
                    conn.sendall(_PLACED.pack(NO_ROOM, 0))
                    continue
                offset, ticket = got
                try:
                    _recv_into(conn, view[offset : offset + n])
                except BaseException:
                    self.space.free(offset, ticket)
                    raise
                self.placed += 1
                conn.sendall(_PLACED.pack(offset, ticket))
            elif kind == b"F":
                offset, ticket = _PLACED.unpack(_recv_exactly(conn, 16))
                self.space.free(offset, ticket)
            else:
                raise FeedError(f"a feed message of kind {kind!r}: expected P or F")

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise FeedError("the sender closed the connection inside a message")
        got += k


def _drop(conn: socket.socket, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    view = memoryview(buf)
    while n > 0:
        k = conn.recv_into(view[: min(n, len(buf))])
        if not k:
            raise FeedError("the sender closed the connection inside a message")
        n -= k
