"""Traces of the router's requests: what each hop of a request took, as OpenTelemetry spans
exported over OTLP to the collector an operator names (`poolpipe serve --trace-endpoint`).

The router's loop only takes notes: when a request arrived (and the W3C `traceparent` its
client sent, forwarded by the router's Triton like the balancer's headers), when its batch
was dispatched, each hop's sent, start and end times beside the reservation's, how it ended
and when its answer left. A request sampled (its client's trace is sampled; else a share
`sample` of the rest), late, dropped, failed or refused goes, as one plain tuple, down a
pipe to the exporter process (trace_export.py), which makes the spans and exports them:
that costs about 100 µs per request (bench-serving table 1c), work the loop does not do.
With tracing off none of it exists: the hooks are a test of None per request and per
batch.

Every span of a request tiles its latency: `queue` (arrival to dispatch), per hop
`transfer` (from the previous boundary to the compute's start: waiting for the vGPU's turn
and the inputs' way) and `stage` (the compute as measured, reserved times beside it), then
`answer` (from the last hop's end, or the drop, to the answer leaving the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import OUTCOME_NAMES, PENDING, Job, Outcome, forwarded_header

log = logging.getLogger("poolpipe.router")

# OpenTelemetry's own environment variables: where traces go, and headers to send with them
TRACES_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACES_HEADERS_VAR = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
HEADERS_VAR = "OTEL_EXPORTER_OTLP_HEADERS"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>" (W3C Trace Context, version 00;
# a later version's first four fields read the same)
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_LEN = struct.Struct("<I")
# the wall clock moved against the router's by more than this: the exporter is told
EPOCH_MOVED_NS = 100_000
FLUSH_EVERY_S = 0.2  # notes wait at most this long on the loop before they go to the exporter
MAX_BACKLOG_BYTES = 8 << 20  # unsent to the exporter past this: new traces are dropped


@dataclass(frozen=True)
class TraceConfig:
    """Where and what the router traces. `endpoint`: the OTLP/HTTP traces URL of a
    collector (http://HOST:4318/v1/traces); `sample`: the share of requests traced whose
    client sent no sampled trace context (0 to 1; late, dropped, failed and refused ones
    always are); `headers`: sent with every export (a collector's authorisation);
    `service`: the service name on every span."""

    endpoint: str
    sample: float = 0.01
    headers: Mapping[str, str] = field(default_factory=dict)
    service: str = "poolpipe-router"

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/\s]+", self.endpoint):
            raise PoolpipeError(
                f"trace endpoint {self.endpoint!r} is not an http(s) URL; give the collector's "
                "OTLP/HTTP traces URL, for example http://otel-collector:4318/v1/traces"
            )
        if not 0.0 <= self.sample <= 1.0:
            raise PoolpipeError(f"trace sample {self.sample!r} is not between 0 and 1")


def parse_headers(text: str | None) -> dict[str, str]:
    """'k1=v1,k2=v2' (OTEL_EXPORTER_OTLP_HEADERS' form) -> a dict, or a clear error."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise PoolpipeError(
                f"trace header {part.strip()!r} is not NAME=VALUE (for example "
                "authorization=Bearer%20TOKEN, several separated by commas)"
            )
        out[k.strip()] = v.strip()
    return out


def trace_context(traceparent: object) -> tuple[str, str, bool] | None:
    """A traceparent header's (trace id, parent span id, sampled flag), ids in lower-case
    hex; None: no valid header."""
    if not isinstance(traceparent, str):
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), bool(int(m.group(3), 16) & 1)


class RequestTrace:
    """A request's notes while the router serves it. `events`: per row, in time order:
    ("d", t, batch size, dispatch id), ("h", hop, sent, start, end or None, pool, vGPU,
    node, partition, reserved transfer start, reserved start, reserved end, failure, the
    stage span's (trace id, span id) where its call carried them to the node), and ("x",
    t, outcome, reason) when the row's end was decided (µs on the router's clock).
    `parent`: its client's context (trace id, span id), where it sent a valid one, and
    `state` its tracestate. `trace_id`: set when sampled from the start (its client's, or a
    new one), so that its stage calls carry its context to the nodes; a trace exported for
    being late or dropped takes its client's trace id, else one from the exporter."""

    __slots__ = ("arrival", "events", "model", "parent", "state", "trace_id", "tracing")

    def __init__(
        self,
        tracing: Tracing,
        model: str,
        rows: int,
        arrival: float,
        parent: tuple[str, str] | None,
        state: str | None,
        trace_id: str | None,
    ):
        self.tracing = tracing  # where its notes go
        self.model = model
        self.arrival = arrival
        self.parent = parent
        self.state = state
        self.trace_id = trace_id
        self.events: list[list[tuple]] = [[] for _ in range(rows)]


class Tracing:
    """The router's notes of its requests (on its loop) and the exporter process they go
    to. `epoch`: the wall-clock time (ns since 1970) at the router clock's 0, read again
    before each frame of notes: a wall clock set forward or back (a time daemon's step, a
    virtual machine resumed) moves it, as it moves the nodes' Triton, which reads the wall
    clock for each request, so that a node's spans stay inside the router's."""

    def __init__(
        self,
        config: TraceConfig,
        loop: asyncio.AbstractEventLoop,
        now: Any,
        epoch: Callable[[], int],
    ):
        self.config = config
        self.loop = loop
        self.now = now  # the router's clock (µs)
        self.epoch = epoch
        self.epoch_ns = epoch()  # as the exporter has it
        self.sent = 0  # traces handed to the exporter
        self.dropped = 0  # traces dropped: the exporter was behind (or gone)
        self._notes: list[tuple] = []
        self._flushing = False
        self._proc: subprocess.Popen | None = None
        self._pipe: asyncio.WriteTransport | None = None
        self._random = random.random

    # ------------------------------------------------------------------ the exporter

    @property
    def exporter_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the exporter process and open its pipe (on the router's loop)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "triton_backend.router.trace_export"],
            stdin=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None
        first = {
            "endpoint": self.config.endpoint,
            "headers": dict(self.config.headers),
            "service": self.config.service,
            "epoch_ns": self.epoch_ns,
        }
        self._proc.stdin.write(_frame(first))
        self._proc.stdin.flush()
        stdin = self._proc.stdin

        async def connect() -> None:
            transport, _ = await self.loop.connect_write_pipe(asyncio.Protocol, stdin)
            self._pipe = transport

        asyncio.run_coroutine_threadsafe(connect(), self.loop).result(10)
        log.info(
            "tracing: %g of requests (and every late, dropped or refused one) to %s",
            self.config.sample,
            self.config.endpoint,
        )

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is noted, close the pipe and wait for the exporter to export it."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None

        def last() -> None:
            self._flush()
            if self._pipe is not None:
                self._pipe.close()

        if self.loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(_call(last), self.loop)
            with contextlib.suppress(Exception):
                fut.result(5)
        elif proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # ------------------------------------------------------------------ notes

    def begin(
        self, model: str, rows: int, arrival: float, params: Mapping[str, Any] | None
    ) -> RequestTrace:
        """A request's notes from its arrival (µs, router clock) and its parameters (the
        forwarded headers among them)."""
        ctx = trace_context(forwarded_header(params, TRACEPARENT)) if params else None
        trace_id: str | None = None
        if ctx is None:
            if self._random() < self.config.sample:
                trace_id = f"{random.getrandbits(128):032x}"
            return RequestTrace(self, model, rows, arrival, None, None, trace_id)
        if ctx[2]:
            trace_id = ctx[0]
        state = forwarded_header(params or {}, TRACESTATE)
        return RequestTrace(self, model, rows, arrival, ctx[:2], state, trace_id)

    def dispatched(self, job: Job) -> None:
        t = self.now()
        d = job.dispatch
        note = ("d", t, len(job.entries), d.id)
        for e in job.entries:
            tr = e.payload.request.trace
            if tr is not None:
                tr.events[e.payload.row].append(note)

    def hop(self, job: Job, h: int, sent: float, start: float) -> None:
        served = job.served
        hop = job.dispatch.hops[h]
        note = [
            "h",
            h,
            sent,
            start,
            None,
            hop.pool,
            hop.vgpu,
            served.vgpu_node.get(hop.vgpu, ""),
            served.adapter.pool_partition.get(hop.pool, ""),
            hop.transfer_start_us,
            hop.start_us,
            hop.end_us,
            "",
            None,
        ]
        for e in job.entries:
            tr = e.payload.request.trace
            if tr is not None and e.outcome is PENDING:
                tr.events[e.payload.row].append(note)  # (one list shared by the batch)

    def traceparent(self, job: Job, h: int) -> str | None:
        """The W3C context hop `h`'s call carries to its node: that of its stage span in
        the trace of the batch's first request sampled from the start (None: none is)."""
        for e in job.entries:
            tr = e.payload.request.trace
            if tr is None or tr.trace_id is None or e.outcome is not PENDING:
                continue
            events = tr.events[e.payload.row]
            if not events or events[-1][0] != "h" or events[-1][1] != h:
                return None
            note = events[-1]
            if note[13] is None:
                note[13] = (tr.trace_id, f"{random.getrandbits(64):016x}")
            return f"00-{note[13][0]}-{note[13][1]}-01"
        return None

    def hop_ended(self, job: Job, h: int, end: float | None, failure: str = "") -> None:
        for e in job.entries:
            tr = e.payload.request.trace
            if tr is None:
                continue
            events = tr.events[e.payload.row]
            if events and events[-1][0] == "h" and events[-1][1] == h:
                note = events[-1]
                if end is not None:
                    note[4] = end
                if failure:
                    note[12] = failure
                return  # the note is shared: one entry's update is every one's

    def ended(self, trace: RequestTrace, row: int, outcome: Outcome, reason: str) -> None:
        trace.events[row].append(("x", self.now(), OUTCOME_NAMES[outcome], reason))

    def answered(self, trace: RequestTrace, code: str | None, message: str) -> None:
        """The request's answer left the router: its notes go to the exporter where it is
        sampled or did not end on time."""
        if trace.trace_id is None and code is None and _on_time(trace):
            return
        rows = [[tuple(ev) for ev in row] for row in trace.events]  # (hop notes: lists)
        t = trace
        self._note(
            (t.model, t.parent, t.state, t.trace_id, t.arrival, self.now(), code, message, rows)
        )

    def refused(
        self, model: str, arrival: float, params: Mapping[str, Any] | None, code: str, message: str
    ) -> None:
        """A request refused at the door (nothing queued): always traced."""
        tr = self.begin(model, 0, arrival, params)
        self._note(
            (model, tr.parent, tr.state, tr.trace_id, arrival, self.now(), code, message, [])
        )

    def _note(self, record: tuple) -> None:
        if self._pipe is None or self._pipe.is_closing():
            self.dropped += 1
            return
        self._notes.append(record)
        if not self._flushing:
            self._flushing = True
            self.loop.call_later(FLUSH_EVERY_S, self._flush)

    def _flush(self) -> None:
        self._flushing = False
        notes, self._notes = self._notes, []
        if not notes:
            return
        pipe = self._pipe
        if pipe is None or pipe.is_closing() or pipe.get_write_buffer_size() > MAX_BACKLOG_BYTES:
            self.dropped += len(notes)
            return
        epoch_ns = self.epoch()
        if abs(epoch_ns - self.epoch_ns) > EPOCH_MOVED_NS:
            self.epoch_ns = epoch_ns
            pipe.write(_frame({"epoch_ns": epoch_ns}))
        pipe.write(_frame(notes))
        self.sent += len(notes)


def _on_time(trace: RequestTrace) -> bool:
    """Whether every row of the request ended on time."""
    return all(ev[2] == "on time" for row in trace.events for ev in row if ev[0] == "x")


async def _call(fn: Any) -> None:
    fn()


def _frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


class TracedRuntime:
    """The runtime as the transports see it while tracing: each hop report is noted, then
    passed on; everything else is the runtime's."""

    __slots__ = ("_rt", "_tracing", "clock")

    def __init__(self, runtime: Any, tracing: Tracing):
        self._rt = runtime
        self._tracing = tracing
        self.clock = runtime.clock  # (read by the transports for every job)

    @property
    def runtime(self) -> Any:
        return self._rt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def hop_started(
        self,
        job: Job,
        h: int,
        start_us: float,
        transfer_start_us: float | None = None,
        transfer_end_us: float | None = None,
    ) -> None:
        sent = start_us if transfer_start_us is None else transfer_start_us
        self._tracing.hop(job, h, sent, start_us)
        self._rt.hop_started(job, h, start_us, transfer_start_us, transfer_end_us)

    def hop_done(self, job: Job, h: int, start_us: float, end_us: float) -> None:
        self._tracing.hop_ended(job, h, end_us)
        self._rt.hop_done(job, h, start_us, end_us)

    def hop_failed(self, job: Job, h: int, why: str, node_failed: bool) -> None:
        self._tracing.hop_ended(job, h, self.clock.now(), why or "failed")
        self._rt.hop_failed(job, h, why, node_failed)

    def hop_late(self, job: Job, h: int, start_us: float = float("-inf")) -> bool:
        return self._rt.hop_late(job, h, start_us)


def wall_ns() -> int:
    """The wall clock (ns since 1970) less CLOCK_MONOTONIC: a monotonic time plus this is
    its wall-clock time."""
    return time.time_ns() - time.monotonic_ns()
