"""The messages between a data plane and whatever drives it (the simulator, the live router).

Plain slotted dataclasses; times are µs on the driver's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Why a request was answered without being served.
DROP_DEADLINE_PASSED = "deadline passed while queued"
DROP_CANNOT_MEET = "deadline cannot be met"
DROP_OVERLOAD = "queue full"


@dataclass(slots=True)
class Request:
    id: int  # unique per driver
    model: int  # index into Topology.models
    arrival_us: float
    deadline_us: float  # arrival + the model's SLO


@dataclass(slots=True)
class Hop:
    """One partition of a batch's path: optional transfer in, then compute on one vGPU."""

    pool: int
    vgpu: int
    src_vgpu: int  # vGPU holding the input feature map; -1: input comes from the client
    transfer_start_us: float  # reserved (equal to transfer_end_us when nothing is sent)
    transfer_end_us: float
    start_us: float  # reserved compute interval
    end_us: float


@dataclass(slots=True)
class Dispatch:
    id: int
    model: int
    pipeline: int  # index into Topology.pipelines
    batch: int  # the batch size the hops were timed for (>= len(requests))
    requests: list[Request]
    hops: list[Hop]
    final: bool  # the last hop runs the model's last partition: its end answers the requests
    probes: int  # probe() calls spent deciding this batch


@dataclass(slots=True)
class Drop:
    request: Request
    reason: str


@dataclass(slots=True)
class Decisions:
    dispatches: list[Dispatch] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    wake_at_us: float | None = None  # call decide() again then, even if nothing happens


@dataclass(slots=True)
class StageReport:
    """What really happened to one hop of a dispatch (for feedback correction)."""

    dispatch: int
    hop: int
    start_us: float  # actual compute start
    end_us: float | None  # actual compute end; None while it is still running
    transfer_start_us: float | None = None  # actual transfer into the hop, if any
    transfer_end_us: float | None = None


class DataPlane(Protocol):
    """The contract every data plane meets; `now` is always passed in, never read."""

    name: str
    probes: int  # probe() calls so far (0 for planes that never probe)

    def add_request(self, req: Request, now: float) -> None: ...

    def decide(self, now: float) -> Decisions: ...

    def on_stage_started(self, report: StageReport, now: float) -> None: ...

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        """Returns True when decide() should run now (a pool may take work)."""
        ...

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        """Take a failed vGPU out of service, or put it back once it answers again."""
        ...
