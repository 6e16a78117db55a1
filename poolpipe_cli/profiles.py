"""`poolpipe profiles` and `poolpipe warehouse`: import and inspect block profiles, keep the
warehouse file at this version's schema."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.store.warehouse import Warehouse, default_path
from poolpipe_cli.common import DEFAULT_PPIPE_DIR, console, open_warehouse


def cmd_import_ppipe(args: argparse.Namespace) -> int:
    root = Path(args.directory)
    with console.status(f"reading {root} ..."):
        profiles = load_ppipe_dir(root)
        clusters_file = root / "clusters.toml"
        clusters = list(load_clusters(clusters_file).values()) if clusters_file.is_file() else []
    with open_warehouse(args) as wh:
        wh.store_profiles(profiles, provenance={"importer": "ppipe", "path": str(root.resolve())})
        wh.store_clusters(clusters, source=str(clusters_file))
        console.print(
            f"imported {len(profiles)} models ({sum(len(p.tables) for p in profiles)} latency "
            f"tables) and {len(clusters)} clusters into {wh.path}"
        )
    return 0


def cmd_profiles_list(args: argparse.Namespace) -> int:
    with open_warehouse(args) as wh:
        rows = wh.profile_summary()
    if not rows:
        console.print(
            f"no models in {args.warehouse or default_path()}; run: poolpipe profiles "
            f"import-ppipe {DEFAULT_PPIPE_DIR}"
        )
        return 0
    t = Table(title="models in the warehouse", title_justify="left")
    for col in ("model", "blocks", "ref ms", "SLO ms", "GPUs", "tables", "cells", "source"):
        t.add_column(col)
    for name, nb, ref, slo, gpus, ntab, ncell, src in rows:
        t.add_row(
            name,
            str(nb),
            f"{ref / 1e3:.2f}" if ref else "-",
            f"{slo / 1e3:.1f}" if slo else "-",
            gpus or "-",
            str(ntab),
            str(ncell),
            src,
        )
    console.print(t)
    return 0


def cmd_profiles_show(args: argparse.Namespace) -> int:
    with open_warehouse(args) as wh:
        p = wh.load_profile(args.model)
    console.print(
        f"[bold]{p.name}[/]: {p.num_blocks} blocks, "
        f"reference {p.reference_latency_us or 0:,.0f} µs, "
        f"SLO {p.slo_us or 0:,.0f} µs, source {p.meta.get('source')}"
    )
    t = Table(
        title="block latency at batch 1 (µs); boundary = bytes leaving the block",
        title_justify="left",
    )
    t.add_column("block", justify="right")
    keys = sorted(p.tables)
    for gpu, share in keys:
        t.add_column(f"{gpu}/{share}" if share > 1 else gpu, justify="right")
    t.add_column("boundary B", justify="right")
    for i in range(p.num_blocks):
        t.add_row(
            str(i),
            *[f"{p.tables[k].latency_us[i, 0]:,.0f}" for k in keys],
            f"{p.boundary_bytes[i]:,.0f}" if i < p.num_blocks - 1 else "",
        )
    t.add_section()
    t.add_row("sum", *[f"{p.tables[k].latency_us[:, 0].sum():,.0f}" for k in keys], "")
    t.add_row("batches", *[str(p.tables[k].max_batch) for k in keys], "")
    console.print(t)
    return 0


def cmd_warehouse_migrate(args: argparse.Namespace) -> int:
    with Warehouse.open(args.warehouse, migrate=True) as wh:
        console.print(f"{wh.path} is at schema version {wh.schema_version()}")
    return 0


def cmd_warehouse_info(args: argparse.Namespace) -> int:
    with open_warehouse(args) as wh:
        console.print(f"{wh.path}: schema version {wh.schema_version()}")
        for (table,) in wh.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema='main' ORDER BY 1"
        ).fetchall():
            row = wh.con.execute(f'SELECT count(*) FROM "{table}"').fetchone()
            console.print(f"  {table:<18} {row[0] if row else 0:>8} rows")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:

    prof = sub.add_parser("profiles", help="import and inspect block profiles")
    psub = prof.add_subparsers(dest="profiles_command", required=True, metavar="ACTION")
    imp = psub.add_parser("import-ppipe", help="import a PPipe profile folder (idempotent)")
    imp.add_argument("directory", help="e.g. ../shared/profiles/ppipe-gpu")
    imp.set_defaults(func=cmd_import_ppipe)
    psub.add_parser("list", help="models in the warehouse").set_defaults(func=cmd_profiles_list)
    show = psub.add_parser("show", help="one model's block table")
    show.add_argument("model")
    show.set_defaults(func=cmd_profiles_show)

    wh = sub.add_parser("warehouse", help="warehouse maintenance")
    wsub = wh.add_subparsers(dest="warehouse_command", required=True, metavar="ACTION")
    wsub.add_parser("migrate", help="bring the file to this version's schema").set_defaults(
        func=cmd_warehouse_migrate
    )
    wsub.add_parser("info", help="schema version and row counts").set_defaults(
        func=cmd_warehouse_info
    )
