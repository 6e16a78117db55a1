"""The router tier on this machine: a router (real tritonserver node, the router's Triton and
door, the runtime) behind HAProxy rendered by `poolpipe lb` from an inventory. Each part
prints a table and stores its rows in the warehouse (bench_serving, bench router-tier-*):

1. burst: `--burst` requests at once (SLO `--burst-slo-ms`; a one-partition plan, batch 4),
   alternately straight to the router and through the balancer, over HTTP (a connection
   each, timed by the kernel's stamps) and over gRPC (`--burst-clients` asyncio clients,
   each a process of its own, firing at one agreed moment), `--rounds` times each: on
   time, late and dropped as the clients count them and as the router does; through the
   balancer the router's deadlines run from its stamps.
2. CPU per request: `--requests` one after another over gRPC, straight and through the
   balancer: the CPU each process spent per request (HAProxy, the router's Triton with its
   door stubs, the router process) and the client's p50.
3. router kill: two routers (`poolpipe serve --router`), a cpu-1t node each (`poolpipe
   node`) serving a light model (ResNet-50 at 1/8 width, 32 px), behind HAProxy under an
   open-loop load; one router's processes killed: errors, hung
   requests, when its node serves again (adopted by the other router), the router
   started again and its node handed back; per-second timeline.
4. CPU cap: 1 and 2 routers, each held to `--cap-cpus` by a cgroup CPU quota, on a load
   the routers limit (the light model on two cpu-1t nodes): capacity through the balancer.
5. sharding: what splitting hc2-large and hc4-large into 2 and 4 shards (one per router,
   each planned for itself: whole servers, GPUs evenly, or the split searched for the
   highest summed objective) costs against planning the whole cluster (planner only).

    ./run bench-router-tier [--burst 500] [--burst-slo-ms 100] [--rounds 2] [--burst-clients 5]
                            [--requests 300]
    ./run bench-router-tier --parts sharding     # the planner only: no HAProxy, no servers
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from bench_serving import client_run, hand_plan, onboard_bench_model
from rich.console import Console
from rich.table import Table

from poolpipe.domain.inventory import parse_inventory
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import scratch_dir, teardown_on_sigterm
from testbed.cpu import cpu_seconds

console = Console(width=None if sys.stdout.isatty() else 150)


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--burst", type=int, default=500, help="requests in a burst (500)")
    ap.add_argument("--burst-slo-ms", type=float, default=100.0, help="their SLO (100)")
    ap.add_argument("--rounds", type=int, default=2, help="bursts per path (2)")
    ap.add_argument(
        "--burst-clients",
        type=int,
        default=5,
        help="gRPC clients sharing a burst, each a process of its own firing at one moment (5)",
    )
    ap.add_argument("--requests", type=int, default=300, help="closed-loop requests (300)")
    ap.add_argument(
        "--parts",
        default="burst,cpu,kill,cap,sharding",
        help="which parts, comma-separated: burst, cpu, kill, cap, sharding (all)",
    )
    ap.add_argument("--kill-rate", type=float, default=10.0, help="req/s in the kill part (10)")
    ap.add_argument("--kill-seconds", type=float, default=60.0, help="its length (60 s)")
    ap.add_argument("--cap-cpus", type=float, default=0.15, help="CPU of each router (0.15)")
    ap.add_argument("--cap-step", type=float, default=5.0, help="rate grid, req/s (5)")
    ap.add_argument("--cap-top", type=int, default=600, help="highest rate tried (600)")
    ap.add_argument("--cap-seconds", type=float, default=8.0, help="per rate tried (8 s)")
    ap.add_argument("--profiles", type=Path, default=None, help="PPipe profiles (shipped ones)")
    ap.add_argument(
        "--bound-time-limit",
        type=float,
        default=60.0,
        help="sharding: seconds for the MILP bounding every split's loss (60)",
    )
    args = ap.parse_args()
    if args.burst < 1 or args.rounds < 1 or args.requests < 10 or args.burst_clients < 1:
        ap.error(
            "--burst, --rounds and --burst-clients must be at least 1, --requests at least 10"
        )
    parts = set(args.parts.split(","))
    if not parts or parts - {"burst", "cpu", "kill", "cap", "sharding"}:
        ap.error(f"--parts: choose among burst, cpu, kill, cap, sharding, got {args.parts!r}")
    rows = BenchRows(args.label)
    if parts & {"burst", "cpu"}:
        live_parts(args, parts, rows)
    if parts & {"kill", "cap"}:  # tiers of processes, on a light model
        tmp = scratch_dir("bench-router-tier-")
        model = onboard_tiny_model(args.warehouse, tmp)
        if "kill" in parts:
            kill_part(args, model, tmp, rows.record)
        if "cap" in parts:
            cap_part(args, model, tmp, rows.record)
    if "sharding" in parts:
        sharding_part(args, rows.record)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench router-tier-*)")
    return 0


def live_parts(args, parts: set[str], rows: BenchRows) -> None:

    from triton_backend.deploy.serving import ServingProcess
    from triton_backend.env import free_ports
    from triton_backend.lb.haproxy import Balancer, find_haproxy

    find_haproxy()  # before anything starts: the error says how to install it
    tmp = scratch_dir("bench-router-tier-")
    name = onboard_bench_model(args.warehouse, tmp)

    plan = hand_plan(name, [(0, 4, "cpu-2t", 1)], 4, args.burst_slo_ms, args.warehouse)
    http, grpc, ready, lb_http, lb_grpc = free_ports(5)
    with console.status("starting the router and HAProxy in front of it ..."):
        srv = ServingProcess(
            plan,
            args.warehouse,
            tmp / "router",
            stats_interval_s=3600,
            ready_port=ready,
            http_port=http,
            grpc_port=grpc,
        )
        try:
            inv = parse_inventory(
                _inventory(srv.deployment.nodes, http, grpc, ready, lb_http, lb_grpc),
                "bench inventory",
            )
            lb = Balancer(inv, tmp / "lb").start()
        except BaseException:
            srv.close()
            raise
    try:
        dep = srv.deployment
        x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
        in_name = dep.ios[0].inputs[0].name
        paths = {"router": (dep.http_url, dep.grpc_url), "balancer": (lb.http_url, lb.grpc_url)}
        _wait_until_balanced(lb.grpc_url, name, in_name, x)
        if "burst" in parts:
            burst_part(args, srv, paths, name, in_name, x, rows.record)
        if "cpu" in parts:
            cpu_part(args, srv, lb, paths, name, in_name, x, rows.record)
    finally:
        lb.stop()
        srv.close()


def kill_part(args, model, tmp: Path, record) -> None:
    """Two routers (`poolpipe serve --nodes INV --router r0|r1`), each driving a node of its
    own (`poolpipe node`), every one a process of its own, behind HAProxy (checks every
    500 ms, two failed: the defaults); an open-loop Poisson load through the balancer
    (gRPC). r1's processes killed (SIGKILL) a quarter of the way in: r0 adopts its node
    (the reshard flow re-plans, the rollout fences r1 off); r1 started again at 55%: r0
    hands the node back. Per second: sent, on time, late, dropped, errors; and when each
    step happened."""
    from poolpipe.client import send_control
    from testbed.loadgen import drive, poisson_times
    from testbed.tier import ProcessTier
    from triton_backend.lb.haproxy import Balancer

    name, in_name, dims = model
    x = np.zeros(dims, np.float32)
    work = tmp / "kill"
    work.mkdir()
    plan = hand_plan(name, [(0, 4, "cpu-1t", 1)], 4, args.burst_slo_ms, args.warehouse)
    (work / "plan.json").write_text(plan.to_json())
    serve = [str(work / "plan.json")]
    serve += ["--warehouse", args.warehouse] if args.warehouse else []
    with ProcessTier(work, "cpu-1t", [[0], [1]], serve) as tier:
        with console.status("router kill: starting two nodes and two routers ..."):
            tier.start()
        lb = Balancer(tier.inventory, work / "lb").start()
        events: dict[str, float] = {}
        t0 = time.monotonic()

        def generation0() -> int:
            """r0's rollouts so far: 1 once it has adopted n1, 2 once it has handed it back."""
            with contextlib.suppress(Exception):
                command = {"op": "status"}
                status = send_control(tier.router_grpc(0), command, token=tier.token, timeout_s=5)
                return int(status["generation"])
            return -1

        def at(event: str, ok) -> None:
            while not ok() and time.monotonic() - t0 < args.kill_seconds:
                time.sleep(0.2)
            if ok():
                events[event] = time.monotonic() - t0

        def timeline() -> None:
            seconds = args.kill_seconds
            time.sleep(seconds * 0.25)
            events["killed"] = time.monotonic() - t0
            tier.crash("r1")
            at("adopted", lambda: generation0() >= 1)
            time.sleep(max(0.0, seconds * 0.55 - (time.monotonic() - t0)))
            events["restarted"] = time.monotonic() - t0
            tier.start_router(1)
            at("handed back", lambda: generation0() >= 2)
            at("back", lambda: tier.ready(1))

        try:
            _wait_until_balanced(lb.grpc_url, name, in_name, x)
            rate, seconds = args.kill_rate, args.kill_seconds
            times = poisson_times(rate, seconds, seed=1)
            steps = threading.Thread(target=timeline)
            with console.status(
                f"router kill: {rate:g} req/s for {seconds:g} s; r1 killed at "
                f"{seconds * 0.25:.0f} s, started again at {seconds * 0.55:.0f} s ..."
            ):
                t0 = time.monotonic()
                steps.start()
                shots = drive(lb.grpc_url, name, {in_name: x}, times, timeout_s=30.0)
                steps.join()
        finally:
            lb.stop()
    kill_report(args, shots, events, record)


def kill_report(args, shots, events: dict[str, float], record) -> None:
    rate, seconds, slo = args.kill_rate, args.kill_seconds, args.burst_slo_ms / 1e3
    t = Table(
        title=f"router kill: two routers behind HAProxy, a node each, {rate:g} req/s (Poisson, "
        f"gRPC); r1 killed (SIGKILL) at {events.get('killed', 0):.1f} s, its node adopted by r0, "
        "r1 started again; per second",
        title_justify="left",
    )
    for col in ("second", "sent", "on time", "late", "dropped", "errors", "slowest ms", ""):
        t.add_column(col, justify="right")
    for k in range(math.ceil(seconds)):
        w = [sh for sh in shots if k <= sh.sent_s < k + 1]
        ok = [sh.latency_s for sh in w if sh.outcome == "ok"]
        row = {
            "sent": len(w),
            "on_time": sum(lat <= slo for lat in ok),
            "late": sum(lat > slo for lat in ok),
            "dropped": sum(sh.outcome == "dropped" for sh in w),
            "errors": sum(sh.outcome not in ("ok", "dropped") for sh in w),
        }
        slowest = max((sh.latency_s for sh in w), default=0.0) * 1e3
        what = ", ".join(e for e, at in events.items() if k <= at < k + 1)
        t.add_row(str(k), *(str(v) for v in row.values()), f"{slowest:.0f}", what)
        for metric, v in row.items():
            record("router-tier-kill", f"{rate:g}rps#s{k}", metric, v)
    console.print(t)
    kill_at = events.get("killed", 0.0)
    errors = [sh for sh in shots if sh.outcome not in ("ok", "dropped")]
    hung = [sh for sh in shots if sh.latency_s >= 29.0]
    last = max((sh.sent_s for sh in errors), default=kill_at)
    console.print(
        f"{len(errors)} error(s) of {len(shots)} requests, the last sent "
        f"{last - kill_at:+.2f} s from the kill; {len(hung)} hung (no answer in 30 s); "
        f"r1's node serving again (adopted by r0, rolled out) {_after(events, 'adopted', kill_at)} "
        f"the kill; r1 ready again {_after(events, 'back', events.get('restarted', 0.0))} its "
        "restart",
        highlight=False,
    )
    windows = {
        "before the kill": (0.0, kill_at),
        "first 10 s after it": (kill_at, kill_at + 10.0),
        "from 10 s after it to the restart": (kill_at + 10.0, events.get("restarted", seconds)),
        "from the restart": (events.get("restarted", seconds), seconds),
    }
    for what, (a, b) in windows.items():
        w = [sh for sh in shots if a <= sh.sent_s < b]
        if not w:
            continue
        on_time = sum(sh.outcome == "ok" and sh.latency_s <= slo for sh in w)
        console.print(f"  attainment {what}: {on_time}/{len(w)} = {on_time / len(w):.1%}")
        record("router-tier-kill", f"{rate:g}rps#{what}", "attainment", on_time / len(w))
    record("router-tier-kill", f"{rate:g}rps", "errors", len(errors))
    record("router-tier-kill", f"{rate:g}rps", "hung", len(hung))
    record("router-tier-kill", f"{rate:g}rps", "last_error_after_kill_s", last - kill_at)
    for e, since in (("adopted", "killed"), ("handed back", "restarted"), ("back", "restarted")):
        if e in events and since in events:
            record("router-tier-kill", f"{rate:g}rps", f"{e}_after_s", events[e] - events[since])


def _after(events: dict[str, float], event: str, since: float) -> str:
    return f"{events[event] - since:.1f} s after" if event in events else "not within the run of"


def onboard_tiny_model(warehouse, tmp: Path) -> tuple[str, str, tuple[int, ...]]:
    """A model whose stages cost the nodes little (ResNet-50 at 1/8 width, 32 px, 4 blocks,
    profiled for cpu-1t), so that the routers are what limits a tier: its name, its
    input's name and shape."""
    import onnx

    from flows.onboard import onboard_model
    from poolpipe.offline.zoo import make_model

    name = "bench-tiny"
    path = make_model("resnet50", tmp / "tiny.onnx", width=0.125, image=32)
    with console.status("onboarding a light model (cpu-1t) ..."):
        onboard_model(
            str(path), name, warehouse=warehouse, blocks=4, batches=[1, 2, 3, 4], reps=5,
            replace=True,
        )  # fmt: skip
    first = onnx.load(str(path)).graph.input[0]
    dims = tuple(max(1, d.dim_value) for d in first.type.tensor_type.shape.dim)
    return name, first.name, dims


def cap_part(args, model, tmp: Path, record) -> None:
    """1 and 2 routers (processes of their own), each held to `--cap-cpus` CPUs by a cgroup
    CPU quota (the router, its Triton and its door stubs together), behind HAProxy, on two
    cpu-1t nodes of a light model (the routers, not the nodes, limit the tier): the
    highest Poisson rate through the balancer at which >= 99% of requests are answered
    within the SLO, by bisection on a grid of `--cap-step` req/s."""
    from testbed.cgroup import hierarchy

    version = hierarchy()[0]  # before anything starts: says why caps cannot be had here
    found: dict[int, tuple[float, list]] = {}
    for routers in (1, 2):
        guess = None if routers == 1 else 2 * round(found[1][0] / args.cap_step)
        found[routers] = _capacity_capped(args, tmp / f"cap-{routers}", routers, model, guess)
    t = Table(
        title=f"routers held to {args.cap_cpus:g} CPU each (cgroup {version} quota), light "
        f"model on two cpu-1t nodes, SLO {args.burst_slo_ms:g} ms: capacity through HAProxy "
        "(>= 99% on time, Poisson, gRPC)",
        title_justify="left",
    )
    for col in ("routers", "capacity req/s", "vs 1 router", "rates tried (on time, throttled)"):
        t.add_column(col, justify="right")
    one = found[1][0]
    for routers, (capacity, points) in found.items():
        tried = ", ".join(f"{r:g} ({a:.0%}, {th})" for r, a, th in sorted(points))
        ratio = f"{capacity / one:.2f}x" if one else "-"
        t.add_row(str(routers), f"{capacity:g}", ratio, tried)
        record("router-tier-cap", f"{routers}router@{args.cap_cpus:g}cpu", "capacity", capacity)
    console.print(t)
    if one:
        record("router-tier-cap", f"2vs1@{args.cap_cpus:g}cpu", "ratio", found[2][0] / one)


def _capacity_capped(args, work: Path, routers: int, model, guess) -> tuple[float, list]:
    """(capacity, [(rate, on-time share, periods the quotas throttled)]) of `routers`
    routers over two nodes, each capped."""
    from testbed.cgroup import CpuCap
    from testbed.loadgen import bisect_grid, drive, poisson_times
    from testbed.tier import ProcessTier
    from triton_backend.lb.haproxy import Balancer

    name, in_name, dims = model
    x = np.zeros(dims, np.float32)
    slo = args.burst_slo_ms / 1e3
    work.mkdir()
    plan = hand_plan(name, [(0, 4, "cpu-1t", 2 // routers)], 4, args.burst_slo_ms, args.warehouse)
    (work / "plan.json").write_text(plan.to_json())
    serve = [str(work / "plan.json"), "--adopt-after", "0"]
    serve += ["--warehouse", args.warehouse] if args.warehouse else []
    shards = [[0, 1]] if routers == 1 else [[0], [1]]
    points: list[tuple[float, float, int]] = []
    with ProcessTier(work, "cpu-1t", shards, serve) as tier:
        with console.status(f"CPU cap: starting {routers} router(s) and two nodes ..."):
            tier.start()
        caps = [CpuCap(f"poolpipe-bench-r{k}", args.cap_cpus) for k in range(routers)]
        lb = None
        try:
            for k, cap in enumerate(caps):
                cap.add(tier.pids(f"r{k}"))
            lb = Balancer(tier.inventory, work / "lb").start()
            _wait_until_balanced(lb.grpc_url, name, in_name, x)
            url = lb.grpc_url

            def passes(i: int) -> bool:
                rate = i * args.cap_step
                before = sum(c.throttled() for c in caps)
                shots = drive(url, name, {in_name: x}, poisson_times(rate, args.cap_seconds, i))
                ok = sum(sh.outcome == "ok" and sh.latency_s <= slo for sh in shots)
                share = ok / len(shots) if shots else 1.0
                points.append((rate, share, sum(c.throttled() for c in caps) - before))
                console.print(
                    f"  {routers} router(s) at {rate:g} req/s: {share:.1%} on time",
                    highlight=False,
                )
                time.sleep(1.0)  # what is left drains
                return share >= 0.99

            top = bisect_grid(passes, args.cap_top // int(args.cap_step), guess)
        finally:
            if lb is not None:
                lb.stop()
            for cap in caps:
                cap.close()
    return top * args.cap_step, points


def sharding_part(args, record) -> None:
    """What splitting a cluster into shards (one per router, whole servers each, each planned
    for itself) costs against planning the whole: the paper's groups (maf19 mix) on
    hc2-large and hc4-large, 2 and 4 shards; the planner's objective (throughput per unit
    of weight, which adds up over shards)."""
    import tomllib

    from poolpipe.domain.cluster import load_clusters
    from poolpipe.domain.profiles import load_ppipe_dir
    from poolpipe.planner import make_plan
    from poolpipe.planner.request import group_request
    from poolpipe.planner.shards import SPLITS, sharding_loss, shards_bound
    from poolpipe_cli.common import ppipe_dir

    root = args.profiles or ppipe_dir()
    profiles = {p.name: p for p in load_ppipe_dir(root)}
    workloads = tomllib.loads((root / "workloads.toml").read_text())
    clusters = load_clusters(root / "clusters.toml")
    weights = tuple(workloads["mixes"]["maf19"])
    scale = float(workloads.get("slo_scale", 5))

    def objective(group: list[str]):
        def plan(cluster) -> tuple[float, tuple[float, ...]]:
            made = make_plan(group_request(profiles, group, weights, cluster, slo_scale=scale))
            return made.objective, tuple(m.throughput / m.weight for m in made.models)

        return plan

    bounds: dict[tuple[str, int, int], object] = {}

    def bound(c: str, gi: int, k: int, whole: float):
        """The least loss of any split (shards_bound: every split in one MILP), once."""
        if (c, gi, k) not in bounds:
            req = group_request(
                profiles,
                workloads["groups"][gi],
                weights,
                clusters[c],
                slo_scale=scale,
                time_limit_s=args.bound_time_limit,
            )
            bounds[(c, gi, k)] = shards_bound(req, k, whole)
        return bounds[(c, gi, k)]

    t = Table(
        title="sharding loss: each shard (whole servers, GPUs evenly, the split searched "
        "for the highest sum from the even one, or from the bound's own: joint) planned for "
        "itself, against the whole cluster planned at once "
        "(objective: req/s per unit of weight, maf19 mix; loss: of the shards' objectives "
        "summed, what routers weighted by them serve; loss together: of the least over "
        "models of the summed req/s per weight, in brackets, an upper bound; least loss: "
        "what no split keeping each type's GPUs per server (by GPU, searched) can lose "
        "less than, every such split bounded in one MILP, * where its time ran out first)",
        title_justify="left",
    )
    for col in (
        "cluster",
        "group",
        "shards",
        "split by",
        "GPUs per shard",
        "whole",
        "shards' objectives (together)",
        "loss",
        "loss together",
        "least loss",
    ):
        t.add_column(col, justify="right")
    least: dict[tuple[str, int], list[float]] = {}
    losses: dict[tuple[str, int, str], list[float]] = {}
    configs = [
        (c, gi, k)
        for c in ("hc2-large", "hc4-large")
        for gi in range(len(workloads["groups"]))
        for k in (2, 4)
    ]
    with console.status(f"sharding loss: {len(configs)} configurations, each planned ..."):
        for (c, gi, k), by in itertools.product(configs, (*SPLITS, "joint")):
            if by == "joint":  # the search from shards_bound's own split
                start = bounds[(c, gi, k)].counts  # (bounded on the first split's row)
                if not start:
                    continue
                r = sharding_loss(
                    clusters[c], k, objective(workloads["groups"][gi]), "search", start=start
                )
            else:
                r = sharding_loss(clusters[c], k, objective(workloads["groups"][gi]), by)
            sizes = ", ".join(
                "/".join(str({q.gpu: q.count for q in sh.pools}.get(p.gpu, 0)) for sh in r.split)
                + f" {p.gpu}"
                for p in clusters[c].pools
            )
            losses.setdefault((c, k, by), []).append(r.loss)
            b = bound(c, gi, k, r.whole)
            if by == SPLITS[0]:
                least.setdefault((c, k), []).append(b.least_loss)
                record("router-tier-sharding", f"g{gi}:{c}/{k}", "least_loss", b.least_loss)
                record("router-tier-sharding", f"g{gi}:{c}/{k}", "bound_objective", b.bound)
                record("router-tier-sharding", f"g{gi}:{c}/{k}", "bound_seconds", b.seconds)
            t.add_row(
                c,
                str(gi),
                str(k),
                by,
                sizes,
                f"{r.whole:.1f}",
                " + ".join(f"{min(o):.1f}" for o in r.shards) + f" ({r.together:.1f})",
                f"{r.loss:.1%}",
                f"{r.loss_together:.1%}",
                f"{b.least_loss:.1%}" + ("" if b.status == "optimal" else "*"),
            )
            config = f"g{gi}:{c}/{k}-by-{by}"
            record("router-tier-sharding", config, "loss", r.loss)
            record("router-tier-sharding", config, "whole_objective", r.whole)
            record("router-tier-sharding", config, "shards_objective", r.summed)
            record("router-tier-sharding", config, "loss_together", r.loss_together)
    console.print(t)
    for (c, k, by), xs in losses.items():
        console.print(
            f"{c}, {k} shards by {by}: loss mean {sum(xs) / len(xs):.1%}, worst {max(xs):.1%}",
            highlight=False,
        )
    for (c, k), xs in least.items():
        console.print(
            f"{c}, {k} shards, any split: least loss mean {sum(xs) / len(xs):.1%}, "
            f"worst {max(xs):.1%}",
            highlight=False,
        )


GRPC_BURST = """
import asyncio, json, sys, time
import numpy as np
import tritonclient.grpc as tg
import tritonclient.grpc.aio as ta
url, model, in_name, shape, n, slo_ms, deadline, start_at = json.loads(sys.argv[1])
async def main():
    c = ta.InferenceServerClient(url)
    x = tg.InferInput(in_name, shape, "FP32")
    x.set_data_from_numpy(np.zeros(shape, np.float32))
    await c.is_server_live()  # the channel open before the burst (no inference counted)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    late_ms = (time.time() - start_at) * 1e3  # how long after the agreed moment it fired
    async def one():
        t = time.perf_counter()
        try:
            await c.infer(model, [x], parameters={"slo_ms": slo_ms},
                          client_timeout=slo_ms / 1e3 if deadline else 30)
            return [time.perf_counter() - t, "ok", ""]
        except Exception as exc:
            dropped = "POOLPIPE_DROPPED" in str(exc)
            expired = "DEADLINE_EXCEEDED" in str(exc) or "Deadline Exceeded" in str(exc)
            out = "dropped" if dropped else "expired" if expired else "error"
            return [time.perf_counter() - t, out, " ".join(str(exc).split())[:160]]
    out = await asyncio.gather(*(one() for _ in range(n)))
    await c.close()
    return {"fired_late_ms": late_ms, "shots": out}
print(json.dumps(asyncio.run(main())))
"""
CLIENT_START_S = 1.5  # a client process's start-up and channel, before the agreed moment


def grpc_burst(
    url: str,
    name: str,
    in_name: str,
    x: np.ndarray,
    n: int,
    slo_ms: float,
    deadline: bool,
    clients: int = 1,
) -> tuple[list, float]:
    """n requests at once from `clients` gRPC clients (asyncio, one channel each), each in a
    process of its own, all firing at one agreed moment (n split evenly), each request with
    a gRPC deadline of the SLO where `deadline` (30 s otherwise): (seconds from its call
    to its answer, outcome: ok, dropped, expired (its deadline passed at the client),
    error, and what the client was told where it was not ok) each; and how long after the
    agreed moment the last client fired (ms)."""
    import json
    import subprocess

    start_at = time.time() + CLIENT_START_S * (1 + clients / 2)  # (two cores start them)
    shares = [n // clients + (k < n % clients) for k in range(clients)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                GRPC_BURST,
                json.dumps([url, name, in_name, list(x.shape), m, slo_ms, deadline, start_at]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in shares
        if m
    ]
    shots, late_ms = [], 0.0
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            why = (err.strip().splitlines() or ["no message"])[-1]
            raise SystemExit(f"a gRPC burst client against {url} failed: {why}")
        got = json.loads(out)
        shots += got["shots"]
        late_ms = max(late_ms, got["fired_late_ms"])
    return shots, late_ms


def _inventory(nodes, http, grpc, ready, lb_http, lb_grpc) -> dict:
    """The inventory a user would write for this: the router's node, one router, HAProxy."""
    return {
        "servers": [{"name": "here", "bandwidth_gbps": 10}],
        "nodes": [
            {"name": n, "server": "here", "device": "cpu-2t", "grpc": node.grpc_url}
            for n, node in nodes.items()
        ],
        "balancer": {"http": f"127.0.0.1:{lb_http}", "grpc": f"127.0.0.1:{lb_grpc}"},
        "routers": [
            {
                "name": "r0",
                "http": f"127.0.0.1:{http}",
                "grpc": f"127.0.0.1:{grpc}",
                "ready": f"127.0.0.1:{ready}",
            }
        ],
    }


def _wait_until_balanced(url: str, name: str, in_name: str, x: np.ndarray) -> None:
    """Until HAProxy's health check has found the router (its first checks take a moment)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            client_run("closed", url, name, in_name, x, 5)
            return
        except SystemExit:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def burst_part(args, srv, paths, name, in_name, x, record) -> None:
    core = srv.deployment.core
    slo = args.burst_slo_ms / 1e3
    results = []
    others: Counter[str] = Counter()
    with console.status(f"burst: {args.burst} requests at once, {args.rounds} round(s) ..."):
        client_run("closed", paths["router"][1], name, in_name, x, 30)  # warm, not counted
        for k in range(1, args.rounds + 1):
            for (via, (http_url, grpc_url)), proto in itertools.product(
                paths.items(), ("http", "grpc", "grpc+deadline")
            ):
                used = core.stamps.counts["used"]
                shortened = core.client_deadlines["shortened"]
                before = _router_counts(core, name)
                if proto == "http":
                    shots = [
                        (lat, o, "")
                        for lat, o in client_run(
                            "burst", http_url, name, in_name, x, args.burst, args.burst_slo_ms
                        )
                    ]
                else:
                    shots, fired_late_ms = grpc_burst(
                        grpc_url,
                        name,
                        in_name,
                        x,
                        args.burst,
                        args.burst_slo_ms,
                        deadline=proto.startswith("grpc+deadline"),
                        clients=args.burst_clients,
                    )
                after = _router_counts(core, name)
                win = {k: after[k] - before[k] for k in after}
                _until_answered(core)
                ok = [lat for lat, o, _ in shots if o == "ok"]
                # where the late ones were in the client's own order of calls (one gRPC
                # channel sends the burst's requests one after another)
                late_at = [i for i, (lat, o, _) in enumerate(shots) if o == "ok" and lat > slo]
                r = {
                    "client_on_time": sum(lat <= slo for lat in ok),
                    "client_late": sum(lat > slo for lat in ok),
                    "client_dropped": sum(o == "dropped" for _, o, _ in shots),
                    "client_expired": sum(o == "expired" for _, o, _ in shots),
                    "client_other": sum(o not in ("ok", "dropped", "expired") for _, o, _ in shots),
                    "deadlines_shortened": core.client_deadlines["shortened"] - shortened,
                    "client_max_ms": max(ok) * 1e3 if ok else float("nan"),
                    "late_first_call": min(late_at) if late_at else float("nan"),
                    "late_median_call": float(np.median(late_at)) if late_at else float("nan"),
                    "router_on_time": win["on_time"],
                    "router_late": win["late"],
                    "router_dropped": win["dropped"],
                    "stamps_used": core.stamps.counts["used"] - used,
                    "reply_margin_ms": core.margin_figures()["reply_margin_ms"],
                    "clients": 1 if proto == "http" else args.burst_clients,
                    "fired_late_ms": float("nan") if proto == "http" else fired_late_ms,
                }
                many = "" if r["clients"] == 1 else f" x{r['clients']}"
                results.append((k, f"{proto}{many} {via}", r))
                others.update(why for _, o, why in shots if o == "error")
                tag = f"{proto}{many.replace(' ', '')}-{via}"
                config = f"{tag}:{args.burst}x{args.burst_slo_ms:g}ms#{k}"
                for metric, v in r.items():
                    record("router-tier-burst", config, metric, v)
    t = Table(
        title=f"burst: {args.burst} requests at once, SLO {args.burst_slo_ms:g} ms, straight to "
        "the router or through the balancer (HTTP: a connection each, timed by the kernel; "
        f"gRPC x{args.burst_clients}: that many clients, each a process and a channel of its "
        "own, firing at one moment, timed from each call; +deadline: each call with a gRPC "
        "deadline of the SLO, which the balancer hands the router); late = answered after "
        "the SLO; expired = the client's deadline passed first; fired: the last client's "
        "start after the agreed moment",
        title_justify="left",
    )
    for col in (
        "round",
        "path",
        "client on time",
        "client late",
        "dropped (client / router)",
        "expired",
        "deadlines shortened",
        "other",
        "router on time",
        "router late",
        "on time: router - client",
        "stamps used",
        "slowest answer ms",
        "late: call # (first, median)",
        "fired ms",
    ):
        t.add_column(col, justify="right")
    for k, via, r in results:
        gap = r["router_on_time"] - r["client_on_time"]
        t.add_row(
            str(k),
            via,
            str(r["client_on_time"]),
            f"{r['client_late']} ({r['client_late'] / args.burst:.1%})",
            f"{r['client_dropped']} / {r['router_dropped']}",
            str(r["client_expired"]),
            str(r["deadlines_shortened"]),
            str(r["client_other"]),
            str(r["router_on_time"]),
            str(r["router_late"]),
            f"{gap:+d} ({gap / args.burst:+.1%})",
            str(r["stamps_used"]),
            f"{r['client_max_ms']:.0f}",
            "-"
            if r["client_late"] == 0
            else f"{r['late_first_call']:.0f}, {r['late_median_call']:.0f}",
            "-" if math.isnan(r["fired_late_ms"]) else f"{r['fired_late_ms']:.0f}",
        )
    console.print(t)
    for why, k in others.most_common(5):
        console.print(f"  other: {k} x {why or '(no message)'}", highlight=False)


def _router_counts(core, model: str) -> dict[str, int]:
    """The router's counters of `model` since it started (arrivals, on time, late, ...)."""
    return core.stats[model].counts()


def _until_answered(core, timeout_s: float = 30.0) -> None:
    """Until the router has answered every request of the burst and no more come (a client
    that gave up on some leaves them in flight, or still in its Triton's front end), so
    that its counters hold the whole burst."""
    end, quiet = time.monotonic() + timeout_s, 0
    while quiet < 10 and time.monotonic() < end:
        quiet = 0 if core.in_flight() else quiet + 1
        time.sleep(0.1)


def cpu_part(args, srv, lb, paths, name, in_name, x, record) -> None:
    dep = srv.deployment
    n = args.requests
    triton = dep.frontend.node.process.pid
    haproxy = lb.process.pid
    rows = []
    with console.status(f"CPU per request: {n} requests one after another, each path ..."):
        for via, (_, grpc_url) in paths.items():
            client_run("closed", grpc_url, name, in_name, x, 20)  # warm
            cpu0, tr0, ha0 = time.process_time(), cpu_seconds([triton]), cpu_seconds([haproxy])
            lat = client_run("closed", grpc_url, name, in_name, x, n)
            r = {
                "haproxy_cpu_us": (cpu_seconds([haproxy]) - ha0) / n * 1e6,
                "router_triton_cpu_us": (cpu_seconds([triton]) - tr0) / n * 1e6,
                "router_cpu_us": (time.process_time() - cpu0) / n * 1e6,
                "client_p50_ms": float(np.percentile(lat, 50)),
                "answered": len(lat),
            }
            rows.append((via, r))
            for metric, v in r.items():
                record("router-tier-cpu", f"{via}:closed-grpc", metric, v)
    t = Table(
        title=f"CPU per request ({n} one after another over gRPC; µs of CPU per request)",
        title_justify="left",
    )
    for col in ("path", "HAProxy", "router's Triton + door", "router process", "client p50 ms"):
        t.add_column(col, justify="right")
    for via, r in rows:
        t.add_row(
            via,
            f"{r['haproxy_cpu_us']:.0f}",
            f"{r['router_triton_cpu_us']:.0f}",
            f"{r['router_cpu_us']:.0f}",
            f"{r['client_p50_ms']:.2f}",
        )
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
