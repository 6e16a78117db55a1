"""`poolpipe demo`: the whole system on this machine, on embedded defaults.

By default on EMULATED GPUs (demo_gpu: the paper's group 2 from real GPU profiles, live on
an emulated hc2-small; needs network namespaces, else this CPU demo runs).

With --cpu, real compute on this machine's CPU classes: generate a model, onboard it
(split, profile on two CPU device classes), plan it for the local heterogeneous cluster,
start the stage-worker nodes and the router, drive load with tritonclient at a few rates
(beside the simulator's prediction for the same trace), roll a second plan out under load,
and write plots.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.table import Table

from poolpipe.client.control import new_token_file
from poolpipe.errors import PoolpipeError
from poolpipe.store.warehouse import REPO_ROOT
from poolpipe_cli.common import counted, step
from poolpipe_cli.common import demo_console as console
from poolpipe_cli.serve import add_router_arguments, router_options

CLUSTERS = REPO_ROOT / "local-clusters.toml"
# Emulated GPUs: each rate judged on one trace of this many seconds (undilated; x D on the
# wall clock). Traces of 0.5 s (two a rate) put whole-model serving's capacity 1.36x above
# its capacity on traces of 4 s (`./run bench-trace-length`): its queues take longer than
# that to miss. 1.25 s: within a grid step of 4 s, in the main job's six minutes.
TRACE_S = 1.25


def cmd_demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # the rollout is an expected event here: its result is printed, not logged as a warning
    logging.getLogger("poolpipe.serve").setLevel(logging.ERROR)
    router_options(args)  # bad router options refused before minutes of work
    if not args.cpu:
        from testbed.netns import unavailable

        why = unavailable()
        if why is None:
            from poolpipe_cli.demo_gpu import cmd_demo_gpu

            args.cluster = args.cluster or "hc2-small"
            args.duration = args.duration or TRACE_S * args.time_scale
            return cmd_demo_gpu(args)
        console.print(
            f"[yellow]The emulated GPU cluster needs network namespaces, but {why}; running "
            "the CPU demo (--cpu) on loopback instead.[/]"
        )
        args.loopback = True
    args.cluster = args.cluster or "demo"
    args.duration = args.duration or 8.0
    return cmd_demo_cpu(args)


def cmd_demo_cpu(args: argparse.Namespace) -> int:
    from flows.onboard import onboard_model
    from flows.profile import profile_model
    from poolpipe.offline.profiler import sum_vs_whole
    from poolpipe.offline.zoo import make_model
    from poolpipe.planner import make_plan
    from poolpipe.store.plan_inputs import plan_request
    from poolpipe.store.warehouse import Warehouse
    from poolpipe_cli.onboard import progress_bar
    from triton_backend.deploy.serving import ServingProcess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "demo-resnet"
    t_start = time.perf_counter()

    step(f"generating a ResNet-50 (width {args.width}, {args.image}x{args.image})")
    path = make_model("resnet50", out / f"{name}.onnx", width=args.width, image=args.image)

    step("onboarding: split, build, verify, profile on cpu-1t (Prefect flow)")
    with progress_bar(name):
        r = onboard_model(
            str(path),
            name,
            warehouse=args.warehouse,
            blocks=6,
            batches=[1, 2, 3, 4],
            reps=5,
            replace=True,
        )
    step("profiling the same blocks on cpu-2t (Prefect flow)")
    with progress_bar(name):
        profile_model(name, warehouse=args.warehouse, batches=[1, 2, 3, 4], threads=2, reps=5)
    console.print(
        f"  {r.split.layers} layers in {len(r.split.blocks)} blocks; whole model at batch 1: "
        f"{sum_vs_whole(r.measurements)[1][1] / 1e3:.1f} ms on cpu-1t"
    )

    step(f"planning for cluster {args.cluster} (SLO {args.slo_ms:g} ms)")
    with Warehouse.open(args.warehouse) as wh:
        req = plan_request(
            wh,
            [name],
            args.cluster,
            clusters_file=CLUSTERS,
            slo_us={name: args.slo_ms * 1e3},
            max_partitions=2,
        )
        plan = make_plan(req)
        first = (plan, wh.store_plan(plan, label="demo:ppipe"))
        # whole-model serving on the same nodes: the rollout switches to it under load,
        # and then its capacity is measured beside the ppipe plan's
        whole = make_plan(replace(req, strategy="np"))
        second = (whole, wh.store_plan(whole, label="demo:np"))
    from poolpipe_cli.plans import print_plan

    print_plan(first[0])
    print_plan(second[0])

    token_file = out / "serve" / "control.token"
    token = new_token_file(token_file)  # control (and the nodes' management APIs) need it
    with contextlib.ExitStack() as stack:
        options = _nodes(stack, req.cluster, out, token_file, args)
        step("starting the router (its own tritonserver) attached to the nodes")
        server = ServingProcess(
            first[0],
            args.warehouse,
            out / "serve",
            name="demo",
            plan_id=first[1],
            stats_interval_s=3600,
            metrics_port=0,
            token=token,
            **options,
            **router_options(args),
        )
        stack.callback(server.close)
        rows, timeline = _drive_loads(server, name, args)
        topo = server.deployment.core.runtime.topo
        top = min(sum(m.throughput for m in topo.models), args.max_rate)  # ppipe's
        capacity = [_capacity(server, "ppipe", top, name, args)]
        step(f"rolling plan {second[1]} (whole-model serving, np) out under load")
        roll = _rollout_under_load(server, second[0], second[1], name, args)
        capacity.append(_capacity(server, "np", top, name, args))
        capacity[0]["same"] = _pipelines(first[0]) == _pipelines(second[0])
        server.flush_stats()

    table = Table(
        title=f"{name} live (router + Triton nodes) vs simulator, SLO {args.slo_ms:g} ms",
        title_justify="left",
    )
    for col in (
        "load",
        "req/s",
        "sent",
        "attainment",
        "simulated",
        "p50 ms",
        "p99 ms",
        "dropped",
        "failed",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            f"{row['load']:.2f}",
            f"{row['rate']:.0f}",
            str(row["sent"]),
            f"{row['attainment']:.3f}",
            f"{row['sim_attainment']:.3f}",
            f"{row['p50_ms']:.1f}",
            f"{row['p99_ms']:.1f}",
            str(row["dropped"]),
            str(row["failed"]),
        )
    console.print(table)
    _capacity_table(capacity, args)
    _store_capacity(capacity, args.warehouse, "emulated" if options else "loopback")
    att = roll["attainment"]
    console.print(
        f"rollout to whole-model serving under {roll['rate']:.0f} req/s: {roll['status']} "
        f"{roll['reason']}\n  prepared in {roll['prepare_s']:.1f} s while the old plan served, "
        f"downtime {roll['downtime_ms']:.1f} ms, {counted(roll['held'], 'request')} held "
        f"during the switch, {roll['failed']} failed, {roll['unanswered']} of {roll['sent']} "
        "unanswered\n"
        f"  attainment before {att['before']:.3f}, while preparing {att['preparing']:.3f}, "
        f"after the switch {att['after']:.3f}"
    )
    _plots(out, rows, timeline, args.slo_ms, capacity)
    console.print(
        f"plots in {out}/ (attainment_vs_load.png, pool_utilization.png, capacity.png); "
        f"statistics and rollouts in the warehouse; {time.perf_counter() - t_start:.0f} s in all"
    )
    return 0


def _drive_loads(server, name: str, args: argparse.Namespace):
    from testbed.loadgen import client_figures, drive, poisson_times
    from testbed.predict import predict

    dep = server.deployment
    topo = dep.core.runtime.topo
    planned = sum(m.throughput for m in topo.models)
    x = np.random.default_rng(0).standard_normal((1, *dep.ios[0].inputs[0].dims))
    inputs = {dep.ios[0].inputs[0].name: x.astype(dep.ios[0].inputs[0].dtype)}
    url = dep.grpc_url
    rows, timeline = [], []
    # warm-up, not counted: the router's instances, the nodes' sessions, the channels
    drive(url, name, inputs, poisson_times(min(planned, args.max_rate) * 0.3, 2.0, seed=0))
    # then the first stage times the simulator draws from (measured / reserved, per pool)
    dep.core.take_stage_factors()
    dep.core.take_answer_delays()
    drive(url, name, inputs, poisson_times(min(planned, args.max_rate) * 0.5, 3.0, seed=100))
    factors = [list(f) for f in dep.core.take_stage_factors()]
    delays = [list(f) for f in dep.core.take_answer_delays()]
    for k, load in enumerate(args.loads):
        rate = load * min(planned, args.max_rate)
        times = poisson_times(rate, args.duration, seed=k + 1)
        step(
            f"load {load:.2f} of {min(planned, args.max_rate):.0f} req/s (the plan's "
            f"{planned:.0f}, capped by --max-rate): {rate:.0f} req/s for {args.duration:g} s"
        )
        sampler = _Sampler(dep.core)
        sampler.start()
        shots = drive(url, name, inputs, times)
        timeline.append((load, sampler.stop()))
        s = client_figures(shots, args.slo_ms / 1e3, args.duration)
        # the simulator on the same (calibrated) topology, the same trace, the same plane,
        # with the stage times and answer delays measured so far (before this run: a
        # prediction)
        sim = predict(dep, times, args.duration, factors, answer_delays=delays)
        for pool, f in enumerate(dep.core.take_stage_factors()):
            factors[pool].extend(f)
        for pool, f in enumerate(dep.core.take_answer_delays()):
            delays[pool].extend(f)
        rows.append({"load": load, "rate": rate, **s, "sim_attainment": sim.attainment})
    return rows, timeline


def _rollout_under_load(server, plan, plan_id: int, name: str, args: argparse.Namespace):
    """Steady load at half the demo's top rate for 3 x --duration; the rollout starts at
    1/4 of the run (testbed.emulated.rollout_under_load, a mix of this one model):
    attainment before it, while the new models load and are calibrated (the old plan
    serving), and after the switch."""
    from testbed.emulated import MixLoad, rollout_under_load

    dep = server.deployment
    rate = 0.5 * min(sum(m.throughput for m in dep.core.runtime.topo.models), args.max_rate)
    load = MixLoad.of(dep, {name: 1.0})
    return rollout_under_load(server, plan, plan_id, load, rate, 3 * args.duration)


def _nodes(stack: contextlib.ExitStack, cluster, out: Path, token_file: Path, args) -> dict:
    """The demo's nodes, one per GPU of the cluster: each on its own emulated server (a
    network namespace with its own address and a NIC of the cluster's bandwidth, limited by
    tc) where namespaces are permitted, else on loopback. Returns the deployment's options:
    the inventory to attach to, or none (the deployment starts local nodes)."""
    from testbed.netns import EmulatedCluster, unavailable

    why = "--loopback given" if args.loopback else unavailable()
    if why:
        step(f"starting stage-worker nodes on loopback (no emulated cluster: {why})")
        return {}
    gpus = [(pool.gpu, i) for pool in cluster.pools for i in range(pool.count)]
    em = stack.enter_context(EmulatedCluster(len(gpus), out / "cluster", cluster.bandwidth_gbps))
    step(
        f"emulated cluster: {len(gpus)} servers as network namespaces on {em.subnet} "
        f"({cluster.bandwidth_gbps:g} Gbit/s NICs, tc), a stage-worker node (tritonserver) in each"
    )
    for k, (gpu, i) in enumerate(gpus):
        em.start_node(k, gpu, name=f"{gpu}-{i}", wait=False, token_file=token_file)
    for k in range(len(gpus)):
        em.wait_node(k)
    for s in em.nodes:
        console.print(f"  {s.node_name} ({s.device}) on server s{s.server} at {s.address}")
    console.print(f"  inventory: {em.write_inventory()}")
    return {"inventory": em.inventory()}


def _capacity(server, label: str, top: float, name: str, args: argparse.Namespace) -> dict:
    """Live capacity of the plan being served beside the simulator's (loadgen.live_capacity):
    bisected on Poisson traces of --duration seconds up to `top` req/s."""
    from testbed.loadgen import CAPACITY_TARGET, live_capacity

    dep = server.deployment
    x = np.random.default_rng(0).standard_normal((1, *dep.ios[0].inputs[0].dims))
    inputs = {dep.ios[0].inputs[0].name: x.astype(dep.ios[0].inputs[0].dtype)}
    step(f"{label}: capacity at >= {CAPACITY_TARGET:.0%} on time, bisecting 0-{top:.0f} req/s")

    def point(rate: float, on_time: float) -> None:
        console.print(f"  {label}: {rate:.0f} req/s for {args.duration:g} s: {on_time:.3f} on time")

    found = live_capacity(dep, inputs, top, args.duration, args.slo_ms / 1e3, point)
    return {"plan": label, **found}


def _pipelines(plan) -> list:
    """A plan's pipelines as (batch, ((blocks, device, vGPUs), ...)), to compare plans."""
    return sorted(
        (p.batch, tuple((q.start, q.end, q.gpu, q.vgpus) for q in p.partitions))
        for m in plan.models
        for p in m.pipelines
    )


def _store_capacity(runs: list[dict], warehouse, where: str) -> None:
    """The capacities in the warehouse (bench_serving, bench "demo", config "<plan>@<where>")."""
    from poolpipe.store.bench_rows import BenchRows
    from poolpipe.store.warehouse import Warehouse

    rows = BenchRows("demo")
    for r in runs:
        for metric, key in (
            ("capacity_live_req_s", "live"),
            ("capacity_sim_req_s", "sim"),
            ("planned_req_s", "planned"),
        ):
            rows.record("demo", f"{r['plan']}@{where}", metric, r[key])
    with Warehouse.open(warehouse) as wh:
        wh.store_rows("bench_serving", rows)


def _capacity_table(runs: list[dict], args: argparse.Namespace) -> None:
    from testbed.loadgen import CAPACITY_STEPS

    t = Table(
        title=f"capacity on the same nodes (>= 99% on time, SLO {args.slo_ms:g} ms)",
        title_justify="left",
    )
    for col in ("plan", "planned req/s", "simulator req/s", "live req/s", "live / simulator"):
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(
            r["plan"],
            f"{r['planned']:.0f}",
            f"{'>= ' if r['sim_capped'] else ''}{r['sim']:.0f}",
            f"{'>= ' if r['capped'] else ''}{r['live']:.0f}",
            f"{r['live'] / r['sim']:.2f}" if r["sim"] else "-",
        )
    console.print(t)
    pp, whole = runs
    if pp["same"]:
        console.print(
            "Here the ppipe plan is the np plan: at this SLO the slower class serves the "
            "whole model in time, so pipelining gains nothing. ppipe pipelines where an "
            "old device cannot serve the whole model within the SLO but can serve its "
            "later layers (`poolpipe compare` on the real GPU profiles; here, --image 128 "
            "--slo-ms 55 plans 1.4x np, but on this machine's shared cores the stages run "
            "about 1.5x slower than profiled and miss that SLO)."
        )
    if whole["live"] and whole["sim"]:
        what = "the same plan measured twice gives" if pp["same"] else "ppipe serves"
        console.print(
            f"{what} {pp['live'] / whole['live']:.2f}x the load of whole-model serving "
            f"live (simulator: {pp['sim'] / whole['sim']:.2f}x); rates are multiples of "
            f"{pp['top'] / CAPACITY_STEPS:.1f} req/s up to {pp['top']:.0f} (--max-rate)"
        )


class _Sampler:
    """Per-pool busy fraction over time, sampled from the router's counters."""

    def __init__(self, core, every_s: float = 0.25):
        self.core, self.every_s = core, every_s
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._t.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        last = list(self.core.runtime.pool_busy_us())
        while not self._stop.wait(self.every_s):
            now = list(self.core.runtime.pool_busy_us())
            vg = [max(1, len(p.vgpus)) for p in self.core.runtime.topo.pools]
            frac = [
                (b - a) / (self.every_s * 1e6 * v) for a, b, v in zip(last, now, vg, strict=False)
            ]
            self.samples.append((time.perf_counter() - t0, frac))
            last = now

    def stop(self):
        self._stop.set()
        self._t.join()
        pools = self.core.runtime.topo.pools
        labels = [f"[{p.start},{p.end}) {p.gpu}×{len(p.vgpus)}" for p in pools]
        return labels, self.samples


def _plots(out: Path, rows: list[dict], timeline, slo_ms: float, capacity: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    rates = [r["rate"] for r in rows]
    ax.plot(rates, [r["attainment"] for r in rows], "o-", label="live (client)")
    ax.plot(rates, [r["sim_attainment"] for r in rows], "s--", label="simulator")
    ax.set_xlabel("offered load (req/s, Poisson)")
    ax.set_ylabel(f"SLO attainment ({slo_ms:g} ms)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment_vs_load.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(len(timeline), 1, figsize=(6, 2.2 * len(timeline)), squeeze=False)
    for ax, (load, (labels, samples)) in zip(axes[:, 0], timeline, strict=True):
        if samples:
            t = [s[0] for s in samples]
            for i, label in enumerate(labels):
                ax.plot(t, [s[1][i] for s in samples], label=label)
        ax.set_title(f"load {load:.2f}", fontsize=9)
        ax.set_ylabel("busy")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "pool_utilization.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for run, color in zip(capacity, ("tab:blue", "tab:orange"), strict=False):
        for key, style, what in (("live_points", "o", "live"), ("sim_points", "s", "simulator")):
            pts = sorted(run[key].items())
            ax.plot(
                [r for r, _ in pts],
                [a for _, a in pts],
                style + ("-" if what == "live" else ":"),
                color=color,
                label=f"{run['plan']} {what}",
            )
    ax.axhline(0.99, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("offered load (req/s, Poisson)")
    ax.set_ylabel(f"on time ({slo_ms:g} ms)")
    ax.set_title("capacity search: ppipe vs whole-model (np) on the same nodes", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)


def _loads(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PoolpipeError(f"--loads {text!r}: give fractions like 0.3,0.6,0.9") from None
    if not values or any(not 0 < v <= 2 for v in values):
        raise PoolpipeError(f"--loads {text!r}: fractions in (0, 2]")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/demo", help="plots and working files (out/demo)")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the real-compute demo: a generated ResNet-50 served on this machine's CPU "
        "classes (else: the paper's group 2 on emulated GPUs)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="emulated GPUs: a preset of data/ppipe-gpu-group2/clusters.toml (hc2-small); "
        "--cpu: a cluster in local-clusters.toml (demo)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=20.0,
        help="emulated GPUs: time dilation D; latencies and SLOs x D, NICs and rates / D (20: "
        "at 10, a host with two cores runs ppipe's chains late on its own time)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds per trace, wall clock (emulated GPUs: {TRACE_S:g} x the time scale, "
        "dilated, where a request or two decide a load near 99%%; 5 x the time scale, 100 at "
        "D = 20, settles the figures in about 14 minutes; --cpu: 8)",
    )
    p.add_argument(
        "--compare",
        choices=("loads", "search"),
        default="loads",
        help="emulated GPUs: how the plans' live figures are found: 'loads', both plans at the "
        "same three offered loads (the lower and the higher of the rates they state they "
        "deliver and one between; a plan that keeps all three one load further); 'search', "
        "each plan's capacity "
        "searched on a grid (minutes more where a plan's share on time stays near 99%% over "
        "several rates)",
    )
    p.add_argument(
        "--traces",
        type=int,
        default=1,
        help="emulated GPUs: traces a rate is judged on (1; one more where it fails narrowly)",
    )
    p.add_argument("--width", type=float, default=1.0, help="model channel multiplier (1.0)")
    p.add_argument("--image", type=int, default=64, help="input size (64)")
    p.add_argument("--slo-ms", type=float, default=100.0, help="--cpu: SLO (100 ms)")
    p.add_argument("--loads", type=_loads, default=[0.3, 0.6, 0.9], help="--cpu: 0.3,0.6,0.9")
    p.add_argument(
        "--max-rate", type=float, default=100.0, help="--cpu: load 1.0 is at most this req/s (100)"
    )
    p.add_argument(
        "--loopback",
        action="store_true",
        help="--cpu: nodes on loopback even where an emulated cluster (network namespaces) "
        "is possible",
    )
    p.add_argument(
        "--search-margins",
        metavar="M,M",
        help="emulated cluster: plan both strategies also holding back these fractions of the "
        "SLO (e.g. 0.3,0.2; poolpipe plan --search-margins) and serve what delivers most",
    )
    add_router_arguments(p)
