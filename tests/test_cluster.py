"""Serving on an emulated multi-host cluster (docs/design/cluster.md): each server a network
namespace with its own address and a 1 Gbit/s `tc`-limited NIC, a `poolpipe node` in each,
the router in the root namespace attaching to them by an inventory and uploading its
partition models through Triton's model repository API. Skipped, with the reason, where
namespaces cannot be made."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from poolpipe.client.control import new_token_file, node_key, read_token
from poolpipe.domain.inventory import Inventory, InventoryError, InventoryNode, load_inventory
from testbed.netns import EmulatedCluster, EmulationError, unavailable
from tests.test_serving import (
    SLO_MS,
    _grpc,
    _infer,
    onboarded_tiny,  # noqa: F401 (a fixture)
    two_partition_plan,
    whole_model,
)
from triton_backend import HOPS_OUTPUT
from triton_backend.node.triton import NodeError, RemoteNode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two servers, a cpu-1t node on each whose management APIs need the cluster's token,
    every feature map (the tiny model's are 2-16 KB) sent through the next node's feed."""
    work = tmp_path_factory.mktemp("cluster")
    token_file = work / "token"
    new_token_file(token_file)
    with EmulatedCluster(2, work, bandwidth_gbps=1.0) as c:
        c.token_file = token_file
        with _environment(POOLPIPE_FEED_MIN_BYTES="1"):  # (the nodes' Triton inherits it)
            for k in range(2):
                c.start_node(k, "cpu-1t", wait=False, token_file=token_file)
        for k in range(2):
            c.wait_node(k)
        yield c


@contextlib.contextmanager
def _environment(**values: str):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _keep_asking(dep, answers: list, stop, pause_s: float = 0.0) -> None:
    """One client asking `dep` for a tiny input's answer until `stop` is set: the output's
    shape, or the exception, appended to `answers` each time."""
    mod, c = _grpc(dep)
    x = np.zeros((1, 3, 32, 32), np.float32)
    while not stop.is_set():
        try:
            answers.append(_infer(mod, c, x).as_numpy(dep.ios[0].outputs[0].name).shape)
        except Exception as exc:
            answers.append(exc)
        if pause_s:
            time.sleep(pause_s)


def _key(cluster) -> str:
    return node_key(read_token(cluster.token_file))


def _loaded(inv: Inventory, key: str) -> list[str]:
    from triton_backend.node.triton import RemoteNode

    return sorted(
        m for n in inv.nodes for m in RemoteNode(n.name, n.device, n.grpc, key=key).models()
    )


def test_router_serves_on_nodes_of_other_hosts(cluster, onboarded_tiny, tmp_path):  # noqa: F811
    from triton_backend.deploy.deployment import Deployment

    wh, _ = onboarded_tiny
    inv = load_inventory(cluster.write_inventory())
    before = [cluster.link_bytes(k) for k in range(2)]
    token = read_token(cluster.token_file)
    dep = Deployment.up(two_partition_plan(), wh, tmp_path / "router", inventory=inv, token=token)
    try:
        assert sorted(n.grpc_url for n in dep.nodes.values()) == sorted(n.grpc for n in inv.nodes)
        # each server's NIC carried its partition model (uploaded, not read from a disk)
        for k, (down, _) in enumerate(before):
            assert cluster.link_bytes(k)[0] - down > 20_000
        for s in cluster.nodes:  # the nodes' repositories stay empty
            assert not any((cluster.workspace / s.node_name / "repo").iterdir())
        mod, client = _grpc(dep)
        x = np.random.default_rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32)
        # Each generation's first batch, on two cores shared with the test's own process:
        # this checks the answers, not their latency (a generous SLO).
        slow = {"slo_ms": 10 * SLO_MS}
        got = _infer(mod, client, x, parameters=slow).as_numpy(dep.ios[0].outputs[0].name)
        want = whole_model(wh).run(None, {"input": x})[0]
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
        # a rollout uploads the new generation and unloads the old one from the nodes
        r = dep.rollout(two_partition_plan(cut=1), wh)
        assert r.status == "done", r.reason
        assert _loaded(inv, _key(cluster)) == ["tiny__b00-01__g1", "tiny__b01-04__g1"]
        # an anonymous client of a node may not unload what the router loaded
        node = inv.nodes[0]
        host = node.grpc.rsplit(":", 1)[0]
        r = httpx.post(f"http://{host}:8000/v2/repository/models/tiny__b00-01__g1/unload")
        assert r.status_code == 403
        with pytest.raises(NodeError, match="restricted"):
            RemoteNode(node.name, node.device, node.grpc).load("tiny__b00-01__g1")
        got = _infer(mod, client, x, parameters=slow).as_numpy(dep.ios[0].outputs[0].name)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
    finally:
        dep.down()
    # the nodes keep running, with this deployment's models gone
    assert _loaded(inv, _key(cluster)) == []


def test_bad_inventories_fail_before_anything_is_loaded(cluster, onboarded_tiny, tmp_path):  # noqa: F811
    from triton_backend.deploy.deployment import Deployment

    wh, _ = onboarded_tiny
    inv = cluster.inventory()
    one = Inventory(inv.servers, inv.nodes[:1], "one.toml")
    with pytest.raises(InventoryError, match=r"one.toml has live \(cpu-1t: needs 2, has 1\)"):
        Deployment.up(two_partition_plan(), wh, tmp_path / "a", inventory=one)
    down = inv.mark_down({inv.nodes[1].name})
    with pytest.raises(InventoryError, match="needs 2, has 1"):
        Deployment.up(two_partition_plan(), wh, tmp_path / "b", inventory=down)
    unreachable = str(list(cluster.subnet.hosts())[200])
    ghost = Inventory(
        inv.servers,
        (inv.nodes[0], InventoryNode("ghost", "s1", "cpu-1t", f"{unreachable}:8001")),
        "ghost.toml",
    )
    with pytest.raises(
        InventoryError, match=rf"not answering on gRPC: ghost \({unreachable}:8001\)"
    ):
        Deployment.up(two_partition_plan(), wh, tmp_path / "c", inventory=ghost)
    assert _loaded(inv, _key(cluster)) == []


def _shaped_mbit(s) -> tuple[float, float]:
    """A server's NIC as tc shapes it, Mbit/s of frames: (uplink, downlink)."""

    def rate_mbit(*cmd: str) -> float:
        out = subprocess.run([*cmd], capture_output=True, text=True, check=True).stdout
        value, unit = re.search(r" tbf .*? rate (\d+(?:\.\d+)?)([KMG])bit", out).groups()
        return float(value) * {"K": 1e-3, "M": 1.0, "G": 1e3}[unit]

    up = rate_mbit("ip", "netns", "exec", s.namespace, "tc", "qdisc", "show", "dev", s.peer)
    return up, rate_mbit("tc", "qdisc", "show", "dev", s.veth)


def test_each_nic_carries_the_planned_bandwidth_of_payload(cluster):
    """tc counts frames; the planner's 1 Gbit/s is TCP payload: each server's NIC is shaped
    at 1,514 / 1,448 of it both ways (its uplink in the namespace, its downlink on the
    bridge)."""
    want = 1000 * 1514 / 1448
    for s in cluster.nodes:
        up, down = _shaped_mbit(s)
        assert abs(up - want) / want < 0.005, (s.namespace, up)
        assert abs(down - want) / want < 0.005, (s.veth, down)


def test_links_shaped_faster_than_planned_one_way_only(tmp_path):
    """bench-links' arms: the uplinks at 4x the planned bandwidth, the downlinks as planned
    (the plan's figure stays the cluster's); a scale that is not two factors > 0 is refused
    before a namespace is made."""
    with EmulatedCluster(1, tmp_path, bandwidth_gbps=0.5, link_scale=(4.0, 1.0)) as c:
        assert c.bandwidth_gbps == 0.5
        up, down = _shaped_mbit(c.nodes[0])
        want = 500 * 1514 / 1448
        assert abs(up - 4 * want) / want < 0.02 and abs(down - want) / want < 0.005, (up, down)
    for bad in ((0.0, 1.0), (1.0, float("inf")), (1.0,)):
        with pytest.raises(EmulationError, match="links' scale"):
            EmulatedCluster(1, tmp_path, link_scale=bad)


def test_a_node_stops_cleanly_on_sigterm(cluster):
    cluster.stop_node(1, signal.SIGTERM)
    assert cluster.nodes[1].node.returncode == 0
    cluster.start_node(1, "cpu-1t", token_file=cluster.token_file)  # back for what runs next


def test_feature_maps_go_node_to_node(cluster, onboarded_tiny, tmp_path, monkeypatch):  # noqa: F811
    """transport="chain": the router sends a batch's input to the first node with the rest
    of its path; the first node sends its fp16 feature map straight to the second, whose
    answer goes straight to the router's inbox (or, with chain_answers="back", back along
    the chain). The same requests through the same plan with
    transport="router" (every hop sent from the router) cross the router's interface with
    each feature map twice more; through the chain, the feature maps cross from server 0
    to server 1 instead. Answers match the whole model, and a chain that is not signed
    with the cluster's key is refused by the node. Every map, and every input the router
    sends a node (the tiny model's are 49 KB: the router's threshold lowered here), goes
    through the receiving node's feed (node/feed.py)."""
    import tritonclient.grpc as grpcclient

    from triton_backend.deploy.deployment import Deployment
    from triton_backend.router import kserve_http

    monkeypatch.setattr(kserve_http, "FEED_MIN_BYTES", 1)

    wh, _ = onboarded_tiny
    inv = cluster.inventory()
    token = read_token(cluster.token_file)
    x = np.random.default_rng(5).standard_normal((4, 3, 32, 32)).astype(np.float32)
    want = whole_model(wh).run(None, {"input": x})[0]
    n = 25
    seen = {}
    for transport, answers in (("router", "auto"), ("chain", "auto"), ("chain", "back")):
        dep = Deployment.up(
            two_partition_plan(cut=1),
            wh,
            tmp_path / f"{transport}-{answers}",
            inventory=inv,
            token=token,
            transport=transport,
            chain_answers=answers,
        )
        try:
            first = next(p for p in dep.layout.placements if p.start == 0)
            fmap = dep.parts[first.partition].outputs
            fmap_bytes = len(x) * sum(
                int(np.prod(t.dims)) * np.dtype(t.dtype).itemsize for t in fmap
            )
            s0 = next(
                k for k, s in enumerate(cluster.nodes) if s.node_name == dep.nodes[first.node].name
            )
            s1 = 1 - s0
            mod, client = _grpc(dep)
            out_name = dep.ios[0].outputs[0].name
            before = (cluster.router_bytes(), cluster.link_bytes(s0), cluster.link_bytes(s1))
            maps = cluster.feature_maps()
            for _ in range(n):
                got = _infer(mod, client, x).as_numpy(out_name)
                assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
            seen[transport, answers] = (
                cluster.router_bytes() - before[0],
                cluster.link_bytes(s0)[1] - before[1][1],  # from server 0
                cluster.link_bytes(s1)[0] - before[2][0],  # to server 1
            )
            fed, inline = np.subtract(cluster.feature_maps(), maps)
            feeds = dep.core.stages.http._feeds.values()
            # the router's calls: every batch's inputs through the first node's feed
            assert sum(f.placed for f in feeds) >= n and not sum(f.inline for f in feeds)
            if transport == "chain":  # each map written into the second node's feed (a
                # node counts what it sent at its next batch: calibration's maps, one late)
                assert fed >= n - 1 and inline == 0, (fed, inline)
            inbox = dep.core.inbox
            if transport == "chain" and answers == "auto":  # each answer to the inbox
                assert inbox is not None and inbox.received >= n and not inbox.unexpected
            else:
                assert inbox is None
            if transport == "chain":  # the router knows each node's clock (one host's)
                _clocks_known(dep)
            if transport == "chain" and answers == "auto":
                # a chain not signed with the cluster's key is refused
                c = grpcclient.InferenceServerClient(dep.nodes[first.node].grpc_url)
                i = grpcclient.InferInput("input", list(x.shape), "FP32")
                i.set_data_from_numpy(x)
                chain = '[{"url": "10.0.0.99:8001", "model": "x"}]'
                with pytest.raises(Exception, match="not signed with this cluster's key"):
                    c.infer(
                        first.partition,
                        [i],
                        parameters={"poolpipe_next": chain, "poolpipe_sig": "0" * 64},
                    )
                _chains_keep_to_their_time(dep, c, i, first, token)
                c.close()
        finally:
            dep.down()
    payload = n * (x.nbytes + want.nbytes)
    router = seen["router", "auto"]
    for chain in (seen["chain", "auto"], seen["chain", "back"]):
        # through the router each feature map crosses its interface twice (in and out) ...
        assert router[0] - chain[0] >= 1.5 * n * fmap_bytes, (seen, n * fmap_bytes)
        # ... through the chain the router carries about the requests' own bytes
        assert chain[0] < 1.2 * payload, (seen, payload)
        # and the feature maps went from server 0 to server 1 directly
        assert chain[1] >= n * fmap_bytes and chain[2] >= n * fmap_bytes, seen


def _clocks_known(dep) -> None:
    """Every watched node's clock is known to the router (router/clocks.py), on this host
    the router's own within half the best round trip of its probes."""
    clocks, nodes = dep.core.clocks, sorted(dep.core.feeds)
    assert nodes
    for _ in range(100):
        if all(clocks.offset_ns(n) is not None for n in nodes):
            break
        time.sleep(0.05)
    for n in nodes:
        offset, rtt = clocks.offset_ns(n), clocks.round_trip_ns(n)
        assert offset is not None and rtt is not None, (n, rtt)
        assert abs(offset) <= rtt // 2 + 1, (n, offset, rtt)
    # and says so in its nodes' states (poolpipe status)
    states = dep.core.node_states()
    assert states and all(s["clock_error_us"] is not None for s in states), states


def _chains_keep_to_their_time(dep, c, inp, first, token: str) -> None:
    """A chain with no time left is not forwarded: work that can no longer be on time is
    not sent on to queue at the next node, out of the router's sight."""
    from poolpipe.client.control import chain_signature

    second = next(p for p in dep.layout.placements if p.start > 0)
    path = json.dumps([{"url": dep.nodes[second.node].grpc_url, "model": second.partition}])
    out = dep.ios[0].outputs[0].name
    params = {
        "poolpipe_next": path,
        "poolpipe_outputs": json.dumps([out]),
        "poolpipe_sig": chain_signature(node_key(token), path),
    }
    # a budget that the first hop's own compute uses up: not forwarded
    with pytest.raises(Exception, match="POOLPIPE_HOP 1: POOLPIPE_DEADLINE"):
        c.infer(first.partition, [inp], parameters={**params, "poolpipe_budget_us": "1"})
    # time enough: served through the chain
    r = c.infer(first.partition, [inp], parameters={**params, "poolpipe_budget_us": "30000000"})
    assert r.as_numpy(out).shape[0] == inp.shape()[0]
    # a feature map whose transfer is reserved later is held until then: sent no sooner
    # than "after_us" after the sending hop's compute began (on its node's clock)
    held = json.dumps(
        [{"url": dep.nodes[second.node].grpc_url, "model": second.partition, "after_us": 300000}]
    )
    params = {**params, "poolpipe_next": held, "poolpipe_budget_us": "30000000"}
    params["poolpipe_sig"] = chain_signature(node_key(token), held)
    r = c.infer(first.partition, [inp], parameters=params)
    start, _, sent = r.as_numpy(HOPS_OUTPUT)[0][:3]
    assert sent - start >= 300_000_000, (start, sent)
    # ... or at "at_ns" on its node's clock where that is sooner (the router's reserved
    # transfer start on the node's clock, router/clocks.py; this host's clock is theirs)
    at = time.monotonic_ns() + 200_000_000
    held = json.dumps(
        [
            {
                "url": dep.nodes[second.node].grpc_url,
                "model": second.partition,
                "after_us": 5_000_000,
                "at_ns": at,
            }
        ]
    )
    params = {**params, "poolpipe_next": held}
    params["poolpipe_sig"] = chain_signature(node_key(token), held)
    r = c.infer(first.partition, [inp], parameters=params)
    start, _, sent = r.as_numpy(HOPS_OUTPUT)[0][:3]
    assert at <= sent < start + 5_000_000_000, (at, start, sent)


def test_a_killed_node_is_routed_around_and_refilled_when_it_returns(
    cluster,
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """One partition on the nodes of both servers, chained transport; one server's node is
    killed (SIGKILL, its Triton with it) under load: its batch is retried on the other
    server's node and every request gets an answer (a result, or an explicit drop: no
    request hangs). The operator starts the node again, empty: the router's watch finds it
    answering without its models, uploads them and puts it back in service."""
    import threading
    import time

    from tests.test_serving import hand_plan
    from triton_backend.deploy.deployment import Deployment
    from triton_backend.node.triton import descendants, shm_regions
    from triton_backend.router.core import DROP_MARKER

    wh, _ = onboarded_tiny
    token = read_token(cluster.token_file)
    dep = Deployment.up(
        hand_plan([(0, 4, 2)]),
        wh,
        tmp_path / "router",
        inventory=cluster.inventory(),
        token=token,
        transport="chain",
        router_instances=4,
    )
    try:
        answers: list[object] = []
        stop = threading.Event()

        # daemon threads, stopped in any case: a failure must not leave them running
        threads = [
            threading.Thread(target=_keep_asking, args=(dep, answers, stop), daemon=True)
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            held = shm_regions(descendants(cluster.nodes[1].node.pid))
            cluster.stop_node(1, signal.SIGKILL)
            # a crash leaves its stubs' shared memory behind: stopping it removes it
            assert held and not [r for r in held if (Path("/dev/shm") / r).exists()]
            time.sleep(1.5)
            n_during = len(answers)
            down = dep.core.down_nodes()
            cluster.start_node(1, "cpu-1t", token_file=cluster.token_file)  # empty, same address
            deadline = time.monotonic() + 60
            while dep.core.runtime.recoveries < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert down, "the killed node was not taken out of service"
        assert not any(t.is_alive() for t in threads), "a request hung"
        errors = [str(a)[-300:] for a in answers if not isinstance(a, tuple)]
        assert all(DROP_MARKER in e for e in errors), errors[:3]
        assert len(errors) <= 0.05 * len(answers), errors[:3]
        assert len(answers) > n_during > 0
        assert dep.core.runtime.recoveries == 1 and not dep.core.down_nodes()
        assert _loaded(cluster.inventory(), _key(cluster)) == ["tiny__b00-04__g0"] * 2
        s = dep.core.stats["tiny"]
        assert s.failed == 0 and s.arrivals == len(answers)
    finally:
        dep.down()


def test_losing_a_server_re_plans_for_the_one_left_and_its_return_for_both(
    prefect_api,
    cluster,
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """The serving plan cuts the model across the two servers' nodes. Server 1's node dies
    (SIGKILL) under load: no path is left, requests fail saying so, and after the grace
    period the router runs the re-planning flow itself, which plans for the node left,
    judges the serving plan by what it still serves (nothing) and rolls the new plan out:
    requests are answered again, on server 0 alone. Its node started again (empty), the
    router finds it answering, and re-plans once more, for both."""
    import threading

    from flows.replan import on_failure
    from triton_backend.deploy.serving import ServingProcess

    wh, _ = onboarded_tiny
    inventory = cluster.write_inventory()
    srv = ServingProcess(
        two_partition_plan(),
        wh,
        tmp_path / "router",
        name="failover",
        stats_interval_s=3600,
        inventory=load_inventory(inventory),
        token=read_token(cluster.token_file),
        replan_on_failure=on_failure(
            inventory=str(inventory),
            warehouse=wh,
            deployment="failover",
            token_file=str(cluster.token_file),
        ),
        replan_grace_s=1.0,
    )
    stop = threading.Event()
    answers: list[object] = []
    try:
        dep = srv.deployment
        assert len({n.name for n in dep.nodes.values()}) == 2  # a partition on each server

        client = threading.Thread(target=_keep_asking, args=(dep, answers, stop, 0.05), daemon=True)
        client.start()
        time.sleep(1.0)
        cluster.stop_node(1, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not srv.replans and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.replans, "no re-plan after the node was lost"
        lost = srv.replans[0]
        assert lost["rolled_out"] and lost["serving_objective"] == 0.0, lost
        assert lost["down"] == cluster.nodes[1].node_name and "down" in lost["trigger"]
        on = {dep.nodes[p.node].name for p in dep.layout.placements}
        assert on == {cluster.nodes[0].node_name}  # the new plan uses the node left
        n = len(answers)
        time.sleep(2.5)  # longer than the grace: the node, still down, stays left out
        assert all(isinstance(a, tuple) for a in answers[n:]) and len(answers) > n
        assert any("no live path" in str(a) for a in answers[:n])  # said so meanwhile
        assert len(srv.replans) == 1 and [d["node"] for d in dep.down_nodes()] == [
            cluster.nodes[1].node_name
        ]

        cluster.start_node(1, "cpu-1t", token_file=cluster.token_file)  # empty, same address
        deadline = time.monotonic() + 90
        while len(srv.replans) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(srv.replans) == 2, srv.replans
        back = srv.replans[1]
        assert back["trigger"] == "every node back" and back["down"] == "none", back
        if back["rolled_out"]:
            on = {dep.nodes[p.node].name for p in dep.layout.placements}
            assert on == {s.node_name for s in cluster.nodes}
        else:  # the planner found nothing better on two nodes than on one
            assert back["new_objective"] <= back["serving_objective"] * 1.05, back
    finally:
        stop.set()
        srv.close()
    errors = [str(a) for a in answers if not isinstance(a, tuple)]
    assert all("POOLPIPE" in e or "no live path" in e for e in errors), errors[:3]  # explicit


def _whole_model_on_both(cluster, onboarded, tmp_path, **options):
    """A router serving the tiny model whole on both servers' nodes (one pool of two)."""
    from tests.test_serving import hand_plan
    from triton_backend.deploy.deployment import Deployment

    wh, _ = onboarded
    return Deployment.up(
        hand_plan([(0, 4, 2)]),
        wh,
        tmp_path / "router",
        inventory=cluster.inventory(),
        token=read_token(cluster.token_file),
        **options,
    )


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def test_a_node_process_killed_alone_leaves_service_at_once_and_returns_loaded_untouched(
    cluster,
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """`kill -9` of one node's `poolpipe node` process alone (as the OOM killer would), with
    no traffic: the router takes the node out of service at once, by its watch connection
    (there used to be no sign of it until a call failed, and its Triton, shutting down,
    still answered checks). The node started again, empty, with still no traffic: the
    router loads its partition and puts it back (it used to stay empty until a request
    came)."""
    dep = _whole_model_on_both(cluster, onboarded_tiny, tmp_path)
    try:
        victim = cluster.nodes[1]
        address = f"{victim.address}:8001"
        assert _wait(lambda: address in dep.core.watching, 10), "no watch connection"
        cluster.kill_node_process(1)
        assert _wait(lambda: address in dep.core.down_nodes(), 10), "still in service"
        (event,) = [e for e in dep.core.node_events if e[1] == address]
        assert event[2] == "down" and "watch connection" in event[3]
        time.sleep(1.5)  # its checks keep it out: no watch connection, no return
        assert dep.core.down_nodes() == {address} and dep.core.runtime.recoveries == 0

        cluster.start_node(1, "cpu-1t", token_file=cluster.token_file)  # empty, no traffic
        assert _wait(lambda: dep.core.runtime.recoveries == 1, 60), "not refilled without traffic"
        assert not dep.core.down_nodes()
        assert _loaded(cluster.inventory(), _key(cluster)) == ["tiny__b00-04__g0"] * 2
        states = [e[2] for e in dep.core.node_events if e[1] == address]
        assert states == ["down", "back"]
        mod, c = _grpc(dep)
        assert _infer(mod, c, np.zeros((1, 3, 32, 32), np.float32)).as_numpy(
            dep.ios[0].outputs[0].name
        ).shape == (1, 1000)
    finally:
        dep.down()


def test_a_node_drained_under_load_drops_nothing_and_takes_batches_again_once_undrained(
    cluster,
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """Under load, one of two nodes of a pool is drained: the drain waits for its batches,
    no request is dropped or failed, the node gets no inference while drained (its Triton's
    own counts), and again once undrained. (There was no drain.)"""
    import threading

    dep = _whole_model_on_both(cluster, onboarded_tiny, tmp_path, router_instances=4)
    victim = cluster.nodes[1]
    node = RemoteNode(victim.node_name, "cpu-1t", f"{victim.address}:8001", key=_key(cluster))

    def served() -> int:
        with contextlib.closing(node.grpc_client()) as c:
            stats = c.get_inference_statistics(headers=node._headers, as_json=True)
        return sum(int(m.get("inference_count", 0)) for m in stats.get("model_stats", []))

    answers: list[object] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_keep_asking, args=(dep, answers, stop), daemon=True)
        for _ in range(3)
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        before = served()
        out = dep.drain(victim.node_name, timeout_s=30)
        assert out["batches_left"] == 0 and before > 0
        time.sleep(0.3)  # its Triton counts a batch once it has answered it
        drained_at = served()
        n = len(answers)
        time.sleep(1.5)
        assert served() == drained_at and len(answers) > n  # served on the other node
        dep.undrain(victim.node_name)
        assert _wait(lambda: served() > drained_at, 10), "no batch after undrain"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        dep.down()
    errors = [str(a)[-300:] for a in answers if not isinstance(a, tuple)]
    assert not errors, errors[:3]
    s = dep.core.stats["tiny"]
    assert s.dropped == 0 and s.failed == 0 and s.arrivals == len(answers)


def test_the_nightly_replan_plans_for_the_routers_own_nodes_and_fails_when_rolled_back(
    prefect_api,
    cluster,
    onboarded_tiny,  # noqa: F811
    tmp_path,
):
    """The shipped nightly re-plan used to plan for the `local` cluster of
    local-clusters.toml and count the traffic of deployment `local`, whatever the router
    served; its rollout was rolled back ("needs 2 cpu-1t, has 1") and the run Completed.
    Now, given no cluster, it plans for the router's own inventory and counts the router's
    own deployment; a plan the router cannot take (here: for a named cluster of four
    nodes, the router having two) fails the run, with the reason."""
    from flows.replan import nightly_replan
    from poolpipe.errors import PoolpipeError
    from tests.test_serving import REPO, hand_plan
    from triton_backend.deploy.serving import ServingProcess

    wh, _ = onboarded_tiny
    srv = ServingProcess(
        hand_plan([(0, 4, 1)]),
        wh,
        tmp_path / "router",
        name="on-two-hosts",
        stats_interval_s=3600,
        inventory=cluster.inventory(),
        token=read_token(cluster.token_file),
    )
    try:
        dep = srv.deployment
        mod, c = _grpc(dep)
        for _ in range(3):
            _infer(mod, c, np.zeros((1, 3, 32, 32), np.float32))
        srv.flush_stats()
        router, tf = dep.grpc_url, str(cluster.token_file)
        done = nightly_replan(router=router, warehouse=wh, token_file=tf, margin=-0.99)
        assert done["rolled_out"] is True, done
        assert done["weights"] == {"tiny": 1.0}  # the traffic of "on-two-hosts" was found
        assert {p.gpu: p.count for p in dep.plan.cluster.pools} == {"cpu-1t": 2}
        with pytest.raises(PoolpipeError, match=r"not rolled out \(rolled back\)"):
            nightly_replan(
                router=router,
                warehouse=wh,
                token_file=tf,
                margin=-0.99,
                cluster="local-1t",
                clusters_file=str(REPO / "local-clusters.toml"),
            )
        assert {p.gpu: p.count for p in dep.plan.cluster.pools} == {"cpu-1t": 2}
    finally:
        srv.close()
