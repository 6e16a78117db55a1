"""The data plane: pure, clock-agnostic schedulers driven by the simulator and the live router.

`make_data_plane(name, topology)` returns one of DATA_PLANES, or of CHECK_PLANES (the
reservation plane's specification, alone or checked against the fast plane); all meet the
`DataPlane` contract of `messages.py` (add_request / decide / on_stage_started /
on_stage_done).
"""

from __future__ import annotations

import math

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler.adaptive import LIGHT_LOAD, WAKE_GUARD_US, ReservationScheduler
from poolpipe.scheduler.checked import CheckedPlane, PlaneDifference, checked_plane
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

# reservation: docs/design/dataplane.md's adaptive batching; the others are baselines and
# ablations (holding: reservation holding every short batch for its last moment, light load
# or not, as the published plane does; spread: reservation with equally good vGPUs taking
# turns at any load; packed: the lowest-numbered of them first at any load).
DATA_PLANES = ("reservation", "holding", "spread", "packed", "reactive", "eager", "deferred")
# reservation's specification (reference.py: slower, every pipeline probed by the plain
# rule), and both side by side, failing at the first difference (checked.py)
CHECK_PLANES = ("reference", "checked")


def make_data_plane(
    name: str,
    topo: Topology,
    max_queue: int | None = None,
    wake_guard_us: float | None = None,
    light_load: float | None = None,
) -> DataPlane:
    """`wake_guard_us`: how early a waiting batch wakes before its last moment (live
    drivers, whose timers fire late, need about a millisecond; the default suits the
    simulator). `light_load`: the reservation plane's (adaptive.LIGHT_LOAD; 0: hold every
    short batch for its last moment)."""
    guard = WAKE_GUARD_US if wake_guard_us is None else wake_guard_us
    light = LIGHT_LOAD if light_load is None else light_load
    if name == "reservation":
        return ReservationScheduler(topo, "adaptive", max_queue, guard, light_load=light)
    if name == "holding":
        return ReservationScheduler(topo, "adaptive", max_queue, guard, light_load=0.0)
    if name == "packed":
        return ReservationScheduler(
            topo, "adaptive", max_queue, guard, light_load=light, pack_load=math.inf
        )
    if name == "spread":
        return ReservationScheduler(
            topo, "adaptive", max_queue, guard, light_load=light, pack=False
        )
    if name in ("eager", "deferred"):  # (as published: equally good vGPUs take turns)
        return ReservationScheduler(topo, name, max_queue, guard, pack=False)
    if name == "reactive":
        return ReactiveScheduler(topo, max_queue)
    if name == "reference":
        return ReservationScheduler(
            topo, "adaptive", max_queue, guard, reference=True, light_load=light
        )
    if name == "checked":
        return checked_plane(topo, "adaptive", max_queue, guard, light)
    raise PoolpipeError(
        f"unknown data plane {name!r}; choose {', '.join(DATA_PLANES + CHECK_PLANES)}"
    )


__all__ = [
    "CHECK_PLANES",
    "DATA_PLANES",
    "CheckedPlane",
    "DataPlane",
    "Decisions",
    "Dispatch",
    "Drop",
    "Hop",
    "PlaneDifference",
    "PlaneWrapper",
    "ReactiveScheduler",
    "Request",
    "ReservationScheduler",
    "ReservationTable",
    "StageReport",
    "Topology",
    "build_topology",
    "checked_plane",
    "earliest_common_slot",
    "make_data_plane",
]
