"""Applications at the router's door: one KServe v2 model per application of the served
plan (its inputs the entry model's, its outputs the exit models'), whose requests the
runtime's application coordinator (poolpipe.runtime.apps) turns into parts on the
router's loop.

A client request of n rows is n application requests, answered together once all are (or
at the first dropped or failed: nothing partial). A part is an ordinary runtime entry (a
`RequestRow`) of its served model (app.model); its answer goes to the coordinator instead
of a client. A child's parts are made by its first parent's edge transform from each of
that parent's parts' outputs (a dict of output name -> array, batch 1): `identity` (the
parent's outputs are the child's inputs, one part each, fan-out copies), `shadow` (fan-out
zero inputs of the child's shapes) or the user's `module:function(outputs, fanout)`, which
returns the child's inputs, one item per part (an array for a one-input child, else a
list of arrays in its input order; with or without the batch dimension of 1): how many
it returns is how many parts there are. An exit's outputs are its parts' outputs
stacked (first dimension: parts of all rows); with several exits each output is named
`model.output`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from poolpipe.domain.apps import IDENTITY, SHADOW, App, resolve_transform
from poolpipe.offline.partitions import TensorSpec
from poolpipe.runtime import DROPPED, FAILED, Clock, Outcome, ServingRuntime
from poolpipe.runtime.apps import (
    AppCoordinator,
    AppRequest,
    Part,
    ServedApp,
    check_app_slo,
    served_app,
)
from poolpipe.runtime.intake import BadRequest, Unservable, request_slo_us
from poolpipe.scheduler import Topology
from triton_backend.router.served import ClientRequest, ModelIO, Reply, RequestRow


def app_ios(
    apps: Sequence[App], parts: Mapping[str, ModelIO], served: Mapping[str, Mapping[str, str]]
) -> list[ModelIO]:
    """Each application's tensors at the door: its entry's inputs, its exits' outputs
    (`served`: each application's served model per model, domain.apps.served_parts)."""
    out = []
    for a in apps:
        where = served[a.name]
        entry = parts[where[a.entry]]
        outs: list[TensorSpec] = []
        for e in a.exits:
            for t in parts[where[e]].outputs:
                outs.append(t if len(a.exits) == 1 else replace(t, name=f"{e}.{t.name}"))
        out.append(ModelIO(a.name, entry.inputs, tuple(outs)))
    return out


class _PartSink:
    """Where the executor settles a part (as it settles a client request's row)."""

    __slots__ = ("apps", "part")
    trace = None  # an application's parts are not traced (router/tracing.py)

    def __init__(self, apps: RouterApps, part: Part):
        self.apps = apps
        self.part = part

    def settle(self, row: int, outcome: Outcome, reason: str, result: Any) -> None:
        self.apps.coordinator.part_ended(self.part, outcome, reason, result)


class RouterApps:
    """The served plan's applications on a router (RouterCore.apps): their door tensors
    and the coordinator (whose calls all run on the router's loop, on its `runtime` and
    `clock`)."""

    def __init__(
        self,
        runtime: ServingRuntime,
        clock: Clock,
        apps: Sequence[App],
        budgets_us: Mapping[str, Mapping[str, float]],
        parts: Mapping[str, ModelIO],
        served: Mapping[str, Mapping[str, str]],
    ):
        self.runtime = runtime
        self.apps = list(apps)
        self.parts = dict(parts)  # served part model -> its tensors
        # per application, each model's served part (domain.apps.served_parts: shared
        # parts by their own names)
        self.where = {a.name: dict(served[a.name]) for a in self.apps}
        self.ios = {io.name: io for io in app_ios(self.apps, self.parts, self.where)}
        self.index = {a.name: i for i, a in enumerate(self.apps)}
        self.served = self._served(budgets_us)
        self._transforms = {
            (a.name, e.src, e.dst): e.transform
            if e.transform in (IDENTITY, SHADOW)
            else resolve_transform(e.transform, f"application {a.name}: {e.src} -> {e.dst}")
            for a in self.apps
            for e in a.edges
        }
        self._topo: Topology | None = None  # the topology _index was made from
        self._index: dict[str, int] = {}
        self.coordinator = AppCoordinator(
            self.served, clock, self._add, runtime.decide, self._answer, fan=self._fan
        )
        runtime.on_batch(self._batched)

    def _served(self, budgets_us: Mapping[str, Mapping[str, float]]) -> list[ServedApp]:
        return [
            served_app(a, budgets_us[a.name], self.where[a.name]) for a in self.apps
        ]

    def use_budgets(self, budgets_us: Mapping[str, Mapping[str, float]]) -> None:
        """A plan rolled out (on the router's loop): its budgets for the requests that
        arrive from now on; those in flight keep theirs."""
        self.served = self._served(budgets_us)
        self.coordinator.apps = list(self.served)

    def take(
        self,
        name: str,
        arrays: Sequence[np.ndarray],
        slo_ms: object,
        arrived_us: float,
        reply: Reply,
    ) -> None:
        """One client request of application `name` (on the router's loop); `slo_ms`: its
        own SLO (a hybrid client's budget left), its parts' budgets scaled to it."""
        io = self.ios[name]
        slo_us = request_slo_us(slo_ms, self.runtime.config.max_slo_ms)
        if len(arrays) != len(io.inputs):
            raise BadRequest(f"{name}: expected {len(io.inputs)} input tensors")
        n = int(arrays[0].shape[0]) if arrays[0].ndim else 0
        if n < 1:
            raise BadRequest(f"{name}: a request needs at least one row")
        app = self.served[self.index[name]]
        served = self._models()
        if any(p not in served for p in app.parts):
            raise Unservable(f"{name}: the plan served now does not serve this application")
        if slo_us is not None:  # one it cannot meet refused before anything runs
            check_app_slo(
                app, slo_us, lambda part: self.runtime.fastest_us(served[part]),
                self.runtime.reply_margin_us,
            )  # fmt: skip
        coord = self.coordinator
        request = ClientRequest(io, n, reply)
        for i in range(n):
            coord.arrive(
                self.index[name], (request, i), [a[i : i + 1] for a in arrays], arrived_us, slo_us
            )

    # ------------------------------------------------------------------ the coordinator's

    def _models(self) -> dict[str, int]:
        """The served plan's models by name (made again only when a rollout changed the
        plan, not for every part)."""
        topo = self.runtime.topo
        if topo is not self._topo:
            self._topo, self._index = topo, {m.name: m.index for m in topo.models}
        return self._index

    def _add(self, model: str, part: Part, slo_us: float, arrived_us: float) -> Any:
        index = self._models().get(model)
        if index is None:  # a plan rolled out without this application
            self.coordinator.part_ended(part, FAILED, f"the plan served now has no {model}")
            return None
        row = RequestRow(_PartSink(self, part), 0, list(part[2]))  # type: ignore[arg-type]
        return self.runtime.add(index, row, slo_us, arrived_us)

    def _batched(self, model: int, rows: list[Any]) -> None:
        """A batch sent down a pipeline: its applications' parts recorded (members)."""
        parts = [r.request.part for r in rows if isinstance(r.request, _PartSink)]
        if parts:
            self.coordinator.batch(self.runtime.topo.models[model].name, parts)

    def _answer(self, req: AppRequest, outcome: Outcome, reason: str) -> None:
        request, row = req.payload
        if outcome is DROPPED or outcome is FAILED:
            request.settle(row, outcome, f"application {req.app.name}: {reason}", None)
            return
        outs: dict[str, np.ndarray] = {}
        app = req.app
        io = self.ios[app.name]
        k = 0
        for pos in (p for p in range(len(app.models)) if not app.children[p]):  # the exits
            for t in self.parts[app.parts[pos]].outputs:
                got = [r[t.name] for r in req.results[pos]]
                outs[io.outputs[k].name] = (
                    np.concatenate(got) if got else np.zeros((0, *t.dims), t.dtype)
                )
                k += 1
        request.settle(row, outcome, reason, outs)

    def _fan(self, req: AppRequest, child: int, parent: int, drawn: list[int]) -> list[Any]:
        app = req.app
        src, dst = app.models[parent], app.models[child]
        transform = self._transforms[(app.name, src, dst)]
        inputs = self.parts[app.parts[child]].inputs
        outputs = self.parts[app.parts[parent]].outputs
        out: list[Any] = []
        for result, k in zip(req.results[parent], drawn, strict=True):
            if transform == IDENTITY:
                item = [result[t.name] for t in outputs]
                out += [_shaped(item, inputs, src, dst)] * k
            elif transform == SHADOW:
                out += [[np.zeros((1, *t.dims), t.dtype) for t in inputs]] * k
            else:
                made = transform(dict(result), k)  # type: ignore[operator]
                out += [_shaped(item, inputs, src, dst) for item in made]
        return out


def _shaped(item: Any, inputs: Sequence[TensorSpec], src: str, dst: str) -> list[np.ndarray]:
    """One part's inputs as the child takes them (batch 1, its dtypes); a clear error for
    a transform that made something else."""
    arrays = [item] if isinstance(item, np.ndarray) else list(item)
    if len(arrays) != len(inputs):
        raise ValueError(
            f"{src} -> {dst}: the transform made {len(arrays)} tensor(s) for a part; "
            f"{dst} takes {len(inputs)}"
        )
    out = []
    for a, t in zip(arrays, inputs, strict=True):
        a = np.asarray(a)
        if a.shape == tuple(t.dims):
            a = a[None]
        if a.shape[1:] != tuple(t.dims) or a.shape[0] != 1:
            raise ValueError(
                f"{src} -> {dst}: the transform made a tensor of shape {a.shape} for "
                f"{dst}'s input {t.name} of shape (1, {', '.join(map(str, t.dims))})"
            )
        out.append(a.astype(t.dtype, copy=False))
    return out
