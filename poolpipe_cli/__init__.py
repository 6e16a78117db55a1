"""The `poolpipe` command: the composition root that wires the core, the warehouse, the
Prefect flows and the Triton adapters together (one module per group of subcommands)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from rich.markup import escape

from poolpipe import __version__, native
from poolpipe.errors import PoolpipeError
from poolpipe.store.warehouse import ENV_VAR, default_path
from poolpipe_cli.common import err_console


def build_parser() -> argparse.ArgumentParser:
    from poolpipe_cli import (
        apps,
        demo,
        graft,
        lb,
        models,
        onboard,
        operate,
        plans,
        profiles,
        serve,
        sim,
    )

    parser = argparse.ArgumentParser(
        prog="poolpipe",
        description="Pool-based pipeline-parallel CNN serving on heterogeneous GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"poolpipe {__version__}")
    parser.add_argument(
        "--warehouse",
        default=None,
        help=f"DuckDB warehouse file (default: ${ENV_VAR} or {default_path()})",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plans.add_commands(sub)
    live = sub.add_parser(
        "demo",
        help="the whole system here: onboard, plan, serve, load, roll out (the main job)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(live)
    live.set_defaults(func=lambda a: demo.cmd_demo(a))
    profiles.add_commands(sub)
    sim.add_commands(sub)
    models.add_commands(sub)
    onboard.add_commands(sub)
    serve.add_commands(sub)
    operate.add_commands(sub)
    lb.add_commands(sub)
    apps.add_commands(sub)
    graft.add_commands(sub)
    return parser


def _terminated(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a command as Ctrl-C does: torn down on the way out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # commands that serve set their own
    slow = native.unasked_sources()
    if slow is not None:
        err_console.print(
            f"[yellow]warning:[/] the hot path runs from its sources, several times slower: {slow}",
            highlight=False,
        )
    try:
        return int(args.func(args))
    except PoolpipeError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        return 2
    except KeyboardInterrupt:  # what the command started was stopped on the way out
        err_console.print("interrupted", highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
