"""The serving runtime: every serving policy around the data plane (intake, decisions and
wake-ups, outcomes and statistics, stage failures, node return, recalibration, flush
migration), driven through a clock and an executor, and where a plan's vGPUs live (nodes).

The simulator (virtual clock, simulated cluster) and the live router (event-loop clock,
Triton stage workers) are its two drivers. core.py composes the policies, each a part of
its own: overdue.py, guard.py, health.py, recalibration.py, migration.py; ports.py holds
the ports and the records a driver sees.
"""

from poolpipe.runtime.core import RuntimeConfig, ServingRuntime
from poolpipe.runtime.intake import (
    DEFAULT_MARGIN_CEILING_US,
    DEFAULT_MARGIN_FLOOR_US,
    DEFAULT_REPLY_MARGIN_US,
    MAX_SLO_MS,
    BadRequest,
    MarginMeter,
    Unservable,
    live_room_warnings,
    slo_room_warnings,
)
from poolpipe.runtime.migration import SwitchResult, default_flush_timeout_us
from poolpipe.runtime.ports import (
    DROPPED,
    FAILED,
    LATE,
    ON_TIME,
    OUTCOME_NAMES,
    PENDING,
    Clock,
    Entry,
    Executor,
    Job,
    Outcome,
    PlanUsage,
    ServedPlan,
    Timer,
)
from poolpipe.runtime.recalibration import RECALIBRATE_BAND, RECALIBRATE_EVERY, RECALIBRATE_MAX
from poolpipe.runtime.stamps import (
    ARRIVAL_STAMP,
    CLIENT_TIMEOUT,
    FORWARDED_HEADERS,
    STAMP_OUTCOMES,
    ArrivalStamps,
    capped_slo_us,
    client_timeout_us,
    forwarded_header,
)
from poolpipe.runtime.stats import ModelStats, ModelWindow, PoolWindow, Window

__all__ = [
    "ARRIVAL_STAMP",
    "CLIENT_TIMEOUT",
    "DEFAULT_MARGIN_CEILING_US",
    "DEFAULT_MARGIN_FLOOR_US",
    "DEFAULT_REPLY_MARGIN_US",
    "DROPPED",
    "FAILED",
    "FORWARDED_HEADERS",
    "LATE",
    "MAX_SLO_MS",
    "ON_TIME",
    "OUTCOME_NAMES",
    "PENDING",
    "RECALIBRATE_BAND",
    "RECALIBRATE_EVERY",
    "RECALIBRATE_MAX",
    "STAMP_OUTCOMES",
    "ArrivalStamps",
    "BadRequest",
    "Clock",
    "Entry",
    "Executor",
    "Job",
    "MarginMeter",
    "ModelStats",
    "ModelWindow",
    "Outcome",
    "PlanUsage",
    "PoolWindow",
    "RuntimeConfig",
    "ServedPlan",
    "ServingRuntime",
    "SwitchResult",
    "Timer",
    "Unservable",
    "Window",
    "capped_slo_us",
    "client_timeout_us",
    "default_flush_timeout_us",
    "forwarded_header",
    "live_room_warnings",
    "slo_room_warnings",
]
