"""Online-serving benchmark on this machine (real tritonserver nodes, the router in its own
Triton behind its door, tritonclient on loopback). Parts, each printed as a table and
stored in the warehouse (bench_serving):

1. router overhead: a 1-partition plan; the same request sent one at a time (a client in
   its own process) straight to the stage node and through the router (eager plane: no
   batching wait); added p50/p99, the router's CPU time per request (its process; its
   Triton and door stubs apart), the reply margin it measured, and the highest open-loop
   rate it sustains with >= 99% of requests within the SLO;
   then a burst of `--burst` requests at once (SLO `--burst-slo-ms`), twice: on time,
   late and dropped as the client counts them and as the router does;
2. rollout under steady load: downtime, requests held during the switch, failed, unanswered;
3. live vs simulator: the same plan and arrival trace, attainment measured live (by the
   client, and by the router from a request's arrival there) and predicted by the simulator
   on the router's calibrated topology, with its reply margin, and with stage times drawn
   from those the router measured in a calibration run on another trace;
4. a scenario live and in the simulator: one partition on two nodes under steady load, one
   node killed and restarted a few seconds later, then a rollout; the simulator replays the
   same events at the times they happened live (scenario file semantics), and attainment is
   compared in windows around each event.

    ./run bench-serving [--duration 20] [--slo-ms 100] [--burst 500] [--burst-slo-ms 100]
    ./run bench-serving --only-overhead    # part 1 and the burst
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_cluster
from poolpipe.domain.plan import Plan, manual_plan
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import REPO_ROOT, Warehouse
from testbed import scratch_dir, teardown_on_sigterm
from testbed.cpu import cpu_seconds
from testbed.predict import predict
from triton_backend import ROUTER_INSTANCES

console = Console(width=None if sys.stdout.isatty() else 150)
CLUSTERS = REPO_ROOT / "local-clusters.toml"


def hand_plan(
    model: str, parts: list[tuple[int, int, str, int]], batch: int, slo_ms: float, wh
) -> Plan:
    """One pipeline of (first block, end block, device, vGPUs) partitions."""
    with Warehouse.open(wh) as w:
        profile = w.load_profile(model)
    return manual_plan(model, slo_ms * 1e3, load_cluster(CLUSTERS, "local"), parts, batch, profile)


def onboard_bench_model(warehouse, tmp: Path) -> str:
    """The serving benchmarks' model (ResNet-50 at 64 px, 4 blocks), onboarded and profiled
    for cpu-1t and cpu-2t; its name."""
    from flows.onboard import onboard_model
    from flows.profile import profile_model
    from poolpipe.offline.zoo import make_model

    name = "bench-resnet"
    path = make_model("resnet50", tmp / "m.onnx", width=1.0, image=64)
    with console.status("onboarding the benchmark model (cpu-1t, cpu-2t) ..."):
        onboard_model(
            str(path), name, warehouse=warehouse, blocks=4, batches=[1, 2, 3, 4], reps=5,
            replace=True,
        )  # fmt: skip
        profile_model(name, warehouse=warehouse, batches=[1, 2, 3, 4], threads=2, reps=5)
    return name


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per load level")
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--requests", type=int, default=300, help="closed-loop requests")
    ap.add_argument(
        "--router-instances",
        type=int,
        default=ROUTER_INSTANCES,
        help=f"door instances ({ROUTER_INSTANCES})",
    )
    ap.add_argument("--burst", type=int, default=500, help="requests in a burst (500)")
    ap.add_argument("--burst-slo-ms", type=float, default=100.0, help="their SLO (100)")
    ap.add_argument(
        "--scenario-rate", type=float, default=30.0, help="req/s in part 4 (default 30)"
    )
    ap.add_argument(
        "--only-scenario", action="store_true", help="run part 4 only (onboarding first)"
    )
    ap.add_argument(
        "--only-overhead",
        action="store_true",
        help="run part 1 only: router overhead and the burst (onboarding first)",
    )
    args = ap.parse_args()

    from testbed.loadgen import client_figures, drive, poisson_times
    from triton_backend.deploy.serving import ServingProcess

    rows = BenchRows(args.label)
    record = rows.record

    tmp = scratch_dir("bench-serving-")
    name = onboard_bench_model(args.warehouse, tmp)

    if args.only_scenario:
        scenario_check(args, name, tmp, record)
        store(args, rows)
        return 0

    # ---------------------------------------------------------------- 1. router overhead
    plan = hand_plan(name, [(0, 4, "cpu-2t", 1)], 1, args.slo_ms, args.warehouse)
    with console.status("router overhead: starting a 1-partition deployment ..."):
        srv = ServingProcess(
            plan,
            args.warehouse,
            tmp / "ws1",
            stats_interval_s=3600,
            plane="eager",
            router_instances=args.router_instances,
        )
    dep = srv.deployment
    try:
        d, r, router_cpu, door_cpu, inside50 = overhead_runs(dep, name, args.requests)
        x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
        in_name = dep.ios[0].inputs[0].name
        idle_margin = dep.core.margin_figures()
        sustained = 0.0
        rate = 10.0
        while rate <= 400:
            shots = drive(
                dep.grpc_url,
                name,
                {in_name: x},
                poisson_times(rate, args.duration / 2, 7),
            )
            s = client_figures(shots, args.slo_ms / 1e3, args.duration / 2)
            if s["attainment"] < 0.99:
                break
            sustained = rate
            rate *= 1.5
    finally:
        srv.close()
    t = Table(title="1. router overhead (1 partition on cpu-2t, eager plane)", title_justify="left")
    for col in ("path", "p50 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    t.add_row(
        "stage node direct", f"{np.median(d):.2f}", f"{np.percentile(d, 99):.2f}", f"{d.max():.1f}"
    )
    t.add_row(
        "through the router", f"{np.median(r):.2f}", f"{np.percentile(r, 99):.2f}", f"{r.max():.1f}"
    )
    added50 = float(np.median(r) - np.median(d))
    added99 = float(np.percentile(r, 99) - np.percentile(d, 99))
    t.add_section()
    verdict = "met" if added50 <= 1.0 else "MISSED"
    verdict99 = "met" if added99 <= 5.0 else "MISSED"
    t.add_row("added", f"{added50:.2f} ({verdict}: <= 1)", f"{added99:.2f} ({verdict99}: <= 5)", "")
    core50 = inside50 - float(np.median(d))
    t.add_row("  of which the router core (door stamp to answer, less the stage)", f"{core50:.2f}")
    t.add_row("  of which the door (Triton front end, stub, socket)", f"{added50 - core50:.2f}")
    console.print(t)
    verdict = "met" if router_cpu <= 250 else "MISSED"
    console.print(
        f"router CPU per request: {router_cpu:.0f} µs in the router process ({verdict}: <= 250), "
        f"{door_cpu:.0f} µs in its Triton and door stubs"
    )
    console.print(
        "reply margin with the nodes idle: {reply_margin_ms:.2f} ms (egress p99 "
        "{egress_p99_ms:.2f} ms, ingress p99 {ingress_p99_ms:.2f} ms)".format(**idle_margin)
    )
    console.print(
        f"highest sustained open-loop rate with >= 99% within the SLO: {sustained:.0f} req/s"
    )
    record("router-overhead", "1p-cpu-2t", "added_p50_ms", added50)
    record("router-overhead", "1p-cpu-2t", "added_p99_ms", added99)
    record("router-overhead", "1p-cpu-2t", "direct_p50_ms", float(np.median(d)))
    record("router-overhead", "1p-cpu-2t", "router_p50_ms", float(np.median(r)))
    record("router-overhead", "1p-cpu-2t", "sustained_req_s", sustained)
    record("router-overhead", "1p-cpu-2t", "router_core_p50_ms", core50)
    record("router-overhead", "1p-cpu-2t", "door_path_p50_ms", added50 - core50)
    record("router-overhead", "1p-cpu-2t", "router_cpu_us_per_request", router_cpu)
    record("router-overhead", "1p-cpu-2t", "door_cpu_us_per_request", door_cpu)
    for k, v in idle_margin.items():
        record("reply-margin", "idle", k, v)

    trivial_stage_check(args, tmp, record)

    # ---------------------------------------------------------------- burst
    burst_check(args, name, tmp, record)
    if args.only_overhead:
        store(args, rows)
        return 0

    # ------------------------------------------------------- 2 + 3. rollout, live vs sim
    plan_a = hand_plan(
        name, [(0, 2, "cpu-2t", 1), (2, 4, "cpu-1t", 1)], 4, args.slo_ms, args.warehouse
    )
    plan_b = hand_plan(name, [(0, 4, "cpu-2t", 1)], 4, args.slo_ms, args.warehouse)
    with console.status("two-partition deployment (cpu-2t -> cpu-1t) ..."):
        srv = ServingProcess(
            plan_a,
            args.warehouse,
            tmp / "ws2",
            stats_interval_s=3600,
            router_instances=args.router_instances,
        )
    dep = srv.deployment
    live_rows = []
    try:
        x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
        in_name = dep.ios[0].inputs[0].name
        url = dep.grpc_url
        drive(url, name, {in_name: x}, poisson_times(10, 2, 0))  # warm-up
        # Calibration for the simulator, on its own trace: how long stage calls really take
        # against what the router reserved for them (the nodes share 2 cores with the router
        # and the client, which start-up calibration, one call at a time, cannot see).
        dep.core.take_stage_factors()
        dep.core.take_answer_delays()
        drive(url, name, {in_name: x}, poisson_times(40, args.duration, 100))
        factors = dep.core.take_stage_factors()
        delays = dep.core.take_answer_delays()
        for pool, f in enumerate(factors):
            config = f"calibration@40req/s:pool{pool}"
            record("live-vs-sim", config, "stage_factor_mean", float(np.mean(f)))
        for k, rate in enumerate((20.0, 40.0, 60.0)):
            times = poisson_times(rate, args.duration, k + 1)
            dep.core.take_window()
            shots = drive(url, name, {in_name: x}, times)
            s = client_figures(shots, args.slo_ms / 1e3, args.duration)
            win = dep.core.take_window().models[0]  # the router's own view of the same requests
            s["router_attainment"] = win.on_time / max(1, win.arrivals)
            sim = predict(dep, times, args.duration, factors, answer_delays=delays)
            live_rows.append((rate, s, sim.attainment))
            record("live-vs-sim", f"{rate:g}req/s", "live_attainment", s["attainment"])
            record("live-vs-sim", f"{rate:g}req/s", "router_attainment", s["router_attainment"])
            record("live-vs-sim", f"{rate:g}req/s", "sim_attainment", sim.attainment)
        # rollout A -> B under steady load
        roll_rate = 30.0
        times = poisson_times(roll_rate, args.duration, 42)
        result: dict = {}

        def roll() -> None:
            time.sleep(args.duration / 3)
            result["r"] = srv.rollout(plan_b)

        th = threading.Thread(target=roll)
        th.start()
        shots = drive(url, name, {in_name: x}, times)
        th.join()
        s = client_figures(shots, args.slo_ms / 1e3, args.duration)
        ro = result["r"]
    finally:
        srv.close()
    t = Table(
        title=f"3. live vs simulator (same plan, same trace; SLO {args.slo_ms:g} ms)",
        title_justify="left",
    )
    for col in (
        "req/s",
        "live (client)",
        "live (router)",
        "simulator",
        "points apart",
        "p50 ms",
        "p99 ms",
    ):
        t.add_column(col, justify="right")
    for rate, s3, sim_att in live_rows:
        gap = abs(s3["attainment"] - sim_att) * 100
        t.add_row(
            f"{rate:g}",
            f"{s3['attainment']:.3f}",
            f"{s3['router_attainment']:.3f}",
            f"{sim_att:.3f}",
            f"{gap:.1f}{'' if gap <= 2 else ' (> 2)'}",
            f"{s3['p50_ms']:.1f}",
            f"{s3['p99_ms']:.1f}",
        )
    console.print(t)
    console.print(
        f"simulator inputs: reply margin {dep.core.runtime.reply_margin_us / 1e3:.2f} ms "
        "(measured); stage times from the calibration run, measured / reserved, per pool: "
        + "; ".join(
            f"pool {p}: {len(f)} calls, mean {np.mean(f):.2f}, p50 {np.median(f):.2f}, "
            f"p90 {np.percentile(f, 90):.2f}, p99 {np.percentile(f, 99):.2f}"
            for p, f in enumerate(factors)
            if f
        )
    )
    unanswered = len(times) - len(shots)
    t = Table(
        title=f"2. rollout under {roll_rate:g} req/s (2 partitions -> 1 partition)",
        title_justify="left",
    )
    for col in ("status", "prepare s", "downtime ms", "held", "failed", "unanswered", "attainment"):
        t.add_column(col, justify="right")
    t.add_row(
        ro.status,
        f"{ro.prepare_s:.1f}",
        f"{ro.downtime_ms:.1f}",
        str(ro.held),
        str(ro.failed + s["failed"]),
        str(unanswered),
        f"{s['attainment']:.3f}",
    )
    console.print(t)
    ok = ro.downtime_ms <= args.slo_ms + 100 and unanswered == 0 and ro.failed == 0
    console.print(
        f"rollout target (downtime <= SLO + 100 ms, nothing lost): {'met' if ok else 'MISSED'}"
    )
    for metric, value in (
        ("downtime_ms", ro.downtime_ms),
        ("held", ro.held),
        ("failed", ro.failed + s["failed"]),
        ("unanswered", unanswered),
        ("attainment", s["attainment"]),
        ("prepare_s", ro.prepare_s),
    ):
        record("rollout", "2p->1p@30req/s", metric, value)
    scenario_check(args, name, tmp, record)
    store(args, rows)
    return 0


CLIENT = """
import json, sys, time
import numpy as np
from testbed.loadgen import burst
kind, url, model, in_name, shape, n, slo_ms = json.loads(sys.argv[1])
x = np.zeros(shape, np.float32)
if kind == "closed":
    import tritonclient.grpc as tg
    c = tg.InferenceServerClient(url)
    i = tg.InferInput(in_name, list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    def call():  # a request the router dropped is an answer too: not timed, not fatal
        try:
            c.infer(model, [i])
            return True
        except tg.InferenceServerException as exc:
            if "POOLPIPE_DROPPED" not in str(exc):
                raise
            return False
    for _ in range(5):
        call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        if call():
            out.append((time.perf_counter() - t) * 1e3)
else:
    out = [[s.latency_s, s.outcome] for s in burst(url, model, {in_name: x}, n, slo_ms)]
print(json.dumps(out))
"""


def overhead_runs(dep, name: str, n: int):
    """`n` requests one at a time straight to the stage node, n through the router, n more
    straight: (direct ms, router ms, router CPU µs per request (this process), its Triton's
    and door stubs' CPU µs per request, the router's own p50 ms from door stamp to answer)."""
    x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
    in_name = dep.ios[0].inputs[0].name
    part = dep.layout.placements[0].partition
    node = next(iter(dep.nodes.values()))
    # The client runs in its own process, so that this one is the router alone: its
    # CPU time per request is the router's (runtime, door socket, stage calls).
    d = client_run("closed", node.grpc_url, part, in_name, x, n)
    client_run("closed", dep.grpc_url, name, in_name, x, min(n, 50))  # warm the path
    dep.core.take_window()
    door = dep.frontend.node.process.pid  # the router's Triton and its door stubs
    cpu0, door0 = time.process_time(), cpu_seconds([door])
    r = client_run("closed", dep.grpc_url, name, in_name, x, n)
    router_cpu = (time.process_time() - cpu0) / n * 1e6
    door_cpu = (cpu_seconds([door]) - door0) / n * 1e6
    # the router's own time per request (the door's stamp to its answer); the rest of
    # the path is the door's (Triton front end, Python stub, the socket both ways)
    inside50 = float(dep.core.take_window().models[0].p50_ms)
    d2 = client_run("closed", node.grpc_url, part, in_name, x, n)
    return np.concatenate([d, d2]), r, router_cpu, door_cpu, inside50


def trivial_stage_check(args, tmp: Path, record) -> None:
    """The router's cost with a stage that costs almost nothing (ResNet-50 at 1/16 width,
    16 x 16 px: about 1 ms here), the condition the CPU target is stated for: with a real
    stage the router's work runs on caches the stage's threads just took over, and costs
    it twice as much or more on this 2-core machine."""
    from flows.onboard import onboard_model
    from flows.profile import profile_model
    from poolpipe.offline.zoo import make_model
    from triton_backend.deploy.serving import ServingProcess
    from triton_backend.router.timers import loop_kind

    name = "bench-trivial"
    path = make_model("resnet50", tmp / "trivial.onnx", width=1 / 16, image=16)
    with console.status("trivial stage: onboarding, then a 1-partition deployment ..."):
        onboard_model(
            str(path), name, warehouse=args.warehouse, blocks=2, batches=[1, 2], reps=3,
            replace=True,
        )  # fmt: skip
        profile_model(name, warehouse=args.warehouse, batches=[1, 2], threads=1, reps=3)
        plan = hand_plan(name, [(0, 2, "cpu-1t", 1)], 1, args.slo_ms, args.warehouse)
        srv = ServingProcess(
            plan, args.warehouse, tmp / "ws-trivial", stats_interval_s=3600, plane="eager"
        )
    try:
        d, r, router_cpu, door_cpu, _ = overhead_runs(srv.deployment, name, 3 * args.requests)
    finally:
        srv.close()
    tracing_check(args, tmp, record, name, plan)
    added50 = float(np.median(r) - np.median(d))
    added99 = float(np.percentile(r, 99) - np.percentile(d, 99))
    t = Table(
        title="1b. router overhead, trivial stage (1 partition on cpu-1t)", title_justify="left"
    )
    for col in ("figure", "value", "target"):
        t.add_column(col, justify="right")
    t.add_row(
        "stage node direct p50 / p99 ms", f"{np.median(d):.2f} / {np.percentile(d, 99):.2f}", ""
    )
    t.add_row(
        "through the router p50 / p99 ms", f"{np.median(r):.2f} / {np.percentile(r, 99):.2f}", ""
    )
    t.add_row("added p50 ms", f"{added50:.2f}", f"<= 1 ({'met' if added50 <= 1 else 'MISSED'})")
    t.add_row("added p99 ms", f"{added99:.2f}", f"<= 5 ({'met' if added99 <= 5 else 'MISSED'})")
    verdict = "met" if router_cpu <= 250 else "MISSED"
    t.add_row("router CPU µs per request (its process)", f"{router_cpu:.0f}", f"<= 250 ({verdict})")
    t.add_row("its Triton and door stubs, µs per request", f"{door_cpu:.0f}", "")
    # the VM's speed moves the two together by up to 30%: their ratio tells runs apart
    ratio = f"{router_cpu / door_cpu:.2f}" if door_cpu else "-"
    t.add_row("router / its Triton and stubs (CPU)", ratio, "")
    t.add_row("router's event loop", loop_kind(srv.deployment.core.loop), "")
    console.print(t)
    for k, v in (
        ("added_p50_ms", added50),
        ("added_p99_ms", added99),
        ("direct_p50_ms", float(np.median(d))),
        ("router_p50_ms", float(np.median(r))),
        ("router_cpu_us_per_request", router_cpu),
        ("door_cpu_us_per_request", door_cpu),
    ):
        record("router-overhead", "1p-trivial-cpu-1t", k, v)


def tracing_check(args, tmp: Path, record, name: str, plan: Plan, rounds: int = 8) -> None:
    """1c. The trivial-stage deployment started with tracing (spans to an OTLP receiver in
    a process of its own; the nodes' Triton tracing the stage calls that carry a context),
    its requests traced or not in turns: `rounds` times `--requests` requests one at a time
    untraced and as many with every one traced (sample 1), which first alternating, each
    turn after the same pause (a turn right after another ran up to 40% dearer here than
    one after a pause: measured, with the order fixed). Turns in one deployment, so
    that the host's drift between deployments (up to 50% on this VM) stays out of the
    ratio: the router's CPU µs per request (this process), the exporter process's, and
    traced over untraced in each round; the figure is the median round's (a round in which
    the host slowed down between its two turns moves the mean, not the median)."""
    import json
    import subprocess

    from triton_backend.deploy.serving import ServingProcess
    from triton_backend.router.tracing import TraceConfig

    n = args.requests
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    rx = subprocess.Popen(
        [sys.executable, "-m", "testbed.otlp", "--count-only"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        endpoint = rx.stdout.readline().strip()  # type: ignore[union-attr]
        with console.status("tracing: a deployment that traces ..."):
            srv = ServingProcess(
                plan,
                args.warehouse,
                tmp / "ws-trace",
                stats_interval_s=3600,
                plane="eager",
                tracing=TraceConfig(endpoint, sample=1.0),
            )
        try:
            dep = srv.deployment
            for k in range(rounds):  # off first in odd rounds, on first in even ones
                for mode in ("off", "on") if k % 2 == 0 else ("on", "off"):
                    with console.status(f"tracing {mode}, round {k + 1} of {rounds} ..."):
                        dep.core.trace_requests(mode == "on")
                        rows[mode].append(traced_run(dep, name, n))
        finally:
            srv.close()
        rx.stdin.close()  # type: ignore[union-attr]
        received = json.loads(rx.stdout.readline())  # type: ignore[union-attr]
    finally:
        rx.kill()
        rx.wait()
    ratios = [
        on["router_cpu"] / off["router_cpu"]
        for off, on in zip(rows["off"], rows["on"], strict=True)
    ]
    t = Table(
        title=f"1c. tracing, trivial stage: {rounds} rounds of {n} requests one at a time "
        "untraced and as many traced (sample 1), in one deployment",
        title_justify="left",
    )
    for col in (
        "round",
        "router CPU µs/req off",
        "on",
        "on / off",
        "exporter CPU µs/req",
        "p50 ms off / on",
    ):
        t.add_column(col, justify="right")
    for k, (off, on) in enumerate(zip(rows["off"], rows["on"], strict=True)):
        t.add_row(
            str(k + 1),
            f"{off['router_cpu']:.0f}",
            f"{on['router_cpu']:.0f}",
            f"{ratios[k]:.3f}",
            f"{on['exporter_cpu']:.0f}",
            f"{off['p50_ms']:.2f} / {on['p50_ms']:.2f}",
        )
    console.print(t)
    added = (float(np.median(ratios)) - 1) * 100
    mean = (float(np.mean(ratios)) - 1) * 100
    err = float(np.std(ratios, ddof=1) / np.sqrt(len(ratios))) * 100 if len(ratios) > 1 else 0.0
    verdict = "met" if added <= 10 else "MISSED"
    console.print(
        f"tracing every request adds {added:+.1f}% router CPU per request in the median round "
        f"(target <= 10%: {verdict}; mean {mean:+.1f}% +- {err:.1f}%, standard error over "
        f"{rounds} rounds); its exporter "
        f"process {np.mean([r['exporter_cpu'] for r in rows['on']]):.0f} µs per request; the "
        f"receiver got {received['bytes'] / 1e6:.1f} MB in {received['posts']} posts"
    )
    for m in ("off", "on"):
        for r in rows[m]:
            for key, v in r.items():
                record("tracing", f"1p-trivial-cpu-1t:{m}", key, v)
    record("tracing", "1p-trivial-cpu-1t", "added_router_cpu_pct_median", added)
    record("tracing", "1p-trivial-cpu-1t", "added_router_cpu_pct_mean", mean)
    record("tracing", "1p-trivial-cpu-1t", "added_router_cpu_pct_stderr", err)


def traced_run(dep, name: str, n: int) -> dict[str, float]:
    """`n` requests one at a time through the router (a client in its own process, after
    20 to warm the path): the router's CPU µs per request (this process), its trace
    exporter's (its own process; 0 without one), the client's p50 ms."""
    x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
    in_name = dep.ios[0].inputs[0].name
    client_run("closed", dep.grpc_url, name, in_name, x, 20)
    tracing = dep.core.tracing
    exporter = [] if tracing is None or tracing.exporter_pid is None else [tracing.exporter_pid]
    cpu0, exp0 = time.process_time(), cpu_seconds(exporter)
    r = client_run("closed", dep.grpc_url, name, in_name, x, n)
    router_cpu = (time.process_time() - cpu0) / n * 1e6
    # the last notes reach the exporter within 0.2 s, its batches leave every 0.5 s; with
    # tracing or not, so that each turn starts after the same pause
    time.sleep(2.0)
    return {
        "router_cpu": router_cpu,
        "exporter_cpu": (cpu_seconds(exporter) - exp0) / n * 1e6,
        "p50_ms": float(np.median(r)),
    }


def client_run(kind, url, model, in_name, x, n, slo_ms=None):
    """A client in its own process: `closed` (n requests one after another over gRPC:
    latencies in ms of those answered, not those the router dropped) or `burst` (n at once
    over HTTP, loadgen.burst: (s, outcome) pairs)."""
    import json
    import subprocess

    spec = json.dumps([kind, url, model, in_name, list(x.shape), n, slo_ms])
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, spec],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if out.returncode:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"the {kind} client against {url} failed: {why}")
    result = json.loads(out.stdout)
    return np.asarray(result) if kind == "closed" else result


def burst_check(args, name: str, tmp: Path, record) -> None:
    """`--burst` requests at once, `--burst-slo-ms`, twice, on a 1-partition plan (batch 4,
    reservation plane): counted at the client (HTTP, its own process, loadgen.burst) and by
    the router, with the reply margin before and after."""
    from triton_backend.deploy.serving import ServingProcess

    plan = hand_plan(name, [(0, 4, "cpu-2t", 1)], 4, args.slo_ms, args.warehouse)
    with console.status(f"burst: {args.burst} requests at once, twice ..."):
        srv = ServingProcess(plan, args.warehouse, tmp / "ws-burst", stats_interval_s=3600)
        dep = srv.deployment
        rows = []
        try:
            x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
            in_name = dep.ios[0].inputs[0].name
            client_run("closed", dep.grpc_url, name, in_name, x, 30)  # warm, not counted
            for k in (1, 2):
                dep.core.take_window()
                shots = client_run(
                    "burst", dep.http_url, name, in_name, x, args.burst, args.burst_slo_ms
                )
                win = dep.core.take_window().models[0]
                slo = args.burst_slo_ms / 1e3
                ok = [lat for lat, o in shots if o == "ok"]
                rows.append(
                    {
                        "burst": k,
                        "client_on_time": sum(lat <= slo for lat in ok),
                        "client_late": sum(lat > slo + 0.005 for lat in ok),
                        "client_dropped": sum(o == "dropped" for _, o in shots),
                        "client_other": sum(o not in ("ok", "dropped") for _, o in shots),
                        "client_max_ms": max(ok) * 1e3 if ok else float("nan"),
                        "router_on_time": win.on_time,
                        "router_late": win.late,
                        "router_dropped": win.dropped,
                        **dep.core.margin_figures(),
                    }
                )
        finally:
            srv.close()
    t = Table(
        title=f"burst: {args.burst} requests at once, SLO {args.burst_slo_ms:g} ms "
        "(client: its own process, HTTP, one connection each)",
        title_justify="left",
    )
    for col in (
        "burst",
        "client on time",
        "client late (> SLO + 5 ms)",
        "dropped (client / router)",
        "router on time",
        "router late",
        "on time: router vs client",
        "slowest answer ms",
        "reply margin ms after",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        gap = r["router_on_time"] - r["client_on_time"]
        t.add_row(
            str(r["burst"]),
            str(r["client_on_time"]),
            str(r["client_late"]),
            f"{r['client_dropped']} / {r['router_dropped']}",
            str(r["router_on_time"]),
            str(r["router_late"]),
            f"{gap:+d} ({gap / args.burst:+.1%} of the burst)",
            f"{r['client_max_ms']:.0f}",
            f"{r['reply_margin_ms']:.1f}",
        )
        for metric, v in r.items():
            if metric != "burst":
                record("burst", f"{args.burst}x{args.burst_slo_ms:g}ms#{r['burst']}", metric, v)
    console.print(t)


def store(args, rows: list[dict]) -> None:
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving)")


def per_second(shots, slo_s: float, seconds: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrivals and on-time answers per second of the run, by when a request was sent."""
    arrived, on_time = np.zeros(seconds), np.zeros(seconds)
    for s in shots:
        k = min(int(s.sent_s), seconds - 1)
        arrived[k] += 1
        on_time[k] += s.outcome == "ok" and s.latency_s <= slo_s
    return arrived, on_time


def scenario_check(args, name: str, tmp: Path, record) -> None:
    """4. One partition on two cpu-1t nodes at a load one node cannot carry; kill a node,
    restart it, roll the same plan out again; then the simulator on the same trace with the
    same events at the times they happened here."""
    from poolpipe.sim.scenario import GpuChange, Rollout, Scenario
    from testbed.loadgen import drive, poisson_times
    from triton_backend.deploy.serving import ServingProcess

    plan = hand_plan(name, [(0, 4, "cpu-1t", 2)], 4, args.slo_ms, args.warehouse)
    # long enough that the windows after each event hold several seconds of requests (a
    # 1 s window of 30 requests moves 3.3 points per request), whatever the restart and the
    # rollout's preparation take here (5 s and 9 s at times)
    duration, rate = max(45.0, args.duration), args.scenario_rate
    with console.status("4. scenario: one partition on two cpu-1t nodes ..."):
        srv = ServingProcess(
            plan,
            args.warehouse,
            tmp / "ws4",
            stats_interval_s=3600,
            router_instances=args.router_instances,
        )
    dep = srv.deployment
    try:
        topo0 = dep.core.runtime.topo
        (pool,) = topo0.pools
        b = topo0.pipelines[0].batch
        x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
        in_name = dep.ios[0].inputs[0].name
        url = dep.grpc_url
        drive(url, name, {in_name: x}, poisson_times(10, 2, 0))  # warm-up
        dep.core.take_stage_factors()
        drive(url, name, {in_name: x}, poisson_times(rate, duration / 2, 300))
        factors = dep.core.take_stage_factors()
        console.print(
            f"4. scenario: {pool.latency_us[b] / 1e3:.1f} ms per batch of {b} as calibrated, "
            f"x {np.mean(factors[0]):.2f} under load at {rate:g} req/s"
        )
        victim = sorted(dep.nodes)[1]
        gpu, index = victim.rsplit("-", 1)
        times = poisson_times(rate, duration, 301)
        marks: dict[str, float] = {}
        t_start = time.monotonic()  # the load generator's loop clock starts here too

        def events() -> None:
            at = lambda s: time.sleep(max(0.0, t_start + s - time.monotonic()))  # noqa: E731
            at(duration * 0.12)
            marks["down"] = time.monotonic() - t_start
            dep.nodes[victim].kill()
            at(duration * 0.24)
            marks["restart"] = time.monotonic() - t_start
            dep.restart_node(victim)  # serving again when this returns
            marks["up"] = time.monotonic() - t_start
            at(max(duration * 0.4, marks["up"] + 5.0))  # a window with the node back
            marks["prepare"] = time.monotonic() - t_start
            marks["rollout_result"] = srv.rollout(plan)  # type: ignore[assignment]
            marks["switch"] = marks["prepare"] + marks["rollout_result"].prepare_s  # type: ignore[attr-defined]

        th = threading.Thread(target=events)
        th.start()
        shots = drive(url, name, {in_name: x}, times)
        th.join()
        recoveries = dep.core.runtime.recoveries
        new_topo = dep.core.runtime.topo
        ro = marks.pop("rollout_result")
        scenario = Scenario(
            (
                GpuChange("gpu_down", marks["down"], gpu, 1, (int(index),)),
                GpuChange("gpu_up", marks["up"], gpu, 1, (int(index),)),
                Rollout(marks["switch"], new_topo, "the same plan again"),
            )
        )
        sim = predict(dep, times, duration, factors, scenario=scenario, topo=topo0)
    finally:
        srv.close()
    seconds = int(np.ceil(duration))
    live_arr, live_ok = per_second(shots, args.slo_ms / 1e3, seconds)
    sim_arr = np.asarray(sim.per_second[name]["arrived"], float)
    sim_ok = np.asarray(sim.per_second[name]["on_time"], float)
    cut = {k: round(v) for k, v in marks.items()}
    # windows with the restart's or the rollout preparation's work on this machine's two
    # cores (tritonserver start-up, model loading, cutting partitions, calibration) slow the
    # stage workers there, which the simulator does not model: they are shown apart
    windows = [
        ("before", 1, cut["down"], None),
        (f"node down ({marks['down']:.1f} s)", cut["down"], cut["restart"], True),
        (f"node restarting ({marks['restart']:.1f} s)", cut["restart"], cut["up"], False),
        (f"node back ({marks['up']:.1f} s)", cut["up"], cut["prepare"], True),
        (f"rollout preparing ({marks['prepare']:.1f} s)", cut["prepare"], cut["switch"], False),
        (f"rollout switch ({marks['switch']:.1f} s)", cut["switch"], seconds, True),
    ]
    t = Table(
        title=f"4. scenario at {rate:.0f} req/s: {victim} down, back, then a rollout "
        f"(SLO {args.slo_ms:g} ms)",
        title_justify="left",
    )
    for col in ("window", "seconds", "requests", "live", "simulator", "points apart"):
        t.add_column(col, justify="right")
    worst = 0.0
    for label, a, b, judged in windows:
        if b <= a:
            continue
        n = live_arr[a:b].sum()
        live = live_ok[a:b].sum() / max(1, n)
        pred = sim_ok[a:b].sum() / max(1, sim_arr[a:b].sum())
        gap = abs(live - pred) * 100
        if judged:
            worst = max(worst, gap)
        note = "" if gap <= 3 or judged is None else " (> 3)" if judged else " (co-located work)"
        t.add_row(label, f"{a}-{b}", f"{n:.0f}", f"{live:.3f}", f"{pred:.3f}", f"{gap:.1f}{note}")
        record("scenario", label.split(" (")[0], "live_attainment", live)
        record("scenario", label.split(" (")[0], "sim_attainment", pred)
    console.print(t)
    console.print(
        "per second (live / simulator): "
        + " ".join(
            f"{k}:{live_ok[k] / max(1, live_arr[k]):.2f}/{sim_ok[k] / max(1, sim_arr[k]):.2f}"
            for k in range(seconds)
        )
    )
    sim_down = sim.rollouts[0]["downtime_ms"] if sim.rollouts else float("nan")
    console.print(
        f"rollout downtime: live {ro.downtime_ms:.1f} ms, simulator {sim_down:.1f} ms; "
        f"node returns seen by the router: {recoveries}; largest gap in the windows after an "
        f"event: {worst:.1f} points ({'met' if worst <= 3 else 'MISSED'}: <= 3)"
    )
    record("scenario", "rollout", "live_downtime_ms", ro.downtime_ms)
    record("scenario", "rollout", "sim_downtime_ms", sim_down)
    record("scenario", "events", "worst_gap_points", worst)


if __name__ == "__main__":
    sys.exit(main())
