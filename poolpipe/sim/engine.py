"""Deterministic discrete-event simulation of a plan's cluster: the serving runtime of
`poolpipe.runtime`, driven by a virtual clock and a simulated executor.

Every vGPU, uplink and downlink executes its work in the order of the reserved start times,
each piece as soon as its input is there and the previous one has finished; execution may
run faster or slower than reserved (jitter, measured stage factors), and the runtime hears
what really happened through the same reports the live router's executor sends. Entries of
the event queue are (time, priority, sequence, ...), so ties break the same way on every
run. A scenario (scenario.py) fails GPUs, brings them back and rolls out plans on the
virtual clock; the runtime meets them with the policies it uses live.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Final, cast

import numpy as np
from librt.vecs import append, vec
from mypy_extensions import i64, mypyc_attr

from poolpipe.errors import PoolpipeError
from poolpipe.runtime import (
    LATE,
    ON_TIME,
    PENDING,
    Clock,
    Entry,
    Executor,
    Job,
    Outcome,
    PlanUsage,
    RuntimeConfig,
    ServedPlan,
    ServingRuntime,
    SwitchResult,
    default_flush_timeout_us,
)
from poolpipe.runtime.heap import EventHeap, Keyed, heapify, pop, push
from poolpipe.runtime.placement import vgpu_nodes
from poolpipe.scheduler import DataPlane, Decisions, PlaneWrapper, Topology, make_data_plane
from poolpipe.scheduler.topology import latency_tables
from poolpipe.sim.metrics import SimResult, summarize
from poolpipe.sim.scenario import GpuChange, Rollout, Scenario, ScenarioEvent

# event priorities at equal times: finished work frees resources first, then scenario
# events, then the runtime's timers (wake-ups, node checks); arrivals come after all three
_END: Final = 0
_EVENT: Final = 1
_TIMER: Final = 2


@dataclass(frozen=True)
class SimConfig:
    duration_s: float = 30.0
    seed: int = 1
    jitter: float = 0.0  # coefficient of variation of execution time (lognormal, mean 1)
    # Measured execution-time factors per pool (actual / reserved compute time, as a live
    # router records them; indexed by pool id): a compute of a pool that has some takes its
    # reserved time times one of them, drawn at random, instead of the lognormal jitter.
    stage_factors: tuple[tuple[float, ...], ...] = ()
    # Measured answer delays per pool, a pipeline's last (µs: how much later than reserved a
    # live router had the batches it ended answered, beyond their stages' own overrun: its
    # data path's slips, ServingRuntime.take_answer_delays): a batch ending there is answered
    # that much later (one drawn at random, none below 0), and its vGPUs are taken to be
    # busy until then, as the router takes them.
    answer_delays: tuple[tuple[float, ...], ...] = ()
    # Held back from every deadline the data plane schedules for, as the live router holds
    # it back for a request's way in and out; a request still counts as on time when it
    # finishes by arrival + SLO, as the router counts it.
    reply_margin_us: float = 0.0
    # Recalibrate pools whose stages run off their reservations, as the live router does.
    recalibrate: bool = False
    # Answer a request whose batch still runs when its SLO runs out then, dropped, as the
    # live router does (RuntimeConfig.drop_overdue); False: it is answered late.
    drop_overdue: bool = True


# ---------------------------------------------------------------------------- the clock

# An event's key: its time, then priority * _PRIORITY + the order scheduled (so the
# priority decides ties of time, then the order; runs schedule far fewer than 2**48).
_PRIORITY: Final = 1 << 48
_END_KEY: Final = _END * _PRIORITY  # (a constant: the commonest event, a work's end)
# the wall clock of MeteredPlane (Final, compiled: a static, not a lookup per call)
_wall_s: Final = perf_counter


class _Event:
    """What the clock's queue holds (in a heap.Keyed): `fire()` runs it (compiled, a
    native method call)."""

    __slots__ = ()

    def fire(self) -> None:
        raise NotImplementedError


class _Call(_Event):
    """`fn(arg)`, scheduled."""

    __slots__ = ("arg", "fn")

    def __init__(self, fn: Callable[[Any], None], arg: Any):
        self.fn = fn
        self.arg = arg

    def fire(self) -> None:
        self.fn(self.arg)


class _Timer(_Event):
    __slots__ = ("cancelled", "fn")

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.fn()


class Arrivals:
    """What the clock calls at each arrival (`VirtualClock.run`)."""

    def arrive(self, k: int) -> None:
        raise NotImplementedError


class _Requests(Arrivals):
    """Arrival k: one request of its model, at the model's SLO (compiled: native calls)."""

    def __init__(self, rt: ServingRuntime, models: vec[i64], model_map: list[int]):
        self.rt = rt
        self.models = models
        self.model_map = model_map  # arrival model -> the served plan's model index

    def arrive(self, k: int) -> None:
        self.rt.arrive(self.model_map[self.models[k]], k)


class _Calls(Arrivals):
    """Arrival k: `fn(k)`, a driver's own."""

    def __init__(self, fn: Callable[[int], None]):
        self.fn = fn

    def arrive(self, k: int) -> None:
        self.fn(k)


class VirtualClock(Clock):
    """Simulated time (µs) and its event queue, ordered by (time, priority, sequence) so
    that ties break the same way on every run; `run` fires them in order."""

    def __init__(self) -> None:
        self.t = 0.0
        self._events = EventHeap()  # of _Event and _Work
        self._seq = 0
        # whose _end a _Work's end calls (a work's end is the commonest event: no object
        # of its own, and a direct call)
        self.ends: SimulatedCluster | None = None

    def __len__(self) -> int:
        """Events still to come."""
        return len(self._events)

    def now(self) -> float:
        return self.t

    def call_at(self, t_us: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(fn)
        self.add(t_us, _TIMER, timer)
        return timer

    def schedule(self, t: float, priority: int, fn: Callable[[Any], None], arg: Any) -> None:
        """Call `fn(arg)` at `t`; at equal times, lower priorities first, then in the order
        scheduled."""
        self.add(t, priority, _Call(fn, arg))

    def add(self, t: float, priority: int, event: _Event) -> None:
        """Schedule an event of the driver's own (its `fire()` at `t`), as `schedule`."""
        self._push(t, priority * _PRIORITY, event)

    def end_at(self, t: float, work: _Work) -> None:
        """`work` ends at `t` (priority _END): `ends._end(work)` then."""
        self._push(t, _END_KEY, work)

    def _push(self, t: float, key: int, item: object) -> None:
        """`item` at `t`, keyed by its priority's `key` (priority * _PRIORITY), then the
        order scheduled."""
        self._seq += 1
        self._events.push(t, key + self._seq, item)

    def pending(self) -> list[object]:
        """What is still to come (events, works that end), in no order."""
        return self._events.pending()

    def _fire(self, item: object) -> None:
        if isinstance(item, _Work):
            ends = self.ends
            assert ends is not None
            ends._end(item)
        else:
            cast(_Event, item).fire()

    def run_until(self, t_us: float) -> None:
        """Fire every event due by `t_us` in order, then stand at `t_us`."""
        ev = self._events
        while len(ev) and ev.first_t() <= t_us:
            self.t = ev.first_t()
            self._fire(ev.pop())
        self.t = max(self.t, t_us)

    def run(self, times: vec[float], arrivals: Arrivals, done: Callable[[], bool]) -> None:
        """Fire the events and the arrivals (arrival k at `times[k]` calls
        `arrivals.arrive(k)`; `times` ascending) in time order, events first at equal
        times, until none is left or, every arrival in, `done()` says that what is left
        would run for ever (timers that only watch)."""
        ev = self._events
        i, n = 0, len(times)
        while i < n or len(ev):
            if i < n and (not len(ev) or times[i] < ev.first_t()):
                self.t = times[i]
                arrivals.arrive(i)
                i += 1
                continue
            if i == n and done():
                return
            self.t = ev.first_t()
            self._fire(ev.pop())


# ---------------------------------------------------------------------------- the cluster


@mypyc_attr(acyclic=True)
class _Work(Keyed):
    """One transfer or one compute of a dispatched batch; in its resources' queues by its
    reserved start (t: the order in which each resource runs its work), then the order it
    was queued in (k). Acyclic (Keyed): it refers to its job and the work after it, and
    neither refers back (a thousand GPUs' works in flight no longer enter and leave the
    collector's lists, whose neighbours were cold)."""

    __slots__ = (
        "compute",
        "dead",
        "dur",
        "hop",
        "job",
        "r0",
        "r1",
        "ready",
        "ready_at",
        "succ",
        "t0",
        "tr_end",
        "tr_start",
    )

    def __init__(self, key: float, r0: int, r1: int, dur: float, job: Job, hop: int, compute: bool):
        super().__init__(key, 0)  # k: set when queued
        self.r0 = r0  # global resource indices: a vGPU, or an uplink and a downlink
        self.r1 = r1  # (-1: none)
        self.dur = dur
        self.ready = False
        self.succ: _Work | None = None
        self.job = job
        self.hop = hop
        self.compute = compute
        self.ready_at = 0.0
        self.t0 = 0.0  # actual start
        # the actual transfer into a compute (-inf: none; two floats, not a tuple of them:
        # an object less to make and free per hop)
        self.tr_start = -math.inf
        self.tr_end = -math.inf
        self.dead = False  # killed while running: its end is not reported


@dataclass
class _Layout:
    """Where one served plan's resources sit in the cluster's resource arrays."""

    topo: Topology  # the truth the executor runs by (latencies as profiled)
    base: int  # vGPU v is resource base + v; uplink of server s base + V + s; downlink + S
    up: vec[i64]  # per vGPU: its server's uplink resource (unboxed: librt.vecs)
    down: vec[i64]  # per vGPU: its server's downlink resource
    node_res: dict[str, list[int]]  # node -> its vGPUs' resources
    lat: list[list[float]]  # per pool: its latency at batch b (topo's, as typed floats)


class SimulatedCluster(Executor):
    """The executor of a simulation: vGPUs and NICs as FIFO resources ordered by reserved
    start, execution times as profiled (times jitter or measured factors), and GPUs that
    fail and return as a scenario says."""

    def __init__(self, clock: VirtualClock, config: SimConfig, n_requests: int):
        self.clock = clock
        clock.ends = self
        self.config = config
        self._rng = random.Random(config.seed * 7919 + 17)
        self._sigma = math.sqrt(math.log1p(config.jitter**2)) if config.jitter > 0 else 0.0
        self._queue: list[list[Keyed]] = []  # per resource: a heap of its _Work
        self._busy: list[bool] = []
        self._layouts: dict[int, _Layout] = {}
        self._qseq = 0
        self.dead_nodes: list[str] = []  # in the order they failed
        self._dead_res: set[int] = set()
        self.n_requests = n_requests
        # The answers in the order given: each one's request index and outcome packed
        # (_OUTCOME_BITS), and its time (`outcome` and `finish_us` read them back by
        # request).
        # Appended, unboxed: two lists by request and a float object per answer, kept to
        # the end, grow with the run and slow a long one down per request.
        self._answers = vec[i64]()
        self._answered_at = vec[float]()
        self.transfer_wait_us = 0.0
        self.transfers = 0
        self.retired: list[PlanUsage] = []  # what the plans served before did
        self.rt: ServingRuntime
        # where the runtime's answers go instead of `outcome` (a driver of its own)
        self.on_answer: Callable[[Entry, Outcome, str], None] | None = None

    def bind(self, runtime: ServingRuntime) -> None:
        self.rt = runtime

    def add_generation(self, generation: int, served: ServedPlan, truth: Topology) -> None:
        """Resources for a served plan (its vGPUs and its servers' NICs); `truth` holds the
        latencies its work really takes (a plan rolled out runs as it was laid out)."""
        base = len(self._busy)
        V, S = len(truth.vgpus), len(truth.servers)
        n = V + 2 * S
        self._queue.extend([] for _ in range(n))
        self._busy.extend([False] * n)
        node_res: dict[str, list[int]] = {}
        for v, node in served.vgpu_node.items():
            node_res.setdefault(node, []).append(base + v)
        lay = _Layout(
            truth,
            base,
            vec[i64]([base + V + v.server for v in truth.vgpus]),
            vec[i64]([base + V + S + v.server for v in truth.vgpus]),
            node_res,
            latency_tables(truth),
        )
        self._layouts[generation] = lay
        for node in self.dead_nodes:
            self._dead_res.update(node_res.get(node, ()))

    # ------------------------------------------------------------------ the port

    def run(self, job: Job) -> None:
        d = job.dispatch
        lay = self._layouts.get(job.generation)
        if lay is None:  # a plan rolled out: its first batch
            served = job.served
            self.add_generation(job.generation, served, served.topo)
            lay = self._layouts[job.generation]
        lat = lay.lat
        base, up, down = lay.base, lay.up, lay.down
        now = self.clock.t
        prev: _Work | None = None
        first: _Work | None = None
        sigma = self._sigma
        # measured factors describe the first plan's pools; a plan rolled out runs as laid out
        factors = self.config.stage_factors if base == 0 else ()
        for h, hop in enumerate(d.hops):
            p = hop.pool
            dur = lat[p][d.batch]
            if p < len(factors) and factors[p]:
                dur *= self._rng.choice(factors[p])
            elif sigma > 0:
                dur *= self._rng.lognormvariate(-sigma * sigma / 2, sigma)
            compute = _Work(hop.start_us, base + hop.vgpu, -1, dur, job, h, True)
            if hop.transfer_end_us > hop.transfer_start_us:
                src = hop.src_vgpu  # (< 0: the requests' inputs, on the downlink alone)
                tr = _Work(
                    hop.transfer_start_us,
                    up[src] if src >= 0 else down[hop.vgpu],
                    down[hop.vgpu] if src >= 0 else -1,
                    hop.transfer_end_us - hop.transfer_start_us,
                    job,
                    h,
                    False,
                )
                tr.succ = compute
                self._enqueue(tr)
                head = tr
            else:
                head = compute
            self._enqueue(compute)
            if prev is not None:
                prev.succ = head
            else:
                first = head
            prev = compute
        assert first is not None
        first.ready = True
        first.ready_at = now
        self._try_start(first, now)

    def answer(self, entry: Entry, outcome: Outcome, reason: str) -> None:
        if self.on_answer is not None:  # a driver of its own (applications: sim/apps.py)
            self.on_answer(entry, outcome, reason)
            return
        i: int = entry.payload
        self._answers = append(self._answers, (i << _OUTCOME_BITS) + int(outcome))
        self._answered_at = append(self._answered_at, self.clock.t)

    def _answers_by_request(self) -> tuple[np.ndarray, np.ndarray]:
        """The answers' request indexes and outcomes, in the order given."""
        a = np.asarray(self._answers)
        return a >> _OUTCOME_BITS, a & ((1 << _OUTCOME_BITS) - 1)

    @property
    def outcome(self) -> np.ndarray:
        """Each request's outcome (its last answer's; PENDING where none came)."""
        out = np.full(self.n_requests, int(PENDING), dtype=np.int8)
        idx, code = self._answers_by_request()
        last = _last_of_each(idx)
        out[idx[last]] = code[last]
        return out

    @property
    def finish_us(self) -> np.ndarray:
        """When each request was answered on time or late (its last such answer; nan
        where none)."""
        out = np.full(self.n_requests, math.nan)
        idx, code = self._answers_by_request()
        served = (code == int(ON_TIME)) | (code == int(LATE))
        idx, at = idx[served], np.asarray(self._answered_at)[served]
        last = _last_of_each(idx)
        out[idx[last]] = at[last]
        return out

    def check_node(self, node: str, served: ServedPlan) -> None:
        self.rt.node_checked(node, node not in self.dead_nodes)

    def retire(self, usage: PlanUsage) -> None:
        self._layouts.pop(usage.generation, None)
        self.retired.append(usage)

    # ------------------------------------------------------------------ execution

    def _enqueue(self, work: _Work) -> None:
        self._qseq += 1
        work.k = self._qseq
        push(self._queue[work.r0], work)
        if work.r1 >= 0:
            push(self._queue[work.r1], work)

    def _try_start(self, work: _Work, now: float) -> None:
        if not work.ready:
            return
        busy, queue = self._busy, self._queue
        r0, r1 = work.r0, work.r1
        if busy[r0] or queue[r0][0] is not work:
            return
        if r1 >= 0 and (busy[r1] or queue[r1][0] is not work):
            return
        if work.compute:
            if self._dead_res and r0 in self._dead_res:
                self._fail(work, "its node is down")
                return
            job = work.job
            if now - work.t > job.slack_us and not self.rt.hop_late(job, work.hop):
                self._restart(self._remove(job), now)  # dropped: its works do not run
                return
        pop(queue[r0])
        busy[r0] = True
        if r1 >= 0:
            pop(queue[r1])
            busy[r1] = True
        work.t0 = now
        self.clock.end_at(now + work.dur, work)
        if work.compute:
            if work.tr_start == -math.inf:
                self.rt.hop_started(work.job, work.hop, now)
            else:
                self.rt.hop_started(work.job, work.hop, now, work.tr_start, work.tr_end)
        else:
            self.transfer_wait_us += now - work.ready_at
            self.transfers += 1

    def _end(self, work: _Work) -> None:
        if work.dead:
            return
        now = self.clock.t
        busy = self._busy
        r0, r1 = work.r0, work.r1
        busy[r0] = False
        if r1 >= 0:
            busy[r1] = False
        succ = work.succ
        if succ is not None:
            if not work.compute:
                succ.tr_start = work.t0
                succ.tr_end = now
            succ.ready = True
            succ.ready_at = now
            self._try_start(succ, now)
        self._start_next(r0, now)
        if r1 >= 0:
            self._start_next(r1, now)
        if work.compute:
            if succ is None and self.config.answer_delays:
                delay = self._answer_delay(work.job)
                if delay > 0:
                    job, hop, t0 = work.job, work.hop, work.t0
                    self.clock.call_at(
                        now + delay, lambda: self.rt.hop_done(job, hop, t0 + delay, now + delay)
                    )
                    return
            self.rt.hop_done(work.job, work.hop, work.t0, now)

    def _answer_delay(self, job: Job) -> float:
        """One of the measured answer delays of the job's last pool (SimConfig.answer_delays;
        the first plan's only, as its stage factors), 0 where it has none."""
        lay = self._layouts.get(job.generation)
        if lay is None or lay.base != 0:
            return 0.0
        delays = self.config.answer_delays
        p = job.dispatch.hops[-1].pool
        if p >= len(delays) or not delays[p]:
            return 0.0
        return self._rng.choice(delays[p])

    def _start_next(self, r: int, now: float) -> None:
        """Resource `r` is free: its next work starts if it is ready."""
        q = self._queue[r]
        if q and not self._busy[r]:
            head = cast(_Work, q[0])
            if head.ready:
                self._try_start(head, now)

    # ------------------------------------------------------------------ failures

    def _fail(self, work: _Work, why: str) -> None:
        """The job of `work` fails at its hop: none of its works still queued will run.
        (Works hold no list of their job's works: such a cycle would leave every job to
        the cyclic garbage collector, which made the simulator a third slower.)"""
        touched = self._remove(work.job)
        self.rt.hop_failed(work.job, work.hop, f"{why} ({why_node(work)})")
        self._restart(touched, self.clock.t)

    def _remove(self, job: Job) -> set[int]:
        """Take the job's works out of every queue; the resources whose queue changed."""
        touched: set[int] = set()
        for r, q in enumerate(self._queue):
            kept = [w for w in q if cast(_Work, w).job is not job]
            if len(kept) < len(q):
                heapify(kept)
                q[:] = kept
                touched.add(r)
        return touched

    def _restart(self, touched: set[int], now: float) -> None:
        for r in sorted(touched):
            if self._queue[r] and not self._busy[r]:
                self._try_start(cast(_Work, self._queue[r][0]), now)

    def fail_nodes(self, nodes: list[str]) -> None:
        """These nodes die now: their running computes fail, nothing starts there."""
        for node in nodes:
            if node in self.dead_nodes:
                continue
            self.dead_nodes.append(node)
            for lay in self._layouts.values():
                self._dead_res.update(lay.node_res.get(node, ()))
        # computes running there (found among the pending ends: failures are rare, and a
        # per-resource record of the running work would cost every work's start and end)
        dying = [
            w
            for w in self.clock.pending()
            if isinstance(w, _Work) and w.compute and w.r0 in self._dead_res and not w.dead
        ]
        for work in sorted(dying, key=lambda w: w.r0):
            work.dead = True
            self._busy[work.r0] = False
            self._fail(work, "its node died")

    def revive_nodes(self, nodes: list[str]) -> None:
        now = self.clock.t
        for node in nodes:
            if node not in self.dead_nodes:
                continue
            self.dead_nodes.remove(node)
            for lay in self._layouts.values():
                for r in lay.node_res.get(node, ()):
                    self._dead_res.discard(r)
                    if self._queue[r] and not self._busy[r]:
                        self._try_start(cast(_Work, self._queue[r][0]), now)


# an answer's outcome in its packed entry's low bits (every Outcome fits)
_OUTCOME_BITS: Final = 3
assert max(Outcome) < 1 << _OUTCOME_BITS


def _last_of_each(idx: np.ndarray) -> np.ndarray:
    """The positions in `idx` of each value's last occurrence."""
    _, first_from_end = np.unique(idx[::-1], return_index=True)
    return len(idx) - 1 - first_from_end


def why_node(work: _Work) -> str:
    served = work.job.served
    return f"node {served.vgpu_node[work.job.dispatch.hops[work.hop].vgpu]}"


# ---------------------------------------------------------------------------- metering


class MeteredPlane(PlaneWrapper):
    """A data plane whose decide() is timed in wall seconds (the simulator's measure of
    scheduling cost); every other call goes straight to the plane."""

    def __init__(self, plane: DataPlane):
        super().__init__(plane)
        self.seconds = 0.0
        self.per_batch = vec[float]()  # wall s per dispatched batch, per decide call

    def decide(self, now: float) -> Decisions:
        t0 = _wall_s()
        dec = super().decide(now)
        dt = _wall_s() - t0
        self.seconds += dt
        if dec.dispatches:
            self.per_batch = append(self.per_batch, dt / len(dec.dispatches))
        return dec


# ---------------------------------------------------------------------------- a run


class Simulator:
    """One run: build with a topology, a fresh data plane and arrivals; call `run()` once.

    `scenario`: timed GPU failures, returns and rollouts (scenario.py). `make_plane`: the
    data plane for a plan rolled out by the scenario (default: `data_plane`'s kind)."""

    def __init__(
        self,
        topo: Topology,
        data_plane: DataPlane,
        arrival_us: np.ndarray,
        arrival_model: np.ndarray,
        config: SimConfig,
        scenario: Scenario | None = None,
        make_plane: Callable[[Topology], DataPlane] | None = None,
    ):
        self.topo = topo  # the truth of the first plan (a test may swap it before run())
        self.dp = data_plane
        # (unboxed: read one after another; a float object each is several times the
        # memory)
        self.arrival_us = vec[float]([float(t) for t in arrival_us])
        self.arrival_model = vec[i64]([int(m) for m in arrival_model])
        self.config = config
        self.scenario = scenario or Scenario(())
        late = [e for e in self.scenario.events if e.at_s > config.duration_s]
        if late:
            e = late[0]
            raise PoolpipeError(
                f"scenario event {e.kind} at {e.at_s:g} s is past the end of the run "
                f"({config.duration_s:g} s): it would never happen; move it before the end or "
                "simulate longer (--duration)"
            )
        self._events_left = len(self.scenario.events)
        self._make_plane = make_plane or (lambda t: make_data_plane(data_plane.name, t))
        self.clock = VirtualClock()
        self.cluster = SimulatedCluster(self.clock, config, len(self.arrival_us))
        self.planes: list[MeteredPlane] = []
        self.rollouts: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.runtime: ServingRuntime | None = None
        self._names = [m.name for m in topo.models]
        self._model_map = list(range(len(topo.models)))
        self._rng = random.Random(config.seed * 104729 + 3)

    @property
    def outcome(self) -> np.ndarray:
        return self.cluster.outcome

    @property
    def finish_us(self) -> np.ndarray:
        return self.cluster.finish_us

    @property
    def now(self) -> float:
        return self.clock.t

    def _served(self, topo: Topology, plane: DataPlane) -> ServedPlan:
        metered = MeteredPlane(plane)
        self.planes.append(metered)
        return ServedPlan(topo, metered, vgpu_nodes(topo))

    def run(self) -> SimResult:
        wall0 = perf_counter()
        rt = self.drive(None)
        return summarize(self, rt, perf_counter() - wall0)

    def drive(
        self,
        arrivals: Callable[[ServingRuntime], Callable[[int], None]] | None,
        busy: Callable[[], bool] | None = None,
    ) -> ServingRuntime:
        """Run the simulation to its end and return its runtime. `arrivals(runtime)` gives
        what arrival k calls (default: one request of its model at the model's SLO), and
        `busy()` whether the driver still has work of its own to come; applications
        (sim/apps.py) bring both, and their own account of the run."""
        served = self._served(self.dp.topo, self.dp)
        rt = self.runtime = ServingRuntime(
            served,
            self.clock,
            self.cluster,
            RuntimeConfig(
                reply_margin_us=self.config.reply_margin_us,
                recalibrate=self.config.recalibrate,
                keep_latencies=False,
                drop_overdue=self.config.drop_overdue,
            ),
        )
        self.cluster.add_generation(rt.generation, rt.served, self.topo)
        for event in self.scenario.events:
            self.clock.schedule(event.at_s * 1e6, _EVENT, self._apply, event)

        def done() -> bool:  # only node watches are left: they would run for ever
            return rt.idle() and not self._events_left and not (busy is not None and busy())

        each: Arrivals = (
            _Requests(rt, self.arrival_model, self._model_map)
            if arrivals is None
            else _Calls(arrivals(rt))
        )
        # The event loop makes and drops a few dozen small objects per request: a young
        # collection every 700 of them walks the live ones again and again, so one every
        # 10,000 (benchmarks-history.md).
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], 10_000), *threshold[1:])
        try:
            self.clock.run(self.arrival_us, each, done)
        finally:
            gc.set_threshold(*threshold)
        return rt

    # ------------------------------------------------------------------ scenario

    def _apply(self, event: ScenarioEvent) -> None:
        rt = self.runtime
        assert rt is not None
        self._events_left -= 1
        at_s = self.clock.t / 1e6
        if isinstance(event, GpuChange):
            nodes = self._pick_nodes(event)
            if event.kind == "gpu_down":
                self.cluster.fail_nodes(nodes)
            else:
                self.cluster.revive_nodes(nodes)
            self.events.append({"at_s": at_s, "kind": event.kind, "nodes": nodes})
        elif isinstance(event, Rollout):
            plane = self._make_plane(event.topo)
            served = self._served(event.topo, plane)
            self.events.append({"at_s": at_s, "kind": "rollout", "plan": event.label})

            def done(res: SwitchResult, served: ServedPlan = served) -> None:
                names = [m.name for m in served.topo.models]
                self._model_map[:] = [names.index(m) for m in self._names]
                self.rollouts.append(
                    {
                        "at_s": at_s,
                        "plan": event.label,
                        "downtime_ms": res.downtime_us / 1e3,
                        "held": res.held,
                        "failed": res.failed,
                    }
                )

            rt.switch(served, default_flush_timeout_us(rt.topo, event.topo), done)

    def _pick_nodes(self, event: GpuChange) -> list[str]:
        """The GPUs an event names: `count` of its type, picked at random (seeded) among
        those alive (down) or the earliest failed first (up); or exactly `gpus`."""
        if event.gpus:
            return [f"{event.gpu}-{g}" for g in event.gpus]
        dead = self.cluster.dead_nodes
        if event.kind == "gpu_up":
            return [n for n in dead if n.rsplit("-", 1)[0] == event.gpu][: event.count]
        total = self.topo.gpu_counts.get(event.gpu, 0)
        alive = [f"{event.gpu}-{g}" for g in range(total) if f"{event.gpu}-{g}" not in dead]
        return sorted(self._rng.sample(alive, min(event.count, len(alive))))
