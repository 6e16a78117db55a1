"""`poolpipe apps`: applications of several models under one SLO (apps.toml)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.domain.apps import fastest_latencies, load_apps

console = Console()


def cmd_apps_check(args: argparse.Namespace) -> int:
    """Check an apps.toml against the models the warehouse (or a PPipe profile directory)
    holds: every model known, transforms importable, each SLO no shorter than its slowest
    path at its fastest; then show each application's graph."""
    if args.profiles:
        from poolpipe.domain.profiles import load_ppipe_dir

        profiles = load_ppipe_dir(Path(args.profiles))
        where = str(args.profiles)
    else:
        from poolpipe.store.warehouse import Warehouse

        with Warehouse.open(args.warehouse) as wh:
            profiles = [wh.load_profile(n) for n in wh.model_names()]
            where = str(wh.path)
    fastest = fastest_latencies(profiles)
    apps = load_apps(args.spec, known_models=fastest, fastest_us=fastest)
    for app in apps:
        per = app.multiplicity()
        t = Table(
            title=f"{app.name}: SLO {app.slo_us / 1e3:g} ms, weight {app.weight:g}, entry "
            f"{app.entry}, answered by {', '.join(app.exits)}",
            title_justify="left",
        )
        for col in (
            "model",
            "waits for",
            "fan-out",
            "transform",
            "requests per request",
            "fastest ms",
        ):
            t.add_column(col, justify="left" if col in ("model", "waits for") else "right")
        for m in app.models:
            parents = app.parents(m)
            t.add_row(
                m,
                ", ".join(e.src for e in parents) or "-",
                ", ".join(e.fanout.describe() for e in parents) or "-",
                ", ".join(e.transform for e in parents) or "-",
                f"{per[m]:g}",
                f"{fastest[m] / 1e3:.1f}",
            )
        console.print(t)
        for path in app.paths():
            ms = sum(fastest[m] for m in path) / 1e3
            console.print(
                f"  path {' -> '.join(path)}: {ms:.1f} ms at its fastest, "
                f"{app.slo_us / 1e3 - ms:.1f} ms of the SLO left for waiting and batching",
                highlight=False,
            )
    console.print(f"{args.spec}: {len(apps)} application(s) checked against {where}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    apps = sub.add_parser("apps", help="applications: graphs of models under one SLO")
    asub = apps.add_subparsers(dest="apps_command", required=True, metavar="ACTION")
    check = asub.add_parser(
        "check",
        help="check an apps.toml and show each application's graph",
        description=cmd_apps_check.__doc__,
    )
    check.add_argument("spec", help="the application spec (apps.toml; see docs/apps.md)")
    check.add_argument(
        "--profiles",
        help="a PPipe profile directory to check against instead of the warehouse",
    )
    check.set_defaults(func=cmd_apps_check)
