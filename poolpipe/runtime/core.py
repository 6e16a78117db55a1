"""The serving runtime: every serving policy around the data plane, driven through a clock
and an executor (ports.py) and blind to which ones it has.

It takes requests (deadline = arrival + SLO - reply margin; a per-request SLO), asks the
data plane for decisions and wakes it when it asked to be woken, hands dispatched batches
to the executor and books what each hop really did, and answers every request exactly once
(on time, late, dropped, failed). Its policies are parts of their own, each with its
module: the overdue watch (overdue.py), the wake guard (guard.py), node health and the
node watch (health.py), recalibration (recalibration.py), and pipeline-flush migration
(migration.py). This module composes them.

The driver interface, the same for the simulator and the live router:
- intake: `check` (a request at the door), `add` / `arrive` / `submit`, then `decide`;
- reports from the executor: `hop_started`, `hop_done`, `hop_late`, `hop_failed`,
  `node_checked`; and from the driver: `node_lost` / `node_watched` (a node's watch
  connection broke / is open again);
- operators: `drain` / `undrain` a node, `node_jobs` (its batches not yet ended);
- a migration: `switch`;
- reading: `served`, `topo`, `generation`, `stats`, `take_window`, `take_stage_factors`,
  `take_answer_delays`, `usage`, `pool_busy_us`, `down_nodes`, `drained_nodes`,
  `node_since`, `live_throughput`, `without_path`, `in_flight`, `idle`, and the counters
  `batches`, `recalibrations`, `recoveries`, `drop_reasons`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from librt.vecs import vec
from mypy_extensions import i64, mypyc_attr

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.guard import WakeGuard
from poolpipe.runtime.health import NODE_CHECK_EVERY_US, NodeHealth
from poolpipe.runtime.heap import Slots
from poolpipe.runtime.intake import (
    MAX_SLO_MS,
    RowBounds,
    Unservable,
    check_request,
    unservable,
)
from poolpipe.runtime.migration import (
    SWITCHED_AWAY,
    FlushMigration,
    HeldRequest,
    SwitchResult,
)
from poolpipe.runtime.overdue import OverdueWatch
from poolpipe.runtime.ports import (
    DROPPED,
    FAILED,
    LATE,
    ON_TIME,
    PENDING,
    Clock,
    Entry,
    Executor,
    Job,
    Outcome,
    PlanUsage,
    ServedPlan,
    Timer,
    count_answer,
)
from poolpipe.runtime.recalibration import RECALIBRATE_BAND, RECALIBRATE_EVERY, Recalibrator
from poolpipe.runtime.stats import ModelStats, Window, Windows
from poolpipe.scheduler import DataPlane, Dispatch, StageReport
from poolpipe.scheduler.messages import DROP_OVERDUE, DROP_STAGE_OVERRAN
from poolpipe.scheduler.topology import Topology


@dataclass(frozen=True)
class RuntimeConfig:
    reply_margin_us: float = 0.0  # held back from every deadline for the way out (and in)
    recalibrate: bool = True  # scale a pool's latencies when its stages run off reservation
    recalibrate_every: int = RECALIBRATE_EVERY
    recalibrate_band: float = RECALIBRATE_BAND
    # keep measured / reserved per pool (take_stage_factors) and how late batches were
    # answered beyond it (take_answer_delays)
    record_stage_factors: bool = False
    node_check_every_us: float = NODE_CHECK_EVERY_US
    # every node in service is checked this often too (0: only when a call to it fails):
    # one that is not ready (restarted empty, shutting down) leaves service at once and
    # is refilled by the driver, traffic or not
    node_sweep_every_us: float = 0.0
    keep_latencies: bool = True  # each answer's latency, for the windows' percentiles
    max_slo_ms: float = MAX_SLO_MS  # the longest per-request SLO a request may ask for
    # answer a request whose batch is still running when its SLO runs out, dropped, then
    # (a stage that ran far over its time, e.g. on cores a burst took): an explicit drop
    # instead of a late answer; the batch runs on, its vGPU stays busy until it ends
    drop_overdue: bool = True

    def __post_init__(self) -> None:
        if not (self.reply_margin_us >= 0 and math.isfinite(self.reply_margin_us)):
            raise PoolpipeError(f"reply margin must be >= 0 µs, got {self.reply_margin_us}")
        if self.recalibrate_every < 1 or not self.recalibrate_band >= 0:
            raise PoolpipeError(
                "recalibration needs at least one call per check and a band >= 0, got "
                f"{self.recalibrate_every} and {self.recalibrate_band}"
            )
        if not (self.max_slo_ms > 0 and math.isfinite(self.max_slo_ms)):
            raise PoolpipeError(f"the longest SLO must be a finite ms > 0, got {self.max_slo_ms}")
        if not self.node_check_every_us > 0:
            raise PoolpipeError(f"node checks need a period > 0 µs, got {self.node_check_every_us}")
        if not self.node_sweep_every_us >= 0:
            raise PoolpipeError(
                f"the node sweep needs a period >= 0 µs (0: off), got {self.node_sweep_every_us}"
            )


@mypyc_attr(acyclic=True)
class _PoolUse:
    """One pool's counters in a served plan: batches run and the requests in them."""

    __slots__ = ("batches", "requests")

    def __init__(self) -> None:
        self.batches = 0
        self.requests = 0


class _Plan:
    """The runtime's bookkeeping of one served plan (a migration starts a new one; jobs
    dispatched on the old one finish on it, and it is retired after the last)."""

    __slots__ = (
        "answer_delays",
        "first_pool",
        "generation",
        "jobs",
        "model_stats",
        "node_vgpus",
        "plane",
        "pools",
        "recal",
        "row_bounds",
        "served",
        "slo_us",
        "stage_factors",
        "vgpu_busy_us",
        "vgpu_jobs",
        "vgpu_last_us",
        "vgpu_running",
    )

    def __init__(
        self,
        generation: int,
        served: ServedPlan,
        windows: Windows,
        config: RuntimeConfig,
        now_us: float = 0.0,
    ):
        self.generation = generation
        self.served = served
        self.plane = served.plane
        topo = served.topo
        V, P = len(topo.vgpus), len(topo.pools)
        # per vGPU (unboxed vectors, librt.vecs: a thousand GPUs' counters in a few
        # buffers, where an object per vGPU was read cold at each hop)
        self.vgpu_busy_us = vec[float]([0.0] * V)  # stage time, since the plan began
        # when its last stage ended (clock µs; the plan's start where none has run)
        self.vgpu_last_us = vec[float]([now_us] * V)
        self.vgpu_jobs = vec[i64]([0] * V)  # jobs with a hop on it, not yet ended
        self.vgpu_running = vec[i64]([0] * V)  # hops started, not yet done (observing)
        self.pools = [_PoolUse() for _ in range(P)]
        self.stage_factors: list[list[float]] = [[] for _ in range(P)]
        self.answer_delays: list[list[float]] = [[] for _ in range(P)]  # by last pool
        self.node_vgpus: dict[str, list[int]] = {}
        for v, node in served.vgpu_node.items():
            self.node_vgpus.setdefault(node, []).append(v)
        self.first_pool = [pipe.pools[0] for pipe in topo.pipelines]
        self.slo_us = [m.slo_us for m in topo.models]
        self.recal = Recalibrator(topo, config.recalibrate_every, config.recalibrate_band)
        self.row_bounds = RowBounds(self.recal.base)  # the door's check, per request
        # the counters of the requests taken now (the open window's; see Windows)
        self.model_stats = [windows.epoch(m.name) for m in topo.models]
        self.jobs = 0  # dispatched and not ended

    @property
    def pool_busy_us(self) -> list[float]:
        return [sum(self.vgpu_busy_us[v] for v in p.vgpus) for p in self.served.topo.pools]

    def usage(self) -> PlanUsage:
        return PlanUsage(
            self.generation,
            self.served,
            tuple(self.vgpu_busy_us),
            tuple(u.batches for u in self.pools),
            tuple(u.requests for u in self.pools),
        )


class ServingRuntime:
    def __init__(
        self,
        served: ServedPlan,
        clock: Clock,
        executor: Executor,
        config: RuntimeConfig | None = None,
    ):
        self.clock = clock
        self.executor = executor
        self.config = config or RuntimeConfig()
        self.reply_margin_us = self.config.reply_margin_us
        self.stats: dict[str, ModelStats] = {}  # cumulative, per model
        self._windows = Windows(self.stats)
        self._plan = _Plan(0, served, self._windows, self.config, clock.now())
        self._old: list[_Plan] = []  # switched away from, with jobs still running
        self._observing = self.config.recalibrate or self.config.record_stage_factors
        self._keep_latencies = self.config.keep_latencies
        self._watch = OverdueWatch(clock, self._overdue) if self.config.drop_overdue else None
        # The requests taken and not yet answered, each at its slot (Entry.slot): a dict by
        # request id would make an int object per request and read it back cold at its
        # answer.
        self._live = Slots()
        self._next_id = 0
        self._wake: Timer | None = None
        self._wake_at = math.inf
        self._guard = WakeGuard()
        self._health = NodeHealth(clock, self._check_node, self.config.node_check_every_us)
        self._sweep: Timer | None = None
        if self.config.node_sweep_every_us > 0:
            self._sweep = clock.call_at(clock.now() + self.config.node_sweep_every_us, self._swept)
        self._migration = FlushMigration()
        self._report = StageReport(0, 0, 0.0, None)  # see _lend_report
        self.drop_reasons: Counter[str] = Counter()
        self.batches = 0  # batches sent down a pipeline (its first pool)
        # fn(model index, payloads) for every batch sent down a pipeline (on_batch)
        self._on_batch: Callable[[int, list[Any]], None] | None = None
        self.recalibrations = 0
        self.recoveries = 0  # failed nodes back in service
        executor.bind(self)

    # ------------------------------------------------------------------ what is served

    @property
    def served(self) -> ServedPlan:
        return self._plan.served

    @property
    def topo(self) -> Topology:
        return self._plan.served.topo

    @property
    def base_topo(self) -> Topology:
        """The serving plan's topology as served, before recalibration scaled any pool's
        latencies (`topo` is as scaled): what stage factors are measured against."""
        return self._plan.recal.base

    @property
    def plane(self) -> DataPlane:
        return self._plan.plane

    @property
    def generation(self) -> int:
        """Plans served before this one (0: the first; each migration adds one)."""
        return self._plan.generation

    def in_flight(self) -> int:
        """Requests taken and not yet answered (held ones excluded)."""
        return len(self._live)

    def idle(self) -> bool:
        """Nothing taken, held or switching: what is left on the clock is only watching."""
        m = self._migration
        return not len(self._live) and not m.held and m.switch is None

    def down_nodes(self) -> set[str]:
        """Nodes out of service because they failed (watched until they answer)."""
        return set(self._health.down)

    def drained_nodes(self) -> set[str]:
        """Nodes their operator took out of service (drain), until undrained."""
        return set(self._health.drained)

    def node_since(self) -> dict[str, float]:
        """When each node's state last changed (clock µs; nodes never changed absent)."""
        return dict(self._health.since)

    def on_node_change(self, fn: Callable[[str, str, str, float], None] | None) -> None:
        """`fn(node, state, why, t_us)` on every change of a node's state (down, back,
        drained, undrained): the driver logs and counts them."""
        self._health.on_change = fn

    def on_batch(self, fn: Callable[[int, list[Any]], None] | None) -> None:
        """`fn(model index, payloads)` for every batch sent down a pipeline, its requests'
        payloads in it: the driver records which requests were batched together."""
        self._on_batch = fn

    def without_path(self) -> set[int]:
        """Models (indexes) with no live path now: their requests fail at the door."""
        return set(self._health.no_path)

    def unservable(self) -> list[int]:
        """Models (indexes) whose own SLO, less the reply margin, leaves no pipeline time
        to serve a request in: the door refuses all of them (see check)."""
        return unservable(self._plan.row_bounds, self.reply_margin_us)

    def fastest_us(self, model: int) -> float:
        """The least time one row of model index `model` takes through the served plan
        (its fastest pipeline, every GPU idle): what the door checks requests against."""
        return self._plan.row_bounds.fastest_us(model)

    def has_live_path(self, model: int) -> bool:
        """Whether some pipeline of `model` has a vGPU in service in every pool."""
        return self._health.has_live_path(self._plan.served, model)

    def live_throughput(self) -> dict[str, float]:
        """Each served model's planned req/s on the vGPUs in service now."""
        return self._health.live_throughput(self._plan.served)

    def pool_busy_us(self) -> list[float]:
        """Stage time per pool of the plan served now, since it began (or reset_stats)."""
        return self._plan.pool_busy_us

    def usage(self) -> list[PlanUsage]:
        """What the plans not yet retired did: the one served now, and those switched away
        from whose last jobs are still running (the executor hears of the others through
        retire), oldest first."""
        return [p.usage() for p in (*self._old, self._plan)]

    @property
    def wake_late_us(self) -> float:
        """The p99 of how late the clock's wake-ups fired (part of the plane's guard)."""
        return self._guard.late_us

    @property
    def overrun_us(self) -> float:
        """The p99 of how far batches ended after their reservation (part of the guard)."""
        return self._guard.overrun_us

    # ------------------------------------------------------------------ intake

    def add(
        self, model: int, payload: Any, slo_us: float | None = None, arrived_us: float | None = None
    ) -> Entry | None:
        """Take one request of model index `model` (of the serving plan); decisions wait for
        `decide()`. While a switch holds intake, the request waits for it (None)."""
        now = self.clock.now()
        arrived = now if arrived_us is None else arrived_us
        if self._migration.paused:
            name = self._plan.served.topo.models[model].name
            self._migration.hold(HeldRequest(name, slo_us, payload, arrived))
            return None
        return self._admit(model, payload, slo_us, arrived, now)

    def check(self, model: str, rows: int, slo_ms: object) -> tuple[int, float | None]:
        """A request at the door, before it is queued: (model index, SLO in µs or None for
        the model's), or a BadRequest naming what is wrong, or Unservable where the plan
        cannot serve it (counted: arrivals and refused; see intake.check_request)."""
        try:
            return check_request(
                self._plan.recal.base,
                model,
                rows,
                slo_ms,
                self.reply_margin_us,
                self.config.max_slo_ms,
                self._plan.row_bounds,
            )
        except Unservable:
            stats = self._windows.epoch(model)
            stats.arrivals += rows
            stats.refused += rows
            stats.total.arrivals += rows
            stats.total.refused += rows
            raise

    def submit(
        self, model: int, payloads: Sequence[Any], slo_us: float | None = None
    ) -> list[Entry | None]:
        """Take several requests of one model at once and decide."""
        entries = [self.add(model, p, slo_us) for p in payloads]
        self._decide(self.clock.now())
        return entries

    def arrive(self, model: int, payload: Any) -> None:
        """One request at the model's SLO, arriving now, and a decision if the data plane
        has one to make (the simulator's arrivals; the hot path, so `_admit` is inlined)."""
        now = self.clock.now()
        plan = self._plan
        if self._migration.paused:
            name = plan.served.topo.models[model].name
            self._migration.hold(HeldRequest(name, None, payload, now))
            return
        rid = self._next_id
        self._next_id = rid + 1
        stats = plan.model_stats[model]
        due = now + plan.slo_us[model]
        entry = Entry(rid, model, now, due - self.reply_margin_us, due, payload, stats)
        stats.arrivals += 1
        stats.total.arrivals += 1
        no_path = self._health.no_path
        if no_path and model in no_path:
            self._end(entry, FAILED, self._health.no_path_reason(plan.served, model), now)
            return
        self._take(entry)
        if plan.plane.add_request(entry, now):
            self._decide(now)

    def decide(self) -> None:
        self._decide(self.clock.now())

    def _admit(
        self, model: int, payload: Any, slo_us: float | None, arrived: float, now: float
    ) -> Entry:
        plan = self._plan
        slo = plan.slo_us[model] if slo_us is None else slo_us
        rid = self._next_id
        self._next_id = rid + 1
        stats = plan.model_stats[model]
        due = arrived + slo
        entry = Entry(rid, model, arrived, due - self.reply_margin_us, due, payload, stats)
        stats.arrivals += 1
        stats.total.arrivals += 1
        no_path = self._health.no_path
        if no_path and model in no_path:
            self._end(entry, FAILED, self._health.no_path_reason(plan.served, model), now)
            return entry
        self._take(entry)
        plan.plane.add_request(entry, now)  # the caller decides
        return entry

    # ------------------------------------------------------------------ decisions

    def _decide(self, now: float) -> None:
        plan = self._plan
        dec = plan.plane.decide(now)
        if dec.drops:
            no_path = self._health.no_path
            for drop in dec.drops:
                # (the plane's requests are the runtime's entries)
                entry: Entry = drop.request  # type: ignore[assignment]
                if not self._release(entry):
                    continue
                if no_path and entry.model in no_path:  # its path went with a node: failed
                    reason = self._health.no_path_reason(plan.served, entry.model)
                    self._end(entry, FAILED, reason, now)
                else:
                    self._end(entry, DROPPED, drop.reason, now)
        for d in dec.dispatches:
            self._start(plan, d)
        w = dec.wake_at_us
        if w is not None and w != self._wake_at:
            if self._wake is not None:
                self._wake.cancel()
            self._wake_at = w = max(w, now)
            self._wake = self.clock.call_at(w, self._on_wake)

    def _on_wake(self) -> None:
        now = self.clock.now()
        late = now - self._wake_at
        self._wake, self._wake_at = None, math.inf
        # A batch held for more requests until its last moment is dropped when the wake
        # comes later than the plane's guard: wake earlier by what the clock's lateness
        # has been (the simulator's is 0, a busy live host's a few ms).
        if self._guard.wake_seen(late):
            self._plan.plane.set_wake_lateness(self._guard.extra_us)
        self._decide(now)

    def _start(self, plan: _Plan, d: Dispatch) -> None:
        # The plane's requests are the runtime's entries, all still waiting: a request is
        # answered by the plane's drop (never dispatched then), by its batch's end, or by
        # a failure (its job ends there). Answers skip any entry that has one already.
        entries: list[Entry] = d.requests  # type: ignore[assignment]
        n = len(entries)
        pools, jobs = plan.pools, plan.vgpu_jobs
        for hop in d.hops:
            pu = pools[hop.pool]
            pu.batches += 1
            pu.requests += n
            jobs[hop.vgpu] += 1
        if d.hops[0].pool == plan.first_pool[d.pipeline]:
            self.batches += 1
            stats = entries[0].stats
            sizes = stats.batch_sizes
            sizes[n] = sizes.get(n, 0) + 1
            sizes = stats.total.batch_sizes
            sizes[n] = sizes.get(n, 0) + 1
            if self._on_batch is not None:
                self._on_batch(entries[0].model, [e.payload for e in entries])
        due = math.inf
        for e in entries:
            if e.due_us < due:
                due = e.due_us
        job = Job(d, entries, plan, due - d.hops[-1].end_us)
        plan.jobs += 1
        if self._watch is not None:
            self._watch.add(job, due)
        self.executor.run(job)

    def _ended(self, job: Job) -> None:
        """`job` reported its last hop (done, failed or let go). A plan switched away from
        is retired with its last job: the executor forgets it, and so does the runtime."""
        job.ended = True
        if self._watch is not None:
            self._watch.ended(job)
        plan: _Plan = job._plan
        plan.jobs -= 1
        jobs = plan.vgpu_jobs
        for hop in job.dispatch.hops:
            jobs[hop.vgpu] -= 1
        if plan.jobs == 0 and plan is not self._plan:
            self._retire(plan)

    def _retire(self, plan: _Plan) -> None:
        self._old.remove(plan)
        self.executor.retire(plan.usage())

    # ------------------------------------------------------------------ overdue batches

    def _overdue(self, job: Job, now: float) -> float:
        """Answer, dropped, the requests of running `job` whose SLO has run out; the
        earliest SLO end among those left (inf: none left, and the job's later hops will
        not run: the executor asks hop_late, which lets them go)."""
        first = self._drop_due_before(job, now, DROP_OVERDUE, now)
        if first == math.inf:
            job.slack_us = -math.inf
        return first

    def _drop_due_before(self, job: Job, limit: float, reason: str, now: float) -> float:
        """Answer, dropped for `reason`, the requests of `job` still waiting whose SLO ends
        before `limit`; the earliest SLO end among those left (inf: none left)."""
        first = math.inf
        for entry in job.entries:
            if entry.outcome is not PENDING:
                continue
            if entry.due_us < limit:
                if self._release(entry):
                    self._end(entry, DROPPED, reason, now)
            elif entry.due_us < first:
                first = entry.due_us
        return first

    # ------------------------------------------------------------------ reports

    def hop_started(
        self,
        job: Job,
        h: int,
        start_us: float,
        transfer_start_us: float | None = None,
        transfer_end_us: float | None = None,
    ) -> None:
        """Hop `h` of `job` started computing at `start_us` (after its transfer from
        `transfer_start_us` to `transfer_end_us`, if it had one)."""
        plan: _Plan = job._plan
        d = job.dispatch
        job.started = h + 1
        if self._observing:
            v = d.hops[h].vgpu
            running = plan.vgpu_running
            if running[v] == 0:
                job.idle |= i64(1) << h
            running[v] += 1
        report = self._lend_report(d.id, h, start_us, None, transfer_start_us, transfer_end_us)
        plan.plane.on_stage_started(report, start_us)

    def _lend_report(
        self,
        dispatch: int,
        h: int,
        start_us: float,
        end_us: float | None,
        transfer_start_us: float | None,
        transfer_end_us: float | None,
    ) -> StageReport:
        """The one StageReport this runtime lends the plane for a call (DataPlane: read,
        not kept), filled in: two reports made per hop cost the simulator 3%."""
        return self._report.fill(dispatch, h, start_us, end_us, transfer_start_us, transfer_end_us)

    def hop_done(self, job: Job, h: int, start_us: float, end_us: float) -> None:
        """Hop `h` of `job` computed from `start_us` to `end_us`; the last hop answers."""
        plan: _Plan = job._plan
        d = job.dispatch
        hop = d.hops[h]
        plan.vgpu_busy_us[hop.vgpu] += end_us - start_us
        if end_us > plan.vgpu_last_us[hop.vgpu]:
            plan.vgpu_last_us[hop.vgpu] = end_us
        current = plan is self._plan
        if self._observing:
            plan.vgpu_running[hop.vgpu] -= 1
            job.excess_us += (end_us - start_us) - (hop.end_us - hop.start_us)
            if job.idle >> h & 1 and current:
                reserved = max(1.0, hop.end_us - hop.start_us)
                self._observe(plan, hop.pool, (end_us - start_us) / reserved)
        report = self._lend_report(d.id, h, start_us, end_us, None, None)
        again = plan.plane.on_stage_done(report, end_us)
        last = h == len(d.hops) - 1
        if last:
            if self._observing and current:
                if self.config.record_stage_factors:  # of every batch (take_answer_delays)
                    # beyond its stages' own time: inputs, maps and the answer late
                    plan.answer_delays[hop.pool].append(end_us - hop.end_us - job.excess_us)
                if job.idle == (i64(1) << job.started) - 1 and self._guard.overrun_seen(
                    end_us - hop.end_us
                ):  # (every hop on an idle vGPU)
                    self._plan.plane.set_wake_lateness(self._guard.extra_us)
            if d.final:
                for entry in job.entries:
                    if entry.outcome is not PENDING:
                        continue
                    self._release(entry)
                    if end_us <= entry.due_us:
                        self._end(entry, ON_TIME, "", end_us)
                    elif self._watch is not None:  # past its SLO before the watch answered
                        self._end(entry, DROPPED, DROP_OVERDUE, end_us)
                    else:
                        self._end(entry, LATE, "", end_us)
            self._ended(job)
        if again and current:
            self._decide(self.clock.now())

    def hop_late(self, job: Job, h: int, start_us: float = -math.inf) -> bool:
        """Hop `h` of `job` may start now (or its compute at `start_us`, where its inputs
        are sent first), later than reserved (its vGPU was busy with a
        stage that ran over its reservation). Requests that can no longer be on time (the
        rest of the path as reserved, shifted by the delay, ends after their SLO: late even
        with no time for the reply, whose margin was held back for this) are dropped now,
        explicitly, rather than answered late; True while any request of the batch remains,
        else the rest of the path is released and the hop must not run. (A driver also asks
        it of a hop that was not run for want of time: a chain's hop whose node had no
        time left to forward the feature map to.)"""
        plan: _Plan = job._plan
        d = job.dispatch
        now = self.clock.now()
        end = d.hops[-1].end_us + (max(now, start_us) - d.hops[h].start_us)
        first = self._drop_due_before(job, end, DROP_STAGE_OVERRAN, now)
        if first < math.inf:
            job.slack_us = first - d.hops[-1].end_us
            return True
        if job.started > h and self._observing:  # a hop given up on after it started
            plan.vgpu_running[d.hops[h].vgpu] -= 1
        plan.plane.on_dispatch_failed(d.id, h, now)
        current = plan is self._plan
        self._ended(job)
        if current:
            self._decide(now)
        return False

    def hop_failed(self, job: Job, h: int, why: str, node_failed: bool = True) -> None:
        """Hop `h` of `job` failed. `node_failed`: its node did not serve it (unreachable,
        or answered with an error): the node's vGPUs leave service and are watched until
        it answers. Otherwise (the call timed out: a node too busy to answer in time is
        not a dead one) the node stays in service. Either way the job's requests start
        over once on a live path (one whose deadline passed meanwhile is dropped by the
        data plane, a miss like any), else they fail explicitly."""
        plan: _Plan = job._plan
        d = job.dispatch
        hop = d.hops[h]
        now = self.clock.now()
        if job.started > h and self._observing:
            plan.vgpu_running[hop.vgpu] -= 1
        plan.plane.on_dispatch_failed(d.id, h, now)
        node = plan.served.vgpu_node[hop.vgpu]
        current = plan is self._plan
        self._ended(job)
        if current and node_failed and node not in self._health.down:
            self._node_down(node, now, why)
        retry = []
        for entry in job.entries:
            if entry.outcome is not PENDING:
                continue
            if current and entry.attempts < 2:
                entry.attempts += 1
                entry.stats.retried += 1
                entry.stats.total.retried += 1
                retry.append(entry)
            else:
                self._fail(entry, f"{why} (node {node}; no attempt left to retry)", now)
        if not retry:
            return
        if self.has_live_path(retry[0].model):
            for entry in retry:
                plan.plane.add_request(entry, now)
        else:
            for entry in retry:
                self._fail(entry, f"no live path for this model: {why} (node {node})", now)
        self._decide(now)

    def node_checked(
        self, node: str, ok: bool | None, why: str = "", served: ServedPlan | None = None
    ) -> bool:
        """The executor's answer to check_node (ok None: no answer in time). A down node
        that serves again returns (True); a node in service that does not serve (the
        sweep's check) leaves service at once; one that was only slow to answer stays (a
        busy node is not a dead one). The answer of a check of a plan no longer served
        (`served`, where given) is dropped: a rollout that ended while it ran unloaded
        the models it looked for, and says nothing of the plan served now (whose sweep
        checks the node again; a down node is asked again, about the plan served now: its
        watch goes on)."""
        health = self._health
        now = self.clock.now()
        if served is not None and not self.serves(served):
            if node in health.down:
                health.watch(node, now)
            return False
        if node not in health.down:
            if ok is False and node in self._plan.node_vgpus and node not in health.drained:
                self._node_down(node, now, why or "not ready")
                self._decide(now)
            return False
        if not ok or node in health.unwatched:
            health.watch(node, now)
            return False
        plan = self._plan
        if node not in health.drained:
            for v in plan.node_vgpus.get(node, ()):
                plan.plane.set_vgpu_down(v, False, now)
        health.back(node, plan.served, now)
        self.recoveries += 1
        self._decide(now)
        return True

    def serves(self, served: ServedPlan) -> bool:
        """Is `served` the plan served now? (A recalibration keeps the plan's plane, which
        it rescales; a rollout brings another.)"""
        return served.plane is self._plan.served.plane

    def node_lost(self, node: str, why: str) -> None:
        """`node` is gone (its watch connection broke: its process died or is stopping):
        out of service at once, before any call to it fails; watched until it answers."""
        self._health.unwatched.add(node)
        if node in self._health.down or node not in self._plan.node_vgpus:
            return
        now = self.clock.now()
        self._node_down(node, now, why)
        self._decide(now)

    def node_watched(self, node: str) -> None:
        """`node`'s watch connection is open again (its process runs): its checks may put
        it back in service (until then a node that lost its watch stays out, even while
        its Triton, shutting down, still answers them)."""
        self._health.unwatched.discard(node)

    def drain(self, node: str) -> int:
        """Take `node` out of new batches (its operator's drain); the batches on it run to
        their end (`node_jobs`). Returns that number now."""
        plan = self._plan
        if node not in plan.node_vgpus:
            raise PoolpipeError(
                f"node {node!r} serves nothing of the plan served; it has "
                f"{', '.join(sorted(plan.node_vgpus))}"
            )
        health = self._health
        if node not in health.drained:
            now = self.clock.now()
            for v in plan.node_vgpus[node]:
                plan.plane.set_vgpu_down(v, True, now)
            health.drain(node, plan.served, now)
            self._decide(now)
        return self.node_jobs(node)

    def undrain(self, node: str) -> None:
        """Put a drained node back in service (checked at once: one that does not serve
        goes down and is watched)."""
        health = self._health
        if node not in health.drained:
            return
        plan = self._plan
        now = self.clock.now()
        if node not in health.down:
            for v in plan.node_vgpus.get(node, ()):
                plan.plane.set_vgpu_down(v, False, now)
        health.undrain(node, plan.served, now)
        if node not in health.down and node in plan.node_vgpus:
            self._check_node(node)
        self._decide(now)

    def node_jobs(self, node: str) -> int:
        """Batches with a hop on `node` that have not ended, over every plan not retired."""
        plans = (*self._old, self._plan)
        return sum(sum(p.vgpu_jobs[v] for v in p.node_vgpus.get(node, ())) for p in plans)

    def node_idle_us(self, node: str, now: float) -> float:
        """How long `node` has run no stage of any plan not retired (since the served plan
        began where it has run none of it): packing (adaptive.PACK) leaves the highest
        vGPUs idle at a low load, and a node idle long enough can be drained and released."""
        last = -math.inf
        for p in (*self._old, self._plan):
            for v in p.node_vgpus.get(node, ()):
                last = max(last, p.vgpu_last_us[v])
        return max(0.0, now - last) if last > -math.inf else 0.0

    def _node_down(self, node: str, now: float, why: str = "") -> None:
        plan = self._plan
        for v in plan.node_vgpus.get(node, ()):
            plan.plane.set_vgpu_down(v, True, now)
        self._health.failed(node, plan.served, now, why)

    def _check_node(self, node: str) -> None:
        self.executor.check_node(node, self._plan.served)

    def _swept(self) -> None:
        """Check every node of the plan served that is in service (see node_sweep_every_us)."""
        health = self._health
        for node in self._plan.node_vgpus:
            if node not in health.out:
                self._check_node(node)
        self._sweep = self.clock.call_at(
            self.clock.now() + self.config.node_sweep_every_us, self._swept
        )

    def stop_sweep(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # ------------------------------------------------------------------ answers

    def _end(self, entry: Entry, outcome: Outcome, reason: str, t: float) -> None:
        entry.outcome = outcome
        latency = (
            t - entry.arrival_us
            if self._keep_latencies and (outcome is ON_TIME or outcome is LATE)
            else None
        )
        stats = entry.stats  # its window's; and the model's cumulative counters
        count_answer(stats, outcome, latency)
        count_answer(stats.total, outcome, latency)
        if outcome is DROPPED:
            self.drop_reasons[reason] += 1
        self.executor.answer(entry, outcome, reason)
        if not len(self._live) and self._migration.finishing:
            self.clock.call_at(t, self._complete_switch)

    def _fail(self, entry: Entry, why: str, now: float) -> None:
        if self._release(entry):
            self._end(entry, FAILED, why, now)

    def _take(self, entry: Entry) -> None:
        """`entry` is in flight until it is released (answered)."""
        entry.slot = self._live.take(entry)

    def _release(self, entry: Entry) -> bool:
        """`entry` answered: out of flight. False where it was already (answered before)."""
        slot = entry.slot
        if slot < 0:
            return False
        self._live.release(slot)
        entry.slot = -1
        return True

    # ------------------------------------------------------------------ recalibration

    def _observe(self, plan: _Plan, pool: int, factor: float) -> None:
        """A stage's measured / reserved time: kept for the simulator, and when the pool's
        recent median leaves the band, its latencies are scaled by it (recalibration.py)."""
        if self.config.record_stage_factors:  # against the latencies as served
            plan.stage_factors[pool].append(factor * plan.recal.scale[pool])
        if not self.config.recalibrate:
            return
        new = plan.recal.observe(pool, factor)
        if new is None:
            return
        plan.plane.set_latencies(new)
        plan.served = replace(plan.served, topo=new)
        self.recalibrations += 1

    def take_stage_factors(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan, measured compute time of the stages that found
        their vGPU idle, since the last call (RuntimeConfig.record_stage_factors), over the
        pool's latency as the plan was served (`base_topo`: before recalibration scaled
        it, so that factors taken before and after a recalibration describe one truth):
        what the simulator draws execution times from to predict this runtime's driver."""
        plan = self._plan
        out = tuple(tuple(f) for f in plan.stage_factors)
        for f in plan.stage_factors:
            f.clear()
        return out

    def take_answer_delays(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan (a pipeline's last), how much later than reserved
        the batches it ended were answered beyond what their stages took over their
        reserved times, since the last call (RuntimeConfig.record_stage_factors). What a
        live driver's data path adds (inputs and feature maps late on their links, the
        nodes' forwarding, a chain's answer on its way back, as its transport places the
        hops): what the simulator delays its answers by (SimConfig.answer_delays). Of every
        batch, those that waited for a vGPU too: a batch queued behind one the host made
        late starts late, and so on until the vGPU's queue empties (on emulated hc2-small,
        googlenet-v3's and repvgg-b3's second stages, one L4 vGPU each: most of their
        latest starts came within 3 ms of the previous batch's end there); the simulator's
        queues, on reserved times, do not make that. Measured only where every hop found
        its vGPU idle, the simulator kept ppipe 0.3-0.7 points above live on the same
        traces. (Where a wait is inside a hop's measured time, a relay's, nothing is left
        beyond the stages: the delay is 0 or less, an answer at once.)"""
        plan = self._plan
        out = tuple(tuple(f) for f in plan.answer_delays)
        for f in plan.answer_delays:
            f.clear()
        return out

    # ------------------------------------------------------------------ statistics

    def take_window(self) -> Window:
        """What happened since the last call: one row per model (arrivals, on time, late,
        dropped, failed, refused, latency p50/p99 ms, mean batch) of the requests that
        arrived in windows now all answered (Windows: never more outcomes than arrivals),
        and one per pool (busy ms since the last call)."""
        plan = self._plan
        window = Window(
            self._windows.model_rows(),
            self._windows.pool_rows(plan.served.topo, plan.pool_busy_us),
        )
        plan.model_stats = [self._windows.epoch(m.name) for m in plan.served.topo.models]
        return window

    @property
    def windows_pending(self) -> int:
        """Closed windows with requests still in flight (given out by a later look)."""
        return self._windows.pending

    def reset_stats(self) -> None:
        """Counters, windows, busy times and stage factors from zero; what recalibration
        has learnt stays."""
        for s in self.stats.values():
            s.clear()
        plan = self._plan
        for v in range(len(plan.vgpu_busy_us)):
            plan.vgpu_busy_us[v] = 0.0
        for f in plan.stage_factors:
            f.clear()
        for f in plan.answer_delays:
            f.clear()
        self.drop_reasons.clear()
        self._windows = Windows(self.stats)
        plan.model_stats = [self._windows.epoch(m.name) for m in plan.served.topo.models]

    # ------------------------------------------------------------------ migration

    def switch(
        self,
        served: ServedPlan,
        flush_timeout_us: float,
        on_done: Callable[[SwitchResult], None],
    ) -> None:
        """Pipeline-flush migration to `served`: pause intake (new requests are held, none
        is dropped), send every queued request out at once, let the in-flight batches
        finish (at most `flush_timeout_us`; what is left then fails explicitly), switch,
        resume with the held requests; `on_done` gets the downtime. A plan that does not
        serve every model served now is refused before anything changes."""
        missing = {m.name for m in self.topo.models} - {m.name for m in served.topo.models}
        if missing:
            raise PoolpipeError(f"the new plan does not serve {sorted(missing)}")
        now = self.clock.now()
        sw = self._migration.begin(served, now, on_done)
        self._plan.plane.drain()
        self._decide(now)
        if not len(self._live):
            self._complete_switch()
        elif not sw.done:
            sw.timer = self.clock.call_at(now + flush_timeout_us, self._complete_switch)

    def _complete_switch(self) -> None:
        sw = self._migration.finish()
        if sw is None:
            return
        now = self.clock.now()
        left = [cast(Entry, e) for e in self._live.items if e is not None]
        left.sort(key=_taken)  # in the order they were taken
        for entry in left:
            self._fail(entry, SWITCHED_AWAY, now)
        if self._wake is not None:
            self._wake.cancel()
        self._wake, self._wake_at = None, math.inf
        old = self._plan
        self._plan = plan = _Plan(
            old.generation + 1, sw.served, self._windows, self.config, now
        )
        if old.jobs:
            self._old.append(old)
        else:
            self.executor.retire(old.usage())
        plan.plane.set_wake_lateness(self._guard.extra_us)
        self._windows.restart_pools()
        out = self._health.out
        for v, node in sw.served.vgpu_node.items():
            if node in out:  # still failed or drained: out of the new plan's tables too
                plan.plane.set_vgpu_down(v, True, now)
        self._health.refresh(plan.served)
        held = self._migration.resume()
        topo = plan.served.topo
        for r in held:
            self._admit(topo.model_index(r.model), r.payload, r.slo_us, r.arrived_us, now)
        self._decide(now)
        sw.on_done(SwitchResult(now - sw.t0, len(held), len(left)))


def _taken(entry: Entry) -> int:
    """The order in which the runtime took its requests (their ids count up)."""
    return entry.id
