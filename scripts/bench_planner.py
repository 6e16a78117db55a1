"""Planner benchmark. The delivery part (scripts/bench_delivery.py): what plans deliver at
>= 99% on time, the planner's stated figures checked by simulations it did not make, and
ppipe / np as a ratio of what they deliver (its `large` and `costs` parts: 100 GPUs, and cost
plans simulated at their rates). The max-min part: the fluid MILP (the bound plans are
chosen under) on the paper's 24 main configurations with every strategy and the 18
single-model configurations; prints objective, per-model throughput, status, gap and solve
time, and stores one row per (configuration, strategy, model) in the warehouse.

With the cost part: the cheapest ppipe plan of every main configuration for rates of 50%
and 90% of its max-min plan's per-model throughput, beside the cheapest np and single-type
plans for the same rates. With the replan part: the max-min plan again after losing 5% and
20% of one GPU type (each type in turn), as `poolpipe plan --exclude TYPE:N` does, cold and
warm-started from the main plan (`--warm-start PLAN`).

    ./run bench-planner [--parts delivery,maxmin,large,costs,types,cost,replan]
                        [--packing per-position] [--quick] [--prices L4=0.56,...]
                        [--warehouse FILE]
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import tomllib
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from poolpipe.domain.cluster import Cluster, GpuPool, load_clusters
from poolpipe.domain.plan import PACKINGS, STRATEGIES, Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)
MAIN_CLUSTERS = ("hc1-large", "hc2-large", "hc3-large", "hc4-large")
# Example prices per GPU-hour (USD, on-demand list prices of one cloud's GPUs, 2025): the
# shipped clusters carry none. Pass --prices to use your own.
PRICES = {"L4": 0.56, "T4": 0.35, "P4": 0.60, "V100": 2.48}
PARTS = ("delivery", "large", "costs", "maxmin", "types", "cost", "replan")
DELIVERY_PARTS = ("delivery", "large", "costs")  # bench_delivery.py
# Clusters of three and four GPU types from the shipped profiles' types (NICs and shares as
# in clusters.toml: P4 whole GPUs only), in several proportions of new to old GPUs.
MANY_TYPES = {
    "3t-l4-t4-p4": (10, {"L4": 10, "T4": 30, "P4": 60}),
    "3t-v100-t4-p4": (10, {"V100": 10, "T4": 30, "P4": 60}),
    "3t-l4-v100-p4": (6, {"L4": 15, "V100": 15, "P4": 70}),
    "4t-even": (10, {"L4": 25, "V100": 25, "T4": 25, "P4": 25}),
    "4t-few-new": (10, {"L4": 5, "V100": 5, "T4": 40, "P4": 50}),
    "4t-many-new": (10, {"L4": 40, "V100": 20, "T4": 20, "P4": 20}),
}
GPUS_PER_SERVER = {"L4": 4, "V100": 4, "T4": 2, "P4": 1}
COST_FRACTIONS = (0.5, 0.9)
LOSSES = (0.05, 0.20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument(
        "--packing",
        choices=PACKINGS,
        default="per-position",
        help="per-position is the published rule (default, comparable with PPipe)",
    )
    ap.add_argument("--mix", default="maf19")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="2 groups x 2 clusters, 4 single models")
    ap.add_argument(
        "--parts",
        default="delivery,maxmin",
        help=f"comma-separated, of {', '.join(PARTS)} (default delivery,maxmin; delivery "
        "takes ~15 min, large ~10, types ~25)",
    )
    ap.add_argument(
        "--prices",
        default=",".join(f"{g}={p}" for g, p in PRICES.items()),
        help="price per GPU-hour per type for the cost part",
    )
    ap.add_argument(
        "--search-margins",
        default="",
        help="delivery part: plan also at these margins, keep what delivers most (e.g. 0.3,0.2)",
    )
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default=None, help="run label stored with the rows")
    args = ap.parse_args()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts: choose among {', '.join(PARTS)}")
    prices = {g: float(p) for g, _, p in (x.partition("=") for x in args.prices.split(","))}

    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    workloads = tomllib.loads((args.profiles / "workloads.toml").read_text())
    mix = tuple(workloads["mixes"][args.mix])
    slo_scale = float(workloads.get("slo_scale", 5))
    groups = workloads["groups"][:2] if args.quick else workloads["groups"]
    main_clusters = MAIN_CLUSTERS[:2] if args.quick else MAIN_CLUSTERS
    singles = sorted(profiles)[:4] if args.quick else sorted(profiles)

    jobs: list[tuple[str, PlanRequest]] = []
    main_strategies = STRATEGIES if "maxmin" in parts else ("ppipe",)

    def group_request(group: list[str], cluster: Cluster, strategy: str, packing: str):
        """A main configuration: the group at the mix, P = 2, margin 0.4."""
        return PlanRequest(
            models=tuple(profiles[n] for n in group),
            weights=mix,
            slos_us=tuple(slo_scale * profiles[n].reference_latency_us for n in group),
            cluster=cluster,
            strategy=strategy,
            packing=packing,
            margin=0.4,
            max_partitions=2,
            time_limit_s=args.time_limit,
            delivery="off",  # the fluid MILP: what its solve costs and proves
        )

    if set(parts) & set(DELIVERY_PARTS):
        import bench_delivery

        bench_delivery.run(
            [p for p in parts if p in DELIVERY_PARTS],
            args.quick,
            args.profiles,
            args.warehouse,
            args.label,
            bench_delivery.parse_margins(ap, args.search_margins),
        )
        parts = [p for p in parts if p not in DELIVERY_PARTS]
        if not parts:
            return 0
    for gi, group in enumerate(groups):
        for cname in main_clusters:
            for strategy in main_strategies:
                req = group_request(group, clusters[cname], strategy, args.packing)
                jobs.append((f"main:g{gi}:{cname}", req))
    if "types" in parts:
        for gi, group in enumerate(groups):
            for cname, cluster in many_type_clusters(args.quick).items():
                for packing in PACKINGS:
                    req = group_request(group, cluster, "ppipe", packing)
                    jobs.append((f"types:g{gi}:{cname}:{packing}", req))
    for name in singles if "maxmin" in parts else ():
        jobs.append(
            (
                f"single:{name}:hc2-large",
                PlanRequest(
                    models=(profiles[name],),
                    weights=(1.0,),
                    slos_us=(slo_scale * profiles[name].reference_latency_us,),
                    cluster=clusters["hc2-large"],
                    strategy="ppipe",
                    packing="per-position",
                    margin=0.1,
                    max_partitions=3,
                    time_limit_s=args.time_limit,
                    delivery="off",
                ),
            )
        )

    results: list[tuple[str, Plan]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(jobs))
        for config, req in jobs:
            progress.update(task, description=f"{config} {req.strategy}")
            results.append((config, make_plan(req)))
            progress.advance(task)

    if "maxmin" in parts:
        print_main(results, args.packing)
        print_singles(results)
        print_summary(results)
    mains = [(c, p, req) for (c, req), (_, p) in zip(jobs, results, strict=True)]
    mains = [(c, p, req) for c, p, req in mains if c.startswith("main:") and p.strategy == "ppipe"]
    if "types" in parts:
        print_types(results)
    if "cost" in parts:
        cost = cost_part(mains, prices)
        print_cost(cost, args.packing)
        results += [(c, p) for c, p, _ in cost]
    if "replan" in parts:
        replans = replan_part(mains)
        print_replan(replans, args.packing)
        results += [(c, p) for c, p, _ in replans]
    store(results, args)
    return 0


def many_type_clusters(quick: bool) -> dict[str, Cluster]:
    out = {}
    for name, (bw, counts) in MANY_TYPES.items():
        pools = tuple(
            GpuPool(g, n, GPUS_PER_SERVER[g], (1,) if g == "P4" else (1, 2, 3, 4))
            for g, n in counts.items()
        )
        out[name] = Cluster(name, bw, pools)
    if quick:
        return {k: out[k] for k in ("3t-l4-t4-p4", "4t-even")}
    return out


def print_types(results: list[tuple[str, Plan]]) -> None:
    rows = [(c, p) for c, p in results if c.startswith("types:")]
    t = Table(
        title="ppipe max-min plans on clusters of 3 and 4 GPU types (P=2, margin 0.4)",
        title_justify="left",
    )
    for col in (
        "group",
        "cluster",
        "packing",
        "objective",
        "GPUs used",
        "status",
        "gap",
        "proof",
        "seconds",
    ):
        t.add_column(col, justify="right" if col in ("objective", "gap", "seconds") else "left")
    for c, p in rows:
        _, g, cname, packing = c.split(":")
        t.add_row(
            g,
            cname,
            packing,
            _cell(p),
            ", ".join(f"{k} {n}" for k, n in sorted(p.gpus_used().items())),
            p.solver.status,
            f"{p.solver.gap:.1e}",
            p.solver.proof,
            f"{p.solver.seconds:.2f}",
        )
    console.print(t)
    secs = [p.solver.seconds for _, p in rows]
    proven = sum(_proven(p) for _, p in rows)
    console.print(
        f"[bold]{len(rows)} many-type plans[/]: {proven} proven optimal (gap <= 1e-4); "
        f"median {statistics.median(secs):.2f} s, max {max(secs):.2f} s, "
        f"{sum(s > 10 for s in secs)} over 10 s"
    )


def cost_part(
    mains: list[tuple[str, Plan, PlanRequest]], prices: dict[str, float]
) -> list[tuple[str, Plan, float]]:
    """The cheapest ppipe plan for COST_FRACTIONS of each max-min plan's per-model rates."""
    out = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("cost", total=len(mains) * len(COST_FRACTIONS))
        for config, plan, req in mains:
            for f in COST_FRACTIONS:
                rates = tuple(f * m.throughput for m in plan.models)
                priced = replace(req, objective="cost", rates=rates, prices=prices)
                progress.update(task, description=f"cost {config} at {f:.0%}")
                out.append(
                    (f"cost{f * 100:.0f}:{config.removeprefix('main:')}", make_plan(priced), f)
                )
                progress.advance(task)
    return out


def print_cost(cost: list[tuple[str, Plan, float]], packing: str) -> None:
    t = Table(
        title=f"cheapest ppipe plans ({packing}) for rates at 50% / 90% of the max-min plan's",
        title_justify="left",
    )
    for col in (
        "config",
        "rates",
        "cost/h",
        "GPUs",
        "np cost/h",
        "saves vs np",
        "cheapest one type",
        "saves vs it",
        "status",
        "gap",
        "solve s",
        "all s",
    ):
        t.add_column(
            col, justify="left" if col in ("config", "GPUs", "cheapest one type") else "right"
        )
    solve, savings_np, savings_one = [], [], []
    for config, plan, f in cost:
        m = plan.meta
        c = m["cost_per_hour"]
        singles = {g: x for g, x in m["single_type_cost_per_hour"].items() if x is not None}
        one = min(singles.items(), key=lambda kv: kv[1]) if singles else None
        np_c = m["np_cost_per_hour"]
        if np_c:
            savings_np.append(1 - c / np_c)
        if one:
            savings_one.append(1 - c / one[1])
        solve.append(plan.solver.milp_seconds)
        t.add_row(
            config.split(":", 1)[1],
            f"{f:.0%}",
            f"{c:,.2f}",
            ", ".join(f"{g} {n}" for g, n in sorted(plan.gpus_used().items())),
            "-" if np_c is None else f"{np_c:,.2f}",
            "np cannot" if np_c is None else f"{1 - c / np_c:.0%}",
            "none can" if one is None else f"{one[0]} {one[1]:,.2f}",
            "" if one is None else f"{1 - c / one[1]:.0%}",
            plan.solver.status,
            f"{plan.solver.gap:.1e}",
            f"{plan.solver.milp_seconds:.2f}",
            f"{plan.solver.seconds:.2f}",
        )
    console.print(t)
    proven = sum(_proven(p) for _, p, _ in cost)
    console.print(
        f"[bold]{len(cost)} cost plans[/]: {proven} proven optimal; solve median "
        f"{statistics.median(solve):.2f} s, max {max(solve):.2f} s, {sum(s > 10 for s in solve)} "
        f"over 10 s; saving vs np: {_spread(savings_np)} ({len(savings_np)} where np serves the "
        f"rates); vs the cheapest single type: {_spread(savings_one)} ({len(savings_one)} where "
        "one type serves them)"
    )


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"mean {statistics.mean(xs):.0%} (min {min(xs):.0%}, max {max(xs):.0%})"


def replan_part(mains: list[tuple[str, Plan, PlanRequest]]) -> list[tuple[str, Plan, float]]:
    """Max-min plans after losing LOSSES of each GPU type in turn: cold, then warm-started
    from the main plan (as the replan flow does with the serving plan)."""
    out = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replan", total=len(mains) * len(LOSSES) * 2 * 2)
        for config, plan, req in mains:
            for pool in req.cluster.pools:
                for loss in LOSSES:
                    n = max(1, round(loss * pool.count))
                    lost = replace(req, cluster=req.cluster.without({pool.gpu: n}))
                    progress.update(task, description=f"replan {config} less {pool.gpu}:{n}")
                    for how, warm in (("replan", None), ("replan-warm", plan)):
                        name = f"{how}:{config.removeprefix('main:')}:{pool.gpu}-{n}"
                        out.append((name, make_plan(replace(lost, warm_start=warm)), loss))
                        progress.advance(task)
    return out


def print_replan(replans: list[tuple[str, Plan, float]], packing: str) -> None:
    t = Table(title=f"re-planning after GPU loss ({packing})", title_justify="left")
    cols = ("lost", "start", "plans", "proven", "median s", "max s", "slowest", "start optimal")
    for col in cols:
        t.add_column(col, justify="left" if col in ("lost", "start", "slowest") else "right")
    for loss in LOSSES:
        for how in ("replan", "replan-warm"):
            rows = [(c, p) for c, p, x in replans if x == loss and c.split(":")[0] == how]
            s = [p.solver.seconds for _, p in rows]
            slow = max(rows, key=lambda r: r[1].solver.seconds)
            # the warm start (the main plan fitted to the GPUs left) already optimal
            hit = [
                p.meta.get("warm_start_objective", -1) >= p.objective * (1 - 1e-4) for _, p in rows
            ]
            t.add_row(
                f"{loss:.0%} of one type",
                "main plan" if how == "replan-warm" else "cold",
                str(len(rows)),
                str(sum(_proven(p) for _, p in rows)),
                f"{statistics.median(s):.2f}",
                f"{max(s):.2f}",
                slow[0].split(":", 1)[1],
                f"{sum(hit)}" if how == "replan-warm" else "-",
            )
    console.print(t)
    for how in ("replan", "replan-warm"):
        plans = [p for c, p, _ in replans if c.split(":")[0] == how]
        secs = [p.solver.seconds for p in plans]
        console.print(
            f"[bold]{len(plans)} {how}s[/]: {sum(map(_proven, plans))} proven optimal; "
            f"median {statistics.median(secs):.2f} s, max {max(secs):.2f} s"
        )


def _proven(plan: Plan) -> bool:
    return plan.solver.status == "optimal" and plan.solver.gap <= 1e-4


def _cell(plan: Plan) -> str:
    return f"{plan.objective:,.1f}"


def print_main(results: list[tuple[str, Plan]], packing: str) -> None:
    by = {(c, p.strategy): p for c, p in results if c.startswith("main:")}
    configs = sorted({c for c, _ in by}, key=lambda c: (int(c.split(":")[1][1:]), c))
    if not configs:
        return
    t = Table(
        title=f"{len(configs)} main configurations (P=2, margin 0.4, {packing}): max-min objective",
        title_justify="left",
    )
    for col in (
        "config",
        "np",
        "dart-r",
        "ppipe",
        "ppipe/np",
        "ppipe/dart-r",
        "ppipe req/s per model",
        "ppipe status",
        "gap",
        "proof",
        "ppipe s",
        "np s",
        "dart-r s",
    ):
        t.add_column(col, justify="left" if col in ("config", "ppipe req/s per model") else "right")
    for c in configs:
        pp, npl, dr = by[(c, "ppipe")], by[(c, "np")], by[(c, "dart-r")]
        t.add_row(
            c.removeprefix("main:"),
            _cell(npl),
            _cell(dr),
            _cell(pp),
            f"{pp.objective / npl.objective:.2f}",
            f"{pp.objective / dr.objective:.2f}",
            " / ".join(f"{m.throughput:,.0f}" for m in pp.models),
            pp.solver.status,
            f"{pp.solver.gap:.1e}",
            pp.solver.proof,
            f"{pp.solver.seconds:.2f}",
            f"{npl.solver.seconds:.2f}",
            f"{dr.solver.seconds:.2f}",
        )
    console.print(t)
    ratios = [by[(c, "ppipe")].objective / by[(c, "np")].objective for c in configs]
    ratios_dr = [by[(c, "ppipe")].objective / by[(c, "dart-r")].objective for c in configs]
    wins = sum(r > 1 + 1e-9 for r in ratios)
    console.print(
        f"ppipe beats np in {wins}/{len(configs)} configurations; objective ratio ppipe/np "
        f"mean {statistics.mean(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
        f"ppipe/dart-r mean {statistics.mean(ratios_dr):.2f}"
    )


def print_singles(results: list[tuple[str, Plan]]) -> None:
    singles = [(c, p) for c, p in results if c.startswith("single:")]
    if not singles:
        return
    t = Table(
        title="single-model configurations (hc2-large, P=3, margin 0.1, per-position)",
        title_justify="left",
    )
    for col in (
        "model",
        "req/s",
        "pipelines",
        "status",
        "gap",
        "proof",
        "seconds",
        "candidates kept",
        "feasible configs",
    ):
        t.add_column(col, justify="left" if col == "model" else "right")
    for c, p in singles:
        t.add_row(
            c.split(":")[1],
            _cell(p),
            str(len(p.models[0].pipelines)),
            p.solver.status,
            f"{p.solver.gap:.1e}",
            p.solver.proof,
            f"{p.solver.seconds:.2f}",
            str(p.solver.candidates),
            str(p.solver.feasible_configs),
        )
    console.print(t)


def print_summary(results: list[tuple[str, Plan]]) -> None:
    secs = [p.solver.seconds for _, p in results]
    proven = sum(_proven(p) for _, p in results)
    slowest = max(results, key=lambda r: r[1].solver.seconds)
    console.print(
        f"[bold]{len(results)} plans[/]: {proven} proven optimal (gap <= 1e-4); solve time "
        f"median {statistics.median(secs):.3f} s, mean {statistics.mean(secs):.3f} s, "
        f"max {max(secs):.2f} s ({slowest[0]} {slowest[1].strategy}); "
        f"{sum(s > 1 for s in secs)} over 1 s, {sum(s > 10 for s in secs)} over 10 s"
    )
    for family in ("main", "single"):
        fs = [p.solver.seconds for c, p in results if c.startswith(family)]
        if fs:
            console.print(f"  {family}: median {statistics.median(fs):.3f} s, max {max(fs):.2f} s")


def store(results: list[tuple[str, Plan]], args: argparse.Namespace) -> None:
    now = datetime.now().replace(microsecond=0)
    label = args.label or f"bench_planner {platform.python_version()} {args.packing}"
    rows = []
    for config, plan in results:
        for m in plan.models:
            rows.append(
                {
                    "run_at": now,
                    "run_label": label,
                    "config": config,
                    "strategy": plan.strategy,
                    "packing": plan.packing,
                    "model": m.name,
                    "objective": plan.meta.get("cost_per_hour", plan.objective),
                    "throughput": m.throughput,
                    "status": plan.solver.status,
                    "gap": plan.solver.gap if plan.solver.gap != float("inf") else None,
                    "seconds": plan.solver.seconds,
                    "candidates": plan.solver.candidates,
                    "host": socket.gethostname(),
                }
            )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_planner", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (table bench_planner)")


if __name__ == "__main__":
    sys.exit(main())
