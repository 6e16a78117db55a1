"""An operator's commands on a running router: `status` (what it serves, its nodes, its
figures), `drain` / `undrain` (a node out of new batches, and back), `join` / `release` (a
node into the inventory, and out of it), `advise` (the GPUs the observed load needs, and
the nodes that can be released now), and `stats` (the warehouse's per-window serving
statistics)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from rich.table import Table

from poolpipe.client.control import TOKEN_FILE_VAR, read_token
from poolpipe.errors import PoolpipeError
from poolpipe_cli.common import console, open_warehouse


def _send(args: argparse.Namespace, command: dict, timeout_s: float = 30.0) -> dict:
    """`command` to the router at --router with the token of --token-file (or
    $POOLPIPE_TOKEN_FILE); its answer, or a PoolpipeError saying what went wrong."""
    from poolpipe.client import send_control

    token_file = args.token_file or os.environ.get(TOKEN_FILE_VAR)
    token = read_token(token_file) if token_file else None
    try:
        answer = send_control(args.router, command, timeout_s=timeout_s, token=token)
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PoolpipeError(
            f"no answer from the router at {args.router} ({text}); is `poolpipe serve` "
            "running there, and is that its gRPC address?"
        ) from None
    if not answer.get("ok"):
        raise PoolpipeError(f"the router at {args.router} refused: {answer.get('error')}")
    return answer


def _pct(x: object) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"  # type: ignore[arg-type]


def _clock_text(node: dict) -> str:
    """A node's clock against the router's (router/clocks.py), or why there is none: its
    chains' hops are then sent so long after their stage began, not at a time."""
    offset, error = node.get("clock_offset_us"), node.get("clock_error_us")
    if offset is None or error is None:
        return "not known"
    return f"{offset:+.0f} ± {error:.0f}"


def cmd_status(args: argparse.Namespace) -> int:
    s = _send(args, {"op": "status"})
    if args.json:
        console.print_json(json.dumps(s))
        return 0
    ports = s["ports"]
    console.print(
        f"deployment {s['deployment']}: plan {s['plan_id']} (generation {s['generation']}), "
        f"serving since {s['started']}; reply margin {s['reply_margin_ms']:.2f} ms\n"
        f"ports: HTTP {ports['http']}, gRPC {ports['grpc']}, metrics {ports['metrics']}, "
        f"its Triton's metrics {ports['triton_metrics']}",
        highlight=False,
    )
    nodes = Table(title="nodes")
    for col in ("node", "address", "state", "since", "batches on it", "idle s",
                "clock - router's, µs"):  # fmt: skip
        nodes.add_column(col)
    for n in s["nodes"]:
        style = {"down": "red", "drained": "yellow"}.get(n["state"], "")
        nodes.add_row(
            n["node"], n["address"], n["state"], n["since"] or "start", str(n["batches"]),
            f"{n.get('idle_s', 0):g}", _clock_text(n), style=style,
        )  # fmt: skip
    console.print(nodes)
    models = Table(title="models (since the start; then the last windows written)")
    cols = ("model", "when", "req/s", "arrivals", "on time", "refused", "dropped", "failed")
    for col in (*cols, "p99 ms"):
        models.add_column(col, justify="left" if col in ("model", "when") else "right")
    for name, m in s["models"].items():
        plan_rps = s["live_throughput"].get(name)
        models.add_row(
            name, "since start", f"{m['req_s']:.1f}", str(m["arrivals"]),
            _pct(m["attainment"]), str(m["refused"]), str(m["dropped"]), str(m["failed"]), "-",
        )  # fmt: skip
        for w in s["windows"][-3:]:
            r = w["models"].get(name)
            if r is None:
                continue
            models.add_row(
                "", f"{w['start']} ({w['seconds']:g} s)", f"{r['req_s']:.1f}",
                str(r["arrivals"]), _pct(r["attainment"]), str(r["refused"]),
                str(r["dropped"]), str(r["failed"]),
                "-" if r["p99_ms"] is None else f"{r['p99_ms']:.1f}",
            )  # fmt: skip
        if plan_rps is not None:
            models.add_row("", "planned on the nodes in service", f"{plan_rps:.1f}", *[""] * 6)
    console.print(models)
    _print_load(s.get("load") or {})
    if s["node_changes"] or s["rollouts"]:
        console.print(
            "node changes: "
            + (", ".join(f"{k} {v}" for k, v in s["node_changes"].items()) or "none")
            + "; rollouts: "
            + (", ".join(f"{k} {v}" for k, v in s["rollouts"].items()) or "none"),
            highlight=False,
        )
    return 0


def _print_load(load: dict) -> None:
    """The load observed against the plan's envelope (status's "load")."""
    if not load.get("models"):
        return
    t = Table(title=f"load against the plan's envelope (sampled {load['sampled_s']:g} s)")
    windows = list(next(iter(load["models"].values()))["req_s"])
    for col in ("model", *(f"req/s {w}" for w in windows), "envelope req/s", "share"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name, m in load["models"].items():
        t.add_row(
            name,
            *(f"{m['req_s'][w]:.1f}" for w in windows),
            "-" if m["envelope_req_s"] is None else f"{m['envelope_req_s']:.1f}",
            "-" if m["share"] is None else f"{m['share']:.2f}",
        )
    console.print(t)
    if not load.get("envelope"):
        console.print("no envelope: the plan states no deliverable req/s (plan it with --delivery)")
    events = ", ".join(f"{k} {v}" for k, v in load["events"].items())
    console.print(f"envelope events: {events}", highlight=False, markup=False)
    for e in load["recent"][-3:]:
        console.print(
            f"  {e['seconds_ago']} s ago, {e['kind']}: {e['why']}", highlight=False, markup=False
        )


def cmd_advise(args: argparse.Namespace) -> int:
    import tomllib

    from poolpipe.domain.inventory import load_inventory, parse_inventory
    from poolpipe.domain.plan import Plan, time_scale
    from poolpipe.planner.advise import advise, published, undilated_load
    from poolpipe_cli.plans import parse_pairs

    status = _send(args, {"op": "status"})
    served = Plan.from_dict(_send(args, {"op": "plan"})["plan"])
    if args.inventory:
        inv = load_inventory(args.inventory)
    else:
        text = _send(args, {"op": "inventory"})["inventory"]
        inv = parse_inventory(tomllib.loads(text), f"the inventory of router {args.router}")
    cluster = inv.cluster()
    if args.rates:
        rates = parse_pairs(args.rates, "rates")
    else:
        load = (status.get("load") or {}).get("models") or {}
        window = f"{args.window:g}s"
        if not load or window not in next(iter(load.values()))["req_s"]:
            have = ", ".join(next(iter(load.values()))["req_s"]) if load else "none yet"
            raise PoolpipeError(
                f"the router keeps no {window} rate (it keeps: {have}); pass --window with one "
                "of those, or --rates NAME=REQ/S,..."
            )
        rates = {n: float(m["req_s"][window]) for n, m in load.items()}
    prices = parse_pairs(args.prices, "prices") if args.prices else None
    scale = time_scale(served)  # emulated GPU nodes at time scale D: planned undilated
    served, rates = undilated_load(served, rates)
    if scale != 1 and not args.inventory:  # (the router's own lists the NICs D times slower)
        cluster = replace(cluster, bandwidth_gbps=cluster.bandwidth_gbps * scale)
    with open_warehouse(args) as wh:
        profiles = {m.name: wh.load_profile(m.name) for m in served.models}
    with console.status("planning the cheapest GPUs for the observed load ..."):
        a = advise(
            served, profiles, rates, cluster, headroom=args.headroom, prices=prices,
            nodes=status["nodes"], idle_s=args.idle_s,
        )  # fmt: skip
    if args.publish:
        _send(args, {"op": "advice", "advice": published(a)})
    if args.json:
        console.print_json(json.dumps(a.to_dict()))
        return 0
    source = "--rates" if args.rates else f"the router's last {args.window:g} s"
    t = Table(
        title=f"GPUs for the load of {source} x {1 + a.headroom:g} (headroom {a.headroom:.0%})"
    )
    for col in ("GPU type", "in use", "needed", "change", "offered"):
        t.add_column(col, justify="left" if col == "GPU type" else "right")
    change = a.change()
    for g in sorted(set(a.in_use) | set(a.available)):
        t.add_row(
            g, str(a.in_use.get(g, 0)), "-" if a.needed is None else str(a.needed.get(g, 0)),
            "-" if a.needed is None else f"{change.get(g, 0):+d}", str(a.available.get(g, 0)),
        )  # fmt: skip
    console.print(t)
    m = Table(title="per model")
    for col in ("model", "req/s observed", "req/s asked", "advised plan delivers"):
        m.add_column(col, justify="left" if col == "model" else "right")
    for name, r in a.rates.items():
        d = None if a.deliverable is None else a.deliverable.get(name)
        m.add_row(name, f"{r:.1f}", f"{a.asked[name]:.1f}", "-" if d is None else f"{d:.1f}")
    console.print(m)
    if a.why_not:
        console.print(f"[red]the GPUs offered cannot serve the load:[/] {a.why_not}")
    elif a.cost_per_hour is not None:
        console.print(
            f"advised plan: {a.cost_per_hour:g} per hour against {a.served_cost_per_hour:g} "
            "served"
            + ("" if a.priced else " (no prices known: every GPU counted as 1; give --prices)"),
            highlight=False,
        )
    if a.releasable:
        console.print(f"nodes that can be released now (idle >= {args.idle_s:g} s, no batch):")
        for n in a.releasable:
            console.print(
                f"  {n['node']} ({n['address']}, {n['state']}, idle {n['idle_s']:g} s): "
                f"{n['action']}",
                highlight=False,
            )
    else:
        console.print(f"no node can be released now (none idle >= {args.idle_s:g} s)")
    if args.publish:
        console.print(
            f"told router {args.router}: its gauges poolpipe_gpus_needed and "
            "poolpipe_gpus_needed_headroom say so now",
            highlight=False,
        )
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    with console.status(f"draining {args.node} (waiting for its batches) ..."):
        r = _send(
            args, {"op": "drain", "node": args.node, "timeout_s": args.timeout},
            timeout_s=args.timeout + 30,
        )  # fmt: skip
    left = r["batches_left"]
    console.print(
        f"node {r['node']} drained in {r['waited_s']:.2f} s: no new batch goes to it"
        + (f"; {left} batch(es) still on it after {args.timeout:g} s" if left else "")
        + f". Put it back: poolpipe undrain {args.node} --router {args.router}",
        highlight=False,
    )
    return 0 if not left else 1


def cmd_undrain(args: argparse.Namespace) -> int:
    _send(args, {"op": "undrain", "node": args.node})
    console.print(f"node {args.node} is back in service (checked now)", highlight=False)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    node = {"name": args.node, "server": args.server, "device": args.device, "grpc": args.grpc}
    node |= {k: v for k, v in (("http", args.http), ("watch", args.watch)) if v}
    if args.shares:
        try:
            node["shares"] = [int(x) for x in args.shares.split(",")]
        except ValueError:
            raise PoolpipeError(f"--shares: {args.shares!r} is not a list such as 1,2,4") from None
    server = None
    if args.bandwidth_gbps is not None:
        server = {"name": args.server, "bandwidth_gbps": args.bandwidth_gbps}
    r = _send(args, {"op": "join", "node": node, "server": server})
    console.print(
        f"node {r['node']} ({r['device']}) joined: {r['nodes']} nodes in the inventory; the "
        "next re-plan plans for it (poolpipe advise shows what the load needs)",
        highlight=False,
    )
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    r = _send(args, {"op": "release", "node": args.node})
    console.print(
        f"node {r['node']} released: no longer in the inventory ({r['nodes']} nodes left); "
        "it can be given back",
        highlight=False,
    )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with open_warehouse(args) as wh:
        where, params = "", []
        if args.deployment:
            where, params = "WHERE deployment = ?", [args.deployment]
        rows = wh.con.execute(
            "SELECT minute, seconds, deployment, plan_id, model, arrivals, on_time, late, "
            f"refused, dropped, failed, p50_ms, p99_ms, mean_batch FROM serving_stats {where} "
            "ORDER BY minute DESC, deployment, model LIMIT ?",
            [*params, args.last],
        ).fetchall()
    cols = (
        "minute", "seconds", "deployment", "plan_id", "model", "arrivals", "on_time", "late",
        "refused", "dropped", "failed", "p50_ms", "p99_ms", "mean_batch",
    )  # fmt: skip
    records = [dict(zip(cols, r, strict=True)) for r in reversed(rows)]
    if args.json:
        for r in records:
            r["minute"] = r["minute"].isoformat()
        console.print_json(json.dumps(records))
        return 0
    if not records:
        console.print(
            "no serving statistics yet"
            + (f" for deployment {args.deployment!r}" if args.deployment else "")
            + " (a router writes a window every --stats-interval seconds)"
        )
        return 0
    t = Table(title=f"serving statistics, the last {len(records)} row(s)")
    for c in ("window", "deployment", "plan", "model", "req/s", "arrivals", "on time",
              "late", "refused", "dropped", "failed", "p50 ms", "p99 ms",
              "batch"):  # fmt: skip
        t.add_column(c, justify="left" if c in ("window", "deployment", "model") else "right")

    def num(x: object, f: str = ".1f") -> str:
        return "-" if x is None else format(x, f)

    for r in records:
        n = r["arrivals"]
        t.add_row(
            f"{r['minute']:%Y-%m-%d %H:%M:%S} ({r['seconds']:.0f} s)", r["deployment"],
            num(r["plan_id"], "d"), r["model"], num(n / r["seconds"] if r["seconds"] else None),
            str(n), _pct(r["on_time"] / n if n else None), str(r["late"]), str(r["refused"]),
            str(r["dropped"]), str(r["failed"]), num(r["p50_ms"]), num(r["p99_ms"]),
            num(r["mean_batch"], ".2f"),
        )  # fmt: skip
    console.print(t)
    return 0


def _router(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="the router's gRPC host:port")
    p.add_argument("--token-file", help=f"the router's token file (default: ${TOKEN_FILE_VAR})")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="a running router: plan, nodes in and out of service, live figures, ports",
        description="Ask a running router (poolpipe serve) what it serves: the plan and its "
        "generation, every node's state (in service, down, drained) and since when, per "
        "model the req/s and attainment since the start and over the last windows, the "
        "reply margin, the ports.",
    )
    _router(p)
    p.add_argument("--json", action="store_true", help="the router's answer as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "drain",
        help="take a node out of new batches and wait for those on it to end",
        description="The router sends no new batch to NODE (also after rollouts) and waits "
        "for the batches on it to end; then the node may be stopped or upgraded without a "
        "dropped request. `poolpipe undrain` puts it back.",
    )
    p.add_argument("node", help="the node's name in the inventory (or its gRPC host:port)")
    _router(p)
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for its batches (60)"
    )
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser(
        "advise",
        help="the GPUs of each type the observed load needs, and the nodes to release now",
        description="Ask a running router for its load (per model req/s over --window) and "
        "plan the cheapest GPUs of its inventory that serve it x (1 + --headroom), sized on "
        "what the plan delivers (the cost objective): GPUs per type in use, needed, offered; "
        "and the nodes that can be released now (idle >= --idle-s with no batch: the data "
        "plane packs batches onto the lowest-numbered GPUs, so at a low load the others "
        "stay idle). What an autoscaler acts on; nodes that join the inventory are used at "
        "the next re-plan.",
    )
    _router(p)
    p.add_argument("--window", type=float, default=300.0, help="the rates' window, s (300)")
    p.add_argument("--rates", help="NAME=REQ/S,... instead of the router's observed rates")
    p.add_argument("--headroom", type=float, default=0.2, help="share above the load (0.2)")
    p.add_argument("--idle-s", type=float, default=60.0, help="idle before release, s (60)")
    p.add_argument("--prices", help="TYPE=PRICE per GPU-hour,... (default: 1 per GPU)")
    p.add_argument("--inventory", help="an inventory file (default: the router's own)")
    p.add_argument(
        "--publish",
        action="store_true",
        help="tell the router too: its gauges poolpipe_gpus_needed (per type) and "
        "poolpipe_gpus_needed_headroom, beside poolpipe_gpus_in_use",
    )
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser(
        "join",
        help="a node joins the router's inventory (the next re-plan plans for it)",
        description="Add a running node (poolpipe node, with the router's token) to the "
        "inventory of a router that serves one (serve --nodes): it must answer; the next "
        "rollout may place on it and the next re-plan (load-replan, nightly) plans for it.",
    )
    p.add_argument("node", help="its name")
    p.add_argument("--server", required=True, help="the inventory server it is on")
    p.add_argument("--device", required=True, help="its GPU type, as the profiles name it")
    p.add_argument("--grpc", required=True, help="its gRPC host:port")
    p.add_argument("--http", help="its KServe v2 HTTP host:port")
    p.add_argument("--watch", help="its process's watch host:port")
    p.add_argument("--shares", help="vGPU shares it may be cut into, e.g. 1,2,4 (1)")
    p.add_argument("--bandwidth-gbps", type=float, help="its server's NIC (a new server)")
    _router(p)
    p.set_defaults(func=cmd_join)

    p = sub.add_parser(
        "release",
        help="a node leaves the router's inventory (refused while the plan uses it)",
        description="Take a node out of a router's inventory so that it can be given back: "
        "refused while the plan served places a partition on it (roll out a plan without it "
        "first; poolpipe advise names the nodes a plan for the load leaves idle).",
    )
    p.add_argument("node", help="its name in the inventory")
    _router(p)
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("undrain", help="put a drained node back in service")
    p.add_argument("node", help="the node's name in the inventory (or its gRPC host:port)")
    _router(p)
    p.set_defaults(func=cmd_undrain)

    p = sub.add_parser(
        "stats",
        help="the serving statistics routers wrote to the warehouse, as a table or JSON",
        description="The per-window rows of serving_stats (one per model and window), newest last.",
    )
    p.add_argument("--deployment", help="only this deployment's rows (serve --name)")
    p.add_argument("--last", type=int, default=20, help="rows (20)")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=cmd_stats)
