"""Arrival stamps from a load balancer (poolpipe.runtime.stamps): taken where plausible,
ignored and counted by why otherwise. Pure: the clocks' readings are passed in."""

from __future__ import annotations

import pytest

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import ArrivalStamps, BadRequest, capped_slo_us, client_timeout_us

WALL_NS = 1_795_569_861_000_000_000  # the router's wall clock now
MONO_NS = 5_000_000_000  # and its monotonic clock, read together


def test_a_plausible_stamp_is_the_arrival_on_the_monotonic_clock():
    s = ArrivalStamps(clock_bound_us=2_000, max_wait_us=1_000_000)
    waited_us = 300_000  # a burst that waited in the router's front end
    at = s.arrival_ns(str(WALL_NS // 1000 - waited_us), WALL_NS, MONO_NS)
    assert at == MONO_NS - waited_us * 1000
    assert s.counts["used"] == 1


def test_a_stamp_slightly_ahead_is_taken_as_now():
    s = ArrivalStamps(clock_bound_us=2_000, max_wait_us=1_000_000)
    assert s.arrival_ns(WALL_NS // 1000 + 1_500, WALL_NS, MONO_NS) == MONO_NS


@pytest.mark.parametrize(
    ("stamp", "why"),
    [
        (str(WALL_NS // 1000 + 2_500), "ahead"),  # the balancer's clock 2.5 ms ahead
        (str(WALL_NS // 1000 - 1_000_001), "stale"),  # or the router's far ahead
        ("yesterday", "malformed"),
        ("1.5e15", "malformed"),
        (1.795e15, "malformed"),
        (True, "malformed"),
        (None, "malformed"),
    ],
)
def test_an_implausible_stamp_is_ignored_and_counted(stamp, why):
    s = ArrivalStamps(clock_bound_us=2_000, max_wait_us=1_000_000)
    assert s.arrival_ns(stamp, WALL_NS, MONO_NS) is None
    assert s.counts[why] == 1 and sum(s.counts.values()) == 1


def test_bounds_that_cannot_hold_are_refused():
    with pytest.raises(PoolpipeError, match="clock bound < longest wait"):
        ArrivalStamps(clock_bound_us=5_000, max_wait_us=1_000)
    with pytest.raises(PoolpipeError, match="arrival-clock-bound-ms"):
        ArrivalStamps(clock_bound_us=-1)


@pytest.mark.parametrize(
    ("raw", "us"),
    [("100m", 100_000.0), ("99870u", 99_870.0), ("1S", 1e6), ("2M", 1.2e8), ("1H", 3.6e9),
     ("5000n", 5.0), (" 100m ", 100_000.0), ("12345678u", 12_345_678.0)],
)  # fmt: skip
def test_a_clients_time_left_is_read_as_grpc_writes_it(raw, us):
    assert client_timeout_us(raw) == us


@pytest.mark.parametrize(
    "raw", ["100ms", "100", "m", "123456789u", "-5m", "1.5S", "\uff110m", 100, None]
)
def test_a_clients_time_left_written_wrong_is_refused_naming_the_header(raw):
    with pytest.raises(BadRequest, match=r"x-poolpipe-timeout .*e\.g\. 100m"):
        client_timeout_us(raw)


def test_a_clients_deadline_ends_the_slo_only_where_it_comes_first():
    arrived = MONO_NS
    assert capped_slo_us(100_000.0, arrived, None) == 100_000.0
    assert capped_slo_us(100_000.0, arrived, arrived + 150_000_000) == 100_000.0
    assert capped_slo_us(100_000.0, arrived, arrived + 40_000_000) == 40_000.0
    assert capped_slo_us(100_000.0, arrived, arrived - 1_000_000) == -1_000.0  # spent
