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

    ./run bench-trace-length [--cluster hc2-small] [--lengths 0.5,1,2,4,10] [--pairs 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.scheduler.topology import simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed.emulated import GROUP2, MAF19, group2_inputs, group_plans
from testbed.emulated import MIX_STEPS as STEPS  # the grid: ppipe's planned rate / this
from testbed.loadgen import CAPACITY_TARGET

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cluster", default="hc2-small", help="a cluster of group 2's clusters.toml")
    ap.add_argument("--lengths", default="0.5,1,2,4,10", help="trace lengths, simulated s")
    ap.add_argument("--pairs", type=int, default=4, help="seed pairs per length (4)")
    ap.add_argument("--from-step", type=int, default=12, help="grid step the search starts at")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    try:
        lengths = [float(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: {args.lengths!r} is not a list of seconds")
    if any(x <= 0 for x in lengths) or args.pairs < 1 or args.from_step < 1:
        ap.error("--lengths must be positive, --pairs and --from-step at least 1")
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
    table = Table(
        title=f"capacity by trace length: group 2 at maf19 on {args.cluster}, simulated "
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
                capacity(topo, shares, step, length, (2 * k + 1, 2 * k + 2), args.from_step)
                for k in range(args.pairs)
            ]
            found[strategy] = caps
            medians[strategy] = statistics.median(caps)
            cfg = f"{args.cluster} {strategy} trace {length:g} s"
            for k, c in enumerate(caps):
                rows.record("trace-length", f"{cfg} seeds {2 * k + 1},{2 * k + 2}", "capacity", c)
            rows.record("trace-length", cfg, "capacity_median", medians[strategy])
        ratio = medians["ppipe"] / medians["np"]
        rows.record("trace-length", f"{args.cluster} trace {length:g} s", "ppipe_over_np", ratio)
        table.add_row(
            f"{length:g}",
            ", ".join(f"{c:.0f}" for c in found["ppipe"]),
            f"{medians['ppipe']:.0f}",
            ", ".join(f"{c:.0f}" for c in found["np"]),
            f"{medians['np']:.0f}",
            f"{ratio:.2f}x",
        )
        console.print(f"  {length:g}-s traces: done ({time.monotonic() - started:.0f} s)")
    console.print(table)
    console.print(
        f"planned {plans['ppipe'][0].objective:.1f} / {plans['np'][0].objective:.1f} req/s, "
        f"stated {plans['ppipe'][0].deliverable or float('nan'):.1f} / "
        f"{plans['np'][0].deliverable or float('nan'):.1f}"
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'trace-length')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
