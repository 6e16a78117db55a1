"""Scheduler benchmark: scheduling time and probes per dispatched batch, and simulator speed,
for ppipe plans of the paper's groups on the 100-GPU hc2-large cluster near capacity, then
group 2 planned for the cluster scaled to each of --sizes GPUs (same type ratio and GPUs
per server) at load 0.9: how the hot path's cost grows with the pools. A plan made for a
larger cluster has another shape (more pipelines per model, other batches: more probes and
decisions per request), so the same rows follow for the smallest size's plan replicated
(every pool k times the vGPUs on a cluster k times as large): the cost of size alone.
The scaling runs go in --rounds rounds, every size once per round: a shared machine's speed
moves between minutes, so each round's ratios come from runs back to back, and the table
shows each configuration's median round and the median of the rounds' ratios.
Prints which build
ran (the compiled hot path, or the sources and why), tables, and appends rows to the
warehouse (bench_scheduler).

    ./run bench-scheduler [--quick] [--load-factors 0.9,1.0] [--sizes 100,400,1000]
                          [--rounds 3] [--data-plane reservation]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tomllib
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from poolpipe import native
from poolpipe.domain.cluster import Cluster, load_clusters
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import make_plan
from poolpipe.planner.request import group_request
from poolpipe.scheduler import CHECK_PLANES, DATA_PLANES, Topology, build_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--cluster", default="hc2-large")
    ap.add_argument("--load-factors", default="0.9,1.0")
    ap.add_argument("--data-plane", choices=DATA_PLANES + CHECK_PLANES, default="reservation")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument(
        "--sizes",
        default=None,
        help="GPU counts the scaling table plans group 2 for (100,400,1000; --quick: "
        "100,400; '' for none)",
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="rounds of the scaling runs (3; --quick: 1)"
    )
    ap.add_argument("--quick", action="store_true", help="2 groups, 10 s")
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()

    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    cluster = clusters[args.cluster]
    workloads = tomllib.loads((args.profiles / "workloads.toml").read_text())
    groups = workloads["groups"][:2] if args.quick else workloads["groups"]
    duration = 10.0 if args.quick else args.duration
    lfs = [float(x) for x in args.load_factors.split(",")]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    if args.sizes is None:
        args.sizes = "100,400" if args.quick else "100,400,1000"
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: give GPU counts, like 100,400,1000")
    build = native.status()
    console.print(f"hot path: {build}")
    mix = workloads["mixes"]["maf19"]

    laid_out: dict[tuple[tuple[str, ...], str], Topology] = {}  # planned once per cluster

    def measure(config: str, group: list[str], on: Cluster, lf: float, times: int = 0) -> dict:
        key = (tuple(group), on.name, times)
        if key not in laid_out:
            plan = make_plan(group_request(profiles, group, mix, on))
            if times:  # the plan for `on`, replicated
                plan = replicated(plan, times)
            laid_out[key] = build_topology(plan, profiles, larger_batches=True)
        topo = laid_out[key]
        sim = SimConfig(duration, seed=1)
        res = run_once(topo, ArrivalSpec("poisson"), lf, sim, args.data_plane)
        row = {
            "run_at": datetime.now(UTC).replace(tzinfo=None),
            "run_label": args.label,
            "config": config,
            "data_plane": args.data_plane,
            "load_factor": lf,
            "vgpus": len(topo.vgpus),
            "requests": res.arrived,
            "batches": res.batches,
            "probes_per_batch": res.probes_per_batch,
            "sched_us_median": res.sched_us_per_batch_median,
            "sched_us_mean": res.sched_us_per_batch_mean,
            "sim_requests_per_wall_s": res.requests_per_wall_s,
            "attainment": res.attainment,
            "host": socket.gethostname(),
            "build": build,
        }
        return row

    table = new_table(
        f"scheduler on {args.cluster} ({args.data_plane}, Poisson, {duration:g} s simulated)"
    )
    rows = [
        measure(f"g{gi}:{args.cluster}", group, cluster, lf)
        for gi, group in enumerate(groups)
        for lf in lfs
    ]
    for row in rows:
        add_row(table, row)
    console.print(table)
    console.print(
        f"median of medians {statistics.median(r['sched_us_median'] for r in rows):.1f} µs per "
        f"batch; probes per batch {statistics.mean(r['probes_per_batch'] for r in rows):.2f}; "
        f"simulator {statistics.median(r['sim_requests_per_wall_s'] for r in rows):,.0f} "
        "requests per wall second (median)"
    )
    if sizes:
        group = workloads["groups"][2]
        scaling = new_table(
            f"group 2 on {args.cluster} scaled ({args.data_plane}, load 0.9, {duration:g} s "
            "simulated)"
        )
        def sized(n: int) -> Cluster:
            return cluster if n == cluster.total_gpus else cluster.scaled(n)

        small = sized(sizes[0])
        configs = []  # (config, cluster, replicated k times or 0)
        for n in sizes:
            on = sized(n)
            configs.append((f"g2:{on.name}", on, 0))
            if n != sizes[0] and n % sizes[0] == 0:
                k = n // sizes[0]
                configs.append((f"g2:{small.name} plan x{k}", small, k))
        runs: dict[str, list[dict]] = {c: [] for c, _, _ in configs}
        in_rounds = [cfg for _ in range(args.rounds) for cfg in configs]
        for c, on, k in track(
            in_rounds,
            f"planning and simulating each size, {args.rounds} round(s)",
            console=console,
            transient=True,
        ):
            runs[c].append(measure(c, group, on, 0.9, k))
        base_config = configs[0][0]
        for c, _, _ in configs:  # each configuration's median round
            by_speed = sorted(runs[c], key=lambda r: r["sim_requests_per_wall_s"])
            add_row(scaling, by_speed[(len(by_speed) - 1) // 2])
        console.print(scaling)
        for c, _, _ in configs[1:]:
            ratios = [
                b["sim_requests_per_wall_s"] / r["sim_requests_per_wall_s"]
                for b, r in zip(runs[base_config], runs[c], strict=True)
            ]
            each = f" (rounds: {' / '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
            console.print(
                f"{c}: {statistics.median(ratios):.2f}x the wall time per simulated request of "
                f"{base_config}{each}"
            )
        rows += [r for c, _, _ in configs for r in runs[c]]
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_scheduler", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_scheduler)")
    return 0


def add_row(table: Table, row: dict) -> None:
    table.add_row(
        row["config"],
        f"{row['load_factor']:g}",
        str(row["vgpus"]),
        f"{row['requests']:,}",
        f"{row['batches']:,}",
        f"{row['probes_per_batch']:.2f}",
        f"{row['sched_us_median']:.1f}",
        f"{row['sched_us_mean']:.1f}",
        f"{row['sim_requests_per_wall_s']:,.0f}",
        f"{row['attainment']:.4f}",
    )


def replicated(plan: Plan, k: int) -> Plan:
    """`plan` with every partition's vGPUs (and so every rate) k times, on its cluster
    scaled k times (the same GPUs per server: the pools' servers k times as many)."""
    models = tuple(
        replace(
            m,
            throughput=m.throughput * k,
            est_throughput=None if m.est_throughput is None else m.est_throughput * k,
            pipelines=tuple(
                replace(
                    p,
                    throughput=p.throughput * k,
                    partitions=tuple(replace(q, vgpus=q.vgpus * k) for q in p.partitions),
                )
                for p in m.pipelines
            ),
        )
        for m in plan.models
    )
    return replace(plan, cluster=plan.cluster.scaled(plan.cluster.total_gpus * k), models=models)


def new_table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (
        "config",
        "load",
        "vGPUs",
        "requests",
        "batches",
        "probes/batch",
        "µs/batch median",
        "µs/batch mean",
        "sim req/wall s",
        "attainment",
    ):
        table.add_column(col, justify="left" if col == "config" else "right")
    return table


if __name__ == "__main__":
    sys.exit(main())
