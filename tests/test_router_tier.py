"""The router tier for real: HAProxy (Debian's package) rendered from an inventory's
[balancer] and [[routers]] and run in front of a real router (its Triton, door and runtime,
a real stage-worker node): arrival stamps from the balancer, the router's readiness check,
and the errors an operator meets (HAProxy missing, a port taken, a node given to two
routers). Skipped, with the reason, where HAProxy is not installed."""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from poolpipe.domain.inventory import InventoryError, parse_inventory
from poolpipe.domain.tier import TierError, split_address
from tests.test_serving import hand_plan, onboarded_tiny  # noqa: F401 (a fixture)
from triton_backend.env import free_ports
from triton_backend.lb.haproxy import Balancer, BalancerError, find_haproxy, render
from triton_backend.router.served import DROP_MARKER

pytestmark = pytest.mark.integration
needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None,
    reason="HAProxy is not installed (./run installs it as root: apt-get install haproxy)",
)
N_BURST = 100
SLO_MS = 100.0
WAY_MS = 30.0  # the burst's way in and out through HAProxy, at most (client's clock)


def tier_toml(router_ports: dict[str, int], lb_ports: dict[str, int], nodes: str = "") -> str:
    r, b = router_ports, lb_ports
    return f"""
[[servers]]
name = "s0"
bandwidth_gbps = 10
[[nodes]]
name = "n0"
server = "s0"
device = "cpu-1t"
grpc = "127.0.0.1:1"
[balancer]
http = "127.0.0.1:{b["http"]}"
grpc = "127.0.0.1:{b["grpc"]}"
check_ms = 100
fall = 2
rise = 1
[[routers]]
name = "r0"
http = "127.0.0.1:{r["http"]}"
grpc = "127.0.0.1:{r["grpc"]}"
ready = "127.0.0.1:{r["ready"]}"
{nodes}
"""


def two_routers_toml(r0: dict[str, int], r1: dict[str, int], lb: dict[str, int]) -> str:
    """Two routers behind one balancer, each with a node of its own: r0 drives n0 (cpu-1t
    on s0), r1 drives n1 (cpu-2t on s1). Ports by "http", "grpc", "ready" on loopback."""
    return tier_toml(r0, lb, 'nodes = ["n0"]').replace(
        "[balancer]",
        '[[servers]]\nname = "s1"\nbandwidth_gbps = 10\n'
        '[[nodes]]\nname = "n1"\nserver = "s1"\ndevice = "cpu-2t"\ngrpc = "127.0.0.1:2"\n'
        "[balancer]",
    ) + (
        f'\n[[routers]]\nname = "r1"\nhttp = "127.0.0.1:{r1["http"]}"\n'
        f'grpc = "127.0.0.1:{r1["grpc"]}"\nready = "127.0.0.1:{r1["ready"]}"\nnodes = ["n1"]\n'
    )


R0, R1, LB = (
    {"http": 1001, "grpc": 1002, "ready": 1003},
    {"http": 2001, "grpc": 2002, "ready": 2003},
    {"http": 1004, "grpc": 1005},
)


def _router(wh: str, workspace, http: int, grpc: int, ready: int, **kw):
    """A router serving a one-partition plan on a cpu-1t node of its own."""
    from triton_backend.deploy.serving import ServingProcess

    return ServingProcess(
        hand_plan([(0, 4, 1)], batch=4),
        wh,
        workspace,
        stats_interval_s=3600,
        ready_port=ready,
        http_port=http,
        grpc_port=grpc,
        **kw,
    )


@pytest.fixture(scope="module")
def tier(onboarded_tiny, tmp_path_factory):  # noqa: F811
    """A router serving a one-partition plan (one cpu-1t node) behind HAProxy."""
    if shutil.which("haproxy") is None:
        pytest.skip("HAProxy is not installed (./run installs it as root: apt-get install haproxy)")
    from testbed.otlp import OTLPReceiver
    from triton_backend.router.tracing import TraceConfig

    wh, _ = onboarded_tiny
    tmp = tmp_path_factory.mktemp("tier")
    http, grpc, ready, lb_http, lb_grpc = free_ports(5)
    rx = OTLPReceiver().__enter__()  # the router's traces (sample 0: its clients' alone)
    srv = _router(
        wh, tmp / "router", http, grpc, ready, metrics_port=0, tracing=TraceConfig(rx.endpoint, 0.0)
    )
    srv.traces = rx  # type: ignore[attr-defined]
    inv = parse_inventory(
        _toml(
            tier_toml(
                {"http": http, "grpc": grpc, "ready": ready}, {"http": lb_http, "grpc": lb_grpc}
            )
        )
    )
    lb = Balancer(inv, tmp / "lb")
    try:
        lb.start()
        _until(lambda: _through(lb.http_url) == 200, "the balancer sends to the router")
        yield srv, lb
    finally:
        lb.stop()
        srv.close()
        rx.__exit__()


def _toml(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def _until(ok, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


def _infer_body(slo: bool = True) -> bytes:
    body: dict = {
        "inputs": [
            {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
        ]
    }
    if slo:
        body["parameters"] = {"slo_ms": 10 * SLO_MS}
    return json.dumps(body).encode()


def _through(url: str, headers: dict | None = None, slo: bool = True) -> int:
    """One request to model tiny at `url` over HTTP (with a generous `slo_ms`, or none):
    its status code."""
    return _answer(url, headers, slo)[0]


def _answer(url: str, headers: dict | None = None, slo: bool = True) -> tuple[int, str]:
    """_through's status code, and what the answer said where it was not 200."""
    req = urllib.request.Request(
        f"http://{url}/v2/models/tiny/infer", data=_infer_body(slo), headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, " ".join(exc.read().decode(errors="replace").split())[:200]
    except OSError as exc:
        return 0, str(exc)


def _ready(srv) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{srv.ready.port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_requests_through_the_balancer_carry_its_stamp_over_http_and_grpc(tier):
    import tritonclient.grpc as tg

    srv, lb = tier
    counts = srv.deployment.core.stamps.counts
    before = counts["used"]
    assert _answer(lb.http_url) == (200, "")  # (what it said otherwise)
    client = tg.InferenceServerClient(lb.grpc_url)
    x = tg.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    client.infer("tiny", [x])
    client.close()
    assert counts["used"] == before + 2, dict(counts)
    assert sum(v for k, v in counts.items() if k != "used") == 0, dict(counts)


def test_a_clients_trace_context_reaches_the_router_through_the_balancer(tier):
    """HAProxy passes the W3C traceparent on (HTTP header, gRPC metadata): the router's
    span of each request is a child of the client's, in the client's trace."""
    import tritonclient.grpc as tg

    srv, lb = tier
    parent = "00f067aa0ba902b7"
    over_http, over_grpc = "ab" * 16, "cd" * 16
    assert _answer(lb.http_url, {"traceparent": f"00-{over_http}-{parent}-01"}) == (200, "")
    client = tg.InferenceServerClient(lb.grpc_url)
    x = tg.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    client.infer("tiny", [x], headers={"traceparent": f"00-{over_grpc}-{parent}-01"})
    client.close()
    roots = {
        s.trace_id: s
        for s in srv.traces.wait_for(
            lambda spans: (
                {over_http, over_grpc} <= {s.trace_id for s in spans if s.name == "poolpipe tiny"}
            )
        )
        if s.name == "poolpipe tiny"
    }
    for trace in (over_http, over_grpc):
        assert trace in roots and roots[trace].parent_id == parent, roots


def test_a_body_triton_cannot_parse_is_a_400_through_the_balancer(tier):
    """Triton's own front end answers a body it cannot parse with 500 (it files JSON errors
    as internal ones); through the balancer the client's mistake is a 400, its message
    kept, and the router's own answers keep their status."""
    srv, lb = tier
    one = {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32"}
    for body, says in [
        (b"{not json", "failed to parse"),
        (b'{"inputs": [{"name": "input"', "failed to parse"),
        (b"{}", "Unable to parse"),
        (json.dumps({"inputs": [{**one, "data": [1.0, 2.0]}]}).encode(), "Unable to parse"),
    ]:
        for url, status in ((srv.deployment.frontend.node.http_url, 500), (lb.http_url, 400)):
            req = urllib.request.Request(f"http://{url}/v2/models/tiny/infer", data=body)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            text = err.value.read().decode()
            assert err.value.code == status and says in text, (url, body, text)
    assert _answer(lb.http_url) == (200, "")


def test_a_stamp_outside_the_clock_bound_is_ignored_counted_and_exported(tier):
    """A stamp the balancer's host could not have made with clocks in sync (sent straight
    to the router here, its header name capitalised as urllib sends it): the request is
    served as if unstamped, the stamp counted, with other parameters or alone."""
    srv, _ = tier
    router = srv.deployment.http_url
    counts = srv.deployment.core.stamps.counts
    now_us = time.time_ns() // 1000
    ahead, stale = counts["ahead"], counts["stale"]
    assert _answer(router, {"x-poolpipe-arrival-us": str(now_us + 60_000_000)}) == (200, "")
    assert _answer(router, {"x-poolpipe-arrival-us": str(now_us - 60_000_000)}) == (200, "")
    alone = {"x-poolpipe-arrival-us": str(now_us + 60_000_000)}
    assert _answer(router, alone, slo=False) == (200, "")
    assert (counts["ahead"], counts["stale"]) == (ahead + 2, stale + 1)
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics") as r:
        text = r.read().decode()
    assert f'poolpipe_arrival_stamps_total{{outcome="ahead"}} {ahead + 2:.1f}' in text


def test_a_burst_through_the_balancer_is_counted_from_its_stamp(tier):
    """N_BURST requests at once through HAProxy, SLO 100 ms: the router's deadlines run from
    the balancer's stamps, so what waited in its Triton's front end counts. The router
    counts as on time what the client received on time, give or take the way between the
    client and the balancer."""
    from testbed.loadgen import burst

    srv, lb = tier
    core = srv.deployment.core
    x = np.zeros((1, 3, 32, 32), np.float32)
    used = core.stamps.counts["used"]
    core.take_window()
    shots = burst(lb.http_url, "tiny", {"input": x}, N_BURST, SLO_MS)
    win = core.take_window().models[0]
    assert core.stamps.counts["used"] == used + N_BURST
    ok = [s for s in shots if s.outcome == "ok"]
    dropped = [s for s in shots if s.outcome == "dropped"]
    assert len(ok) + len(dropped) == N_BURST, {s.outcome for s in shots}
    assert win.arrivals == N_BURST and win.late == 0, win

    def client_within(ms: float) -> int:
        return sum(s.latency_s <= ms / 1e3 for s in ok)

    # The client's clock starts before the balancer's stamp and stops when its kernel has
    # the answer: what the router counts on time is at least what the client saw on time,
    # and reached the client within the SLO and its way in and out through the balancer
    # (WAY_MS: a few ms on a quiet host, tens while other tests load its two cores; before
    # the stamp, the router counted 148 answers on time of a burst the client saw none of).
    assert client_within(SLO_MS) <= win.on_time <= client_within(SLO_MS + WAY_MS), (
        client_within(SLO_MS),
        client_within(SLO_MS + WAY_MS),
        win,
    )
    assert win.dropped == len(dropped), win


def test_a_grpc_clients_deadline_reaches_the_router_through_the_balancer(tier):
    """A gRPC client's deadline (its time left as grpc-timeout) is copied by the balancer
    beside its stamp: a deadline before the request's SLO ends it there (counted
    shortened), one after leaves it (kept); both are served. A client's deadline already
    spent is dropped by the router (an explicit answer, counted dropped), and one written
    wrong is refused naming the header and its format."""
    import tritonclient.grpc as tg

    srv, lb = tier
    core = srv.deployment.core
    counts = core.client_deadlines
    before = dict(counts)
    client = tg.InferenceServerClient(lb.grpc_url)
    x = tg.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    slo = {"slo_ms": 10 * SLO_MS}
    client.infer("tiny", [x], parameters=slo, client_timeout=30.0)  # after the SLO
    client.infer("tiny", [x], parameters=slo, client_timeout=0.5)  # before it
    client.infer("tiny", [x], parameters=slo)  # no deadline
    client.close()
    assert counts["kept"] == before["kept"] + 1, dict(counts)
    assert counts["shortened"] == before["shortened"] + 1, dict(counts)

    router = srv.deployment.http_url
    core.take_window()
    code, text = _answer(router, {"X-Poolpipe-Timeout": "1n"})
    assert code == 503 and DROP_MARKER in text, (code, text)
    assert core.take_window().models[0].dropped == 1
    code, text = _answer(router, {"x-poolpipe-timeout": "100ms"})
    assert code == 400 and "x-poolpipe-timeout" in text and "100ms" in text, (code, text)


def test_lb_status_and_render_from_the_inventory(tier, tmp_path, capsys):
    from poolpipe_cli import main

    _, lb = tier
    path = tmp_path / "inventory.toml"
    path.write_text(lb.inv.to_toml())
    assert main(["lb", "status", "--nodes", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 router(s) ready" in out, out
    assert main(["lb", "render", "--nodes", str(path), "-o", str(tmp_path / "h.cfg")]) == 0
    rendered = (tmp_path / "h.cfg").read_text().splitlines()
    assert rendered[1:] == render(lb.inv).splitlines()[1:]  # all but the line naming the file


def test_readiness_fails_while_the_router_has_no_live_path(tier):
    """The node dies: the router's readiness check says so (503, naming the model), the
    balancer stops sending to it (its answer: 503 from HAProxy, no router behind it); the
    node back, both serve again."""
    srv, lb = tier
    assert _ready(srv) == (200, _ready(srv)[1]) and _ready(srv)[1]["ready"] is True
    dep = srv.deployment
    (name,) = dep.nodes
    dep.nodes[name].kill()
    _through(dep.http_url)  # a call fails: the node is down at once
    _until(lambda: _ready(srv)[0] == 503, "readiness fails")
    _, body = _ready(srv)
    assert body["ready"] is False and "no live path for model(s) tiny" in body["why"], body
    _until(lambda: _through(lb.http_url) == 503, "the balancer takes the router out")
    dep.restart_node(name)
    _until(lambda: _ready(srv)[0] == 200, "readiness back", 30.0)
    _until(lambda: _through(lb.http_url) == 200, "the balancer sends to it again")


# ---------------------------------------------------------------------- two routers


@pytest.fixture
def pair(tier, onboarded_tiny, tmp_path_factory):  # noqa: F811
    """A second router with its own node (a shard of its own) beside the first, and a
    balancer over both (a new one per test: each test stops the second router)."""
    srv0, lb0 = tier
    wh, _ = onboarded_tiny
    tmp = tmp_path_factory.mktemp("pair")
    http, grpc, ready, lb_http, lb_grpc = free_ports(5)
    # stop grace: the balancer's checks (every 100 ms, two failed) see it draining first
    srv1 = _router(wh, tmp / "router1", http, grpc, ready, stop_grace_s=0.5)
    r0 = {k: split_address(getattr(lb0.inv.routers[0], k))[1] for k in ("http", "grpc", "ready")}
    r1 = {"http": http, "grpc": grpc, "ready": ready}
    data = _toml(two_routers_toml(r0, r1, {"http": lb_http, "grpc": lb_grpc}))
    lb = Balancer(parse_inventory(data), tmp / "lb")
    try:
        lb.start()
        _until(lambda: _through(lb.http_url) == 200, "the balancer sends to the routers")
        yield srv0, srv1, lb
    finally:
        lb.stop()
        srv1.close()


def _load(lb, seconds: float, event_at: float, event) -> tuple[list, float]:
    """Four clients through the balancer for `seconds`; `event()` at `event_at` s. Returns
    (sent s, took s, status) per request and when the event happened."""
    import concurrent.futures as cf

    results: list[tuple[float, float, int]] = []
    t0 = time.monotonic()

    def client() -> None:
        while time.monotonic() - t0 < seconds:
            sent = time.monotonic()
            code = _through(lb.http_url)
            results.append((sent - t0, time.monotonic() - sent, code))

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client) for _ in range(4)]
        time.sleep(event_at)
        at = time.monotonic() - t0
        event()
        for f in futures:
            f.result(30)
    return results, at


def test_a_router_stopped_under_load_fails_no_request(pair):
    """The second router stopped as SIGTERM stops it: its readiness check fails first while
    it goes on serving for its grace, so the balancer sends new requests to the first
    before it stops: every request is answered."""
    _, srv1, lb = pair
    used = srv1.deployment.core.stamps.counts["used"]
    results, _ = _load(lb, 3.0, 1.0, srv1.close)
    assert srv1.deployment.core.stamps.counts["used"] > used  # it served before the stop
    assert [r for r in results if r[2] != 200] == []
    assert len(results) > 8


def test_a_router_lost_under_load_costs_only_its_requests_in_flight(pair):
    """Requests through the balancer from four clients, spread over both routers; the
    second router's Triton killed: every request is answered (none hangs), errors only
    for those in flight on it around the kill, then the first router serves them all."""

    srv0, srv1, lb = pair
    used = [s.deployment.core.stamps.counts["used"] for s in (srv0, srv1)]
    results, kill = _load(lb, 4.0, 1.5, srv1.deployment.frontend.node.kill)
    before = [r for r in results if r[0] + r[1] < kill]  # answered before the kill
    assert before and all(code == 200 for _, _, code in before), before
    served = [
        s.deployment.core.stamps.counts["used"] - u for s, u in zip((srv0, srv1), used, strict=True)
    ]
    assert min(served) > 0, served  # both routers took requests before the kill
    _only_in_flight_failed(results, kill)
    assert _ready(srv1)[0] == 503


def _only_in_flight_failed(results: list, kill: float) -> None:
    """No request hung; errors only for those in flight on the router lost at `kill`, or
    sent before the balancer's checks (every 100 ms, two failed) took it out; every one a
    second after it answered."""
    assert max(r[1] for r in results) < 5.0  # none hung
    errors = [r for r in results if r[2] != 200]
    assert all(sent <= kill + 0.5 <= sent + took + 0.5 for sent, took, *_ in errors), (
        kill,
        errors,
    )
    after = [r for r in results if r[0] > kill + 1.0]
    assert len(after) > 8 and all(r[2] == 200 for r in after), after


# ---------------------------------------------------------------------- adoption


def _nodes_and_tier(tmp_path, r0: dict, r1: dict, lb: dict):
    """Two running cpu-1t nodes, n0 on server s0 and n1 on s1, and the inventory in which
    router r0 drives n0 and r1 drives n1 behind one balancer."""
    from triton_backend.node.triton import TritonNode

    nodes = [
        TritonNode(f"n{k}", "cpu-1t", tmp_path / f"repo{k}", tmp_path).start() for k in range(2)
    ]
    text = two_routers_toml(r0, r1, lb).replace('"cpu-2t"', '"cpu-1t"')
    for k, n in enumerate(nodes):
        text = text.replace(f'grpc = "127.0.0.1:{k + 1}"', f'grpc = "{n.grpc_url}"')
    for r in (r0, r1):  # weight agents, and HAProxy's statistics to read the weights from
        ready = f'ready = "127.0.0.1:{r["ready"]}"'
        text = text.replace(ready, f'{ready}\nagent = "127.0.0.1:{r["agent"]}"\nweight = 10')
    text = text.replace("[balancer]", f'[balancer]\nstats = "127.0.0.1:{lb["stats"]}"')
    return nodes, parse_inventory(_toml(text))


def _weights(lb) -> dict[str, int]:
    """Each router's weight in HAProxy now (its gRPC back end), from the statistics page."""
    with urllib.request.urlopen(f"http://{lb.inv.balancer.stats}/;csv", timeout=5) as r:
        rows = [line.split(",") for line in r.read().decode().splitlines()]
    col = rows[0].index("weight")
    servers = [row for row in rows[1:] if row[0] == "routers_grpc" and row[1] != "BACKEND"]
    return {row[1]: int(row[col]) for row in servers}


def _tier_router(wh: str, workspace, inv, name: str, ports: dict):
    from flows.replan import on_reshard
    from poolpipe.domain.plan import manual_plan
    from poolpipe.store.warehouse import Warehouse
    from triton_backend.deploy.serving import ServingProcess

    with Warehouse.open(wh) as w:  # its throughput from the profile, as a planner's
        profile = w.load_profile("tiny")
    first = hand_plan([(0, 4, 1)], batch=4)
    plan = manual_plan("tiny", SLO_MS * 1e3, first.cluster, [(0, 4, "cpu-1t", 1)], 4, profile)
    return ServingProcess(
        plan,
        wh,
        workspace,
        stats_interval_s=3600,
        ready_port=ports["ready"],
        agent_port=ports["agent"],
        http_port=ports["http"],
        grpc_port=ports["grpc"],
        tier=(inv, name),
        adopt_after_s=1.0,
        on_reshard=on_reshard(warehouse=wh),
    )


def _crash(srv) -> None:
    """The router process dies as under kill -9: nothing is taken off its nodes."""
    srv._stop.set()
    srv.ready.close()  # its ports go with its process
    srv.agent.close()
    srv.deployment.frontend.stop()
    srv.deployment.core.stop()


def _held(nodes) -> dict[str, list[str]]:
    return {n.name: sorted(n.models()) for n in nodes}


@needs_haproxy
def test_a_lost_routers_nodes_are_adopted_and_handed_back_when_it_returns(
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """Two routers, each with a node, behind the balancer, under load. The second dies as
    under kill -9 (its models stay on its node): the first stops hearing its readiness
    check, unloads what it left (fencing it: a late reload of its is refused), re-plans
    for both nodes through the reshard flow and rolls out; the balancer sends everything
    to it; no request hangs and errors are only those in flight at the death. The second
    started again waits until the first has handed its node back, then both serve. The
    first's weight agent has HAProxy send it twice the share (or more) while it drives both
    nodes."""
    import threading

    from triton_backend.node.triton import stop_nodes

    wh, _ = onboarded_tiny
    ports = free_ports(11)
    r0, r1 = (
        dict(zip(("http", "grpc", "ready", "agent"), ports[i : i + 4], strict=True)) for i in (0, 4)
    )
    lb_ports = {"http": ports[8], "grpc": ports[9], "stats": ports[10]}
    nodes, inv = _nodes_and_tier(tmp_path, r0, r1, lb_ports)
    servers: list = []
    lb = Balancer(inv, tmp_path / "lb")
    results: list[tuple[float, float, int, str]] = []
    done = threading.Event()
    t0 = time.monotonic()

    def client() -> None:
        while not done.is_set():
            sent = time.monotonic()
            code, why = _answer(lb.http_url)
            results.append((sent - t0, time.monotonic() - sent, code, why))

    clients = [threading.Thread(target=client) for _ in range(2)]
    try:
        servers.append(_tier_router(wh, tmp_path / "r0", inv, "r0", r0))
        servers.append(_tier_router(wh, tmp_path / "r1", inv, "r1", r1))
        srv0, srv1 = servers
        assert _held(nodes) == {"n0": ["tiny__b00-04__r0-g0"], "n1": ["tiny__b00-04__r1-g0"]}
        lb.start()
        _until(lambda: _through(lb.http_url) == 200, "the balancer sends to the routers")
        _until(lambda: _weights(lb) == {"r0": 10, "r1": 10}, "HAProxy asks the weight agents")
        for c in clients:
            c.start()
        time.sleep(1.0)
        killed = time.monotonic() - t0
        _crash(srv1)
        _until(lambda: srv0.member.shard == ("n0", "n1"), "r0 adopts n1 and rolls out", 30.0)
        adopted = time.monotonic() - t0 - killed
        assert _held(nodes) == {"n0": ["tiny__b00-04__r0-g1"], "n1": ["tiny__b00-04__r0-g1"]}
        assert {p.gpu: p.count for p in srv0.deployment.plan.cluster.pools} == {"cpu-1t": 2}
        assert srv0.deployment.generation == 1
        # its weight agent: twice the GPUs, re-planned (the planner may batch more than the
        # first plan, written by hand, did): twice its first plan's objective or more
        pct = int(srv0.weight_percent().rstrip("%"))
        assert pct >= 190, pct
        _until(lambda: abs(_weights(lb)["r0"] - pct / 10) <= 1, f"HAProxy weighs r0 {pct}%")
        assert "adopting node(s) n1 of router(s) r1 (gone)" in srv0.member.reshards[-1]["trigger"]
        # fenced: the dead router's own refill of "its" node leaves it to r0
        srv1.deployment._refill_url(nodes[1].grpc_url)
        assert _held(nodes)["n1"] == ["tiny__b00-04__r0-g1"]
        time.sleep(1.0)
        since = time.monotonic() - t0
        servers[1] = _tier_router(wh, tmp_path / "r1b", inv, "r1", r1)  # waits for n1
        assert "handing node(s) n1 back" in srv0.member.reshards[-1]["trigger"]
        assert _held(nodes) == {"n0": ["tiny__b00-04__r0-g2"], "n1": ["tiny__b00-04__r1-g0"]}
        _until(lambda: servers[1].deployment.core.stamps.counts["used"] > 0, "r1 serves again")
        served = time.monotonic() - t0
        # r1 weighs as at first; r0 as its agent says for its own node again (re-planned)
        back = int(srv0.weight_percent().rstrip("%"))
        assert 90 <= back < pct, (back, pct)
        _until(
            lambda: _weights(lb)["r1"] == 10 and abs(_weights(lb)["r0"] - back / 10) <= 1,
            "both weigh as their shards serve",
        )
    finally:
        done.set()
        for c in clients:
            if c.is_alive():
                c.join(30)
        lb.stop()
        for srv in servers[::-1]:
            srv.close()
        stop_nodes(nodes)
    assert adopted < 30.0, adopted

    # Each router holds a batch until the last moment its deadline allows; on two cores a
    # router's Triton starting or a node loading beside it can make that batch run over,
    # and the router then drops it explicitly at the deadline (its answer says so): an
    # overload answer, not a failure. Only while a node was taken over and loaded (from the
    # kill to the rollout's end) or a router started again (until it served), and a second
    # after: a request explicitly dropped at any other time fails the test, as does
    # anything else.
    def starting(sent: float, took: float) -> bool:
        windows = ((killed, killed + adopted + 1.0), (since, served + 1.0))
        return any(sent <= end and start <= sent + took for start, end in windows)

    dropped = [r for r in results if r[2] == 503 and DROP_MARKER in r[3]]
    assert all(starting(r[0], r[1]) for r in dropped), (dropped, killed, adopted, since, served)
    results = [r for r in results if r not in dropped]
    _only_in_flight_failed(results, killed)
    assert [r for r in results if r[0] > since and r[2] != 200] == []


# ---------------------------------------------------------------------- bad input


def test_a_node_given_to_two_routers_is_refused_naming_both():
    text = two_routers_toml(R0, R1, LB).replace('nodes = ["n1"]', 'nodes = ["n0"]')
    with pytest.raises(TierError, match="node n0 is given to routers r0 and r1"):
        parse_inventory(_toml(text))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda t: t.replace('"127.0.0.1:2003"', '"127.0.0.1:1003"'), "is also router r0's ready"),
        (lambda t: t.replace('nodes = ["n1"]', 'nodes = ["nx"]'), "node 'nx' is not among"),
        (lambda t: t.replace('nodes = ["n1"]\n', ""), "router(s) r1 list no nodes"),
        (lambda t: t.replace("check_ms = 100", "check_ms = 1"), "check_ms = 1 must be at least"),
        (lambda t: t.replace("[balancer]", "[balancer]\nport = 3"), "unknown key(s) port"),
        (lambda t: t.replace('name = "r1"', 'name = "r/1"'), "a router's name is letters"),
    ],
)
def test_a_router_tier_that_cannot_be_deployed_is_refused(change, error):
    text = two_routers_toml(R0, R1, LB)
    parse_inventory(_toml(text))  # as given: fine
    with pytest.raises((TierError, InventoryError), match=re.escape(error)):
        parse_inventory(_toml(change(text)))


def test_the_inventory_with_its_router_tier_reads_back_from_its_toml():
    inv = parse_inventory(_toml(tier_toml(R0, LB, 'nodes = ["n0"]\nweight = 3')))
    again = parse_inventory(_toml(inv.to_toml()))
    assert (again.routers, again.balancer) == (inv.routers, inv.balancer)
    assert again.routers[0].weight == 3 and again.routers[0].nodes == ("n0",)


def test_haproxy_missing_is_named_with_the_fix():
    with pytest.raises(BalancerError, match="apt-get install haproxy"):
        find_haproxy("no-such-haproxy-here")


@needs_haproxy
def test_a_balancer_port_taken_is_named_with_its_holder(tmp_path):
    lb_http, lb_grpc = free_ports(2)
    inv = parse_inventory(_toml(tier_toml(R0, {"http": lb_http, "grpc": lb_grpc})))
    with socket.socket() as s:
        s.bind(("127.0.0.1", lb_grpc))
        s.listen()
        with pytest.raises(Exception, match=f"gRPC port {lb_grpc} on 127.0.0.1 is taken by"):
            Balancer(inv, tmp_path).start()
    assert "server r0 127.0.0.1:1001 weight 1 check addr 127.0.0.1 port 1003" in render(inv)


def _two_shards(tmp_path):
    text = two_routers_toml(R0, R1, LB)
    path = tmp_path / "inventory.toml"
    path.write_text(text)
    return path


def test_serve_as_a_router_of_the_inventory_takes_its_shard_and_addresses(tmp_path):
    import argparse

    from poolpipe.domain.inventory import load_inventory
    from poolpipe.errors import PoolpipeError
    from poolpipe_cli.plans import _cluster_arg
    from poolpipe_cli.serve import _router_shard

    path = _two_shards(tmp_path)
    inv = load_inventory(path)
    args = argparse.Namespace(
        router="r1",
        listen="127.0.0.1",
        http_port=0,
        grpc_port=0,
        ready_port=0,
        workspace=str(tmp_path / "ws"),
        nodes=str(path),
    )
    shard = _router_shard(args, inv)
    assert [n.name for n in shard.nodes] == ["n1"] and [s.name for s in shard.servers] == ["s1"]
    assert (args.listen, args.http_port, args.grpc_port, args.ready_port) == (
        "127.0.0.1",
        2001,
        2002,
        2003,
    )
    # what it re-plans for: the shard, written where --nodes now points
    assert [n.name for n in load_inventory(args.nodes).nodes] == ["n1"]
    plan_args = argparse.Namespace(inventory=str(path), cluster=None, router="r0")
    assert [(p.gpu, p.count) for p in _cluster_arg(plan_args).pools] == [("cpu-1t", 1)]
    args.router, args.http_port = "r0", 8000
    with pytest.raises(PoolpipeError, match="leave out --http-port"):
        _router_shard(args, inv)
    args.http_port, args.router = 0, "r9"
    with pytest.raises(InventoryError, match=r"no router 'r9' \(r0, r1\)"):
        _router_shard(args, inv)
    with pytest.raises(PoolpipeError, match="give --nodes INVENTORY"):
        _router_shard(args, None)
