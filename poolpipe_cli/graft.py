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
        merge=args.merge,
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
    doc, _ = chosen.document()
    _print_streams(chosen, doc, streams)
    if args.out:
        doc.save(Path(args.out))
        console.print(
            f"the {args.how} plan written to {args.out} ({len(doc.models)} segments): serve "
            f"it with poolpipe serve {args.out}",
            highlight=False,
        )
    return 0


def _print_streams(gp, doc, streams) -> None:
    """Each stream's path (`doc`: the plan `gp` as served): its parts with their blocks
    and budgets."""
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


def cmd_graft_client(args: argparse.Namespace) -> int:
    """A hybrid client's load against a router serving a plan of entry streams (poolpipe
    graft plan --out, then poolpipe serve): --requests requests of --model at --rate req/s
    (Poisson), each running the model's first blocks here (cut from the warehouse's files,
    timed here first), its entry chosen among the plan's by Neurosurgeon's rule at
    --uplink-mbps, the rest sent to the router with what is left of --slo-ms. Prints the
    entries used, on time, dropped, refused, latency p50 / p99, and each of the first
    --check answers against the whole model run here (ONNX Runtime)."""
    import time

    import numpy as np

    from poolpipe.client.hybrid import HybridClient, doors
    from poolpipe.domain.plan import Plan
    from poolpipe.offline.onnxgraph import session
    from poolpipe.store.warehouse import Warehouse

    if not (args.rate > 0 and args.requests > 0 and args.uplink_mbps > 0):
        raise PoolpipeError("--rate, --requests and --uplink-mbps must be > 0")
    plan = Plan.load(Path(args.plan))
    gates = doors(plan.meta, args.model)
    with Warehouse.open(args.warehouse) as wh:
        profile = wh.load_profile(args.model)
        whole = wh.whole_model_file(args.model)
        layers = wh.block_layers(args.model)
    if whole is None:
        raise PoolpipeError(f"model {args.model} has no onboarded files in the warehouse")
    gpu = args.server_gpu or min(profile.tables, key=lambda k: profile.whole_latency_us(*k))[0]
    if (gpu, 1) not in profile.tables:
        raise PoolpipeError(f"--server-gpu {gpu}: {args.model} is profiled on {profile.gpus}")
    slo_us = args.slo_ms * 1e3 if args.slo_ms else profile.slo_us
    if slo_us is None:
        raise PoolpipeError(f"{args.model} has no SLO of its own: give --slo-ms")
    reference = session(whole)
    rng = np.random.default_rng(args.seed)
    x = {
        i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(
            np.float32
        )
        for i in reference.get_inputs()
    }
    client = HybridClient(
        args.router,
        whole,
        layers,
        gates,
        list(profile.tables[(gpu, 1)].latency_us[:, 0]),
        slo_us,
        Path(args.workspace),
        margin=plan.margin,
    )
    uplink = args.uplink_mbps * 1e6 / 8
    client.measure(x)
    entry, budget = client.choose(uplink)
    console.print(
        f"{args.model}: blocks timed here {[round(t / 1e3, 2) for t in client.client_us]} ms; "
        f"at {args.uplink_mbps:g} Mbit/s entry {entry} ({gates[entry]}), "
        f"{budget / 1e3:.1f} ms of {slo_us / 1e3:g} left the server",
        highlight=False,
    )
    from tritonclient.utils import InferenceServerException

    entries: dict[int, int] = {}
    latencies, late, dropped, refused, worst = [], 0, 0, 0, 0.0
    start = time.perf_counter()
    due = 0.0
    try:
        for k in range(args.requests):
            due += rng.exponential(1 / args.rate)
            time.sleep(max(0.0, start + due - time.perf_counter()))
            try:
                got = client.infer(x, uplink)
            except InferenceServerException as e:
                # refused: a budget left that no path of the plan meets (400 up front)
                if e.status() == "StatusCode.INVALID_ARGUMENT":
                    refused += 1
                else:
                    dropped += 1
                if dropped + refused <= 3:
                    console.print(f"request {k}: {e.message()}", highlight=False)
                continue
            entries[got.entry] = entries.get(got.entry, 0) + 1
            latencies.append(got.total_ms)
            late += got.total_ms > slo_us / 1e3
            if k < args.check:
                (want,) = reference.run(None, x)
                (out,) = got.outputs.values()
                worst = max(worst, float(np.abs(out - want).max() / np.abs(want).max()))
    finally:
        client.close()
    answered = len(latencies)
    on_time = answered - late
    p50, p99 = (np.percentile(latencies, q) if latencies else float("nan") for q in (50, 99))
    console.print(
        f"{args.requests} requests: {on_time} on time ({on_time / args.requests:.1%}), "
        f"{late} late, {dropped} dropped, {refused} refused; "
        f"entries {dict(sorted(entries.items()))}; latency "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms (the client's blocks and the upload estimate "
        f"included); the first {min(args.check, answered)} answers within {worst:.2e} of "
        "the whole model's (max |diff| / max |answer|; fp16 between stages)",
        highlight=False,
    )
    return 0


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
        "--merge",
        choices=("first", "best"),
        default="first",
        help="re-aligned groups: each round's first merge that costs no more (first, the "
        "default), or its cheapest (best: more MILPs; 12 GPUs instead of 13 on one of "
        "bench-hybrid's mixes, 148 s of planning instead of 41.5)",
    )
    plan.add_argument(
        "--prices",
        help="price per GPU-hour per type, e.g. L4=0.56,T4=0.35 (default: the clusters file's; "
        "none there: 1 per GPU)",
    )
    plan.add_argument("--out", help="write the --how plan here (JSON)")
    plan.set_defaults(func=cmd_graft_plan)
    client = gsub.add_parser(
        "client",
        help="a hybrid client's load: first blocks here, the rest through the router",
        description=cmd_graft_client.__doc__,
    )
    client.add_argument("plan", help="the plan the router serves (poolpipe graft plan --out)")
    client.add_argument("--model", required=True, help="the model whose blocks run here")
    client.add_argument("--router", default="127.0.0.1:8001", help="the router's gRPC address")
    client.add_argument("--uplink-mbps", type=float, default=100.0, help="Mbit/s (100)")
    client.add_argument("--slo-ms", type=float, help="end-to-end SLO (default: the model's)")
    client.add_argument("--rate", type=float, default=5.0, help="req/s, Poisson (5)")
    client.add_argument("--requests", type=int, default=50, help="how many (50)")
    client.add_argument("--check", type=int, default=5, help="answers checked (5)")
    client.add_argument(
        "--server-gpu", help="the profile's GPU type for the server's blocks (the fastest)"
    )
    client.add_argument("--workspace", default="out/hybrid", help="the client's block files")
    client.add_argument("--seed", type=int, default=1)
    client.set_defaults(func=cmd_graft_client)
