"""The router's trace exporter, a process of its own (tracing.py starts it): reads the
router's notes of its requests from stdin, makes each request's spans as OTLP's own
protobuf messages (opentelemetry-proto) and posts them, in batches, over OTLP/HTTP to the
configured collector. It ends, having posted what it has, when the router closes the
pipe; a collector that cannot be reached is said once a minute, not per batch, and the
router serves on meanwhile.

Not the OpenTelemetry SDK's tracer and exporter: they cost 410-660 µs of CPU per request
of five spans on the test machine (`Tracer.start_span` about 180, its OTLP encoder about
220-300), this 70-80, for the same bytes on the wire (`./run bench-serving
--only-overhead`, table 1c, has this process's CPU per request). On a router's host the
exporter shares the cores with the router, its Triton and the nodes.

stdin: frames of a 4-byte little-endian length and a pickle: first the configuration
{endpoint, headers, service, epoch_ns}, then lists of notes (Tracing.answered's tuples;
the client's context in them as the router parsed it), and {epoch_ns} where the wall clock
moved against the router's (the notes after it are placed by the new one). Nothing of
poolpipe is imported.

    python -m triton_backend.router.trace_export < frames
"""

from __future__ import annotations

import http.client
import os
import pickle
import random
import select
import signal
import struct
import sys
import time
import urllib.parse
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span, Status

_LEN = struct.Struct("<I")
SAY_EVERY_S = 60.0
EXPORT_TIMEOUT_S = 3.0  # a batch not posted within this is given up (counted, said)
BATCH_SPANS = 512  # a batch is posted at this many spans ...
BATCH_EVERY_S = 0.5  # ... or this long after its first
WORST_FIRST = ("failed", "dropped", "late", "on time")  # a request's outcome: its worst row's
SERVER, CLIENT, INTERNAL = (
    Span.SpanKind.SPAN_KIND_SERVER,
    Span.SpanKind.SPAN_KIND_CLIENT,
    Span.SpanKind.SPAN_KIND_INTERNAL,
)


def _attributes(into: Any, values: dict[str, Any]) -> None:
    for key, v in values.items():
        kv: KeyValue = into.add()
        kv.key = key
        if isinstance(v, str):
            kv.value.string_value = v
        elif isinstance(v, bool):
            kv.value.bool_value = v
        elif isinstance(v, int):
            kv.value.int_value = v
        else:
            kv.value.double_value = float(v)


class Poster:
    """Posts OTLP/HTTP protobuf bodies to the collector at `endpoint` on one kept-alive
    connection; failures are counted and said once a minute on stderr."""

    def __init__(self, endpoint: str, headers: dict[str, str]):
        self.endpoint = endpoint
        url = urllib.parse.urlsplit(endpoint)
        self.https = url.scheme == "https"
        self.host = url.netloc
        self.path = url.path or "/v1/traces"
        self.headers = {"Content-Type": "application/x-protobuf", **headers}
        self.conn: http.client.HTTPConnection | None = None
        self.failed = 0  # spans not exported
        self._said = -1e18

    def post(self, body: bytes, spans: int) -> None:
        why = ""
        for attempt in (1, 2):  # a kept-alive connection the collector closed: once more
            try:
                if self.conn is None:
                    kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                    self.conn = kind(self.host, timeout=EXPORT_TIMEOUT_S)
                self.conn.request("POST", self.path, body, self.headers)
                answer = self.conn.getresponse()
                answer.read()
                if 200 <= answer.status < 300:
                    return
                why = f"the collector answered {answer.status} {answer.reason}"
                break
            except (OSError, http.client.HTTPException) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if self.conn is not None:
                    self.conn.close()
                    self.conn = None
                if attempt == 2 or isinstance(exc, TimeoutError | ConnectionRefusedError):
                    break
        self.failed += spans
        now = time.monotonic()
        if now - self._said >= SAY_EVERY_S:
            self._said = now
            print(
                f"poolpipe traces: {self.failed} span(s) not exported to {self.endpoint}: {why}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class Frames:
    """The router's frames from file descriptor `fd`, as they come; `next(wait_s)` returns
    the next one, None when none came within `wait_s`, or raises EOFError at the end."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def next(self, wait_s: float | None) -> Any:
        while True:
            if len(self.buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(self.buf)
                if len(self.buf) >= _LEN.size + n:
                    data = bytes(self.buf[_LEN.size : _LEN.size + n])
                    del self.buf[: _LEN.size + n]
                    return pickle.loads(data)
            ready, _, _ = select.select([self.fd], [], [], wait_s)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk


def _id(bits: int) -> bytes:
    return random.getrandbits(bits).to_bytes(bits // 8, "big")


class SpanMaker:
    """Requests' notes -> OTLP spans, gathered into batches for `poster`; times are the
    router clock's µs plus `epoch_ns`."""

    def __init__(self, poster: Poster, service: str, epoch_ns: int):
        self.poster = poster
        self.service = service
        self.epoch_ns = epoch_ns
        self.batch: ScopeSpans | None = None
        self.request_msg: ExportTraceServiceRequest | None = None
        self.spans = 0
        self.since = 0.0
        self.trace_id = b""  # the request's now
        self.given = ""  # its trace id where the router chose it (hex), to match stage spans
        self.parent = b""  # the span its spans are children of

    def ns(self, t_us: float) -> int:
        return self.epoch_ns + int(t_us * 1e3)

    def _new_batch(self) -> ScopeSpans:
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        _attributes(rs.resource.attributes, {"service.name": self.service})
        ss = rs.scope_spans.add()
        ss.scope.name = "poolpipe.router"
        self.request_msg, self.batch, self.spans, self.since = req, ss, 0, time.monotonic()
        return ss

    def flush(self, force: bool = False) -> None:
        """Post the batch when it is full, old enough, or `force`d."""
        if self.request_msg is None or not self.spans:
            return
        if force or self.spans >= BATCH_SPANS or time.monotonic() - self.since >= BATCH_EVERY_S:
            body, spans = self.request_msg.SerializeToString(), self.spans
            self.request_msg = self.batch = None
            self.poster.post(body, spans)

    def request(self, note: tuple) -> None:
        model, parent, state, trace_id, arrival, answered, code, message, rows = note
        self.given = trace_id or ""
        hex_id = parent[0] if parent is not None else trace_id  # (parent: the client's ids)
        self.trace_id = bytes.fromhex(hex_id) if hex_id else _id(128)
        outcomes = {ev[2] for row in rows for ev in row if ev[0] == "x"}
        outcome = next(
            (o for o in WORST_FIRST if o in outcomes),
            "on time" if rows else "bad request" if code == "INVALID_ARG" else "refused",
        )
        attributes: dict[str, Any] = {
            "poolpipe.model": model,
            "poolpipe.rows": len(rows),
            "poolpipe.outcome": outcome,
        }
        if code is not None:
            attributes["poolpipe.error"] = message
        self.parent = bytes.fromhex(parent[1]) if parent is not None else b""
        root = self._span(
            f"poolpipe {model}",
            arrival,
            answered,
            attributes,
            SERVER,
            message if code is not None else "",
        )
        if parent is not None and state:
            root.trace_state = state
        self.parent = root.span_id
        for k, row in enumerate(rows):
            self._row(k if len(rows) > 1 else None, arrival, answered, row)
        self.flush()

    def _span(
        self,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any],
        kind: Any = INTERNAL,
        error: str = "",
        span_id: bytes | None = None,
    ) -> Span:
        batch = self.batch if self.batch is not None else self._new_batch()
        span: Span = batch.spans.add()
        span.trace_id = self.trace_id
        span.span_id = span_id or _id(64)
        if self.parent:
            span.parent_span_id = self.parent
        span.name = name
        span.kind = kind
        span.start_time_unix_nano = self.ns(start)
        span.end_time_unix_nano = self.ns(max(start, end))
        _attributes(span.attributes, attributes)
        if error:
            span.status.code = Status.StatusCode.STATUS_CODE_ERROR
            span.status.message = error
        self.spans += 1
        return span

    def _row(self, row: int | None, arrival: float, answered: float, events: list) -> None:
        """One row's spans, each from where the one before ended: they tile its time."""
        base: dict[str, Any] = {} if row is None else {"poolpipe.row": row}
        at = arrival
        queued = True
        for ev in events:
            if ev[0] == "d":
                _, t, size, dispatch = ev
                self._span(
                    "queue",
                    at,
                    t,
                    {**base, "poolpipe.batch": size, "poolpipe.dispatch": dispatch},
                )
                at, queued = t, False
            elif ev[0] == "h":
                (
                    _,
                    h,
                    sent,
                    start,
                    end,
                    pool,
                    vgpu,
                    node,
                    part,
                    r_sent,
                    r_start,
                    r_end,
                    fail,
                    sent_to_node,
                ) = ev
                # the id its call carried to the node, if in this request's trace
                carried = (
                    bytes.fromhex(sent_to_node[1])
                    if sent_to_node and sent_to_node[0] == self.given
                    else None
                )
                where = {**base, "poolpipe.hop": h, "poolpipe.partition": part}
                self._span(
                    "transfer",
                    at,
                    start,
                    {
                        **where,
                        "poolpipe.sent_ms": (sent - arrival) / 1e3,
                        "poolpipe.reserved_transfer_start_ms": (r_sent - arrival) / 1e3,
                        "poolpipe.reserved_start_ms": (r_start - arrival) / 1e3,
                    },
                )
                stop = end if end is not None else start
                self._span(
                    "stage",
                    start,
                    stop,
                    {
                        **where,
                        "poolpipe.pool": pool,
                        "poolpipe.vgpu": vgpu,
                        "poolpipe.node": node,
                        "poolpipe.start_ms": (start - arrival) / 1e3,
                        "poolpipe.end_ms": (stop - arrival) / 1e3,
                        "poolpipe.reserved_start_ms": (r_start - arrival) / 1e3,
                        "poolpipe.reserved_end_ms": (r_end - arrival) / 1e3,
                        "poolpipe.over_reservation_ms": (stop - r_end) / 1e3,
                    },
                    CLIENT,
                    fail,
                    carried,
                )
                at = max(at, stop)
            elif ev[0] == "x":
                _, t, outcome, reason = ev
                if queued:  # ended before any batch took it (dropped at the door's queue)
                    self._span("queue", at, t, dict(base))
                    at, queued = t, False
                attrs = {**base, "poolpipe.outcome": outcome}
                if reason:
                    attrs["poolpipe.reason"] = reason
                self._span(
                    "answer",
                    at,
                    answered,
                    attrs,
                    error=reason if outcome in ("dropped", "failed") else "",
                )
                return
        if queued:  # (no end noted: the request was answered as a whole at once)
            self._span("queue", at, answered, dict(base))


def main() -> int:
    # a Ctrl-C at the terminal reaches this process too: it ends when the router closes
    # the pipe, having posted what the router sent it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    frames = Frames(sys.stdin.fileno())
    try:
        config = frames.next(None)
    except EOFError:
        return 0
    poster = Poster(config["endpoint"], dict(config["headers"] or {}))
    maker = SpanMaker(poster, config["service"], int(config["epoch_ns"]))
    try:
        while True:
            notes = frames.next(BATCH_EVERY_S)
            if isinstance(notes, dict):  # the wall clock moved
                maker.epoch_ns = int(notes["epoch_ns"])
                continue
            for note in notes or ():
                maker.request(note)
            maker.flush(force=notes is None)  # (nothing came for a while: post what waits)
    except EOFError:
        pass
    finally:
        maker.flush(force=True)
        poster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
