"""A planning request assembled from the warehouse: profiles, SLOs and the cluster by name
(and applications' specs checked against its models). Shared by the CLI and the `plan`
and `plan-apps` flows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from poolpipe.domain.apps import App, fastest_latencies, load_apps
from poolpipe.domain.cluster import Cluster, load_cluster
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import (
    DEFAULT_CALL_OVERHEAD_US,
    ModelProfile,
    ServedReference,
    served_reference,
)
from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest
from poolpipe.planner.apps import AppPlanRequest
from poolpipe.runtime.intake import DEFAULT_MARGIN_FLOOR_US, DEFAULT_REPLY_MARGIN_US
from poolpipe.store.warehouse import Warehouse


def plan_request(
    wh: Warehouse,
    models: Sequence[str],
    cluster: str | Cluster,
    *,
    clusters_file: Path | str | None = None,
    weights: Sequence[float] | None = None,
    slo_us: Mapping[str, float] | None = None,
    slo_scale: float | None = None,
    strategy: str = "ppipe",
    **options: Any,
) -> PlanRequest:
    """SLO per model: `slo_us[name]`, else `slo_scale` x its reference latency (a model
    onboarded here: as served, `served_references`), else the SLO stored with the model.
    `options` are the remaining PlanRequest fields."""
    names = list(models)
    profiles = tuple(wh.load_profile(n) for n in names)
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise PoolpipeError(f"{len(weights)} weights for {len(names)} models; give one each")
    explicit = dict(slo_us or {})
    for name in explicit:
        if name not in names:
            raise PoolpipeError(f"an SLO is given for {name!r}, which is not among {names}")
    slos = []
    refs = served_references(wh, profiles) if slo_scale is not None else {}
    for p in profiles:
        if p.name in explicit:
            slos.append(float(explicit[p.name]))
        elif slo_scale is not None:
            if p.name not in refs:
                raise PoolpipeError(
                    f"model {p.name} has no reference latency; give its SLO ({p.name}=µs)"
                )
            slos.append(refs[p.name].slo_us(slo_scale))
        elif p.slo_us:
            slos.append(p.slo_us)
        else:
            raise PoolpipeError(f"model {p.name} has no SLO; give an SLO scale or its SLO")
    return PlanRequest(
        models=profiles,
        weights=tuple(weights),
        slos_us=tuple(slos),
        cluster=resolve_cluster(wh, cluster, clusters_file),
        strategy=strategy,
        **options,
    )


def reply_margin_us(
    wh: Warehouse,
    given_us: float,
    floor_us: float,
    models: Sequence[str],
    any_model: bool = True,
) -> float:
    """The reply margin to reckon with: the one given, or a router's `floor_us` plus what a
    router serving `models` from this warehouse last measured beyond its floor (any model's
    where none served them, unless not `any_model`), where that is larger."""
    measured = wh.measured_reply_margin_us(models, any_model)
    return max(given_us, floor_us + measured) if measured is not None else given_us


def served_references(
    wh: Warehouse, profiles: Sequence[ModelProfile]
) -> dict[str, ServedReference]:
    """What an SLO scale multiplies, per model that has a reference latency
    (domain.profiles.served_reference): for a model onboarded here, its run plus the stage
    call and reply margin a router serving that model from this warehouse last measured,
    each at least its default (DEFAULT_CALL_OVERHEAD_US; DEFAULT_REPLY_MARGIN_US)."""
    out = {}
    for p in profiles:
        call = max(DEFAULT_CALL_OVERHEAD_US, wh.measured_call_overhead_us([p.name]) or 0.0)
        # (its own: another model's answers, 24 ms of a detector's, say nothing of its)
        reply = reply_margin_us(
            wh, DEFAULT_REPLY_MARGIN_US, DEFAULT_MARGIN_FLOOR_US, [p.name], any_model=False
        )
        ref = served_reference(p, call, reply)
        if ref is not None:
            out[p.name] = ref
    return out


def warehouse_apps(wh: Warehouse, spec: Path | str) -> tuple[list[App], dict[str, ModelProfile]]:
    """The applications of an apps.toml, checked against the warehouse's models (every one
    known, each SLO no shorter than its slowest path at its fastest), and the profile of
    every model the warehouse holds."""
    known = {n: wh.load_profile(n) for n in wh.model_names()}
    apps = load_apps(spec, known_models=known, fastest_us=fastest_latencies(known.values()))
    return apps, known


def apps_request(
    wh: Warehouse,
    spec: Path | str,
    cluster: str | Cluster,
    *,
    clusters_file: Path | str | None = None,
    **options: Any,
) -> AppPlanRequest:
    """The applications of an apps.toml planned on `cluster` (a name, from
    `clusters_file` or the warehouse, or a Cluster); `options` are the remaining
    AppPlanRequest fields."""
    apps, known = warehouse_apps(wh, spec)
    used = {m for a in apps for m in a.models}
    return AppPlanRequest(
        tuple(apps),
        {m: known[m] for m in used},
        resolve_cluster(wh, cluster, clusters_file),
        **options,
    )


def resolve_cluster(
    wh: Warehouse, cluster: str | Cluster, clusters_file: Path | str | None = None
) -> Cluster:
    """A cluster as given (e.g. from an inventory of nodes), or by name from `clusters_file`,
    else from the warehouse."""
    if isinstance(cluster, Cluster):
        return cluster
    if clusters_file:
        return load_cluster(Path(clusters_file), cluster)
    return wh.load_cluster(cluster)


def check_plan(
    wh: Warehouse, plan: Plan, where: str = "the plan", plan_id: int | None = None
) -> Plan:
    """`plan` if it can be served or simulated: every model profiled in the warehouse, and
    every constraint re-derived from the profiles (Plan.verify: blocks 0..B contiguous,
    shares and batch sizes profiled, GPUs per type within the cluster, latencies within
    the SLO, throughputs within capacity); else a PlanVerificationError naming `where`.
    A stored plan (`plan_id`) whose models were onboarded again after it was made is
    refused naming them. Call it before storing or starting anything."""
    from poolpipe.errors import PlanVerificationError

    outdated = wh.outdated_models(plan_id) if plan_id is not None else []
    if outdated:
        model, when = outdated[0]
        raise PlanVerificationError(
            f"{where} was made for an earlier onboarding of {model!r} (onboarded again "
            f"{when:%Y-%m-%d %H:%M:%S}, whose blocks and latencies may differ); plan again "
            "(poolpipe plan ...) and serve the new plan"
        )

    known = set(wh.model_names())
    base = warehouse_models(plan)
    missing = [m.name for m in plan.models if base[m.name] not in known]
    if missing:
        raise PlanVerificationError(
            f"{where} serves {missing}, which warehouse {wh.path} has no profiles of; "
            "onboard or import them first"
        )
    profiles = served_profiles(wh, plan)
    try:
        plan.verify(profiles)
    except PlanVerificationError as e:
        raise PlanVerificationError(f"{where}: {e}") from None
    return plan


def warehouse_models(plan: Plan) -> dict[str, str]:
    """Each plan model's model in the warehouse: itself, the model an application's part
    is (domain.apps.base_models), or the model a segment is blocks of (plan_segments)."""
    from poolpipe.domain.apps import base_models
    from poolpipe.domain.entry import plan_segments

    base = base_models(plan.meta)
    segments = plan_segments(plan.meta)
    return {
        m.name: segments[m.name].model if m.name in segments else base.get(m.name, m.name)
        for m in plan.models
    }


def served_profiles(wh: Warehouse, plan: Plan) -> dict[str, ModelProfile]:
    """The profile of each plan model under its plan name (warehouse_models'; a segment's
    cut out of its model's: domain.entry.segment)."""
    from dataclasses import replace

    from poolpipe.domain.entry import plan_segments, segment

    segments = plan_segments(plan.meta)
    out = {}
    for m, model in warehouse_models(plan).items():
        profile = wh.load_profile(model)
        if m in segments:
            profile = segment(profile, segments[m].start, segments[m].end)
        out[m] = replace(profile, name=m)
    return out
