"""The serving runtime: every serving policy around the data plane, driven through a clock
and an executor (ports.py) and blind to which ones it has.

It takes requests (deadline = arrival + SLO - reply margin; a per-request SLO), asks the
data plane for decisions and wakes it when it asked to be woken, hands dispatched batches
to the executor and books what each hop really did, answers every request exactly once
(on time, late, dropped, failed), counts outcomes, handles a failed stage (the node's vGPUs
leave the reservation tables, the batch's requests start over once on a live path, else
fail explicitly), watches failed nodes until they answer again, recalibrates a pool whose
stages run slower or faster than reserved, and migrates to a new plan by pipeline flush
(pause intake, drain, let in-flight batches finish, switch, resume the held requests).

The simulator and the live router are its two drivers; neither restates a policy.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.intake import MAX_SLO_MS, check_request, p99
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
    ServedPlan,
    Timer,
)
from poolpipe.runtime.stats import ModelStats, Windows
from poolpipe.scheduler import DataPlane, Dispatch, StageReport
from poolpipe.scheduler.messages import DROP_OVERDUE, DROP_STAGE_OVERRAN
from poolpipe.scheduler.topology import Topology, with_latencies

# Live recalibration: after this many stage calls of a pool that found their vGPU idle, the
# median of measured / reserved time, when outside 1 +- RECALIBRATE_BAND, scales the pool's
# latencies (every batch size) for all later reservations. Start-up calibration times one
# call at a time; under load, stage workers that share a host's cores run slower.
RECALIBRATE_EVERY = 20
RECALIBRATE_BAND = 0.1
# ... by at most this factor either way from the latencies the plan was served with: stages
# measured far slower (a host's cores taken by an overload) would otherwise leave no batch
# fitting any SLO, and with nothing run, nothing measured to bring them back.
RECALIBRATE_MAX = 2.0
# A failed node is asked whether it serves again this often (µs).
NODE_CHECK_EVERY_US = 500_000.0
# The plane's wake guard grows by the p99 of how late the last WAKE_WINDOW wakes fired
# (recomputed every WAKE_EVERY wakes), by at most WAKE_LATE_CAP_US; and by the p99 of how
# far the last WAKE_WINDOW batches whose stages all found their vGPU idle ended after
# their reserved end (stages slower than reserved, transfers, the executor's own path),
# by at most OVERRUN_CAP_US. Batches held for more requests then go out that much earlier.
WAKE_WINDOW, WAKE_EVERY, WAKE_LATE_CAP_US = 256, 8, 20_000.0
OVERRUN_CAP_US = 20_000.0
# A request whose batch is still running this long after its SLO ran out is answered then,
# dropped (RuntimeConfig.drop_overdue): later than the SLO, never by a few µs of round-off.
OVERDUE_AFTER_US = 1.0
SWITCHED_AWAY = "the plan was switched before this request could finish"


def default_flush_timeout_us(old: Topology, new: Topology) -> float:
    """How long a flush may wait for the old plan's requests: two of the longest SLO of
    either plan, and a second for the switch itself."""
    return 2 * max(m.slo_us for m in (*old.models, *new.models)) + 1e6


@dataclass(frozen=True)
class RuntimeConfig:
    reply_margin_us: float = 0.0  # held back from every deadline for the way out (and in)
    recalibrate: bool = True  # scale a pool's latencies when its stages run off reservation
    recalibrate_every: int = RECALIBRATE_EVERY
    recalibrate_band: float = RECALIBRATE_BAND
    record_stage_factors: bool = False  # keep measured / reserved per pool (take_stage_factors)
    node_check_every_us: float = NODE_CHECK_EVERY_US
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


@dataclass(frozen=True)
class SwitchResult:
    downtime_us: float  # intake paused
    held: int  # requests that arrived meanwhile (served after the switch)
    failed: int  # requests the flush could not finish in time (answered with an error)


class Generation:
    """The runtime's bookkeeping of one served plan (a migration starts a new one; jobs
    dispatched on the old one finish on it)."""

    def __init__(self, served: ServedPlan, stats: dict[str, ModelStats]):
        self.served = served
        self.plane = served.plane
        topo = served.topo
        V, P = len(topo.vgpus), len(topo.pools)
        self.vgpu_busy_us = [0.0] * V
        self.running = [0] * V  # hops started and not yet done, per vGPU (when observing)
        self.pool_batches = [0] * P  # batches run and requests in them, per pool
        self.pool_requests = [0] * P
        self.stage_factors: list[list[float]] = [[] for _ in range(P)]
        self.recent: list[list[float]] = [[] for _ in range(P)]
        self.node_vgpus: dict[str, list[int]] = {}
        for v, node in served.vgpu_node.items():
            self.node_vgpus.setdefault(node, []).append(v)
        self.first_pool = [pipe.pools[0] for pipe in topo.pipelines]
        self.slo_us = [m.slo_us for m in topo.models]
        self.base_topo = topo  # as served (recalibration scales from it, within limits)
        self.scale = [1.0] * P  # each pool's latencies / its served ones
        self.model_stats = [stats.setdefault(m.name, ModelStats()) for m in topo.models]

    @property
    def pool_busy_us(self) -> list[float]:
        topo = self.served.topo
        return [sum(self.vgpu_busy_us[v] for v in p.vgpus) for p in topo.pools]


@dataclass
class _Switch:
    served: ServedPlan
    t0: float
    on_done: Callable[[SwitchResult], None]
    timer: Timer | None = None
    done: bool = False


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
        self.stats: dict[str, ModelStats] = {}
        self.gen = Generation(served, self.stats)
        self.generations = [self.gen]
        self._observing = self.config.recalibrate or self.config.record_stage_factors
        self._keep_latencies = self.config.keep_latencies
        self._drop_overdue = self.config.drop_overdue
        self._watched: list[tuple[float, int, Job]] = []  # running jobs by earliest SLO end
        self._watch_seq = 0
        self._watch_timer: Timer | None = None
        self._watch_at = math.inf
        self._live: dict[int, Entry] = {}
        self._next_id = 0
        self._wake: Timer | None = None
        self._wake_at = math.inf
        # How late the clock's timers fire (its wakes), for the plane's wake guard
        self._late_us: deque[float] = deque(maxlen=WAKE_WINDOW)
        self._late_n = self._over_n = 0  # samples taken (each window recomputed every few)
        self.wake_late_us = 0.0  # p99 of the window, at most WAKE_LATE_CAP_US
        # How far batches that never queued ended after their reservation
        self._over_us: deque[float] = deque(maxlen=WAKE_WINDOW)
        self.overrun_us = 0.0  # p99 of the window, at most OVERRUN_CAP_US
        self._down: set[str] = set()  # failed nodes, until they answer again
        self._no_path: set[int] = set()  # models with no live path (failed at the door)
        self._paused = False
        self._held: list[tuple[str, float | None, Any, float]] = []
        self._switch: _Switch | None = None
        self.drop_reasons: Counter[str] = Counter()
        self.batches = 0  # batches sent down a pipeline (its first pool)
        self.recalibrations = 0
        self.recoveries = 0  # failed nodes back in service
        self.windows = Windows()
        executor.bind(self)

    # ------------------------------------------------------------------ what is served

    @property
    def served(self) -> ServedPlan:
        return self.gen.served

    @property
    def topo(self) -> Topology:
        return self.gen.served.topo

    @property
    def plane(self) -> DataPlane:
        return self.gen.plane

    def in_flight(self) -> int:
        """Requests taken and not yet answered (held ones excluded)."""
        return len(self._live)

    def idle(self) -> bool:
        """Nothing taken, held or switching: what is left on the clock is only watching."""
        return not self._live and not self._held and self._switch is None

    def down_nodes(self) -> set[str]:
        return set(self._down)

    def without_path(self) -> set[int]:
        """Models (indexes) with no live path now: their requests fail at the door."""
        return set(self._no_path)

    def _kept(self, pipeline: int) -> float:
        """The share of a pipeline's planned throughput its vGPUs in service keep: a pool
        does the share of its work that its vGPUs up can (any of them takes any batch), and
        the pipeline keeps the share its most-hit pool keeps (0: no live path through it)."""
        topo, vn, down = self.gen.served.topo, self.gen.served.vgpu_node, self._down
        return min(
            sum(vn[v] not in down for v in topo.pools[p].vgpus) / len(topo.pools[p].vgpus)
            for p in topo.pipelines[pipeline].pools
        )

    def has_live_path(self, model: int) -> bool:
        """Whether some pipeline of `model` has a vGPU in service in every pool."""
        return any(self._kept(i) > 0 for i in self.gen.served.topo.models[model].pipelines)

    def live_throughput(self) -> dict[str, float]:
        """Each served model's planned req/s on the vGPUs in service now (see _kept)."""
        topo = self.gen.served.topo
        return {
            m.name: sum(topo.pipelines[i].throughput * self._kept(i) for i in m.pipelines)
            for m in topo.models
        }

    # ------------------------------------------------------------------ intake

    def add(
        self, model: int, payload: Any, slo_us: float | None = None, arrived_us: float | None = None
    ) -> Entry | None:
        """Take one request of model index `model` (of the serving plan); decisions wait for
        `decide()`. While a switch holds intake, the request waits for it (None)."""
        now = self.clock.now()
        arrived = now if arrived_us is None else arrived_us
        if self._paused:
            self._held.append((self.gen.served.topo.models[model].name, slo_us, payload, arrived))
            return None
        return self._admit(model, payload, slo_us, arrived, now)

    def check(self, model: str, rows: int, slo_ms: object) -> tuple[int, float | None]:
        """A request at the door, before it is queued: (model index, SLO in µs or None for
        the model's), or a BadRequest naming what is wrong (see intake.check_request)."""
        return check_request(
            self.gen.base_topo, model, rows, slo_ms, self.reply_margin_us, self.config.max_slo_ms
        )

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
        gen = self.gen
        if self._paused:
            self._held.append((gen.served.topo.models[model].name, None, payload, now))
            return
        rid = self._next_id
        self._next_id = rid + 1
        stats = gen.model_stats[model]
        due = now + gen.slo_us[model]
        entry = Entry(rid, model, now, due - self.reply_margin_us, due, payload, stats)
        stats.arrivals += 1
        if self._no_path and model in self._no_path:
            self._end(entry, FAILED, self._no_path_reason(model), now)
            return
        self._live[rid] = entry
        if gen.plane.add_request(entry, now):
            self._decide(now)

    def decide(self) -> None:
        self._decide(self.clock.now())

    def _admit(
        self, model: int, payload: Any, slo_us: float | None, arrived: float, now: float
    ) -> Entry:
        gen = self.gen
        slo = gen.slo_us[model] if slo_us is None else slo_us
        rid = self._next_id
        self._next_id = rid + 1
        stats = gen.model_stats[model]
        due = arrived + slo
        entry = Entry(rid, model, arrived, due - self.reply_margin_us, due, payload, stats)
        stats.arrivals += 1
        if self._no_path and model in self._no_path:
            self._end(entry, FAILED, self._no_path_reason(model), now)
            return entry
        self._live[rid] = entry
        gen.plane.add_request(entry, now)  # the caller decides
        return entry

    def _no_path_reason(self, model: int) -> str:
        name = self.gen.served.topo.models[model].name
        return f"no live path for model {name}: node(s) {', '.join(sorted(self._down))} down"

    def _refresh_paths(self) -> None:
        """Which models have no live path left (their requests fail at once, saying so)."""
        self._no_path = {
            m for m in range(len(self.gen.served.topo.models)) if not self.has_live_path(m)
        }

    # ------------------------------------------------------------------ decisions

    def _decide(self, now: float) -> None:
        gen = self.gen
        dec = gen.plane.decide(now)
        if dec.drops:
            live = self._live
            for drop in dec.drops:
                entry = live.pop(drop.request.id, None)
                if entry is not None:
                    self._end(entry, DROPPED, drop.reason, now)
        for d in dec.dispatches:
            self._start(gen, d, now)
        w = dec.wake_at_us
        if w is not None and w != self._wake_at:
            if self._wake is not None:
                self._wake.cancel()
            self._wake_at = w = max(w, now)
            self._wake = self.clock.call_at(w, self._on_wake)

    def _on_wake(self) -> None:
        now = self.clock.now()
        self._late_us.append(max(0.0, now - self._wake_at))
        self._wake, self._wake_at = None, math.inf
        self._late_n += 1
        if self._late_n % WAKE_EVERY == 0:
            # A batch held for more requests until its last moment is dropped when the
            # wake comes later than the plane's guard: wake earlier by what the clock's
            # lateness has been (the simulator's is 0, a busy live host's a few ms).
            late = min(WAKE_LATE_CAP_US, p99(self._late_us))
            if late != self.wake_late_us:
                self.wake_late_us = late
                self.gen.plane.set_wake_lateness(self.guard_extra_us)
        self._decide(now)

    @property
    def guard_extra_us(self) -> float:
        """What the plane's wake guard holds back beyond its floor: the timer's lateness
        and the batches' overrun (p99 of each)."""
        return self.wake_late_us + self.overrun_us

    def _overran(self, over_us: float) -> None:
        self._over_us.append(max(0.0, over_us))
        self._over_n += 1
        if self._over_n % WAKE_EVERY == 0:
            over = min(OVERRUN_CAP_US, p99(self._over_us))
            if over != self.overrun_us:
                self.overrun_us = over
                self.gen.plane.set_wake_lateness(self.guard_extra_us)

    def _start(self, gen: Generation, d: Dispatch, now: float) -> None:
        # The plane's requests are the runtime's entries, all still waiting: a request is
        # answered by the plane's drop (never dispatched then), by its batch's end, or by
        # a failure (its job ends there). Answers skip any entry that has one already.
        entries: list[Entry] = d.requests  # type: ignore[assignment]
        n = len(entries)
        for hop in d.hops:
            gen.pool_batches[hop.pool] += 1
            gen.pool_requests[hop.pool] += n
        if d.hops[0].pool == gen.first_pool[d.pipeline]:
            self.batches += 1
            entries[0].stats.batch_sizes[n] += 1
        due = min(e.due_us for e in entries)
        job = Job(d, entries, gen, due - d.hops[-1].end_us)
        if self._drop_overdue:
            self._watch_seq += 1
            heapq.heappush(self._watched, (due, self._watch_seq, job))
            if due < self._watch_at:
                self._arm_watch(due)
        self.executor.run(job)

    # ------------------------------------------------------------------ overdue batches

    def _arm_watch(self, due: float) -> None:
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        self._watch_at = due
        self._watch_timer = self.clock.call_at(due + OVERDUE_AFTER_US, self._on_watch)

    def _on_watch(self) -> None:
        """The earliest SLO among the running jobs has run out: requests of jobs still
        running past their SLO are answered now, dropped (RuntimeConfig.drop_overdue). One
        timer for all running jobs: a heap of (earliest SLO end, job), ended jobs skipped."""
        self._watch_timer, self._watch_at = None, math.inf
        now = self.clock.now()
        watched = self._watched
        while watched and (watched[0][2].ended or watched[0][0] < now):
            _, _, job = heapq.heappop(watched)
            if job.ended:
                continue
            first = self._overdue(job, now)
            if first < math.inf:
                self._watch_seq += 1
                heapq.heappush(watched, (first, self._watch_seq, job))
        if watched:
            self._arm_watch(watched[0][0])

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
        live = self._live
        first = math.inf
        for entry in job.entries:
            if entry.outcome != PENDING:
                continue
            if entry.due_us < limit:
                if live.pop(entry.id, None) is not None:
                    self._end(entry, DROPPED, reason, now)
            elif entry.due_us < first:
                first = entry.due_us
        return first

    # ------------------------------------------------------------------ reports

    def hop_started(
        self, job: Job, h: int, start_us: float, transfer: tuple[float, float] | None = None
    ) -> None:
        """Hop `h` of `job` started computing at `start_us` (after its transfer, if any)."""
        gen = job.generation
        d = job.dispatch
        job.started = h + 1
        if self._observing:
            v = d.hops[h].vgpu
            job.idle.append(gen.running[v] == 0)
            gen.running[v] += 1
        if transfer is None:
            report = StageReport(d.id, h, start_us, None)
        else:
            report = StageReport(d.id, h, start_us, None, transfer[0], transfer[1])
        gen.plane.on_stage_started(report, start_us)

    def hop_done(self, job: Job, h: int, start_us: float, end_us: float) -> None:
        """Hop `h` of `job` computed from `start_us` to `end_us`; the last hop answers."""
        gen = job.generation
        d = job.dispatch
        hop = d.hops[h]
        gen.vgpu_busy_us[hop.vgpu] += end_us - start_us
        if self._observing:
            gen.running[hop.vgpu] -= 1
            if job.idle[h] and gen is self.gen:
                reserved = max(1.0, hop.end_us - hop.start_us)
                self._observe(gen, hop.pool, (end_us - start_us) / reserved)
        again = gen.plane.on_stage_done(StageReport(d.id, h, start_us, end_us), end_us)
        last = h == len(d.hops) - 1
        if last:
            job.ended = True
        if last and self._observing and all(job.idle) and gen is self.gen:
            self._overran(end_us - hop.end_us)
        if last and d.final:
            live = self._live
            for entry in job.entries:
                if entry.outcome != PENDING:
                    continue
                del live[entry.id]
                if end_us <= entry.due_us:
                    self._end(entry, ON_TIME, "", end_us)
                elif self._drop_overdue:  # past its SLO before the watch could answer it
                    self._end(entry, DROPPED, DROP_OVERDUE, end_us)
                else:
                    self._end(entry, LATE, "", end_us)
        if again and gen is self.gen:
            self._decide(self.clock.now())

    def hop_late(self, job: Job, h: int) -> bool:
        """Hop `h` of `job` may start now, later than reserved (its vGPU was busy with a
        stage that ran over its reservation). Requests that can no longer be on time (the
        rest of the path as reserved, shifted by the delay, ends after their SLO: late even
        with no time for the reply, whose margin was held back for this) are dropped now,
        explicitly, rather than answered late; True while any request of the batch remains,
        else the rest of the path is released and the hop must not run. (A driver also asks
        it of a hop that was not run for want of time: a chain's hop whose node had no
        time left to forward the feature map to.)"""
        gen = job.generation
        d = job.dispatch
        now = self.clock.now()
        end = d.hops[-1].end_us + (now - d.hops[h].start_us)
        first = self._drop_due_before(job, end, DROP_STAGE_OVERRAN, now)
        if first < math.inf:
            job.slack_us = first - d.hops[-1].end_us
            return True
        job.ended = True
        if job.started > h and self._observing:  # a hop given up on after it started
            gen.running[d.hops[h].vgpu] -= 1
        gen.plane.on_dispatch_failed(d.id, h, now)
        if gen is self.gen:
            self._decide(now)
        return False

    def hop_failed(self, job: Job, h: int, why: str) -> None:
        """Hop `h` of `job` failed (its node did not answer): the node's vGPUs leave
        service and are watched until they answer; the job's requests start over once on
        a live path (one whose deadline passed meanwhile is dropped by the data plane, a
        miss like any), else they fail explicitly."""
        gen = job.generation
        d = job.dispatch
        hop = d.hops[h]
        now = self.clock.now()
        if job.started > h and self._observing:
            gen.running[hop.vgpu] -= 1
        job.ended = True
        gen.plane.on_dispatch_failed(d.id, h, now)
        node = gen.served.vgpu_node[hop.vgpu]
        current = gen is self.gen
        if current and node not in self._down:
            self._node_down(node, now)
        retry = []
        for entry in job.entries:
            if entry.outcome != PENDING:
                continue
            if current and entry.attempts < 2:
                entry.attempts += 1
                entry.stats.retried += 1
                retry.append(entry)
            else:
                self._fail(entry, f"{why} (node {node}; no attempt left to retry)", now)
        if not retry:
            return
        if self.has_live_path(retry[0].model):
            for entry in retry:
                gen.plane.add_request(entry, now)
        else:
            for entry in retry:
                self._fail(entry, f"no live path for this model: {why} (node {node})", now)
        self._decide(now)

    def node_checked(self, node: str, ok: bool) -> None:
        """The executor's answer to check_node: a node that serves again returns."""
        if node not in self._down:
            return
        now = self.clock.now()
        if not ok:
            self._watch(node, now)
            return
        self._down.discard(node)
        for v in self.gen.node_vgpus.get(node, ()):
            self.gen.plane.set_vgpu_down(v, False, now)
        self._refresh_paths()
        self.recoveries += 1
        self._decide(now)

    def _node_down(self, node: str, now: float) -> None:
        self._down.add(node)
        for v in self.gen.node_vgpus.get(node, ()):
            self.gen.plane.set_vgpu_down(v, True, now)
        self._refresh_paths()
        self._watch(node, now)

    def _watch(self, node: str, now: float) -> None:
        def check() -> None:
            if node in self._down:
                self.executor.check_node(node, self.gen.served)

        self.clock.call_at(now + self.config.node_check_every_us, check)

    # ------------------------------------------------------------------ answers

    def _end(self, entry: Entry, outcome: int, reason: str, t: float) -> None:
        entry.outcome = outcome
        stats = entry.stats
        if outcome == ON_TIME:
            stats.on_time += 1
        elif outcome == LATE:
            stats.late += 1
        elif outcome == DROPPED:
            stats.dropped += 1
            self.drop_reasons[reason] += 1
        else:
            stats.failed += 1
        if outcome <= LATE and self._keep_latencies:
            stats.latency_us.append(t - entry.arrival_us)
        self.executor.answer(entry, outcome, reason)
        sw = self._switch
        if sw is not None and not self._live and not sw.done:
            self.clock.call_at(t, self._complete_switch)

    def _fail(self, entry: Entry, why: str, now: float) -> None:
        if self._live.pop(entry.id, None) is not None:
            self._end(entry, FAILED, why, now)

    # ------------------------------------------------------------------ recalibration

    def _observe(self, gen: Generation, pool: int, factor: float) -> None:
        """A stage's measured / reserved time: kept for the simulator, and when the pool's
        recent median leaves the band, its latencies are scaled by it."""
        if self.config.record_stage_factors:
            gen.stage_factors[pool].append(factor)
        if not self.config.recalibrate:
            return
        recent = gen.recent[pool]
        recent.append(factor)
        if len(recent) < self.config.recalibrate_every:
            return
        f = statistics.median(recent)
        recent.clear()
        if abs(f - 1.0) <= self.config.recalibrate_band:
            return
        scale = min(RECALIBRATE_MAX, max(1.0 / RECALIBRATE_MAX, gen.scale[pool] * f))
        if scale == gen.scale[pool]:
            return
        gen.scale[pool] = scale
        base = gen.base_topo.pools[pool].latency_us
        new = with_latencies(gen.served.topo, {pool: tuple(x * scale for x in base)})
        gen.plane.set_latencies(new)
        gen.served = replace(gen.served, topo=new)
        self.recalibrations += 1

    def take_stage_factors(self) -> tuple[tuple[float, ...], ...]:
        """Per pool of the serving plan, measured / reserved compute time of the stages that
        found their vGPU idle, since the last call (RuntimeConfig.record_stage_factors): what
        the simulator draws execution times from to predict this runtime's driver."""
        gen = self.gen
        out = tuple(tuple(f) for f in gen.stage_factors)
        for f in gen.stage_factors:
            f.clear()
        return out

    # ------------------------------------------------------------------ statistics

    def take_window(self) -> tuple[list[dict], list[dict]]:
        """What happened since the last call: one row per model (arrivals, on time, late,
        dropped, failed, latency p50/p99 ms, mean batch) and one per pool (busy ms)."""
        return (
            self.windows.model_rows(self.stats),
            self.windows.pool_rows(self.gen.served.topo, self.gen.pool_busy_us),
        )

    def reset_stats(self) -> None:
        """Counters, windows, busy times and stage factors from zero; what recalibration
        has learnt stays."""
        for s in self.stats.values():
            s.clear()
        gen = self.gen
        gen.vgpu_busy_us[:] = [0.0] * len(gen.vgpu_busy_us)
        for f in gen.stage_factors:
            f.clear()
        self.drop_reasons.clear()
        self.windows = Windows()

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
        resume with the held requests; `on_done` gets the downtime."""
        if self._switch is not None:
            raise PoolpipeError("a plan switch is already under way; wait for it to finish")
        missing = {m.name for m in self.topo.models} - {m.name for m in served.topo.models}
        if missing:
            raise PoolpipeError(f"the new plan does not serve {sorted(missing)}")
        now = self.clock.now()
        self._paused = True
        sw = self._switch = _Switch(served, now, on_done)
        self.gen.plane.drain()
        self._decide(now)
        if not self._live:
            self._complete_switch()
        elif not sw.done:
            sw.timer = self.clock.call_at(now + flush_timeout_us, self._complete_switch)

    def _complete_switch(self) -> None:
        sw = self._switch
        if sw is None or sw.done:
            return
        sw.done = True
        if sw.timer is not None:
            sw.timer.cancel()
        now = self.clock.now()
        left = list(self._live.values())
        for entry in left:
            self._fail(entry, SWITCHED_AWAY, now)
        if self._wake is not None:
            self._wake.cancel()
        self._wake, self._wake_at = None, math.inf
        self.gen = gen = Generation(sw.served, self.stats)
        self.generations.append(gen)
        gen.plane.set_wake_lateness(self.guard_extra_us)
        self.windows.restart_pools()
        for v, node in sw.served.vgpu_node.items():
            if node in self._down:  # still failed: out of the new plan's tables too
                gen.plane.set_vgpu_down(v, True, now)
        self._refresh_paths()
        held, self._held = self._held, []
        self._paused = False
        self._switch = None
        topo = gen.served.topo
        for name, slo, payload, arrived in held:
            self._admit(topo.model_index(name), payload, slo, arrived, now)
        self._decide(now)
        sw.on_done(SwitchResult(now - sw.t0, len(held), len(left)))
