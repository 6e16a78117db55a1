"""The router's executor without Triton: the runtime on the real clock in RouterCore, its
hop transports (relay, chain) over a fake stage client (testbed/fake_stages.py) whose nodes
run partitions as numpy functions on the event loop. What is checked here is the router's
own bookkeeping: answers, one stage call at a time per vGPU, hop reports and chain times,
failures that take a node out and timeouts that do not, retries on another node, and the
per-plan state dropped when a plan is retired. SLOs are generous: nothing here is timed."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import time

import numpy as np
import pytest

from poolpipe.offline.partitions import TensorSpec
from poolpipe.runtime import MarginMeter
from poolpipe.scheduler import make_data_plane
from testbed.fake_stages import FakePartition, FakeStages
from tests.factories import make_topology
from triton_backend.router.core import RouterCore
from triton_backend.router.served import DROP_MARKER, FAIL_MARKER, ModelIO, served_plan

F32 = np.dtype(np.float32)
IO = ModelIO("m", (TensorSpec("x", F32, (2,)),), (TensorSpec("y", F32, (2,)),))
PARTITIONS = {
    "p0": FakePartition(lambda xs: [xs[0] + 1], ("out_0",), lambda n: 0.002),
    "p1": FakePartition(lambda xs: [xs[0] * 2], ("y",), lambda n: 0.003),
}


def two_stages(second: list[int]):
    """Stage 0 on one vGPU (node n0), stage 1 on one vGPU per server in `second`."""
    return make_topology([([0], [2_000.0], 0.0), (second, [3_000.0], 0.0)], slo_us=2e6)


def router(topo, transport="router", timeout_s=5.0, **fake):
    nodes = {v.id: f"n{v.server}:8001" for v in topo.vgpus}
    plan = served_plan(topo, make_data_plane("eager", topo), {0: "p0", 1: "p1"}, nodes, [IO])
    made: list[FakeStages] = []

    def stages(loop):
        made.append(FakeStages(loop, PARTITIONS, **fake))
        return made[0]

    core = RouterCore(
        plan,
        stage_timeout_s=timeout_s,
        margin=MarginMeter(0.0, 0.0),
        recalibrate=False,
        transport=transport,
        stages=stages,
    ).start()
    return core, made[0]


def ask(core: RouterCore, x: np.ndarray) -> cf.Future:
    """One request of x's rows; the future holds (outputs, code, message)."""
    fut: cf.Future = cf.Future()

    def take() -> None:
        core.take("m", [x], None, time.monotonic_ns(), lambda *a: fut.set_result(a))

    core.loop.call_soon_threadsafe(take)
    return fut


def answers(core: RouterCore, n: int) -> list[tuple]:
    futs = [ask(core, np.full((1, 2), i, np.float32)) for i in range(n)]
    return [f.result(10) for f in futs]


def never_queued(stages: FakeStages) -> None:
    """No call reached a node before the node's last call had ended: the vGPU gates send
    one call at a time per vGPU, so none waits in a node's queue out of the runtime's
    sight."""
    by_node: dict[str, list] = {}
    for c in stages.calls:
        by_node.setdefault(c.node, []).append(c)
    for calls in by_node.values():
        for a, b in itertools.pairwise(calls):
            assert b.sent_s >= a.end_s, (a, b)


@pytest.mark.parametrize("transport", ["router", "chain"])
def test_every_request_is_answered_through_both_stages(transport):
    core, stages = router(two_stages([1]), transport)
    try:
        got = answers(core, 8)
        for i, (outs, code, msg) in enumerate(got):
            assert code is None, msg
            assert outs[0].tolist() == [[(i + 1) * 2.0] * 2]
        assert [c.model for c in stages.calls].count("p1") == 8
        if transport == "router":  # (a chain's later hops queue at their nodes)
            never_queued(stages)
        # the busy time the runtime booked is what the nodes took (from the router, the
        # call's way there and back too: at most a few ms each on a loaded host)
        for pool, model in enumerate(("p0", "p1")):
            took = sum(c.end_s - c.start_s for c in stages.calls if c.model == model) * 1e6
            assert took - 100 <= core.runtime.pool_busy_us()[pool] <= took + 8 * 20_000
        overheads = core.take_chain_overheads()
        assert len(overheads) == (8 if transport == "chain" else 0)
        assert core.stats["m"].on_time == 8 and core.in_flight() == 0
    finally:
        core.stop()


def test_a_chain_names_each_next_nodes_http_address_where_known():
    """Each hop after the first carries its node's KServe v2 HTTP address where the stage
    client knows it: the node before sends its feature map there (over tritonclient's
    gRPC, 4.3 MB took 1.1-2.6x as long to reach the model); gRPC only where none is known."""
    for http in ({"n1:8001": "n1:8000"}, {}):
        core, stages = router(two_stages([1]), "chain", http=http)
        try:
            for _, code, msg in answers(core, 4):
                assert code is None, msg
            later = [hop for chain in stages.chains for hop in chain[1:]]
            assert len(stages.chains) == 4 and len(later) == 4
            assert [hop.get("http") for hop in later] == [http.get("n1:8001")] * 4, later
        finally:
            core.stop()


@pytest.mark.parametrize("transport", ["router", "chain"])
def test_a_node_that_cannot_be_reached_is_taken_out_and_its_requests_retried(transport):
    core, stages = router(two_stages([1, 2]), transport, down={"n1:8001"})
    try:
        got = answers(core, 6)
        assert all(code is None for _, code, _ in got), got
        assert core.down_nodes() == {"n1:8001"}
        assert core.stats["m"].retried >= 1 and core.stats["m"].on_time == 6
        assert {c.node for c in stages.calls if c.model == "p1"} == {"n2:8001"}
        stages.down.clear()  # back: the watch finds it
        deadline = time.monotonic() + 5
        while core.down_nodes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.down_nodes() == set() and core.runtime.recoveries == 1
    finally:
        core.stop()


@pytest.mark.parametrize("transport", ["router", "chain"])
def test_inputs_leave_at_their_reserved_slots_on_the_first_servers_downlink(transport):
    """Stage 0 on two vGPUs of one node, reserved 50 ms a batch; each request's inputs
    take 20 ms on that server's downlink (topology.with_inputs): of two requests at once,
    the second goes to the other vGPU, and its call is sent when the first's inputs are
    through (its reserved slot on the link), not at once."""
    topo = make_topology(
        [([0, 0], [50_000.0], 0.0), ([1], [3_000.0], 0.0)], slo_us=2e6, inputs=20_000.0
    )
    core, stages = router(topo, transport)
    try:
        got = answers(core, 2)
        assert all(code is None for _, code, _ in got), got
        first, second = (c for c in stages.calls if c.model == "p0")
        assert second.sent_s - first.sent_s >= 0.020 - 0.002, (first, second)
        assert core.stats["m"].on_time == 2 and core.in_flight() == 0
    finally:
        core.stop()


@pytest.mark.parametrize("transport", ["router", "chain"])
def test_inputs_in_early_do_not_free_the_vgpu_before_its_turn_ends(transport):
    """Stage 0 on one vGPU, 40 ms a batch, each request's inputs 10 ms on the link. Of two
    requests at once the second's inputs are reserved at 10-20 ms (the link is free) but
    its compute at 50-90 (the vGPU runs the first until 50), and the node keeps it queued
    until then. Reported as started once its inputs were in (20 ms), the runtime moved its
    reservation to 20-60 and a third request at 30 ms got the vGPU at 60-100 where it is
    busy until 90: admitted on a finish of 103 ms and dropped as its batch ran past its
    deadline (118 ms). Reported as started at its reserved start, the third is reserved
    at 90-130: refused at once, its deadline out of reach."""
    topo = make_topology(
        [([0], [40_000.0], 0.0), ([1], [3_000.0], 0.0)], slo_us=2e6, inputs=10_000.0
    )
    core, _ = router(topo, transport, slow={"n0:8001": 0.038})  # p0: 2 + 38 ms
    try:
        first = [ask(core, np.full((1, 2), i, np.float32)) for i in range(2)]
        time.sleep(0.030)
        fut: cf.Future = cf.Future()
        x = np.full((1, 2), 2, np.float32)

        def take() -> None:
            core.take("m", [x], 88.0, time.monotonic_ns(), lambda *a: fut.set_result(a))

        core.loop.call_soon_threadsafe(take)
        assert all(f.result(10)[1] is None for f in first)
        _, code, message = fut.result(10)
        assert code is not None and DROP_MARKER in message, (code, message)
        reasons = dict(core.runtime.drop_reasons)
        assert reasons == {"deadline cannot be met": 1}, reasons
    finally:
        core.stop()


def test_calibration_times_a_pools_compute_apart_from_what_crossed_the_nic():
    """A call of 30 ms at batch 2 whose inputs are reserved at 5 ms a request on the link:
    20 ms of compute; less 4 ms more where its outputs took 2 ms a request back to the
    router (a feature map the next node gets instead). A later pool's call less its
    feature map in (3 ms a request); a first pool whose inputs are not timed keeps the
    call's time; transfers above the call (a NIC faster than the plan says) leave a
    quarter of the call, never nothing."""
    from triton_backend.router.calibration import _compute_us

    timed = make_topology([([0], [1.0, 2.0], 0.0), ([1], [1.0, 2.0], 3_000.0)], inputs=5_000.0)
    first, later = timed.pools
    assert _compute_us(first, 2, 30_000.0) == 20_000.0
    assert _compute_us(first, 2, 30_000.0, 4_000.0) == 16_000.0
    assert _compute_us(later, 2, 30_000.0) == 24_000.0
    assert _compute_us(two_stages([1]).pools[0], 2, 30_000.0) == 30_000.0
    assert _compute_us(first, 2, 8_000.0) == 2_000.0


def test_chain_times_place_each_hop_after_its_inputs_and_transfers():
    """Hop 0's inputs reserved 0-10, compute 10-20; hop 1's feature map 20-25, compute
    25-35. Sent at 100, back at 140, the nodes measured 10 µs each: 5 µs of overhead, hop
    1 placed back from the answer (130-140), its transfer before it (125-130), hop 0 before
    that, never before its inputs could be through (110)."""
    from poolpipe.scheduler.messages import Hop
    from triton_backend.router.transport import chain_times

    hops = [Hop(0, 0, -1, 0.0, 10.0, 10.0, 20.0), Hop(1, 1, 0, 20.0, 25.0, 25.0, 35.0)]
    measured = np.array([0, 10_000, 10_000, 50_000, 60_000, 60_000])
    times, overhead = chain_times(hops, measured, 100.0, 140.0)
    assert overhead == 5.0
    assert times == [(115.0, 125.0), (130.0, 140.0)]
    # an answer faster than the reservations: nothing placed before the inputs were through
    times, _ = chain_times(hops, measured, 100.0, 118.0)
    assert times[0][0] >= 110.0 and times[1] == (110.0, 118.0)


def test_a_chain_that_waits_as_reserved_has_no_overhead():
    """Hop 1's vGPU is reserved busy until 40 (its feature map in at 25): the chain's
    reservations end at 50. Sent at 100 and back at 155, the answer is 5 µs later than
    reserved, though 20 µs of the 55 are neither computed nor transferred: waiting for a
    vGPU or a link as booked is not what the reply margin holds back."""
    from poolpipe.scheduler.messages import Hop
    from triton_backend.router.transport import chain_times

    hops = [Hop(0, 0, -1, 0.0, 10.0, 10.0, 20.0), Hop(1, 1, 0, 20.0, 25.0, 40.0, 50.0)]
    measured = np.array([0, 10_000, 10_000, 65_000, 75_000, 75_000])
    times, overhead = chain_times(hops, measured, 100.0, 155.0)
    assert overhead == 5.0
    assert times[1] == (145.0, 155.0)
    _, ahead = chain_times(hops, measured, 100.0, 140.0)  # nodes that ran ahead of it
    assert ahead == -10.0
    # without timed inputs the path counts from its first compute's reserved start
    untimed = [Hop(0, 0, -1, 10.0, 10.0, 10.0, 20.0), hops[1]]
    assert chain_times(untimed, measured, 100.0, 145.0)[1] == 5.0


def test_a_running_router_keeps_the_heap_it_started_with_out_of_full_collections():
    """A full collection walks the whole heap with the GIL held and the router's loop still
    (hundreds of ms in a test process on a busy host: requests went past their deadline
    before the loop read them). What the process held when the router started is frozen
    until the last router of the process stops."""
    import gc

    before = gc.get_freeze_count()  # (0 unless another test left a router running)
    first, _ = router(two_stages([1]))
    second, _ = router(two_stages([1]))
    try:
        assert gc.get_freeze_count() > 1000  # (the modules imported by now, at least)
        first.stop()
        assert gc.get_freeze_count() > 1000  # the other one still runs
        assert answers(second, 2)[1][1] is None
    finally:
        first.stop()
        second.stop()
    assert gc.get_freeze_count() == before


def test_without_a_live_path_requests_fail_explicitly():
    core, _ = router(two_stages([1]), "chain", down={"n1:8001"})
    try:
        (outs, code, msg), *_ = answers(core, 3)
        assert outs is None and code == "INTERNAL" and msg.startswith(FAIL_MARKER), msg
        assert core.down_nodes() == {"n1:8001"}
    finally:
        core.stop()


@pytest.mark.parametrize("transport", ["router", "chain"])
def test_a_stage_call_that_times_out_leaves_its_node_in_service(transport):
    # An overloaded node that does not answer in time is not a dead one: its requests are
    # answered (their retry comes too late and is dropped), the node stays in service, and
    # it serves the next request once it is quick again.
    core, stages = router(two_stages([1]), transport, timeout_s=0.3, slow={"n1:8001": 1.0})
    try:
        outs, code, msg = ask(core, np.zeros((1, 2), np.float32)).result(10)
        assert outs is None and (msg.startswith(DROP_MARKER) or msg.startswith(FAIL_MARKER))
        assert core.down_nodes() == set()
        stages.slow.clear()
        time.sleep(1.0)  # the slow call ends on the node
        ((outs, code, msg),) = answers(core, 1)
        assert code is None, msg
    finally:
        core.stop()


def test_a_plan_switched_away_from_leaves_no_gates_behind():
    topo = two_stages([1])
    core, _ = router(topo)
    try:
        for k in range(1, 4):
            assert all(code is None for _, code, _ in answers(core, 3))
            new = served_plan(
                topo,
                make_data_plane("eager", topo),
                {0: "p0", 1: "p1"},
                dict(core.runtime.served.vgpu_node),
                [IO],
            )
            core.switch(new, flush_timeout_s=5.0)
            assert core.runtime.generation == k
            assert core.executor.generations_kept in ([], [k])  # nothing of older plans
            assert [u.generation for u in core.runtime.usage()] == [k]
        assert all(code is None for _, code, _ in answers(core, 3))
        assert core.executor.generations_kept == [3]
    finally:
        core.stop()
