"""The two ports through which a serving runtime is driven, and the records it hands them.

A `Clock` tells the time and calls back later; an `Executor` runs dispatched batches and
delivers answers. The simulator plugs in a virtual clock and a simulated cluster; the live
router the event loop's clock and Triton stage workers. The runtime cannot tell them apart
(SimPy's one environment, two clocks). Everything a driver may read of the runtime's work
is here: the requests it took (`Entry`), the batches it dispatched (`Job`), what a plan
used once it is gone (`PlanUsage`), and how a request ended (`Outcome`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final, Protocol

from mypy_extensions import i64, mypyc_attr

from poolpipe.runtime.stats import EpochStats, ModelStats
from poolpipe.scheduler import DataPlane, Dispatch, Request, Topology


class Outcome(IntEnum):
    """What became of a request. A late completion is a miss; a drop is an explicit
    "deadline cannot be met"; a failure is a stage that failed with no live path or no
    attempt left. Only ON_TIME and LATE carry a result."""

    ON_TIME = 0
    LATE = 1
    DROPPED = 2
    PENDING = 3  # taken, not answered yet
    FAILED = 4

    @property
    def is_finished(self) -> bool:
        return self is not Outcome.PENDING

    @property
    def has_result(self) -> bool:
        """Answered with the model's outputs (on time or late)."""
        return self is Outcome.ON_TIME or self is Outcome.LATE


# Final: compiled (native.py), a module constant is read from a static, not the globals
ON_TIME: Final = Outcome.ON_TIME
LATE: Final = Outcome.LATE
DROPPED: Final = Outcome.DROPPED
PENDING: Final = Outcome.PENDING
FAILED: Final = Outcome.FAILED
OUTCOME_NAMES = {ON_TIME: "on time", LATE: "late", DROPPED: "dropped", FAILED: "failed"}


class Timer(Protocol):
    def cancel(self) -> None: ...


@mypyc_attr(allow_interpreted_subclasses=True)
class Clock:
    """Time in µs since the runtime's start, and callbacks at a later time. (Clocks and
    executors subclass these bases, interpreted ones too: compiled, a call through a class
    is a native call, through a Protocol a Python method call.)"""

    def now(self) -> float:
        raise NotImplementedError

    def call_at(self, t_us: float, fn: Callable[[], None]) -> Timer:
        """Call `fn` at `t_us` (as soon as possible when that has passed)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ServedPlan:
    """What a runtime serves one plan with; a migration swaps it whole, and a dispatch runs
    to its end on the one it was made with.

    `vgpu_node` names each vGPU's failure domain (a stage-worker node: a node's vGPUs fail
    and return together); `adapter` is the driver's own data for this plan (partition
    model names and node addresses for the router, nothing for the simulator)."""

    topo: Topology
    plane: DataPlane
    vgpu_node: Mapping[int, str]
    adapter: Any = None


@dataclass(slots=True, eq=False, init=False)
class Entry(Request):
    """A request the runtime has taken and will answer exactly once. The data plane
    schedules it as a Request (its deadline is due - reply margin). (Its own `__init__`:
    see scheduler/messages.py.)"""

    due_us: float  # arrival + SLO: on time when answered by then
    payload: Any  # the driver's data (the client's tensors and reply handle; an index)
    stats: EpochStats  # the model's counters (its window's; and `total`, cumulative)
    attempts: int
    result: Any  # set by the executor before it reports the last hop done
    outcome: Outcome
    slot: int  # the runtime's: its place among the requests in flight (-1: none)

    def __init__(
        self,
        id: int,
        model: int,
        arrival_us: float,
        deadline_us: float,
        due_us: float,
        payload: Any,
        stats: EpochStats,
        attempts: int = 1,
        result: Any = None,
        outcome: Outcome = PENDING,
    ) -> None:
        # (not super(): dataclass(slots=True) makes a new class, which a zero-argument
        # super() in a method of the old one does not know)
        Request.__init__(self, id, model, arrival_us, deadline_us)
        self.due_us = due_us
        self.payload = payload
        self.stats = stats
        self.attempts = attempts
        self.result = result
        self.outcome = outcome
        self.slot = -1


def count_answer(stats: ModelStats, outcome: Outcome, latency_us: float | None) -> None:
    """One answer in a model's (or an application's) counters: its outcome, and its latency
    (None: not kept, or no result)."""
    if outcome is ON_TIME:
        stats.on_time += 1
    elif outcome is LATE:
        stats.late += 1
    elif outcome is DROPPED:
        stats.dropped += 1
    else:
        stats.failed += 1
    if latency_us is not None:
        stats.latency_us.append(latency_us)


class Job:
    """A dispatched batch as the executor runs it: its hops in order, on its plan.

    `generation` counts the plans this runtime has served (0 for the first; each
    migration adds one): what an executor keys its per-plan state by, until `retire`."""

    __slots__ = (
        "_plan",
        "dispatch",
        "ended",
        "entries",
        "excess_us",
        "generation",
        "idle",
        "slack_us",
        "started",
        "watch_slot",
    )

    def __init__(self, dispatch: Dispatch, entries: list[Entry], plan: Any, slack_us: float = 0.0):
        self.dispatch = dispatch
        self.entries = entries  # the requests in it that are still waiting for an answer
        self._plan = plan  # the runtime's own bookkeeping of the plan it runs on
        self.generation: int = plan.generation
        self.started = 0  # hops reported started so far
        # bit h: hop h started on a vGPU that had nothing else running (kept by a runtime
        # that observes stage times; a list per job was one more object to make and free)
        self.idle: i64 = 0
        # (observing) how much longer than reserved its hops computed so far, together
        self.excess_us = 0.0
        # How much later than reserved a hop may start with every request still on time
        # (the earliest SLO end, arrival + SLO, less the reserved end of the last hop).
        self.slack_us = slack_us
        self.ended = False  # the runtime's: its last hop reported (done, failed or let go)
        self.watch_slot = -1  # the runtime's overdue watch's: its slot there (-1: none)

    @property
    def served(self) -> ServedPlan:
        """The plan it runs on (its latencies as recalibrated so far)."""
        return self._plan.served


@dataclass(frozen=True)
class PlanUsage:
    """What a served plan did while it served: busy time per vGPU, and batches and the
    requests in them per pool (every hop counts at its pool)."""

    generation: int
    served: ServedPlan
    vgpu_busy_us: tuple[float, ...]
    pool_batches: tuple[int, ...]
    pool_requests: tuple[int, ...]


@mypyc_attr(allow_interpreted_subclasses=True)
class Executor:
    """Runs what the runtime dispatches and delivers what it decides (`bind` hands it the
    runtime it reports to, once, before anything runs).

    `run(job)` runs the job's hops in order and reports each through the runtime:
    `hop_started(job, h, start_us, transfer_start_us, transfer_end_us)`,
    `hop_done(job, h, start_us, end_us)`, or `hop_failed(job, h, why, node_failed)` (no later
    hop of the job is then reported).
    Before it reports the last hop done, it leaves each entry's result in `entry.result`.

    A vGPU runs one hop at a time, in the order of their reserved starts. When hop `h`
    gets its vGPU more than `job.slack_us` after its reserved start (a stage before it ran
    over its reservation), the executor asks `hop_late(job, h)` first: False means the
    runtime has answered the job's requests (dropped) and released the rest of its path;
    the hop and the later ones do not run."""

    def bind(self, runtime: Any) -> None:
        raise NotImplementedError

    def run(self, job: Job) -> None:
        raise NotImplementedError

    def answer(self, entry: Entry, outcome: Outcome, reason: str) -> None:
        """Deliver a request's end: its result (on time or late), or an explicit error."""
        raise NotImplementedError

    def check_node(self, node: str, served: ServedPlan) -> None:
        """Find out whether a node serves `served`'s models (a failed one, or one in service
        when the runtime sweeps); report runtime.node_checked(node, ok, why, served): ok
        None when it gave no answer in time."""
        raise NotImplementedError

    def retire(self, usage: PlanUsage) -> None:
        """A plan the runtime served before is done: it was switched away from and its
        last job has ended. Nothing will run on it again; forget what was kept for it."""
        raise NotImplementedError
