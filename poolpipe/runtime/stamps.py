"""Arrival stamps from a load balancer in front of the router: when it received a request,
by its host's clock (wall time, µs since the epoch; HAProxy's `%[date(0,us)]`). A request's
deadline runs from that stamp when the stamp is plausible, so time a burst spends in the
router's own front end (Triton's HTTP/gRPC parsing, out of the router's sight) counts
against it. Plausible means within the clock bound the deployment assumes between the
balancer's host and the router's (chrony or PTP in a data centre: well under a millisecond)
and not older than the longest wait a front end is taken to impose; any other stamp is
ignored (the door's own arrival counts instead), counted by why.

A client's deadline travels too: a gRPC client that sets one sends the time it has left as
`grpc-timeout` when its call goes on the wire (so time the call waited in the client's own
channel is already spent), the balancer copies it into CLIENT_TIMEOUT beside its stamp,
and a request's SLO becomes the lesser of its own and that time left from the stamp. A
request the client has given up on is then dropped by the router (an explicit answer,
counted) instead of served for nobody and counted on time. Any client may send the header
itself, in the same format.

The policy is pure: the driver passes its clocks' readings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.intake import BadRequest

# The request parameter (a header the balancer sets and the router's Triton forwards).
ARRIVAL_STAMP = "x-poolpipe-arrival-us"
# The pattern of headers the router's Triton forwards to the door as parameters, in any
# case (HAProxy sends header names in lower case, other clients as they were written):
# ours, and the client's W3C trace context (traceparent, tracestate) for the router's traces.
FORWARDED_HEADERS = "(?i)(x-poolpipe-.*|traceparent|tracestate)"


def forwarded_header(params: Mapping[str, Any], name: str) -> Any:
    """A forwarded header's value among a request's parameters: as the balancer names it
    (lower case, `name`) or as a client wrote its name (any case); None where absent."""
    value = params.get(name)
    if value is None:
        value = next((v for k, v in params.items() if k.lower() == name), None)
    return value


# The time the client has left (gRPC's `grpc-timeout` format: up to 8 digits and a unit),
# counted from the request's arrival stamp (or the door's arrival where it has none).
CLIENT_TIMEOUT = "x-poolpipe-timeout"
TIMEOUT_UNITS_US = {"H": 3.6e9, "M": 6e7, "S": 1e6, "m": 1e3, "u": 1.0, "n": 1e-3}

# Defaults (µs): the clocks of the balancer's host and a router's agree within this...
DEFAULT_CLOCK_BOUND_US = 2_000.0
# ... and no request is taken to have waited longer than this between them.
DEFAULT_MAX_WAIT_US = 1_000_000.0

# Why a stamp was or was not used (the counters' keys).
USED = "used"
AHEAD = "ahead"  # later than the router's clock by more than the bound
STALE = "stale"  # older than the longest plausible wait
MALFORMED = "malformed"  # not an integer number of µs
STAMP_OUTCOMES = (USED, AHEAD, STALE, MALFORMED)


class ArrivalStamps:
    """Turns a request's stamp into its arrival on the router's monotonic clock, or None
    (ignored: the door's arrival counts). `counts` says how many stamps went which way."""

    __slots__ = ("clock_bound_us", "counts", "max_wait_us")

    def __init__(
        self,
        clock_bound_us: float = DEFAULT_CLOCK_BOUND_US,
        max_wait_us: float = DEFAULT_MAX_WAIT_US,
    ):
        if not 0 <= clock_bound_us < max_wait_us:
            raise PoolpipeError(
                f"arrival stamps need 0 <= clock bound < longest wait, got "
                f"{clock_bound_us / 1e3:g} ms and {max_wait_us / 1e3:g} ms "
                "(--arrival-clock-bound-ms, --arrival-max-wait-ms)"
            )
        self.clock_bound_us = clock_bound_us
        self.max_wait_us = max_wait_us
        self.counts: Counter[str] = Counter({k: 0 for k in STAMP_OUTCOMES})

    def arrival_ns(self, stamp: object, wall_ns: int, monotonic_ns: int) -> int | None:
        """`stamp` as the request carried it (µs since the epoch, a string or a number);
        `wall_ns` and `monotonic_ns`: the router's two clocks read together now. Returns
        the stamp on the monotonic clock (ns), at most now; None where it is ignored."""
        try:
            stamp_us = int(stamp)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            self.counts[MALFORMED] += 1
            return None
        if isinstance(stamp, bool | float):
            self.counts[MALFORMED] += 1
            return None
        age_us = wall_ns / 1e3 - stamp_us
        if age_us < -self.clock_bound_us:
            self.counts[AHEAD] += 1
            return None
        if age_us > self.max_wait_us:
            self.counts[STALE] += 1
            return None
        self.counts[USED] += 1
        return monotonic_ns - max(0, int(age_us * 1e3))


def client_timeout_us(raw: object) -> float:
    """The time a client has left, from CLIENT_TIMEOUT as the request carried it (gRPC's
    `grpc-timeout` format, e.g. `100m`, `99870u`, `1S`), in µs; a BadRequest naming the
    header and the format otherwise."""
    text = raw.strip() if isinstance(raw, str) else raw
    if (
        not isinstance(text, str)
        or not 2 <= len(text) <= 9
        or not text[:-1].isascii()
        or not text[:-1].isdigit()
        or text[-1] not in TIMEOUT_UNITS_US
    ):
        raise BadRequest(
            f"{CLIENT_TIMEOUT} must be the time the client has left as gRPC writes it (1 to 8 "
            f"digits and a unit of H, M, S, m, u or n, e.g. 100m), got {raw!r}"
        )
    return int(text[:-1]) * TIMEOUT_UNITS_US[text[-1]]


def capped_slo_us(slo_us: float, arrived_ns: int, deadline_ns: int | None) -> float:
    """A request's SLO (µs from its arrival, `arrived_ns`), shortened where its client's
    own deadline (`deadline_ns`, same clock) comes first; at or below 0 when the client's
    deadline has passed (the runtime drops it)."""
    if deadline_ns is None:
        return slo_us
    return min(slo_us, (deadline_ns - arrived_ns) / 1e3)
