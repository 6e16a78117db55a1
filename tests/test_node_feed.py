"""A node's feed (triton_backend/node/feed.py): feature maps written into shared memory
registered with the node's Triton, over its watch port, and read by its model as inputs."""

from __future__ import annotations

import contextlib
import socket
import struct
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
