"""The router's door inside Triton: the Python-backend model of each served model name (and
of `poolpipe_control`), copied as `model.py` into the router's own model repository.

It does as little as it can: `execute` stamps when Triton received the requests, as early
as it may have been (CLOCK_MONOTONIC, the same clock in every process of the host; see
execute for a burst), sends each request's tensors and parameters down a Unix socket to
the router process, keeps its response sender and returns at once, so Triton never holds
a request out of the router's sight while another one is served. A reader thread takes
the answers as they come and a few sender threads send them, outputs before errors
(refused = INVALID_ARG, HTTP 400; dropped = UNAVAILABLE, HTTP 503). The config stays
non-decoupled (one response per request), so KServe v2 HTTP works too; Triton's dynamic
batcher hands `execute` every request queued at that moment (nothing waits for a batch).

Self-contained (stdlib, numpy and Triton's `triton_python_backend_utils`): the stub
process imports nothing of poolpipe. Frames both ways: a 4-byte little-endian length, then
a pickle of a plain tuple (the socket lives in a folder only this user can enter), named
here and in inbox.py alike: HelloFrame and RequestFrame from the stub, AnswerFrame from the
router; each array is (dtype str, shape, bytes). A request's `egress_ns` are the times from
the router's `sent_ns` until earlier answers left the stub, carried back with the next
request: what the router learns its reply margin from.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import pickle
import queue
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_LEN = struct.Struct("<I")
_BACK_TO_BACK_NS = 200_000
_HANDOVER_NS = 100_000  # per request: more than Triton takes to copy one into the backend
_BACKLOG = 3  # requests in one back-to-back batch that show a backlog


class HelloFrame(NamedTuple):  # stub -> router, once per connection
    kind: str  # "hello"
    model: str  # the served model this door instance takes requests of
    instance: str


class RequestFrame(NamedTuple):  # stub -> router, per client request
    kind: str  # "req"
    rid: int  # this stub's request id, echoed by the answer
    arrived_ns: int  # when Triton received it, as early as it may have been (monotonic)
    parameters: str  # the request's parameters, a JSON object
    arrays: list  # its input tensors, packed
    egress_ns: list  # egress of the answers sent since the last request
    nonfinite: bool  # a NaN or an infinite value among its floating-point inputs


class AnswerFrame(NamedTuple):  # router -> stub, per request
    kind: str  # "ans"
    rid: int
    sent_ns: int  # when the router sent it (monotonic)
    arrays: list | None  # the outputs, packed; None for an error
    code: str | None  # None, or the error's code (INVALID_ARG, UNAVAILABLE, INTERNAL)
    message: str


def _frame(obj: tuple) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


def _pack(arrays: list) -> list:
    """Arrays as (dtype, shape, bytes): numpy's own pickling costs several times more."""
    return [a if a.dtype.hasobject else (a.dtype.str, a.shape, a.tobytes()) for a in arrays]


def _nonfinite(arrays: list) -> bool:
    """Whether a floating-point input holds a NaN or an infinity (a sum in float64: one
    pass, no temporary; either anywhere makes it so). Here, not on the router's loop: the
    stubs share that work, and it grows with the inputs (0.4 ms for 4.3 MB)."""
    return any(
        a.dtype.kind == "f" and a.size and not np.isfinite(a.sum(dtype=np.float64)) for a in arrays
    )


def _unpack(packed: list) -> list:
    return [
        p if isinstance(p, np.ndarray) else np.frombuffer(p[2], p[0]).reshape(p[1]) for p in packed
    ]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30.0
        while True:
            try:
                self.sock.connect(params["poolpipe_door"])
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        hello = HelloFrame("hello", config["name"], args.get("model_instance_name", ""))
        self.sock.sendall(_frame(tuple(hello)))
        self.pending: dict[int, Any] = {}  # request id -> its response sender
        self.ids = itertools.count()
        self.egress: list[int] = []
        self.closed = False
        self.last_start = self.last_end = self.backlog_start = 0
        self.wait_cap_ns = int(float(params.get("poolpipe_wait_cap_ms", "100")) * 1e6)
        self.outbox: queue.PriorityQueue = queue.PriorityQueue()
        self.busy = [False] * int(params.get("poolpipe_senders", "4"))  # per sender
        self.order = itertools.count()
        self.senders = [
            threading.Thread(target=self._send_loop, args=(k,), daemon=True)
            for k in range(len(self.busy))
        ]
        for t in self.senders:
            t.start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def execute(self, requests: list) -> None:
        now = time.monotonic_ns()
        # When Triton received these, as early as it may have been. Triton hands an
        # instance every request queued when it takes the next batch, so these arrived
        # after the last call began; if they come right after it (back to back: no more
        # time between the calls than Triton takes to hand a batch of this size over),
        # they may have waited since then. A back-to-back batch of several requests is a
        # backlog: a burst, whose requests wait longest in Triton's HTTP/gRPC front end,
        # where nothing can be seen. Its requests count from the start of the backlog (a
        # burst arrives at once), at most `wait_cap` back; after an idle moment they
        # arrived just now.
        back_to_back = now - self.last_end < _BACK_TO_BACK_NS + _HANDOVER_NS * len(requests)
        if not back_to_back:
            self.backlog_start = now
        elif len(requests) < _BACKLOG:
            self.backlog_start = self.last_start
        arrived = max(self.backlog_start, now - self.wait_cap_ns)
        self.last_start = now
        frames = []
        for r in requests:
            sender = r.get_response_sender()
            if self.closed:
                sender.send(_error("the router is not running", "UNAVAILABLE"), FINAL)
                continue
            rid = next(self.ids)
            self.pending[rid] = sender
            arrays = [pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs]
            egress, self.egress = self.egress, []
            frames.append(
                RequestFrame(
                    "req", rid, arrived, r.parameters(), _pack(arrays), egress, _nonfinite(arrays)
                )
            )
        if frames:
            try:  # the only writer after initialize (one execute at a time per instance)
                self.sock.sendall(b"".join(_frame(tuple(f)) for f in frames))
            except OSError:
                self._fail_all("the router is not running")
        self.last_end = time.monotonic_ns()
        return None

    def _read(self) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the router closed the door")
                buf += chunk
                at = 0
                msgs = []
                while len(buf) - at >= _LEN.size:
                    (n,) = _LEN.unpack_from(buf, at)
                    if len(buf) - at - _LEN.size < n:
                        break
                    raw = pickle.loads(memoryview(buf)[at + _LEN.size : at + _LEN.size + n])
                    msgs.append(AnswerFrame._make(raw))
                    at += _LEN.size + n
                del buf[:at]
                if len(msgs) == 1 and not any(self.busy) and self.outbox.empty():
                    # one answer and nothing else to send: sent from here, without waking
                    # a sender (a thread hand-over less on the way out)
                    with contextlib.suppress(Exception):
                        self._answer(msgs[0])
                    continue
                for msg in msgs:
                    # outputs before errors: a drop told a little later is still a drop,
                    # an answer told later may be late
                    self.outbox.put((msg.code is not None, next(self.order), msg))
        except (ConnectionError, OSError, EOFError, struct.error, pickle.UnpicklingError):
            self._fail_all("the router closed the door")

    def _send_loop(self, k: int) -> None:
        while True:
            _, _, msg = self.outbox.get()
            if msg is None:
                return
            self.busy[k] = True
            with contextlib.suppress(Exception):  # a client gone: the next answer goes on
                self._answer(msg)
            self.busy[k] = False

    def _answer(self, msg: AnswerFrame) -> None:
        """Send one answer. Each send waits for Triton to take the response (about 0.4 ms
        on an idle 2-core host), so a few threads send side by side."""
        sender = self.pending.pop(msg.rid, None)
        if sender is None:
            return
        if msg.code is None:
            pairs = zip(self.outputs, _unpack(msg.arrays or []), strict=True)
            tensors = [pb_utils.Tensor(k, v) for k, v in pairs]
            sender.send(pb_utils.InferenceResponse(tensors), FINAL)
        else:
            sender.send(_error(msg.message, msg.code), FINAL)
        self.egress.append(time.monotonic_ns() - msg.sent_ns)

    def _fail_all(self, why: str) -> None:
        self.closed = True
        for rid in list(self.pending):
            sender = self.pending.pop(rid, None)
            if sender is not None:
                with contextlib.suppress(Exception):
                    sender.send(_error(why, "UNAVAILABLE"), FINAL)

    def finalize(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.reader.join(5.0)
        for _ in self.senders:
            self.outbox.put((True, next(self.order), None))


def _error(message: str, code: str) -> object:
    err = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(error=err)
