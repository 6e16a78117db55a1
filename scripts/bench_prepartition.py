"""Pre-partitioning benchmark: split every shipped model's layer-level GPU timings into 10
blocks (the paper's greedy walk and the exact balanced split) and compare how even the
blocks are with the shipped 10-block tables (slowest / fastest block at batch 1).
Prints a table and stores rows in the warehouse (bench_prepartition).

    ./run bench-prepartition [--gpu L4] [--blocks 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.offline.cuts import METHODS, prepartition
from poolpipe.offline.layerdata import layer_cut_table
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 150)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--gpu", default="L4")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    shipped = {p.name: p for p in load_ppipe_dir(args.profiles)}
    table = Table(
        title=f"pre-partitioning into {args.blocks} blocks on {args.gpu} layer timings "
        "(balance = slowest / fastest block)",
        title_justify="left",
    )
    for col in ("model", "layers", "shipped", *(f"{m} (tensors/cut)" for m in METHODS)):
        table.add_column(col, justify="left" if col == "model" else "right")
    rows = []
    now = datetime.now(UTC).replace(tzinfo=None)
    for model in sorted(p.name for p in (args.profiles / "layers").iterdir()):
        cuts = layer_cut_table(args.profiles / "layers", model, args.gpu)
        lat = shipped[model].tables[(args.gpu, 1)].latency_us[:, 0]
        shipped_balance = float(max(lat.max(), 1) / max(lat.min(), 1))
        cells = []
        for method in METHODS:
            part = prepartition(cuts, args.blocks, method=method)
            cells.append(f"{part.balance:.2f} ({part.policy.max_tensors})")
            rows.append(
                {
                    "run_at": now,
                    "run_label": args.label,
                    "model": model,
                    "source": f"shipped-layers:{args.gpu}",
                    "layers": len(cuts.layers),
                    "blocks": args.blocks,
                    "method": method,
                    "max_tensors": part.policy.max_tensors,
                    "balance": part.balance,
                    "shipped_balance": shipped_balance,
                    "host": socket.gethostname(),
                }
            )
        table.add_row(model, str(len(cuts.layers)), f"{shipped_balance:.2f}", *cells)
    console.print(table)
    med = {m: statistics.median(r["balance"] for r in rows if r["method"] == m) for m in METHODS}
    shipped_med = statistics.median(r["shipped_balance"] for r in rows if r["method"] == METHODS[0])
    console.print(
        f"median balance: shipped {shipped_med:.2f}, "
        + ", ".join(f"{m} {v:.2f}" for m, v in med.items())
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_prepartition", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_prepartition)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
