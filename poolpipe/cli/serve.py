"""`poolpipe serve` (a plan on this machine: stage-worker nodes and the router) and
`poolpipe rollout` (a new plan to a running router, as a Prefect flow)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from rich.console import Console

from poolpipe.cli.common import add_reply_margin_argument, warn_slo_room
from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import DATA_PLANES

console = Console()


def _plan_arg(args: argparse.Namespace):
    from poolpipe.domain.plan import Plan
    from poolpipe.store.warehouse import Warehouse

    if args.plan.isdigit():
        with Warehouse.open(args.warehouse) as wh:
            return wh.load_plan(int(args.plan)), int(args.plan)
    path = Path(args.plan)
    if not path.is_file():
        raise PoolpipeError(f"--plan {args.plan!r} is neither a plan id nor a plan JSON file")
    plan = Plan.load(path)
    with Warehouse.open(args.warehouse) as wh:
        return plan, wh.store_plan(plan, label=f"serve:{path.name}")


def cmd_serve(args: argparse.Namespace) -> int:
    from triton_backend.serve import Server

    plan, plan_id = _plan_arg(args)
    warn_slo_room(plan, args.reply_margin_ms * 1e3)
    workspace = Path(args.workspace)
    with console.status("starting stage-worker nodes and the router ..."):
        server = Server(
            plan,
            args.warehouse,
            workspace,
            name=args.name,
            plan_id=plan_id,
            stats_interval_s=args.stats_interval,
            metrics_port=args.metrics_port,
            plane=args.plane,
            **router_options(args),
        )
    dep = server.deployment
    console.print(
        f"serving plan {plan_id} ({', '.join(m.name for m in plan.models)}) on "
        f"{len(dep.nodes)} node(s): KServe v2 HTTP {dep.http_url}, "
        f"gRPC {dep.grpc_url}, router metrics "
        f"http://127.0.0.1:{server.metrics_port}/metrics\n"
        f"roll out another plan: poolpipe rollout PLAN --router {dep.grpc_url}\n"
        "Ctrl-C stops."
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    with console.status("stopping ..."):
        server.close()
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    if not args.verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.rollout import rollout_plan

    with console.status(f"rolling plan {args.plan} out to {args.router} ..."):
        result = rollout_plan(args.plan, args.router, warehouse=args.warehouse)
    console.print(json.dumps(result, indent=2))
    return 0


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """The router's options, shared by `serve` and `demo` (see router_options)."""
    p.add_argument(
        "--router-instances",
        type=int,
        default=1,
        help="Python-backend instances of each served model's door in the router's Triton; "
        "each hands requests to the router at once (1)",
    )
    add_reply_margin_argument(
        p,
        "the least held back from each deadline for the way in and out; the router measures "
        "its own (ingress + egress p99) and holds back more when it needs to",
    )
    p.add_argument(
        "--reply-margin-max-ms",
        type=float,
        default=None,
        help="the most the measured reply margin may hold back (the larger of 25 and "
        "--reply-margin-ms)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1", help="the router's address for clients (127.0.0.1)"
    )
    p.add_argument("--http-port", type=int, default=0, help="the router's HTTP port (a free one)")
    p.add_argument("--grpc-port", type=int, default=0, help="the router's gRPC port (a free one)")


def router_options(args: argparse.Namespace) -> dict:
    """Deployment.up's keyword arguments from the options of add_router_arguments."""
    if args.router_instances < 1:
        raise PoolpipeError(f"--router-instances must be at least 1, got {args.router_instances}")
    return {
        "router_instances": args.router_instances,
        "reply_margin_us": args.reply_margin_ms * 1e3,
        "reply_margin_max_us": (
            None if args.reply_margin_max_ms is None else args.reply_margin_max_ms * 1e3
        ),
        "listen": args.listen,
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
    }


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a plan here: stage-worker nodes (Triton) and the router (Triton)",
        description="Start one tritonserver node per GPU of the plan (CPU device classes "
        "cpu-<threads>t here), the router in front (KServe v2 HTTP/gRPC), per-minute "
        "statistics into the warehouse and Prometheus metrics; run until Ctrl-C.",
    )
    p.add_argument("plan", help="a plan id in the warehouse or a plan JSON file")
    p.add_argument("--workspace", default="out/serve", help="working folder (out/serve)")
    p.add_argument("--name", default="local", help="deployment name in the statistics")
    p.add_argument("--plane", choices=DATA_PLANES, default="reservation")
    add_router_arguments(p)
    p.add_argument("--stats-interval", type=float, default=60.0, help="seconds (60)")
    p.add_argument("--metrics-port", type=int, default=0, help="router metrics port (free one)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "rollout",
        help="roll a plan out to a running router (Prefect flow)",
        description="Pipeline-flush migration: the router loads the new partition models "
        "while the old serve, pauses intake, flushes, switches and resumes; nothing is lost.",
    )
    p.add_argument("plan", help="a plan id in the warehouse or a plan JSON file")
    p.add_argument("--router", required=True, help="the router's gRPC host:port")
    p.add_argument("-v", "--verbose", action="store_true", help="show Prefect's logs")
    p.set_defaults(func=cmd_rollout)
