"""`poolpipe onboard` and `poolpipe profile`: run the Prefect flows of flows/ with a progress
bar (locally on Prefect's ephemeral API) and print the block table."""

from __future__ import annotations

import argparse
import os
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from poolpipe.errors import PoolpipeError
from poolpipe.offline.cuts import METHODS
from poolpipe.offline.engines import ENGINES
from poolpipe.offline.onnxgraph import load_model, parse_input_shapes
from poolpipe_cli.common import add_input_shape_option

console = Console()


def parse_batches(text: str) -> list[int]:
    """'1-8' or '1,2,4,8' (or a mix: '1-4,8')."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            values = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError:
            raise PoolpipeError(f"--batches: {part!r} is not a number or a range (1-8)") from None
        out.update(values)
    if not out or min(out) < 1:
        raise PoolpipeError(f"--batches {text!r}: batch sizes must be integers >= 1")
    return sorted(out)


def _quiet_prefect(verbose: bool) -> None:
    # Before Prefect is imported: its settings are read from the environment.
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")  # errors: printed by us
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@contextmanager
def progress_bar(title: str) -> Iterator[None]:
    """A bar per step on a terminal; elsewhere (a pipe, a CI log, a journal) a line per step
    as it starts and ends, with its time, printed at once."""
    from flows.common import reporting

    if not console.is_terminal:
        with reporting(_progress_lines(title)):
            yield
        return
    bars: dict[str, TaskID] = {}
    with Progress(
        TextColumn("[bold]{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        start = progress.add_task(f"{title}: {_starting_prefect()}", total=1)

        def update(step: str, done: int, total: int) -> None:
            if start in progress.task_ids:
                progress.remove_task(start)
            key = step.split(":")[0] if step.startswith("profile") else step
            if key not in bars:
                bars[key] = progress.add_task(key, total=total)
            progress.update(bars[key], completed=done, total=total, description=step)

        with reporting(update):
            yield


def _starting_prefect() -> str:
    """What the first line says while Prefect starts: its temporary API, where no server is
    configured, takes seconds (about 7 on the 2-core CI machine; 1-2 with a server)."""
    if _prefect_api_configured():
        return "starting Prefect"
    return (
        "starting Prefect's temporary API (seconds; set PREFECT_API_URL to a running "
        "`prefect server` to skip this)"
    )


def _prefect_api_configured() -> bool:
    """Whether Prefect has an API to talk to (PREFECT_API_URL in the environment or in the
    active profile of its profiles.toml), read without importing Prefect."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
    try:
        profiles = tomllib.loads((home / "profiles.toml").read_text())
    except (OSError, ValueError):
        return False
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    return bool(profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"))


_EVERY_S = 10.0  # a progress line at least this often without a terminal


def _progress_lines(title: str):
    """progress(step, done, total) as plain lines: one as a step (a phase, a batch size)
    starts, one as it ends, and one every `_EVERY_S` seconds between."""
    t0 = time.perf_counter()
    console.print(f"{title}: {_starting_prefect()}", highlight=False, markup=False)
    last_step, last_at = "", t0

    def update(step: str, done: int, total: int) -> None:
        nonlocal last_step, last_at
        now = time.perf_counter()
        if step != last_step or done >= total or now - last_at >= _EVERY_S:
            last_step, last_at = step, now
            console.print(
                f"{title}: {step} {done}/{total} ({now - t0:.1f} s)",
                highlight=False,
                markup=False,
            )
        console.file.flush()

    return update


def cmd_onboard(args: argparse.Namespace) -> int:
    path = Path(args.model)
    name = args.name or path.stem
    shapes = parse_input_shapes(args.input_shape)
    load_model(path, name, shapes)  # what a file says of itself, before Prefect starts
    _quiet_prefect(args.verbose)
    from flows.onboard import block_header, block_rows, onboard_model

    with progress_bar(name):
        result = onboard_model(
            str(path),
            name,
            warehouse=args.warehouse,
            blocks=args.blocks,
            batches=parse_batches(args.batches),
            engine=args.engine,
            threads=args.threads,
            method=args.method,
            max_cut_tensors=args.max_cut_tensors,
            warmup=args.warmup,
            reps=args.reps,
            slo_ms=args.slo_ms,
            input_shapes={k: list(v) for k, v in shapes.items()},
            replace=args.replace,
        )
    part = result.split.partitioning
    table = Table(
        title=f"{name}: {result.split.layers} layers in {len(result.split.blocks)} blocks "
        f"({part.method}, cuts crossed by <= {part.policy.max_tensors} tensor(s)) on "
        f"{result.info.device} ({result.info.engine} {result.info.version})",
        title_justify="left",
    )
    for col in block_header(result):
        table.add_column(col, justify="left" if col == "first layer" else "right")
    rows = block_rows(result)
    for row in rows[:-2]:
        table.add_row(*row)
    table.add_section()
    for row in rows[-2:]:
        table.add_row(*row)
    console.print(table)
    e32, e16 = result.verify_errors
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    console.print(
        f"blocks reproduce the model: max error {e32:.1e} of the output scale (fp32), "
        f"{e16:.1e} with fp16 boundaries  |  {steps}\n"
        f"stored in the warehouse; blocks in {result.split.folder}"
    )
    if result.outdated_plans:
        console.print(
            f"[yellow]replaced {name}:[/] plans {', '.join(map(str, result.outdated_plans))} "
            "were made for its old blocks and are refused from now on; plan again",
            highlight=False,
        )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    _quiet_prefect(args.verbose)
    from flows.profile import profile_model
    from poolpipe.offline.profiler import latency_of, sum_vs_whole

    batches = parse_batches(args.batches)
    with progress_bar(args.name):
        info, ms = profile_model(
            args.name,
            warehouse=args.warehouse,
            batches=batches,
            engine=args.engine,
            threads=args.threads,
            warmup=args.warmup,
            reps=args.reps,
        )
    shown = sorted({batches[0], batches[-1]})  # one column where they are the same
    table = Table(title=f"{args.name} on {info.device} ({info.engine})", title_justify="left")
    for col in ("block", *(f"ms b={x}" for x in shown)):
        table.add_column(col, justify="right")
    for k in sorted({m.block for m in ms if m.block >= 0}):
        table.add_row(str(k), *(f"{latency_of(ms, k, x) / 1e3:.3f}" for x in shown))
    sums = sum_vs_whole(ms)
    table.add_section()
    table.add_row("sum", *(f"{sums[x][0] / 1e3:.3f}" for x in shown))
    table.add_row("whole", *(f"{sums[x][1] / 1e3:.3f}" for x in shown))
    console.print(table)
    return 0


def _profiling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1-8", help="batch sizes, e.g. 1-8 or 1,2,4,8 (1-8)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="onnxruntime",
        help="onnxruntime (CPU), onnxruntime-cuda or tensorrt (GPU nodes)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="ONNX Runtime threads on the CPU; device type cpu-<N>t (1)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per batch size (2)")
    p.add_argument("--reps", type=int, default=15, help="timed runs per block and batch (15)")
    p.add_argument("-v", "--verbose", action="store_true", help="show Prefect's logs")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "onboard",
        help="split an ONNX model into blocks, profile them and store them (Prefect flow)",
        description="Run the onboard-model flow: split the model into blocks at valid cuts, "
        "build them on this machine's engine, check that they reproduce the model, profile "
        "every block at every batch size and store model, blocks and latencies in the "
        "warehouse (all or nothing).",
    )
    p.add_argument("model", help="an ONNX file with a dynamic batch dimension")
    p.add_argument("--name", help="model name in the warehouse (default: the file name)")
    p.add_argument("--blocks", type=int, default=10, help="number of blocks (10)")
    p.add_argument("--method", choices=METHODS, default=METHODS[0], help="pre-partitioning")
    p.add_argument(
        "--max-cut-tensors",
        type=int,
        default=1,
        help="tensors allowed to cross a cut, widened when too few cuts qualify (1)",
    )
    p.add_argument(
        "--slo-ms",
        type=float,
        help="SLO (default: 5 x the whole model as served: its batch-1 run, a stage call "
        "and the reply margin)",
    )
    add_input_shape_option(p)
    p.add_argument(
        "--replace",
        action="store_true",
        help="replace a model of the same name (its stored plans are refused from then on)",
    )
    _profiling_options(p)
    p.set_defaults(func=cmd_onboard)

    p = sub.add_parser(
        "profile",
        help="profile an onboarded model's blocks on this machine (Prefect flow)",
        description="Run the profile-model flow: measure every block of an onboarded model "
        "on this machine's device and replace that device's latencies in the warehouse.",
    )
    p.add_argument("name", help="an onboarded model")
    _profiling_options(p)
    p.set_defaults(func=cmd_profile)
