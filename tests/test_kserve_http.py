"""The router's KServe v2 HTTP stage client (triton_backend/router/kserve_http.py) on real loopback
sockets. The round trip against real tritonserver nodes is in test_serving.py (every stage
call of the router goes this way there); here a small HTTP server in the test process plays
a node for what a Triton node does only when it fails or idles: an error answer, a kept-
alive connection it closes, a call it never answers, a port nobody listens on."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest

from triton_backend.router.kserve_http import HttpStage, HttpStages
from triton_backend.router.stages import StageCall, StageCallError, StageTimeout, StageUnreachable
from triton_backend.router.timers import precise_event_loop


class Node:
    """Answers POST /v2/models/<m>/infer: model "echo" returns its inputs as out_0, out_1,
    ...; "broken" answers 400 with a KServe error; "silent" never answers. `close_after`:
    closes each connection after that many answers (a node's keep-alive running out)."""

    def __init__(self, close_after: int | None = None, feed=None):
        self.close_after = close_after
        self.connections = 0
        self.feed = feed  # its feed's region (node/feed.py), as Triton maps it

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path = line.split()[:2]
                headers = {}
                while (h := await reader.readline()) != b"\r\n":
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                if method == b"GET":  # live; of the models, "echo" alone is ready
                    ok = path in (b"/v2/health/live", b"/v2/models/echo/ready")
                    status = "200 OK" if ok else "400 Bad Request"
                    writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode())
                    await writer.drain()
                    continue
                model = path.decode().split("/")[3]
                body = await reader.readexactly(int(headers["content-length"]))
                if model == "silent":
                    await asyncio.sleep(3600)
                if model == "broken":
                    status, head = "400 Bad Request", b""
                    payload = json.dumps({"error": "in_0: unexpected shape"}).encode()
                else:
                    status = "200 OK"
                    size = int(headers["inference-header-content-length"])
                    head, blobs = self.echo(body, size, self.feed)
                    payload = head + blobs
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/octet-stream\r\n"
                    f"Inference-Header-Content-Length: {len(head) or len(payload)}\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                answered += 1
                if self.close_after is not None and answered >= self.close_after:
                    return
        finally:
            writer.close()

    @staticmethod
    def echo(body: bytes, size: int, feed=None) -> tuple[bytes, bytes]:
        """The answer's JSON header and binary part: each input back as out_k (read from
        the feed's region where the input names a place in it), and the request's
        parameters (less binary_data_output) as `params`, a UINT8 tensor of their JSON; only
        the outputs the request names, when it names some."""
        meta = json.loads(body[:size])
        answer, offset = [], size
        for k, t in enumerate(meta["inputs"]):
            where = t["parameters"]
            if "shared_memory_region" in where:
                at, n = where["shared_memory_offset"], where["shared_memory_byte_size"]
                data = bytes(feed.view[at : at + n])
            else:
                n = where["binary_data_size"]
                data = body[offset : offset + n]
                offset += n
            answer.append((f"out_{k}", t["datatype"], t["shape"], data))
        params = {k: v for k, v in meta["parameters"].items() if k != "binary_data_output"}
        text = json.dumps(params).encode()
        answer.append(("params", "UINT8", [len(text)], text))
        wanted = [o["name"] for o in meta.get("outputs", [])] or [a[0] for a in answer]
        outputs = [
            {"name": n, "datatype": d, "shape": sh, "parameters": {"binary_data_size": len(b)}}
            for n, d, sh, b in answer
            if n in wanted
        ]
        blobs = b"".join(b for n, _, _, b in answer if n in wanted)
        return json.dumps({"model_name": "echo", "outputs": outputs}).encode(), blobs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_tensors_go_and_come_back_whole():
    async def main():
        node = Node()
        stage = HttpStage(asyncio.get_running_loop(), await node.start())
        x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        h = np.linspace(0, 1, 10, dtype=np.float16).reshape(1, 10)
        # one kept-alive connection for every call; shapes that come again reuse their
        # request head and answer layout, other values and shapes still come back whole
        for i, xi in enumerate([x[:, 1:], x[:, 1:] + 1, x, x[:1] * 2, x[:, 1:] - 3]):
            out = await stage.infer(StageCall("echo", [("x", xi), ("h", h * i)], 5))
            assert out["out_0"].dtype == np.float32 and np.array_equal(out["out_0"], xi)
            assert out["out_1"].dtype == np.float16 and np.array_equal(out["out_1"], h * i)
        assert node.connections == 1
        stage.close()

    run(main())


def test_a_call_carries_its_parameters_and_gets_the_outputs_it_names():
    # (a chain's first call: its path and budget as parameters, two outputs named)
    async def main():
        stage = HttpStage(asyncio.get_running_loop(), await Node().start())
        x = np.arange(4, dtype=np.float32)
        params = {"poolpipe_next": "[]", "poolpipe_budget_us": "900"}
        out = await stage.infer(StageCall("echo", [("x", x)], 5, params, ["params", "out_0"]))
        assert sorted(out) == ["out_0", "params"] and out["out_0"].tolist() == x.tolist()
        assert json.loads(out["params"].tobytes()) == params
        assert (await stage.infer(StageCall("echo", [("x", x)], 5))).keys() >= {"out_0"}

    run(main())


def test_node_checks_ask_for_liveness_and_each_models_readiness():
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"

    async def main():
        loop = asyncio.get_running_loop()
        stages = HttpStages(loop, {"n": await Node().start(), "gone": nobody})
        assert await stages.ready("n", ["echo"]) == (True, True)
        assert await stages.ready("n", ["echo", "other"]) == (True, False)  # live, not ready
        assert await stages.ready("gone", ["echo"]) == (False, False)
        out = await stages.infer("n", StageCall("echo", [("x", np.ones(2, np.float32))], 5))
        assert out["out_0"].tolist() == [1.0, 1.0]
        await stages.close()

    run(main())


def test_an_error_answer_is_a_stage_error_with_the_nodes_message():
    async def main():
        stage = HttpStage(asyncio.get_running_loop(), await Node().start())
        with pytest.raises(StageCallError, match=r"^in_0: unexpected shape$"):
            await stage.infer(StageCall("broken", [("x", np.zeros(2, np.float32))], 5))
        # and the connection serves the next call
        out = await stage.infer(StageCall("echo", [("x", np.ones(2, np.float32))], 5))
        assert out["out_0"].tolist() == [1.0, 1.0]

    run(main())


def test_a_connection_the_node_closed_while_idle_is_replaced():
    async def main():
        node = Node(close_after=1)
        stage = HttpStage(asyncio.get_running_loop(), await node.start())
        for i in range(3):
            await asyncio.sleep(0.05)  # the node's close reaches us, or not yet: both work
            out = await stage.infer(StageCall("echo", [("x", np.full(3, i, np.int64))], 5))
            assert out["out_0"].tolist() == [i, i, i]
        assert node.connections == 3

    run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "router"])
def test_a_call_without_an_answer_fails_after_the_timeout(loop_kind):
    # on the router's loop the timeout is libuv's own (millisecond) timer
    async def main():
        stage = HttpStage(asyncio.get_running_loop(), await Node().start())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StageTimeout, match=r"no answer from 127\.0\.0\.1:\d+ in 0\.3 s"):
            await stage.infer(StageCall("silent", [("x", np.zeros(1, np.float32))], 0.3))
        assert 0.25 < loop.time() - t0 < 2.0
        out = await stage.infer(
            StageCall("echo", [("x", np.ones(1, np.float32))], 5)
        )  # a new connection
        assert out["out_0"].tolist() == [1.0]

    if loop_kind == "asyncio":
        run(main())
    else:
        loop = precise_event_loop()
        try:
            loop.run_until_complete(asyncio.wait_for(main(), 30))
        finally:
            loop.close()


def test_a_node_nobody_listens_for_cannot_be_reached():
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        stage = HttpStage(asyncio.get_running_loop(), f"127.0.0.1:{port}")
        with pytest.raises(StageUnreachable, match=rf"cannot reach 127\.0\.0\.1:{port}"):
            await stage.infer(StageCall("echo", [("x", np.zeros(1, np.float32))], 5))

    run(main())


def test_large_inputs_go_through_the_nodes_feed_and_inline_where_it_fails():
    """Inputs of FEED_MIN_BYTES or more go with their call to the node's feed (a real one:
    its region and watch port), which places them and calls the node (here the test's)
    with their places, freed when its answer is back; small ones go inline; a feed nobody
    serves is left alone and the inputs go inline."""
    from triton_backend.node.feed import FeedRegion
    from triton_backend.node.watch import NodeWatch
    from triton_backend.router.kserve_http import FEED_MIN_BYTES, Feed

    region = FeedRegion(1)
    watch = NodeWatch("127.0.0.1", 0, region)
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]

    async def main():
        loop = asyncio.get_running_loop()
        stage = HttpStage(loop, await Node(feed=region).start())
        region.triton = stage.address  # the feed calls "its Triton": the test's node
        feed, gone = Feed(loop, watch.url), Feed(loop, f"127.0.0.1:{nobody}")
        big = np.arange(FEED_MIN_BYTES // 4 + 3, dtype=np.float32).reshape(1, -1)
        small = np.ones((2, 3), np.float16)
        for k in range(3):
            out = await stage.infer(StageCall("echo", [("x", big + k), ("s", small)], 5), feed)
            assert np.array_equal(out["out_0"], big + k) and np.array_equal(out["out_1"], small)
        assert (feed.placed, feed.inline, region.placed, region.called) == (3, 0, 3, 3)
        assert region.space.in_use == 0
        out = await stage.infer(StageCall("echo", [("s", small)], 5), feed)  # small: inline
        assert np.array_equal(out["out_0"], small) and feed.placed == 3
        for _ in range(2):  # nobody there: inline, and not tried again at once
            out = await stage.infer(StageCall("echo", [("x", big)], 5), gone)
            assert np.array_equal(out["out_0"], big)
        assert (gone.placed, gone.inline) == (0, 2)
        stage.close()
        feed.close()

    try:
        run(main())
    finally:
        watch.close()
        region.close()
