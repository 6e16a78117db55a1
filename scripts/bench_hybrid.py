"""Hybrid clients' requests entering mid-model (Graft), planned three ways and simulated.

A mix per --clusters entry: for each of --models, one client class per --uplinks rate
(Mbit/s) choosing its entry block by Neurosurgeon's rule (domain/entry.py choose_entry:
the client's blocks at the P4's latencies x --client-slowdown, its feature map uploaded
compressed --compress times, the server's blocks at the L4's over 1 - the plans' margin
0.4), its budget what the SLO
leaves after its blocks and the upload; rates --rates (req/s) in turn over the streams.
The streams are planned (planner/graft.py, cost objective, 1 per GPU-hour, each plan sized
on what it delivers) re-aligned, per fragment (each entry block apart) and as raw input
(every client sending its input with the whole SLO; the upload not counted), and each plan
is simulated at the streams' rates on seeds it was not sized on (--seeds, --duration s).

Prints the mix, then a row per plan: GPUs, cost against the per-fragment and raw plans,
the least stream's share on time (the two seeds pooled), planning time; stores them in the
warehouse (bench_serving, bench "hybrid").

    ./run bench-hybrid [--clusters hc2-large] [--models repvgg-b3,tf_efficientdet_d1,convnext_large]
                       [--uplinks 100,200,400,800,1600] [--rates 40,80,120,160] [--duration 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.entry import EntryStream, choose_entry
from poolpipe.domain.profiles import ModelProfile, load_ppipe_dir
from poolpipe.errors import PoolpipeError
from poolpipe.planner.graft import HOWS, GraftRequest, plan_streams
from poolpipe.sim.apps import app_attainment_at
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)


def mix(
    profiles: dict[str, ModelProfile],
    models: list[str],
    uplinks: list[float],
    rates: list[float],
    slowdown: float,
    compress: float,
) -> list[EntryStream]:
    """The streams of the module doc (a client class whose every entry misses the SLO is
    left out, and said)."""
    out: list[EntryStream] = []
    for m in models:
        p = profiles[m]
        assert p.slo_us is not None and p.input_bytes is not None
        client = p.tables[("P4", 1)].latency_us[:, 0] * slowdown
        server = p.tables[("L4", 1)].latency_us[:, 0]
        upload = [p.input_bytes, *(b / compress for b in p.boundary_bytes)]
        for mbps in uplinks:
            try:
                entry, budget = choose_entry(client, upload, mbps * 1e6 / 8, server, p.slo_us, 0.4)
            except PoolpipeError as e:
                console.print(f"{m} at {mbps:g} Mbit/s left out: {e}", highlight=False)
                continue
            rate = rates[len(out) % len(rates)]
            out.append(EntryStream(f"{m}.{mbps:g}mbps", m, entry, budget, rate, p.slo_us))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--clusters", default="hc2-large")
    ap.add_argument("--models", default="repvgg-b3,tf_efficientdet_d1,convnext_large")
    ap.add_argument("--uplinks", default="100,200,400,800,1600", help="Mbit/s per client class")
    ap.add_argument("--rates", default="40,80,120,160", help="req/s, in turn over the streams")
    ap.add_argument("--client-slowdown", type=float, default=1.0, help="x the P4 latency (1)")
    ap.add_argument("--compress", type=float, default=4.0, help="feature maps uploaded / (4)")
    ap.add_argument("--seeds", default="21,22", help="simulation seeds (21,22)")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated s per seed (30)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    started = time.monotonic()
    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    models = args.models.split(",")
    unknown = [m for m in models if m not in profiles]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not in {args.profiles}")
    streams = mix(
        profiles,
        models,
        [float(x) for x in args.uplinks.split(",")],
        [float(x) for x in args.rates.split(",")],
        args.client_slowdown,
        args.compress,
    )
    table = Table("stream", "entry block", "budget (ms)", "SLO (ms)", "req/s", title="the mix")
    for s in streams:
        table.add_row(
            s.name, str(s.entry), f"{s.budget_us / 1e3:.1f}", f"{s.slo_us / 1e3:.1f}", f"{s.rate:g}"
        )
    console.print(table)
    seeds = [int(x) for x in args.seeds.split(",")]
    rows = BenchRows(args.label)
    for name in args.clusters.split(","):
        if name not in clusters:
            ap.error(f"--clusters: {name} not in {args.profiles / 'clusters.toml'}")
        req = GraftRequest(tuple(streams), profiles, clusters[name])
        plans = {}
        for how in HOWS:
            try:
                plans[how] = plan_streams(req, how, sized=True)
            except PoolpipeError as e:
                console.print(f"{name} {how}: {e}", highlight=False)
        table = Table(
            "plan",
            "GPUs",
            "cost",
            "saved vs per-fragment",
            "saved vs raw",
            "sized (asked / rate)",
            "least stream on time",
            "groups",
            "planning s",
            title=f"{name}: {len(streams)} streams",
        )
        for how, gp in plans.items():
            doc, segs = gp.document()
            on_time = app_attainment_at(
                doc,
                segs,
                gp.request.apps,
                {s.name: s.rate for s in streams},
                seeds=seeds,
                duration_s=args.duration,
            )
            least = min(on_time.values())
            raise_ = max(gp.asked[s.name] / s.rate for s in streams)
            vs = {
                other: f"{1 - gp.cost_per_hour / plans[other].cost_per_hour:+.1%}"
                if other in plans and other != how
                else ""
                for other in ("per-fragment", "raw")
            }
            groups = " ".join(
                f"{g.model.split('_')[0][:8]}{list(g.entries)}"
                for g in gp.groups
                if len(g.entries) > 1
            )
            table.add_row(
                how,
                " + ".join(f"{n} {g}" for g, n in gp.gpus.items()),
                f"{gp.cost_per_hour:g}",
                vs["per-fragment"],
                vs["raw"],
                f"x{raise_:.2f}",
                f"{least:.4f}",
                groups or "-",
                f"{gp.seconds:.1f}",
            )
            cfg = f"{name} {how}"
            rows.record("hybrid", cfg, "gpus", sum(gp.gpus.values()))
            rows.record("hybrid", cfg, "cost_per_hour", gp.cost_per_hour)
            rows.record("hybrid", cfg, "least_on_time", least)
            rows.record("hybrid", cfg, "planning_s", gp.seconds)
        console.print(table)
    console.print(f"{time.monotonic() - started:.0f} s in all", highlight=False)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'hybrid')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
