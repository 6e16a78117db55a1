"""`poolpipe lb`: the load balancer in front of the routers (HAProxy), from the inventory's
[balancer] and [[routers]]: render its configuration, run it, ask the routers' readiness."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()

EXAMPLE = """
inventory (beside [[servers]] and [[nodes]]):

  [balancer]
  http = "0.0.0.0:8000"       # KServe v2 HTTP for clients
  grpc = "0.0.0.0:8001"       # KServe v2 gRPC (h2)
  [[routers]]
  name = "r0"
  http = "10.0.0.2:8000"      # poolpipe serve --listen 10.0.0.2 --http-port 8000
  grpc = "10.0.0.2:8001"      #   --grpc-port 8001
  ready = "10.0.0.2:8002"     #   --ready-port 8002
  nodes = ["s0-n0", "s0-n1"]  # its shard (with several routers)
"""


def _inventory(path: str):
    from poolpipe.domain.inventory import load_inventory

    return load_inventory(path)


def cmd_render(args: argparse.Namespace) -> int:
    from triton_backend.lb.haproxy import render

    text = render(_inventory(args.nodes))
    if args.output:
        Path(args.output).write_text(text)
        console.print(f"wrote {args.output}", highlight=False)
    else:
        print(text, end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from poolpipe_cli.serve import _stop_on_signals, _wait_for_signal
    from triton_backend.lb.haproxy import Balancer

    lb = Balancer(_inventory(args.nodes), Path(args.workspace), args.haproxy)
    with console.status("starting HAProxy ..."):
        lb.start()
    try:
        stop = _stop_on_signals()
        console.print(
            f"balancing {len(lb.inv.routers)} router(s) "
            f"({', '.join(r.name for r in lb.inv.routers)}): KServe v2 HTTP {lb.spec.http}, "
            f"gRPC {lb.spec.grpc}"
            + (f", statistics http://{lb.spec.stats}/" if lb.spec.stats else "")
            + f"\nits configuration {lb.config}, its log {lb.log_path}\n"
            f"the routers' readiness: poolpipe lb status --nodes {args.nodes}\nCtrl-C stops.",
            highlight=False,
        )
        _wait_for_signal(stop, also=lambda: not lb.alive())
        if not lb.alive():
            console.print(f"[red]HAProxy exited[/]: {lb._tail()}", highlight=False)
            return 1
    finally:
        lb.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from triton_backend.router.readiness import READY_PATH

    inv = _inventory(args.nodes)
    t = Table(title=f"routers of {args.nodes}", title_justify="left")
    for col in ("router", "readiness", "ready", "why", "plan", "nodes"):
        t.add_column(col)
    ready = 0
    for r in inv.routers:
        url = f"http://{r.ready}{READY_PATH}"
        try:
            with urllib.request.urlopen(url, timeout=args.timeout) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        except (OSError, ValueError) as exc:
            body = {"ready": False, "why": f"no answer ({getattr(exc, 'reason', exc)})"}
        ready += bool(body.get("ready"))
        t.add_row(
            r.name,
            r.ready,
            {"ready": "[green]yes[/]", "draining": "[yellow]draining[/]"}.get(
                str(body.get("state")), "[red]no[/]"
            ),
            str(body.get("why", "")),
            str(body.get("plan_id", "")),
            ", ".join(r.nodes) or "every node",
        )
    console.print(t)
    console.print(f"{ready} of {len(inv.routers)} router(s) ready", highlight=False)
    return 0 if ready == len(inv.routers) else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lb",
        help="the load balancer in front of the routers (HAProxy): render, run, status",
        description="HAProxy in front of several routers, from the inventory's [balancer] "
        "and [[routers]]: KServe v2 HTTP and gRPC front ends, each request stamped with its "
        "arrival (the routers count deadlines from it) and a gRPC client's own deadline "
        "passed on (x-poolpipe-timeout), routers weighted and taken out by their readiness "
        "check (poolpipe serve --ready-port).\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lb = p.add_subparsers(dest="lb_command", required=True, metavar="COMMAND")
    r = lb.add_parser("render", help="print (or write) the HAProxy configuration")
    r.add_argument("--nodes", required=True, help="the inventory TOML")
    r.add_argument("-o", "--output", help="write it here instead of printing it")
    r.set_defaults(func=cmd_render)
    run = lb.add_parser("run", help="run HAProxy with it until Ctrl-C")
    run.add_argument("--nodes", required=True, help="the inventory TOML")
    run.add_argument("--workspace", default="out/lb", help="its config and log (out/lb)")
    run.add_argument("--haproxy", help="the HAProxy binary (the one on PATH)")
    run.set_defaults(func=cmd_run)
    st = lb.add_parser("status", help="ask each router whether it serves (exit 1 if one does not)")
    st.add_argument("--nodes", required=True, help="the inventory TOML")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds per router (2)")
    st.set_defaults(func=cmd_status)
