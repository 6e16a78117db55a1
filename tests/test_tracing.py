"""The router's traces (triton_backend/router/tracing.py, trace_export.py), received by a real
OTLP/HTTP receiver (testbed/otlp.py): a request's spans tile its latency, the client's W3C
trace context is followed over HTTP and gRPC, and late, dropped and refused requests are
traced whatever the sample."""

from __future__ import annotations

import contextlib
import itertools
import time

import numpy as np
import pytest

from poolpipe.errors import PoolpipeError
from testbed.otlp import OTLPReceiver, Span
from tests.test_serving import (  # noqa: F401
    _grpc,
    _http,
    _infer,
    onboarded_tiny,
    two_partition_plan,
)
from triton_backend.router.tracing import TraceConfig, parent_sampled, parse_headers

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_trace_options_are_checked_with_the_fix_named():
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
    assert parent_sampled(f"00-{TRACE_ID}-{PARENT_ID}-01") is True
    assert parent_sampled(f"00-{TRACE_ID}-{PARENT_ID}-00") is False
    assert parent_sampled(f"00-{'0' * 32}-{PARENT_ID}-01") is None  # invalid trace id
    assert parent_sampled("garbage") is None and parent_sampled(None) is None


@pytest.fixture(scope="module")
def traced(onboarded_tiny):  # noqa: F811
    """Two partitions on two nodes, every trace to a real OTLP receiver; sampled: none of
    the requests without a sampled trace context of their own."""
    from triton_backend.deploy.deployment import Deployment

    wh, tmp = onboarded_tiny
    with OTLPReceiver() as rx:
        config = TraceConfig(rx.endpoint, sample=0.0, headers={"x-test": "poolpipe"})
        with Deployment.up(two_partition_plan(), wh, tmp / "ws-traced", tracing=config) as dep:
            yield dep, rx


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


def _traced_infer(mod, client, x, trace_id: str) -> tuple[str, float]:
    """One request with a sampled trace context (HTTP header or gRPC metadata); (its trace
    id, the client's latency in ms). One the router drops (its batch, held for company
    until its last moment, then ran past the SLO on a host shared with the whole suite: an
    explicit drop, as designed) is asked again, twice at most, under another trace id:
    these tests check the trace, not how fast."""
    from triton_backend.router.core import DROP_MARKER

    for attempt in range(3):
        tid = trace_id[:-1] + str(attempt)
        t0 = time.perf_counter()
        try:
            _infer(
                mod,
                client,
                x,
                headers={"traceparent": f"00-{tid}-{PARENT_ID}-01", "tracestate": "team=vision"},
            )
        except Exception as exc:
            if DROP_MARKER not in str(exc) or attempt == 2:
                raise
            continue
        return tid, (time.perf_counter() - t0) * 1e3
    raise AssertionError("unreachable")


def test_a_requests_spans_follow_its_clients_trace_to_the_nodes_and_tile_its_latency(traced):
    dep, rx = traced
    th, client = _http(dep)
    x = np.zeros((1, 3, 32, 32), np.float32)
    for _ in range(3):  # warm (no trace context, sample 0: not traced unless not on time)
        with contextlib.suppress(Exception):
            _infer(th, client, x)
    tid, client_ms = _traced_infer(th, client, x, TRACE_ID)
    # the router's spans, and the nodes' (Triton exports every 5 s): 3 for each of 2 calls
    spans = rx.wait_for(
        lambda s: (
            len([r for r in s if r.trace_id == tid and r.service == "poolpipe-node"]) >= 6
            and any(r.trace_id == tid for r in _roots(s))
        ),
        timeout_s=30,
    )
    roots = [r for r in _roots(spans) if r.trace_id == tid]
    assert len(roots) == 1, roots
    root = roots[0]
    assert root.parent_id == PARENT_ID and root.service == "poolpipe-router"
    assert root.attributes["poolpipe.model"] == "tiny" and root.status != 2
    assert root.attributes["poolpipe.outcome"] in ("on time", "late")
    assert 0 < root.ms <= client_ms, (root.ms, client_ms)  # the router saw it inside the client's
    kids = _children(spans, root)
    names = [k.name for k in kids]
    assert names == ["queue", "transfer", "stage", "transfer", "stage", "answer"], names
    _tiles(root, kids)
    nodes = {n.grpc_url for n in dep.nodes.values()}
    stages = [k for k in kids if k.name == "stage"]
    assert {s.attributes["poolpipe.node"] for s in stages} == nodes  # one hop on each node
    assert [s.attributes["poolpipe.hop"] for s in stages] == [0, 1]
    for s in stages:  # the reservation beside what was measured
        a = s.attributes
        assert a["poolpipe.reserved_end_ms"] > a["poolpipe.reserved_start_ms"] >= 0
        assert a["poolpipe.end_ms"] == pytest.approx(a["poolpipe.start_ms"] + s.ms, abs=0.01)
        # the node's Triton traced the call as a child of this stage span: it began inside
        # it, and its model computed inside it (Triton's own span ends once its answer is
        # sent, which the router may have read already); 1 ms for the two clocks (the
        # node's real-time clock, the router's monotonic one converted at its start)
        (call,) = [n for n in spans if n.parent_id == s.span_id]
        assert call.service == "poolpipe-node" and call.trace_id == tid
        assert s.start_ns - 1_000_000 <= call.start_ns <= s.end_ns, (s, call)
        (model,) = [n for n in spans if n.parent_id == call.span_id]
        assert model.name == s.attributes["poolpipe.partition"], model
        (compute,) = [n for n in spans if n.parent_id == model.span_id]
        assert compute.name == "compute" and compute.end_ns <= s.end_ns + 1_000_000, (s, compute)
    # the requests without a trace context of their own were not traced (sample 0) unless
    # they did not end on time
    others = [r for r in _roots(spans) if r.trace_id != tid]
    assert all(r.attributes["poolpipe.outcome"] != "on time" for r in others), others


def test_grpc_metadata_carries_the_trace_and_an_unsampled_one_is_not_exported(traced):
    dep, rx = traced
    tg, client = _grpc(dep)
    x = np.zeros((1, 3, 32, 32), np.float32)
    unsampled = "22" * 16
    with contextlib.suppress(Exception):  # (a drop is traced: checked below)
        _infer(tg, client, x, headers={"traceparent": f"00-{unsampled}-{PARENT_ID}-00"})
    grpc_trace, _ = _traced_infer(tg, client, x, "11" * 16)
    rx.wait_for(lambda s: any(r.trace_id == grpc_trace for r in _roots(s)))
    traces = rx.traces()
    assert grpc_trace in traces
    mine = traces[grpc_trace]
    (root,) = _roots(mine)
    _tiles(root, _children(mine, root))
    got = traces.get(unsampled, [])
    assert all(r.attributes["poolpipe.outcome"] != "on time" for r in _roots(got)), got


def test_dropped_and_refused_requests_are_traced_with_their_reason(traced):
    from triton_backend.router.core import BAD_REQUEST_MARKER, DROP_MARKER

    dep, rx = traced
    th, client = _http(dep)
    x = np.zeros((1, 3, 32, 32), np.float32)
    before = len(_roots(rx.spans))
    # a deadline of its own too short for the plan's path: dropped, explicitly
    with pytest.raises(Exception, match=DROP_MARKER):
        _infer(th, client, x, headers={"x-poolpipe-timeout": "1u"})
    with pytest.raises(Exception, match=BAD_REQUEST_MARKER):  # refused at the door
        _infer(th, client, x, parameters={"slo_ms": "soon"})
    spans = rx.wait_for(lambda s: len(_roots(s)) >= before + 2)
    new = _roots(spans)[before:]
    by_outcome = {r.attributes["poolpipe.outcome"]: r for r in new}
    assert {"dropped", "bad request"} <= set(by_outcome), by_outcome
    dropped = by_outcome["dropped"]
    assert dropped.status == 2 and DROP_MARKER in dropped.attributes["poolpipe.error"]
    kids = _children(spans, dropped)
    _tiles(dropped, kids)
    assert kids[-1].name == "answer" and kids[-1].attributes["poolpipe.outcome"] == "dropped"
    assert kids[-1].attributes["poolpipe.reason"]
    refused = by_outcome["bad request"]
    assert refused.status == 2 and "slo_ms" in refused.attributes["poolpipe.error"]


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
        tracing = Tracing(TraceConfig(rx.endpoint, 1.0), loop, lambda: clock[0], 10**18)
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


def test_an_unreachable_collector_is_said_once_and_stopping_does_not_wait_long(capfd):
    from triton_backend.env import free_ports
    from triton_backend.router.tracing import Tracing

    (port,) = free_ports(1)  # nobody listens there
    with _Loop() as loop:
        tracing = Tracing(
            TraceConfig(f"http://127.0.0.1:{port}/v1/traces", 1.0), loop, lambda: 0.0, 0
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
