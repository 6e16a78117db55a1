"""Emulated GPU nodes (../shared/docs/emulation.md). EMULATED: not GPU measurements.

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
with ppipe and np for a preset (`--cluster hc2-small`), served on that preset emulated at
time scale D (a namespace per server, an emulated GPU node per GPU, NICs / D, the router
on the dilated plan, arrivals / D): each plan's capacity (>= 99% on time in two Poisson
traces a rate) live and simulated on the same calibrated topology, np rolled out under
the same nodes after ppipe. Figures undilated, D printed.

Stored in the warehouse (bench_serving, bench "emulated").

    ./run bench-emulated [--only accuracy|cluster] [--calls 200] [--callers 4]
        [--time-scale 1] [--cluster hc2-small] [--cluster-time-scale 20] [--duration 15]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path

import numpy as np

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--calls", type=int, default=200, help="stage calls per batch size (200)")
    ap.add_argument("--callers", type=int, default=4, help="clients at once under load (4)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="D of part 1 (1)")
    ap.add_argument("--only", choices=("accuracy", "cluster"), help="run one part (default: both)")
    ap.add_argument("--cluster", default="hc2-small", help="part 2's preset (hc2-small)")
    ap.add_argument("--cluster-time-scale", type=float, default=20.0, help="part 2's D (20)")
    ap.add_argument(
        "--duration", type=float, default=15.0, help="part 2: seconds per trace, dilated (15)"
    )
    ap.add_argument(
        "--transport", default="router", choices=("router", "chain"), help="part 2 (router)"
    )
    args = ap.parse_args()
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
    from triton_backend.nodes import TritonNode
    from triton_backend.repository import part_name, partition_files, upload_config

    table, source = t4_table()
    record = partial(rows.record, "emulated")
    tmp = Path(tempfile.mkdtemp(prefix="bench-emulated-"))
    name = "bench-emu"
    path = make_model("resnet50", tmp / "m.onnx", width=0.125, image=32)
    with console.status("onboarding a small model (its CPU compute stands in) ..."):
        onboard_model(str(path), name, warehouse=args.warehouse, blocks=2, batches=[1, 2], reps=3)
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
    """Part 2: the paper's group 2 (shadows, maf19) on an EMULATED preset cluster at time
    scale D: ppipe and np capacity live and simulated, on the same nodes (np rolled out
    under load after ppipe's search); router and node CPU per request."""
    import time

    from poolpipe.client.control import new_token_file
    from poolpipe.domain.plan import dilated
    from testbed.emulated import (
        GROUP2,
        GROUP2_DIR,
        MAF19,
        MixLoad,
        emulated_nodes,
        group_plans,
        mix_capacity,
        onboard_shadows,
        serve_dilated,
    )

    d = args.cluster_time_scale
    with Warehouse.open(args.warehouse) as wh:
        warehouse = str(wh.path)
    with console.status("onboarding the shadows of group 2 (flow onboard-shadow) ..."):
        onboard_shadows(warehouse)
    plans = group_plans(warehouse, args.cluster)
    cluster = plans["ppipe"][0].cluster
    weights = dict(zip(GROUP2, MAF19, strict=True))
    tmp = Path(tempfile.mkdtemp(prefix="bench-emulated-cluster-"))
    token_file = tmp / "token"
    token = new_token_file(token_file)
    results = {}
    t0 = time.perf_counter()
    with emulated_nodes(cluster, tmp / "cluster", d, token_file) as em:
        console.print(
            f"EMULATED {cluster.name}: {len(em.nodes)} GPU nodes on {em.servers} servers "
            f"(namespaces, {cluster.bandwidth_gbps:g} Gbit/s / D NICs), time scale D = {d:g}, "
            f"profiles {GROUP2_DIR}; up in {time.perf_counter() - t0:.0f} s"
        )
        top = plans["ppipe"][0].objective / d  # both plans on one grid: ppipe's plan rate
        server = None
        try:
            for strategy in ("ppipe", "np"):
                plan, plan_id = plans[strategy]
                t1 = time.perf_counter()
                if server is None:
                    server = serve_dilated(
                        plan, plan_id, warehouse, tmp / "serve", d, name="bench-emulated",
                        token=token, inventory=em.inventory(), transport=args.transport,
                    )  # fmt: skip
                else:
                    r = server.rollout(dilated(plan, d), plan_id)
                    if r.status != "done":
                        raise SystemExit(f"the rollout to {strategy} ended {r.status}: {r.reason}")
                ready_s = time.perf_counter() - t1
                dep = server.deployment
                load = MixLoad.of(dep, weights)

                def point(kind: str, rate: float, att: float, label: str = strategy) -> None:
                    console.print(
                        f"  {label} {kind}: {rate * d:.0f} req/s ({rate:.2f} dilated) for "
                        f"{args.duration:g} s: {att:.3f} on time",
                        highlight=False,
                    )

                c0 = os.times()
                found = mix_capacity(dep, load, top, args.duration, on_point=point)
                c1 = os.times()
                results[strategy] = {
                    **found,
                    "planned": plan.objective,
                    "ready_s": ready_s,
                    "router_cpu_s": (c1.user - c0.user) + (c1.system - c0.system),
                }
        finally:
            if server is not None:
                server.close()
    t = Table(
        title=f"EMULATED {cluster.name}, group 2 at maf19, time scale D = {d:g} (figures "
        f"undilated), transport {args.transport}, >= 99% on time in 2 traces of "
        f"{args.duration:g} s a rate",
        title_justify="left",
    )
    for c in ("plan", "planned req/s", "simulated req/s", "live req/s", "live / sim",
              "ready s"):  # fmt: skip
        t.add_column(c, justify="right")
    for strategy, r in results.items():
        t.add_row(
            strategy,
            f"{r['planned']:.1f}",
            f"{'>= ' if r['sim_capped'] else ''}{r['sim'] * d:.0f}",
            f"{'>= ' if r['capped'] else ''}{r['live'] * d:.0f}",
            f"{r['live'] / r['sim']:.2f}" if r["sim"] else "-",
            f"{r['ready_s']:.0f}",
        )
        config = f"{cluster.name}/{strategy}/D{d:g}/{args.transport}"
        for metric, key, scale in (
            ("capacity_live_req_s", "live", d),
            ("capacity_sim_req_s", "sim", d),
            ("planned_req_s", "planned", 1.0),
            ("ready_s", "ready_s", 1.0),
        ):
            rows.record("emulated", config, metric, r[key] * scale)
    console.print(t)
    if results.get("np", {}).get("live") and results["np"]["sim"]:
        pp, np_ = results["ppipe"], results["np"]
        console.print(
            f"ppipe / np: live {pp['live'] / np_['live']:.2f}x, simulated "
            f"{pp['sim'] / np_['sim']:.2f}x, planned {pp['planned'] / np_['planned']:.2f}x "
            "(EMULATED GPUs: real processes, network and bytes; device times from profiles)"
        )


if __name__ == "__main__":
    sys.exit(main())
