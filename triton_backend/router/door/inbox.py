"""The router process's end of the door (model.py runs the other end inside the
router's Triton): a Unix socket served on the router's event loop. Each frame from a door
instance is one client request; it goes to RouterCore.take on the spot, and the answer goes
back down the same connection when the runtime gives it. A request stamped by a load
balancer (ARRIVAL_STAMP, forwarded by the router's Triton) counts from that stamp where it
is plausible (poolpipe.runtime.stamps), from the stub's arrival otherwise; a client's own
deadline (CLIENT_TIMEOUT, the time it had left) counts from the same moment. Requests to
`poolpipe_control` run their command on a worker thread (a rollout blocks until it is done).

The frames are model.py's, named the same here (the stub imports nothing of ours, so
each side names the plain tuples that travel). A door instance's ring (model.py) is mapped
read-only here when its hello names one, and its file removed: a request's arrays in it are
read where they lie, until its answer tells the stub that the region is free again."""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import pickle
import struct
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from poolpipe.client.control import CONTROL_MODEL
from poolpipe.runtime import (
    ARRIVAL_STAMP,
    CLIENT_TIMEOUT,
    BadRequest,
    Unservable,
    client_timeout_us,
    forwarded_header,
)
from triton_backend.router.core import BAD_REQUEST_MARKER, REFUSED_MARKER, RouterCore
from triton_backend.router.served import Reply
from triton_backend.router.tracing import RequestTrace, Tracing

_LEN = struct.Struct("<I")
log = logging.getLogger(__name__)


class HelloFrame(NamedTuple):  # model.py's, from the stub once per connection
    kind: str
    model: str
    instance: str
    ring: str  # the ring's file ("": none)
    ring_bytes: int


class RequestFrame(NamedTuple):  # model.py's, per client request
    kind: str
    rid: int
    arrived_ns: int  # CLOCK_MONOTONIC
    parameters: str | bytes | None  # the request's parameters, a JSON object
    arrays: list
    egress_ns: list[int]  # of the stub's answers since its last request
    nonfinite: bool  # a NaN or an infinite value among its floating-point inputs


RING_RID = -1  # an answer to the hello: the ring mapped (no code) or not


class AnswerFrame(NamedTuple):  # model.py's, to the stub per request (and to a hello)
    kind: str
    rid: int
    sent_ns: int
    arrays: list | None
    code: str | None
    message: str


def _frame(obj: tuple) -> bytes:  # model.py's framing
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


# An array in a frame: (dtype, shape, bytes), (dtype, shape, offset in the door's ring), or
# the array itself for object dtypes.
Packed = tuple[str, tuple[int, ...], bytes | int] | np.ndarray


def _pack(arrays: list[np.ndarray]) -> list[Packed]:
    """Arrays as model.py frames them: (dtype, shape, bytes); numpy's own pickling
    cost 15-45 µs per array on the test machine, this 2-3."""
    return [a if a.dtype.hasobject else (a.dtype.str, a.shape, a.tobytes()) for a in arrays]


def _unpack(
    packed: list[Packed], ring: mmap.mmap | None = None
) -> tuple[list[np.ndarray], bool]:
    """The arrays of a frame, those in the ring read where they lie (read-only), and
    whether any was there."""
    out = []
    in_ring = False
    for p in packed:
        if isinstance(p, np.ndarray):
            out.append(p)
        elif isinstance(p[2], int):
            if ring is None:
                raise ValueError("an array in a ring the door did not name")
            dtype = np.dtype(p[0])
            out.append(np.frombuffer(ring, dtype, int(np.prod(p[1])), p[2]).reshape(p[1]))
            in_ring = True
        else:
            out.append(np.frombuffer(p[2], p[0]).reshape(p[1]))
    return out, in_ring


def map_ring(path: str, size: int) -> mmap.mmap:
    """A door instance's ring, mapped read-only; its file is removed (the mappings keep it
    while either side lives)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != size or size <= 0:
            raise ValueError(f"{path}: not a ring of {size} bytes")
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        os.unlink(path)


class _Connection(asyncio.Protocol):
    """One door instance (a Python-backend stub process)."""

    def __init__(self, door: Door):
        self.door = door
        self.model = ""
        self.ring: mmap.mmap | None = None  # the instance's ring, where it has one
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.ring = None  # unmapped when the last array in it is gone

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        at = 0
        size = _LEN.size
        while len(buf) - at >= size:
            (n,) = _LEN.unpack_from(buf, at)
            if len(buf) - at - size < n:
                break
            msg = pickle.loads(memoryview(buf)[at + size : at + size + n])
            at += size + n
            try:
                self.door.handle(self, msg)
            except Exception:  # a bug of ours must not take the door down
                log.exception("the router's door could not handle a request")
        del buf[:at]

    def answer(self, rid: int, outs: list[np.ndarray] | None, code: str | None, msg: str) -> None:
        if self.transport is not None:
            packed = None if outs is None else _pack(outs)
            frame = AnswerFrame("ans", rid, time.monotonic_ns(), packed, code, msg)
            self.transport.write(_frame(tuple(frame)))


class Door:
    """Serves the door's socket at `path` on the core's loop."""

    def __init__(self, core: RouterCore, path: Path, control: Callable[[dict], dict] | None = None):
        self.core = core
        self.path = path
        self.control = control
        self._server: asyncio.AbstractServer | None = None
        # requests whose inputs came through a door's ring / down its socket
        self.handovers: Counter[str] = Counter()
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="poolpipe-control")

    def open(self) -> Door:
        async def serve() -> asyncio.AbstractServer:
            loop = asyncio.get_running_loop()
            return await loop.create_unix_server(lambda: _Connection(self), str(self.path))

        self._server = asyncio.run_coroutine_threadsafe(serve(), self.core.loop).result(10)
        self.path.chmod(0o600)
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None and self.core.loop.is_running():

            async def shut() -> None:
                server.close()
                await server.wait_closed()

            try:
                asyncio.run_coroutine_threadsafe(shut(), self.core.loop).result(5)
            except Exception:  # the connections go with the router's Triton anyway
                server.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests

    def handle(self, conn: _Connection, msg: tuple) -> None:
        if msg[0] == "hello":
            hello = HelloFrame._make(msg)
            conn.model = hello.model
            if hello.ring:  # the stub puts inputs there once told it is mapped
                try:
                    conn.ring = map_ring(hello.ring, hello.ring_bytes)
                    conn.answer(RING_RID, None, None, "")
                except (OSError, ValueError) as exc:  # its requests come by the socket
                    log.warning("the door of %s takes inputs by its socket: %s", hello.model, exc)
                    conn.answer(RING_RID, None, "UNAVAILABLE", str(exc))
            return
        req = RequestFrame._make(msg)
        rid = req.rid
        try:
            arrays, in_ring = _unpack(req.arrays, conn.ring)
        except ValueError as exc:
            conn.answer(rid, None, "INTERNAL", f"the door: {exc}")
            return
        self.handovers["ring" if in_ring else "socket"] += 1
        if conn.model == CONTROL_MODEL:
            self._control(conn, rid, arrays)
            return
        core = self.core
        now = time.monotonic_ns()
        core.observe_door(now - req.arrived_ns, req.egress_ns)
        tracing = core.tracing
        params: dict = {}
        arrived = req.arrived_ns
        try:
            params = _parameters(req.parameters)
            deadline = None
            if params:
                stamp = forwarded_header(params, ARRIVAL_STAMP)
                if stamp is not None:  # the balancer's: where a burst waited counts too
                    at = core.stamps.arrival_ns(stamp, time.time_ns(), now)
                    arrived = arrived if at is None else at
                left = forwarded_header(params, CLIENT_TIMEOUT)
                if left is not None:  # the client's own deadline, from the same moment
                    deadline = arrived + int(client_timeout_us(left) * 1e3)
            if req.nonfinite:  # (found by the stub, off this loop)
                core.nonfinite[conn.model] += 1
            reply = lambda outs, code, text: conn.answer(rid, outs, code, text)  # noqa: E731
            trace = None
            if tracing is not None and core.traces(conn.model):
                rows = int(arrays[0].shape[0]) if arrays and arrays[0].ndim else 0
                trace = tracing.begin(conn.model, rows, core.clock.at(arrived), params)
                reply = _traced(reply, tracing, trace)
            core.take(conn.model, arrays, params.get("slo_ms"), arrived, reply, deadline, trace)
        except BadRequest as exc:
            self._refuse(conn, rid, arrived, params, "INVALID_ARG", f"{BAD_REQUEST_MARKER}: {exc}")
        except Unservable as exc:  # the server's condition: 503, counted as refused
            self._refuse(conn, rid, arrived, params, "UNAVAILABLE", f"{REFUSED_MARKER}: {exc}")

    def _refuse(
        self, conn: _Connection, rid: int, arrived_ns: int, params: dict, code: str, text: str
    ) -> None:
        conn.answer(rid, None, code, text)
        tracing = self.core.tracing
        if tracing is not None:
            tracing.refused(conn.model, self.core.clock.at(arrived_ns), params, code, text)

    def _control(self, conn: _Connection, rid: int, arrays: list[np.ndarray]) -> None:
        handle = self.control
        if handle is None:
            conn.answer(rid, None, "UNAVAILABLE", "this router takes no control commands")
            return
        loop = self.core.loop

        def run() -> None:
            try:
                raw = np.asarray(arrays[0]).reshape(-1)[0]
                cmd = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
                result: Any = handle(cmd)
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            out = np.array([json.dumps(result).encode()], dtype=object)
            loop.call_soon_threadsafe(conn.answer, rid, [out], None, "")

        self._workers.submit(run)


def _traced(reply: Reply, tracing: Tracing, trace: RequestTrace) -> Reply:
    """`reply`, then the request's trace ends (its answer has left the router)."""

    def answer(outs: list[np.ndarray] | None, code: str | None, text: str) -> None:
        reply(outs, code, text)
        tracing.answered(trace, code, text)

    return answer


def _parameters(raw: object) -> dict:
    """A request's parameters as the backend hands them over (a JSON object string)."""
    if not raw or raw == "{}":  # (what a request without parameters brings)
        return {}
    try:
        params = json.loads(raw) if isinstance(raw, str | bytes) else dict(raw)  # type: ignore[call-overload]
    except ValueError:
        raise BadRequest("the request's parameters are not a JSON object") from None
    if not isinstance(params, dict):
        raise BadRequest("the request's parameters are not a JSON object")
    return params
