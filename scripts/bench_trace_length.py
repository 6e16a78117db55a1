"""How long a trace must be for a capacity to be the plan's: the main job's ppipe and np plans
(the paper's group 2 at the maf19 mix on --cluster, SLO 5x reference, each request's inputs
counted on its first server's NIC: testbed.emulated.group_plans) simulated with the
reservation plane, Poisson arrivals, each model at its share of the mix rate. A rate passes
where the two traces of a seed pair together keep >= 99% on time (the main job's rule); the
capacity is the largest rate on a grid of 1/32 of ppipe's planned rate that passes with
every grid rate from --from-step up to it (searched down from --from-step where that fails,
to the first that passes). Per trace length and plan: the
capacity on each of --pairs seed pairs, their median, and ppipe / np of the medians.

The main job judged its rates on traces of 0.5 s (10 s wall clock at D = 20) until
bcfb529. A queue that misses takes longer than that to build at a rate a little above what
a plan carries, the longer the more slack its SLOs leave (np's whole-model pools): a trace
that short states more than the plan serves for longer. Rows: bench_serving, bench "trace-length".

`--parts shares`: what decides the main job's figures, the mean or the spread. At the main
job's loads (--loads, grid steps), each plan's share on time over --patterns arrival
patterns (seeds 200 + 1000 k, scaled to each load: the candidates of the job's typical pattern)
of 1.25 s from an idle cluster (the job's), of 1.25 s judged after a 0.5-s lead-in at the
same load (requests arriving in the lead-in not judged: the cluster's queues as they are
in steady state), and of 5 s: the mean share, and in how many patterns the load keeps 99%.

    ./run bench-trace-length [--cluster hc2-small] [--lengths 0.5,1,2,4,10] [--pairs 4]
        [--parts capacity,shares] [--loads 15,19,22,25,28] [--patterns 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poolpipe.scheduler.topology import simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed.emulated import (
    GROUP2,
    MAF19,
    PATTERN_SEED,
    group2_inputs,
    group_plans,
    simulated_share,
)
from testbed.emulated import MIX_STEPS as STEPS  # the grid: ppipe's planned rate / this
from testbed.loadgen import CAPACITY_TARGET, keeps_target

# --parts shares: (lead-in s not judged, s judged) per trace kind; the main job's is the first
SHARE_TRACES = ((0.0, 1.25), (0.5, 1.25), (0.0, 5.0))

console = Console(width=None if sys.stdout.isatty() else 150)


def capacity(topo, shares: list[float], step: float, length: float, seeds, first: int) -> float:
    """The largest rate i * step whose traces on `seeds` keep the target, every grid rate
    from `first` up to it passing too; where `first` fails, the first below it that passes."""
    arrivals = ArrivalSpec.parse("poisson")

    def passes(i: int) -> bool:
        rates = [i * step * w for w in shares]
        on = arrived = 0
        for seed in seeds:
            r = run_once(topo, arrivals, 1.0, SimConfig(length, seed=seed), reference_rates=rates)
            on += sum(m.on_time for m in r.models)
            arrived += sum(m.arrived for m in r.models)
        return on >= CAPACITY_TARGET * arrived

    i = first
    while i > 1 and not passes(i):
        i -= 1
    while i < 4 * STEPS and passes(i + 1):
        i += 1
    return i * step


def capacity_table(
    served: dict, step: float, lengths: list[float], pairs: int, from_step: int, cluster: str,
    rows: BenchRows,
) -> Table:  # fmt: skip
    """Each plan's capacity by trace length (`pairs` seed pairs each) and their medians."""
    table = Table(
        title=f"capacity by trace length: group 2 at maf19 on {cluster}, simulated "
        f"(Poisson, reservation plane), >= 99% on time over a pair of seeds' traces, grid "
        f"{step:.1f} req/s"
    )
    for col in ("trace s", "ppipe req/s by seed pair", "median", "np req/s by seed pair"):
        table.add_column(col)
    table.add_column("median")
    table.add_column("ppipe / np")
    started = time.monotonic()
    for length in lengths:
        medians = {}
        found = {}
        for strategy, (topo, shares) in served.items():
            caps = [
                capacity(topo, shares, step, length, (2 * k + 1, 2 * k + 2), from_step)
                for k in range(pairs)
            ]
            found[strategy] = caps
            medians[strategy] = statistics.median(caps)
            cfg = f"{cluster} {strategy} trace {length:g} s"
            for k, c in enumerate(caps):
                seeds = f"seeds {2 * k + 1},{2 * k + 2}"
                rows.record("trace-length", f"{cfg} {seeds}", "capacity", c)
            rows.record("trace-length", cfg, "capacity_median", medians[strategy])
        ratio = medians["ppipe"] / medians["np"]
        cfg = f"{cluster} trace {length:g} s"
        rows.record("trace-length", cfg, "ppipe_over_np", ratio)
        table.add_row(
            f"{length:g}",
            ", ".join(f"{c:.0f}" for c in found["ppipe"]),
            f"{medians['ppipe']:.0f}",
            ", ".join(f"{c:.0f}" for c in found["np"]),
            f"{medians['np']:.0f}",
            f"{ratio:.2f}x",
        )
        console.print(f"  {length:g}-s traces: done ({time.monotonic() - started:.0f} s)")
    return table


def shares_table(
    served: dict, step: float, loads: list[int], patterns: int, cluster: str, rows: BenchRows
) -> Table:
    """The mean share on time and the patterns that keep the target, per plan, load and
    trace kind (SHARE_TRACES)."""
    table = Table(
        title=f"share on time at the main job's loads over {patterns} arrival patterns "
        "(simulated, no host delays): mean, and patterns that keep 99%"
    )
    table.add_column("plan")
    table.add_column("req/s")
    for lead, length in SHARE_TRACES:
        table.add_column(f"{length:g} s" + (f" after {lead:g} s" if lead else " from idle"))
    for strategy, (topo, shares) in served.items():
        for i in loads:
            rate = i * step
            cells = []
            for lead, length in SHARE_TRACES:
                got = [
                    simulated_share(
                        topo, shares, rate, length, PATTERN_SEED + 1000 * k, lead_s=lead
                    )
                    for k in range(patterns)
                ]
                mean = float(np.mean([on / max(1, n) for on, n in got]))
                kept = sum(1 for on, n in got if keeps_target(n - on, n))
                cfg = f"{cluster} {strategy} {rate:.0f} req/s trace {length:g} s lead {lead:g} s"
                rows.record("trace-length-shares", cfg, "share_mean", mean)
                rows.record("trace-length-shares", cfg, "patterns_kept", kept)
                cells.append(f"{mean:.4f}, {kept}/{patterns}")
            table.add_row(strategy, f"{rate:.0f}", *cells)
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cluster", default="hc2-small", help="a cluster of group 2's clusters.toml")
    ap.add_argument("--lengths", default="0.5,1,2,4,10", help="trace lengths, simulated s")
    ap.add_argument("--pairs", type=int, default=4, help="seed pairs per length (4)")
    ap.add_argument("--from-step", type=int, default=12, help="grid step the search starts at")
    ap.add_argument("--parts", default="capacity", help="capacity, shares, or both (capacity)")
    ap.add_argument(
        "--loads", default="15,19,22,25,28", help="shares: grid steps (the main job's loads)"
    )
    ap.add_argument("--patterns", type=int, default=12, help="shares: arrival patterns (12)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    try:
        lengths = [float(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: {args.lengths!r} is not a list of seconds")
    if any(x <= 0 for x in lengths) or args.pairs < 1 or args.from_step < 1:
        ap.error("--lengths must be positive, --pairs and --from-step at least 1")
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"capacity", "shares"}:
        ap.error(f"--parts: {args.parts!r}; give capacity, shares or both (comma-separated)")
    try:
        loads = [int(x) for x in args.loads.split(",")]
    except ValueError:
        ap.error(f"--loads: {args.loads!r} is not a list of grid steps")
    if any(i < 1 for i in loads) or args.patterns < 1:
        ap.error("--loads must be grid steps of 1 or more, --patterns at least 1")
    warehouse, profiles, _ = group2_inputs(args.warehouse, args.cluster)
    plans = group_plans(warehouse, args.cluster)
    step = plans["ppipe"][0].objective / STEPS
    weights = dict(zip(GROUP2, MAF19, strict=True))
    # per plan: its topology and each model's share of the mix rate
    served = {}
    for strategy in ("ppipe", "np"):
        topo = simulated_topology(plans[strategy][0], profiles)
        total = sum(weights[m.name] for m in topo.models)
        served[strategy] = (topo, [weights[m.name] / total for m in topo.models])
    rows = BenchRows(args.label)
    if "capacity" in parts:
        console.print(
            capacity_table(served, step, lengths, args.pairs, args.from_step, args.cluster, rows)
        )
    console.print(
        f"planned {plans['ppipe'][0].objective:.1f} / {plans['np'][0].objective:.1f} req/s, "
        f"stated {plans['ppipe'][0].deliverable or float('nan'):.1f} / "
        f"{plans['np'][0].deliverable or float('nan'):.1f}"
    )
    if "shares" in parts:
        console.print(shares_table(served, step, loads, args.patterns, args.cluster, rows))
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'trace-length')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
