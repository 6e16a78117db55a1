"""Feature maps into a node past its Triton's HTTP front end.

A chain's hop sends its feature map to the next node's model over KServe v2 HTTP. Triton's
HTTP front end reads a large body in small pieces: a 2.7 MB map reached a Python-backend
model 8.7 ms after it was sent on loopback, 1.7 ms through the feed (p50, `./run
bench-ingress --parts sizes`; a TCP socket alone 0.9). So a `poolpipe node` keeps a feed:
a shared-memory region registered with its Triton (system shared memory, `FEED_REGION`),
filled over its watch port. The sending hop (or the router, for a batch's inputs) sends
the map with its call over one TCP connection (``C``: `FeedRegion` places it and calls
the model on the node's own Triton over HTTP, its inputs naming the region, offset and
size instead of carrying the bytes; Triton hands them to the model as any input); the
answer goes back on that connection and the place is free again. (``P`` and ``F``, a map
placed and the call made by the sender, are what senders before the ``C`` message use.)

On a connection to the watch port (watch.py) the sender first writes FEED_MAGIC; then
messages, each one byte of kind and fixed fields (big-endian):

- ``P`` size (u64), then size bytes: place them. The reply: offset (u64) and a ticket
  (u64), or NO_ROOM and 0 where the region has no room (the bytes are read and dropped;
  the sender sends the map inline instead).
- ``F`` offset (u64), ticket (u64): that place is free again. No reply. A free whose ticket
  is not the place's is ignored, so that nobody frees a place they did not get.
- ``T``: the node's CLOCK_MONOTONIC now (u64 ns), answered at once: the router times the
  round trip and so knows the node's clock against its own (router/clocks.py), to tell a
  chain's hop when its transfer is reserved on the node's clock. A node without a feed
  answers ``T`` too (and closes the connection at any other message).
- ``C`` size (u64), then size bytes, then a length (u32) and that many bytes of JSON,
  {"model": name, "request": a KServe v2 request header whose inputs name where they lie
  in those bytes (``shared_memory_offset`` from their start, ``shared_memory_byte_size``)}:
  place them and call the model on the node's own Triton (`FeedRegion.triton`, its HTTP
  address) with the inputs at their places; the reply is Triton's HTTP answer as it came,
  and the place is free again once it has come. Without room the bytes go to Triton
  inline. One message instead of ``P``, its reply, an HTTP call and ``F``: a hop's map
  crosses the links once, with nothing small behind it that waits in a queue of other
  transfers' bytes (a reply on the way back, a call's head on the way there each waited up
  to 90 ms at D = 20 on emulated hc2-small behind maps the links carried).

A place not freed within FEED_HOLD_S (a sender that died) is freed when room is needed.
The region's file is removed once Triton has it mapped: nothing is left in /dev/shm when
the node dies, however it dies.
"""

from __future__ import annotations

import bisect
import contextlib
import json
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
_U32 = struct.Struct(">I")
CALL_HEADER_MAX = 1 << 20  # a call's JSON is refused beyond this many bytes
CALL_TIMEOUT_S = 60.0  # a call on the node's own Triton (a hop's timeout)


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
        self.called = 0  # calls made on the node's Triton for a ``C`` message
        self.triton: str | None = None  # host:port of the node's Triton over HTTP (``C``)

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
        local = _Local(self.triton)
        try:
            while True:
                kind = conn.recv(1)
                if not kind:
                    return
                if kind == b"C":
                    conn.sendall(self._call(conn, local))
                    continue
                if kind == b"T":
                    answer_time(conn)
                    continue
                self._serve_one(conn, kind, view)
        finally:
            local.close()

    def _serve_one(self, conn: socket.socket, kind: bytes, view: memoryview) -> None:
        if kind == b"P":
            (n,) = _U64.unpack(_recv_exactly(conn, 8))
            got = self.space.place(n) if 0 < n <= self.space.size else None
            if got is None:
                self.refused += 1
                _drop(conn, n)
                conn.sendall(_PLACED.pack(NO_ROOM, 0))
                return
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
            raise FeedError(f"a feed message of kind {kind!r}: expected P, F, C or T")

    def _call(self, conn: socket.socket, local: _Local) -> bytes:
        """A ``C`` message (its kind read): Triton's HTTP answer to the call, or an error
        answer of this node's own (502: no Triton to call, or it failed; 400: a bad
        message; 413: more bytes than the region holds, read and dropped)."""
        (n,) = _U64.unpack(_recv_exactly(conn, 8))
        if not 0 < n <= self.space.size:
            _drop(conn, n)
            (k,) = _U32.unpack(_recv_exactly(conn, 4))
            _drop(conn, k)
            return _error(413, f"a call with {n} bytes of inputs; the feed holds {self.space.size}")
        got = self.space.place(n)
        try:
            if got is None:  # no room: the bytes go to Triton inline
                self.refused += 1
                inline = bytearray(n)
                _recv_into(conn, memoryview(inline))
                data = memoryview(inline)
            else:
                _recv_into(conn, self.view[got[0] : got[0] + n])
                self.placed += 1
                data = self.view[got[0] : got[0] + n]
            (k,) = _U32.unpack(_recv_exactly(conn, 4))
            if k > CALL_HEADER_MAX:
                _drop(conn, k)
                return _error(400, f"a call's header of {k} bytes (at most {CALL_HEADER_MAX})")
            text = _recv_exactly(conn, k)
            try:
                model, head, parts, trace = _request(text, n, None if got is None else got[0], data)
            except (ValueError, KeyError, TypeError) as exc:
                return _error(400, f"a malformed call: {exc}")
            if self.triton is None:
                return _error(502, "this feed calls no Triton")
            self.called += 1
            try:
                return local.exchange(model, head, parts, trace)
            except OSError as exc:
                return _error(502, f"the node's Triton at {self.triton}: {exc}")
        finally:
            if got is not None:
                self.space.free(*got)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def answer_time(conn: socket.socket) -> None:
    """A ``T`` message (its kind read): this host's CLOCK_MONOTONIC, now."""
    conn.sendall(_U64.pack(time.monotonic_ns()))


def serve_time_only(conn: socket.socket) -> None:
    """A feed's connection to a node without a feed: ``T`` answered, anything else ends
    it (the sender sends its maps inline)."""
    while conn.recv(1) == b"T":
        answer_time(conn)


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


def _request(
    text: bytes, n: int, base: int | None, data: memoryview
) -> tuple[str, bytes, list[memoryview], str | None]:
    """(model, the HTTP request's JSON header, its binary parts, its traceparent) of a
    ``C`` message's JSON: its inputs at `base` + their offsets in the region, or (`base`
    None: no room) inline from `data`."""
    call = json.loads(text)
    model, request = str(call["model"]), call["request"]
    if not model or "/" in model or any(c.isspace() for c in model):
        raise ValueError(f"model {model!r}")
    trace = call.get("traceparent")
    if trace is not None and (not isinstance(trace, str) or not trace.isprintable()):
        raise ValueError(f"traceparent {trace!r}")
    parts: list[memoryview] = []
    for spec in request["inputs"]:
        where = spec["parameters"]
        offset, size = int(where["shared_memory_offset"]), int(where["shared_memory_byte_size"])
        if offset < 0 or size < 0 or offset + size > n:
            raise ValueError(f"input {spec.get('name')!r} at {offset}+{size}, beyond {n} bytes")
        if base is None:
            spec["parameters"] = {"binary_data_size": size}
            parts.append(data[offset : offset + size])
        else:
            where["shared_memory_region"] = FEED_REGION
            where["shared_memory_offset"] = base + offset
    return model, json.dumps(request, separators=(",", ":")).encode(), parts, trace


def _error(status: int, why: str) -> bytes:
    """An HTTP answer of this feed's own: `status` with a KServe error."""
    body = json.dumps({"error": why}).encode()
    reason = {400: "Bad Request", 413: "Payload Too Large", 502: "Bad Gateway"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Local:
    """Calls on the node's own Triton (`address`: host:port over HTTP) for one feed
    connection, on a kept-alive connection of its own."""

    def __init__(self, address: str | None):
        self.address = address
        self.sock: socket.socket | None = None

    def exchange(
        self, model: str, text: bytes, parts: list[memoryview], trace: str | None = None
    ) -> bytes:
        """Triton's whole HTTP answer (head and body) to `model`'s infer call (with a
        `trace` context where given)."""
        assert self.address is not None
        traced = "" if trace is None else f"traceparent: {trace}\r\n"
        head = (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.address}\r\n{traced}"
            "Content-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(text)}\r\n"
            f"Content-Length: {len(text) + sum(len(p) for p in parts)}\r\n\r\n"
        ).encode() + text
        for fresh in (self.sock is None, True):
            if fresh:
                self.close()
                host, _, port = self.address.rpartition(":")
                self.sock = socket.create_connection((host.strip("[]"), int(port)), 10)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock.settimeout(CALL_TIMEOUT_S)
            assert self.sock is not None
            try:
                try:
                    self.sock.sendall(head)
                    for p in parts:
                        self.sock.sendall(p)
                except OSError as exc:
                    raise _Closed(str(exc)) from None
                answer, close = http_answer(self.sock)
            except _Closed:
                self.close()
                if fresh:
                    raise
                continue  # Triton closed the kept connection while idle: once more anew
            except OSError:
                self.close()
                raise
            if close:
                self.close()
            return answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _Closed(OSError):
    """A kept connection closed before any byte of the answer came."""


def http_answer(sock: socket.socket) -> tuple[bytes, bool]:
    """An HTTP answer read whole from `sock` (head and body, as it came), and whether it
    closes the connection; _Closed where it closed before any byte of it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise (
                _Closed("closed before answering")
                if not buf
                else FeedError("Triton closed the connection in its answer's head")
            )
        buf += chunk
    raw, _, rest = buf.partition(b"\r\n\r\n")
    need, close = 0, False
    for line in raw.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            need = int(v)
        elif k == b"connection":
            close = v.strip().lower() == b"close"
    body = bytearray(need)
    got = min(len(rest), need)
    body[:got] = rest[:got]
    if got < need:
        _recv_into(sock, memoryview(body)[got:])
    return raw + b"\r\n\r\n" + bytes(body), close
