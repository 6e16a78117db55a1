"""Where a chain's answer comes back: straight from its last node to the router.

Along a chain, each node's call waits for the next node's; an answer returned the same way
crossed every earlier node's NIC twice (down, then up) where nothing had reserved it: on
emulated hc2-small, colorization's 2 MB answers came back over the one L4 server's
downlink into the googlenet inputs reserved there, and took three transfers instead of
one. So the last node sends the model's outputs to the router's inbox, a plain TCP
listener on the router's loop; the calls back along the chain carry only the hops' times.

An answer is one message: a 4-byte big-endian length, a JSON header {"id", "rows": [start,
end, sent ns of every hop], "tensors": [[name, numpy dtype, shape], ...]}, then the
tensors' bytes in order (python_onnx_model.py writes it). Its id is the one the router put
in the chain's last (signed) entry, random and used once: an answer nobody waits for is
counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import struct
from dataclasses import dataclass

import numpy as np

from poolpipe.errors import PoolpipeError

log = logging.getLogger("poolpipe.router")

HEADER = struct.Struct(">I")
MAX_HEADER = 1 << 20  # a header larger than this is not an answer: the connection is closed


@dataclass(frozen=True)
class Answer:
    rows: list[int]  # (start, end, sent) ns per hop, each on its own node's clock
    tensors: dict[str, np.ndarray]


def parse_address(text: str) -> tuple[str, int]:
    """ "HOST:PORT" (PORT 0: any free port) -> (host, port), or a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise PoolpipeError(
            f"chain answers address {text!r} is not HOST:PORT (for example 10.0.0.5:8200, or "
            "0.0.0.0:0 for any free port); or give 'auto' or 'back'"
        )
    return host.strip("[]"), int(port)


def route_source(host: str) -> str:
    """The address of this host that packets to `host` leave from (the routing table's
    choice; nothing is sent): where a node on `host`'s network reaches this router."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


class AnswerInbox:
    """The router's listener for chains' answers, on its event loop. `address`: "HOST:PORT"
    to listen on (PORT 0: any free one; the host nodes reach it by unless it is 0.0.0.0,
    where each node is told the address its host routes to it from); started on first use."""

    def __init__(self, address: str = "0.0.0.0:0"):
        self.host, self.port = parse_address(address)
        self._server: asyncio.AbstractServer | None = None
        self._waiting: dict[str, asyncio.Future[Answer]] = {}
        self._routes: dict[str, str] = {}
        self._writers: set[asyncio.StreamWriter] = set()  # one per node's connection
        self._closing = False
        self.unexpected = 0  # answers no chain waited for (late, or not ours)
        self.received = 0

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]

    def address_for(self, node: str) -> str:
        """Where the node at `node` ("host:port") sends answers."""
        if self.host not in ("0.0.0.0", ""):
            return f"{self.host}:{self.port}"
        host = node.rpartition(":")[0].strip("[]") or node
        if host not in self._routes:
            self._routes[host] = route_source(socket.gethostbyname(host))
        return f"{self._routes[host]}:{self.port}"

    def expect(self) -> tuple[str, asyncio.Future[Answer]]:
        """A new answer id and the future its answer resolves (forget it when done)."""
        key = secrets.token_hex(16)
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        return key, fut

    def forget(self, key: str) -> None:
        fut = self._waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                except asyncio.IncompleteReadError:
                    return  # the node closed the connection
                if size > MAX_HEADER:
                    log.warning("chain answers: a header of %d bytes; connection closed", size)
                    return
                head = json.loads(await reader.readexactly(size))
                tensors = {}
                for name, dtype, shape in head["tensors"]:
                    dt = np.dtype(dtype)
                    count = int(np.prod(shape, dtype=np.int64))
                    data = await reader.readexactly(count * dt.itemsize)
                    tensors[name] = np.frombuffer(data, dt).reshape(shape)
                self._deliver(str(head["id"]), Answer([int(x) for x in head["rows"]], tensors))
        except (OSError, ValueError, KeyError, TypeError, asyncio.IncompleteReadError) as exc:
            if not self._closing:  # (not the inbox closing under it)
                log.warning("chain answers: a malformed answer (%s); connection closed", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    def _deliver(self, key: str, answer: Answer) -> None:
        fut = self._waiting.pop(key, None)
        if fut is None or fut.done():
            self.unexpected += 1
            return
        self.received += 1
        fut.set_result(answer)

    async def close(self) -> None:
        for key in list(self._waiting):
            self.forget(key)
        if self._server is not None:
            self._closing = True
            self._server.close()
            for writer in list(self._writers):  # the nodes' connections, still open: their
                writer.close()  # readers end as at a node's close, nothing cancelled
            for _ in range(100):
                if not self._writers:
                    break
                await asyncio.sleep(0.01)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
