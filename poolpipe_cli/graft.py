"""`poolpipe graft`: requests that enter mid-model (hybrid clients; streams.toml)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from poolpipe.errors import PoolpipeError
from poolpipe_cli.common import console


def cmd_graft_plan(args: argparse.Namespace) -> int:
    """Plan entry streams (streams.toml: clients that run a model's first blocks and send
    the feature map at an entry block, with what is left of their SLO; docs/apps.md) on a
    cluster, the cheapest GPUs serving each stream's rate: re-aligned (Graft: a model's
    entries grouped, each group's streams sharing the blocks after its deepest entry, their
    batches mixing entry points), beside each entry block planned apart (per-fragment) and
    every client sending its raw input with its whole SLO (raw). Each plan's pools are
    sized for queueing at their rates, and (--sized, default) each plan is simulated at the
    streams' rates and planned again for more where a stream keeps under 99% on time.
    --out writes the re-aligned plan (or --how's) to serve (poolpipe serve) or simulate."""
    from poolpipe.domain.entry import load_streams
    from poolpipe.planner.graft import HOWS, GraftPlan, GraftRequest, plan_streams

    if args.profiles:
        from poolpipe.domain.cluster import load_cluster
        from poolpipe.domain.profiles import load_ppipe_dir

        profiles = {p.name: p for p in load_ppipe_dir(Path(args.profiles))}
        clusters = Path(args.clusters_file or Path(args.profiles) / "clusters.toml")
        cluster = load_cluster(clusters, args.cluster)
    else:
        from poolpipe.store.plan_inputs import resolve_cluster
        from poolpipe.store.warehouse import Warehouse

        with Warehouse.open(args.warehouse) as wh:
            profiles = {n: wh.load_profile(n) for n in wh.model_names()}
            cluster = resolve_cluster(wh, args.cluster, args.clusters_file)
    if args.out and not Path(args.out).parent.is_dir():
        raise PoolpipeError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")
    streams = load_streams(args.streams, profiles)
    prices = None
    if args.prices or cluster.prices():
        from poolpipe_cli.plans import cluster_prices

        prices = cluster_prices(cluster, args.prices)
        missing = [p.gpu for p in cluster.pools if p.gpu not in prices]
        if missing:
            raise PoolpipeError(
                f"--prices: give a price per GPU-hour for {', '.join(missing)} too "
                "(or none at all: 1 per GPU)"
            )
    req = GraftRequest(
        streams,
        {m: profiles[m] for m in {s.model for s in streams}},
        cluster,
        prices,
        margin=args.margin,
        max_partitions=args.max_partitions,
        time_limit_s=args.time_limit,
    )
    hows = HOWS if args.compare else (args.how,)
    plans: dict[str, GraftPlan] = {}
    for how in hows:
        with console.status(f"planning the {how} plan on {cluster.name} ...") as status:

            def step(line: str, how: str = how) -> None:
                status.update(f"{how}: {line}")

            try:
                plans[how] = plan_streams(req, how, args.sized, step)
            except PoolpipeError as e:
                if how == args.how:
                    raise
                console.print(f"{how}: {e}", highlight=False)
    unit = "$/h" if prices else "GPUs (1 each)"
    t = Table(
        title=f"{len(streams)} entry streams on {cluster.name}: the cheapest plans serving "
        f"their rates (margin {args.margin})",
        title_justify="left",
    )
    for col in ("plan", "GPUs", f"cost, {unit}", "least stream on time", "planning s"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for how, gp in plans.items():
        t.add_row(
            how,
            " + ".join(f"{n} {g}" for g, n in gp.gpus.items()),
            f"{gp.cost_per_hour:g}",
            "-" if gp.on_time is None else f"{min(gp.on_time.values()):.4f}",
            f"{gp.seconds:.1f}",
        )
    console.print(t)
    chosen = plans[args.how]
    _print_streams(chosen, streams)
    if args.out:
        doc, _ = chosen.document()
        doc.save(Path(args.out))
        console.print(
            f"the {args.how} plan written to {args.out} ({len(doc.models)} segments): serve "
            f"it with poolpipe serve {args.out}",
            highlight=False,
        )
    return 0


def _print_streams(gp, streams) -> None:
    """Each stream's path: its parts with their blocks and budgets."""
    doc, _ = gp.document()
    t = Table(title=f"the {gp.how} plan, stream by stream", title_justify="left")
    for col in ("stream", "entry", "budget ms", "parts (blocks: budget ms)", "asked req/s"):
        t.add_column(col, justify="left" if col in ("stream", "parts") else "right")
    for s in streams:
        rec = doc.meta["apps"][s.name]
        parts = ", ".join(f"{m}: {b / 1e3:.1f}" for m, b in rec["budgets_us"].items())
        t.add_row(
            s.name, str(s.entry), f"{rec['slo_us'] / 1e3:.1f}", parts, f"{gp.asked[s.name]:.1f}"
        )
    console.print(t)


def add_commands(sub: argparse._SubParsersAction) -> None:
    graft = sub.add_parser("graft", help="requests entering mid-model: hybrid clients' streams")
    gsub = graft.add_subparsers(dest="graft_command", required=True, metavar="ACTION")
    plan = gsub.add_parser(
        "plan",
        help="plan entry streams re-aligned (Graft), per fragment and as raw input",
        description=cmd_graft_plan.__doc__,
    )
    plan.add_argument("streams", help="the entry streams (streams.toml; see docs/apps.md)")
    plan.add_argument("--cluster", required=True, help="cluster name, e.g. hc2-large")
    plan.add_argument("--clusters-file", help="TOML file with the cluster (default: warehouse)")
    plan.add_argument(
        "--profiles", help="a PPipe profile directory instead of the warehouse's models"
    )
    plan.add_argument(
        "--how",
        choices=("realigned", "per-fragment", "raw"),
        default="realigned",
        help="the plan printed stream by stream and written (realigned)",
    )
    plan.add_argument(
        "--no-compare", dest="compare", action="store_false", help="plan --how's alone"
    )
    plan.add_argument(
        "--no-sizing",
        dest="sized",
        action="store_false",
        help="do not simulate the plans and plan again where a stream keeps under 99%% on time",
    )
    plan.add_argument("--margin", type=float, default=0.4, help="share of a budget held back")
    plan.add_argument("--max-partitions", type=int, default=2, help="partitions per pipeline (2)")
    plan.add_argument("--time-limit", type=float, default=60.0, help="seconds per MILP (60)")
    plan.add_argument(
        "--prices",
        help="price per GPU-hour per type, e.g. L4=0.56,T4=0.35 (default: the clusters file's; "
        "none there: 1 per GPU)",
    )
    plan.add_argument("--out", help="write the --how plan here (JSON)")
    plan.set_defaults(func=cmd_graft_plan)
