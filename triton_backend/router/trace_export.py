"""The router's trace exporter, a process of its own (tracing.py starts it): reads the
router's notes of its requests from stdin, makes each request's spans with the
OpenTelemetry SDK and exports them over OTLP/HTTP (protobuf) to the configured collector,
in batches (the SDK's BatchSpanProcessor). It ends, having exported what it has, when the
router closes the pipe; a collector that cannot be reached is said once a minute, not per
batch, and the router serves on meanwhile.

stdin: frames of a 4-byte little-endian length and a pickle: first the configuration
{endpoint, headers, service, epoch_ns}, then lists of notes (Tracing.answered's tuples).

    python -m triton_backend.router.trace_export < frames
"""

from __future__ import annotations

import logging
import pickle
import signal
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("poolpipe.traces")
_LEN = struct.Struct("<I")
SAY_EVERY_S = 60.0
EXPORT_TIMEOUT_S = 3.0
WORST_FIRST = ("failed", "dropped", "late", "on time")  # a request's outcome: its worst row's


class _Exporter(OTLPSpanExporter):
    """OTLP/HTTP export whose failures are counted and said once a minute (the SDK logs
    each failed batch with a traceback)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.failed = 0
        self._said = -1e18

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        try:
            result = super().export(spans)
        except Exception as exc:
            result, why = SpanExportResult.FAILURE, str(exc)
        else:
            why = "the collector refused them or could not be reached"
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
            now = time.monotonic()
            if now - self._said >= SAY_EVERY_S:
                self._said = now
                print(
                    f"poolpipe traces: {self.failed} span(s) not exported to "
                    f"{self._endpoint}: {why}",
                    file=sys.stderr,
                    flush=True,
                )
        return result


def _read(stream: BinaryIO) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class _Ids(RandomIdGenerator):
    """Random ids, but the next trace's or span's given where the router chose it (a trace
    sampled from the start; a stage span whose context its call carried to the node)."""

    def __init__(self) -> None:
        self.trace: int | None = None
        self.span: int | None = None

    def generate_trace_id(self) -> int:
        given, self.trace = self.trace, None
        return given if given is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        given, self.span = self.span, None
        return given if given is not None else super().generate_span_id()


class SpanMaker:
    """A request's notes -> its spans, on `tracer` (whose provider draws ids from `ids`);
    times are the router clock's µs plus `epoch_ns`."""

    def __init__(self, tracer: trace.Tracer, ids: _Ids, epoch_ns: int):
        self.tracer = tracer
        self.ids = ids
        self.epoch_ns = epoch_ns
        self.propagator = TraceContextTextMapPropagator()
        self.trace_id: str | None = None  # the request's now, where the router chose it

    def ns(self, t_us: float) -> int:
        return self.epoch_ns + int(t_us * 1e3)

    def request(self, note: tuple) -> None:
        model, parent, state, trace_id, arrival, answered, code, message, rows = note
        self.trace_id = trace_id
        if trace_id is not None and not parent:
            self.ids.trace = int(trace_id, 16)
        carrier = {"traceparent": parent} if parent else {}
        if parent and state:
            carrier["tracestate"] = state
        ctx = self.propagator.extract(carrier) if carrier else None
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
        root = self.tracer.start_span(
            f"poolpipe {model}",
            context=ctx,
            kind=SpanKind.SERVER,
            start_time=self.ns(arrival),
            attributes=attributes,
        )
        if code is not None:
            root.set_status(Status(StatusCode.ERROR, message))
        inner = trace.set_span_in_context(root)
        for k, row in enumerate(rows):
            self._row(inner, k if len(rows) > 1 else None, arrival, answered, row)
        root.end(end_time=self.ns(answered))

    def _span(
        self,
        ctx: Any,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
        error: str = "",
        span_id: int | None = None,
    ) -> None:
        self.ids.span = span_id
        span = self.tracer.start_span(
            name, context=ctx, kind=kind, start_time=self.ns(start), attributes=attributes
        )
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.ns(max(start, end)))

    def _row(
        self, ctx: Any, row: int | None, arrival: float, answered: float, events: list
    ) -> None:
        """One row's spans, each from where the one before ended: they tile its time."""
        base: dict[str, Any] = {} if row is None else {"poolpipe.row": row}
        at = arrival
        queued = True
        for ev in events:
            if ev[0] == "d":
                _, t, size, dispatch = ev
                self._span(
                    ctx,
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
                    int(sent_to_node[1], 16)
                    if sent_to_node and sent_to_node[0] == self.trace_id
                    else None
                )
                where = {**base, "poolpipe.hop": h, "poolpipe.partition": part}
                self._span(
                    ctx,
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
                    ctx,
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
                    SpanKind.CLIENT,
                    fail,
                    carried,
                )
                at = max(at, stop)
            elif ev[0] == "x":
                _, t, outcome, reason = ev
                if queued:  # ended before any batch took it (dropped at the door's queue)
                    self._span(ctx, "queue", at, t, dict(base))
                    at, queued = t, False
                attrs = {**base, "poolpipe.outcome": outcome}
                if reason:
                    attrs["poolpipe.reason"] = reason
                self._span(
                    ctx,
                    "answer",
                    at,
                    answered,
                    attrs,
                    error=reason if outcome in ("dropped", "failed") else "",
                )
                return
        if queued:  # (no end noted: the request was answered as a whole at once)
            self._span(ctx, "queue", at, answered, dict(base))


def main() -> int:
    # a Ctrl-C at the terminal reaches this process too: it ends when the router closes
    # the pipe, having exported what the router sent it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stream = sys.stdin.buffer
    config = _read(stream)
    if not isinstance(config, dict):
        return 0
    resource = Resource.create({"service.name": config["service"]})
    ids = _Ids()
    # every request the router sent is exported: it sampled them (a late request's client
    # may have sent an unsampled context, which the SDK's default sampler would follow)
    provider = TracerProvider(resource=resource, id_generator=ids, sampler=ALWAYS_ON)
    # a batch that cannot go within 3 s is given up (counted, said): a collector down must
    # not hold the router's stop for long, nor let spans pile up here
    exporter = _Exporter(
        endpoint=config["endpoint"], headers=config["headers"] or None, timeout=EXPORT_TIMEOUT_S
    )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, max_queue_size=65536, schedule_delay_millis=500)
    )
    maker = SpanMaker(provider.get_tracer("poolpipe.router"), ids, int(config["epoch_ns"]))
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # said by _Exporter
    try:
        while (notes := _read(stream)) is not None:
            for note in notes:
                maker.request(note)
    finally:
        provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
