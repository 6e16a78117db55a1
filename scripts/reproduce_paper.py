"""Reproduce the paper's comparison with correct accounting (a late completion is a miss):
for the 24 main configurations (hc1..hc4-large x 6 groups, maf19 mix, P=2, margin 0.4) plan
with ppipe / np / dart-r, search each model's capacity (np and dart-r at the ppipe plan's
absolute rates), and write a table plus figures:

    fig6_capacity.png       mean capacity per cluster and strategy (the paper's Fig. 6)
    fig7_attainment.png     attainment versus load for one group (Fig. 7)
    fig8_utilization.png    high- and low-class GPU utilization at load 0.9 (Fig. 8)
    ablation_reactive.png   reactive vs reservation data plane on hc2-large (§7.4)

    ./run reproduce-paper [--quick] [--out results/] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.plan import STRATEGIES
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.scheduler import build_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.sim.capacity import search_capacity
from poolpipe.sim.records import capacity_rows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)
CLUSTERS = ("hc1-large", "hc2-large", "hc3-large", "hc4-large")
CURVE_LOADS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))  # Fig. 7: 0.5 .. 1.0


def _job(spec: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One configuration: plan with every strategy, then capacity (and extras) per strategy."""
    root = Path(spec["profiles"])
    profiles = {p.name: p for p in load_ppipe_dir(root)}
    cluster = load_clusters(root / "clusters.toml")[spec["cluster"]]
    group = spec["group"]
    arrivals = ArrivalSpec.parse(spec["arrivals"])
    out: dict[str, Any] = {
        "config": spec["config"],
        "cluster": spec["cluster"],
        "group": spec["gi"],
        "models": group,
        "strategies": {},
    }
    topos = {}
    rows: list[dict[str, Any]] = []
    for strategy in STRATEGIES:
        plan = make_plan(
            PlanRequest(
                models=tuple(profiles[n] for n in group),
                weights=tuple(spec["weights"]),
                slos_us=tuple(spec["slo_scale"] * profiles[n].reference_latency_us for n in group),
                cluster=cluster,
                strategy=strategy,
                packing="per-position",
                margin=0.4,
                max_partitions=2,
                delivery="off",  # the published planner's plans, compared by simulation
            )
        )
        topos[strategy] = (plan, build_topology(plan, profiles, larger_batches=True))
    rates = [m.throughput for m in topos["ppipe"][0].models]
    high, low = cluster.pools[0].gpu, cluster.pools[1].gpu
    planes = ["reservation", "reactive"] if spec["ablation"] else ["reservation"]
    for strategy, (plan, topo) in topos.items():
        entry: dict[str, Any] = {"objective": plan.objective}
        for plane in planes if strategy == "ppipe" else ["reservation"]:
            cap = search_capacity(
                topo,
                arrivals,
                duration_s=spec["duration"],
                seeds=spec["seeds"],
                data_plane=plane,
                reference_rates=rates,
                method=spec["search"],
            )
            entry[f"capacity_{plane}"] = cap.capacity
            entry[f"points_{plane}"] = {f"{k:g}": v for k, v in sorted(cap.attainment.items())}
            rows += capacity_rows(
                cap,
                label=spec["label"],
                config=spec["config"],
                strategy=strategy,
                cluster=spec["cluster"],
                data_plane=plane,
                arrivals=arrivals.describe(),
                search=spec["search"],
                seeds=spec["seeds"],
                duration_s=spec["duration"],
            )
        util = run_once(
            topo,
            arrivals,
            0.9,
            SimConfig(spec["duration"], seed=spec["seeds"][0]),
            "reservation",
            rates,
        )
        entry["util_high"] = util.utilization.get(high, 0.0)
        entry["util_low"] = util.utilization.get(low, 0.0)
        if spec["curve"]:
            entry["curve"] = {
                f"{lf:g}": run_once(
                    topo, arrivals, lf, SimConfig(spec["duration"], seed=s), "reservation", rates
                ).attainment
                for lf in CURVE_LOADS
                for s in spec["seeds"][:1]
            }
        out["strategies"][strategy] = entry
    return out, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--arrivals", default="poisson", help="poisson | gamma:CV | trace")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated s per point (30)")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--search", choices=("step", "bisect"), default="bisect")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 configurations, 5 s per point")
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="reproduce")
    args = ap.parse_args()

    workloads = tomllib.loads((args.profiles / "workloads.toml").read_text())
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = [(gi, g, c) for c in CLUSTERS for gi, g in enumerate(workloads["groups"])]
    if args.quick:
        configs = [
            (2, workloads["groups"][2], "hc2-large"),
            (0, workloads["groups"][0], "hc1-large"),
        ]
    duration = 5.0 if args.quick else args.duration
    specs = [
        {
            "profiles": str(args.profiles),
            "cluster": c,
            "group": g,
            "gi": gi,
            "config": f"g{gi}:{c}",
            "weights": workloads["mixes"]["maf19"],
            "slo_scale": float(workloads.get("slo_scale", 5)),
            "arrivals": args.arrivals,
            "duration": duration,
            "seeds": seeds,
            "search": args.search,
            "ablation": c == "hc2-large",
            "curve": c == "hc2-large" and gi == 2,
            "label": args.label,
        }
        for gi, g, c in configs
    ]
    results = []
    rows: list[dict[str, Any]] = []  # capacity_results rows, stored in one transaction
    with Progress(console=console) as progress, ProcessPoolExecutor(args.workers) as pool:
        task = progress.add_task("configurations", total=len(specs))
        futures = [pool.submit(_job, s) for s in specs]
        for f in as_completed(futures):
            result, job_rows = f.result()
            results.append(result)
            rows += job_rows
            progress.advance(task)
    results.sort(key=lambda r: (CLUSTERS.index(r["cluster"]), r["group"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reproduce.json").write_text(json.dumps(results, indent=1))
    _table(results)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("capacity_results", rows)
    _figures(results, args.out)
    console.print(f"wrote {args.out}/reproduce.json and figures")
    return 0


def _mean_cap(entry: dict[str, Any], plane: str = "reservation") -> float:
    caps = entry[f"capacity_{plane}"]
    return statistics.mean(caps.values())


def _table(results: list[dict[str, Any]]) -> None:
    t = Table(
        title="capacity at 99% attainment (late completions are misses), mean over models",
        title_justify="left",
    )
    for col in ("config", "ppipe", "np", "dart-r", "ppipe/np", "ppipe/dart-r", "reactive"):
        t.add_column(col, justify="left" if col == "config" else "right")
    sums: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for r in results:
        caps = {s: _mean_cap(r["strategies"][s]) for s in STRATEGIES}
        for s in STRATEGIES:
            sums[s].append(caps[s])
        reactive = r["strategies"]["ppipe"].get("capacity_reactive")
        t.add_row(
            r["config"],
            *(f"{caps[s]:.3f}" for s in STRATEGIES),
            f"{caps['ppipe'] / caps['np']:.2f}×" if caps["np"] else "∞",
            f"{caps['ppipe'] / caps['dart-r']:.2f}×" if caps["dart-r"] else "∞",
            f"{statistics.mean(reactive.values()):.3f}" if reactive else "",
        )
    t.add_section()
    avg = {s: statistics.mean(v) for s, v in sums.items()}
    t.add_row(
        "average",
        *(f"{avg[s]:.3f}" for s in STRATEGIES),
        f"{avg['ppipe'] / avg['np'] - 1:+.1%}" if avg["np"] else "",
        f"{avg['ppipe'] / avg['dart-r'] - 1:+.1%}" if avg["dart-r"] else "",
        "",
    )
    console.print(t)


def _figures(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = [c for c in CLUSTERS if any(r["cluster"] == c for r in results)]
    width = 0.25
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, s in enumerate(STRATEGIES):
        vals = [
            statistics.mean(_mean_cap(r["strategies"][s]) for r in results if r["cluster"] == c)
            for c in clusters
        ]
        ax.bar([x + (i - 1) * width for x in range(len(clusters))], vals, width, label=s)
    ax.set_xticks(range(len(clusters)), clusters)
    ax.set_ylabel("capacity (load factor, ≥99% on time)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig6_capacity.png", dpi=120)
    plt.close(fig)

    curve = next((r for r in results if "curve" in r["strategies"]["ppipe"]), None)
    if curve is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for s in STRATEGIES:
            pts = curve["strategies"][s]["curve"]
            ax.plot([float(k) for k in pts], list(pts.values()), marker="o", label=s)
        ax.axhline(0.99, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("load factor (× ppipe plan throughput)")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{curve['config']}: " + ", ".join(m.split("_")[0] for m in curve["models"]))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "fig7_attainment.png", dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, s in enumerate(STRATEGIES):
        hi = statistics.mean(r["strategies"][s]["util_high"] for r in results)
        lo = statistics.mean(r["strategies"][s]["util_low"] for r in results)
        ax.bar(
            [
                i - 0.2,
            ],
            [hi],
            0.4,
            color="tab:blue",
            label="high class" if i == 0 else None,
        )
        ax.bar([i + 0.2], [lo], 0.4, color="tab:orange", label="low class" if i == 0 else None)
    ax.set_xticks(range(len(STRATEGIES)), STRATEGIES)
    ax.set_ylabel("temporal GPU utilization at load 0.9")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig8_utilization.png", dpi=120)
    plt.close(fig)

    abl = [r for r in results if "capacity_reactive" in r["strategies"]["ppipe"]]
    if abl:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(abl))
        ax.bar(
            [x - 0.2 for x in xs],
            [_mean_cap(r["strategies"]["ppipe"]) for r in abl],
            0.4,
            label="reservation",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [_mean_cap(r["strategies"]["ppipe"], "reactive") for r in abl],
            0.4,
            label="reactive",
        )
        ax.set_xticks(list(xs), [r["config"] for r in abl], rotation=30)
        ax.set_ylabel("ppipe capacity")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ablation_reactive.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
