"""The data plane: pure, clock-agnostic schedulers driven by the simulator and the live router.

`make_data_plane(name, topology)` returns one of DATA_PLANES; all meet the `DataPlane`
contract of `messages.py` (add_request / decide / on_stage_started / on_stage_done).
"""

from __future__ import annotations

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler.adaptive import ReservationScheduler
from poolpipe.scheduler.messages import (
    DataPlane,
    Decisions,
    Dispatch,
    Drop,
    Hop,
    PlaneWrapper,
    Request,
    StageReport,
)
from poolpipe.scheduler.reactive import ReactiveScheduler
from poolpipe.scheduler.reservations import ReservationTable, earliest_common_slot
from poolpipe.scheduler.topology import Topology, build_topology

# reservation: docs/design/dataplane.md's adaptive batching; the others are baselines and ablations.
DATA_PLANES = ("reservation", "reactive", "eager", "deferred")


def make_data_plane(
    name: str, topo: Topology, max_queue: int | None = None, wake_guard_us: float | None = None
) -> DataPlane:
    """`wake_guard_us`: how early a waiting batch wakes before its last moment (live
    drivers, whose timers fire late, need about a millisecond; the default suits the
    simulator)."""
    guard = {} if wake_guard_us is None else {"wake_guard_us": wake_guard_us}
    if name == "reservation":
        return ReservationScheduler(topo, "adaptive", max_queue, **guard)
    if name in ("eager", "deferred"):
        return ReservationScheduler(topo, name, max_queue, **guard)
    if name == "reactive":
        return ReactiveScheduler(topo, max_queue)
    raise PoolpipeError(f"unknown data plane {name!r}; choose {', '.join(DATA_PLANES)}")


__all__ = [
    "DATA_PLANES",
    "DataPlane",
    "Decisions",
    "Dispatch",
    "Drop",
    "Hop",
    "PlaneWrapper",
    "ReactiveScheduler",
    "Request",
    "ReservationScheduler",
    "ReservationTable",
    "StageReport",
    "Topology",
    "build_topology",
    "earliest_common_slot",
    "make_data_plane",
]
