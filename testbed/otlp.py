"""An OTLP/HTTP traces receiver (what a collector listens with on :4318): POST /v1/traces
with an ExportTraceServiceRequest in protobuf or JSON (gzip or not) is decoded with the
OpenTelemetry protocol's own messages and its spans kept; anything else is refused as a
collector would. What the router's exporter sends it is what a real collector receives.

    with OTLPReceiver() as rx:       # on 127.0.0.1, a free port
        ... rx.endpoint ...          # http://127.0.0.1:PORT/v1/traces
        spans = rx.wait_for(lambda spans: ..., timeout_s=10)
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    service: str

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _parse(body: bytes) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    return req


def _parse_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON (what Triton's exporter sends): protobuf's JSON mapping, except that trace
    and span ids are hex strings, not base64."""
    doc = json.loads(body)
    for rs in doc.get("resourceSpans", doc.get("resource_spans", [])):
        for ss in rs.get("scopeSpans", rs.get("scope_spans", [])):
            for span in ss.get("spans", []):
                for key in (
                    "traceId",
                    "spanId",
                    "parentSpanId",
                    "trace_id",
                    "span_id",
                    "parent_span_id",
                ):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(doc, ExportTraceServiceRequest(), ignore_unknown_fields=True)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, decode: bool = True):
        """`decode`: keep the spans (False: count the posts and their bytes alone, as
        cheaply as a receiver can: a benchmark's stand-in for a collector elsewhere)."""
        self.spans: list[Span] = []
        self.posts = 0
        self.bytes = 0
        self.decode = decode
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if not receiver.decode:
                    receiver._count(len(body))
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                as_json = self.headers.get("Content-Type", "").startswith("application/json")
                try:
                    req = _parse_json(body) if as_json else _parse(body)
                except Exception:
                    self.send_error(400, "not an ExportTraceServiceRequest")
                    return
                receiver._keep(req)
                answer = ExportTraceServiceResponse()
                out = (
                    json_format.MessageToJson(answer).encode()
                    if as_json
                    else answer.SerializeToString()
                )
                self.send_response(200)
                self.send_header(
                    "Content-Type", "application/json" if as_json else "application/x-protobuf"
                )
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1/traces"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self, size: int) -> None:
        with self._cond:
            self.posts += 1
            self.bytes += size

    def _keep(self, req: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in req.resource_spans:
            service = next(
                (_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), ""
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.name,
                            s.kind,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                            s.status.code,
                            service,
                        )
                    )
        with self._cond:
            self.posts += 1
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 10.0) -> list[Span]:
        """The spans received, once `done(spans)` holds (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.spans)

    def traces(self) -> dict[str, list[Span]]:
        """The spans received by trace id."""
        with self._cond:
            out: dict[str, list[Span]] = {}
            for s in self.spans:
                out.setdefault(s.trace_id, []).append(s)
            return out


def main() -> int:
    """A receiver in a process of its own (a benchmark's: what it does costs the measured
    process nothing): prints its endpoint, receives until its stdin closes, then prints
    {"posts", "bytes"} as JSON (and "spans", "traces" unless --count-only: posts counted,
    not decoded, the least CPU a receiver on this host can take)."""
    import sys

    with OTLPReceiver(decode="--count-only" not in sys.argv) as rx:
        print(rx.endpoint, flush=True)
        sys.stdin.read()
        out = {"posts": rx.posts, "bytes": rx.bytes}
        if rx.decode:
            out.update(spans=len(rx.spans), traces=len(rx.traces()))
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
