"""The runtime's door, worked out by hand: what `slo_ms` a request may carry, the most rows a
plan could ever finish within an SLO (checked against a schedule written out by hand), and
the warning for an SLO that the reply margin leaves no room in."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.domain.cluster import load_cluster
from poolpipe.domain.plan import manual_plan
from poolpipe.errors import PoolpipeError
from poolpipe.runtime import BadRequest, slo_room_warnings
from poolpipe.runtime.intake import RowBounds, check_request, p99, request_slo_us
from tests.factories import make_topology

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("raw", "us"), [(None, None), (50, 50e3), (2.5, 2.5e3), ("80", 80e3)])
def test_a_good_slo_is_taken_in_microseconds(raw, us):
    assert request_slo_us(raw) == us


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (-5, "above 0"),
        (0, "above 0"),
        ("abc", "number of milliseconds"),
        ("inf", "finite"),
        (float("nan"), "finite"),
        (1e9, "above the most"),
        (True, "number of milliseconds"),
        ([1], "number of milliseconds"),
    ],
)
def test_a_bad_slo_is_refused_naming_the_value(raw, says):
    with pytest.raises(BadRequest, match=says) as err:
        request_slo_us(raw)
    assert repr(raw) in str(err.value) or f"{float(raw):g}" in str(err.value)


def test_most_rows_of_one_stage():
    # two vGPUs, 10 µs for one row, 15 µs for two: in 30 µs each runs two batches of two
    topo = make_topology([((0, 1), (10.0, 15.0), 0.0)], batch=2)
    assert RowBounds(topo).most(0, 30.0) == 8
    assert RowBounds(topo).most(0, 9.0) == 0  # not even one row


def test_most_rows_of_two_stages_with_a_transfer():
    # A 10 µs, move 5 µs, B 20 µs (one row each). By hand within 60 µs: row 1 A 0-10,
    # move 10-15, B 15-35; row 2 A 10-20, move 20-25, B 35-55; row 3's B would end at 75.
    topo = make_topology([((0,), (10.0,), 0.0), ((1,), (20.0,), 5.0)])
    assert RowBounds(topo).most(0, 60.0) == 2
    assert RowBounds(topo).most(0, 34.0) == 0  # 10 + 5 + 20 > 34


def test_check_request_names_what_is_wrong():
    topo = make_topology([((0,), (10.0,), 0.0)], slo_us=100.0)
    assert check_request(topo, "m", 1, None, 0.0) == (0, None)
    assert check_request(topo, "m", 1, "0.05", 0.0) == (0, 50.0)
    with pytest.raises(BadRequest, match="unknown model 'x'; this router serves m"):
        check_request(topo, "x", 1, None, 0.0)
    with pytest.raises(BadRequest, match="at least one row"):
        check_request(topo, "m", 0, None, 0.0)
    # 100 µs less a 30 µs margin: 7 rows of 10 µs at most
    assert check_request(topo, "m", 7, None, 30.0) == (0, None)
    with pytest.raises(BadRequest, match=r"8 rows cannot be served within 0.1 ms .*at most 7"):
        check_request(topo, "m", 8, None, 30.0)


def test_an_slo_the_margin_leaves_no_room_in_is_named():
    cluster = load_cluster(REPO / "local-clusters.toml", "local-1t")
    plan = manual_plan("googlenet", 23e3, cluster, [(0, 4, "cpu-1t", 1)], 1)
    m = plan.models[0]
    pipe = dataclasses.replace(m.pipelines[0], latency_us=8e3)
    plan = dataclasses.replace(plan, models=(dataclasses.replace(m, pipelines=(pipe,)),))
    assert slo_room_warnings(plan, 10e3) == []  # 13 ms left for an 8 ms pipeline
    (w,) = slo_room_warnings(plan, 25e3)
    assert (w.model, w.slo_ms, w.margin_ms, w.fastest_ms) == ("googlenet", 23, 25, 8)
    assert "every request at that SLO will be dropped" in str(w) and "--reply-margin-ms" in str(w)
    (w,) = slo_room_warnings(plan, 18e3)
    assert "5 ms are left" in str(w)


def test_the_reply_margin_follows_egress_within_floor_and_ceiling():
    from poolpipe.runtime import MarginMeter

    m = MarginMeter(floor_us=1_000.0, ceiling_us=10_000.0, window=100, every=10)
    assert m.margin_us == 1_000.0  # the floor until samples come
    assert not m.observe(500.0, [200.0] * 9)
    assert m.observe(500.0, [200.0])  # 10 egress samples: recomputed
    assert m.margin_us == pytest.approx(1_200.0)  # floor + egress p99
    m.observe(None, [50_000.0] * 10)  # a slow spell: held at the ceiling
    assert m.margin_us == 10_000.0
    m.observe(None, [100.0] * 100)  # the spell leaves the window
    assert m.margin_us == pytest.approx(1_100.0)
    f = m.figures()
    assert f["reply_margin_ms"] == pytest.approx(1.1) and f["ingress_p99_ms"] == pytest.approx(0.5)
    # chains of nodes: their overhead's p99 (negative ones count as 0) is held back too
    assert m.observe(None, path_us=[3_000.0] * 9 + [-50.0])
    assert m.margin_us == pytest.approx(1_000.0 + 100.0 + 3_000.0)
    assert m.figures()["chain_overhead_p99_ms"] == pytest.approx(3.0)
    with pytest.raises(PoolpipeError, match="floor <= ceiling"):
        MarginMeter(floor_us=5_000.0, ceiling_us=1_000.0)


def test_a_plan_that_cannot_serve_one_row_is_the_servers_condition_not_the_clients():
    """Stages of 6 + 4 µs, SLO 8 µs: not even one row at the model's SLO. That request is
    Unservable (the server's condition: answered 503, counted as refused); one asking for
    a shorter SLO than the model's is still the client's BadRequest."""
    from poolpipe.runtime import Unservable

    topo = make_topology([([0], [6.0], 0.0), ([1], [4.0], 0.0)], slo_us=8.0)
    with pytest.raises(Unservable, match=r"cannot serve a request within 0\.008 ms"):
        check_request(topo, "m", 1, None, 0.0)
    with pytest.raises(Unservable):  # a longer SLO that still does not fit
        check_request(topo, "m", 1, 0.009, 0.0)
    with pytest.raises(BadRequest, match="1 rows cannot be served"):
        check_request(topo, "m", 1, 0.005, 0.0)
    assert check_request(topo, "m", 1, 0.02, 0.0) == (0, 20.0)


def test_a_rollout_refusal_gives_both_numbers():
    from poolpipe.runtime.intake import RoomWarning

    w = RoomWarning("m", slo_ms=10.0, margin_ms=3.0, fastest_ms=8.0)
    assert w.refusal() == (
        "m: its SLO 10 ms less the router's measured reply margin 3.00 ms leaves 7.00 ms, "
        "less than its fastest pipeline's planned latency 8 ms"
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=1500))
def test_p99_is_the_nearest_rank_of_the_sorted_samples(xs):
    """p99 takes the top 1% only (heapq.nlargest): the value a full sort gives."""
    ranked = sorted(xs)
    assert p99(xs) == ranked[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
