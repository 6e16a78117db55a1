"""What a request must be for the runtime to take it, and what a plan's SLOs leave after the
reply margin: the checks every driver makes at its door, before a request is queued.

A request names its SLO (optional) and carries some rows. The SLO must be a finite number
of milliseconds above 0 and at most `max_slo_ms`; the rows must be no more than the plan
could ever finish within that SLO with every vGPU idle (an upper bound: a request above it
cannot be on time, so it is refused at once rather than answered late or in pieces).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError, UnknownNameError
from poolpipe.scheduler.topology import Pool, Topology

# The longest per-request SLO a client may ask for (ms): longer than any stage call may
# take, a request would hold its place in the queues for minutes.
MAX_SLO_MS = 60_000.0

# Held back from every request's deadline for its answer's way back. A live router measures
# it (MarginMeter: the floor + egress p99 over its last answers, at most the ceiling). The
# floor is what no door sees (client network, Triton's front end: about 0.2 ms on loopback);
# the default reply margin is what `poolpipe plan` assumes when it warns: the measured
# margin with the nodes idle on the 2-core machine (`./run bench-serving`: about 3 ms).
DEFAULT_MARGIN_FLOOR_US = 1_000.0
DEFAULT_MARGIN_CEILING_US = 25_000.0
DEFAULT_REPLY_MARGIN_US = 3_000.0


class MarginMeter:
    """The reply margin learnt from the router's own door. A request's deadline counts from
    when the door saw it (its arrival), so its way in is inside the SLO already; what the
    runtime cannot see is the answer's way out: egress, from the runtime's answer until it
    has left the door. The margin is the p99 of egress over the last `window` answers plus
    `floor` (what no door sees: the client's network and Triton's own front end), kept at
    most `ceiling`; recomputed every `every` samples, the floor until then. Ingress (the
    door's stamp until the runtime has the request) is kept for the figures. Where batches
    travel as chains of nodes, the p99 of a chain's overhead (`path_us`: how much later than
    its reservations' end its answer came, as the driver measures it) is held back too."""

    def __init__(
        self,
        floor_us: float = DEFAULT_MARGIN_FLOOR_US,
        ceiling_us: float = DEFAULT_MARGIN_CEILING_US,
        window: int = 1024,
        every: int = 32,
    ):
        if not (0 <= floor_us <= ceiling_us and math.isfinite(ceiling_us)):
            raise PoolpipeError(
                f"the reply margin needs 0 <= floor <= ceiling (finite), got floor "
                f"{floor_us / 1e3:g} ms and ceiling {ceiling_us / 1e3:g} ms"
            )
        if window < 1 or every < 1:
            raise PoolpipeError(f"window and every must be >= 1, got {window} and {every}")
        self.floor_us, self.ceiling_us = floor_us, ceiling_us
        self.window, self.every = window, every
        self.ingress_us: deque[float] = deque(maxlen=window)
        self.egress_us: deque[float] = deque(maxlen=window)
        self.path_us: deque[float] = deque(maxlen=window)
        self.margin_us = floor_us
        self._since = 0

    def restart(self) -> None:
        """Forget the samples (the margin back at the floor until `every` new ones): what
        a cold start measured (a stub's first calls) says nothing of the warm path, and it
        would stay in the window while a margin too wide for the SLOs has every request
        refused at the door, so that no answer brings a new sample."""
        self.ingress_us.clear()
        self.egress_us.clear()
        self.path_us.clear()
        self.margin_us = self.floor_us
        self._since = 0

    def observe(
        self,
        ingress_us: float | None,
        egress_us: Sequence[float] = (),
        path_us: Sequence[float] = (),
    ) -> bool:
        """Take samples; True when the margin was recomputed."""
        if ingress_us is not None:
            self.ingress_us.append(ingress_us)
        self.egress_us.extend(egress_us)
        self.path_us.extend(max(0.0, x) for x in path_us)
        self._since += len(egress_us) + len(path_us)
        if self._since < self.every:
            return False
        self._since = 0
        self.margin_us = min(
            self.ceiling_us, self.floor_us + p99(self.egress_us) + p99(self.path_us)
        )
        return True

    def figures(self) -> dict[str, float]:
        """The window's p99 ingress and egress and the margin held back now (ms)."""
        return {
            "ingress_p99_ms": p99(self.ingress_us) / 1e3,
            "egress_p99_ms": p99(self.egress_us) / 1e3,
            "chain_overhead_p99_ms": p99(self.path_us) / 1e3,
            "reply_margin_ms": self.margin_us / 1e3,
        }


def p99(xs: Sequence[float] | deque[float]) -> float:
    """The 99th percentile (nearest rank) of the samples; 0 without any."""
    if not xs:
        return 0.0
    n = len(xs)
    rank = min(n - 1, math.ceil(0.99 * n) - 1)  # in ascending order: the (n - rank)-th largest
    return float(heapq.nlargest(n - rank, xs)[-1])


class BadRequest(PoolpipeError):
    """A request the runtime refuses at the door (the client's input is wrong)."""


class Unservable(PoolpipeError):
    """A request the runtime refuses at the door because the plan served cannot serve it:
    not even one row within the model's own SLO (less the reply margin). The server's
    condition, not the client's fault: counted as refused, answered UNAVAILABLE."""


def request_slo_us(raw: object, max_slo_ms: float = MAX_SLO_MS) -> float | None:
    """A request's `slo_ms` parameter in µs (None when it gives none). Numbers and numeric
    strings are taken; anything else, and values that are not finite, not above 0 or above
    `max_slo_ms`, is a BadRequest naming the value."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise BadRequest(f"slo_ms must be a number of milliseconds, got {raw!r}")
    try:
        ms = float(raw)
    except ValueError:
        raise BadRequest(f"slo_ms must be a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise BadRequest(f"slo_ms must be a finite number above 0, got {raw!r}")
    if ms > max_slo_ms:
        raise BadRequest(f"slo_ms {ms:g} is above the most this router takes ({max_slo_ms:g})")
    return ms * 1e3


def _pool_rate(pool: Pool) -> float:
    """The most rows per µs one vGPU of the pool finishes (over its batch sizes)."""
    return max((b / lat for b, lat in enumerate(pool.latency_us) if b and lat > 0), default=0.0)


class RowBounds:
    """The most rows a topology's pipelines could finish within a budget (`most`), its
    per-plan part computed once (a router asks at every request): per model, per
    pipeline, what every row spends outside the pipeline's pools (their fastest single-row
    times and the moves) and per pool its fastest time, vGPUs and best rate per vGPU."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.models: list[list[tuple[float, list[tuple[float, int, float]]]]] = []
        for m in topo.models:
            pipes = []
            for p in m.pipelines:
                pools = [topo.pools[i] for i in topo.pipelines[p].pools]
                fastest = [min(lat for lat in pool.latency_us[1:] if lat > 0) for pool in pools]
                outside = sum(fastest) + sum(pool.transfer_in_us for pool in pools)
                per_pool = [
                    (f, len(pool.vgpus), _pool_rate(pool))
                    for f, pool in zip(fastest, pools, strict=True)
                ]
                pipes.append((outside, per_pool))
            self.models.append(pipes)

    def most(self, model: int, budget_us: float) -> int:
        """An upper bound on the rows of `model` that its pipelines could finish within
        `budget_us` from now with every vGPU idle. A row passes every pool of its pipeline;
        at pool k it can only run after the earlier pools' fastest single-row time and must
        leave before the later pools' (and transfers') fastest time, so pool k works on it
        within that window at most, at its best rate per vGPU."""
        total = 0
        for outside, per_pool in self.models[model]:
            bound = math.inf
            for fastest, vgpus, rate in per_pool:
                window = budget_us - (outside - fastest)
                if window < fastest:
                    bound = 0.0
                    break
                bound = min(bound, vgpus * window * rate)
            total += int(bound)
        return total

    def fastest_us(self, model: int) -> float:
        """The least time one row of `model` takes through any of its pipelines (every
        pool's fastest single-row time and the transfers); inf without a pipeline."""
        return min((outside for outside, _ in self.models[model]), default=math.inf)


def check_request(
    topo: Topology,
    model: str,
    rows: int,
    slo_raw: object,
    reply_margin_us: float,
    max_slo_ms: float = MAX_SLO_MS,
    bounds: RowBounds | None = None,
) -> tuple[int, float | None]:
    """(model index, SLO in µs or None for the model's) of a request, or a BadRequest:
    unknown model, no rows, a bad `slo_ms`, or more rows than the plan could ever serve
    within the SLO (less the reply margin); or Unservable where the plan cannot serve even
    one row within the model's own SLO (or a longer one the request asks for). `bounds`:
    the topology's RowBounds, where the caller keeps them."""
    try:
        index = topo.model_index(model)
    except UnknownNameError:
        served = ", ".join(m.name for m in topo.models)
        raise BadRequest(f"unknown model {model!r}; this router serves {served}") from None
    if rows < 1:
        raise BadRequest(f"{model}: a request needs at least one row, got {rows}")
    slo_us = request_slo_us(slo_raw, max_slo_ms)
    own = topo.models[index].slo_us
    slo = own if slo_us is None else slo_us
    if bounds is None or bounds.topo is not topo:
        bounds = RowBounds(topo)
    most = bounds.most(index, slo - reply_margin_us)
    if most < 1 and slo >= own:
        raise Unservable(
            f"{model}: this plan cannot serve a request within {slo / 1e3:g} ms: its SLO less "
            f"the {reply_margin_us / 1e3:.2f} ms held back for the reply leaves less than its "
            "fastest pipeline; the operator must roll out a plan that fits (or a request may "
            "ask for a longer slo_ms)"
        )
    if rows > most:
        raise BadRequest(
            f"{model}: {rows} rows cannot be served within {slo / 1e3:g} ms by this plan "
            f"(at most {most} with every GPU idle, {reply_margin_us / 1e3:g} ms held back for "
            "the reply); send fewer rows per request or a longer slo_ms"
        )
    return index, slo_us


@dataclass(frozen=True)
class RoomWarning:
    model: str
    slo_ms: float
    margin_ms: float
    fastest_ms: float  # the plan's fastest pipeline, planned end-to-end latency
    # fastest_ms as measured on the serving nodes (one row, stage calls and transfers)
    measured: bool = False
    overhead_ms: float = 0.0  # of fastest_ms: the stage calls' overhead measured on the nodes

    @property
    def _fastest(self) -> str:
        if self.measured:
            return "measured"
        if self.overhead_ms > 0:
            return f"planned (with {self.overhead_ms:.2g} ms of stage calls measured on the nodes)"
        return "planned"

    def __str__(self) -> str:
        room = self.slo_ms - self.margin_ms
        if room <= 0:
            what = "every request at that SLO will be dropped"
        else:
            what = f"{room:g} ms are left, and most requests at that SLO will be dropped"
        return (
            f"{self.model}: SLO {self.slo_ms:g} ms less the router's reply margin "
            f"{self.margin_ms:g} ms leaves less than its fastest pipeline's {self._fastest} "
            f"latency {self.fastest_ms:.1f} ms: {what}. Lower the reply margin (--reply-margin-ms) "
            "or give the model a longer SLO."
        )

    def refusal(self) -> str:
        """Why a rollout of this plan is refused, with both numbers."""
        room = self.slo_ms - self.margin_ms
        return (
            f"{self.model}: its SLO {self.slo_ms:g} ms less the router's measured reply margin "
            f"{self.margin_ms:.2f} ms leaves {room:.2f} ms"
            + (
                f", less than its fastest pipeline's {self._fastest} latency "
                f"{self.fastest_ms:.3g} ms"
                if room > 0
                else ": no time to serve a request in"
            )
        )


def unservable(bounds: RowBounds, reply_margin_us: float) -> list[int]:
    """Models (indexes) of the bounds' topology whose own SLO, less the reply margin, leaves
    less than one row takes: the door refuses every request of theirs (check_request)."""
    return [
        i
        for i, m in enumerate(bounds.topo.models)
        if bounds.most(i, m.slo_us - reply_margin_us) < 1
    ]


def live_room_warnings(topo: Topology, reply_margin_us: float) -> list[RoomWarning]:
    """The models of a served topology (its stage times measured on the nodes) that the
    door would refuse every request of (unservable). What a plan's latencies leave out
    (each stage call's overhead, a batch of one where the plan batches more) is in these."""
    bounds = RowBounds(topo)
    return [
        RoomWarning(
            topo.models[i].name,
            topo.models[i].slo_us / 1e3,
            reply_margin_us / 1e3,
            bounds.fastest_us(i) / 1e3,
            measured=True,
        )
        for i in unservable(bounds, reply_margin_us)
    ]


def slo_room_warnings(
    plan: Plan, reply_margin_us: float, call_overhead_us: float = 0.0
) -> list[RoomWarning]:
    """The plan's models whose SLO, less the reply margin, is shorter than their fastest
    planned pipeline: the router drops most or all of their requests. `call_overhead_us`:
    what a stage call on the nodes takes beyond its blocks' profiled run (measured by a
    router), added per partition."""
    out = []
    for m in plan.models:
        if not m.pipelines:
            continue
        fastest, calls = min(
            (p.latency_us + len(p.partitions) * call_overhead_us, len(p.partitions))
            for p in m.pipelines
        )
        if m.slo_us - reply_margin_us >= fastest:
            continue
        overhead = calls * call_overhead_us / 1e3
        out.append(
            RoomWarning(
                m.name,
                m.slo_us / 1e3,
                reply_margin_us / 1e3,
                fastest / 1e3,
                overhead_ms=overhead,
            )
        )
    return out
