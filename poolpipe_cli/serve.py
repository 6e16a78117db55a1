"""`poolpipe serve` (a plan: the router, on nodes of an inventory or on nodes it starts
here), `poolpipe node` (one stage-worker node on this host) and `poolpipe rollout` (a new
plan to a running router, as a Prefect flow)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
from pathlib import Path

from rich.console import Console

from poolpipe.client.control import (
    TOKEN_FILE_VAR,
    new_token_file,
    node_headers,
    node_key,
    read_token,
)
from poolpipe.domain.tier import split_address
from poolpipe.errors import PoolpipeError
from poolpipe.runtime import DEFAULT_MARGIN_CEILING_US, DEFAULT_MARGIN_FLOOR_US, ArrivalStamps
from poolpipe.runtime.envelope import EnvelopeConfig
from poolpipe.runtime.stamps import DEFAULT_CLOCK_BOUND_US, DEFAULT_MAX_WAIT_US
from poolpipe.scheduler import DATA_PLANES
from poolpipe_cli.common import (
    add_reply_margin_argument,
    call_overhead_to_check,
    err_console,
    log_events,
    warn_each,
)
from triton_backend import (
    DOOR_QUEUE,
    DOOR_RING_MB,
    REPLAN_GRACE_S,
    ROUTER_INSTANCES,
    TRANSPORT_CHOICES,
)
from triton_backend.env import is_loopback
from triton_backend.node.feed import FEED_MB, FeedRegion
from triton_backend.router.tracing import (
    HEADERS_VAR,
    TRACES_ENDPOINT_VAR,
    TRACES_HEADERS_VAR,
    TraceConfig,
    parse_headers,
)

console = Console()


def _check_slo_room(args: argparse.Namespace, plan) -> float:
    """Refuse, as a rollout does, a plan whose SLOs the reply margin leaves no room in
    (every request of such a model would be refused), unless --force: then it is served,
    not ready to a load balancer and said in the log every minute. Returns the margin it
    checked with (the one given, or what a router measured on this warehouse's nodes)."""
    from poolpipe.runtime import slo_room_warnings
    from poolpipe.store.plan_inputs import reply_margin_us
    from poolpipe.store.warehouse import Warehouse

    with Warehouse.open(args.warehouse) as wh:
        floor_us = args.reply_margin_ms * 1e3
        names = [m.name for m in plan.models]
        margin_us = reply_margin_us(wh, floor_us, floor_us, names)
        overhead_us = call_overhead_to_check(wh, names)
    no_room = slo_room_warnings(plan, margin_us, overhead_us)
    _refuse_unless_forced(args, no_room, "; ".join(str(w) for w in no_room) + " ")
    return margin_us


def _check_live_room(args: argparse.Namespace, server, margin_us: float) -> None:
    """The same check once the nodes run, on the stage times the router measured there
    (a stage call costs more than the block's profiled run, most of all for fast models):
    what the door would refuse every request of is refused here, unless --force."""
    from poolpipe.runtime import live_room_warnings

    no_room = live_room_warnings(server.deployment.core.runtime.topo, margin_us)
    _refuse_unless_forced(
        args,
        no_room,
        "; ".join(w.refusal() for w in no_room)
        + ". Plan it with a longer SLO (plan --slo-ms or a larger --slo-scale); ",
    )


def _refuse_unless_forced(args: argparse.Namespace, no_room: list, why: str) -> None:
    """A PoolpipeError saying `why` where models have no room, unless --force: then each
    is warned of."""
    if no_room and not args.force:
        raise PoolpipeError(
            f"refused: {why}--force serves it anyway (reported not ready, and said every minute)"
        )
    warn_each(no_room)


def _plan_arg(args: argparse.Namespace):
    from poolpipe.domain.plan import Plan
    from poolpipe.store.plan_inputs import check_plan
    from poolpipe.store.warehouse import Warehouse

    if args.plan.isdigit():
        with Warehouse.open(args.warehouse) as wh:
            plan = wh.load_plan(int(args.plan))
            return check_plan(wh, plan, f"plan {args.plan}", int(args.plan)), int(args.plan)
    path = Path(args.plan)
    if not path.is_file():
        raise PoolpipeError(f"--plan {args.plan!r} is neither a plan id nor a plan JSON file")
    plan = Plan.load(path)
    with Warehouse.open(args.warehouse) as wh:  # stored only once it passes
        check_plan(wh, plan, str(path))
        return plan, wh.stored_plan_id(plan, label=f"serve:{path.name}")


class SignalStop:
    """Set by SIGTERM or Ctrl-C (_stop_on_signals): a plain flag. A handler that set a
    threading.Event ran in the main thread while that thread waited on the same event, and
    when the signal landed inside the wait's lock hand-over the handler waited for that
    lock forever: `serve` then ignored SIGTERM (seen once under the test suite)."""

    def __init__(self) -> None:
        self.signalled = False

    def is_set(self) -> bool:
        return self.signalled


def _stop_on_signals(also=None) -> SignalStop:
    """From now on SIGTERM and Ctrl-C set the returned flag instead of raising: installed
    before "Ctrl-C stops" is printed, so that no signal can land between that line and
    the wait (one that did left the nodes running) or in the teardown after it. `also()`
    is called at once with the signal (before anything notices the nodes a terminal's
    Ctrl-C reaches as well); it must take no lock."""
    stop = SignalStop()

    def on_signal(*_) -> None:
        stop.signalled = True
        if also is not None:
            also()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop


def _wait_for_signal(stop: SignalStop, also=None) -> None:
    """Until `stop` is set (a signal; looked at every 0.1 s) or `also()` says so (asked
    every second)."""
    import time

    asked = time.monotonic()
    while not stop.is_set():
        time.sleep(0.1)
        if also is not None and time.monotonic() - asked >= 1.0:
            asked = time.monotonic()
            if also():
                break


def cmd_serve(args: argparse.Namespace) -> int:
    from triton_backend.deploy.serving import ServingProcess

    log_events()
    options = router_options(args)  # (bad options refused before anything is written)
    inventory = tier = None
    if args.nodes:
        from poolpipe.domain.inventory import load_inventory

        inventory = load_inventory(args.nodes)
    if args.router:
        shard = _router_shard(args, inventory)  # (refuses a missing inventory)
        assert inventory is not None
        tier, inventory = (inventory, args.router), shard
    if args.replan_on_failure and not args.nodes:
        raise PoolpipeError(
            "--replan-on-failure re-plans for the nodes of an inventory: give --nodes "
            "INVENTORY (nodes serve started here are restarted when they die instead)"
        )
    if args.prefect_events and not os.environ.get("PREFECT_API_URL"):
        raise PoolpipeError(
            "--prefect-events sends the load's events to the Prefect server its deployment "
            "triggers run on: set PREFECT_API_URL to that server's API (e.g. "
            "http://prefect.internal:4200/api)"
        )
    if args.replan_on_failure or args.router:  # flows run here: logged here, not Prefect's
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
        # Prefect's ephemeral API (where no PREFECT_API_URL is set) sends telemetry from its
        # SQLite file, which printed "database is locked" tracebacks beside serving
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    plan, plan_id = _plan_arg(args)
    margin_us = _check_slo_room(args, plan)
    workspace = Path(args.workspace)
    token_file = args.token_file or os.environ.get(TOKEN_FILE_VAR)
    if token_file:
        token = read_token(token_file)
    else:  # secure by default: a fresh token only this user can read
        token_file = str(workspace / "control.token")
        token = new_token_file(Path(token_file))
    what = (
        f"attaching to the nodes of {args.nodes}" if args.nodes else "starting stage-worker nodes"
    )
    with console.status(f"{what} and starting the router ..."):
        server = ServingProcess(
            plan,
            args.warehouse,
            workspace,
            name=args.name,
            plan_id=plan_id,
            stats_interval_s=args.stats_interval,
            metrics_port=args.metrics_port,
            ready_port=args.ready_port,
            agent_port=args.agent_port,
            stop_grace_s=args.stop_grace,
            plane=args.plane,
            inventory=inventory,
            token=token,
            supervise=True,  # nodes it starts itself are restarted when they die
            replan_on_failure=_replanner(args, token_file) if args.replan_on_failure else None,
            replan_grace_s=args.replan_grace,
            tier=tier,
            adopt_after_s=args.adopt_after,
            on_reshard=_resharder(args, token_file) if tier else None,
            on_load_event=_load_events(args) if args.prefect_events else None,
            **options,
        )
    try:
        _check_live_room(args, server, margin_us)
        _serve_until_stopped(server, plan, plan_id, token_file)
    finally:  # whatever ends it, the nodes this started are stopped
        with console.status("stopping ..."):
            server.close()
    return 0


def _router_shard(args: argparse.Namespace, inventory):
    """`serve --router NAME`: that router of the inventory, on its shard's nodes and at its
    addresses; the shard's own inventory, written to the workspace, is what it re-plans for."""
    if inventory is None:
        raise PoolpipeError("--router names a router of an inventory: give --nodes INVENTORY")
    r = inventory.router(args.router)
    listed = [r.http, r.grpc, r.ready, *([r.agent] if r.agent else [])]
    addresses = [split_address(a) for a in listed]
    hosts = {host for host, _ in addresses}
    if len(hosts) > 1:
        raise PoolpipeError(
            f"{inventory.source}: router {r.name} lists addresses on {len(hosts)} hosts "
            f"({', '.join(sorted(hosts))}); its ports listen on one address"
        )
    given = {
        "--listen": args.listen != "127.0.0.1",
        "--http-port": bool(args.http_port),
        "--grpc-port": bool(args.grpc_port),
        "--ready-port": bool(args.ready_port),
        "--agent-port": getattr(args, "agent_port", None) is not None,
    }
    if any(given.values()):
        raise PoolpipeError(
            f"--router {r.name} takes its addresses from {inventory.source}; leave out "
            f"{', '.join(k for k, v in given.items() if v)}"
        )
    args.listen = hosts.pop()
    args.http_port, args.grpc_port, args.ready_port = (port for _, port in addresses[:3])
    args.agent_port = addresses[3][1] if r.agent else None
    from triton_backend.deploy.peers import shard_file

    shard = inventory.shard(r.name)
    path = shard_file(Path(args.workspace), r.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(shard.to_toml())
    args.nodes = str(path)
    return shard


def _replanner(args: argparse.Namespace, token_file: str):
    """The re-planning flow for the nodes of --nodes, as serve calls it after a failure."""
    from flows.replan import on_failure

    return on_failure(
        inventory=str(Path(args.nodes).resolve()),
        warehouse=args.warehouse,
        deployment=args.name,
        token_file=str(Path(token_file).resolve()),
        margin=args.replan_margin,
    )


def _load_events(args: argparse.Namespace):
    """The load's envelope events as Prefect events (prefect.yaml's load-replan trigger)."""
    from flows.replan import load_event_emitter

    return load_event_emitter(args.name)


def _resharder(args: argparse.Namespace, token_file: str):
    """The reshard flow, as a router of a router tier calls it when its shard changes."""
    from flows.replan import on_reshard

    return on_reshard(warehouse=args.warehouse, token_file=str(Path(token_file).resolve()))


def _serve_until_stopped(server, plan, plan_id, token_file: str) -> None:
    dep = server.deployment
    stop = _stop_on_signals(also=lambda: setattr(dep.core, "stopping", True))
    if dep.cleaned:
        console.print(
            f"unloaded {len(dep.cleaned)} partition model(s) an earlier router of these "
            f"models had left on the nodes: {', '.join(dep.cleaned)}",
            highlight=False,
        )
    console.print(
        f"serving plan {plan_id} ({', '.join(m.name for m in plan.models)}) on "
        f"{len(dep.nodes)} node(s) (feature maps "
        f"{'node to node' if dep.options.transport == 'chain' else 'through the router'}): "
        f"KServe v2 HTTP {dep.http_url}, "
        f"gRPC {dep.grpc_url}, router metrics "
        f"http://{_host(server.metrics_address)}:{server.metrics_port}/metrics, its Triton's "
        f"metrics http://{dep.triton_metrics_url}/metrics, readiness for a load balancer "
        f"http://{_host(server.metrics_address)}:{server.ready.port}/ready\n"
        f"look at it: poolpipe status --router {dep.grpc_url} --token-file {token_file}\n"
        f"roll out another plan: poolpipe rollout PLAN --router {dep.grpc_url} "
        f"--token-file {token_file}\n"
        "Ctrl-C stops."
    )
    front = dep.frontend.node if dep.frontend is not None else None
    _wait_for_signal(stop, also=None if front is None else lambda: not front.alive)
    if front is not None and not front.alive:
        raise PoolpipeError(
            f"the router's Triton (its KServe v2 front end) exited; see {front.log_path}. "
            "The router stops, taking its models off its nodes (the routers of its tier "
            "adopt them); start it again, or let its supervisor (systemd) do so"
        )


def _host(address: str) -> str:
    """An address as a URL's host (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def _emulation(args: argparse.Namespace, cpu_class: bool) -> dict[str, str]:
    """The environment that makes the node's partitions emulate its GPU device type."""
    import math

    if not args.emulate:
        if args.time_scale != 1.0:
            raise PoolpipeError("--time-scale applies to emulated nodes only: add --emulate")
        return {}
    if cpu_class:
        raise PoolpipeError(
            f"--emulate is for GPU device types (as profiled: T4, L4, V100, ...); "
            f"{args.device} is a CPU class, which a node runs for real"
        )
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise PoolpipeError(
            f"--time-scale must be a finite number above 0 (the emulated GPU runs that many "
            f"times slower than profiled), got {args.time_scale:g}"
        )
    return {"POOLPIPE_EMULATE_TIME_SCALE": repr(float(args.time_scale))}


def cmd_node(args: argparse.Namespace) -> int:
    from triton_backend.node.triton import TritonNode, refuse_taken_ports, trace_options
    from triton_backend.node.watch import NodeWatch

    if args.trace_endpoint:  # a URL Triton could not export to is refused here, with the fix
        TraceConfig(args.trace_endpoint)
    cpu_class = re.fullmatch(r"cpu-\d+t", args.device) is not None
    if args.gpus < 1:
        raise PoolpipeError(f"--gpus {args.gpus}: a node serves at least one GPU (1 .. the host's)")
    environment = _emulation(args, cpu_class)
    seen = len([d for d in Path("/dev").glob("nvidia*") if d.name[6:].isdigit()])
    if not cpu_class and not args.emulate and 0 < seen < args.gpus:
        raise PoolpipeError(
            f"--gpus {args.gpus}: this host shows {seen} NVIDIA GPU(s) (/dev/nvidia0 ..); "
            "serve those, or --emulate"
        )
    if not cpu_class and not args.emulate and not Path("/dev/nvidiactl").exists():
        err_console.print(
            f"[yellow]warning:[/] device {args.device!r} is not a CPU class (cpu-<n>t) and this "
            "host shows no NVIDIA GPU; partitions for it will not load here",
            highlight=False,
        )
    token_file = args.token_file or os.environ.get(TOKEN_FILE_VAR)
    key = node_key(read_token(token_file)) if token_file else None
    if key is None and not is_loopback(args.listen):
        raise PoolpipeError(
            f"poolpipe node --listen {args.listen} without a token would let anyone who "
            "reaches that address load, unload and replace the models it serves (Triton's "
            "model-repository API); pass --token-file FILE with the router's token (poolpipe "
            f"serve prints where it is; ${TOKEN_FILE_VAR} works too), or listen on 127.0.0.1"
        )
    name = args.name or f"{args.device}@{args.listen}:{args.grpc_port or 'auto'}"
    workspace = Path(args.workspace or f"out/node-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}")
    node = TritonNode(
        re.sub(r"[^A-Za-z0-9_.-]", "_", name),
        args.device,
        workspace / "repo",
        workspace,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        address=args.listen,
        key=key,
        environment=environment,
        options=trace_options(args.trace_endpoint, name),
    )
    if args.feed_mb < 0:
        raise PoolpipeError(f"--feed-mb {args.feed_mb}: give MB of shared memory, or 0 for none")
    watch = feed = None
    try:  # a Ctrl-C while it starts stops what has started
        refuse_taken_ports(f"node {name}", args.listen, {"watch port": args.watch_port})
        with console.status(f"starting node {name} ..."):
            node.start()
            if args.feed_mb:
                feed = FeedRegion(args.feed_mb)
                feed.triton = node.http_url  # calls that come with their maps (``C``)
                with contextlib.closing(node.client()) as client:
                    feed.register(client, node_headers(key, grpc=False))
        # once it serves: routers may watch, hops may feed
        watch = NodeWatch(args.listen, args.watch_port, feed)
        stop = _stop_on_signals()
        what = (
            f"{args.device}, EMULATED from its profiles, time scale {args.time_scale:g}"
            if args.emulate
            else args.device
        )
        if args.gpus > 1:
            what = f"{args.gpus} x {what}"
        gpus = f", gpus = {args.gpus}" if args.gpus > 1 else ""
        console.print(
            f"node {name} ({what}) serving: gRPC {node.grpc_url}, HTTP {node.http_url}, "
            f"metrics {_host(args.listen)}:{node.metrics_port}, watch {watch.url}; models "
            f"arrive through the model repository API (log: {node.log_path}). Its inventory "
            f'entry: grpc = "{node.grpc_url}", http = "{node.http_url}", watch = '
            f'"{watch.url}"{gpus}. Ctrl-C stops.',
            highlight=False,
        )
        _wait_for_signal(stop, also=lambda: not node.alive)
        if not node.alive:
            raise PoolpipeError(f"node {name}: tritonserver exited; see {node.log_path}")
    finally:
        if watch is not None:  # first: routers stop sending here while it stops
            watch.close()
        with console.status("stopping ..."):
            node.stop()
        if feed is not None:
            feed.close()
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    if not args.verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.rollout import rollout_plan

    token_file = args.token_file or os.environ.get(TOKEN_FILE_VAR)
    if token_file:
        read_token(token_file)  # a bad file is refused here, before the flow runs
    with console.status(f"rolling plan {args.plan} out to {args.router} ..."):
        result = rollout_plan(
            args.plan,
            args.router,
            warehouse=args.warehouse,
            token_file=token_file,
            force=args.force,
        )
    console.print(json.dumps(result, indent=2))
    return 0


def _token_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--token-file",
        help=f"file holding {what}; mode 600 (default: ${TOKEN_FILE_VAR})",
    )


def _trace_endpoint_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--trace-endpoint",
        default=os.environ.get(TRACES_ENDPOINT_VAR) or None,
        metavar="URL",
        help=f"{what} (default: ${TRACES_ENDPOINT_VAR}; none: no traces)",
    )


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """The router's options, shared by `serve` and `demo` (see router_options)."""
    p.add_argument(
        "--router-instances",
        type=int,
        default=ROUTER_INSTANCES,
        help="Python-backend instances of each served model's door in the router's Triton; "
        "each hands requests to the router at once; with one, a request that comes while "
        f"it runs can wait in Triton until the next one comes ({ROUTER_INSTANCES})",
    )
    p.add_argument(
        "--door-ring-mb",
        type=float,
        default=DOOR_RING_MB,
        help="shared memory of each door instance through which requests' inputs reach the "
        f"router process; 0: down the door's socket ({DOOR_RING_MB:g})",
    )
    p.add_argument(
        "--door-queue",
        type=int,
        default=DOOR_QUEUE,
        metavar="N",
        help="requests each served model's queue in the router's Triton holds at most, "
        "ahead of the door, when the router's host falls behind; more are refused (503), "
        "as is one that waited there longer than the longest SLO served; 0: no bound "
        f"({DOOR_QUEUE})",
    )
    p.add_argument(
        "--door-ring-dir",
        default=None,
        metavar="DIR",
        help="where the doors' shared memory lies (/dev/shm where there is one, else the "
        "door's own temporary folder)",
    )
    add_reply_margin_argument(
        p,
        "the least held back from each deadline for the way out: the router adds the p99 of "
        "what it measures (its door's egress, chains' overhead) to it",
        DEFAULT_MARGIN_FLOOR_US,
    )
    p.add_argument(
        "--reply-margin-max-ms",
        type=float,
        default=None,
        help="the most the measured reply margin may hold back (the larger of "
        f"{DEFAULT_MARGIN_CEILING_US / 1e3:g} and --reply-margin-ms)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1", help="the router's address for clients (127.0.0.1)"
    )
    p.add_argument("--http-port", type=int, default=0, help="the router's HTTP port (a free one)")
    p.add_argument(
        "--transport",
        choices=TRANSPORT_CHOICES,
        default="auto",
        help="router: every stage called from the router (feature maps pass through it); "
        "chain: the first node sends its feature map straight to the next; auto: router "
        "when every node is on this host (loopback addresses), else chain (auto: on emulated "
        "hc2-small ppipe served 140 req/s by chain, 109 by router; 105 and 35 at 32 GPUs)",
    )
    p.add_argument(
        "--chain-answers",
        default="auto",
        metavar="HOST:PORT|auto|back",
        help="chain transport: where a chain's last node sends the model's outputs: the "
        "router's inbox at HOST:PORT (PORT 0: a free one; HOST 0.0.0.0: every interface, "
        "each node told the address its host is routed to); auto: 127.0.0.1:0 when every "
        "node is on loopback, else 0.0.0.0:0; back: back along the chain, across every "
        "earlier node's NIC (auto)",
    )
    p.add_argument("--grpc-port", type=int, default=0, help="the router's gRPC port (a free one)")
    p.add_argument(
        "--triton-metrics-port",
        type=int,
        default=0,
        help="the router's Triton's own metrics port (a free one)",
    )
    p.add_argument(
        "--arrival-clock-bound-ms",
        type=float,
        default=DEFAULT_CLOCK_BOUND_US / 1e3,
        help="a load balancer's arrival stamp (header x-poolpipe-arrival-us) counts as the "
        "request's arrival; its host's clock and the router's agree within this, and a stamp "
        f"further ahead is ignored and counted ({DEFAULT_CLOCK_BOUND_US / 1e3:g})",
    )
    p.add_argument(
        "--arrival-max-wait-ms",
        type=float,
        default=DEFAULT_MAX_WAIT_US / 1e3,
        help="an arrival stamp older than this is taken for a clock out of sync: ignored and "
        f"counted ({DEFAULT_MAX_WAIT_US / 1e3:g})",
    )
    _trace_endpoint_argument(
        p,
        "export the requests' traces (OpenTelemetry, OTLP/HTTP) to this collector URL, for "
        "example http://otel-collector:4318/v1/traces; headers to send with them (a "
        f"collector's authorisation) from ${TRACES_HEADERS_VAR} or ${HEADERS_VAR} as "
        "NAME=VALUE,...",
    )
    p.add_argument(
        "--trace-sample",
        type=float,
        default=0.01,
        help="the share of requests traced (0 to 1) among those whose client sent no "
        "traceparent header; a client's sampled trace context is followed, and every late, "
        "dropped, failed or refused request is traced (0.01)",
    )
    d = EnvelopeConfig()
    p.add_argument(
        "--envelope",
        default=None,
        metavar="HIGH,LOW,HOLD_S,MIX",
        help="when the load leaves the served plan's envelope (logged, counted in "
        "poolpipe_envelope_events, in `status`): a model's arrivals over the last "
        f"{d.short_s:g} s above HIGH of what the plan states it serves at 99%% on time; every "
        f"model below LOW of it over {d.long_s:g}-s windows for HOLD_S seconds; the mix "
        "further than MIX (total variation) from the plan's "
        f"({d.high:g},{d.low:g},{d.hold_s:g},{d.mix_shift:g})",
    )


def trace_config(args: argparse.Namespace) -> TraceConfig | None:
    """The router's tracing from the options of add_router_arguments (None: off)."""
    if not args.trace_endpoint:
        return None
    headers = os.environ.get(TRACES_HEADERS_VAR) or os.environ.get(HEADERS_VAR)
    return TraceConfig(args.trace_endpoint, args.trace_sample, parse_headers(headers))


def router_options(args: argparse.Namespace) -> dict:
    """Deployment.up's keyword arguments from the options of add_router_arguments."""
    if args.router_instances < 1:
        raise PoolpipeError(f"--router-instances must be at least 1, got {args.router_instances}")
    if args.door_ring_mb < 0:
        raise PoolpipeError(f"--door-ring-mb must be 0 or more, got {args.door_ring_mb:g}")
    if args.door_queue < 0:
        raise PoolpipeError(f"--door-queue must be 0 or more (0: no bound), got {args.door_queue}")
    if args.door_ring_dir is not None and not Path(args.door_ring_dir).is_dir():
        raise PoolpipeError(
            f"--door-ring-dir {args.door_ring_dir}: no such folder (give one on shared memory, "
            "such as /dev/shm, or --door-ring-mb 0)"
        )
    return {
        "router_instances": args.router_instances,
        "door_ring_mb": args.door_ring_mb,
        "door_ring_dir": args.door_ring_dir,
        "door_queue": args.door_queue,
        "reply_margin_us": args.reply_margin_ms * 1e3,
        "reply_margin_max_us": (
            None if args.reply_margin_max_ms is None else args.reply_margin_max_ms * 1e3
        ),
        "listen": args.listen,
        "transport": args.transport,
        "chain_answers": args.chain_answers,
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
        "triton_metrics_port": args.triton_metrics_port,
        "arrival_stamps": ArrivalStamps(
            args.arrival_clock_bound_ms * 1e3, args.arrival_max_wait_ms * 1e3
        ),
        "tracing": trace_config(args),
        "envelope": envelope_config(args.envelope),
    }


def envelope_config(text: str | None) -> EnvelopeConfig | None:
    """--envelope HIGH,LOW,HOLD_S,MIX (None: the defaults)."""
    if text is None:
        return None
    parts = [x.strip() for x in text.split(",")]
    try:
        high, low, hold_s, mix = (float(x) for x in parts)
    except ValueError:
        raise PoolpipeError(
            f"--envelope: {text!r} is not four numbers HIGH,LOW,HOLD_S,MIX (e.g. 0.9,0.4,600,0.2)"
        ) from None
    try:
        return EnvelopeConfig(high=high, low=low, hold_s=hold_s, mix_shift=mix)
    except PoolpipeError as exc:
        raise PoolpipeError(f"--envelope: {exc}") from None


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a plan here: stage-worker nodes (Triton) and the router (Triton)",
        description="Start one tritonserver node per GPU of the plan (CPU device classes "
        "cpu-<threads>t here), the router in front (KServe v2 HTTP/gRPC), per-minute "
        "statistics into the warehouse and Prometheus metrics; run until Ctrl-C.",
    )
    p.add_argument("plan", help="a plan id in the warehouse or a plan JSON file")
    p.add_argument(
        "--nodes",
        metavar="INVENTORY",
        help="serve on the running nodes of this inventory TOML (default: start nodes here)",
    )
    p.add_argument("--workspace", default="out/serve", help="working folder (out/serve)")
    p.add_argument("--name", default="local", help="deployment name in the statistics")
    p.add_argument(
        "--force",
        action="store_true",
        help="serve a plan whose SLOs the reply margin leaves no room in (refused without): "
        "its requests are refused and the router reports not ready",
    )
    p.add_argument("--plane", choices=DATA_PLANES, default="reservation")
    add_router_arguments(p)
    _token_argument(
        p,
        "the secret control commands and the nodes' model repository API require (default: "
        "a fresh one in WORKSPACE/control.token)",
    )
    p.add_argument("--stats-interval", type=float, default=60.0, help="seconds (60)")
    p.add_argument("--metrics-port", type=int, default=0, help="router metrics port (free one)")
    p.add_argument(
        "--stop-grace",
        type=float,
        default=1.0,
        help="seconds the router keeps serving after Ctrl-C or SIGTERM with its readiness "
        "check failing, so that a load balancer sends new requests elsewhere first (1)",
    )
    p.add_argument(
        "--router",
        help="with --nodes: serve as this router of the inventory's [[routers]], on its "
        "shard's nodes and at its addresses (no --listen or ports then)",
    )
    p.add_argument(
        "--agent-port",
        type=int,
        default=None,
        help="port of the router's weight agent for HAProxy's agent-check: it answers the "
        "percentage of its first plan's objective its nodes in service serve now, which "
        "HAProxy applies to its weight (none; with --router: the inventory's `agent`)",
    )
    p.add_argument(
        "--adopt-after",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="with --router: a peer router whose readiness check has not answered for this "
        "long is gone; this router adopts its part of the peer's nodes (re-planned and "
        "rolled out) and hands them back when the peer answers again (3; 0: never adopt)",
    )
    p.add_argument(
        "--ready-port",
        type=int,
        default=0,
        help="port of the router's readiness check for a load balancer: GET /ready answers "
        "200 while it has a live path for every model of its plan, 404 while it stops "
        "(draining), 503 otherwise (a free one)",
    )
    p.add_argument(
        "--replan-on-failure",
        action="store_true",
        help="when nodes of --nodes stay out of service for --replan-grace seconds (or come "
        "back), run the re-planning flow for the nodes in service and roll its plan out if "
        "it serves more than what is left of the serving plan",
    )
    p.add_argument(
        "--replan-grace", type=float, default=REPLAN_GRACE_S, help="seconds (%(default)g)"
    )
    p.add_argument(
        "--prefect-events",
        action="store_true",
        help="send each time the load leaves the plan's envelope (--envelope) to the Prefect "
        "server at $PREFECT_API_URL as an event poolpipe.load.above|below|mix of resource "
        "poolpipe.router.<--name>: prefect.yaml's load-replan deployment re-plans on it",
    )
    p.add_argument(
        "--replan-margin", type=float, default=0.05, help="roll out when better by (0.05)"
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "node",
        help="run one stage-worker node (Triton) on this host until Ctrl-C",
        description="Start one tritonserver in explicit model-control mode with an empty "
        "repository: a router that lists it in its inventory uploads partition models to it "
        "through Triton's model repository API. CPU device classes (cpu-<threads>t) run here. "
        "With --gpus N it serves N GPUs of the host (a node per server): each is a node of "
        "its own to the router, its partitions placed on it.",
    )
    p.add_argument("--device", required=True, help="device type as profiled, e.g. cpu-1t")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs of this host it serves, 0 .. N-1 of those its Triton sees (1); give it as "
        "`gpus` in the inventory",
    )
    p.add_argument("--name", help="node name in logs and folders (device@address:port)")
    p.add_argument("--listen", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port (a free one)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="metrics port (a free one)")
    p.add_argument(
        "--watch-port",
        type=int,
        default=0,
        help="watch port (a free one): routers hold a connection here and take the node out "
        "of service the moment this process ends, and chains' hops write feature maps into "
        "the node's feed there; give it as `watch` in the inventory",
    )
    p.add_argument(
        "--feed-mb",
        type=int,
        default=FEED_MB,
        help=f"shared memory the feed holds feature maps in on their way into this node's "
        f"models (MB, {FEED_MB}; 0: none, maps come through Triton's HTTP front end)",
    )
    p.add_argument("--workspace", help="working folder (out/node-NAME)")
    _trace_endpoint_argument(
        p,
        "trace, with OpenTelemetry, the stage calls of the requests a router traces (they "
        "carry a W3C traceparent) and export the spans over OTLP/HTTP to this collector URL; "
        f"headers from ${HEADERS_VAR}",
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="emulate the GPU device type on this CPU host: each batch completes at its "
        "start + the profiled latency of its partition (which the router sends with it) x "
        "--time-scale; for tests and demos of clusters you do not have",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="with --emulate: run the emulated GPU this many times slower than profiled (1)",
    )
    _token_argument(p, "the router's token: only it may load and unload models here")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser(
        "rollout",
        help="roll a plan out to a running router (Prefect flow)",
        description="Pipeline-flush migration: the router loads the new partition models "
        "while the old serve, pauses intake, flushes, switches and resumes; nothing is lost.",
    )
    p.add_argument("plan", help="a plan id in the warehouse or a plan JSON file")
    p.add_argument("--router", required=True, help="the router's gRPC host:port")
    _token_argument(p, "the router's token (serve prints where it is)")
    p.add_argument(
        "--force",
        action="store_true",
        help="roll out even a plan whose SLO, less the router's measured reply margin, is "
        "shorter than its fastest pipeline (refused otherwise: its requests would be dropped)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show Prefect's logs")
    p.set_defaults(func=cmd_rollout)
