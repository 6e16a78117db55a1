"""Applications: graphs of models served under one end-to-end SLO (apps.toml).

An application is a directed acyclic graph whose nodes are models and whose edges say what
a request of one model makes of the next: `fanout` requests of the child per request of
the parent (a whole number, or a distribution for the simulator and emulated runs), built
from the parent's outputs by a `transform`. A model with several parents waits for all of
them (fan-in); every path from the application's one entry model to any model must then
make the same number of that model's requests. Each application has one SLO (from its
entry's arrival until its last part has finished) and a weight in the mix.

    [[apps]]
    name = "traffic"              # the application's model name at the router's door
    slo_ms = 300
    weight = 1.0                  # its share of the mix (1)
    models = ["detector"]         # optional: models no edge names (a one-model application)

    [[apps.edges]]
    from = "detector"
    to = "classifier"
    fanout = 3                    # or { poisson = 2.5 }, or { values = [1, 3],
                                  #    weights = [0.4, 0.6] }
    transform = "shadow"          # identity (the default) | shadow | package.module:function

Transforms: `identity` passes the parent's outputs on as the child's inputs; `shadow`
makes `fanout` inputs of the child's shape (a shadow model: the load of the real crops
without their content); `module:function` is the user's own, imported when the spec is
loaded. This module is pure: checks that need the models' profiles take what they need
as arguments."""

from __future__ import annotations

import importlib
import math
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from poolpipe.domain.tomlfile import need, only_known, read_toml
from poolpipe.errors import PoolpipeError

if TYPE_CHECKING:
    from poolpipe.domain.profiles import ModelProfile

IDENTITY = "identity"
SHADOW = "shadow"
BUILTIN_TRANSFORMS = (IDENTITY, SHADOW)
# An application is a model at the router's door: a KServe v2 model name.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*$")
_IMPORTABLE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Relative difference below which two paths make "the same" number of a model's requests.
_SAME = 1e-9


class AppSpecError(PoolpipeError):
    """An application spec that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class FanOut:
    """How many requests of the child one request of the parent makes: `values` with
    `weights` (one value, weight 1: a fixed fan-out), or a Poisson law of mean `poisson`."""

    values: tuple[int, ...] = (1,)
    weights: tuple[float, ...] = (1.0,)
    poisson: float | None = None

    @property
    def mean(self) -> float:
        """The mean fan-out: what planning couples the rates by."""
        if self.poisson is not None:
            return self.poisson
        return sum(v * w for v, w in zip(self.values, self.weights, strict=True)) / sum(
            self.weights
        )

    @property
    def fixed(self) -> int | None:
        """The fan-out where it is always the same, else None."""
        return self.values[0] if self.poisson is None and len(self.values) == 1 else None

    def sample(self, rng: random.Random) -> int:
        """One draw (the simulator's and emulated runs')."""
        if self.poisson is not None:  # Knuth's method: means here are small
            limit, k, p = math.exp(-self.poisson), 0, rng.random()
            while p > limit:
                k += 1
                p *= rng.random()
            return k
        return rng.choices(self.values, self.weights)[0]

    def describe(self) -> str:
        if self.poisson is not None:
            return f"Poisson({self.poisson:g})"
        if self.fixed is not None:
            return str(self.fixed)
        return (
            "{"
            + ", ".join(f"{v}: {w:g}" for v, w in zip(self.values, self.weights, strict=True))
            + "}"
        )


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    fanout: FanOut = field(default_factory=FanOut)
    transform: str = IDENTITY


@dataclass(frozen=True)
class App:
    """An application: its models in an order in which every parent comes before its
    children (the entry first), and its edges."""

    name: str
    slo_us: float
    weight: float
    models: tuple[str, ...]
    edges: tuple[Edge, ...] = ()

    @property
    def entry(self) -> str:
        return self.models[0]

    def parents(self, model: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.dst == model)

    def children(self, model: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == model)

    @property
    def exits(self) -> tuple[str, ...]:
        """The models no other model waits for: their outputs answer the request."""
        return tuple(m for m in self.models if not self.children(m))

    def paths(self) -> list[tuple[str, ...]]:
        """Every path from the entry to an exit (along each, the models' latency budgets
        sum to at most the SLO)."""
        out: list[tuple[str, ...]] = []

        def walk(path: tuple[str, ...]) -> None:
            kids = self.children(path[-1])
            if not kids:
                out.append(path)
            for e in kids:
                walk((*path, e.dst))

        walk((self.entry,))
        return out

    def multiplicity(self) -> dict[str, float]:
        """Each model's requests per request of the application (mean fan-outs multiplied
        along any path: with fan-in, every path agrees)."""
        out = {self.entry: 1.0}
        for m in self.models[1:]:
            e = self.parents(m)[0]
            out[m] = out[e.src] * e.fanout.mean
        return out


def load_apps(
    path: str | Path,
    known_models: Iterable[str] | None = None,
    fastest_us: Mapping[str, float] | None = None,
    import_transforms: bool = True,
) -> list[App]:
    """The applications of an apps.toml; AppSpecError naming the file and the field that
    is wrong (see parse_apps for the checks)."""
    path = Path(path)
    data = read_toml(path, "application spec", AppSpecError)
    return parse_apps(data, str(path), known_models, fastest_us, import_transforms)


def parse_apps(
    data: dict,
    source: str = "apps",
    known_models: Iterable[str] | None = None,
    fastest_us: Mapping[str, float] | None = None,
    import_transforms: bool = True,
) -> list[App]:
    """Applications from parsed TOML. Checked: the fields and their types; names; a graph
    without cycles with one entry model; fan-outs > 0; fan-in with the same number of
    requests along every path; transforms built in or importable (`import_transforms`);
    models among `known_models` (where given); the SLO no shorter than the slowest path's
    fastest latencies (`fastest_us`: each model's, e.g. batch 1 on its fastest GPU)."""
    known = set(known_models) if known_models is not None else None
    _keys(data, {"apps"}, "top level", source)
    tables = data.get("apps")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise AppSpecError(f"{source}: no [[apps]]: add one table per application")
    apps: list[App] = []
    for i, t in enumerate(tables):
        app = _parse_app(t, f"[[apps]] #{i + 1}", source, known, import_transforms)
        if any(a.name == app.name for a in apps):
            raise AppSpecError(f"{source}: two applications are named {app.name}")
        if known is not None and app.name in known:
            raise AppSpecError(
                f"{source}: application {app.name}: a model has that name; the router's door "
                "would offer both: rename the application"
            )
        if fastest_us is not None:
            _check_slo(app, fastest_us, source)
        apps.append(app)
    return apps


def _parse_app(t: dict, what: str, source: str, known: set[str] | None, imports: bool) -> App:
    _keys(t, {"name", "slo_ms", "weight", "models", "edges"}, what, source)
    name = _need(t, "name", what, source, str)
    if not _NAME.match(name):
        raise AppSpecError(
            f"{source}: {what}: name = {name!r}: use letters, digits, _, . and - (it is a "
            "model name at the router's door)"
        )
    what = f"application {name}"
    slo_ms = _need(t, "slo_ms", what, source, float)
    if not (slo_ms > 0 and math.isfinite(slo_ms)):
        raise AppSpecError(f"{source}: {what}: slo_ms = {slo_ms!r} must be a number of ms > 0")
    weight = _need(t, "weight", what, source, float) if "weight" in t else 1.0
    if not (weight > 0 and math.isfinite(weight)):
        raise AppSpecError(f"{source}: {what}: weight = {weight!r} must be > 0")
    listed = t.get("models", [])
    if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
        raise AppSpecError(f"{source}: {what}: models = {listed!r} is not a list of model names")
    raw = t.get("edges", [])
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise AppSpecError(f"{source}: {what}: edges must be an array of tables ([[apps.edges]])")
    edges = [_parse_edge(e, f"{what}: edge #{k + 1}", source, imports) for k, e in enumerate(raw)]
    models = list(dict.fromkeys([*listed, *(m for e in edges for m in (e.src, e.dst))]))
    if not models:
        raise AppSpecError(f"{source}: {what}: no models: list them (models = [...]) or add edges")
    if known is not None:
        unknown = [m for m in models if m not in known]
        if unknown:
            raise AppSpecError(
                f"{source}: {what}: unknown model(s) {', '.join(unknown)}; onboard them first "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
    seen = set()
    for e in edges:
        if e.src == e.dst:
            raise AppSpecError(f"{source}: {what}: edge {e.src} -> {e.dst} is a cycle")
        if (e.src, e.dst) in seen:
            raise AppSpecError(f"{source}: {what}: edge {e.src} -> {e.dst} is given twice")
        seen.add((e.src, e.dst))
    order = _topological(models, edges, what, source)
    app = App(name, slo_ms * 1e3, weight, tuple(order), tuple(edges))
    _check_fan_in(app, what, source)
    return app


def _parse_edge(e: dict, what: str, source: str, imports: bool) -> Edge:
    _keys(e, {"from", "to", "fanout", "transform"}, what, source)
    src, dst = _need(e, "from", what, source, str), _need(e, "to", what, source, str)
    what = f"{what} ({src} -> {dst})"
    transform = e.get("transform", IDENTITY)
    if not isinstance(transform, str):
        raise AppSpecError(f"{source}: {what}: transform = {transform!r} is not a string")
    if transform not in BUILTIN_TRANSFORMS:
        if not _IMPORTABLE.match(transform):
            raise AppSpecError(
                f"{source}: {what}: transform = {transform!r}: use identity, shadow or "
                "package.module:function"
            )
        if imports:
            resolve_transform(transform, f"{source}: {what}")
    return Edge(src, dst, _parse_fanout(e.get("fanout", 1), what, source), transform)


def _parse_fanout(v: object, what: str, source: str) -> FanOut:
    bad = f"{source}: {what}: fanout = {v!r}"
    if isinstance(v, bool):
        raise AppSpecError(f"{bad} is not a number")
    if isinstance(v, int | float):
        if v != int(v) or v < 1:
            raise AppSpecError(
                f"{bad}: a fixed fan-out is a whole number >= 1; for a mean give a "
                "distribution ({ poisson = 2.5 } or { values = [...], weights = [...] })"
            )
        return FanOut((int(v),))
    if not isinstance(v, dict):
        raise AppSpecError(f"{bad} is neither a number nor a distribution")
    if set(v) == {"poisson"}:
        mean = v["poisson"]
        if isinstance(mean, bool) or not isinstance(mean, int | float) or not 0 < mean < 1e3:
            raise AppSpecError(f"{bad}: the Poisson mean must be a number > 0 (and < 1000)")
        return FanOut(poisson=float(mean))
    if set(v) == {"values", "weights"}:
        values, weights = v["values"], v["weights"]
        ok = (
            isinstance(values, list)
            and isinstance(weights, list)
            and len(values) == len(weights) > 0
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values)
            and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
        )
        if not ok or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise AppSpecError(
                f"{bad}: values are whole numbers >= 0, weights numbers >= 0 (not all 0), "
                "as many of each"
            )
        fan = FanOut(tuple(values), tuple(float(w) for w in weights))
        if fan.mean <= 0:
            raise AppSpecError(f"{bad}: its mean is 0: the child would never run")
        return fan
    raise AppSpecError(
        f"{bad}: a distribution is {{ poisson = MEAN }} or {{ values = [...], weights = [...] }}"
    )


def resolve_transform(spec: str, where: str = "transform") -> object:
    """The function a `package.module:function` transform names (imported now); the
    built-in ones are the runtime's (poolpipe.runtime.transforms)."""
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # any import-time error of the user's module
        raise AppSpecError(
            f"{where}: transform {spec} cannot be imported ({type(exc).__name__}: {exc}); "
            "check that its package is installed where the router runs"
        ) from None
    if not callable(fn):
        raise AppSpecError(f"{where}: transform {spec} is not a function")
    return fn


def _topological(models: list[str], edges: list[Edge], what: str, source: str) -> list[str]:
    """Kahn's order; AppSpecError for a cycle, or for other than one entry model."""
    indeg = {m: 0 for m in models}
    for e in edges:
        indeg[e.dst] += 1
    entries = [m for m in models if indeg[m] == 0]
    if len(entries) > 1:
        raise AppSpecError(
            f"{source}: {what}: {len(entries)} models no edge leads to ({', '.join(entries)}); "
            "an application has one entry model: join them with edges, or make two applications"
        )
    order, ready = [], list(entries)
    while ready:
        m = ready.pop(0)
        order.append(m)
        for e in edges:
            if e.src == m:
                indeg[e.dst] -= 1
                if indeg[e.dst] == 0:
                    ready.append(e.dst)
    if len(order) < len(models):
        stuck = [m for m in models if m not in order]
        raise AppSpecError(f"{source}: {what}: the edges make a cycle through {', '.join(stuck)}")
    return order


def _check_fan_in(app: App, what: str, source: str) -> None:
    counts: dict[str, float] = {app.entry: 1.0}
    for m in app.models[1:]:
        via = {e.src: counts[e.src] * e.fanout.mean for e in app.parents(m)}
        first = next(iter(via.values()))
        if any(abs(v - first) > _SAME * max(1.0, first) for v in via.values()):
            each = ", ".join(f"{v:g} via {p}" for p, v in via.items())
            raise AppSpecError(
                f"{source}: {what}: {m} waits for {', '.join(via)}, but they make different "
                f"numbers of its requests per application request ({each}); fan-in joins "
                "one request of each parent: give the edges fan-outs that agree"
            )
        counts[m] = first


def _check_slo(app: App, fastest_us: Mapping[str, float], source: str) -> None:
    missing = [m for m in app.models if m not in fastest_us]
    if missing:
        raise AppSpecError(
            f"{source}: application {app.name}: no profile for {', '.join(missing)}; profile "
            "them first"
        )
    worst = max(app.paths(), key=lambda p: sum(fastest_us[m] for m in p))
    need = sum(fastest_us[m] for m in worst)
    if need > app.slo_us:
        raise AppSpecError(
            f"{source}: application {app.name}: slo_ms = {app.slo_us / 1e3:g} is shorter than "
            f"its path {' -> '.join(worst)} at its fastest ({need / 1e3:.1f} ms: each model "
            "alone at batch 1 on its fastest GPU): raise the SLO"
        )


def _need(t: dict, key: str, what: str, source: str, kind: type):
    return need(t, key, what, source, kind, AppSpecError)


def _keys(t: dict, keys: set[str], what: str, source: str) -> None:
    only_known(t, keys, what, source, AppSpecError)


def part_name(app: str, model: str) -> str:
    """The served plan's model for `model` within application `app` (the pipelines of a
    model in two applications are planned and served apart)."""
    return f"{app}.{model}"


def served_parts(app: str, record: Mapping) -> dict[str, str]:
    """The served plan's model for each model of application `app`, as its plan records
    it: `parts` where some are shared with other applications (one model's pools serving
    every application that names it: planner.apps's `shared`), else part_name's."""
    parts = record.get("parts")
    if isinstance(parts, Mapping):
        return {str(m): str(p) for m, p in parts.items()}
    return {m: part_name(app, m) for m in record.get("models", ())}


def base_models(meta: Mapping) -> dict[str, str]:
    """Each application part of a plan (served_parts) and the model it is (its profile and
    files in the warehouse are that model's)."""
    recorded = meta.get("apps") or {}
    return {
        served: m
        for app, rec in recorded.items()
        if isinstance(rec, dict)
        for m, served in served_parts(app, rec).items()
    }


def app_table(app: App) -> dict:
    """`app` as its [[apps]] table (what parse_apps reads): a plan records its
    applications so, and whoever serves the plan reads them back."""

    def fanout(f: FanOut) -> object:
        if f.poisson is not None:
            return {"poisson": f.poisson}
        if f.fixed is not None:
            return f.fixed
        return {"values": list(f.values), "weights": list(f.weights)}

    return {
        "name": app.name,
        "slo_ms": app.slo_us / 1e3,
        "weight": app.weight,
        "models": list(app.models),
        "edges": [
            {"from": e.src, "to": e.dst, "fanout": fanout(e.fanout), "transform": e.transform}
            for e in app.edges
        ],
    }


def plan_applications(meta: Mapping, source: str = "the plan") -> tuple[list[App], dict]:
    """The applications a plan's meta records (app_table's, transforms imported) and each
    one's record (SLO, weight, budgets); ([], {}) for a plan of models alone."""
    recorded = meta.get("apps")
    if not recorded:
        return [], {}
    tables = [r["spec"] for r in recorded.values() if isinstance(r, dict) and "spec" in r]
    if len(tables) != len(recorded):
        raise AppSpecError(f"{source}: its applications lack their graphs: plan them again")
    return parse_apps({"apps": tables}, source), dict(recorded)


def fastest_latencies(profiles: Iterable[ModelProfile]) -> dict[str, float]:
    """Each model alone at batch 1 on its fastest GPU (µs): what no budget can go below."""
    return {
        p.name: min(p.whole_latency_us(gpu, share, 1) for gpu, share in p.tables) for p in profiles
    }
