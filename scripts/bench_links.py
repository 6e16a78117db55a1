"""What the links' own timing costs a pooled plan live: the main job's ppipe plan (the
paper's group 2 on emulated hc2-small, a node per server, the chain transport) served with
the NICs shaped at the plan's bandwidth / D, and at multiples of it on the uplinks, the
downlinks or both, while the router and its reservations keep the plan's bandwidth. Each
arm starts its own cluster and router; at each of --loads (undilated req/s) one trace of
--duration s (undilated; the same arrivals in every arm), after a warm-up: the share on time
with its 95% interval, each model's on time, and how much later than their reservations'
end the chains were answered (their overhead, undilated ms, p50 / p90 / p99).

Where the share rises with links faster than planned, what a chain loses is the time its
transfers take beyond what the router reserved for them (a transfer that runs into another
shares the NIC with it), not the host's CPU: the stages and the router keep their times in
every arm. Rows: bench_serving, bench "links". EMULATED GPUs; needs root (namespaces, tc).

    ./run bench-links [--loads 245,279] [--duration 4] [--arms 1,down:4,up:4,4]
        [--time-scale 20]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poolpipe.errors import PoolpipeError
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import emulated as emu
from testbed.loadgen import mix_times

console = Console(width=None if sys.stdout.isatty() else 150)
WARM_UP_RATE = 100.0  # undilated req/s, for half a dilated second per unit of D


def parse_arm(text: str) -> tuple[float, float]:
    """'4' (both ways), 'up:4' or 'down:4' (one way, the other as planned): the NICs'
    (uplink, downlink) bandwidth as multiples of the plan's."""
    side, _, x = text.strip().rpartition(":")
    try:
        k = float(x)
    except ValueError:
        raise PoolpipeError(
            f"--arms: {text!r} is not a multiple of the plan's bandwidth (4, up:4 or down:4)"
        ) from None
    if not (k > 0 and np.isfinite(k)):
        raise PoolpipeError(f"--arms: {text!r} needs a multiple > 0")
    if side not in ("", "up", "down"):
        raise PoolpipeError(f"--arms: {text!r}: the side is up or down, or none for both")
    return (k if side in ("", "up") else 1.0, k if side in ("", "down") else 1.0)


def arm_text(scale: tuple[float, float]) -> str:
    up, down = scale
    if up == down:
        return "as planned" if up == 1 else f"{up:g}x both ways"
    return f"uplinks {up:g}x, downlinks {down:g}x"


def run_arm(
    plan, plan_id: int, warehouse: str, scale: tuple[float, float], loads, duration_s, d, work
) -> list[dict]:
    """One arm: its cluster and router, a warm-up, then one trace a load (module doc)."""
    from poolpipe.client.control import new_token_file

    token_file = work / "control.token"
    token = new_token_file(token_file)
    weights = dict(zip(emu.GROUP2, emu.MAF19, strict=True))
    out = []
    with (
        emu.emulated_nodes(
            plan.cluster, work / "cluster", d, token_file, node_per_server=True, link_scale=scale
        ) as em,
        emu.serve_dilated(
            plan, plan_id, warehouse, work / "serve", d, name="emulated", token=token,
            inventory=em.inventory(), transport="chain",
        ) as server,  # fmt: skip
    ):
        dep = server.deployment
        load = emu.MixLoad.of(dep, weights)
        load.run(WARM_UP_RATE / d, 0.5 * d, 7)
        names = [io.name for io in dep.ios]
        for k, rate in enumerate(loads):
            times, which = mix_times(rate / d, load.weights, duration_s * d, 500 + k)
            dep.core.take_chain_overheads()
            shots = load.drive(times, which)
            per: dict[str, list[int]] = {}
            for s in shots:
                n_ok = per.setdefault(names[s.model], [0, 0])
                n_ok[0] += 1
                n_ok[1] += load.on_time(s)
            on = sum(ok for _, ok in per.values())
            over = np.asarray(dep.core.take_chain_overheads(), dtype=float) / 1e3 / d
            row = {
                "rate": rate,
                "sent": len(times),
                "on_time": on,
                "models": per,
                "overhead_ms": np.percentile(over, [50, 90, 99]) if len(over) else None,
            }
            out.append(row)
            console.print(
                f"  {arm_text(scale)}: {rate:g} req/s, {on / max(1, len(times)):.3f} on "
                f"time of {len(times)}",
                highlight=False,
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loads", default="245,279", help="undilated req/s (245,279)")
    ap.add_argument("--duration", type=float, default=4.0, help="undilated s a trace (4)")
    ap.add_argument(
        "--arms",
        default="1,down:4,up:4,4",
        help="the NICs' bandwidth against the plan's, per arm: 4 (both ways), up:4, down:4 "
        "(1,down:4,up:4,4)",
    )
    ap.add_argument("--time-scale", type=float, default=20.0, help="D (20, the main job's)")
    ap.add_argument("--cluster", default="hc2-small", help="a cluster of group 2 (hc2-small)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    # the loads are above the plan's envelope on purpose: its warnings say nothing here
    logging.getLogger("poolpipe.serve").setLevel(logging.ERROR)
    try:
        loads = [float(x) for x in args.loads.split(",")]
        arms = [parse_arm(a) for a in args.arms.split(",")]
        if not loads or min(loads) <= 0 or args.duration <= 0 or args.time_scale <= 0:
            raise PoolpipeError("--loads, --duration and --time-scale must be > 0")
    except ValueError:
        ap.error(f"--loads: {args.loads!r} is not a list of req/s")
    except PoolpipeError as exc:
        ap.error(str(exc))
    warehouse, _, _ = emu.group2_inputs(args.warehouse, args.cluster)
    plan, plan_id = emu.group_plans(warehouse, args.cluster)["ppipe"]
    d = args.time_scale
    rows = BenchRows(args.label)
    results = []
    t0 = time.perf_counter()
    try:
        for scale in arms:
            console.print(f"▶ {arm_text(scale)}: {args.cluster} EMULATED at D = {d:g}, ppipe")
            with tempfile.TemporaryDirectory(prefix="poolpipe-links-") as work:
                got = run_arm(plan, plan_id, warehouse, scale, loads, args.duration, d, Path(work))
            results.append((scale, got))
    except PoolpipeError as exc:
        console.print(f"[red]bench-links: {exc}[/red]")
        return 1
    table = Table(
        title=f"ppipe on {args.cluster} EMULATED (D = {d:g}, a node per server, chain), "
        f"the NICs against the plan's bandwidth, the router reserving by the plan's; one "
        f"trace of {args.duration:g} s a load; figures undilated"
    )
    models = sorted({m for _, got in results for r in got for m in r["models"]})
    heads = ("NICs", "req/s", "on time (95%), requests", *models, "chain overhead p50/p90/p99 ms")
    for col in heads:
        table.add_column(col, justify="left" if col == "NICs" else "right")
    for scale, got in results:
        for r in got:
            share = r["on_time"] / max(1, r["sent"])
            lo, hi = emu.wilson(share, r["sent"])
            cells = []
            for m in models:
                n, ok = r["models"].get(m, [0, 0])
                cells.append(f"{ok}/{n}")
            ov = r["overhead_ms"]
            table.add_row(
                arm_text(scale), f"{r['rate']:g}", f"{share:.4f} ({lo:.3f}-{hi:.3f}), {r['sent']}",
                *cells, "-" if ov is None else " / ".join(f"{x:.1f}" for x in ov),
            )  # fmt: skip
            config = f"{args.cluster} D={d:g} up={scale[0]:g} down={scale[1]:g} rate={r['rate']:g}"
            rows.record("links", config, "share_on_time", share)
            rows.record("links", config, "requests", r["sent"])
            if ov is not None:
                rows.record("links", config, "chain_overhead_p99_ms", float(ov[2]))
    console.print(table)
    console.print(
        f"EMULATED GPUs: real processes, network and bytes; device times from the profiles. "
        f"{time.perf_counter() - t0:.0f} s"
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'links')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
