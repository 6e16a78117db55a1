"""`poolpipe apps`: applications of several models under one SLO (apps.toml)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from poolpipe.domain.apps import fastest_latencies, load_apps
from poolpipe.errors import InfeasibleError, PoolpipeError
from poolpipe_cli.common import console


def cmd_apps_check(args: argparse.Namespace) -> int:
    """Check an apps.toml against the models the warehouse (or a PPipe profile directory)
    holds: every model known, transforms importable, each SLO no shorter than its slowest
    path at its fastest; then show each application's graph."""
    if args.profiles:
        from poolpipe.domain.profiles import load_ppipe_dir

        profiles = load_ppipe_dir(Path(args.profiles))
        where = str(args.profiles)
    else:
        from poolpipe.store.warehouse import Warehouse

        with Warehouse.open(args.warehouse) as wh:
            profiles = [wh.load_profile(n) for n in wh.model_names()]
            where = str(wh.path)
    fastest = fastest_latencies(profiles)
    apps = load_apps(args.spec, known_models=fastest, fastest_us=fastest)
    for app in apps:
        per = app.multiplicity()
        t = Table(
            title=f"{app.name}: SLO {app.slo_us / 1e3:g} ms, weight {app.weight:g}, entry "
            f"{app.entry}, answered by {', '.join(app.exits)}",
            title_justify="left",
        )
        for col in (
            "model",
            "waits for",
            "fan-out",
            "transform",
            "requests per request",
            "fastest ms",
        ):
            t.add_column(col, justify="left" if col in ("model", "waits for") else "right")
        for m in app.models:
            parents = app.parents(m)
            t.add_row(
                m,
                ", ".join(e.src for e in parents) or "-",
                ", ".join(e.fanout.describe() for e in parents) or "-",
                ", ".join(e.transform for e in parents) or "-",
                f"{per[m]:g}",
                f"{fastest[m] / 1e3:.1f}",
            )
        console.print(t)
        for path in app.paths():
            ms = sum(fastest[m] for m in path) / 1e3
            console.print(
                f"  path {' -> '.join(path)}: {ms:.1f} ms at its fastest, "
                f"{app.slo_us / 1e3 - ms:.1f} ms of the SLO left for waiting and batching",
                highlight=False,
            )
    console.print(f"{args.spec}: {len(apps)} application(s) checked against {where}")
    return 0


def cmd_apps_plan(args: argparse.Namespace) -> int:
    """Plan the applications of an apps.toml on a cluster: each model's latency budget
    chosen with the pooled pipelines (the joint split: where the applications' maximal
    splits of the grid are few, each planned in turn from the highest LP bound until none
    left can serve more; else one MILP over every budget), beside fixed splits: the SLO
    split equally along each path, in proportion to the models' fastest
    latencies, and by Nexus's split-then-plan (each model's budget chosen by what it costs
    alone). Shows what each serves (req/s of the least served application per unit of
    weight) and the joint split's budgets and pipelines. With --objective cost: the
    cheapest GPUs serving --rates, each split, and the cheapest whole-model plan."""
    from poolpipe.planner.apps import SPLITS, AppPlan, plan_apps
    from poolpipe.store.plan_inputs import apps_request
    from poolpipe.store.warehouse import Warehouse

    with Warehouse.open(args.warehouse) as wh:
        req = apps_request(
            wh,
            args.spec,
            args.cluster,
            clusters_file=args.clusters_file,
            grid=args.grid,
            margin=args.margin,
            max_partitions=args.max_partitions,
            time_limit_s=args.time_limit,
            count_inputs=args.count_inputs,
        )
    apps, cluster = req.apps, req.cluster
    _writable(args.out)
    if args.objective == "cost":
        return _apps_cost(args, req)
    if args.rates or args.prices:
        raise PoolpipeError("--rates and --prices apply to --objective cost only")
    plans: dict[str, AppPlan] = {}
    for split in (*SPLITS[1:], SPLITS[0]):  # the joint split last, from nexus's plan
        with console.status(f"planning the {split} split on {cluster.name} ..."):
            start = plans["nexus"] if split == "joint" else None
            plans[split] = plan_apps(req, split, start=start)
    plans = {split: plans[split] for split in SPLITS}
    joint = plans["joint"]
    docs: dict = {}
    chosen = "joint"
    if args.delivery != "off":
        from poolpipe.planner.apps import choose_apps

        with console.status("simulating what each split delivers ...") as status:
            chosen, docs = choose_apps(
                req,
                plans,
                args.delivery,
                lambda split: status.update(f"simulating what the {split} split delivers ..."),
            )
    t = Table(
        title=f"{len(apps)} application(s) on {cluster.name}: req/s of the least served per "
        f"unit of weight (budgets: a grid of {args.grid} per model, margin {args.margin})"
        + ("; delivered: with >= 99% of requests on time, simulated" if docs else ""),
        title_justify="left",
    )
    cols = ["split", "objective (fluid)", "joint / this", "each application req/s"]
    if docs:
        cols[2:2] = ["delivered"]
        cols[3] = f"{chosen} / this (delivered)"
        cols.append("each delivers")
    for col in (*cols, "MILP s"):
        t.add_column(col, justify="left" if col in ("split",) else "right")
    for split, p in plans.items():
        row = [split, f"{p.objective:.1f}"]
        if docs:
            got, best = docs[split].meta["apps_deliverable"], docs[chosen].meta["apps_deliverable"]
            row += [f"{got:.1f}", f"{best / got:.2f}" if got > 0 else "-"]
        else:
            row.append(f"{joint.objective / p.objective:.2f}" if p.objective > 0 else "-")
        row.append(", ".join(f"{a} {r:.1f}" for a, r in p.rates.items()))
        if docs:
            recorded = docs[split].meta["apps"]
            row.append(", ".join(f"{a} {recorded[a]['deliverable']:.1f}" for a in p.rates))
        row.append(f"{p.seconds:.2f} ({p.status})")
        t.add_row(*row)
    console.print(t)
    if chosen != "joint":
        got, joint_got = (docs[s].meta["apps_deliverable"] for s in (chosen, "joint"))
        console.print(
            f"chosen: the {chosen} split, which delivers {got:.1f} with >= 99% on time "
            f"against the joint split's {joint_got:.1f} (--delivery state keeps the joint split)",
            highlight=False,
        )
    _print_split(plans[chosen], chosen)
    _write(args.out, req, plans[chosen], docs.get(chosen), chosen)
    return 0


def _writable(out: str | None) -> None:
    if out and not Path(out).parent.is_dir():
        raise PoolpipeError(f"--out {out}: folder {Path(out).parent} does not exist")


def _write(
    out: str | None, req, plan, stated=None, split: str = "joint", meta: dict | None = None
) -> None:
    """The `split` split's plan document (what the simulator and the router serve), with
    what it delivers where `stated` has it, and `meta` (how a cost plan was sized)."""
    if not out:
        return
    from poolpipe.planner.apps import app_plan_document

    doc = stated if stated is not None else app_plan_document(req, plan)[0]
    if meta:
        doc = replace(doc, meta={**doc.meta, **meta})
    doc.save(Path(out))
    console.print(
        f"the {split} split's plan written to {out} ({len(doc.models)} models, "
        f"budgets filled to each SLO): poolpipe apps simulate SPEC --plan {out}",
        highlight=False,
    )


def cmd_apps_simulate(args: argparse.Namespace) -> int:
    """Simulate an application plan (poolpipe apps plan --out): requests of each
    application arrive at --load-factor x the rate it was planned for (Poisson), their
    parts run through the serving runtime on the simulated cluster; each request is
    answered once, on time only when all its parts finished by its SLO."""
    from poolpipe.domain.plan import Plan
    from poolpipe.sim.apps import part_profiles, simulate_apps
    from poolpipe.sim.engine import SimConfig
    from poolpipe.store.plan_inputs import warehouse_apps
    from poolpipe.store.warehouse import Warehouse

    if not Path(args.plan).is_file():
        raise PoolpipeError(f"plan file {args.plan} does not exist; write one with apps plan --out")
    if not (args.load_factor > 0 and args.duration > 0):
        raise PoolpipeError("--load-factor and --duration must be > 0")
    plan = Plan.load(Path(args.plan))
    with Warehouse.open(args.warehouse) as wh:
        apps, known = warehouse_apps(wh, args.spec)
    rates = plan.meta.get("apps_rates") or {}
    missing = [a.name for a in apps if a.name not in rates]
    if missing:
        raise PoolpipeError(
            f"plan {args.plan} was not planned for application(s) {', '.join(missing)}: "
            "plan the spec with poolpipe apps plan --out"
        )
    offered = {a.name: args.load_factor * rates[a.name] for a in apps}
    config = SimConfig(duration_s=args.duration, seed=args.seed)
    scenario = None
    if args.scenario:
        from poolpipe.sim.scenario import load_scenario

        def no_rollout(path: Path):
            raise PoolpipeError(
                f"{args.scenario}: rolling out {path} is not simulated for applications yet; "
                "a scenario of applications may fail GPUs and bring them back"
            )

        scenario = load_scenario(
            args.scenario,
            gpu_counts={p.gpu: p.count for p in plan.cluster.pools},
            models=[m.name for m in plan.models],
            load_plan=no_rollout,
        )
    with console.status("simulating ..."):
        res = simulate_apps(
            plan, part_profiles(plan, known), apps, offered, config, scenario=scenario
        )
    t = Table(
        title=f"applications on {plan.cluster.name} (simulated, {args.duration:g} s, load "
        f"{args.load_factor:g} x planned)",
        title_justify="left",
    )
    for col in (
        "application",
        "req/s",
        "arrived",
        "on time",
        "late",
        "dropped",
        "failed",
        "attainment",
    ):
        t.add_column(col, justify="left" if col == "application" else "right")
    for a in apps:
        row = res.apps[a.name]
        t.add_row(
            a.name,
            f"{offered[a.name]:.1f}",
            *(str(row[k]) for k in ("arrived", "on_time", "late", "dropped", "failed")),
            f"{res.attainment(a.name):.2%}",
        )
    console.print(t)
    parts = Table(title="their parts (requests of each model)", title_justify="left")
    for col in ("model", "arrived", "on time", "late", "dropped", "failed"):
        parts.add_column(col, justify="left" if col == "model" else "right")
    for name, c in res.parts.items():
        parts.add_row(
            name, *(str(c[k]) for k in ("arrivals", "on_time", "late", "dropped", "failed"))
        )
    console.print(parts)
    return 0


def _apps_cost(args: argparse.Namespace, req) -> int:
    """--objective cost: the cheapest GPUs serving --rates, per split, and whole-model."""
    from poolpipe.planner.apps import (
        AppPlan,
        app_plan_document,
        cheapest_apps,
        cheapest_by_split,
        cheapest_by_split_sized,
    )
    from poolpipe.planner.deliverable import app_attainment_at
    from poolpipe_cli.plans import cluster_prices, parse_pairs

    if not args.rates:
        raise PoolpipeError(
            "--objective cost needs the rates to serve: --rates "
            + ",".join(f"{a.name}=REQ_PER_S" for a in req.apps)
        )
    rates = parse_pairs(args.rates, "rates")
    prices = cluster_prices(req.cluster, args.prices)
    sizing = None
    with console.status("the cheapest GPUs ...") as status:

        def on_split(split: str) -> None:
            status.update(f"the cheapest GPUs, {split} split ...")

        plans: dict[str, AppPlan | None]
        if args.delivery == "off":
            plans = cheapest_by_split(req, rates, prices, on_split)
        else:
            plans, sizing = cheapest_by_split_sized(req, rates, prices, on_split)
    with console.status("the cheapest whole-model plan ..."):
        plans["whole-model"] = _or_none(lambda: cheapest_apps(req, rates, prices, whole=True))
        whole = plans["whole-model"]
        if sizing is not None and whole is not None:
            doc, profiles = app_plan_document(req, whole)
            sizing.on_time["whole-model"] = app_attainment_at(doc, profiles, req.apps, rates)
    joint = plans["joint"]
    assert joint is not None and joint.cost_per_hour is not None
    t = Table(
        title=f"the cheapest GPUs of {req.cluster.name} serving "
        + ", ".join(f"{a} {r:g} req/s" for a, r in rates.items())
        + " (prices per GPU-hour: "
        + ", ".join(f"{g} {p:g}" for g, p in sorted(prices.items()))
        + ")",
        title_justify="left",
    )
    cols = ["plan", "cost / hour", "this / joint", "GPUs", "MILP s"]
    if sizing is not None:
        cols.insert(4, "on time at the rates (simulated)")
    for col in cols:
        t.add_column(col, justify="left" if col in ("plan", "GPUs") else "right")
    for name, p in plans.items():
        if p is None or p.cost_per_hour is None:
            t.add_row(name, "cannot serve them", *["-"] * (len(cols) - 2))
            continue
        row = [
            name,
            f"{p.cost_per_hour:.2f}",
            f"{p.cost_per_hour / joint.cost_per_hour:.2f}",
            ", ".join(f"{n} {g}" for g, n in sorted(p.gpus_used.items()) if n),
            f"{p.seconds:.2f} ({p.status})",
        ]
        if sizing is not None:
            kept = sizing.on_time.get(name, {})
            row.insert(4, ", ".join(f"{a} {x:.1%}" for a, x in kept.items()))
        t.add_row(*row)
    console.print(t)
    meta = {}
    if sizing is not None:
        meta = {
            "on_time_at_rates": sizing.on_time["joint"],
            "sizing_rounds": sizing.rounds,
            "sized_for_rates": dict(rates),
        }
        _print_sizing(sizing, joint, rates)
    _print_split(joint)
    _write(args.out, req, joint, meta=meta)
    return 0


def _print_sizing(sizing, joint, rates) -> None:
    """How the joint split's cost plan was sized on what it delivers."""
    kept = ", ".join(f"{a} {x:.1%}" for a, x in sizing.on_time["joint"].items())
    n = len(sizing.rounds)
    if sizing.served:
        more = ", ".join(
            f"{a} {joint.rates[a]:.1f}" for a in rates if joint.rates[a] > rates[a] * (1 + 1e-9)
        )
        console.print(
            f"sized on what it delivers: the joint split keeps {kept} on time at the rates "
            f"(simulated, {n} plan(s))" + (f"; planned for {more} req/s" if more else ""),
            highlight=False,
        )
    else:
        console.print(
            f"[yellow]warning:[/] no joint-split plan of the cluster found to keep >= 99% on "
            f"time at these rates ({n} plan(s) simulated); the one planned at them keeps "
            f"{kept}: lower the rates, loosen the SLOs or plan on a larger cluster",
            highlight=False,
        )


def _or_none(plan):
    """A plan, or None where the cluster cannot serve the rates that way."""
    try:
        return plan()
    except InfeasibleError:
        return None


def _print_split(joint, split: str = "joint") -> None:
    b = Table(title=f"the {split} split", title_justify="left")
    for col in ("application", "model", "budget ms", "req/s served", "pipelines (batch: GPUs)"):
        b.add_column(col, justify="right" if col in ("budget ms", "req/s served") else "left")
    for (a, m), budget in joint.budgets.items():
        pipes = "; ".join(
            f"b{c.batch}: "
            + " | ".join(
                f"{n}x{p.gpu}/{p.share}" for p, n in zip(c.partitions, counts, strict=True)
            )
            for c, counts in joint.pipelines.get((a, m), [])
        )
        b.add_row(a, m, f"{budget / 1e3:.1f}", f"{joint.served[(a, m)]:.1f}", pipes)
    console.print(b)
    console.print(
        "GPUs used: " + ", ".join(f"{n} {g}" for g, n in sorted(joint.gpus_used.items())),
        highlight=False,
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    apps = sub.add_parser("apps", help="applications: graphs of models under one SLO")
    asub = apps.add_subparsers(dest="apps_command", required=True, metavar="ACTION")
    check = asub.add_parser(
        "check",
        help="check an apps.toml and show each application's graph",
        description=cmd_apps_check.__doc__,
    )
    check.add_argument("spec", help="the application spec (apps.toml; see docs/apps.md)")
    check.add_argument(
        "--profiles",
        help="a PPipe profile directory to check against instead of the warehouse",
    )
    check.set_defaults(func=cmd_apps_check)
    plan = asub.add_parser(
        "plan",
        help="plan the applications' SLO split with the pools; compare with fixed splits",
        description=cmd_apps_plan.__doc__,
    )
    plan.add_argument("spec", help="the application spec (apps.toml)")
    plan.add_argument("--cluster", required=True, help="cluster name, e.g. hc2-large")
    plan.add_argument("--clusters-file", help="TOML file with the cluster (default: warehouse)")
    plan.add_argument("--grid", type=int, default=10, help="budgets per model: SLO x k/grid (10)")
    plan.add_argument("--margin", type=float, default=0.4, help="share of a budget held back")
    plan.add_argument("--max-partitions", type=int, default=2, help="partitions per pipeline (2)")
    plan.add_argument("--time-limit", type=float, default=60.0, help="seconds per MILP (60)")
    plan.add_argument(
        "--count-inputs",
        action="store_true",
        help="count each part's request inputs on its first server's NIC, as the live router "
        "sends them (as poolpipe plan --count-inputs); needs each model's input size",
    )
    plan.add_argument(
        "--out",
        help="write the plan of the split kept here (JSON; see --delivery), to simulate or serve",
    )
    plan.add_argument(
        "--delivery",
        choices=("maximise", "state", "off"),
        default="maximise",
        help="maximise (default): simulate what each split's plan delivers, each "
        "application's req/s with >= 99%% of its requests on time, compare the splits by it "
        "and keep (print, --out) the split that delivers most; state: the same, keeping the "
        "joint split; off: the MILP's (fluid) figures alone, the joint split. With "
        "--objective cost, maximise and state both simulate each plan at --rates and size "
        "the joint split's until each application keeps 99%% on time",
    )
    plan.add_argument(
        "--objective",
        choices=("maxmin", "cost"),
        default="maxmin",
        help="maxmin: the most req/s per unit of weight for the least served application "
        "(default); cost: the cheapest of the cluster's GPUs serving --rates",
    )
    plan.add_argument("--rates", help="with --objective cost: req/s per application, e.g. A=100")
    plan.add_argument(
        "--prices",
        help="with --objective cost: price per GPU-hour per type, e.g. L4=0.56,T4=0.35 "
        "(default: price_per_hour in the clusters file)",
    )
    plan.set_defaults(func=cmd_apps_plan)
    sim = asub.add_parser(
        "simulate",
        help="simulate an application plan: each request answered once, as a whole",
        description=cmd_apps_simulate.__doc__,
    )
    sim.add_argument("spec", help="the application spec (apps.toml) the plan was made for")
    sim.add_argument("--plan", required=True, help="the plan (poolpipe apps plan --out)")
    sim.add_argument("--load-factor", type=float, default=0.9, help="x the planned rates (0.9)")
    sim.add_argument("--duration", type=float, default=10.0, help="simulated seconds (10)")
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument(
        "--scenario", help="a scenario file: GPUs failing and coming back (docs/runtime.md)"
    )
    sim.set_defaults(func=cmd_apps_simulate)
