"""What the observed load needs: the GPUs of each type that serve it, against those in use.

`advise` plans the cheapest GPUs (the cost objective, sized on what the plan delivers:
cost.py) that serve each model's observed rate times (1 + headroom) on the GPUs the cluster
offers, and compares them with the served plan's. Beside it, the nodes that can be released
now without a new plan: packing (scheduler.adaptive.PACK) leaves the highest vGPUs of a pool
idle at a low load, and a node that has run no stage for `idle_s` is one the data plane no
longer needs (drain it, then release it: a drained node with no batch on it is released at
once). This is what a Kubernetes HPA / KEDA scaler or a cloud autoscaler acts on; nodes that
join the inventory are used at the next re-plan.

Pure: the caller brings the served plan, the rates, the cluster and the nodes' states (the
router's `status`); no clock, process or session here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import STRATEGIES, Plan, time_scale, undilated
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import InfeasibleError, PoolpipeError
from poolpipe.planner.request import PlanRequest

HEADROOM = 0.2  # the plan asked for serves the observed rates x (1 + this)
IDLE_S = 60.0  # a node idle this long can be released
# a model seen at (nearly) no load is still planned a pipeline, at this share of the
# served plan's rate for it (the cost objective needs a rate > 0 for every model)
FLOOR_SHARE = 0.01


@dataclass(frozen=True)
class Advice:
    """GPUs per type: in use by the served plan, needed by the observed load (None where
    the cluster cannot serve it: `why_not`), offered by the cluster; the rates observed and
    asked; what the advised plan delivers per model; the nodes that can be released now."""

    rates: dict[str, float]
    asked: dict[str, float]
    headroom: float
    in_use: dict[str, int]
    available: dict[str, int]
    needed: dict[str, int] | None
    deliverable: dict[str, float | None] | None
    cost_per_hour: float | None
    served_cost_per_hour: float  # the served plan's GPUs at the same prices
    priced: bool  # False: no prices known, every GPU counted alike (1 per hour)
    why_not: str | None
    releasable: tuple[dict[str, Any], ...]
    plan: Plan | None = None

    def change(self) -> dict[str, int]:
        """GPUs to add (> 0) or give back (< 0) per type; empty where nothing is known."""
        if self.needed is None:
            return {}
        types = sorted(set(self.in_use) | set(self.needed))
        return {g: self.needed.get(g, 0) - self.in_use.get(g, 0) for g in types}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("plan")
        d["change"] = self.change()
        return d


# What a router keeps of the last advice it was given (control op "advice") and exports
# as gauges: GPUs per type needed and in use, the headroom asked, the rates advised on.
PUBLISHED = ("needed", "in_use", "available", "headroom", "rates", "cost_per_hour", "why_not")


def published(a: Advice) -> dict[str, Any]:
    """The figures of `a` a router keeps and exports (PUBLISHED)."""
    d = a.to_dict()
    return {k: d[k] for k in PUBLISHED}


def read_published(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` (an advice sent to a router) checked: GPU counts per type whole numbers >= 0
    (needed: None where the GPUs offered cannot serve the load), the headroom a share >= 0,
    rates req/s >= 0; a PoolpipeError naming the first field that is not."""

    def counts(key: str, none_ok: bool = False) -> dict[str, int] | None:
        v = doc.get(key)
        if v is None and none_ok:
            return None
        if not isinstance(v, Mapping) or not all(
            isinstance(g, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for g, n in v.items()
        ):
            raise PoolpipeError(f"advice: {key} must map GPU types to counts >= 0, got {v!r}")
        return dict(v)

    headroom = doc.get("headroom")
    if not isinstance(headroom, int | float) or not (headroom >= 0 and math.isfinite(headroom)):
        raise PoolpipeError(f"advice: headroom must be a share >= 0, got {headroom!r}")
    rates = doc.get("rates") or {}
    if not isinstance(rates, Mapping) or not all(
        isinstance(r, int | float) and r >= 0 and math.isfinite(r) for r in rates.values()
    ):
        raise PoolpipeError(f"advice: rates must map models to req/s >= 0, got {rates!r}")
    cost = doc.get("cost_per_hour")
    return {
        "needed": counts("needed", none_ok=True),
        "in_use": counts("in_use"),
        "available": counts("available"),
        "headroom": float(headroom),
        "rates": {str(m): float(r) for m, r in rates.items()},
        "cost_per_hour": None if cost is None else float(cost),
        "why_not": None if doc.get("why_not") is None else str(doc["why_not"]),
    }


def undilated_load(served: Plan, rates: Mapping[str, float]) -> tuple[Plan, dict[str, float]]:
    """A plan served at time scale D (emulated GPU nodes: domain.plan.dilated) and the rates
    a router measured under it, as `advise` plans them: the plan undilated, the rates x D."""
    d = time_scale(served)
    return undilated(served), {n: float(r) * d for n, r in rates.items()}


def releasable_nodes(nodes: Sequence[Mapping[str, Any]], idle_s: float) -> list[dict[str, Any]]:
    """Of the router's nodes (status's "nodes": node, address, state, batches, idle_s),
    those that can be released now: drained with no batch on it (release), or in service,
    no batch on it, and no stage for `idle_s` (drain, then release). Down nodes are not
    listed (they are out already)."""
    out = []
    for n in nodes:
        if n.get("batches", 0) or n.get("state") == "down":
            continue
        idle = float(n.get("idle_s") or 0.0)
        if n.get("state") == "drained":
            out.append({**_node(n), "action": "release"})
        elif idle >= idle_s:
            out.append({**_node(n), "action": "drain, then release"})
    return out


def _node(n: Mapping[str, Any]) -> dict[str, Any]:
    return {k: n.get(k) for k in ("node", "address", "state", "idle_s")}


def advise(
    served: Plan,
    profiles: Mapping[str, ModelProfile],
    rates: Mapping[str, float],
    cluster: Cluster,
    *,
    headroom: float = HEADROOM,
    prices: Mapping[str, float] | None = None,
    nodes: Sequence[Mapping[str, Any]] = (),
    idle_s: float = IDLE_S,
    delivery: str = "maximise",
) -> Advice:
    """The advice for the load `rates` (req/s per model of `served`; per entry stream of a
    plan of them) on `cluster` (the GPUs offered: the router's inventory). `delivery`
    "off" sizes on the fluid plan (tests)."""
    from poolpipe.planner.strategies import make_plan

    if not (headroom >= 0 and math.isfinite(headroom)):
        raise PoolpipeError(f"headroom must be a share >= 0, such as 0.2; got {headroom}")
    if served.meta.get("graft"):
        return _advise_streams(
            served, profiles, rates, cluster, headroom, prices, nodes, idle_s, delivery
        )
    names = [m.name for m in served.models]
    unknown = sorted(set(rates) - set(names))
    if unknown:
        raise PoolpipeError(f"rates given for {unknown}, which the plan does not serve: {names}")
    missing = [n for n in names if n not in profiles]
    if missing:
        raise PoolpipeError(f"no profile for {missing}; onboard them (poolpipe onboard)")
    observed = _observed(names, rates)
    asked = {
        m.name: max(observed[m.name] * (1 + headroom), FLOOR_SHARE * m.throughput, 1e-3)
        for m in served.models
    }
    price, priced = _prices(cluster, prices)
    strategy = served.strategy if served.strategy in ("ppipe", "np") else "ppipe"
    req = PlanRequest(
        models=tuple(profiles[n] for n in names),
        weights=tuple(asked[n] / sum(asked.values()) for n in names),
        slos_us=tuple(m.slo_us for m in served.models),
        cluster=cluster,
        strategy=strategy,
        packing=served.packing,
        margin=served.margin if served.strategy in STRATEGIES else 0.4,
        max_partitions=max(1, served.max_partitions),
        count_inputs=served.counts_inputs,
        objective="cost",
        rates=tuple(asked[n] for n in names),
        prices=price,
        cost_alternatives=False,
        delivery="off" if delivery == "off" else "maximise",
    )
    plan: Plan | None = None
    why_not = None
    try:
        plan = make_plan(req)
    except InfeasibleError as exc:
        why_not = str(exc)
    deliverable = None
    if plan is not None:
        deliverable = {
            m.name: None if m.deliverable is None else float(m.deliverable) for m in plan.models
        }
    cost = None if plan is None else float(plan.meta.get("cost_per_hour", math.nan))
    return _advice(
        served, cluster, observed, asked, headroom, (price, priced), (plan, deliverable, cost),
        why_not, releasable_nodes(nodes, idle_s),
    )  # fmt: skip


def _observed(names: Sequence[str], rates: Mapping[str, float]) -> dict[str, float]:
    """Each name's rate (0 where not given); an error naming a bad one."""
    observed = {n: float(rates.get(n, 0.0)) for n in names}
    bad = [f"{n}={r}" for n, r in observed.items() if not (r >= 0 and math.isfinite(r))]
    if bad:
        raise PoolpipeError(f"rates must be req/s >= 0, got {', '.join(bad)}")
    return observed


def _prices(
    cluster: Cluster, prices: Mapping[str, float] | None
) -> tuple[dict[str, float], bool]:
    """Each GPU type's price per hour (given, else the cluster's) and whether every type
    has one (not: every GPU counted alike, 1 per hour)."""
    given = dict(prices or {})
    priced = all(p.gpu in given or p.price_per_hour is not None for p in cluster.pools)
    price = {p.gpu: given.get(p.gpu, p.price_per_hour or 1.0) for p in cluster.pools}
    return (price if priced else dict.fromkeys(price, 1.0)), priced


def profiled_models(plan: Plan) -> list[str]:
    """The warehouse's models a plan is planned again from: its models; a plan of entry
    streams, the models its streams enter (its own are their segments)."""
    if plan.meta.get("graft"):
        from poolpipe.planner.graft import streams_of

        return sorted({s.model for s in streams_of(plan.meta)})
    return [m.name for m in plan.models]


def _advise_streams(
    served: Plan,
    profiles: Mapping[str, ModelProfile],
    rates: Mapping[str, float],
    cluster: Cluster,
    headroom: float,
    prices: Mapping[str, float] | None,
    nodes: Sequence[Mapping[str, Any]],
    idle_s: float,
    delivery: str,
) -> Advice:
    """`advise` for a plan of entry streams (planner/graft.py): the load is each stream's
    rate (the entry mix with it); the streams planned again as the plan was made, the
    cheapest GPUs serving each at its rate x (1 + headroom), sized on what they deliver."""
    from poolpipe.planner.graft import replan_streams, streams_of

    streams = streams_of(served.meta)
    names = [s.name for s in streams]
    unknown = sorted(set(rates) - set(names))
    if unknown:
        raise PoolpipeError(f"rates given for {unknown}, which the plan has no stream of: {names}")
    missing = sorted({s.model for s in streams} - set(profiles))
    if missing:
        raise PoolpipeError(f"no profile for {missing}; onboard them (poolpipe onboard)")
    observed = _observed(names, rates)
    asked = {
        s.name: max(observed[s.name] * (1 + headroom), FLOOR_SHARE * s.rate, 1e-3)
        for s in streams
    }
    price, priced = _prices(cluster, prices)
    plan: Plan | None = None
    cost = None
    why_not = None
    sized = delivery != "off"
    try:
        gp = replan_streams(served, profiles, cluster, asked, prices=price, sized=sized)
        plan, cost = gp.document()[0], gp.cost_per_hour
    except InfeasibleError as exc:
        why_not = str(exc)
    # a sized plan keeps >= 99% of each stream on time at the rate asked
    deliverable = None if plan is None else {n: asked[n] if sized else None for n in names}
    return _advice(
        served, cluster, observed, asked, headroom, (price, priced), (plan, deliverable, cost),
        why_not, releasable_nodes(nodes, idle_s),
    )  # fmt: skip


def _advice(
    served: Plan,
    cluster: Cluster,
    observed: dict[str, float],
    asked: dict[str, float],
    headroom: float,
    prices: tuple[dict[str, float], bool],
    advised: tuple[Plan | None, dict[str, float | None] | None, float | None],
    why_not: str | None,
    releasable: list[dict[str, Any]],
) -> Advice:
    """The Advice of a plan planned for the load (`advised`: the plan, what it delivers,
    its cost per hour; None where the cluster cannot serve it, `why_not`) against `served`
    at `prices` (per GPU type, and whether they were known)."""
    plan, deliverable, cost = advised
    price, priced = prices
    return Advice(
        rates=observed,
        asked=asked,
        headroom=headroom,
        in_use=dict(served.gpus_used()),
        available={p.gpu: p.count for p in cluster.pools},
        needed=None if plan is None else dict(plan.gpus_used()),
        deliverable=deliverable,
        cost_per_hour=cost,
        served_cost_per_hour=float(
            sum(price.get(g, 1.0) * n for g, n in served.gpus_used().items())
        ),
        priced=priced,
        why_not=why_not,
        releasable=tuple(releasable),
        plan=plan,
    )


__all__ = ["HEADROOM", "IDLE_S", "Advice", "advise", "profiled_models", "releasable_nodes"]
