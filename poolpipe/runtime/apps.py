"""Applications on a serving runtime (poolpipe.domain.apps): one request of an application
becomes requests of its models ("parts"), each scheduled by the data plane with the
deadline its model's latency budget leaves, and is answered once, as a whole.

A model's parts are due, after the application's arrival, at its budget plus the latest
due time of its parents (the budgets summed along the slowest path to it): the data plane
batches and drops each part by that deadline. A request may bring its own SLO (a hybrid
client's, what is left of its budget): its parts' due times are then the plan's scaled
by its SLO over the application's. The entry model gets one part; when every
part of a model has finished, each child whose parents have all finished gets its parts:
over the first parent's parts, each makes a draw of that edge's fan-out (a fixed fan-out
always the same number; with fan-in every path makes the same number on average, as the
spec checks). A child with no part (a draw of 0) has finished at once.

The application's request is answered on time when its last part finished by arrival +
SLO, late after; the first part dropped or failed answers it at once, dropped or failed,
with nothing partial (its other parts run on, their ends ignored). Parts are made on the
clock's next turn (`call_at(now)`), never inside the runtime's own call that ended their
parents. Nothing here knows which driver runs it: the simulator and the live router hand
it the same calls. What a child's parts are made of is the driver's `fan`: the simulator's
draws the edge's fan-out (parts without data); the router's applies the edge's transform
to the first parent's outputs (one input per part), which sets how many there are."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolpipe.domain.apps import App, FanOut
from poolpipe.errors import PoolpipeError
from poolpipe.runtime.intake import BadRequest
from poolpipe.runtime.ports import FAILED, LATE, ON_TIME, Clock, Outcome, count_answer
from poolpipe.runtime.stats import ModelStats


@dataclass(frozen=True)
class ServedApp:
    """An application as a runtime serves it: its models (entry first, parents before
    children), the served plan's model for each (`parts`: app.model), when its parts are
    due after the application's arrival (µs), its children with their fan-outs and its
    parents (positions in `models`)."""

    name: str
    slo_us: float
    models: tuple[str, ...]
    parts: tuple[str, ...]
    due_us: tuple[float, ...]
    children: tuple[tuple[tuple[int, FanOut], ...], ...]
    parents: tuple[tuple[int, ...], ...]


def served_app(app: App, budgets_us: Mapping[str, float], parts: Mapping[str, str]) -> ServedApp:
    """`app` with each model's latency budget and its model in the served plan."""
    missing = [m for m in app.models if m not in budgets_us or m not in parts]
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
        tuple(parts[m] for m in app.models),
        tuple(due),
        tuple(tuple((pos[e.dst], e.fanout) for e in app.children(m)) for m in app.models),
        tuple(tuple(pos[e.src] for e in app.parents(m)) for m in app.models),
    )


def check_app_slo(
    app: ServedApp, slo_us: float, fastest_us: Callable[[str], float], reply_margin_us: float
) -> None:
    """A BadRequest where a request of `app` asking for its own SLO `slo_us` cannot be
    met even with every GPU idle: some part, started once its parents' fastest paths end
    and run on its fastest pipeline (`fastest_us(part)`), ends after its due time scaled
    to that SLO (less the reply margin); before anything runs."""
    finish: list[float] = []
    for pos, part in enumerate(app.parts):
        start = max((finish[p] for p in app.parents[pos]), default=0.0)
        finish.append(start + fastest_us(part))
    # the least scale of the plan's due times every part's earliest end fits in
    need, pos = max(
        ((f + reply_margin_us) / max(app.due_us[i], 1e-9), i) for i, f in enumerate(finish)
    )
    if slo_us < need * app.slo_us:
        raise BadRequest(
            f"application {app.name}: slo_ms {slo_us / 1e3:g} is too short for this plan: "
            f"{app.parts[pos]} ends {finish[pos] / 1e3:.2f} ms after arrival at the earliest "
            f"(every GPU idle, {reply_margin_us / 1e3:g} ms held back for the reply); send "
            f"slo_ms of at least {need * app.slo_us / 1e3:.2f}"
        )


class AppRequest:
    """One request of an application, from its arrival until it is answered."""

    __slots__ = (
        "answered",
        "app",
        "arrived_us",
        "made",
        "parents_left",
        "payload",
        "results",
        "running",
        "slo_us",
    )

    def __init__(
        self, app: ServedApp, payload: Any, arrived_us: float, slo_us: float | None = None
    ):
        self.app = app
        self.payload = payload  # the driver's (the client's request; an index)
        self.arrived_us = arrived_us
        self.slo_us = app.slo_us if slo_us is None else slo_us  # its own, or the app's
        self.made = [0] * len(app.models)  # parts made, per model
        self.running = [0] * len(app.models)  # parts made and not yet ended
        self.parents_left = [len(p) for p in app.parents]
        # per model: its parts' results, in the order they ended (what the driver kept)
        self.results: list[list[Any]] = [[] for _ in app.models]
        self.answered = False


# A part as the runtime carries it (the payload `add` is handed): its request, its model's
# position in the application, and its data (the driver's: its inputs live; None simulated).
Part = tuple[AppRequest, int, Any]
# add(served model name, part, slo_us, arrived_us): one part taken by the runtime
AddPart = Callable[[str, Part, float, float], Any]
# answer(request, outcome, reason): the application's request ends
AnswerApp = Callable[[AppRequest, Outcome, str], None]
# fan(request, child position, parent position, drawn): the data of each of the child's
# parts, made from the parent's results; `drawn` is the fan-out's draw per parent part
Fan = Callable[[AppRequest, int, int, list[int]], list[Any]]


class BatchMembers:
    """Which applications' parts each batch of a part model held (AppCoordinator.batch):
    per model, batches by the applications of their members, so a pool shared by several
    applications (a stream's shared suffix) shows batches of more than one."""

    def __init__(self) -> None:
        self.by_model: dict[str, dict[tuple[str, ...], int]] = {}

    def add(self, model: str, apps: Sequence[str]) -> None:
        key = tuple(sorted(set(apps)))
        row = self.by_model.setdefault(model, {})
        row[key] = row.get(key, 0) + 1

    def mixed(self, model: str) -> int:
        """Batches of `model` that held parts of two applications or more."""
        return sum(n for k, n in self.by_model.get(model, {}).items() if len(k) > 1)

    def document(self) -> dict[str, dict[str, Any]]:
        """Per model: batches, those of mixed applications, and the batches per set of
        applications (their names joined by " + ")."""
        return {
            m: {
                "batches": sum(row.values()),
                "mixed": self.mixed(m),
                "members": {" + ".join(k): n for k, n in sorted(row.items())},
            }
            for m, row in sorted(self.by_model.items())
        }


def drawn_parts(req: AppRequest, child: int, parent: int, drawn: list[int]) -> list[Any]:
    """The simulator's fan: as many parts as drawn, with no data."""
    return [None] * sum(drawn)


class AppCoordinator:
    """Makes the parts of application requests and answers each request once.

    `add` takes a part into the runtime (ServingRuntime.add, the model by name), `decide`
    asks the runtime for decisions after parts were added, `answer` delivers an
    application request's end, `fan` makes a child's parts (default: `drawn_parts`); the
    driver calls `arrive` for each request and `part_ended` with every answer the runtime
    gives a part (the part is the payload `add` was handed)."""

    def __init__(
        self,
        apps: Sequence[ServedApp],
        clock: Clock,
        add: AddPart,
        decide: Callable[[], None],
        answer: AnswerApp,
        seed: int = 1,
        fan: Fan = drawn_parts,
        keep_latencies: bool = True,
    ):
        self.apps = list(apps)
        self.clock = clock
        self._add = add
        self._decide = decide
        self._answer = answer
        self._fan = fan
        self._rng = random.Random(seed * 7723 + 5)
        self._scheduled = 0  # part-making turns asked of the clock and not yet run
        self.open = 0  # requests taken and not answered
        self.parts = 0  # parts made
        # per application, as the runtime counts a model's requests (latency of answers)
        self.stats: dict[str, ModelStats] = {a.name: ModelStats() for a in self.apps}
        self._keep_latencies = keep_latencies
        self.members = BatchMembers()  # batch()'s record

    def busy(self) -> bool:
        """Whether parts are still to be made on a later turn of the clock."""
        return self._scheduled > 0

    def arrive(
        self,
        app: int,
        payload: Any,
        data: Any = None,
        arrived_us: float | None = None,
        slo_us: float | None = None,
    ) -> AppRequest:
        """A request of application `app` (its index) arriving now (or at `arrived_us`);
        `data`: its entry part's (the client's inputs, live); `slo_us`: its own SLO (the
        application's where None)."""
        now = self.clock.now()
        arrived = now if arrived_us is None else arrived_us
        req = AppRequest(self.apps[app], payload, arrived, slo_us)
        self.open += 1
        self.stats[req.app.name].arrivals += 1
        self._make(req, [(0, [data])])
        self._decide()
        return req

    def part_ended(self, part: Part, outcome: Outcome, reason: str, result: Any = None) -> None:
        """The runtime answered a part (`outcome`, its `result` where it has one): the
        request's next parts or its end."""
        req, pos, _ = part
        req.running[pos] -= 1
        if req.answered:
            return
        app = req.app
        if not outcome.has_result:
            self._end(req, outcome, f"{app.models[pos]}: {reason}")
            return
        req.results[pos].append(result)
        if req.running[pos] > 0:
            return
        ready = self._finished(req, pos)
        if ready:
            self._scheduled += 1
            self.clock.call_at(self.clock.now(), lambda: self._turn(req, ready))
        elif not any(req.running) and not any(req.parents_left):
            self._done(req)

    def batch(self, model: str, parts: Sequence[Part]) -> None:
        """The runtime sent a batch of `model` holding `parts` (the driver hands them from
        ServingRuntime.on_batch): recorded by their applications (`members`)."""
        self.members.add(model, [p[0].app.name for p in parts])

    # ------------------------------------------------------------------ inside

    def _finished(self, req: AppRequest, pos: int) -> list[int]:
        """Model `pos` has no part left: its children whose parents have all finished."""
        app = req.app
        out: list[int] = []
        for child, _ in app.children[pos]:
            req.parents_left[child] -= 1
            if req.parents_left[child] == 0:
                out.append(child)
        return out

    def _parts_of(self, req: AppRequest, child: int) -> list[Any]:
        """The data of a child's parts: the driver's fan over its first parent's parts,
        with a draw of the edge's fan-out for each."""
        app = req.app
        first = app.parents[child][0]
        fan = next(f for c, f in app.children[first] if c == child)
        fixed = fan.fixed
        n = req.made[first]
        drawn = [fixed] * n if fixed is not None else [fan.sample(self._rng) for _ in range(n)]
        return self._fan(req, child, first, drawn)

    def _turn(self, req: AppRequest, ready: list[int]) -> None:
        self._scheduled -= 1
        if req.answered:
            return
        try:
            made = [(c, self._parts_of(req, c)) for c in ready]
        except Exception as exc:  # the driver's transform failed: the request fails
            self._end(req, FAILED, f"making its parts: {exc}")
            return
        self._make(req, made)
        self._decide()

    def _make(self, req: AppRequest, ready: list[tuple[int, list[Any]]]) -> None:
        """Parts for each (model position, their data); a model given none has finished."""
        app = req.app
        while ready:
            pos, data = ready.pop()
            req.made[pos] = len(data)
            if not data:
                ready += [(c, self._parts_of(req, c)) for c in self._finished(req, pos)]
                continue
            req.running[pos] += len(data)
            self.parts += len(data)
            due = app.due_us[pos] * (req.slo_us / app.slo_us)
            for d in data:
                self._add(app.parts[pos], (req, pos, d), due, req.arrived_us)
                if req.answered:  # refused at once (no live path): answered already
                    return
        if not any(req.running) and not any(req.parents_left):
            self._done(req)

    def _done(self, req: AppRequest) -> None:
        late = self.clock.now() > req.arrived_us + req.slo_us
        self._end(req, LATE if late else ON_TIME, "")

    def _end(self, req: AppRequest, outcome: Outcome, reason: str) -> None:
        req.answered = True
        self.open -= 1
        latency = (
            self.clock.now() - req.arrived_us
            if outcome.has_result and self._keep_latencies
            else None
        )
        count_answer(self.stats[req.app.name], outcome, latency)
        self._answer(req, outcome, reason)
