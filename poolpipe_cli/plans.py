"""`poolpipe plan`, `compare` and `paper-plans`: plan model groups and print plans."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import PACKINGS, STRATEGIES, ModelPlan, PipelinePlan, Plan
from poolpipe.errors import PoolpipeError
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.request import DELIVERY, OBJECTIVES
from poolpipe.planner.solvers import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S, SOLVERS
from poolpipe.runtime import DEFAULT_MARGIN_FLOOR_US, DEFAULT_REPLY_MARGIN_US
from poolpipe.store.plan_inputs import plan_request, reply_margin_us, served_references
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import (
    PPIPE_DIR_ENV,
    add_reply_margin_argument,
    call_overhead_to_check,
    console,
    err_console,
    open_warehouse,
    parse_floats,
    parse_list,
    parse_margins,
    ppipe_dir,
    warn_slo_room,
)
from poolpipe_cli.profiles import cmd_import_ppipe

# ----------------------------------------------------------------------------- rendering


def describe_pipeline(p: PipelinePlan) -> str:
    return " → ".join(
        f"[{q.start},{q.end}) {q.gpu}{'' if q.share == 1 else f'/{q.share}'}×{q.vgpus}"
        for q in p.partitions
    )


def print_plan(plan: Plan) -> None:
    t = Table(
        title=f"{plan.strategy} plan on {plan.cluster.name} ({plan.packing}, "
        f"margin {plan.margin}, P≤{plan.max_partitions}"
        f"{', inputs counted on the NICs' if plan.counts_inputs else ''})",
        title_justify="left",
    )
    stated = plan.deliverable is not None
    for col, just in (
        ("model", "left"),
        ("req/s (fluid)", "right"),
        *((("deliverable req/s", "right"),) if stated else ()),
        ("batch", "right"),
        ("latency ms", "right"),
        ("SLO ms", "right"),
        ("partitions: blocks GPU/share×vGPUs", "left"),
    ):
        t.add_column(col, justify=just)
    for m in plan.models:
        dlv = [_deliverable_cell(m)] if stated else []
        if not m.pipelines:
            t.add_row(m.name, "0", *dlv, "", "", f"{m.slo_us / 1e3:.1f}", "(nothing fits)")
        for i, p in enumerate(m.pipelines):
            t.add_row(
                m.name if i == 0 else "",
                f"{p.throughput:,.1f}",
                *(dlv if i == 0 and len(m.pipelines) == 1 else [""] if stated else []),
                str(p.batch),
                f"{p.latency_us / 1e3:.2f}",
                f"{m.slo_us / 1e3:.1f}" if i == 0 else "",
                describe_pipeline(p),
            )
        if len(m.pipelines) > 1:
            t.add_row("", f"[bold]{m.throughput:,.1f}[/]", *dlv, "", "", "", "[dim]model total[/]")
    console.print(t)
    used = plan.gpus_used()
    gpus = ", ".join(f"{p.gpu} {used.get(p.gpu, 0)}/{p.count}" for p in plan.cluster.pools)
    s = plan.solver
    head = f"objective {plan.objective:,.2f} (fluid)"
    if plan.meta.get("objective") == "cost":
        head = f"cost {plan.meta['cost_per_hour']:,.2f}/h"
    console.print(
        f"{head}  |  GPUs {gpus}  |  {s.name} {s.status}, "
        f"gap {s.gap:.1e}, {s.seconds:.2f} s ({s.candidates} candidate pipelines)"
    )
    if stated:
        console.print(delivery_line(plan), highlight=False)
    if plan.meta.get("objective") == "cost":
        print_costs(plan)
    unserved = unserved_line(plan)
    if unserved:
        console.print(f"[yellow]{escape(unserved)}[/]", highlight=False)


def unserved_line(plan: Plan) -> str | None:
    """The models a plan leaves out because the cluster cannot serve them beside the rest."""
    left = plan.meta.get("unserved") or []
    if not left:
        return None
    return (
        f"not served: {', '.join(left)}: cluster {plan.cluster.name} cannot hold a pipeline "
        "of every model at its SLO at once, so the plan serves the others; plan those on a "
        "larger cluster, with looser SLOs, or apart"
    )


def _deliverable_cell(m: ModelPlan) -> str:
    if m.deliverable is None:
        return ""
    share = f" ({m.deliverable / m.throughput:.0%})" if m.throughput > 0 else ""
    return f"{m.deliverable:,.1f}{share}"


def delivery_line(plan: Plan) -> str:
    """What the plan delivers, in a line: the objective as delivered beside the fluid one
    and the fluid optimum, and how it was measured."""
    d = plan.meta.get("delivery") or {}
    delivered = plan.deliverable or 0.0
    parts = [f"delivers {delivered:,.1f} (objective at >= {d.get('target', 0.99):.0%} on time"]
    parts[0] += (
        f", {delivered / plan.objective:.0%} of its fluid {plan.objective:,.1f})"
        if plan.objective > 0
        else ")"
    )
    bound = d.get("fluid_bound")
    if d.get("mode") == "maximise" and bound:
        at = d.get("fluid_margin", plan.margin)
        parts.append(
            f"the fluid optimum is {bound:,.1f}"
            + (f" at margin {at:g}" if at != plan.margin else "")
            + f"; chosen: {d.get('variant')} of {len(d.get('variants', []))} plans simulated"
        )
    seeds = ",".join(str(x) for x in d.get("seeds", []))
    parts.append(
        f"simulated: Poisson, seeds {seeds}, {d.get('duration_s', 0):.1f} s per run, "
        f"{d.get('simulations', 0)} runs"
    )
    return "  |  ".join(parts)


def print_costs(plan: Plan) -> None:
    """A cost plan's price beside the cheapest np plan and single-type plans for its rates."""
    meta = plan.meta
    cost = float(meta["cost_per_hour"])
    prices = ", ".join(f"{g} {p:g}" for g, p in meta["prices"].items())
    rates = ", ".join(f"{m} {r:,.1f}" for m, r in meta["rates"].items())
    t = Table(
        title=f"cheapest plans for {rates} req/s (prices per GPU-hour: {prices})",
        title_justify="left",
    )
    t.add_column("plan")
    t.add_column("cost / h", justify="right")
    t.add_column(f"{plan.strategy} saves", justify="right")

    def row(label: str, other: float | None) -> None:
        if other is None:
            t.add_row(label, "cannot serve these rates", "")
        else:
            t.add_row(label, f"{other:,.2f}", f"{1 - cost / other:.0%}" if other > 0 else "")

    t.add_row(f"{plan.strategy} (this plan)", f"{cost:,.2f}", "")
    if plan.strategy != "np" and "np_cost_per_hour" in meta:
        row("np: whole models, whole GPUs", meta["np_cost_per_hour"])
    for gpu, other in (meta.get("single_type_cost_per_hour") or {}).items():
        row(f"{plan.strategy} on {gpu} only", other)
    console.print(t)


def print_side_by_side(plans: list[Plan]) -> None:
    t = Table(
        title=f"strategies side by side on {plans[0].cluster.name}"
        f"{' (inputs counted on the NICs)' if plans[0].counts_inputs else ''}",
        title_justify="left",
    )
    stated = all(p.deliverable is not None for p in plans)
    t.add_column("model")
    for p in plans:
        t.add_column(
            f"{p.strategy} req/s" + (" fluid / deliverable" if stated else ""), justify="right"
        )
        t.add_column(f"{p.strategy} pipelines")
    for i, m in enumerate(plans[0].models):
        row = [m.name]
        for p in plans:
            pm = p.models[i]
            thr = f"{pm.throughput:,.1f}"
            if stated:
                thr += f" / {pm.deliverable:,.1f}"
            row += [
                thr,
                "\n".join(f"b{pp.batch} {describe_pipeline(pp)}" for pp in pm.pipelines) or "-",
            ]
        t.add_row(*row)
    t.add_section()
    t.add_row(
        "objective, fluid (max-min req/s ÷ weight)",
        *[x for p in plans for x in (f"{p.objective:,.1f}", "")],
    )
    if stated:
        t.add_row(
            "objective, delivered (>= 99% on time)",
            *[x for p in plans for x in (f"{p.deliverable:,.1f}", "")],
        )
    t.add_row(
        "GPUs used",
        *[
            x
            for p in plans
            for x in (", ".join(f"{g} {n}" for g, n in sorted(p.gpus_used().items())), "")
        ],
    )
    t.add_row(
        "solve",
        *[
            x
            for p in plans
            for x in (f"{p.solver.seconds:.2f} s", f"{p.solver.status} gap {p.solver.gap:.0e}")
        ],
    )
    console.print(t)
    base = {p.strategy: p for p in plans}
    if "ppipe" in base:
        for other in ("np", "dart-r"):
            if other not in base:
                continue
            console.print(ratio_line(base["ppipe"], base[other]), highlight=False)


def ratio_line(plan: Plan, other: Plan) -> str:
    """ppipe / other: the ratio of what they deliver, with the fluid ratio beside it."""
    fluid = f"{plan.objective / other.objective:.2f}x" if other.objective > 0 else "n/a"
    if plan.deliverable is None or other.deliverable is None:
        return f"{plan.strategy} / {other.strategy}: {fluid} (fluid; not simulated)"
    delivered = f"{plan.deliverable / other.deliverable:.2f}x" if other.deliverable > 0 else "n/a"
    return (
        f"{plan.strategy} / {other.strategy}: {delivered} delivered at >= 99% on time "
        f"(fluid: {fluid})"
    )


def _cluster_arg(args: argparse.Namespace):
    """--cluster NAME, or the cluster of --inventory FILE's live nodes."""
    inventory = getattr(args, "inventory", None)
    if inventory and args.cluster:
        raise PoolpipeError("give --cluster or --inventory, not both")
    if getattr(args, "router", None) and not inventory:
        raise PoolpipeError("--router names a router of an inventory: give --inventory FILE")
    if inventory:
        from poolpipe.domain.inventory import load_inventory

        inv = load_inventory(inventory)
        router = getattr(args, "router", None)
        return (inv.shard(router) if router else inv).cluster()
    if not args.cluster:
        raise PoolpipeError(
            "give --cluster NAME (a cluster in the warehouse or --clusters-file) or "
            "--inventory FILE"
        )
    return args.cluster


def parse_pairs(text: str, what: str) -> dict[str, float]:
    """NAME=NUMBER,... as a dict; the bad item named."""
    out: dict[str, float] = {}
    for item in parse_list(text, what):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise PoolpipeError(f"--{what}: {item!r} is not NAME=NUMBER")
        out[name.strip()] = parse_floats(value, what)[0]
    return out


def cluster_prices(cluster: Cluster, given: str | None) -> dict[str, float]:
    """The cluster's prices per GPU-hour (its file's or warehouse's), overridden by
    --prices `given` (TYPE=PRICE,...), which may name only the cluster's GPU types."""
    prices = cluster.prices()
    if given:
        parsed = parse_pairs(given, "prices")
        types = [p.gpu for p in cluster.pools]
        extra = sorted(set(parsed) - set(types))
        if extra:
            raise PoolpipeError(
                f"--prices names {extra}, not GPU types of cluster {cluster.name} ({types})"
            )
        prices.update(parsed)
    return prices


def with_objective(args: argparse.Namespace, req: PlanRequest) -> PlanRequest:
    """--objective cost: the rates of --rates (one per model) and the prices of the
    cluster's file or warehouse, overridden by --prices."""
    if getattr(args, "objective", "maxmin") != "cost":
        for flag in ("rates", "prices", "no_compare"):
            if getattr(args, flag, None):
                raise PoolpipeError(f"--{flag.replace('_', '-')} applies to --objective cost only")
        return req
    names = [m.name for m in req.models]
    if not args.rates:
        raise PoolpipeError(
            "--objective cost needs the rates to serve: --rates "
            + ",".join(f"{n}=REQ_PER_S" for n in names)
        )
    rates = parse_pairs(args.rates, "rates")
    unknown = sorted(set(rates) - set(names))
    missing = [n for n in names if n not in rates]
    if unknown or missing:
        raise PoolpipeError(
            f"--rates must name each of --models {names} once"
            + (f"; not in --models: {unknown}" if unknown else "")
            + (f"; missing: {missing}" if missing else "")
        )
    return dataclasses.replace(
        req,
        objective="cost",
        rates=tuple(rates[n] for n in names),
        prices=cluster_prices(req.cluster, args.prices),
        cost_alternatives=not getattr(args, "no_compare", False),
    )


def build_request(args: argparse.Namespace, wh: Warehouse, strategy: str) -> PlanRequest:
    names = parse_list(args.models, "models")
    weights = parse_floats(args.weights, "weights") if args.weights else None
    if weights is not None and len(weights) != len(names):
        raise PoolpipeError(f"--weights has {len(weights)} values for {len(names)} models")
    explicit: dict[str, float] = {}
    for item in parse_list(args.slo_us, "slo-us") if args.slo_us else []:
        name, _, value = item.partition("=")
        if name not in names:
            raise PoolpipeError(f"--slo-us names {name!r}, which is not in --models {names}")
        explicit[name] = parse_floats(value, "slo-us")[0]
    req = plan_request(
        wh,
        names,
        _cluster_arg(args),
        clusters_file=args.clusters_file,
        weights=weights,
        slo_us=explicit,
        slo_scale=args.slo_scale,
        strategy=strategy,
        packing=args.packing,
        margin=args.margin,
        max_partitions=args.max_partitions,
        solver=args.solver,
        time_limit_s=args.time_limit,
        mip_gap=args.mip_gap,
        count_inputs=getattr(args, "count_inputs", False),
        delivery=getattr(args, "delivery", "maximise"),
        search_margins=parse_margins(getattr(args, "search_margins", None)),
    )
    if getattr(args, "exclude", None):
        req = dataclasses.replace(req, cluster=req.cluster.without(parse_exclude(args.exclude)))
    if args.slo_scale is not None:  # say what an onboarded model's SLO was scaled from
        refs = served_references(wh, [m for m in req.models if m.name not in explicit])
        for name, ref in refs.items():
            if ref.call_us or ref.reply_us:
                err_console.print(
                    f"{name}: {ref.describe(args.slo_scale)} (--slo-us sets it)",
                    highlight=False,
                    markup=False,
                )
    return req


def parse_exclude(text: str) -> dict[str, int]:
    """--exclude T4:5,L4:1 as {GPU type: GPUs lost}."""
    out: dict[str, int] = {}
    for item in parse_list(text, "exclude"):
        gpu, colon, n = item.partition(":")
        if not colon or not gpu.strip() or not n.strip().isdigit():
            raise PoolpipeError(f"--exclude: {item!r} is not TYPE:COUNT (e.g. T4:5)")
        out[gpu.strip()] = out.get(gpu.strip(), 0) + int(n)
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    # the warehouse is open to read the inputs and to store the plan, not while planning:
    # other processes (a router writing statistics) need it meanwhile
    with open_warehouse(args) as wh:
        req = with_objective(args, build_request(args, wh, args.strategy))
        req = dataclasses.replace(req, leave_out=True)  # serve those that fit, name the rest
        names = [m.name for m in req.models]
        margin_us = reply_margin_us(wh, args.reply_margin_ms * 1e3, DEFAULT_MARGIN_FLOOR_US, names)
        overhead_us = call_overhead_to_check(wh, names)
        if args.warm_start:
            req = dataclasses.replace(req, warm_start=_warm_start(wh, args.warm_start))
    what = "the cheapest " if req.objective == "cost" else ""
    with console.status(f"planning {what}{args.strategy} with {args.solver} ..."):
        plan = make_plan(req)
    warn_slo_room(plan, margin_us, overhead_us)  # before it is stored
    with open_warehouse(args) as wh:
        plan_id = wh.store_plan(plan, label=args.label)
    if args.out:
        plan.save(Path(args.out))
    if args.json:
        print(plan.to_json())
        unserved = unserved_line(plan)
        if unserved:
            err_console.print(unserved, highlight=False, markup=False)
        return 1 if unserved else 0
    print_plan(plan)
    if args.warm_start:
        start = plan.meta.get("warm_start_objective")
        console.print(
            f"warm start: plan {args.warm_start} fitted to these GPUs scores {start:,.1f}"
            if start is not None
            else f"warm start: nothing of plan {args.warm_start} fits (other models, or "
            "none of its pipelines within the SLOs now); planned cold"
        )
    console.print(
        f"stored as plan {plan_id} in {wh.path}" + (f"; written to {args.out}" if args.out else "")
    )
    return 1 if unserved_line(plan) else 0


def _warm_start(wh: Warehouse, ref: str) -> Plan:
    """--warm-start: a plan id in the warehouse or a plan JSON file."""
    if ref.isdigit():
        return wh.load_plan(int(ref))
    path = Path(ref)
    if not path.is_file():
        raise PoolpipeError(
            f"--warm-start {ref!r} is neither a plan id in {wh.path} nor a plan JSON file"
        )
    return Plan.load(path)


def cmd_compare(args: argparse.Namespace) -> int:
    plans = []
    strategies = parse_list(args.strategies, "strategies")
    with open_warehouse(args) as wh:
        base = build_request(args, wh, strategies[0])
    for strategy in strategies:
        with console.status(f"planning {strategy} ..."):
            plans.append(make_plan(dataclasses.replace(base, strategy=strategy)))
    with open_warehouse(args) as wh:
        for plan in plans:
            wh.store_plan(plan, label=args.label)
    print_side_by_side(plans)
    return 0


def cmd_paper_plans(args: argparse.Namespace) -> int:
    """Import the shipped real-GPU profiles and plan one of the paper's configurations with
    every strategy, side by side."""
    root = Path(args.profiles)
    if not (root / "block-latency").is_dir():
        raise PoolpipeError(
            f"{root} holds no PPipe profiles; pass --profiles DIR or set {PPIPE_DIR_ENV}"
        )
    args.directory = str(root)
    cmd_import_ppipe(args)
    workloads = tomllib.loads((root / "workloads.toml").read_text())
    group = workloads["groups"][args.group]
    args.models = ",".join(group)
    args.weights = ",".join(str(w) for w in workloads["mixes"][args.mix])
    args.clusters_file = str(root / "clusters.toml")
    args.slo_us = None
    args.slo_scale = float(workloads.get("slo_scale", 5))
    args.margin = float(workloads.get("planning_margin", 0.4))
    args.strategies = ",".join(STRATEGIES)
    console.print(
        f"group {args.group} ({', '.join(group)}), mix {args.mix}, cluster {args.cluster}, "
        f"SLO {args.slo_scale:g}x reference, margin {args.margin}"
    )
    return cmd_compare(args)


def _planning_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", required=True, help="comma-separated model names (in the warehouse)")
    p.add_argument("--weights", help="workload share per model, same order (default: equal)")
    p.add_argument("--cluster", help="cluster name, e.g. hc2-large")
    p.add_argument("--clusters-file", help="TOML file with the cluster (default: the warehouse)")
    p.add_argument(
        "--inventory",
        help="plan for the live nodes of this inventory TOML instead of --cluster (device "
        "counts, nodes per server and NIC bandwidth follow from it)",
    )
    p.add_argument(
        "--router",
        help="with --inventory: plan for this router's shard only (its [[routers]] nodes)",
    )
    p.add_argument(
        "--exclude",
        help="plan without some GPUs (failed, in maintenance), e.g. T4:5,L4:1 (an inventory "
        "marks such nodes down instead)",
    )
    p.add_argument(
        "--slo-scale",
        type=float,
        help="SLO = this x each model's reference latency (a model onboarded here: as served, "
        "its batch-1 run + a stage call + the reply margin)",
    )
    p.add_argument("--slo-us", help="explicit SLOs, e.g. A=70000,B=23000 (µs)")
    p.add_argument("--margin", type=float, default=0.4, help="fraction of the SLO held back (0.4)")
    p.add_argument("--max-partitions", type=int, default=2, help="partitions per pipeline (2)")
    p.add_argument(
        "--packing",
        choices=PACKINGS,
        default="per-share",
        help="per-share: MPS-realisable (default); per-position: PPipe's published rule",
    )
    p.add_argument("--solver", choices=SOLVERS, default="highs", help="MILP solver (highs)")
    p.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="seconds per MILP"
    )
    p.add_argument("--mip-gap", type=float, default=DEFAULT_MIP_GAP, help="relative gap (1e-4)")
    p.add_argument(
        "--count-inputs",
        action="store_true",
        help="count each request's inputs on its first server's NIC (the paper's transfer "
        "model counts feature maps only): plans a live cluster can carry when inputs are "
        "large; needs each model's input size (imported with the artifact's layers/ files)",
    )
    _delivery_option(p)
    p.add_argument("--label", help="free-text label stored with the plan")


def _delivery_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--delivery",
        choices=DELIVERY,
        default="maximise",
        help="maximise (default): the plan that serves the most with >= 99%% of requests on "
        "time, chosen among plans made from the MILP's by simulating each, its deliverable "
        "req/s stated; state: the MILP's (fluid) plan, its deliverable req/s simulated; off: "
        "the fluid MILP alone, nothing simulated",
    )
    p.add_argument(
        "--search-margins",
        metavar="M,M",
        help="with --delivery maximise, also plan holding back these fractions of the SLO "
        "(e.g. 0.3,0.2) and keep the plan that delivers the most: a smaller margin admits "
        "larger batches and slower GPUs, and the simulation measures the waiting it leaves "
        "room for (default: --margin alone)",
    )


def cmd_shards(args: argparse.Namespace) -> int:
    """Split an inventory's nodes among its [[routers]] for the highest summed objective
    (each router's shard planned for itself; search_split), and write the inventory with
    each router's `nodes` set to its shard."""
    from poolpipe.domain.inventory import InventoryError, parse_inventory
    from poolpipe.domain.tier import nodes_for_counts
    from poolpipe.domain.tomlfile import read_toml
    from poolpipe.errors import InfeasibleError
    from poolpipe.planner.shards import sharding_loss

    if not args.inventory:
        raise PoolpipeError("shards splits an inventory's nodes: give --inventory FILE")
    if args.router:
        raise PoolpipeError("shards splits among every router of the inventory: drop --router")
    data = read_toml(Path(args.inventory), "inventory", InventoryError)
    tables = data.get("routers")
    if not isinstance(tables, list) or len(tables) < 2:
        raise PoolpipeError(
            f"{args.inventory}: a split needs two [[routers]] or more (see `poolpipe lb --help`)"
        )
    # the nodes alone first (what the routers list now does not count: split afresh)
    inv = parse_inventory(
        {k: v for k, v in data.items() if k not in ("routers", "balancer")}, args.inventory
    )
    whole = argparse.Namespace(**{**vars(args), "inventory": None, "cluster": inv.cluster()})
    with open_warehouse(args) as wh:
        req = build_request(whole, wh, "ppipe")

    def plan(cluster):
        # (a split is scored by its shards' fluid plans: each router plans its own again)
        made = make_plan(dataclasses.replace(req, cluster=cluster, delivery="off"))
        return made.objective, tuple(m.throughput / m.weight for m in made.models)

    k = len(tables)
    with console.status(f"searching a split among {k} routers (each shard planned) ..."):
        try:
            found = sharding_loss(req.cluster, k, plan, by="search")
        except InfeasibleError as exc:
            raise PoolpipeError(f"the whole inventory cannot serve the models: {exc}") from None
    bound = None
    if args.bound:
        from poolpipe.planner.shards import shards_bound

        with console.status(f"bounding every split among {k} routers (one MILP) ..."):
            bound = shards_bound(req, k, found.whole)
        if bound.counts:  # the search from the MILP's own split, the better one kept
            with console.status("searching again from the bound's split ..."):
                other = sharding_loss(req.cluster, k, plan, by="search", start=bound.counts)
            if other.summed > found.summed + 1e-9:
                found = other
    counts = [{p.gpu: p.count for p in sh.pools} for sh in found.split]
    live = [(n.name, n.device, n.server) for n in inv.nodes if n.name not in inv.down]
    shards = nodes_for_counts(live, counts)
    down = [n for n in inv.nodes if n.name in inv.down]  # to the router with fewest nodes
    for n in down:
        i = min(range(k), key=lambda i: (len(shards[i]), i))
        shards[i] = (*shards[i], n.name)
    for table, nodes in zip(tables, shards, strict=True):
        if isinstance(table, dict):
            table["nodes"] = list(nodes)
    inv = parse_inventory(data, args.inventory)  # the tier checked as written
    routers = inv.routers
    t = Table(
        title=f"{inv.source}: {k} shards searched for the highest summed objective (req/s "
        f"per unit of weight); the whole inventory planned at once: {found.whole:.1f}",
        title_justify="left",
    )
    for col in ("router", "GPUs", "objective", "nodes"):
        t.add_column(col, justify="right" if col == "objective" else "left")
    for r, c, per_model in zip(routers, counts, found.shards, strict=True):
        gpus = ", ".join(f"{n} {g}" for g, n in sorted(c.items()) if n)
        t.add_row(r.name, gpus, f"{min(per_model):.1f}", ", ".join(r.nodes))
    console.print(t)
    console.print(
        f"summed {found.summed:.1f}: sharding loss {found.loss:.1%} of the whole", highlight=False
    )
    if bound is not None:
        proven = "proven" if bound.status == "optimal" else f"bound after {bound.seconds:.0f} s"
        console.print(
            f"no split among {k} routers loses less than {bound.least_loss:.1%} ({proven}; "
            f"summed at most {bound.bound:.1f})",
            highlight=False,
        )
    out = Path(args.out or args.inventory)
    out.write_text(inv.to_toml())
    console.print(f"wrote the routers' nodes to {out}", highlight=False)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "paper-plans", help="import the PPipe profiles and compare all strategies on a cluster"
    )
    demo.add_argument("--profiles", default=str(ppipe_dir()), help="PPipe profile folder")
    demo.add_argument("--group", type=int, default=2, help="workload group index (0-5; default 2)")
    demo.add_argument("--mix", default="maf19", help="workload mix (maf19, maf21, even)")
    demo.add_argument("--cluster", default="hc2-large", help="cluster preset (hc2-large)")
    demo.add_argument("--max-partitions", type=int, default=2)
    demo.add_argument("--packing", choices=PACKINGS, default="per-position")
    demo.add_argument("--solver", choices=SOLVERS, default="highs")
    demo.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S)
    demo.add_argument("--mip-gap", type=float, default=DEFAULT_MIP_GAP)
    _delivery_option(demo)
    demo.add_argument("--label", default="paper-plans")
    demo.set_defaults(func=cmd_paper_plans)
    shards = sub.add_parser(
        "shards",
        help="split an inventory's nodes among its routers for the most throughput",
        description=cmd_shards.__doc__,
    )
    _planning_options(shards)
    shards.add_argument("-o", "--out", help="write the inventory here (default: in place)")
    shards.add_argument(
        "--bound",
        action="store_true",
        help="also bound the loss of any split: one MILP over every split at once (up to "
        "--time-limit; per-position packing proves it in seconds, per-share may not), and "
        "search again from its split, keeping the better",
    )
    shards.set_defaults(func=cmd_shards)
    plan = sub.add_parser("plan", help="plan a model group on a cluster (MILP)")
    _planning_options(plan)
    plan.add_argument("--strategy", choices=STRATEGIES, default="ppipe")
    plan.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="maxmin",
        help="maxmin: the most throughput at the --weights mix on the cluster's GPUs "
        "(default); cost: the cheapest of the cluster's GPUs serving --rates",
    )
    plan.add_argument(
        "--rates", help="with --objective cost: req/s to serve per model, e.g. A=1200,B=900"
    )
    plan.add_argument(
        "--prices",
        help="with --objective cost: price per GPU-hour per GPU type, e.g. L4=0.8,T4=0.35 "
        "(default: price_per_hour of the clusters file; these override it)",
    )
    plan.add_argument(
        "--no-compare",
        action="store_true",
        help="with --objective cost: skip pricing the cheapest np plan and the cheapest plan "
        "on each GPU type alone (one solve fewer each)",
    )
    plan.add_argument(
        "--warm-start",
        metavar="PLAN",
        help="start from this plan (id or JSON file; the serving one when re-planning after "
        "a GPU loss): its pipelines fitted to the GPUs left are the first plan the search "
        "improves on (max-min only)",
    )
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON instead of tables")
    add_reply_margin_argument(
        plan,
        "the reply margin to expect of the router that will serve the plan (what one "
        "measures with its nodes idle; a larger one a router of this warehouse measured "
        "last is used instead): SLOs it leaves no room in are warned of",
        DEFAULT_REPLY_MARGIN_US,
    )
    plan.set_defaults(func=cmd_plan)

    cmp_ = sub.add_parser(
        "compare", help="plan with several strategies and print them side by side"
    )
    _planning_options(cmp_)
    cmp_.add_argument("--strategies", default=",".join(STRATEGIES))
    cmp_.set_defaults(func=cmd_compare)
