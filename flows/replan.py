"""Re-planning, nightly and after GPU loss: the request mix observed by the router
(warehouse) → plan for the GPUs in service → roll out only when the new plan's objective
beats the serving plan's, for that mix, by a margin. Nodes the router has taken out of
service (failed, not back) are left out of the new plan, and the serving plan is judged by
what it still serves without them: the router can trigger this flow when a node stays down
(`poolpipe serve --replan-on-failure`), and when the load leaves the serving plan's envelope
(`poolpipe serve --prefect-events`: an event that prefect.yaml's load-replan trigger turns
into a run of `load_replan`)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import artifact_key, io_error_only, markdown_table
from poolpipe.domain.cluster import Cluster
from poolpipe.domain.inventory import Inventory
from poolpipe.domain.plan import STRATEGIES, Plan, dilated, time_scale, undilated, watched_load
from poolpipe.errors import PoolpipeError
from poolpipe.planner import make_plan
from poolpipe.planner.advise import Advice, advise, profiled_models, undilated_load
from poolpipe.planner.replan import objective_under, observed_weights, worth_rolling_out
from poolpipe.runtime.envelope import EnvelopeEvent
from poolpipe.store.plan_inputs import plan_request, resolve_cluster
from poolpipe.store.warehouse import Warehouse


@task(name="observed-mix", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def observed_mix(warehouse: str | None, deployment: str, hours: float) -> dict[str, float]:
    since = datetime.now() - timedelta(hours=hours)
    with Warehouse.open(warehouse) as wh:
        rows = wh.con.execute(
            "SELECT model, sum(arrivals) FROM serving_stats WHERE deployment = ? "
            "AND minute >= ? GROUP BY model",
            [deployment, since],
        ).fetchall()
    return {m: float(n) for m, n in rows}


@task(name="serving-plan", cache_policy=NO_CACHE)
def serving_plan(router: str, token_file: str | None = None) -> tuple[Plan, int | None]:
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    answer = send_control(router, {"op": "plan"}, token=token_from(token_file))
    if not answer.get("ok"):
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")
    return Plan.from_dict(answer["plan"]), answer.get("plan_id")


@task(name="router-health", cache_policy=NO_CACHE)
def router_health(router: str, token_file: str | None = None) -> dict:
    """The nodes the router has taken out of service and what each model's plan still
    serves without them (req/s)."""
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    answer = send_control(router, {"op": "health"}, token=token_from(token_file))
    if not answer.get("ok"):
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")
    return answer


@task(name="router-inventory", cache_policy=NO_CACHE)
def router_inventory(router: str, token_file: str | None = None) -> dict:
    """What the router serves on: its deployment name and its inventory (TOML: every node
    it attached to, or started), as it answers its control command."""
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    answer = send_control(router, {"op": "inventory"}, token=token_from(token_file))
    if not answer.get("ok"):
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")
    return answer


def surviving_cluster(
    wh: Warehouse,
    cluster: str | None,
    clusters_file: str | None,
    inventory: str | Inventory | None,
    down: list[dict],
    scale: float = 1.0,
) -> Cluster:
    """The cluster to plan for: the inventory's nodes (a file, or the router's own) less
    those down, or the named cluster (from `clusters_file`, else the warehouse) less as
    many GPUs of each type as are down. `scale`: the time scale of the plan served (an
    emulated cluster's NICs are that much slower than its inventory's servers would be)."""
    if inventory:
        from poolpipe.domain.inventory import load_inventory

        inv = load_inventory(inventory) if isinstance(inventory, str) else inventory
        found = inv.mark_down({d["node"] for d in down}).cluster()
        if scale == 1:
            return found
        return dataclasses.replace(found, bandwidth_gbps=found.bandwidth_gbps * scale)
    if not cluster:
        raise PoolpipeError("give the cluster (name) or the inventory (file) to plan for")
    whole = resolve_cluster(wh, cluster, clusters_file)
    return whole.without(dict(Counter(d["device"] for d in down))) if down else whole


@task(name="plan", cache_policy=NO_CACHE)
def new_plan(
    warehouse: str | None,
    current: Plan,
    weights: list[float],
    cluster: str | None,
    clusters_file: str | None,
    inventory: str | Inventory | None = None,
    down: list[dict] | None = None,
    shares: dict[str, float] | None = None,
) -> Plan:
    """The serving plan planned again for the mix seen (`weights` per model; for an
    application plan, `shares` per application) on the GPUs in service. A plan served at
    a time scale (emulated GPU nodes: docs/design/emulation.md) is planned undilated and
    comes back at the same scale."""
    if current.meta.get("graft"):
        raise PoolpipeError(
            "the serving plan is a plan of entry streams (poolpipe graft plan), planned for "
            "cost: the load-replan flow's cost objective (objective=cost) follows its "
            "streams' rates; the max-min re-plan does not apply to it"
        )
    d = time_scale(current)
    current = undilated(current)
    if shares is not None:  # an application plan: its applications planned again
        from poolpipe.domain.apps import base_models
        from poolpipe.planner.apps import replan_apps

        with Warehouse.open(warehouse) as wh:
            survivors = surviving_cluster(wh, cluster, clusters_file, inventory, down or [], d)
            profiles = {m: wh.load_profile(m) for m in set(base_models(current.meta).values())}
        return _at_scale(replan_apps(current, profiles, survivors, shares), d)
    with Warehouse.open(warehouse) as wh:
        req = plan_request(
            wh,
            [m.name for m in current.models],
            surviving_cluster(wh, cluster, clusters_file, inventory, down or [], d),
            weights=weights,
            slo_us={m.name: m.slo_us for m in current.models},
            # a plan written by hand is re-planned as PPipe would plan it
            strategy=current.strategy if current.strategy in STRATEGIES else "ppipe",
            packing=current.packing,
            margin=current.margin if current.strategy in STRATEGIES else 0.4,
            max_partitions=current.max_partitions,
            count_inputs=current.counts_inputs,
        )
    # the serving plan, fitted to the GPUs in service, is where the search starts
    return _at_scale(make_plan(dataclasses.replace(req, warm_start=current)), d)


def _at_scale(plan: Plan, d: float) -> Plan:
    return plan if d == 1 else dilated(plan, d)


@task(name="store-plan", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def store(warehouse: str | None, plan: Plan) -> int:
    with Warehouse.open(warehouse) as wh:
        return wh.store_plan(plan, label="nightly-replan")


def _roll_out(
    warehouse: str | None, router: str, plan: Plan, token_file: str | None
) -> tuple[dict, str]:
    """`plan` stored and rolled out to the router: what the decision records of it, and
    why it was not rolled out ("" where it was)."""
    from flows.rollout import switch

    plan_id = store(warehouse, plan)
    result = switch(router, plan_id, token_file)
    failed = ""
    if not result.get("ok"):
        failed = (
            f"plan {plan_id} was not rolled out ({result.get('status') or 'error'}): "
            f"{result.get('reason') or result.get('error')}"
        )
    return {"rolled_out": bool(result.get("ok")), "plan_id": plan_id, **result}, failed


def _decision_artifact(deployment: str, trigger: str, decision: dict) -> None:
    """A re-planning decision as the run's artifact (the deployment's latest)."""
    create_markdown_artifact(
        key=artifact_key("replan", deployment),
        description=f"re-planning decision ({trigger})",
        markdown=f"# re-planning ({trigger})\n\n"
        + markdown_table(["", ""], [[k, v] for k, v in decision.items()]),
    )


@flow(name="nightly-replan", log_prints=True)
def nightly_replan(
    cluster: str | None = None,
    router: str | None = None,
    warehouse: str | None = None,
    clusters_file: str | None = None,
    deployment: str | None = None,
    hours: float = 24.0,
    margin: float = 0.05,
    token_file: str | None = None,
    inventory: str | None = None,
    trigger: str = "nightly",
) -> dict:
    """Re-plan for the mix the router saw in the last HOURS, for the GPUs in service of the
    nodes the router serves on (its own inventory; or of the INVENTORY file, or of the
    named CLUSTER, where given); roll out when better by MARGIN than what the serving plan
    still serves. ROUTER: its gRPC host:port (default $POOLPIPE_ROUTER of the worker);
    TOKEN_FILE: the router's token (default $POOLPIPE_TOKEN_FILE of the worker);
    DEPLOYMENT: whose traffic counts (default: the router's own name, serve --name).
    TRIGGER: what started the run (shown). A rollout that does not happen (rolled back,
    refused) fails the run, with the reason."""
    router, warehouse = worker.router(router), worker.warehouse(warehouse)
    target: str | Inventory | None = inventory
    if deployment is None or (cluster is None and inventory is None):
        served = router_inventory(router, token_file)
        deployment = deployment or served["deployment"]
        if cluster is None and inventory is None:
            from poolpipe.domain.inventory import parse_inventory

            target = parse_inventory(
                tomllib.loads(served["inventory"]), f"the inventory of router {router}"
            )
    assert deployment is not None
    current, current_id = serving_plan(router, token_file)
    health = router_health(router, token_file)
    down = health.get("down", [])
    names = [m.name for m in current.models]
    mix = observed_mix(warehouse, deployment, hours)
    shares = None
    if current.meta.get("apps"):  # applications: their mix, seen at their entry models
        from poolpipe.planner.apps import observed_app_shares, part_weights

        shares = observed_app_shares(current.meta, mix)
        if shares is None and down:
            shares = {a: r["weight"] for a, r in current.meta["apps"].items()}
        weights = None if shares is None else part_weights(current.meta, shares, names)
    else:
        weights = observed_weights(mix, names)
    if weights is None and down:
        weights = [m.weight for m in current.models]  # GPUs lost: re-plan for the plan's mix
    decision: dict = {"trigger": trigger, "down": ", ".join(d["node"] for d in down) or "none"}
    failed = ""
    if weights is None:
        decision |= {"rolled_out": False, "why": f"no requests in the last {hours:g} h"}
    else:
        candidate = new_plan(
            warehouse, current, weights, cluster, clusters_file, target, down, shares
        )
        # compared by what they deliver where both state it, else by their fluid figures
        both_stated = current.deliverable is not None and candidate.deliverable is not None
        if down:  # what the serving plan still serves on the nodes in service
            live = health["live_throughput"]
            old_obj = min(live[m] / w for m, w in zip(names, weights, strict=True))
        else:
            old_obj = objective_under(current, names, weights, both_stated)
        new_obj = objective_under(candidate, names, weights, both_stated)
        decision |= {
            "weights": dict(zip(names, weights, strict=True)),
            "serving_objective": old_obj,
            "new_objective": new_obj,
            # the serving plan fitted to the GPUs in service, where the search started
            "warm_start_objective": candidate.meta.get("warm_start_objective"),
            "rolled_out": False,
        }
        if worth_rolling_out(old_obj, new_obj, margin):
            rolled, failed = _roll_out(warehouse, router, candidate, token_file)
            decision |= rolled
        else:
            decision["why"] = f"not better than plan {current_id} by more than {margin:.0%}"
    _decision_artifact(deployment, trigger, decision)
    if failed:  # the run ends Failed in Prefect, saying why
        raise PoolpipeError(failed)
    return decision


# the Prefect events a router sends when the load leaves its plan's envelope:
# poolpipe.load.above | .below | .mix (prefect.yaml's load-replan trigger expects them)
LOAD_EVENT = "poolpipe.load"


def load_event_emitter(deployment: str) -> Callable[[str, EnvelopeEvent], None]:
    """What `poolpipe serve --prefect-events` calls at each envelope event of the router
    (triton_backend.deploy.envelope.LoadWatch): a Prefect event `poolpipe.load.<kind>` on
    the resource `poolpipe.router.<deployment>` to the API at $PREFECT_API_URL, the
    router's gRPC address and what happened in its payload."""

    def emit(router: str, e: EnvelopeEvent) -> None:
        from prefect.events import emit_event

        def per_model(values: tuple[float, ...]) -> dict[str, float]:
            return {m: round(v, 4) for m, v in zip(e.models, values, strict=True)}

        emit_event(
            event=f"{LOAD_EVENT}.{e.kind}",
            resource={
                "prefect.resource.id": f"poolpipe.router.{deployment}",
                "prefect.resource.name": deployment,
            },
            payload={
                "router": router,
                "kind": e.kind,
                "why": e.why,
                "rates": per_model(e.rates),
                "deliverable": per_model(e.deliverable),
                "mix": per_model(e.mix),
                "planned_mix": per_model(e.planned_mix),
            },
        )

    return emit


@task(name="last-rollout", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def last_rollout(warehouse: str | None, deployment: str) -> datetime | None:
    """When a plan was last rolled out to `deployment` (done), or None."""
    with Warehouse.open(warehouse) as wh:
        row = wh.con.execute(
            "SELECT max(rolled_at) FROM rollouts WHERE deployment = ? AND status = 'done'",
            [deployment],
        ).fetchone()
    return row[0] if row else None


@task(name="router-status", cache_policy=NO_CACHE)
def router_status(router: str, token_file: str | None = None) -> dict:
    """The router's status: its nodes (state, batches, idle time) and its load's rates."""
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from

    answer = send_control(router, {"op": "status"}, token=token_from(token_file))
    if not answer.get("ok", True) or "nodes" not in answer:
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")
    return answer


@task(name="advise", cache_policy=NO_CACHE)
def advise_plan(
    warehouse: str | None,
    current: Plan,
    status: dict,
    cluster: Cluster,
    headroom: float,
    prices: dict[str, float] | None,
    windows: tuple[str, ...] = ("60s", "300s"),
) -> Advice:
    """The cheapest GPUs of `cluster` for each model's largest rate over `windows` (the
    router's status) x (1 + headroom): planner/advise.py. `current` is planned at time
    scale 1 (`undilated`) and the rates x its time scale with it; the advice's plan is
    served at the time scale of `current`."""
    load = (status.get("load") or {}).get("models") or {}
    for m in load.values():
        missing = [w for w in windows if w not in m["req_s"]]
        if missing:
            raise PoolpipeError(
                f"the router keeps no rate over {', '.join(missing)} (it keeps "
                f"{', '.join(m['req_s'])}): give rate_windows from those"
            )
    rates = {n: max(float(m["req_s"][w]) for w in windows) for n, m in load.items()}
    current, rates = undilated_load(current, rates)
    with Warehouse.open(warehouse) as wh:
        profiles = {m: wh.load_profile(m) for m in profiled_models(current)}
    return advise(
        current, profiles, rates, cluster, headroom=headroom, prices=prices,
        nodes=status.get("nodes", ()),
    )  # fmt: skip


@task(name="publish-advice", cache_policy=NO_CACHE)
def publish_advice(router: str, a: Advice, token_file: str | None = None) -> None:
    """Tell the router what the load needs (its gauges poolpipe_gpus_needed and
    poolpipe_gpus_needed_headroom: what an autoscaler acts on)."""
    from poolpipe.client import send_control
    from poolpipe.client.control import token_from
    from poolpipe.planner.advise import published

    answer = send_control(
        router, {"op": "advice", "advice": published(a)}, token=token_from(token_file)
    )
    if not answer.get("ok"):
        raise PoolpipeError(f"router {router}: {answer.get('error', answer)}")


@flow(name="load-replan", log_prints=True)
def load_replan(
    router: str | None = None,
    event: str = LOAD_EVENT,
    why: str = "",
    hours: float = 0.25,
    margin: float = 0.05,
    min_interval_s: float = 1800.0,
    warehouse: str | None = None,
    token_file: str | None = None,
    inventory: str | None = None,
    cluster: str | None = None,
    clusters_file: str | None = None,
    objective: str = "maxmin",
    headroom: float = 0.2,
    shrink: float = 0.1,
    prices: dict[str, float] | None = None,
    rate_windows: list[str] | None = None,
) -> dict:
    """Re-plan because the load left the serving plan's envelope (EVENT, WHY: the router's
    Prefect event, through prefect.yaml's load-replan trigger); not at all where a plan was
    rolled out to the router's deployment less than MIN_INTERVAL_S ago (no flapping).
    OBJECTIVE "maxmin": nightly-replan on the mix of the last HOURS, rolled out when better
    by MARGIN. "cost" (capacity that follows the load): the cheapest GPUs of the inventory
    (or CLUSTER) that serve the router's rates x (1 + HEADROOM) (`poolpipe advise`; PRICES
    per GPU-hour, else 1 per GPU), rolled out on a rise or a mix shift, where it needs GPUs
    of a type the serving plan lacks, or where it saves SHRINK of the cost
    (planner/follow.py's judge); where the GPUs offered cannot serve the rates, the max-min
    re-plan. RATE_WINDOWS: the router's windows a model's rate is read over, the largest
    counts (default 60s and 300s: the envelope's short and long windows)."""
    router, warehouse = worker.router(router), worker.warehouse(warehouse)
    if objective not in ("maxmin", "cost"):
        raise PoolpipeError(f"objective must be maxmin or cost, got {objective!r}")
    rate_windows = list(rate_windows or ("60s", "300s"))
    served = router_inventory(router, token_file)
    deployment = served["deployment"]
    last = last_rollout(warehouse, deployment)
    ago = None if last is None else (datetime.now() - last).total_seconds()
    if ago is not None and ago < min_interval_s:
        decision = {
            "trigger": f"{event}: {why}",
            "rolled_out": False,
            "why": f"a plan was rolled out {ago:.0f} s ago; at most one re-plan per "
            f"{min_interval_s:g} s",
        }
        _decision_artifact(deployment, event, decision)
        return decision
    if objective == "cost":
        followed = _follow_load(
            router, warehouse, deployment, served, event, why, headroom, shrink, prices,
            token_file, inventory, cluster, clusters_file, rate_windows,
        )  # fmt: skip
        if followed is not None:
            return followed
    return nightly_replan(
        cluster=cluster,
        router=router,
        warehouse=warehouse,
        clusters_file=clusters_file,
        deployment=deployment,
        hours=hours,
        margin=margin,
        token_file=token_file,
        inventory=inventory,
        trigger=f"{event}: {why}",
    )


def _follow_load(
    router: str,
    warehouse: str | None,
    deployment: str,
    served: dict,
    event: str,
    why: str,
    headroom: float,
    shrink: float,
    prices: dict[str, float] | None,
    token_file: str | None,
    inventory: str | None,
    cluster: str | None,
    clusters_file: str | None,
    rate_windows: list[str],
) -> dict | None:
    """load_replan's cost objective; None where the GPUs offered cannot serve the load (the
    caller re-plans max-min)."""
    from poolpipe.domain.inventory import parse_inventory
    from poolpipe.planner.follow import judge, short_of

    current, current_id = serving_plan(router, token_file)
    status = router_status(router, token_file)
    down = router_health(router, token_file).get("down", [])
    target: str | Inventory | None = inventory
    if cluster is None and inventory is None:
        target = parse_inventory(
            tomllib.loads(served["inventory"]), f"the inventory of router {router}"
        )
    d = time_scale(current)
    with Warehouse.open(warehouse) as wh:
        offered = surviving_cluster(wh, cluster, clusters_file, target, down, d)
    a = advise_plan(warehouse, current, status, offered, headroom, prices, tuple(rate_windows))
    publish_advice(router, a, token_file)
    trigger = f"{event}: {why}"
    decision: dict = {
        "trigger": trigger,
        "objective": "cost",
        "rates": a.rates,
        "in_use": a.in_use,
        "needed": a.needed,
        "releasable": ", ".join(n["node"] for n in a.releasable) or "none",
        "rolled_out": False,
    }
    if a.plan is None or a.cost_per_hour is None:
        print(f"the GPUs offered cannot serve the load ({a.why_not}); re-planning max-min")
        return None
    kind = event.rsplit(".", 1)[-1]
    stated = watched_load(undilated(current))  # per model (per entry stream)
    short = short_of({n: d for n, (d, _) in stated.items()}, a.asked)
    roll, reason = judge(
        kind, why, a.cost_per_hour, a.needed or {}, a.served_cost_per_hour, a.in_use,
        shrink, short,
    )  # fmt: skip
    decision |= {
        "cost_per_hour": a.cost_per_hour,
        "serving_cost_per_hour": a.served_cost_per_hour,
        "why": reason,
    }
    failed = ""
    if roll:
        rolled, failed = _roll_out(warehouse, router, _at_scale(a.plan, d), token_file)
        decision |= rolled
    else:
        decision["why"] = f"{reason}; plan {current_id} stays"
    _decision_artifact(deployment, event, decision)
    if failed:
        raise PoolpipeError(failed)
    return decision


def on_failure(**params: Any) -> Callable[[str, str], dict]:
    """What `poolpipe serve --replan-on-failure` calls when its nodes out of service have
    changed (triton_backend.deploy.serving.ServingProcess): this flow, run in the serving
    process, with `params` (inventory or cluster, warehouse, deployment, token_file, margin,
    ...), the router's address and what happened."""

    def replan(router: str, trigger: str) -> dict:
        return nightly_replan(router=router, trigger=trigger, **params)

    return replan


@flow(name="reshard", log_prints=True)
def reshard(
    router: str,
    inventory: str,
    trigger: str,
    warehouse: str | None = None,
    token_file: str | None = None,
) -> dict:
    """Re-plan a router of a router tier for its new shard, the nodes of INVENTORY (a file:
    nodes adopted from a router gone, or handed back to one that came back), for the mix of
    its serving plan, and roll it out by pipeline flush whatever its objective: the shard
    changed, so must the plan. TRIGGER: what changed (shown). A rollout that does not
    happen fails the run, with the reason."""
    from flows.rollout import switch
    from poolpipe.domain.inventory import load_inventory

    warehouse = worker.warehouse(warehouse)
    current, current_id = serving_plan(router, token_file)
    shard = load_inventory(inventory)
    down = router_health(router, token_file).get("down", [])
    names = [m.name for m in current.models]
    weights = [m.weight for m in current.models]
    candidate = new_plan(warehouse, current, weights, None, None, shard, down)
    both_stated = current.deliverable is not None and candidate.deliverable is not None
    plan_id = store(warehouse, candidate)
    result = switch(router, plan_id, token_file)
    decision: dict = {
        "trigger": trigger,
        "nodes": ", ".join(n.name for n in shard.nodes),
        "down": ", ".join(d["node"] for d in down) or "none",
        "from_plan": current_id,
        "serving_objective": objective_under(current, names, weights, both_stated),
        "new_objective": objective_under(candidate, names, weights, both_stated),
        "rolled_out": bool(result.get("ok")),
        "plan_id": plan_id,
        **result,
    }
    create_markdown_artifact(
        key=artifact_key("reshard", Path(inventory).stem),
        description=f"re-shard ({trigger})",
        markdown=f"# re-shard ({trigger})\n\n"
        + markdown_table(["", ""], [[k, v] for k, v in decision.items()]),
    )
    if not result.get("ok"):
        raise PoolpipeError(
            f"plan {plan_id} for the new shard was not rolled out "
            f"({result.get('status') or 'error'}): {result.get('reason') or result.get('error')}"
        )
    return decision


# How much lower the reshard flow's process runs than the router that starts it (nice).
FLOW_NICE = 10


def on_reshard(isolated: bool = True, **params: Any) -> Callable[[str, str, str], dict]:
    """What a router of a router tier calls when its shard changes
    (triton_backend.deploy.serving.ServingProcess): the reshard flow with `params` (warehouse,
    token_file), the router's address, its new shard's inventory file and what happened.
    `isolated`: in a process of its own (flows.replan as __main__, on the Prefect API the
    router uses, FLOW_NICE lower in CPU priority), so that planning, and Prefect's local
    API where no PREFECT_API_URL is set (started and stopped with that process), take
    nothing from the router's runtime thread (they share its interpreter otherwise) and
    little of its host's CPU while its batches need it; False: in the calling thread."""

    def run(router: str, inventory: str, trigger: str) -> dict:
        what = {"router": router, "inventory": inventory, "trigger": trigger, **params}
        if not isolated:
            return reshard(**what)
        import os
        import subprocess
        import sys

        from prefect.settings import PREFECT_API_URL

        env = dict(os.environ)
        if PREFECT_API_URL.value():
            env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
        # at a lower CPU priority from its first import on: planning is background work,
        # the router's batches on the same host are not
        start = (
            f"import os, runpy; os.nice({FLOW_NICE}); "
            "runpy.run_module('flows.replan', run_name='__main__', alter_sys=True)"
        )
        done = subprocess.run(
            [sys.executable, "-c", start, json.dumps(what)],
            capture_output=True,
            text=True,
            env=env,
        )
        last = done.stdout.strip().splitlines()[-1:] or [""]
        try:
            answer = json.loads(last[0])
        except json.JSONDecodeError:
            tail = " ".join((done.stderr or done.stdout).split()[-40:])
            raise PoolpipeError(
                f"the reshard flow ended with code {done.returncode}: {tail}"
            ) from None
        if "error" in answer:
            raise PoolpipeError(answer["error"])
        return answer

    return run


if __name__ == "__main__":  # on_reshard's process: the parameters in, the decision out
    import sys

    try:
        decision = reshard(**json.loads(sys.argv[1]))
    except Exception as exc:  # said to the router, which logs it and tries again later
        print(json.dumps({"error": str(exc)}))
        sys.exit(1)
    print(json.dumps(decision, default=str))
