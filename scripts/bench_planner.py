"""Planner benchmark: the paper's 24 main configurations with every strategy, and the 18
single-model configurations; prints objective, per-model throughput, status, gap and solve
time, and stores one row per (configuration, strategy, model) in the warehouse.

    ./run bench-planner [--packing per-position] [--quick] [--warehouse FILE]
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import tomllib
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from poolpipe.cli.common import ppipe_dir
from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.plan import PACKINGS, STRATEGIES, Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.store.warehouse import Warehouse

console = Console(width=None if sys.stdout.isatty() else 170)
MAIN_CLUSTERS = ("hc1-large", "hc2-large", "hc3-large", "hc4-large")


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
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default=None, help="run label stored with the rows")
    args = ap.parse_args()

    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    workloads = tomllib.loads((args.profiles / "workloads.toml").read_text())
    mix = tuple(workloads["mixes"][args.mix])
    slo_scale = float(workloads.get("slo_scale", 5))
    groups = workloads["groups"][:2] if args.quick else workloads["groups"]
    main_clusters = MAIN_CLUSTERS[:2] if args.quick else MAIN_CLUSTERS
    singles = sorted(profiles)[:4] if args.quick else sorted(profiles)

    jobs: list[tuple[str, PlanRequest]] = []
    for gi, group in enumerate(groups):
        for cname in main_clusters:
            for strategy in STRATEGIES:
                jobs.append(
                    (
                        f"main:g{gi}:{cname}",
                        PlanRequest(
                            models=tuple(profiles[n] for n in group),
                            weights=mix,
                            slos_us=tuple(
                                slo_scale * profiles[n].reference_latency_us for n in group
                            ),
                            cluster=clusters[cname],
                            strategy=strategy,
                            packing=args.packing,
                            margin=0.4,
                            max_partitions=2,
                            time_limit_s=args.time_limit,
                        ),
                    )
                )
    for name in singles:
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

    print_main(results, args.packing)
    print_singles(results)
    print_summary(results)
    store(results, args)
    return 0


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
    proven = sum(p.solver.status == "optimal" and p.solver.gap <= 1e-4 for _, p in results)
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
                    "objective": plan.objective,
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
