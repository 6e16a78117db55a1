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

The inputs' bytes do not go down the socket where they fit the door's ring: a file of
`poolpipe_door_ring_mb` in `poolpipe_door_ring` (shared memory, /dev/shm), which the stub
maps read-write and the router read-only. The hello names it; the router maps it, removes
its name (nothing is left behind) and answers the hello (rid RING_RID): only then do inputs
go there. A request's arrays are copied into a free region of it and travel as (dtype str,
shape, offset); the region is free again when the request's answer comes back. A 4.3-MB
request then costs the stub one copy and the router's loop one short frame, where down the
socket it took the loop 17 reads while the stub's `execute` waited for them (23 ms a
request at 156 req/s on emulated hc2-small). What does not fit (the ring full, no ring, an
array of objects) goes down the socket.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import pickle
import queue
import select
import socket
import struct
import tempfile
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
    ring: str  # the ring's file, which the router maps and removes ("": none)
    ring_bytes: int


class RequestFrame(NamedTuple):  # stub -> router, per client request
    kind: str  # "req"
    rid: int  # this stub's request id, echoed by the answer
    arrived_ns: int  # when Triton received it, as early as it may have been (monotonic)
    parameters: str  # the request's parameters, a JSON object
    arrays: list  # its input tensors, packed (in the ring: (dtype, shape, offset))
    egress_ns: list  # egress of the answers sent since the last request
    nonfinite: bool  # a NaN or an infinite value among its floating-point inputs


RING_RID = -1  # the router's answer to the hello: the ring mapped (code None) or not


class AnswerFrame(NamedTuple):  # router -> stub, per request (and once to the hello)
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


_ALIGN = 64
RING_PREFIX = "poolpipe-door-ring-"  # (door/server.py sweeps what a dead stub left named)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Ring:
    """Regions of a mapped file, first fit (a few dozen live at most): `take` the offset of
    `n` free bytes (None when none is free), `give` it back."""

    def __init__(self, size: int):
        self.size = size
        self.live: list[tuple[int, int]] = []  # (offset, end), by offset
        self.lock = threading.Lock()

    def take(self, n: int) -> int | None:
        n = max(_ALIGN, _aligned(n))
        with self.lock:
            at = 0
            for k, (start, end) in enumerate(self.live):
                if start - at >= n:
                    self.live.insert(k, (at, at + n))
                    return at
                at = end
            if self.size - at >= n:
                self.live.append((at, at + n))
                return at
            return None

    def give(self, offset: int) -> None:
        with self.lock:
            for k, (start, _) in enumerate(self.live):
                if start == offset:
                    del self.live[k]
                    return


def _open_ring(folder: str, megabytes: float) -> tuple[str, mmap.mmap] | None:
    """The door's ring: a new file of `megabytes` in `folder` (at most a quarter of its free
    room: the Python backend's own regions live there too, and a container's /dev/shm
    holds 64 MB), its memory reserved (a full /dev/shm is found here, not by a write that
    kills the stub), mapped; None where there is none (0 MB, no folder, no room)."""
    if megabytes <= 0 or not folder or not os.path.isdir(folder):
        return None
    st = os.statvfs(folder)
    size = min(int(megabytes * (1 << 20)), st.f_bavail * st.f_frsize // 4) // _ALIGN * _ALIGN
    if size < _ALIGN:
        return None
    try:
        fd, path = tempfile.mkstemp(prefix=RING_PREFIX, dir=folder)  # 0600
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return path, mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _unpack(packed: list) -> list:
    return [
        p if isinstance(p, np.ndarray) else np.frombuffer(p[2], p[0]).reshape(p[1]) for p in packed
    ]


def _exit_with_server() -> None:
    """Leave as soon as the Triton that started this stub has gone. The stub watches its
    server by sending it signal 0, which a server that died but is not yet reaped (a zombie)
    still passes: a node's Triton killed outright, or given up on by the router killed
    outright (pid 1 reaps such orphans when it gets to it), left its stubs running, each
    with its shared-memory region. A thread waits on the server's pidfd, readable once the
    server has exited, reaped or not (no polling: with a thread waking twice a second
    instead, ppipe kept 0.973 on time at 212 req/s in two main jobs, 0.985-0.992 in six
    without), then removes the region the stub's command line names (nobody else maps it
    now) and exits the stub. The same in
    model_repo_templates/python_onnx_model.py: each stub's model file stands alone."""
    try:
        server = os.pidfd_open(os.getppid())
    except (AttributeError, OSError):  # not Linux 5.3+: the stub as Triton made it
        return

    def watch() -> None:
        select.select([server], [], [])
        try:
            with open("/proc/self/cmdline", "rb") as f:
                for arg in f.read().split(b"\0"):
                    if arg.startswith(b"triton_python_backend_shm_region"):
                        os.unlink(os.path.join("/dev/shm", arg.decode()))
        except OSError:
            pass
        os._exit(0)

    threading.Thread(target=watch, name="poolpipe-server-watch", daemon=True).start()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _exit_with_server()
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
        opened = _open_ring(
            params.get("poolpipe_door_ring", ""), float(params.get("poolpipe_door_ring_mb", "0"))
        )
        self.ring_map: mmap.mmap | None = None if opened is None else opened[1]
        self.ring_path = "" if opened is None else opened[0]
        self.ring = Ring(len(self.ring_map) if self.ring_map is not None else 0)
        self.regions: dict[int, int] = {}  # request id -> its inputs' offset in the ring
        self.ring_ready = False  # the router mapped it
        instance = args.get("model_instance_name", "")
        hello = HelloFrame("hello", config["name"], instance, self.ring_path, self.ring.size)
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
                    "req", rid, arrived, r.parameters(), self._pack(rid, arrays), egress,
                    _nonfinite(arrays),
                )
            )  # fmt: skip
        if frames:
            try:  # the only writer after initialize (one execute at a time per instance)
                self.sock.sendall(b"".join(_frame(tuple(f)) for f in frames))
            except OSError:
                self._fail_all("the router is not running")
        self.last_end = time.monotonic_ns()
        return None

    def _pack(self, rid: int, arrays: list) -> list:
        """The arrays in the ring where they fit (one region), else down the socket."""
        ring = self.ring_map
        if ring is None or not self.ring_ready or any(a.dtype.hasobject for a in arrays):
            return _pack(arrays)
        sizes = [_aligned(a.nbytes) for a in arrays]
        at = self.ring.take(sum(sizes))
        if at is None:
            return _pack(arrays)
        self.regions[rid] = at
        packed = []
        for a, n in zip(arrays, sizes, strict=True):
            view = np.frombuffer(ring, a.dtype, a.size, at).reshape(a.shape)
            np.copyto(view, a)
            packed.append((a.dtype.str, a.shape, at))
            at += n
        return packed

    def _free(self, rid: int) -> None:
        at = self.regions.pop(rid, None)
        if at is not None:
            self.ring.give(at)

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
                    msg = AnswerFrame._make(raw)
                    at += _LEN.size + n
                    if msg.rid == RING_RID:
                        self.ring_ready = msg.code is None and self.ring_map is not None
                        continue
                    self._free(msg.rid)  # the router is done with its inputs
                    msgs.append(msg)
                del buf[:at]
                if not msgs:
                    continue
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
            self._free(rid)
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
        if self.ring_path:  # (the router removed it once mapped, unless it never did)
            with contextlib.suppress(OSError):
                os.unlink(self.ring_path)


def _error(message: str, code: str) -> object:
    err = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(error=err)
