"""A node's feed (triton_backend/node/feed.py): feature maps written into shared memory
registered with the node's Triton, over its watch port, and read by its model as inputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from poolpipe.client.control import node_headers, node_key
from triton_backend.node.feed import (
    FEED_ALIGN,
    FEED_MAGIC,
    FEED_REGION,
    NO_ROOM,
    FeedRegion,
    FeedSpace,
)
from triton_backend.node.watch import NodeWatch

# a batched Python-backend model that answers its input as it got it
ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "in_0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "out" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "in_0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("out", x.copy())]))
        return out
"""


def test_places_are_first_fit_aligned_merged_again_and_freed_only_with_their_ticket():
    now = [0.0]
    space = FeedSpace(1024, hold_s=10.0, clock=lambda: now[0])
    a, ta = space.place(100)  # rounded up to FEED_ALIGN
    b, tb = space.place(64)
    c, tc = space.place(1)
    assert (a, b, c) == (0, 128, 192) and a % FEED_ALIGN == b % FEED_ALIGN == 0
    assert space.place(1024) is None  # no room
    assert not space.free(b, tb + 1)  # a wrong ticket frees nothing
    assert space.free(b, tb) and not space.free(b, tb)  # and a place is freed once
    assert space.place(64)[0] == 128  # first fit: the hole
    space.free(128, space.held[128][1])
    space.free(a, ta)
    space.free(c, tc)
    assert space.free_at == [0] and space.free_len == {0: 1024} and space.in_use == 0
    # a place never freed (its sender died) goes when room is needed after hold_s
    space.place(1024)
    now[0] = 5.0
    assert space.place(64) is None
    now[0] = 11.0
    assert space.place(64) == (0, space.held[0][1])


def _put(sock: socket.socket, data: bytes) -> tuple[int, int]:
    sock.sendall(b"P" + struct.pack(">Q", len(data)) + data)
    got = b""
    while len(got) < 16:
        chunk = sock.recv(16 - len(got))
        assert chunk, "the feed closed the connection"
        got += chunk
    return struct.unpack(">QQ", got)


@pytest.fixture
def node(tmp_path: Path):
    """A Triton node with the echo model, its management APIs restricted to a key, its feed
    registered with it, and a NodeWatch serving that feed."""
    from triton_backend.node.triton import TritonNode

    key = node_key("feed-test-token")
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    n = TritonNode("feed", "cpu-1t", repo, tmp_path, key=key).start()
    feed = watch = None
    try:
        import tritonclient.http as th

        with th.InferenceServerClient(n.http_url) as c:
            c.load_model("echo", headers=node_headers(key, grpc=False))
        feed = FeedRegion(1)
        with th.InferenceServerClient(n.http_url) as c:
            feed.register(c, node_headers(key, grpc=False))
        assert not Path(feed.path).exists()  # nothing left in /dev/shm, however it ends
        feed.triton = n.http_url
        watch = NodeWatch("127.0.0.1", 0, feed)
        yield n, feed, watch
    finally:
        if watch is not None:
            watch.close()
        n.stop()
        if feed is not None:
            feed.close()


def test_a_map_written_into_the_feed_reaches_the_model_and_the_watch_still_watches(node):
    import tritonclient.http as th

    n, feed, watch = node
    x = np.random.default_rng(3).standard_normal((2, 70_000)).astype(np.float32)
    watcher = socket.create_connection(("127.0.0.1", watch.port))
    sock = socket.create_connection(("127.0.0.1", watch.port))
    try:
        sock.sendall(FEED_MAGIC)
        offset, ticket = _put(sock, x.tobytes())
        assert offset != NO_ROOM and feed.placed == 1
        with th.InferenceServerClient(n.http_url) as c:
            i = th.InferInput("in_0", list(x.shape), "FP32")
            i.set_shared_memory(FEED_REGION, x.nbytes, offset)
            got = c.infer("echo", [i]).as_numpy("out")  # inference needs no key
        np.testing.assert_array_equal(got, x)
        sock.sendall(b"F" + struct.pack(">QQ", offset, ticket))
        # a map larger than the region: refused, its bytes read, the connection still good
        assert _put(sock, bytes((1 << 20) + 1)) == (NO_ROOM, 0) and feed.refused == 1
        assert _put(sock, b"x" * 100)[0] == 0  # the first place is free again
        # the watcher is held as before, the feed's connection is not one
        for _ in range(50):
            if watch.watchers == 1:
                break
            time.sleep(0.02)
        assert watch.watchers == 1
        # a message of no known kind ends the connection
        sock.sendall(b"Z")
        assert sock.recv(1) == b""
    finally:
        sock.close()
        watcher.close()
    # a node without a feed closes a feed's connection: the sender sends the map inline
    bare = NodeWatch("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", bare.port)) as s:
            s.sendall(FEED_MAGIC + b"P" + struct.pack(">Q", 4) + b"abcd")
            got = b"?"
            with contextlib.suppress(ConnectionResetError):  # (closed with bytes unread)
                got = s.recv(16)
            assert got in (b"", b"?")
    finally:
        bare.close()


def _call(
    sock: socket.socket, data: bytes, request: dict, model: str = "echo"
) -> tuple[int, bytes]:
    """A ``C`` message: (HTTP status, body) of the answer that comes back on `sock`."""
    text = json.dumps({"model": model, "request": request}).encode()
    sock.sendall(b"C" + struct.pack(">Q", len(data)) + data + struct.pack(">I", len(text)) + text)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the feed closed the connection"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    need = next(
        int(v)
        for k, _, v in (h.partition(b":") for h in lines[1:])
        if k.lower() == b"content-length"
    )
    while len(body) < need:
        body += sock.recv(need - len(body))
    return int(lines[0].split()[1]), body


def _echo_request(x: np.ndarray, offset: int = 0) -> dict:
    return {
        "inputs": [
            {
                "name": "in_0",
                "shape": list(x.shape),
                "datatype": "FP32",
                "parameters": {"shared_memory_offset": offset, "shared_memory_byte_size": x.nbytes},
            }
        ],
        "outputs": [{"name": "out", "parameters": {"binary_data": False}}],
    }


def test_a_call_with_its_map_is_made_on_the_nodes_triton_and_its_place_freed(node):
    """A ``C`` message: the map placed, the model called on the node's own Triton with it,
    Triton's answer back on the same connection, the place free again; without room the
    map goes to Triton inline; a bad call, or a feed with no Triton, is answered with an
    error and the connection still serves."""
    _, feed, watch = node
    x = np.random.default_rng(4).standard_normal((2, 3_000)).astype(np.float32)
    sock = socket.create_connection(("127.0.0.1", watch.port))
    try:
        sock.sendall(FEED_MAGIC)
        for k in range(3):  # on one kept connection, each call's place free again after it
            status, body = _call(sock, (x + k).tobytes(), _echo_request(x))
            assert status == 200, body
            got = np.array(json.loads(body)["outputs"][0]["data"], np.float32).reshape(x.shape)
            np.testing.assert_array_equal(got, x + k)
        assert (feed.called, feed.placed, feed.space.in_use) == (3, 3, 0)
        # a map after 64 bytes of padding: the input names where it lies
        status, body = _call(sock, bytes(64) + x.tobytes(), _echo_request(x, 64))
        assert status == 200 and json.loads(body)["outputs"][0]["data"][:2] == x[0, :2].tolist()
        # no room: the bytes go inline and the call is answered as before
        hold = feed.space.place(feed.space.size - 1024)
        status, body = _call(sock, x.tobytes(), _echo_request(x))
        assert status == 200 and feed.refused == 1, body
        feed.space.free(*hold)
        # an input beyond the bytes sent, a model name that is no name: 400, nothing held
        status, body = _call(sock, x.tobytes(), _echo_request(x, 8))
        assert status == 400 and "beyond" in json.loads(body)["error"]
        status, body = _call(sock, x.tobytes(), _echo_request(x), model="../echo")
        assert status == 400 and "model" in json.loads(body)["error"]
        # a model the node does not serve: Triton's own error, passed on
        status, body = _call(sock, x.tobytes(), _echo_request(x), model="nothere")
        assert status == 404 and "nothere" in json.loads(body)["error"]
        assert feed.space.in_use == 0
        # a feed that calls no Triton says so
        feed.triton, triton = None, feed.triton
        status, body = _call(sock, x.tobytes(), _echo_request(x))
        assert status == 502 and "no Triton" in json.loads(body)["error"]
        feed.triton = triton
        status, _ = _call(sock, x.tobytes(), _echo_request(x))
        assert status == 200 and feed.space.in_use == 0
    finally:
        sock.close()


def _node_time(sock: socket.socket) -> tuple[int, int, int]:
    t0 = time.monotonic_ns()
    sock.sendall(b"T")
    got = b""
    while len(got) < 8:
        chunk = sock.recv(8 - len(got))
        assert chunk, "the node closed the connection instead of telling its time"
        got += chunk
    return t0, struct.unpack(">Q", got)[0], time.monotonic_ns()


def test_a_node_tells_its_clock_with_a_feed_and_without_one(node):
    """``T``: the node's CLOCK_MONOTONIC, on the feed's connection between its other
    messages, and on a node with no feed, whose connection ends at any other message."""
    _, _, watch = node
    bare = NodeWatch("127.0.0.1", 0)
    try:
        for port in (watch.port, bare.port):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(FEED_MAGIC)
                for _ in range(3):  # one host, one clock: within the round trip
                    t0, theirs, t1 = _node_time(sock)
                    assert t0 <= theirs <= t1
                if port == watch.port:  # the feed serves on after it
                    assert _put(sock, b"x" * 100)[0] != NO_ROOM
                    assert t1 <= _node_time(sock)[1]
        with socket.create_connection(("127.0.0.1", bare.port)) as sock:
            sock.sendall(FEED_MAGIC + b"P")
            got = b"?"
            with contextlib.suppress(ConnectionResetError):
                got = sock.recv(8)
            assert got in (b"", b"?")
    finally:
        bare.close()


def test_the_routers_clocks_know_a_node_of_this_host_and_not_one_that_does_not_answer():
    """NodeClocks (triton_backend/router/clocks.py) against real watch ports: a node of
    this host is on the router's clock within half the best round trip; a node that closes
    the probe's connection (an older node) or refuses it has no offset (its hops are sent
    at "after_us" alone)."""
    from triton_backend.router.clocks import MAX_RTT_NS, NodeClocks

    watch = NodeWatch("127.0.0.1", 0)
    mute = socket.socket()  # accepts, reads the probe, closes
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    closed = socket.socket()  # a port nobody listens on
    closed.bind(("127.0.0.1", 0))

    def shut() -> None:
        while True:
            try:
                c, _ = mute.accept()
            except OSError:
                return
            c.recv(64)
            c.close()

    threading.Thread(target=shut, daemon=True).start()

    async def run() -> tuple:
        closing = asyncio.Event()
        clocks = NodeClocks(asyncio.get_running_loop(), closing, period_s=0.02)
        clocks.watch("here", f"127.0.0.1:{watch.port}")
        clocks.watch("here/gpu1", f"127.0.0.1:{watch.port}")  # a GPU of the same node
        clocks.watch("old", f"127.0.0.1:{mute.getsockname()[1]}")
        clocks.watch("gone", f"127.0.0.1:{closed.getsockname()[1]}")
        for _ in range(250):
            await asyncio.sleep(0.02)
            kept = clocks._samples.get(f"127.0.0.1:{watch.port}", ())
            if clocks.offset_ns("here") is not None and len(kept) >= 8:
                break
        got = (
            clocks.offset_ns("here"),
            clocks.round_trip_ns("here"),
            clocks.offset_ns("old"),
            clocks.offset_ns("gone"),
            clocks.node_time("gone", 5),
            clocks.offset_ns("here/gpu1") == clocks.offset_ns("here"),
            len(clocks._tasks),
        )
        closing.set()
        await asyncio.gather(*clocks._tasks.values())
        return got

    try:
        offset, rtt, old, gone, when, same, probes = asyncio.run(run())
    finally:
        watch.close()
        mute.close()
        closed.close()
    assert offset is not None and rtt is not None and rtt <= MAX_RTT_NS
    assert abs(offset) <= rtt // 2 + 1, (offset, rtt)
    assert (old, gone, when) == (None, None, None)
    assert same and probes == 3  # one node's GPUs: its probes
