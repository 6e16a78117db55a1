"""The router's load watch: every second, each served model's cumulative arrivals (a plan
of entry streams: each stream's, domain.plan.watched_load) into
`poolpipe.runtime.envelope.ArrivalRates`, checked against the served plan's envelope (its
models' deliverable req/s; a plan that states none for some model, a hand-made one, has no
envelope: its rates are kept, nothing is judged).
An event is logged once (a warning: the load no longer matches the plan), counted, and
handed to `on_event` (`poolpipe serve --prefect-events`: a Prefect event that a deployment
trigger turns into a re-plan, flows.replan.load_replan); a rollout starts the rates and the
envelope anew on the new plan."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from poolpipe.domain.plan import Plan, watched_load
from poolpipe.runtime.envelope import (
    ABOVE,
    BELOW,
    MIX,
    RATE_WINDOWS_S,
    ArrivalRates,
    Envelope,
    EnvelopeConfig,
    EnvelopeEvent,
)

log = logging.getLogger("poolpipe.serve")
SAMPLE_S = 1.0
KINDS = (ABOVE, BELOW, MIX)


class LoadWatch:
    """`sample()` once a second (its own thread from `start`); `figures()` is read by the
    router's metrics and status."""

    def __init__(
        self,
        stats: Any,  # name -> ModelStats, cumulative (RouterCore.stats)
        plan: Any,  # () -> the plan served now
        config: EnvelopeConfig | None = None,
        sample_s: float = SAMPLE_S,
        on_event: Callable[[EnvelopeEvent], None] | None = None,
    ):
        self._stats, self._plan = stats, plan
        self.on_event = on_event
        self.config = config or EnvelopeConfig()
        self.sample_s = sample_s
        self.events: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
        self.recent: deque[EnvelopeEvent] = deque(maxlen=10)
        self._served: Plan | None = None
        self._rates: ArrivalRates | None = None
        self._envelope: Envelope | None = None
        self._names: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="poolpipe-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.sample(time.monotonic() * 1e6)
            except Exception as exc:  # never stops the watch (a rollout under way: next time)
                log.debug("load watch: %s", exc)

    def sample(self, now_us: float) -> list[EnvelopeEvent]:
        """Take the served models' arrivals as of `now_us`; check the envelope; log and
        count what it says."""
        plan = self._plan()
        with self._lock:
            if plan is not self._served:
                self._start_on(plan)
            assert self._rates is not None
            stats = self._stats()
            self._rates.sample(
                now_us, [stats[n].arrivals if n in stats else 0 for n in self._names]
            )
            events = [] if self._envelope is None else self._envelope.check(now_us, self._rates)
        for e in events:
            self.events[e.kind] += 1
            self.recent.append(e)
            log.warning("the load left the plan's envelope (%s): %s", e.kind, e.why)
            if self.on_event is not None:
                try:
                    self.on_event(e)
                except Exception as exc:
                    log.warning("the load event (%s) was not passed on: %s", e.kind, exc)
        return events

    def _start_on(self, plan: Plan) -> None:
        self._served = plan
        watched = watched_load(plan)  # models; a plan of entry streams, its streams
        self._names = list(watched)
        self._rates = ArrivalRates(len(self._names))
        stated = [d for d, _ in watched.values()]
        self._envelope = (
            None
            if any(d is None or not d > 0 for d in stated)
            else Envelope(
                self._names,
                [float(d) for d in stated if d is not None],
                [w for _, w in watched.values()],
                self.config,
            )
        )

    def figures(self) -> dict[str, Any]:
        """Per model its rate over each window and its share of the envelope's rate (short
        window); the envelope; the events so far and the last few."""
        now_us = time.monotonic() * 1e6
        with self._lock:
            if self._rates is None:
                return {"models": {}, "events": dict(self.events), "recent": []}
            rates = {w: self._rates.rates(w) for w in RATE_WINDOWS_S}
            env = self._envelope
            shares = None if env is None else env.shares(self._rates.rates(self.config.short_s))
            return {
                "models": {
                    n: {
                        "req_s": {f"{w:g}s": round(rates[w][i], 2) for w in RATE_WINDOWS_S},
                        "envelope_req_s": None if env is None else round(env.deliverable[i], 2),
                        "share": None if shares is None else round(shares[i], 3),
                    }
                    for i, n in enumerate(self._names)
                },
                "envelope": env is not None,
                "sampled_s": round(self._rates.sampled_s(), 1),
                "config": {
                    "high": self.config.high,
                    "low": self.config.low,
                    "hold_s": self.config.hold_s,
                    "mix_shift": self.config.mix_shift,
                },
                "events": dict(self.events),
                "recent": [
                    {"kind": e.kind, "seconds_ago": round((now_us - e.at_us) / 1e6), "why": e.why}
                    for e in self.recent
                ],
            }
