"""What every `poolpipe` subcommand shares: the console, the shipped profile folder, list
arguments, opening the warehouse."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from poolpipe.errors import PoolpipeError
from poolpipe.store.warehouse import REPO_ROOT, Warehouse

# Without a terminal (CI logs, pipes) rich would wrap at 80 columns; plans need more.
console = Console(width=None if sys.stdout.isatty() else 160)
# Errors go to stderr, as a person (and a script) expects.
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
# The demos' narrative, narrower where it goes to a log.
demo_console = Console(width=None if sys.stdout.isatty() else 120)
DEFAULT_PPIPE_DIR = REPO_ROOT.parent / "shared" / "profiles" / "ppipe-gpu"
PPIPE_DIR_ENV = "POOLPIPE_PPIPE_PROFILES"


def counted(n: int, noun: str) -> str:
    """'1 request', '2 requests': a count with its noun as a person writes it."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def step(text: str) -> None:
    """A step of a demo, as it starts."""
    demo_console.print(f"[bold cyan]▶[/] {text}")


def ppipe_dir() -> Path:
    return Path(os.environ.get(PPIPE_DIR_ENV, DEFAULT_PPIPE_DIR))


def open_warehouse(args: argparse.Namespace) -> Warehouse:
    return Warehouse.open(args.warehouse)


def parse_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise PoolpipeError(f"--{what} is empty; give a comma-separated list")
    return items


def parse_floats(text: str, what: str) -> list[float]:
    out = []
    for x in parse_list(text, what):
        try:
            out.append(float(x))
        except ValueError:
            raise PoolpipeError(f"--{what}: {x!r} is not a number") from None
    return out


def parse_margins(text: str | None) -> tuple[float, ...]:
    """--search-margins 0.3,0.2 as a tuple (none given: empty)."""
    return tuple(parse_floats(text, "search-margins")) if text else ()


def add_input_shape_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="an input's dimensions after the batch, where the file leaves them to run time "
        "(images=3x320x320; repeat per input); each size is a model of its own",
    )


def add_reply_margin_argument(
    p: argparse.ArgumentParser, help_text: str, default_us: float
) -> None:
    """--reply-margin-ms, its default from the code's constants (`plan`: the margin a router
    measures with its nodes idle; `serve`: the floor it measures on top of)."""
    p.add_argument(
        "--reply-margin-ms",
        type=float,
        default=default_us / 1e3,
        help=f"{help_text} ({default_us / 1e3:g})",
    )


def warn_slo_room(plan, reply_margin_us: float, call_overhead_us: float = 0.0) -> None:
    """Warn (on stderr) for each model of `plan` whose SLO the router's reply margin leaves
    no room in."""
    from poolpipe.runtime import slo_room_warnings

    warn_each(slo_room_warnings(plan, reply_margin_us, call_overhead_us))


def warn_each(warnings) -> None:
    """Each warning on stderr, as written (no console markup taken from its text)."""
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {escape(str(w))}", highlight=False)


def call_overhead_to_check(wh: Warehouse, models: Sequence[str]) -> float:
    """What a stage call on the nodes takes beyond its blocks' profiled run, as a router
    serving these models from this warehouse last measured (µs; 0 where none did)."""
    return wh.measured_call_overhead_us(models) or 0.0


def log_events() -> None:
    """Serving's events (nodes down and back, drains, rollouts, re-plans) to stderr, each
    line with its time: what an operator greps for in a journal."""
    import logging

    class Stderr(logging.StreamHandler):
        """Whatever sys.stderr is when a line is written (not the stream of the moment it
        was made, which a test's capture may have closed since)."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, _value) -> None:
            pass

    handler = Stderr()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    for name in ("poolpipe", "triton_backend"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
