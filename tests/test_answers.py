"""The router's inbox for chains' answers (triton_backend/router/answers.py), over a real loopback
socket, written as a node writes them (python_onnx_model.py's wire format)."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest

from poolpipe.errors import PoolpipeError
from triton_backend.deploy.deployment import resolve_answers
from triton_backend.router.answers import AnswerInbox, parse_address


def _message(key: str, rows: list[int], tensors: dict[str, np.ndarray]) -> bytes:
    arrays = [np.ascontiguousarray(v) for v in tensors.values()]
    head = json.dumps(
        {
            "id": key,
            "rows": rows,
            "tensors": [
                [n, a.dtype.str, list(a.shape)] for n, a in zip(tensors, arrays, strict=True)
            ],
        }
    ).encode()
    return struct.pack(">I", len(head)) + head + b"".join(a.tobytes() for a in arrays)


def test_an_answer_reaches_the_chain_waiting_for_it_and_nothing_else():
    async def run() -> None:
        inbox = AnswerInbox("127.0.0.1:0")
        await inbox.start()
        assert inbox.address_for("10.9.9.9:8001") == f"127.0.0.1:{inbox.port}"
        key, fut = inbox.expect()
        other, waiting = inbox.expect()
        out = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        _, w = await asyncio.open_connection("127.0.0.1", inbox.port)
        # an answer for nobody (late, or made up), then the one expected, on one connection
        w.write(_message("0" * 32, [1, 2, 3], {"y": out}))
        w.write(_message(key, [1, 2, 2, 5, 9, 9], {"y": out, "z": np.ones(2, np.int64)}))
        await w.drain()
        got = await asyncio.wait_for(fut, 5)
        assert got.rows == [1, 2, 2, 5, 9, 9]
        assert np.array_equal(got.tensors["y"], out) and got.tensors["z"].dtype == np.int64
        assert inbox.received == 1 and inbox.unexpected == 1
        # a header too large to be an answer: the connection is closed, nothing delivered
        w.write(struct.pack(">I", 1 << 30))
        await w.drain()
        await asyncio.sleep(0.2)
        assert not waiting.done()
        inbox.forget(other)
        assert waiting.cancelled()
        # a node's connection still open when the router closes: ended, nothing logged
        _, w2 = await asyncio.open_connection("127.0.0.1", inbox.port)
        w2.write(struct.pack(">I", 10))  # half a message
        await w2.drain()
        await asyncio.sleep(0.05)
        await inbox.close()
        assert not inbox._writers
        w.close()
        w2.close()

    asyncio.run(run())


def test_a_bad_inbox_address_is_named_before_anything_is_served():
    assert parse_address("10.0.0.5:8200") == ("10.0.0.5", 8200)
    for bad in ("10.0.0.5", ":80", "host:port", "host:99999"):
        with pytest.raises(PoolpipeError, match="not HOST:PORT"):
            resolve_answers(bad, ["127.0.0.1:8001"])
    assert resolve_answers("back", ["10.0.0.2:8001"]) is None
    assert resolve_answers("auto", ["127.0.0.1:8001"]) == "127.0.0.1:0"
    assert resolve_answers("auto", ["127.0.0.1:8001", "10.0.0.2:8001"]) == "0.0.0.0:0"
