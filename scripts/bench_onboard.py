"""Onboarding benchmark: generate a model (ResNet-50 by default), run the onboarding flow
(split into 10 blocks, build, verify, profile at batch 1..8, store) on this machine and
report the wall time against the 5-minute target and, per batch size, the sum of the
blocks' latencies against the whole model's (target: within 10%). Prints tables and stores
rows in the warehouse (bench_onboard).

    ./run bench-onboard [--model resnet50] [--threads 1] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from flows.onboard import onboard_model
from poolpipe.offline.profiler import sum_vs_whole
from poolpipe.offline.zoo import ZOO, make_model
from poolpipe.store.warehouse import Warehouse

console = Console(width=None if sys.stdout.isatty() else 150)
TARGET_S = 300.0
TARGET_RATIO = 0.10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=list(ZOO), default="resnet50")
    ap.add_argument("--name", help="name in the warehouse (default: the model)")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    name = args.name or args.model
    batches = list(range(1, args.max_batch + 1))
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = make_model(args.model, Path(tmp) / f"{args.model}.onnx")
        make_s = time.perf_counter() - t
        console.print(
            f"generated {args.model} ({path.stat().st_size / 1e6:.0f} MB) in {make_s:.1f} s"
        )
        t = time.perf_counter()
        with console.status(f"onboarding {name}: {args.blocks} blocks, batch 1..{args.max_batch}"):
            r = onboard_model(
                str(path),
                name,
                warehouse=args.warehouse,
                blocks=args.blocks,
                batches=batches,
                threads=args.threads,
                warmup=args.warmup,
                reps=args.reps,
            )
        total = time.perf_counter() - t
    steps = Table(
        title=f"onboarding {name} on {r.info.device} ({r.info.device_detail})", title_justify="left"
    )
    for col in ("step", "seconds"):
        steps.add_column(col, justify="left" if col == "step" else "right")
    for step, s in r.seconds.items():
        steps.add_row(step, f"{s:.1f}")
    steps.add_row("Prefect and the rest", f"{total - sum(r.seconds.values()):.1f}")
    steps.add_section()
    verdict = "met" if total <= TARGET_S else "MISSED"
    steps.add_row("total", f"{total:.1f}  (target <= {TARGET_S:.0f}: {verdict})")
    console.print(steps)

    table = Table(
        title=f"sum of the {len(r.split.blocks)} blocks vs the whole model (median of "
        f"{args.reps} runs; target within {TARGET_RATIO:.0%})",
        title_justify="left",
    )
    for col in ("batch", "whole ms", "blocks ms", "difference", "within target"):
        table.add_column(col, justify="right")
    now = datetime.now(UTC).replace(tzinfo=None)
    rows = []
    for batch, (blocks_us, whole_us) in sum_vs_whole(r.measurements).items():
        ratio = blocks_us / whole_us
        table.add_row(
            str(batch),
            f"{whole_us / 1e3:.2f}",
            f"{blocks_us / 1e3:.2f}",
            f"{ratio - 1:+.1%}",
            "yes" if abs(ratio - 1) <= TARGET_RATIO else "NO",
        )
        rows.append(
            {
                "run_at": now,
                "run_label": args.label,
                "model": name,
                "device": r.info.device,
                "blocks": len(r.split.blocks),
                "total_seconds": total,
                "split_seconds": r.seconds.get("split"),
                "build_seconds": r.seconds.get("build"),
                "verify_seconds": r.seconds.get("verify"),
                "profile_seconds": r.seconds.get("profile"),
                "store_seconds": r.seconds.get("store"),
                "batch": batch,
                "whole_us": whole_us,
                "blocks_sum_us": blocks_us,
                "ratio": ratio,
                "host": socket.gethostname(),
            }
        )
    console.print(table)
    console.print(
        f"blocks vs whole model outputs: max error {r.verify_errors[0]:.1e} (fp32), "
        f"{r.verify_errors[1]:.1e} (fp16 boundaries); layer-profile balance "
        f"{r.split.partitioning.balance:.2f}"
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_onboard", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_onboard)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
