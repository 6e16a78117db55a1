"""Reliability benchmark on this machine (real tritonserver nodes, a real second process
holding the warehouse, real signals). Parts, each printed as a table and stored in the
warehouse (bench_serving, bench "reliability"):

1. warehouse held: the router writes its statistics every 2 s under steady load while
   another process holds the warehouse file for `--hold` seconds: statistics windows lost,
   and the router's arrivals against the sum of serving_stats arrivals afterwards;
2. shutdowns: `poolpipe serve` started `--shutdowns` times and sent 1 to 3 SIGINT/SIGTERM
   (random kinds, 0-1 s apart) at a random moment of its start-up or its serving:
   processes of its tree left behind, Triton shared-memory files left, exits that hung;
3. node killed: the only node of a supervised deployment killed (SIGKILL) under load: how
   long until it is restarted with its models and back in the router's service, and how
   the requests meanwhile were answered (failed at once, "no live path", not late).

    ./run bench-reliability [--parts held,shutdowns,node] [--hold 60] [--shutdowns 20]
                            [--rate 20] [--warehouse FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_cluster
from poolpipe.domain.plan import Plan, manual_plan
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import REPO_ROOT, Warehouse, default_path
from testbed import scratch_dir, teardown_on_sigterm
from testbed.holder import hold_elsewhere
from triton_backend.node.triton import descendants, is_running

console = Console(width=None if sys.stdout.isatty() else 150)
CLUSTERS = REPO_ROOT / "local-clusters.toml"


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--hold", type=float, default=60.0, help="seconds the warehouse is held")
    ap.add_argument("--rate", type=float, default=20.0, help="req/s while it is held")
    ap.add_argument("--shutdowns", type=int, default=20, help="serve starts and stops")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--parts", default="held,shutdowns,node", help="which parts (all three)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    warehouse = Path(args.warehouse) if args.warehouse else default_path()

    from flows.onboard import onboard_model
    from poolpipe.offline.zoo import make_model

    rows = BenchRows(args.label)
    record = partial(rows.record, "reliability")

    tmp = scratch_dir("bench-reliability-")
    name = "bench-rel"
    path = make_model("resnet50", tmp / "m.onnx", width=0.25, image=32)
    with console.status("onboarding a small model (cpu-1t) ..."):
        onboard_model(str(path), name, warehouse=str(warehouse), blocks=2, batches=[1, 2], reps=3)
    with Warehouse.open(warehouse) as wh:
        profile = wh.load_profile(name)
    plan = manual_plan(
        name, 500e3, load_cluster(CLUSTERS, "local"), [(0, 2, "cpu-1t", 1)], 1, profile
    )
    if "held" in parts:
        held_part(args, warehouse, plan, tmp, record)
    if "shutdowns" in parts:
        shutdown_part(args, warehouse, plan, tmp, record)
    if "node" in parts:
        node_part(args, warehouse, plan, tmp, record)
    with Warehouse.open(warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows in {warehouse} (bench_serving, bench reliability)")
    return 0


# ---------------------------------------------------------------------------- 1. held


def held_part(args, warehouse: Path, plan: Plan, tmp: Path, record) -> None:
    from testbed.loadgen import drive, poisson_times
    from triton_backend.deploy.serving import ServingProcess

    with Warehouse.open(warehouse) as wh:
        plan_id = wh.store_plan(plan, label="bench-reliability")
    deployment = f"reliability-{os.getpid()}"
    with console.status("warehouse held: starting a deployment ..."):
        srv = ServingProcess(
            plan, str(warehouse), tmp / "ws-held", name=deployment, plan_id=plan_id,
            stats_interval_s=2.0,
        )  # fmt: skip
    flushed = {"windows": 0, "arrivals": 0}
    flush = srv.flush_stats

    def counted() -> int:
        n = flush()
        flushed["windows"] += 1
        return n

    srv.flush_stats = counted  # type: ignore[method-assign]
    before = _router_arrivals(srv)
    dep = srv.deployment
    x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
    inputs = {dep.ios[0].inputs[0].name: x}
    duration = args.hold + 10.0
    shots: list = []
    load = threading.Thread(
        target=lambda: shots.extend(
            drive(dep.grpc_url, plan.models[0].name, inputs, poisson_times(args.rate, duration, 1))
        ),
        daemon=True,
    )
    try:
        load.start()
        time.sleep(5.0)
        holder = hold_elsewhere(warehouse, args.hold)
        console.print(f"warehouse held by PID {holder.pid} for {args.hold:g} s under load ...")
        holder.wait()
        load.join(duration + 60)
        srv.flush_stats()
        arrivals = _router_arrivals(srv) - before
    finally:
        srv.close()
    with Warehouse.open(warehouse) as wh:  # this open writes whatever was spooled
        stored_rows, stored = wh.con.execute(
            "SELECT count(*), coalesce(sum(arrivals), 0) FROM serving_stats WHERE deployment = ?",
            [deployment],
        ).fetchone()  # type: ignore[misc]
    windows_with_rows = flushed["windows"]
    t = Table(title=f"warehouse held {args.hold:g} s, statistics every 2 s", title_justify="left")
    for col in (
        "requests sent",
        "router arrivals",
        "serving_stats arrivals",
        "windows flushed",
        "windows stored",
        "windows lost",
    ):
        t.add_column(col, justify="right")
    lost = max(0, windows_with_rows - int(stored_rows))
    t.add_row(str(len(shots)), str(arrivals), str(int(stored)), str(windows_with_rows),
              str(int(stored_rows)), str(lost))  # fmt: skip
    console.print(t)
    console.print(
        "windows stored counts one row per window (one model); a window whose rows were "
        "spooled while the warehouse was held is written on its next open"
    )
    record("held", "sent", len(shots))
    record("held", "router_arrivals", arrivals)
    record("held", "stored_arrivals", stored)
    record("held", "windows_flushed", windows_with_rows)
    record("held", "windows_lost", lost)


def _router_arrivals(srv) -> int:
    return sum(s.arrivals for s in srv.deployment.core.stats.values())


# ---------------------------------------------------------------------------- 2. shutdowns


def shutdown_part(args, warehouse: Path, plan: Plan, tmp: Path, record) -> None:
    rng = random.Random(args.seed)
    plan_file = tmp / "plan.json"
    plan.save(plan_file)
    results = []
    for i in range(args.shutdowns):
        with console.status(f"shutdown {i + 1}/{args.shutdowns} ..."):
            results.append(_one_shutdown(warehouse, plan_file, tmp / f"ws-stop-{i}", rng))
    t = Table(title=f"{args.shutdowns} serve shutdowns, 1-3 signals each", title_justify="left")
    for col in ("#", "signals", "at", "exit", "seconds to exit", "processes left", "shm left"):
        t.add_column(col, justify="left" if col in ("signals", "at") else "right")
    for i, r in enumerate(results):
        t.add_row(str(i + 1), " ".join(r["signals"]), r["at"], str(r["rc"]),
                  f"{r['exit_s']:.1f}", str(r["left"]), str(r["shm"]))  # fmt: skip
    console.print(t)
    left = sum(r["left"] for r in results)
    shm = sum(r["shm"] for r in results)
    hung = sum(r["rc"] == "hung" for r in results)
    console.print(
        f"[bold]{len(results)} shutdowns[/]: {left} processes orphaned, {shm} shared-memory "
        f"files left, {hung} hung"
    )
    record("shutdowns", "runs", len(results))
    record("shutdowns", "orphaned_processes", left)
    record("shutdowns", "shm_files_left", shm)
    record("shutdowns", "hung", hung)


def _one_shutdown(warehouse: Path, plan_file: Path, ws: Path, rng: random.Random) -> dict:
    shm_before = _shm()
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolpipe_cli", "--warehouse", str(warehouse), "serve",
         str(plan_file), "--workspace", str(ws)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.stdout is not None
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "Ctrl-C stops" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    serving = rng.random() < 0.5  # half the time while serving, else during start-up
    if serving:
        ready.wait(120)
        time.sleep(rng.uniform(0, 2))
    else:
        time.sleep(rng.uniform(0.5, 6.0))
    at = "serving" if ready.is_set() else "start-up"
    tree = _descendants(proc.pid)
    kinds = [rng.choice((signal.SIGINT, signal.SIGTERM)) for _ in range(rng.randint(1, 3))]
    t0 = time.monotonic()
    for k, sig in enumerate(kinds):
        if k:
            time.sleep(rng.uniform(0, 1))
        tree |= _descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(sig)
    try:
        rc: int | str = proc.wait(90)
    except subprocess.TimeoutExpired:
        rc = "hung"
        proc.kill()
        proc.wait()
    exit_s = time.monotonic() - t0
    time.sleep(0.5)
    left = [p for p in tree if is_running(p)]
    for p in left:  # not left to the next round
        os.kill(p, signal.SIGKILL)
    shm = _shm() - shm_before
    return {
        "signals": [signal.Signals(s).name for s in kinds],
        "at": at,
        "rc": rc,
        "exit_s": exit_s,
        "left": len(left),
        "shm": len(shm),
    }


# ---------------------------------------------------------------------------- 3. node


def node_part(args, warehouse: Path, plan: Plan, tmp: Path, record) -> None:
    t = Table(title="the only node killed under load, supervised", title_justify="left")
    for col in (
        "try",
        "restarted after s",
        "serving again after s",
        "sent",
        "ok",
        "failed",
        "dropped",
        "late",
    ):
        t.add_column(col, justify="right")  # fmt: skip
    for k in range(3):
        with console.status(f"node killed ({k + 1}/3) ..."):
            r = _one_node_kill(args, warehouse, plan, tmp / f"ws-node-{k}", k + 1)
        t.add_row(
            str(k + 1),
            f"{r['restarted_s']:.1f}",
            f"{r['serving_again_s']:.1f}",
            *(str(int(r[c])) for c in ("sent", "ok", "failed", "dropped", "late")),
        )
        for metric in ("restarted_s", "serving_again_s", "failed", "late"):
            record(f"node-{k + 1}", metric, r[metric])
    console.print(t)


def _one_node_kill(args, warehouse: Path, plan: Plan, ws: Path, seed: int) -> dict:
    from testbed.loadgen import client_figures, drive, poisson_times
    from triton_backend.deploy.serving import ServingProcess

    srv = ServingProcess(plan, str(warehouse), ws, stats_interval_s=3600, supervise=True)
    dep = srv.deployment
    x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
    inputs = {dep.ios[0].inputs[0].name: x}
    duration = 25.0
    seen = {"restarted_s": float("nan"), "serving_again_s": float("nan")}

    def kill_and_watch() -> None:  # beside the load, which runs on this (main) thread
        time.sleep(5.0)
        (victim,) = list(dep.nodes)
        t0 = time.monotonic()
        dep.nodes[victim].kill()  # type: ignore[attr-defined]
        while time.monotonic() - t0 < 60:
            if seen["restarted_s"] != seen["restarted_s"] and dep.node_restarts.get(victim):
                seen["restarted_s"] = time.monotonic() - t0
            if dep.core.runtime.recoveries >= 1:
                seen["serving_again_s"] = time.monotonic() - t0
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_and_watch, daemon=True)
    try:
        killer.start()
        shots = drive(
            dep.grpc_url, plan.models[0].name, inputs, poisson_times(args.rate, duration, seed)
        )
        killer.join(60)
    finally:
        srv.close()
    s = client_figures(shots, plan.models[0].slo_us / 1e6, duration)
    late = s["ok"] - round(s["attainment"] * s["sent"])
    return {**seen, "late": late, **s}


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if "triton" in f}


def _descendants(pid: int) -> set[int]:
    return {p for p, _ in descendants(pid)}


if __name__ == "__main__":
    sys.exit(main())
