"""The router's traces (triton_backend/router/tracing.py, trace_export.py), received by a real
OTLP/HTTP receiver (testbed/otlp.py): the notes of a request of two rows and of one dropped
in the queue tile their time, and a collector that cannot be reached. Traces of served
requests, followed to the nodes: tests/test_serving.py; through the balancer:
tests/test_router_tier.py."""

from __future__ import annotations

import itertools
import time

import pytest

from poolpipe.errors import PoolpipeError
from testbed.otlp import OTLPReceiver, Span
from triton_backend.router.tracing import TraceConfig, parse_headers, trace_context

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_trace_options_are_checked_with_the_fix_named(tmp_path, capsys):
    with pytest.raises(PoolpipeError, match=r"not an http\(s\) URL.*4318/v1/traces"):
        TraceConfig("otel-collector:4318")
    with pytest.raises(PoolpipeError, match="between 0 and 1"):
        TraceConfig("http://c:4318/v1/traces", sample=1.5)
    assert parse_headers("authorization=Bearer x, x-team=a") == {
        "authorization": "Bearer x",
        "x-team": "a",
    }
    with pytest.raises(PoolpipeError, match="NAME=VALUE"):
        parse_headers("authorization")
    from poolpipe_cli import main

    workspace = tmp_path / "n"
    argv = ["node", "--device", "cpu-1t", "--workspace", str(workspace)]
    assert main([*argv, "--trace-endpoint", "otel-collector:4318"]) == 2
    err = capsys.readouterr().err
    assert "'otel-collector:4318' is not an http(s) URL" in err and "/v1/traces" in err, err
    assert not workspace.exists()  # refused before anything started
    assert trace_context(f"00-{TRACE_ID}-{PARENT_ID}-01") == (TRACE_ID, PARENT_ID, True)
    assert trace_context(f"00-{TRACE_ID.upper()}-{PARENT_ID}-00") == (TRACE_ID, PARENT_ID, False)
    assert trace_context(f"00-{'0' * 32}-{PARENT_ID}-01") is None  # invalid trace id
    assert trace_context("garbage") is None and trace_context(None) is None


def _roots(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.name.startswith("poolpipe ")]


def _children(spans: list[Span], root: Span) -> list[Span]:
    kids = [s for s in spans if s.parent_id == root.span_id and s.trace_id == root.trace_id]
    return sorted(kids, key=lambda s: (s.start_ns, s.end_ns))


def _tiles(root: Span, kids: list[Span]) -> None:
    """The children, end to end, cover the root's time exactly."""
    assert kids, root
    assert kids[0].start_ns == root.start_ns, (kids[0], root)
    assert kids[-1].end_ns == root.end_ns, (kids[-1], root)
    for a, b in itertools.pairwise(kids):
        assert a.end_ns == b.start_ns, (a, b)
    assert all(k.end_ns >= k.start_ns for k in kids)


class _Loop:
    """An event loop in a thread of its own, as the router runs one."""

    def __enter__(self):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _on(loop, fn):
    import asyncio

    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(5)


def _job(entries, hops=1):
    """What the notes read of a batch the runtime dispatched (ports.Job's fields)."""
    from types import SimpleNamespace as NS

    hop = NS(pool=0, vgpu=0, transfer_start_us=10.0, start_us=12.0, end_us=20.0)
    served = NS(vgpu_node={0: "10.0.0.21:8001"}, adapter=NS(pool_partition={0: "m__b00-04"}))
    return NS(entries=entries, dispatch=NS(id=7, hops=[hop] * hops), served=served)


def _entry(trace, row):
    from types import SimpleNamespace as NS

    from poolpipe.runtime import PENDING
    from triton_backend.router.served import ClientRequest, ModelIO, RequestRow

    request = ClientRequest(ModelIO("m", (), ()), len(trace.events), lambda *a: None, trace)
    return NS(payload=RequestRow(request, row, []), outcome=PENDING)


def test_a_request_of_two_rows_and_one_dropped_in_the_queue_tile_their_time():
    """Two rows batched apart, each its own spans under the request's; a request dropped
    before any batch took it: queue, then answer. Made by the exporter process, received
    over OTLP."""
    from poolpipe.runtime import DROPPED, ON_TIME
    from triton_backend.router.tracing import Tracing

    clock = [0.0]
    with OTLPReceiver() as rx, _Loop() as loop:
        tracing = Tracing(TraceConfig(rx.endpoint, 1.0), loop, lambda: clock[0], lambda: 10**18)
        tracing.start()
        try:

            def serve() -> None:
                two = tracing.begin("m", 2, 0.0, {})
                for row, t in ((0, 5.0), (1, 30.0)):
                    e = _entry(two, row)
                    clock[0] = t
                    tracing.dispatched(_job([e]))
                    job = _job([e])
                    tracing.hop(job, 0, t + 1, t + 2)
                    tracing.hop_ended(job, 0, t + 9)
                    clock[0] = t + 10
                    tracing.ended(two, row, ON_TIME, "")
                clock[0] = 45.0
                tracing.answered(two, None, "")
                lone = tracing.begin("m", 1, 50.0, {})  # sample 1: traced too
                clock[0] = 60.0
                tracing.ended(lone, 0, DROPPED, "deadline cannot be met")
                clock[0] = 61.0
                tracing.answered(lone, "UNAVAILABLE", "POOLPIPE_DROPPED: deadline cannot be met")

            _on(loop, serve)
        finally:
            tracing.close()
        spans = rx.wait_for(lambda s: len(_roots(s)) >= 2)
    roots = sorted(_roots(spans), key=lambda r: r.start_ns)
    two, lone = roots
    kids = sorted(_children(spans, two), key=lambda k: k.attributes["poolpipe.row"])
    assert [(k.name, k.attributes.get("poolpipe.row")) for k in kids] == [
        ("queue", 0), ("transfer", 0), ("stage", 0), ("answer", 0),
        ("queue", 1), ("transfer", 1), ("stage", 1), ("answer", 1),
    ]  # fmt: skip
    for row in (0, 1):  # each row's spans tile the request's time
        _tiles(two, [k for k in kids if k.attributes["poolpipe.row"] == row])
    assert two.ms == pytest.approx(0.045) and two.attributes["poolpipe.rows"] == 2
    stage = kids[2].attributes
    assert stage["poolpipe.node"] == "10.0.0.21:8001" and stage["poolpipe.reserved_end_ms"] == 0.02
    assert stage["poolpipe.over_reservation_ms"] == pytest.approx(-0.006)  # ended at 14 of 20
    assert lone.attributes["poolpipe.outcome"] == "dropped" and lone.status == 2
    assert [k.name for k in _children(spans, lone)] == ["queue", "answer"]
    _tiles(lone, _children(spans, lone))


def test_spans_made_after_the_wall_clock_was_set_forward_are_placed_by_it():
    """A node's Triton reads the wall clock for each request; the router's spans follow it
    the same way: a request noted after the wall clock moved 2 s against the router's is
    placed 2 s later; a move within 0.1 ms is not sent."""
    from triton_backend.router.tracing import Tracing

    epoch = [10**18]
    with OTLPReceiver() as rx, _Loop() as loop:
        tracing = Tracing(TraceConfig(rx.endpoint, 1.0), loop, lambda: 5.0, lambda: epoch[0])
        tracing.start()
        try:
            for model, moved_ns in (("before", 0), ("after", 2 * 10**9), ("within", 50_000)):
                epoch[0] += moved_ns
                _on(loop, lambda m=model: tracing.refused(m, 1.0, {}, "INVALID_ARG", "bad"))
                _on(loop, tracing._flush)  # (a frame of its own)
        finally:
            tracing.close()
        spans = rx.wait_for(lambda s: len(_roots(s)) >= 3)
    starts = {r.attributes["poolpipe.model"]: r.start_ns for r in _roots(spans)}
    assert starts == {"before": 10**18 + 1000, "after": 10**18 + 2 * 10**9 + 1000,
                      "within": 10**18 + 2 * 10**9 + 1000}  # fmt: skip


def test_an_unreachable_collector_is_said_once_and_stopping_does_not_wait_long(capfd):
    from triton_backend.env import free_ports
    from triton_backend.router.tracing import Tracing

    (port,) = free_ports(1)  # nobody listens there
    with _Loop() as loop:
        tracing = Tracing(
            TraceConfig(f"http://127.0.0.1:{port}/v1/traces", 1.0), loop, lambda: 0.0, lambda: 0
        )
        tracing.start()
        _on(loop, lambda: [tracing.refused("m", 0.0, {}, "INVALID_ARG", "bad") for _ in range(3)])
        t0 = time.monotonic()
        tracing.close()
        took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert took < 8.0, took  # (the exporter gives a batch up after 3 s)
    assert err.count("not exported") == 1 and f"127.0.0.1:{port}" in err, err
    assert "Traceback" not in err, err
