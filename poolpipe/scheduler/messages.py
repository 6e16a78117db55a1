"""The messages between a data plane and whatever drives it (the simulator, the live router).

Plain slotted dataclasses; times are µs on the driver's clock. Each writes its own
`__init__`: compiled (native.py), a dataclass's generated one runs interpreted, and these
are made once per request, batch and stage. Those that can never be part of a reference
cycle are `acyclic` (compiled: not tracked by the cyclic garbage collector, whose young
collections their numbers would trigger).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from mypy_extensions import mypyc_attr

from poolpipe.scheduler.topology import Topology

# Why a request was answered without being served.
DROP_DEADLINE_PASSED: Final = "deadline passed while queued"
DROP_CANNOT_MEET: Final = "deadline cannot be met"
DROP_OVERLOAD: Final = "queue full"
# (the runtime's) a stage before the batch's ran over its reservation: it would be late
DROP_STAGE_OVERRAN: Final = "deadline cannot be met: a stage ran over its reserved time"
# (the runtime's) its batch was still running when its SLO ran out: answered then, not late
DROP_OVERDUE: Final = "deadline passed while its batch ran"
DROP_REASONS: Final = (
    DROP_DEADLINE_PASSED,
    DROP_CANNOT_MEET,
    DROP_OVERLOAD,
    DROP_STAGE_OVERRAN,
    DROP_OVERDUE,
)


@dataclass(slots=True, init=False)
class Request:
    id: int  # unique per driver
    model: int  # index into Topology.models
    arrival_us: float
    deadline_us: float  # arrival + the model's SLO

    def __init__(self, id: int, model: int, arrival_us: float, deadline_us: float) -> None:
        self.id = id
        self.model = model
        self.arrival_us = arrival_us
        self.deadline_us = deadline_us


@mypyc_attr(acyclic=True)
@dataclass(slots=True, init=False)
class Hop:
    """One partition of a batch's path: optional transfer in, then compute on one vGPU."""

    pool: int
    vgpu: int
    src_vgpu: int  # vGPU holding the input feature map; -1: input comes from the client
    transfer_start_us: float  # reserved (equal to transfer_end_us when nothing is sent)
    transfer_end_us: float
    start_us: float  # reserved compute interval
    end_us: float

    def __init__(
        self,
        pool: int,
        vgpu: int,
        src_vgpu: int,
        transfer_start_us: float,
        transfer_end_us: float,
        start_us: float,
        end_us: float,
    ) -> None:
        self.pool = pool
        self.vgpu = vgpu
        self.src_vgpu = src_vgpu
        self.transfer_start_us = transfer_start_us
        self.transfer_end_us = transfer_end_us
        self.start_us = start_us
        self.end_us = end_us


@dataclass(slots=True, init=False)
class Dispatch:
    id: int
    model: int
    pipeline: int  # index into Topology.pipelines
    batch: int  # the batch size the hops were timed for (>= len(requests))
    requests: list[Request]
    hops: list[Hop]
    final: bool  # the last hop runs the model's last partition: its end answers the requests
    probes: int  # probe() calls spent deciding this batch

    def __init__(
        self,
        id: int,
        model: int,
        pipeline: int,
        batch: int,
        requests: list[Request],
        hops: list[Hop],
        final: bool,
        probes: int,
    ) -> None:
        self.id = id
        self.model = model
        self.pipeline = pipeline
        self.batch = batch
        self.requests = requests
        self.hops = hops
        self.final = final
        self.probes = probes


@mypyc_attr(acyclic=True)
@dataclass(slots=True, init=False)
class Drop:
    request: Request
    reason: str

    def __init__(self, request: Request, reason: str) -> None:
        self.request = request
        self.reason = reason


@mypyc_attr(acyclic=True)
@dataclass(slots=True, init=False)
class Decisions:
    dispatches: list[Dispatch]
    drops: list[Drop]
    wake_at_us: float | None  # call decide() again then, even if nothing happens

    def __init__(
        self,
        dispatches: list[Dispatch] | None = None,
        drops: list[Drop] | None = None,
        wake_at_us: float | None = None,
    ) -> None:
        self.dispatches = [] if dispatches is None else dispatches
        self.drops = [] if drops is None else drops
        self.wake_at_us = wake_at_us


@dataclass(slots=True, init=False)
class StageReport:
    """What really happened to one hop of a dispatch (for feedback correction)."""

    dispatch: int
    hop: int
    start_us: float  # actual compute start
    end_us: float | None  # actual compute end; None while it is still running
    transfer_start_us: float | None  # actual transfer into the hop, if any
    transfer_end_us: float | None

    def __init__(
        self,
        dispatch: int,
        hop: int,
        start_us: float,
        end_us: float | None,
        transfer_start_us: float | None = None,
        transfer_end_us: float | None = None,
    ) -> None:
        self.fill(dispatch, hop, start_us, end_us, transfer_start_us, transfer_end_us)

    def fill(
        self,
        dispatch: int,
        hop: int,
        start_us: float,
        end_us: float | None,
        transfer_start_us: float | None,
        transfer_end_us: float | None,
    ) -> StageReport:
        """This report made anew in place (a runtime lends one report for every call)."""
        self.dispatch = dispatch
        self.hop = hop
        self.start_us = start_us
        self.end_us = end_us
        self.transfer_start_us = transfer_start_us
        self.transfer_end_us = transfer_end_us
        return self


@mypyc_attr(allow_interpreted_subclasses=True)
class DataPlane:
    """The contract every data plane meets; `now` is always passed in, never read.

    The driver (poolpipe.runtime) adds requests, asks for decisions, reports what each hop
    of a dispatch really did, and tells the plane about failures, new latencies and a
    flush; every plane implements all of it.

    A base class rather than a Protocol: compiled (native.py), a call through a class is a
    native call, through a Protocol a Python method call. Planes subclass it (interpreted
    ones too). A StageReport is lent for the call: read it, do not keep it."""

    name: str
    topo: Topology  # what the plane schedules on (set_latencies replaces it)
    probes: int  # probe() calls so far (0 for planes that never probe)

    def __init__(self, name: str, topo: Topology) -> None:
        self.name = name
        self.topo = topo
        self.probes = 0

    def add_request(self, req: Request, now: float) -> bool:
        """Queue a request; True when decide() has something to do now (False: it joins a
        batch that waits for more, and nothing else is due)."""
        raise NotImplementedError

    def decide(self, now: float) -> Decisions:
        raise NotImplementedError

    def on_stage_started(self, report: StageReport, now: float) -> None:
        raise NotImplementedError

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        """Returns True when decide() should run now (a pool may take work)."""
        raise NotImplementedError

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        """Hop `hop` of `dispatch` failed: it and the later hops will not run; what they
        hold is released (the driver retries or fails the requests)."""
        raise NotImplementedError

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        """Take a failed vGPU out of service, or put it back once it answers again."""
        raise NotImplementedError

    def set_latencies(self, topo: Topology) -> None:
        """Schedule with `topo`'s pool latencies from now on: the same topology measured
        anew (a live router recalibrating under load); what is reserved stays."""
        raise NotImplementedError

    def set_wake_lateness(self, late_us: float) -> None:
        """The driver's wakes come up to `late_us` after the time asked for (measured):
        a batch held for more requests wakes that much earlier."""
        raise NotImplementedError

    def drain(self) -> None:
        """Stop waiting for fuller batches: every queued request goes out at its next
        decision (a flush before a plan switch)."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
class PlaneWrapper(DataPlane):
    """A data plane that hands every call to another (`inner`); a subclass overrides what
    it adds (the simulator's timing of decide, a test's counting)."""

    def __init__(self, inner: DataPlane) -> None:
        super().__init__(inner.name, inner.topo)
        self.inner = inner

    def add_request(self, req: Request, now: float) -> bool:
        return self.inner.add_request(req, now)

    def decide(self, now: float) -> Decisions:
        dec = self.inner.decide(now)
        self.probes = self.inner.probes
        return dec

    def on_stage_started(self, report: StageReport, now: float) -> None:
        self.inner.on_stage_started(report, now)

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        return self.inner.on_stage_done(report, now)

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        self.inner.on_dispatch_failed(dispatch, hop, now)

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        self.inner.set_vgpu_down(vgpu, down, now)

    def set_latencies(self, topo: Topology) -> None:
        self.inner.set_latencies(topo)
        self.topo = self.inner.topo

    def set_wake_lateness(self, late_us: float) -> None:
        self.inner.set_wake_lateness(late_us)

    def drain(self) -> None:
        self.inner.drain()
