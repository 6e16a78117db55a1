"""Applications on a serving runtime (poolpipe.domain.apps): one request of an application
becomes requests of its models ("parts"), each scheduled by the data plane with the
deadline its model's latency budget leaves, and is answered once, as a whole.

A model's parts are due, after the application's arrival, at its budget plus the latest
due time of its parents (the budgets summed along the slowest path to it): the data plane
batches and drops each part by that deadline. The entry model gets one part; when every
part of a model has finished, each child whose parents have all finished gets its parts:
over the first parent's parts, each makes a draw of that edge's fan-out (a fixed fan-out
always the same number; with fan-in every path makes the same number on average, as the
spec checks). A child with no part (a draw of 0) has finished at once.

The application's request is answered on time when its last part finished by arrival +
SLO, late after; the first part dropped or failed answers it at once, dropped or failed,
with nothing partial (its other parts run on, their ends ignored). Parts are made on the
clock's next turn (`call_at(now)`), never inside the runtime's own call that ended their
parents. Nothing here knows which driver runs it: the simulator and the live router hand
it the same calls."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolpipe.domain.apps import App, FanOut
from poolpipe.errors import PoolpipeError
from poolpipe.runtime.ports import DROPPED, FAILED, LATE, ON_TIME, Clock, Outcome


@dataclass(frozen=True)
class ServedApp:
    """An application as a runtime serves it: its models (entry first, parents before
    children), each one's index among the served plan's models, when its parts are due
    after the application's arrival (µs), its children with their fan-outs and its
    parents (positions in `models`)."""

    name: str
    slo_us: float
    models: tuple[str, ...]
    index: tuple[int, ...]
    due_us: tuple[float, ...]
    children: tuple[tuple[tuple[int, FanOut], ...], ...]
    parents: tuple[tuple[int, ...], ...]


def served_app(app: App, budgets_us: Mapping[str, float], index: Mapping[str, int]) -> ServedApp:
    """`app` with each model's latency budget and its index in the served plan."""
    missing = [m for m in app.models if m not in budgets_us or m not in index]
    if missing:
        raise PoolpipeError(
            f"application {app.name}: the plan has no budget or pipelines for "
            f"{', '.join(missing)}: plan the application (poolpipe apps plan)"
        )
    pos = {m: i for i, m in enumerate(app.models)}
    due: list[float] = []
    for m in app.models:
        before = [due[pos[e.src]] for e in app.parents(m)]
        due.append(budgets_us[m] + max(before, default=0.0))
    if max(due) > app.slo_us * (1 + 1e-9):
        raise PoolpipeError(
            f"application {app.name}: its budgets sum to {max(due) / 1e3:g} ms along a path, "
            f"more than its SLO of {app.slo_us / 1e3:g} ms"
        )
    return ServedApp(
        app.name,
        app.slo_us,
        app.models,
        tuple(index[m] for m in app.models),
        tuple(due),
        tuple(tuple((pos[e.dst], e.fanout) for e in app.children(m)) for m in app.models),
        tuple(tuple(pos[e.src] for e in app.parents(m)) for m in app.models),
    )


class AppRequest:
    """One request of an application, from its arrival until it is answered."""

    __slots__ = ("answered", "app", "arrived_us", "made", "parents_left", "payload", "running")

    def __init__(self, app: ServedApp, payload: Any, arrived_us: float):
        self.app = app
        self.payload = payload  # the driver's (the client's request; an index)
        self.arrived_us = arrived_us
        self.made = [0] * len(app.models)  # parts made, per model
        self.running = [0] * len(app.models)  # parts made and not yet ended
        self.parents_left = [len(p) for p in app.parents]
        self.answered = False


# add(model index, payload, slo_us, arrived_us): one part taken by the runtime
AddPart = Callable[[int, Any, float, float], Any]
# answer(payload, outcome, reason): the application's request ends
AnswerApp = Callable[[Any, Outcome, str], None]


class AppCoordinator:
    """Makes the parts of application requests and answers each request once.

    `add` takes a part into the runtime (ServingRuntime.add), `decide` asks the runtime
    for decisions after parts were added, `answer` delivers an application request's end;
    the driver calls `arrive` for each request and `part_ended` with every answer the
    runtime gives a part (the part's payload is what `add` was handed)."""

    def __init__(
        self,
        apps: Sequence[ServedApp],
        clock: Clock,
        add: AddPart,
        decide: Callable[[], None],
        answer: AnswerApp,
        seed: int = 1,
    ):
        self.apps = list(apps)
        self.clock = clock
        self._add = add
        self._decide = decide
        self._answer = answer
        self._rng = random.Random(seed * 7723 + 5)
        self._scheduled = 0  # part-making turns asked of the clock and not yet run
        self.open = 0  # requests taken and not answered
        self.parts = 0  # parts made
        self.outcomes: dict[str, dict[Outcome, int]] = {
            a.name: {o: 0 for o in (ON_TIME, LATE, DROPPED, FAILED)} for a in self.apps
        }

    def busy(self) -> bool:
        """Whether parts are still to be made on a later turn of the clock."""
        return self._scheduled > 0

    def arrive(self, app: int, payload: Any, arrived_us: float | None = None) -> AppRequest:
        """A request of application `app` (its index) arriving now (or at `arrived_us`)."""
        now = self.clock.now()
        req = AppRequest(self.apps[app], payload, now if arrived_us is None else arrived_us)
        self.open += 1
        self._make(req, [(0, 1)])
        self._decide()
        return req

    def part_ended(self, part: tuple[AppRequest, int], outcome: Outcome, reason: str) -> None:
        """The runtime answered a part (`outcome`): the request's next parts or its end."""
        req, pos = part
        req.running[pos] -= 1
        if req.answered:
            return
        app = req.app
        if not outcome.has_result:
            self._end(req, outcome, f"{app.models[pos]}: {reason}")
            return
        if req.running[pos] > 0:
            return
        ready = self._finished(req, pos)
        if ready:
            self._scheduled += 1
            self.clock.call_at(self.clock.now(), lambda: self._turn(req, ready))
        elif not any(req.running) and not any(req.parents_left):
            self._done(req)

    # ------------------------------------------------------------------ inside

    def _finished(self, req: AppRequest, pos: int) -> list[tuple[int, int]]:
        """Model `pos` has no part left: its children whose parents have all finished, with
        how many parts each gets."""
        app = req.app
        out: list[tuple[int, int]] = []
        for child, _ in app.children[pos]:
            req.parents_left[child] -= 1
            if req.parents_left[child] == 0:
                first = app.parents[child][0]
                fan = next(f for c, f in app.children[first] if c == child)
                fixed = fan.fixed
                n = (
                    req.made[first] * fixed
                    if fixed is not None
                    else sum(fan.sample(self._rng) for _ in range(req.made[first]))
                )
                out.append((child, n))
        return out

    def _turn(self, req: AppRequest, ready: list[tuple[int, int]]) -> None:
        self._scheduled -= 1
        if req.answered:
            return
        self._make(req, ready)
        self._decide()

    def _make(self, req: AppRequest, ready: list[tuple[int, int]]) -> None:
        """Parts for each (model position, count); a model given none has finished."""
        app = req.app
        while ready:
            pos, n = ready.pop()
            req.made[pos] = n
            if n == 0:
                ready += self._finished(req, pos)
                continue
            req.running[pos] += n
            self.parts += n
            for _ in range(n):
                self._add(app.index[pos], (req, pos), app.due_us[pos], req.arrived_us)
                if req.answered:  # refused at once (no live path): answered already
                    return
        if not any(req.running) and not any(req.parents_left):
            self._done(req)

    def _done(self, req: AppRequest) -> None:
        late = self.clock.now() > req.arrived_us + req.app.slo_us
        self._end(req, LATE if late else ON_TIME, "")

    def _end(self, req: AppRequest, outcome: Outcome, reason: str) -> None:
        req.answered = True
        self.open -= 1
        self.outcomes[req.app.name][outcome] += 1
        self._answer(req.payload, outcome, reason)
