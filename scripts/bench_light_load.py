"""Latency that follows the load: the reservation plane, which sends a short batch at once
where the load does not need batches (adaptive.LIGHT_LOAD), against `holding`, which holds
every short batch for its last moment (the published plane). The paper's six groups at the
maf19 mix, ppipe and np planned (fluid MILP, margin 0.4) on each of --clusters, simulated
(Poisson) with each plane:

- capacity: per model, the largest load factor (of the plan's throughput, grid --step)
  with >= 99% of its requests on time, on seeds 11 and 12 (--duration s each);
- at a light load (--light of the plan's throughput) and near saturation (0.9 of the
  least model capacity `holding` found): on time, and latency p50 / p99 as shares of each
  model's SLO (seed 5).

Prints a row per plan and a summary (models whose capacity moved, p50 at the light load),
and appends the rows to the warehouse (bench_serving, bench "light-load").

With --live (real tritonserver nodes on this machine, nothing emulated): bench-serving's
model (ResNet-50 at 64 px, onboarded and profiled here) in its two-partition plan at batch 4
(cpu-2t -> cpu-1t, SLO --slo-ms), served with each plane in turn; Poisson traces at each of
--live-rates req/s for --live-duration s: on time and p50 / p99 as the client measured them.

    ./run bench-light-load [--clusters hc2-small,hc2-large] [--groups 1,2,3,4,5,6]
                           [--light 0.1] [--duration 30] [--step 0.02]
                           [--live [--live-rates 5,40] [--live-duration 20] [--slo-ms 100]]
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
from poolpipe.scheduler.topology import simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.sim.capacity import search_capacity
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)
PLANES = ("holding", "reservation")
CAPACITY_SEEDS = (11, 12)
LATENCY_SEED = 5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--clusters", default="hc2-small,hc2-large")
    ap.add_argument("--groups", default="1,2,3,4,5,6", help="the paper's groups, from 1")
    ap.add_argument("--light", type=float, default=0.1, help="light load factor (0.1)")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated s per run (30)")
    ap.add_argument("--step", type=float, default=0.02, help="capacity grid (0.02)")
    ap.add_argument("--live", action="store_true", help="also serve live (module docstring)")
    ap.add_argument("--live-rates", default="5,40", help="live req/s (5,40)")
    ap.add_argument("--live-duration", type=float, default=20.0, help="s per live rate (20)")
    ap.add_argument("--slo-ms", type=float, default=100.0, help="the live plan's SLO (100)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    wl = tomllib.loads((args.profiles / "workloads.toml").read_text())
    mix = tuple(wl["mixes"]["maf19"])
    try:
        groups = [int(g) for g in args.groups.split(",")]
        names = [c.strip() for c in args.clusters.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--groups: {args.groups!r} is not a list of numbers such as 1,2,3")
    for c in names:
        if c not in clusters:
            ap.error(f"--clusters: no cluster {c!r} in {args.profiles / 'clusters.toml'}")
    for g in groups:
        if not 1 <= g <= len(wl["groups"]):
            ap.error(f"--groups: {g} is not a group (1..{len(wl['groups'])})")
    if not 0 < args.light < 1:
        ap.error(f"--light must be in (0, 1), got {args.light}")
    try:
        live_rates = [float(r) for r in args.live_rates.split(",")]
    except ValueError:
        ap.error(f"--live-rates: {args.live_rates!r} is not a list of req/s such as 5,40")
    if any(not r > 0 for r in live_rates):
        ap.error(f"--live-rates must be above 0, got {args.live_rates}")
    arrivals = ArrivalSpec.parse("poisson")
    rows = BenchRows(args.label)
    table = Table(
        title="Light load: reservation (sends a short batch at once where the load needs no "
        "batches) vs holding (every short batch held for its last moment); simulated, "
        f"Poisson; capacity on seeds {CAPACITY_SEEDS}, {args.duration:g} s each"
    )
    for col in ("cluster", "group", "plan", "batches", "capacity holding", "capacity reservation"):
        table.add_column(col)
    for col in (f"p50/SLO at {args.light:g}", "p99/SLO at 0.9 cap", "on time at 0.9 cap"):
        table.add_column(col + " (holding -> reservation)")
    p50s: dict[str, list[float]] = {p: [] for p in PLANES}
    moved: list[str] = []
    compared = 0
    started = time.monotonic()
    for cluster in names:
        for g in groups:
            group = wl["groups"][g - 1]
            for strategy in ("ppipe", "np"):
                req = group_request(profiles, group, mix, clusters[cluster], strategy, "per-share")
                topo = simulated_topology(make_plan(req), profiles)
                config = f"{cluster} g{g} {strategy}"
                cap: dict[str, list[float]] = {}
                light: dict[str, list[float]] = {}
                near: dict[str, list[tuple[float, float]]] = {}
                for plane in PLANES:
                    c = search_capacity(
                        topo,
                        arrivals,
                        duration_s=args.duration,
                        seeds=CAPACITY_SEEDS,
                        data_plane=plane,
                        method="bisect",
                        step=args.step,
                    )
                    cap[plane] = [c.capacity[m.name] for m in topo.models]
                    lf_near = 0.9 * min(cap["holding"])
                    runs = {
                        lf: run_once(
                            topo,
                            arrivals,
                            lf,
                            SimConfig(duration_s=args.duration, seed=LATENCY_SEED),
                            plane,
                        )
                        for lf in (args.light, lf_near)
                    }
                    light[plane] = [
                        r.latency_p50_us / m.slo_us
                        for r, m in zip(runs[args.light].models, topo.models, strict=True)
                    ]
                    near[plane] = [
                        (r.latency_p99_us / m.slo_us, r.on_time / r.arrived if r.arrived else 1.0)
                        for r, m in zip(runs[lf_near].models, topo.models, strict=True)
                    ]
                    p50s[plane] += light[plane]
                    for k, m in enumerate(topo.models):
                        cfg = f"{config} {m.name} {plane}"
                        rows.record("light-load", cfg, "capacity_load_factor", cap[plane][k])
                        rows.record(
                            "light-load", cfg, f"p50_slo_at_{args.light:g}", light[plane][k]
                        )
                        rows.record("light-load", cfg, "p99_slo_near_capacity", near[plane][k][0])
                        rows.record("light-load", cfg, "on_time_near_capacity", near[plane][k][1])
                for k, m in enumerate(topo.models):
                    compared += 1
                    if cap["holding"][k] != cap["reservation"][k]:
                        moved.append(
                            f"{config} {m.name}: {cap['holding'][k]:g} -> {cap['reservation'][k]:g}"
                        )

                def cells(x: dict[str, list[float]]) -> str:
                    return (
                        "/".join(f"{v:.2f}" for v in x["holding"])
                        + " -> "
                        + "/".join(f"{v:.2f}" for v in x["reservation"])
                    )

                table.add_row(
                    cluster,
                    str(g),
                    strategy,
                    ",".join(str(b) for b in sorted({p.batch for p in topo.pipelines})),
                    "/".join(f"{v:g}" for v in cap["holding"]),
                    "/".join(f"{v:g}" for v in cap["reservation"]),
                    cells(light),
                    cells({p: [v[0] for v in near[p]] for p in PLANES}),
                    cells({p: [v[1] for v in near[p]] for p in PLANES}),
                )
                console.print(f"  {config}: done ({time.monotonic() - started:.0f} s)")
    console.print(table)
    for plane in PLANES:
        x = p50s[plane]
        console.print(
            f"{plane}: p50 at load {args.light:g}, as a share of the SLO, over {len(x)} "
            f"models: median {statistics.median(x):.2f}, max {max(x):.2f}, "
            f"{sum(v <= 0.5 for v in x)} of {len(x)} at most half"
        )
    console.print(
        f"capacity moved for {len(moved)} of {compared} models (grid {args.step:g})"
        + ("".join(f"\n  {line}" for line in moved) if moved else "")
    )
    if args.live:
        live(args, live_rates, rows)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'light-load')")
    return 0


def live(args: argparse.Namespace, rates: list[float], rows: BenchRows) -> None:
    """The --live part (module docstring)."""
    import numpy as np
    from bench_serving import hand_plan, onboard_bench_model

    from testbed import scratch_dir
    from testbed.loadgen import client_figures, drive, poisson_times
    from triton_backend.deploy.serving import ServingProcess

    tmp = scratch_dir("bench-light-load")
    name = onboard_bench_model(args.warehouse, tmp)
    plan = hand_plan(
        name, [(0, 2, "cpu-2t", 1), (2, 4, "cpu-1t", 1)], 4, args.slo_ms, args.warehouse
    )
    table = Table(
        title=f"Live, real nodes on this machine: {name} in two partitions at batch 4 "
        f"(cpu-2t -> cpu-1t), SLO {args.slo_ms:g} ms, Poisson, {args.live_duration:g} s per rate"
    )
    for col in ("plane", "req/s", "requests", "on time", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right")
    for plane in PLANES:
        with console.status(f"serving with the {plane} plane ..."):
            srv = ServingProcess(
                plan, args.warehouse, tmp / plane, stats_interval_s=3600, plane=plane
            )
        try:
            dep = srv.deployment
            x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
            inputs = {dep.ios[0].inputs[0].name: x}
            drive(dep.grpc_url, name, inputs, poisson_times(10, 2, 0))  # warm-up
            for k, rate in enumerate(rates):
                times = poisson_times(rate, args.live_duration, k + 1)
                shots = drive(dep.grpc_url, name, inputs, times)
                f = client_figures(shots, args.slo_ms / 1e3, args.live_duration)
                table.add_row(
                    plane,
                    f"{rate:g}",
                    str(len(times)),
                    f"{f['attainment']:.3f}",
                    f"{f['p50_ms']:.1f}",
                    f"{f['p99_ms']:.1f}",
                )
                cfg = f"live {name} 2p-b4 {plane} {rate:g}req/s"
                rows.record("light-load", cfg, "on_time", f["attainment"])
                rows.record("light-load", cfg, "p50_ms", f["p50_ms"])
                rows.record("light-load", cfg, "p99_ms", f["p99_ms"])
        finally:
            srv.close()
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
