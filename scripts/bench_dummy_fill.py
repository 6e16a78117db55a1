"""Piccolo's dummy requests, measured: every batch below its pipeline's planned batch filled
up to it with dummy requests (scheduler/topology.py's `filled`: each stage runs, and is
reserved for, the planned batch's latency), against batches as they come (the reservation
plane, default). Piccolo fills a configuration's residual capacity so that its batching
keeps its timing at a low load; poolpipe's data plane times every batch by its own size
(its pools know their latency at every batch up to the planned one), so what the filling
adds is GPU time.

The paper's --groups at the maf19 mix, ppipe and np planned (fluid MILP, margin 0.4) on
each of --clusters, simulated (Poisson, seed 5, --duration s) with and without filling at
each of --loads (of each plan's throughput): on time, latency p50 / p99 as shares of each
model's SLO, and the GPUs' busy time (a share of the GPUs the plan uses); and each plan's
capacity (the least model's largest load factor with >= 99% on time, seeds 11 and 12,
grid --step) with and without.

Prints a row per plan and load and a summary per load; stores the rows in the warehouse
(bench_serving, bench "dummy-fill").

    ./run bench-dummy-fill [--clusters hc2-small,hc2-large] [--groups 1,2,3,4,5,6]
                           [--loads 0.1,0.3,0.5,0.9] [--duration 30] [--step 0.02]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import make_plan
from poolpipe.planner.request import group_request
from poolpipe.scheduler.topology import filled, simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.sim.capacity import search_capacity
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)
KINDS = ("as they come", "filled")
CAPACITY_SEEDS = (11, 12)
SEED = 5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--clusters", default="hc2-small,hc2-large")
    ap.add_argument("--groups", default="1,2,3,4,5,6", help="the paper's groups, from 1")
    ap.add_argument("--loads", default="0.1,0.3,0.5,0.9", help="load factors (0.1,0.3,0.5,0.9)")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated s per run (30)")
    ap.add_argument("--step", type=float, default=0.02, help="capacity grid (0.02)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    wl = tomllib.loads((args.profiles / "workloads.toml").read_text())
    mix = tuple(wl["mixes"]["maf19"])
    try:
        groups = [int(g) for g in args.groups.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        ap.error(f"--groups {args.groups!r} and --loads {args.loads!r} must be lists of numbers")
    names = [c.strip() for c in args.clusters.split(",") if c.strip()]
    for c in names:
        if c not in clusters:
            ap.error(f"--clusters: no cluster {c!r} in {args.profiles / 'clusters.toml'}")
    for g in groups:
        if not 1 <= g <= len(wl["groups"]):
            ap.error(f"--groups: {g} is not a group (1..{len(wl['groups'])})")
    if any(not 0 < x <= 1.5 for x in loads):
        ap.error(f"--loads must be load factors in (0, 1.5], got {args.loads}")
    arrivals = ArrivalSpec.parse("poisson")
    rows = BenchRows(args.label)
    table = Table(
        title="Dummy requests (Piccolo): batches as they come -> filled to the planned batch; "
        f"simulated, Poisson, {args.duration:g} s (seed {SEED}); capacity on seeds "
        f"{CAPACITY_SEEDS}",
        title_justify="left",
    )
    for col in ("cluster", "group", "plan", "capacity", "load", "on time", "p50/SLO", "p99/SLO",
                "GPU busy"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    summary: dict[float, dict[str, list[float]]] = {
        x: {k: [] for k in ("on0", "on1", "busy0", "busy1", "p50_0", "p50_1")} for x in loads
    }
    caps: dict[str, list[float]] = {k: [] for k in KINDS}
    started = time.monotonic()
    for cluster in names:
        for g in groups:
            group = wl["groups"][g - 1]
            for strategy in ("ppipe", "np"):
                req = group_request(profiles, group, mix, clusters[cluster], strategy, "per-share")
                plain = simulated_topology(make_plan(req), profiles)
                topos = dict(zip(KINDS, (plain, filled(plain)), strict=True))
                used = len({(v.gpu, v.physical) for v in plain.vgpus})
                config = f"{cluster} g{g} {strategy}"
                cap = {}
                for kind, topo in topos.items():
                    c = search_capacity(
                        topo, arrivals, duration_s=args.duration, seeds=CAPACITY_SEEDS,
                        method="bisect", step=args.step,
                    )  # fmt: skip
                    cap[kind] = min(c.capacity.values())
                    caps[kind].append(cap[kind])
                    rows.record("dummy-fill", f"{config} {kind}", "capacity_load_factor",
                                cap[kind])  # fmt: skip
                for k, load in enumerate(loads):
                    got = {}
                    for kind, topo in topos.items():
                        r = run_once(
                            topo, arrivals, load, SimConfig(duration_s=args.duration, seed=SEED)
                        )
                        slo = {m.name: m.slo_us for m in topo.models}
                        got[kind] = (
                            r.attainment,
                            statistics.median(m.latency_p50_us / slo[m.name] for m in r.models),
                            max(m.latency_p99_us / slo[m.name] for m in r.models),
                            sum(r.gpu_busy.values()) / used,
                        )
                        cfg = f"{config} {kind} load {load:g}"
                        for metric, value in zip(
                            ("on_time", "p50_slo_median", "p99_slo_max", "gpu_busy_share"),
                            got[kind],
                            strict=True,
                        ):
                            rows.record("dummy-fill", cfg, metric, value)
                    s = summary[load]
                    for j, kind in enumerate(KINDS):
                        s[f"on{j}"].append(got[kind][0])
                        s[f"p50_{j}"].append(got[kind][1])
                        s[f"busy{j}"].append(got[kind][3])
                    a, b = got[KINDS[0]], got[KINDS[1]]
                    table.add_row(
                        cluster if k == 0 else "",
                        str(g) if k == 0 else "",
                        strategy if k == 0 else "",
                        f"{cap[KINDS[0]]:.2f} -> {cap[KINDS[1]]:.2f}" if k == 0 else "",
                        f"{load:g}",
                        f"{a[0]:.4f} -> {b[0]:.4f}",
                        f"{a[1]:.2f} -> {b[1]:.2f}",
                        f"{a[2]:.2f} -> {b[2]:.2f}",
                        f"{a[3]:.1%} -> {b[3]:.1%}",
                    )
                console.print(f"  {config}: done ({time.monotonic() - started:.0f} s)")
    console.print(table)
    n = len(caps[KINDS[0]])
    lower = sum(1 for a, b in zip(caps[KINDS[0]], caps[KINDS[1]], strict=True) if b < a)
    higher = sum(1 for a, b in zip(caps[KINDS[0]], caps[KINDS[1]], strict=True) if b > a)
    for load, s in summary.items():
        console.print(
            f"load {load:g}, over {n} plans (as they come -> filled): on time mean "
            f"{statistics.mean(s['on0']):.4f} -> {statistics.mean(s['on1']):.4f}, worst "
            f"{min(s['on0']):.4f} -> {min(s['on1']):.4f}; p50/SLO median "
            f"{statistics.median(s['p50_0']):.2f} -> {statistics.median(s['p50_1']):.2f}; GPU "
            f"busy mean {statistics.mean(s['busy0']):.1%} -> {statistics.mean(s['busy1']):.1%}",
            highlight=False,
        )
    console.print(
        f"capacity: filled lower for {lower}, higher for {higher} of {n} plans (grid "
        f"{args.step:g}); {time.monotonic() - started:.0f} s in all",
        highlight=False,
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'dummy-fill')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
