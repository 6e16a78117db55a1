"""Load-proportional packing: the reservation plane, where of equally good vGPUs the
lowest-numbered takes the batch (adaptive.PACK), against `spread`, where equally good vGPUs
take turns (each pool's scan starts after its last choice). The paper's six groups at the
maf19 mix, ppipe and np planned (fluid MILP, margin 0.4) on each of --clusters, simulated
(Poisson) with each plane:

- capacity: per model, the largest load factor (of the plan's throughput, grid --step)
  with >= 99% of its requests on time, on seeds 11 and 12 (--duration s each);
- at each of --loads (shares of the least model capacity `spread` found; seed 5): the
  plan's GPUs that ran no stage at all (they could be given back without a new plan), the
  GPU-time busy (GPU-equivalents), and the share of requests on time.

Prints a row per plan and a summary, and appends the rows to the warehouse (bench_serving,
bench "packing").

    ./run bench-packing [--clusters hc2-small,hc2-large] [--groups 1,2,3,4,5,6]
                        [--loads 0.1,0.3,0.5,0.9] [--duration 30] [--step 0.02]
"""

from __future__ import annotations

import argparse
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
PLANES = ("spread", "reservation")
CAPACITY_SEEDS = (11, 12)
LOAD_SEED = 5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--clusters", default="hc2-small,hc2-large")
    ap.add_argument("--groups", default="1,2,3,4,5,6", help="the paper's groups, from 1")
    ap.add_argument(
        "--loads", default="0.1,0.3,0.5,0.9", help="shares of the capacity (0.1,0.3,0.5,0.9)"
    )
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
        ap.error(f"--groups / --loads: {args.groups!r} / {args.loads!r} are not lists of numbers")
    names = [c.strip() for c in args.clusters.split(",") if c.strip()]
    for c in names:
        if c not in clusters:
            ap.error(f"--clusters: no cluster {c!r} in {args.profiles / 'clusters.toml'}")
    for g in groups:
        if not 1 <= g <= len(wl["groups"]):
            ap.error(f"--groups: {g} is not a group (1..{len(wl['groups'])})")
    if any(not 0 < x <= 1 for x in loads):
        ap.error(f"--loads must be in (0, 1], got {args.loads}")
    arrivals = ArrivalSpec.parse("poisson")
    rows = BenchRows(args.label)
    table = Table(
        title="Packing: reservation (of equally good vGPUs the lowest-numbered takes the "
        "batch) vs spread (they take turns); simulated, Poisson; capacity on seeds "
        f"{CAPACITY_SEEDS}, {args.duration:g} s each; loads as shares of spread's least "
        "model capacity"
    )
    for col in ("cluster", "group", "plan", "GPUs", "capacity spread", "capacity reservation"):
        table.add_column(col)
    for x in loads:
        table.add_column(f"GPUs idle at {x:g} (spread -> reservation)")
    table.add_column("on time, lowest (spread -> reservation)")
    idle: dict[tuple[str, float], int] = {(p, x): 0 for p in PLANES for x in loads}
    gpus_total = 0
    worst = {p: 1.0 for p in PLANES}
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
                used = {f"{v.gpu}#{v.physical}" for v in topo.vgpus}
                gpus_total += len(used)
                cap: dict[str, list[float]] = {}
                at: dict[str, list[tuple[int, float, float]]] = {}
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
                    at[plane] = []
                    for x in loads:
                        lf = x * min(cap["spread"])
                        r = run_once(
                            topo,
                            arrivals,
                            lf,
                            SimConfig(duration_s=args.duration, seed=LOAD_SEED),
                            plane,
                        )
                        n_idle = sum(1 for k in used if r.gpu_busy.get(k, 0.0) == 0.0)
                        busy = sum(r.gpu_busy.get(k, 0.0) for k in used)
                        least = min(m.attainment for m in r.models)
                        at[plane].append((n_idle, busy, least))
                        idle[plane, x] += n_idle
                        worst[plane] = min(worst[plane], least)
                        cfg = f"{config} {plane} load {x:g}"
                        rows.record("packing", cfg, "gpus_idle", n_idle)
                        rows.record("packing", cfg, "gpus_in_plan", len(used))
                        rows.record("packing", cfg, "gpu_equivalents_busy", busy)
                        rows.record("packing", cfg, "on_time_least_model", least)
                    for k, m in enumerate(topo.models):
                        rows.record(
                            "packing",
                            f"{config} {m.name} {plane}",
                            "capacity_load_factor",
                            cap[plane][k],
                        )
                for k, m in enumerate(topo.models):
                    compared += 1
                    if cap["spread"][k] != cap["reservation"][k]:
                        moved.append(
                            f"{config} {m.name}: {cap['spread'][k]:g} -> {cap['reservation'][k]:g}"
                        )
                table.add_row(
                    cluster,
                    str(g),
                    strategy,
                    str(len(used)),
                    "/".join(f"{v:g}" for v in cap["spread"]),
                    "/".join(f"{v:g}" for v in cap["reservation"]),
                    *(
                        f"{at['spread'][i][0]} -> {at['reservation'][i][0]} "
                        f"(busy {at['reservation'][i][1]:.1f})"
                        for i in range(len(loads))
                    ),
                    f"{min(a[2] for a in at['spread']):.4f} -> "
                    f"{min(a[2] for a in at['reservation']):.4f}",
                )
                console.print(f"  {config}: done ({time.monotonic() - started:.0f} s)")
    console.print(table)
    for x in loads:
        console.print(
            f"at {x:g} of capacity: GPUs idle, of {gpus_total} in the plans: "
            f"spread {idle['spread', x]}, reservation {idle['reservation', x]}"
        )
    console.print(
        "lowest share on time of any model at any load: "
        + ", ".join(f"{p} {worst[p]:.4f}" for p in PLANES)
    )
    console.print(
        f"capacity moved for {len(moved)} of {compared} models (grid {args.step:g})"
        + ("".join(f"\n  {line}" for line in moved) if moved else "")
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'packing')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
