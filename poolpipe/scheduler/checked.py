"""The checked data plane: the fast reservation plane and its specification (the reference
plane: reference.py's plain rule, every pipeline probed) driven side by side with the same
requests, reports, failures and latencies; at the first call where their answers differ it
raises `PlaneDifference`, naming the time, the call and both answers. What it serves is the
fast plane's. `--data-plane checked` (poolpipe sim, scripts/digest.py sim --checked).
"""

from __future__ import annotations

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler.adaptive import LIGHT_LOAD, PACK, WAKE_GUARD_US, ReservationScheduler
from poolpipe.scheduler.messages import DataPlane, Decisions, Dispatch, Request, StageReport
from poolpipe.scheduler.topology import Topology


class PlaneDifference(PoolpipeError):
    """The fast data plane decided otherwise than its specification."""


def _dispatch(d: Dispatch) -> tuple:
    hops = tuple(
        (h.pool, h.vgpu, h.src_vgpu, h.transfer_start_us, h.transfer_end_us, h.start_us, h.end_us)
        for h in d.hops
    )
    return (d.id, d.model, d.pipeline, d.batch, tuple(r.id for r in d.requests), hops)


def decisions(out: Decisions) -> tuple:
    """Everything a decision says but the plane's work (probes)."""
    return (
        tuple(_dispatch(d) for d in out.dispatches),
        tuple((d.request.id, d.reason) for d in out.drops),
        out.wake_at_us,
    )


class CheckedPlane(DataPlane):
    """`fast` and `reference`, two planes of one policy on one topology."""

    def __init__(self, fast: DataPlane, reference: DataPlane) -> None:
        super().__init__("checked", fast.topo)
        self.fast = fast
        self.reference = reference
        self.calls = 0  # the calls compared so far

    def _same(self, now: float, call: str, a: object, b: object) -> None:
        self.calls += 1
        self.probes = self.fast.probes
        if a != b:
            raise PlaneDifference(
                f"the fast data plane and its specification differ at t={now:.3f} µs, call "
                f"{self.calls} ({call}):\n  fast:      {a}\n  reference: {b}\n"
                "Rerun with --data-plane reference to serve by the specification alone."
            )

    def add_request(self, req: Request, now: float) -> bool:
        a = self.fast.add_request(req, now)
        self._same(now, f"add_request {req.id}", a, self.reference.add_request(req, now))
        return a

    def decide(self, now: float) -> Decisions:
        out = self.fast.decide(now)
        self._same(now, "decide", decisions(out), decisions(self.reference.decide(now)))
        return out

    def on_stage_started(self, report: StageReport, now: float) -> None:
        self.fast.on_stage_started(report, now)
        self.reference.on_stage_started(report, now)

    def on_stage_done(self, report: StageReport, now: float) -> bool:
        a = self.fast.on_stage_done(report, now)
        b = self.reference.on_stage_done(report, now)
        self._same(now, f"on_stage_done {report.dispatch}/{report.hop}", a, b)
        return a

    def on_dispatch_failed(self, dispatch: int, hop: int, now: float) -> None:
        self.fast.on_dispatch_failed(dispatch, hop, now)
        self.reference.on_dispatch_failed(dispatch, hop, now)

    def set_vgpu_down(self, vgpu: int, down: bool, now: float) -> None:
        self.fast.set_vgpu_down(vgpu, down, now)
        self.reference.set_vgpu_down(vgpu, down, now)

    def set_latencies(self, topo: Topology) -> None:
        self.topo = topo
        self.fast.set_latencies(topo)
        self.reference.set_latencies(topo)

    def set_wake_lateness(self, late_us: float) -> None:
        self.fast.set_wake_lateness(late_us)
        self.reference.set_wake_lateness(late_us)

    def drain(self) -> None:
        self.fast.drain()
        self.reference.drain()


def checked_plane(
    topo: Topology,
    policy: str = "adaptive",
    max_queue: int | None = None,
    wake_guard_us: float = WAKE_GUARD_US,
    light_load: float = LIGHT_LOAD,
    pack: bool = PACK,
) -> CheckedPlane:
    """The fast reservation plane of `policy` checked against its reference."""
    return CheckedPlane(
        ReservationScheduler(
            topo, policy, max_queue, wake_guard_us, light_load=light_load, pack=pack
        ),
        ReservationScheduler(
            topo,
            policy,
            max_queue,
            wake_guard_us,
            reference=True,
            light_load=light_load,
            pack=pack,
        ),
    )
