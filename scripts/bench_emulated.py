"""Emulated GPU nodes (docs/design/emulation.md). EMULATED: not GPU measurements.

Part 1 (`--only accuracy`): how exactly an emulated node keeps its profiled stage times.
One node (`tritonserver` with POOLPIPE_EMULATE_TIME_SCALE, as `poolpipe node --emulate`
starts it) serves a partition of a small generated ResNet-50 (its CPU compute about a
millisecond) whose latency table is that of real T4 blocks: GoogLeNet-v3's blocks 0-5 from
the PPipe profiles (../shared/profiles/ppipe-gpu), at batch 1, 2, 4 and 8. Each stage's own
start and end come back with the answer (a chain's last hop): over = end - start - due
(due: profiled latency x time scale). Idle: `--calls` calls one at a time per batch size.
Under load: `--callers` clients at once on a node with as many instances (the vGPUs of
one GPU run at once), batch 4. Reported: p50 / p99 / max of over, and the share of stages
late beyond the target tolerance max(0.3 ms, 2% of due), beside the node's own count
(poolpipe_emulated_stages_total).

Part 2 (`--only cluster`): the paper's group 2 (shadows of colorization-v2,
googlenet-v3-pytorch and repvgg-b3 from data/ppipe-gpu-group2, maf19 mix, SLO 5x) planned
with ppipe and np for each preset (`--cluster hc2-small,hc2-large@32:40`: 16 GPUs, and
hc2-large scaled to 32 keeping its type ratio and GPUs per server, at D = 40), served on
that preset emulated at time scale D (`:D`, or `--cluster-time-scale`: the host's own
work, a millisecond or so per hop, is D x less of a dilated request's time; 32 GPUs at
D = 20 left 4-15% of stages late on this host), with traces of `--duration` x D / the
default D, so that each rate is judged on as many requests (a namespace per server, an
emulated GPU node per GPU, NICs / D,
the router on the dilated plan, arrivals / D), with each transport (router relay, chain):
each plan's capacity (>= 99% on time over two Poisson traces a rate) live, then simulated on
the same traces and calibrated topology; live vs simulated attainment at 1/3, 2/3 and 1 x
the live capacity; np rolled out under load on the same nodes after ppipe; router and node
CPU per request; bytes through the router's interface. Figures undilated, D printed.

Stored in the warehouse (bench_serving, bench "emulated").

    ./run bench-emulated [--only accuracy|cluster] [--calls 200] [--callers 4]
        [--time-scale 1] [--cluster hc2-small,hc2-large@32:40] [--cluster-time-scale 20]
        [--duration 10] [--transport router,chain]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
from functools import partial
from pathlib import Path

import numpy as np

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from poolpipe.scheduler import DATA_PLANES
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import scratch_dir, teardown_on_sigterm

console = Console(width=None if sys.stdout.isatty() else 170)
PPIPE = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "ppipe-gpu"
SOURCE = "googlenet-v3-pytorch", "T4", 1, 6  # model, GPU, share, blocks 0..5
BATCHES = (1, 2, 4, 8)


def t4_table() -> tuple[list[float], str]:
    """Latency (µs) at batch 1..8 of the source blocks on the source GPU; where from."""
    model, gpu, share, blocks = SOURCE
    path = PPIPE / "block-latency" / f"{model}-{gpu}-{share}.csv"
    if not path.is_file():
        raise SystemExit(
            f"{path} is missing: this benchmark takes its table from the PPipe profiles"
        )
    rows = [[float(x) for x in line.split(",")] for line in path.read_text().split()]
    return [sum(r[b] for r in rows[:blocks]) for b in range(len(rows[0]))], str(path)


def stage_over(client, model: str, x: np.ndarray, out: str, due_ns: float) -> float:
    from testbed.loadgen import stage_time_ns

    return stage_time_ns(client, model, {"input": x}, out) - due_ns


def figures(over_ns: list[float], due_ns: float) -> dict[str, float]:
    o = np.asarray(over_ns) / 1e3  # µs
    tol = max(300.0, 0.02 * due_ns / 1e3)
    return {
        "due_ms": due_ns / 1e6,
        "calls": len(o),
        "over_p50_us": float(np.percentile(o, 50)),
        "over_p99_us": float(np.percentile(o, 99)),
        "over_max_us": float(o.max()),
        "early": int((o < 0).sum()),
        "tolerance_us": tol,
        "late_pct": 100.0 * float((o > tol).mean()),
    }


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--calls", type=int, default=200, help="stage calls per batch size (200)")
    ap.add_argument("--callers", type=int, default=4, help="clients at once under load (4)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="D of part 1 (1)")
    ap.add_argument("--only", choices=("accuracy", "cluster"), help="run one part (default: both)")
    ap.add_argument(
        "--cluster",
        default="hc2-small,hc2-large@32:40",
        help="part 2's presets, comma-separated; <preset>@N: scaled to N GPUs; :D its own "
        "time scale (hc2-small,hc2-large@32:40)",
    )
    ap.add_argument(
        "--cluster-time-scale", type=float, default=20.0, help="part 2's default D (20)"
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="part 2: seconds per trace at the default D, dilated; x D / default D at another "
        "(10: two traces of 0.5 s a rate at D = 20, about 250 requests at 16 GPUs' capacity, "
        "where a request or two decide a rate near 99%%; 50: 5 s a rate, about 1,300 "
        "requests, as `./run main --duration 100`, whose figures repeated; 25 min a "
        "transport at 16 GPUs)",
    )
    ap.add_argument(
        "--transport", default="router,chain", help="part 2's transports (router,chain)"
    )
    ap.add_argument(
        "--plane",
        choices=DATA_PLANES,
        default="reservation",
        help="part 2: the router's data plane (reservation: of equally good vGPUs the lowest "
        "first at a low load, taking turns above; packed: the lowest first at any load; "
        "spread: taking turns at any load)",
    )
    ap.add_argument(
        "--nodes",
        choices=("server", "gpu"),
        default="server",
        help="part 2: a node (tritonserver) per server serving its GPUs, or one per GPU (server)",
    )
    args = ap.parse_args()
    logging.getLogger("poolpipe.serve").setLevel(logging.ERROR)  # rollouts: in the tables
    bad = set(args.transport.split(",")) - {"router", "chain"}
    if bad:
        ap.error(f"--transport: unknown {', '.join(sorted(bad))}; give router, chain or both")
    try:  # (checked before anything runs)
        args.clusters = [_time_scale(e, args.cluster_time_scale) for e in args.cluster.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    rows = BenchRows(args.label)
    if args.only != "cluster":
        accuracy(args, rows)
    if args.only != "accuracy":
        cluster_part(args, rows)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench emulated)")
    return 0


def accuracy(args: argparse.Namespace, rows: BenchRows) -> None:
    import httpx
    import tritonclient.grpc as tg

    from flows.onboard import onboard_model
    from poolpipe.offline.partitions import make_partition
    from poolpipe.offline.zoo import make_model
    from triton_backend.node.repository import part_name, partition_files, upload_config
    from triton_backend.node.triton import TritonNode

    table, source = t4_table()
    record = partial(rows.record, "emulated")
    tmp = scratch_dir("bench-emulated-")
    name = "bench-emu"
    path = make_model("resnet50", tmp / "m.onnx", width=0.125, image=32)
    with console.status("onboarding a small model (its CPU compute stands in) ..."):
        onboard_model(
            str(path), name, warehouse=args.warehouse, blocks=2, batches=[1, 2], reps=3,
            replace=True,
        )  # fmt: skip
    with Warehouse.open(args.warehouse) as wh:
        whole, layers = wh.whole_model_file(name), wh.block_layers(name)
    part = make_partition(whole, name, layers, 0, 2, tmp)
    out = part.outputs[0].name
    env = {"POOLPIPE_EMULATE_TIME_SCALE": repr(args.time_scale)}
    node = TritonNode("emulated-t4", "T4", tmp / "repo", tmp, environment=env)
    results: dict[str, dict] = {}
    try:
        with console.status("an emulated T4 node ..."):
            node.start()
            for instances in (1, args.callers):
                model = f"emu{instances}"
                text, files = partition_files(
                    part, cpu=False, instances=instances, latency_us=table, device="T4"
                )
                text = text.replace(f'"{part_name(part)}"', f'"{model}"')
                node.load(model, upload_config(text, model), files)
        client = tg.InferenceServerClient(node.grpc_url)
        for b in BATCHES:
            x = np.zeros((b, 3, 32, 32), np.float32)
            due = table[b - 1] * args.time_scale * 1e3
            with console.status(f"idle, batch {b}: {args.calls} calls ..."):
                for _ in range(5):
                    stage_over(client, "emu1", x, out, due)
                over = [stage_over(client, "emu1", x, out, due) for _ in range(args.calls)]
            results[f"idle, batch {b}"] = figures(over, due)
        b = 4
        x = np.zeros((b, 3, 32, 32), np.float32)
        due = table[b - 1] * args.time_scale * 1e3
        loaded: list[float] = []
        lock = threading.Lock()

        def caller() -> None:
            c = tg.InferenceServerClient(node.grpc_url)
            mine = [stage_over(c, f"emu{args.callers}", x, out, due) for _ in range(args.calls)]
            with lock:
                loaded.extend(mine)

        with console.status(f"{args.callers} callers at once, batch {b} ..."):
            threads = [threading.Thread(target=caller) for _ in range(args.callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        results[f"{args.callers} at once, batch {b}"] = figures(loaded, due)
        text = httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).text
        counted = {
            (m.group(1), m.group(2)): float(m.group(3))
            for m in re.finditer(
                r'poolpipe_emulated_stages_total\{late="(\w+)",model="(\w+)"\} (\S+)', text
            )
        }
    finally:
        node.stop()
    t = Table(
        title=f"EMULATED T4 (time scale {args.time_scale:g}): stage end - start - due, from "
        f"{SOURCE[0]} blocks 0-{SOURCE[3] - 1} ({source})",
        title_justify="left",
    )
    cols = ("due_ms", "calls", "over_p50_us", "over_p99_us", "over_max_us", "early",
            "tolerance_us", "late_pct")  # fmt: skip
    t.add_column("run")
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for run, f in results.items():
        t.add_row(run, *(f"{f[c]:.2f}" if isinstance(f[c], float) else str(f[c]) for c in cols))
        for metric, value in f.items():
            record(run, metric, value)
    console.print(t)
    console.print(
        "the node's own count (poolpipe_emulated_stages_total): "
        + ", ".join(f"{m} late={late}: {n:.0f}" for (late, m), n in sorted(counted.items())),
        highlight=False,
    )


def cluster_part(args: argparse.Namespace, rows: BenchRows) -> None:
    """Part 2: the paper's group 2 (shadows, maf19) on EMULATED preset clusters at time
    scale D, each transport: ppipe and np capacity live and simulated on the same nodes
    (np rolled out under load after ppipe's search), attainment live and simulated at
    three loads up to each live capacity, router and node CPU per request, bytes through
    the router's interface."""
    import time

    from poolpipe.client.control import new_token_file
    from testbed.emulated import (
        GROUP2,
        GROUP2_DIR,
        MAF19,
        compare_plans,
        emulated_nodes,
        group_plans,
        onboard_shadows,
    )

    with Warehouse.open(args.warehouse) as wh:
        warehouse = str(wh.path)
    with console.status("onboarding the shadows of group 2 (flow onboard-shadow) ..."):
        onboard_shadows(warehouse)
    weights = dict(zip(GROUP2, MAF19, strict=True))
    runs = []
    for name, d in args.clusters:
        duration = args.duration * d / args.cluster_time_scale  # as many requests a rate
        plans = group_plans(warehouse, name)
        cluster = plans["ppipe"][0].cluster
        for transport in args.transport.split(","):
            tmp = scratch_dir("bench-emulated-cluster-")
            token_file = tmp / "token"
            token = new_token_file(token_file)
            t0 = time.perf_counter()
            per_server = args.nodes == "server"
            with emulated_nodes(cluster, tmp / "cluster", d, token_file, per_server) as em:
                console.print(
                    f"EMULATED {cluster.name}: {sum(em.gpus)} GPUs, {len(em.nodes)} nodes "
                    f"(a node per {args.nodes}) on {em.servers} "
                    f"servers (namespaces, {cluster.bandwidth_gbps:g} Gbit/s / D NICs), time "
                    f"scale D = {d:g}, transport {transport}, data plane {args.plane}, profiles "
                    f"{GROUP2_DIR}; up in "
                    f"{time.perf_counter() - t0:.0f} s"
                )

                def point(
                    plan: str, kind: str, rate: float, att: float, d=d, duration=duration
                ) -> None:
                    console.print(
                        f"  {plan} {kind}: {rate * d:.0f} req/s ({rate:.2f} dilated) for "
                        f"{duration:g} s: {att:.3f} on time",
                        highlight=False,
                    )

                rx0 = em.router_bytes()
                res = compare_plans(
                    plans, warehouse, em, tmp / "serve", d, weights, duration,
                    token=token, transport=transport, loads=(1 / 3, 2 / 3, 1.0), plane=args.plane,
                    on_point=point, on_step=lambda text: console.print(f"[cyan]{text}[/]"),
                )  # fmt: skip
                moved = em.router_bytes() - rx0
                res["gpus"] = sum(em.gpus)
            runs.append((cluster.name, transport, res, moved, d, duration))
    _cluster_tables(runs, args, rows)


def _time_scale(entry: str, default: float) -> tuple[str, float]:
    """A --cluster entry PRESET[@N][:D]: (the preset, its time scale); ValueError naming the
    entry where D is not a number >= 1."""
    name, _, d = entry.partition(":")
    if not d:
        return name, default
    try:
        value = float(d)
    except ValueError:
        value = 0.0
    if not value >= 1:
        raise ValueError(f"--cluster {entry!r}: the time scale after ':' must be a number >= 1")
    return name, value


def _cluster_tables(runs, args: argparse.Namespace, rows: BenchRows) -> None:
    from testbed.emulated import MIX_STEPS, host_above, judged_text

    t = Table(
        title="EMULATED group 2 at maf19, time scale D (figures undilated), >= 99% on time in "
        "2 traces a rate (3 where 2 fail narrowly) of the dilated seconds given, rates "
        f"1/{MIX_STEPS} of ppipe's plan apart",
        title_justify="left",
    )
    for c in ("cluster", "D", "trace s", "transport", "plan", "planned req/s", "simulated req/s",
              "live req/s", "live / sim", "on time at live (95% interval, requests)", "ready s",
              "router CPU µs/req (above idle)", "nodes CPU µs/req (above idle)",
              "router cores (idle)", "nodes cores (idle)",
              "above live: stages late, host CPU busy"):  # fmt: skip
        t.add_column(c, justify="right")
    loads = Table(
        title="attainment live vs simulated (same traces) at 1/3, 2/3, 1 x live capacity",
        title_justify="left",
    )
    for c in ("cluster", "transport", "plan", "req/s", "live", "simulated", "points apart"):
        loads.add_column(c, justify="right")
    for name, transport, res, moved, d, duration in runs:
        for strategy in ("ppipe", "np"):
            r = res[strategy]
            t.add_row(
                name, f"{d:g}", f"{duration:g}", transport, strategy,
                f"{r['planned']:.1f}",
                f"{'>= ' if r['sim_capped'] else ''}{r['sim'] * d:.0f}",
                f"{'>= ' if r['capped'] else ''}{r['live'] * d:.0f}",
                f"{r['live'] / r['sim']:.2f}" if r["sim"] else "-",
                judged_text(r),
                f"{r['ready_s']:.0f}",
                *(f"{r['cpu_us'][k]:.0f} ({r['cpu_us_above_idle'][k]:.0f})"
                  for k in ("router", "nodes")),
                *(f"{r['cores'][k]:.2f} ({r['idle_cores'][k]:.2f})" for k in ("router", "nodes")),
                host_above(r),
            )  # fmt: skip
            config = (
                f"{name}/{strategy}/D{d:g}/{transport}"
                + ("/node-per-server" if args.nodes == "server" else "")
                + ("" if args.plane == "reservation" else f"/{args.plane}")
            )
            for metric, value in (
                ("capacity_live_req_s", r["live"] * d),
                ("capacity_sim_req_s", r["sim"] * d),
                ("planned_req_s", r["planned"]),
                ("ready_s", r["ready_s"]),
                ("router_cpu_us_per_req", r["cpu_us"]["router"]),
                ("nodes_cpu_us_per_req", r["cpu_us"]["nodes"]),
                ("router_cores", r["cores"]["router"]),
                ("nodes_cores", r["cores"]["nodes"]),
                ("router_cpu_us_per_req_above_idle", r["cpu_us_above_idle"]["router"]),
                ("nodes_cpu_us_per_req_above_idle", r["cpu_us_above_idle"]["nodes"]),
                ("router_idle_cores", r["idle_cores"]["router"]),
                ("nodes_idle_cores", r["idle_cores"]["nodes"]),
                ("live_requests_judged", r["live_requests"]),
                ("live_on_time_low95", r["live_interval"][0]),
                ("host_late_share_above", r["host_late_above"]),
                ("host_cpu_busy_above", r["host_cpu_above"]),
                ("host_bound", float(r["host_bound"])),
            ):
                if value is not None:
                    rows.record("emulated", config, metric, value)
            for k, (rate, live, sim) in enumerate(r["loads"]):
                loads.add_row(
                    name, transport, strategy, f"{rate * d:.0f}", f"{live:.3f}", f"{sim:.3f}",
                    f"{100 * (live - sim):+.1f}",
                )  # fmt: skip
                rows.record("emulated", config, f"attainment_live_load{k + 1}", live)
                rows.record("emulated", config, f"attainment_sim_load{k + 1}", sim)
        rows.record("emulated", f"{name}/D{d:g}/{transport}", "router_interface_mb", moved / 1e6)
        pp, np_ = res["ppipe"], res["np"]
        if np_["live"] and np_["sim"]:
            console.print(
                f"{name}, {transport}: ppipe / np live {pp['live'] / np_['live']:.2f}x, "
                f"simulated {pp['sim'] / np_['sim']:.2f}x, planned "
                f"{pp['planned'] / np_['planned']:.2f}x; {moved / 1e6:.0f} MB through the "
                "router's interface in the run (EMULATED GPUs: real processes, network and "
                "bytes; device times from profiles)"
            )
    console.print(t)
    console.print(loads)
    _router_cpu_by_size(runs)


def _router_cpu_by_size(runs) -> None:
    """The router's CPU per request above idle at each cluster size against the smallest's
    (same transport and plan; each at its own D, printed): how the router's cost grows
    with the cluster."""
    for transport in dict.fromkeys(r[1] for r in runs):
        sized = sorted(
            ((res["gpus"], name, d, res) for name, tr, res, _, d, _ in runs if tr == transport),
            key=lambda x: x[:2],
        )
        if len(sized) < 2:
            continue
        for strategy in ("ppipe", "np"):
            us = [
                (g, name, d, res[strategy]["cpu_us_above_idle"]["router"])
                for g, name, d, res in sized
            ]
            g0, name0, d0, base = us[0]
            rest = [
                f"{name} ({g} GPUs, D = {d:g}) {x:.0f} µs" + (f", {x / base:.2f}x" if base else "")
                for g, name, d, x in us[1:]
            ]
            console.print(
                f"router CPU per request above idle, {transport}, {strategy}: {name0} "
                f"({g0} GPUs, D = {d0:g}) {base:.0f} µs; " + "; ".join(rest),
                highlight=False,
            )


if __name__ == "__main__":
    sys.exit(main())
