"""Plan: warehouse profiles + cluster + SLOs + workload mix → MILP → stored plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import artifact_key, io_error_only, markdown_table
from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.apps import AppPlanRequest
from poolpipe.planner.solvers import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S
from poolpipe.store.plan_inputs import plan_request
from poolpipe.store.warehouse import Warehouse


@task(name="load-request", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def load_request(
    warehouse: str | None,
    models: list[str],
    cluster: str | Cluster,
    clusters_file: str | None,
    weights: list[float] | None,
    slo_ms: dict[str, float] | None,
    slo_scale: float | None,
    options: dict[str, Any],
) -> PlanRequest:
    with Warehouse.open(warehouse) as wh:
        return plan_request(
            wh,
            models,
            cluster,
            clusters_file=clusters_file,
            weights=weights,
            slo_us={k: v * 1e3 for k, v in (slo_ms or {}).items()},
            slo_scale=slo_scale,
            **options,
        )


@task(name="solve", cache_policy=NO_CACHE)
def solve(request: PlanRequest) -> Plan:
    return make_plan(request)


@task(name="store-plan", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def store_plan(warehouse: str | None, plan: Plan, label: str | None) -> int:
    with Warehouse.open(warehouse) as wh:
        return wh.store_plan(plan, label=label)


def _target(cluster: str | None, inventory: str | None) -> str | Cluster:
    """A cluster's name, or the cluster of an inventory's live nodes: one of them."""
    if (cluster is None) == (inventory is None):
        raise PoolpipeError("give cluster (a name) or inventory (a file), one of them")
    if inventory is not None:
        from poolpipe.domain.inventory import load_inventory

        return load_inventory(inventory).cluster()
    assert cluster is not None
    return cluster


@flow(name="plan", log_prints=True)
def plan_models(
    models: list[str],
    cluster: str | None = None,
    warehouse: str | None = None,
    clusters_file: str | None = None,
    weights: list[float] | None = None,
    slo_ms: dict[str, float] | None = None,
    slo_scale: float | None = None,
    strategy: str = "ppipe",
    packing: str = "per-share",
    margin: float = 0.4,
    max_partitions: int = 2,
    solver: str = "highs",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_gap: float = DEFAULT_MIP_GAP,
    label: str | None = None,
    out: str | None = None,
    inventory: str | None = None,
) -> int:
    """Plan MODELS on CLUSTER (a name, from CLUSTERS_FILE or the warehouse), or on the live
    nodes of INVENTORY (an inventory TOML file on the worker), from the warehouse's
    profiles; store the plan (and write it to OUT as JSON when given). Returns the plan id.
    The options are `poolpipe plan`'s:
    STRATEGY (ppipe, np, dart-r), PACKING (per-share, per-position), MARGIN (fraction of
    the SLO held back), MAX_PARTITIONS, SOLVER (highs, gurobi), TIME_LIMIT_S per MILP,
    MIP_GAP (relative)."""
    warehouse = worker.warehouse(warehouse)
    options = {
        "strategy": strategy,
        "packing": packing,
        "margin": margin,
        "max_partitions": max_partitions,
        "solver": solver,
        "time_limit_s": time_limit_s,
        "mip_gap": mip_gap,
        "leave_out": True,  # models the cluster cannot serve beside the others: named
    }
    target = _target(cluster, inventory)
    request = load_request(
        warehouse, models, target, clusters_file, weights, slo_ms, slo_scale, options
    )
    plan = solve(request)
    unserved = list(plan.meta.get("unserved") or [])
    plan_id = store_plan(warehouse, plan, label)
    if out:
        plan.save(Path(out))
    rows = []
    for m in plan.models:
        for i, p in enumerate(m.pipelines):
            parts = " → ".join(
                f"[{q.start},{q.end}) {q.gpu}/{q.share}×{q.vgpus}" for q in p.partitions
            )
            rows.append([m.name if i == 0 else "", f"{p.throughput:,.1f}", p.batch, parts])
    create_markdown_artifact(
        key=artifact_key("plan", plan.cluster.name, strategy),
        description=f"plan {plan_id}: {strategy} on {plan.cluster.name}",
        markdown=f"# plan {plan_id}: {strategy} on {plan.cluster.name}, "
        f"objective {plan.objective:,.2f}\n\n"
        + markdown_table(["model", "req/s", "batch", "partitions"], rows)
        + (f"\n\n**Not served**: {', '.join(unserved)}" if unserved else ""),
    )
    if unserved:
        print(
            f"plan {plan_id} leaves out {', '.join(unserved)}: cluster {plan.cluster.name} "
            "cannot hold a pipeline of every model at its SLO at once"
        )
    return plan_id


@task(name="load-apps-request", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def load_apps_request(
    warehouse: str | None,
    spec: str,
    cluster: str | Cluster,
    clusters_file: str | None,
    options: dict[str, Any],
) -> AppPlanRequest:
    from poolpipe.store.plan_inputs import apps_request

    with Warehouse.open(warehouse) as wh:
        return apps_request(wh, spec, cluster, clusters_file=clusters_file, **options)


@task(name="solve-apps", cache_policy=NO_CACHE)
def solve_apps(
    request: AppPlanRequest, delivery: str = "maximise"
) -> tuple[Plan, dict[str, float]]:
    """The split kept as a plan document, and what each split serves (req/s per unit of
    weight of the least served application). `delivery` "maximise": each split's plan
    stated with what it delivers and the one that delivers most kept; "state": the joint
    split (started from Nexus's plan), stated; "off": the joint split, fluid figures only."""
    from poolpipe.planner.apps import SPLITS, app_plan_document, choose_apps, plan_apps

    plans = {s: plan_apps(request, s) for s in SPLITS[1:]}
    plans["joint"] = plan_apps(request, start=plans["nexus"])
    served = {s: p.objective for s, p in plans.items()}
    if delivery == "off":
        return app_plan_document(request, plans["joint"])[0], served
    chosen, docs = choose_apps(request, plans, delivery)
    return docs[chosen], served


@flow(name="plan-apps", log_prints=True)
def plan_applications(
    spec: str,
    cluster: str | None = None,
    warehouse: str | None = None,
    clusters_file: str | None = None,
    inventory: str | None = None,
    grid: int = 10,
    margin: float = 0.4,
    max_partitions: int = 2,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    label: str | None = None,
    out: str | None = None,
    count_inputs: bool = False,
    delivery: str = "maximise",
) -> int:
    """Plan the applications of SPEC (an apps.toml on the worker) on CLUSTER (a name) or
    the live nodes of INVENTORY: each model's latency budget chosen with the pooled
    pipelines (the joint split, docs/apps.md), beside the equal, proportional and Nexus
    splits; store the plan of the split that delivers most (DELIVERY "maximise"; "state":
    the joint split's, stated; "off": the joint split's, not simulated) and write it to
    OUT as JSON when given, which `poolpipe serve` serves. Returns the plan id. GRID:
    budgets per model; MARGIN: share of a budget held back; TIME_LIMIT_S per MILP;
    COUNT_INPUTS: each part's request inputs counted on its first server's NIC."""
    warehouse = worker.warehouse(warehouse)
    target = _target(cluster, inventory)
    options = {
        "grid": grid,
        "margin": margin,
        "max_partitions": max_partitions,
        "time_limit_s": time_limit_s,
        "count_inputs": count_inputs,
    }
    request = load_apps_request(warehouse, spec, target, clusters_file, options)
    if delivery not in ("maximise", "state", "off"):
        raise PoolpipeError(f"delivery: 'maximise', 'state' or 'off', not {delivery!r}")
    plan, served = solve_apps(request, delivery)
    plan_id = store_plan(warehouse, plan, label)
    if out:
        plan.save(Path(out))
    rows = [
        [app, m, f"{rec['budgets_us'][m] / 1e3:.1f}", f"{rec['planned_budgets_us'][m] / 1e3:.1f}"]
        for app, rec in plan.meta["apps"].items()
        for m in rec["models"]
    ]
    create_markdown_artifact(
        key=artifact_key("plan-apps", plan.cluster.name, "joint"),
        description=f"plan {plan_id}: applications on {plan.cluster.name}",
        markdown=f"# plan {plan_id}: applications on {plan.cluster.name}\n\n"
        + f"the {plan.meta['split']} split"
        + (
            f", which delivers {plan.meta['apps_deliverable']:,.1f} req/s per weight with "
            ">= 99% on time (simulated)"
            if plan.meta.get("apps_deliverable") is not None
            else ""
        )
        + "\n\n"
        + markdown_table(
            ["split", "req/s per weight"], [[s, f"{v:,.1f}"] for s, v in served.items()]
        )
        + "\n\n"
        + markdown_table(["application", "model", "budget ms", "planned ms"], rows),
    )
    return plan_id
