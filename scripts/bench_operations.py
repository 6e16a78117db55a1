"""What an operator meets on real hosts, measured on the emulated cluster (docs/design/cluster.md):
`--servers` network namespaces, a `poolpipe node` (cpu-1t) in each with fixed ports and a
watch port, the router in the root namespace attached by their inventory. A small
generated ResNet-50 is served whole on every node (one pool of `--servers` vGPUs) at
`--rate` req/s, a load the nodes left after losing one can carry. Each part runs `--runs`
times:

1. router crash: `poolpipe serve` (the real command, in its own process) is killed with
   SIGKILL; how long until no process of it is left, and whether its partitions are still
   on the nodes (they are: nobody unloaded them). Started again on the same ports: its
   start-up time, whether it unloaded the dead router's partitions (and said so), the
   first answer after the restart against that start-up time, the models on the nodes
   afterwards (only its own), and the plan id it printed (the same file: the same plan).
2. node process killed: under load, one node's `poolpipe node` process alone gets SIGKILL
   (as the OOM killer would; its Triton shuts down on its own): how soon the router took
   it out of service, and the requests dropped or failed among those sent in the 3 s
   after the kill (target <= 1%); then the node is started again, empty, and the router
   loads it without traffic (the time until it is back in service).
3. drain under load: one node drained, then undrained: requests dropped or failed (target
   0), how long the drain waited, inferences the node ran while drained (0).

Stored in the warehouse (bench_serving, bench "operations"). Needs root (namespaces).

    ./run bench-operations [--servers 3] [--rate 60] [--runs 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
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

from poolpipe.client.control import new_token_file, node_key, read_token
from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.plan import manual_plan
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import scratch_dir, teardown_on_sigterm

console = Console(width=None if sys.stdout.isatty() else 170)
LOSS_WINDOW_S = 3.0  # the requests sent this long after a kill are the ones it may cost


def _loaded(em, key: str) -> list[str]:
    from triton_backend.node.triton import RemoteNode

    out = []
    for n in em.inventory().nodes:
        with contextlib.suppress(Exception):
            out += RemoteNode(n.name, n.device, n.grpc, key=key).models()
    return sorted(out)


def _first_answer(url: str, model: str, inputs: dict, deadline_s: float) -> float:
    """Ask until the first answer; its time (monotonic), or nan."""
    import tritonclient.grpc as tg

    from testbed.loadgen import grpc_inputs

    prepared = grpc_inputs(inputs)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            tg.InferenceServerClient(url).infer(model, prepared, client_timeout=5)
            return time.monotonic()
        except Exception:
            time.sleep(0.02)
    return float("nan")


# ---------------------------------------------------------------------------- 1. router


def _spawn_serve(args, plan_file: Path, inv: Path, ws: Path, token_file: Path, log: Path):
    cmd = [
        sys.executable, "-m", "poolpipe_cli", "--warehouse", str(args.warehouse_path),
        "serve", str(plan_file), "--nodes", str(inv), "--workspace", str(ws),
        "--grpc-port", str(args.router_grpc), "--http-port", str(args.router_http),
        "--metrics-port", str(args.router_metrics),
        "--triton-metrics-port", str(args.router_metrics + 1),
        "--token-file", str(token_file), "--name", "bench-operations",
    ]  # fmt: skip
    out = open(log, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    t0 = time.monotonic()
    while time.monotonic() - t0 < 240:
        text = log.read_text(errors="replace")
        if "Ctrl-C stops" in text:
            return proc, time.monotonic() - t0, text
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {text[-1500:]}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"serve did not start in 240 s: {log.read_text()[-1500:]}")


def router_part(args, em, plan_file: Path, token_file: Path, inputs: dict, model: str, tmp):
    from triton_backend.node.triton import descendants, still_running

    key = node_key(read_token(token_file))
    inv = em.write_inventory()
    url = f"127.0.0.1:{args.router_grpc}"
    rows = []
    for k in range(args.runs):
        ws = tmp / f"router-{k}"
        with console.status(f"router crash {k + 1}/{args.runs}: starting serve ..."):
            proc, start1, said1 = _spawn_serve(args, plan_file, inv, ws, token_file, tmp / "a.log")
        _first_answer(url, model, inputs, 30)
        ours = sorted(_loaded(em, key))
        below = descendants(proc.pid)
        t_kill = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        while still_running(below) and time.monotonic() - t_kill < 60:
            time.sleep(0.05)
        gone_s = time.monotonic() - t_kill
        left = len(still_running(below))
        stale = _loaded(em, key)
        with console.status(f"router crash {k + 1}/{args.runs}: serve again, same ports ..."):
            answered: list[float] = []  # a client asking all along, from the restart on
            asker = threading.Thread(
                target=lambda got=answered: got.append(_first_answer(url, model, inputs, 240))
            )
            t_spawn = time.monotonic()
            asker.start()
            proc2, start2, said2 = _spawn_serve(args, plan_file, inv, ws, token_file, tmp / "b.log")
            asker.join()
        first = answered[0]
        after = _loaded(em, key)
        proc2.send_signal(signal.SIGTERM)
        rc = proc2.wait(120)
        ids = [re.search(r"serving plan (\d+)", s) for s in (said1, said2)]
        rows.append(
            {
                "start_s": start1,
                "gone_s": gone_s,
                "left": left,
                "stale": len(stale),
                "restart_s": start2,
                "said_unloaded": int("unloaded" in said2 and "earlier router" in said2),
                "serving_again_s": first - t_spawn,
                "models_after_ok": int(after == ours),
                "same_plan_id": int(bool(ids[0] and ids[1] and ids[0][1] == ids[1][1])),
                "stop_rc": rc,
            }
        )
    return rows


# ---------------------------------------------------------------------------- 2. node loss


def node_part(args, em, dep, token_file: Path, inputs: dict, model: str) -> list[dict]:
    from testbed.loadgen import drive, poisson_times

    rows = []
    for k in range(args.runs):
        victim = 1 + k % (len(em.nodes) - 1)
        s = em.nodes[victim]
        address = f"{s.address}:8001"
        marks: dict[str, float] = {}
        recovered = dep.core.runtime.recoveries

        def chaos(k: int = victim, address: str = address, marks: dict = marks) -> None:
            time.sleep(args.duration / 3)
            marks["kill"], marks["kill_wall"] = time.monotonic(), time.time()
            em.kill_node_process(k)  # returns once its Triton has shut down, seconds later
            downs = [
                e[0].timestamp() for e in dep.core.node_events if e[1] == address and e[2] == "down"
            ]
            later = [t for t in downs if t >= marks["kill_wall"]]
            marks["out_ms"] = (min(later) - marks["kill_wall"]) * 1e3 if later else float("nan")

        t = threading.Thread(target=chaos)
        with console.status(f"node process killed {k + 1}/{args.runs} at {args.rate:g} req/s"):
            t0 = time.monotonic()
            t.start()
            shots = drive(dep.grpc_url, model, inputs, poisson_times(args.rate, args.duration, k))
            t.join()
        kill = marks["kill"] - t0
        window = [x for x in shots if kill <= x.sent_s < kill + LOSS_WINDOW_S]
        lost = sum(1 for x in window if x.outcome != "ok")
        with console.status(f"node {s.node_name} started again, empty, no traffic ..."):
            t_start = time.monotonic()
            em.start_node(victim, "cpu-1t", name=s.node_name, token_file=token_file)
            end = time.monotonic() + 120
            while dep.core.runtime.recoveries == recovered and time.monotonic() < end:
                time.sleep(0.05)
            back_s = time.monotonic() - t_start
        rows.append(
            {
                "node": s.node_name,
                "out_after_ms": marks["out_ms"],
                "window_sent": len(window),
                "window_lost": lost,
                "window_lost_pct": 100.0 * lost / max(1, len(window)),
                "sent": len(shots),
                "lost": sum(1 for x in shots if x.outcome != "ok"),
                "back_s": back_s if dep.core.runtime.recoveries > recovered else float("nan"),
            }
        )
    return rows


# ---------------------------------------------------------------------------- 3. drain


def drain_part(args, em, dep, token_file: Path, inputs: dict, model: str) -> list[dict]:
    from testbed.loadgen import drive, poisson_times
    from triton_backend.node.triton import RemoteNode

    key = node_key(read_token(token_file))
    rows = []
    for k in range(args.runs):
        s = em.nodes[1 + k % (len(em.nodes) - 1)]
        node = RemoteNode(s.node_name, "cpu-1t", f"{s.address}:8001", key=key)

        def count(node: RemoteNode = node) -> int:
            with contextlib.closing(node.grpc_client()) as c:
                st = c.get_inference_statistics(headers=node._headers, as_json=True)
            return sum(int(m.get("inference_count", 0)) for m in st.get("model_stats", []))

        seen: dict[str, float] = {}

        def operate(name: str = s.node_name, count=count, seen: dict = seen) -> None:
            time.sleep(args.duration / 3)
            out = dep.drain(name)
            seen["waited_s"] = float(out["waited_s"])  # type: ignore[arg-type]
            seen["left"] = float(out["batches_left"])  # type: ignore[arg-type]
            at = count()
            time.sleep(args.duration / 3)
            seen["while_drained"] = count() - at
            dep.undrain(name)

        t = threading.Thread(target=operate)
        with console.status(f"drain {k + 1}/{args.runs} at {args.rate:g} req/s ..."):
            t.start()
            shots = drive(
                dep.grpc_url, model, inputs, poisson_times(args.rate, args.duration, 50 + k)
            )
            t.join()
        rows.append(
            {
                "node": s.node_name,
                "sent": len(shots),
                "lost": sum(1 for x in shots if x.outcome != "ok"),
                "drain_waited_s": seen["waited_s"],
                "batches_left": seen["left"],
                "inferences_while_drained": seen["while_drained"],
            }
        )
    return rows


# ---------------------------------------------------------------------------- main


def _table(title: str, rows: list[dict], formats: dict[str, str]) -> None:
    t = Table(title=title, title_justify="left")
    t.add_column("run", justify="right")
    for col in formats:
        t.add_column(col.replace("_", " "), justify="right")
    for i, r in enumerate(rows):
        t.add_row(str(i + 1), *(format(r[c], f) if not isinstance(r[c], str) else r[c]
                                for c, f in formats.items()))  # fmt: skip
    console.print(t)


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--servers", type=int, default=3, help="emulated servers, one node each (3)")
    ap.add_argument("--rate", type=float, default=60.0, help="req/s of the load (60)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per loaded run (12)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each part (2)")
    ap.add_argument("--parts", default="router,node,drain", help="which parts (all three)")
    ap.add_argument("--router-grpc", type=int, default=18001, help="the router's ports: gRPC")
    ap.add_argument("--router-http", type=int, default=18000, help="HTTP (18000)")
    ap.add_argument("--router-metrics", type=int, default=18002, help="metrics, +1: Triton's")
    args = ap.parse_args()
    if args.servers < 2:
        ap.error("--servers must be at least 2 (one is killed while the others serve)")
    parts = set(args.parts.split(","))

    from testbed.netns import EmulatedCluster, unavailable

    why = unavailable()
    if why:
        console.print(f"[red]cannot emulate a cluster here:[/] {why}")
        return 2
    from flows.onboard import onboard_model
    from poolpipe.offline.zoo import make_model
    from poolpipe.store.warehouse import default_path
    from triton_backend.deploy.deployment import Deployment

    args.warehouse_path = Path(args.warehouse) if args.warehouse else default_path()
    rows = BenchRows(args.label)
    record = partial(rows.record, "operations")
    tmp = scratch_dir("bench-operations-")
    name = "bench-ops"
    path = make_model("resnet50", tmp / "m.onnx", width=0.125, image=32)
    with console.status("onboarding the benchmark model (cpu-1t) ..."):
        onboard_model(
            str(path), name, warehouse=str(args.warehouse_path), blocks=2, batches=[1, 2, 3, 4],
            reps=3, replace=True,
        )  # fmt: skip
    with Warehouse.open(args.warehouse_path) as wh:
        profile = wh.load_profile(name)
    n = args.servers
    cluster = Cluster("emulated", 1.0, (GpuPool("cpu-1t", n, 1, (1,)),))
    plan = manual_plan(name, 400e3, cluster, [(0, 2, "cpu-1t", n)], 4, profile)
    plan_file = tmp / "plan.json"
    plan.save(plan_file)
    x = np.zeros((1, 3, 32, 32), np.float32)
    results: dict[str, list[dict]] = {}
    with EmulatedCluster(n, tmp / "cluster") as em:
        token_file = tmp / "token"
        new_token_file(token_file)
        with console.status(f"starting {n} nodes in their namespaces ..."):
            for k in range(n):
                em.start_node(k, "cpu-1t", wait=False, token_file=token_file)
            for k in range(n):
                em.wait_node(k)
        inputs = {"input": x}
        if "router" in parts:
            results["router"] = router_part(args, em, plan_file, token_file, inputs, name, tmp)
        if parts & {"node", "drain"}:
            with console.status("the router, in this process ..."):
                dep = Deployment.up(
                    plan, args.warehouse_path, tmp / "dep", inventory=em.inventory(),
                    token=read_token(token_file), router_instances=4,
                )  # fmt: skip
            try:
                from testbed.loadgen import drive, poisson_times

                drive(dep.grpc_url, name, inputs, poisson_times(args.rate, 2, 99))  # warm-up
                if "node" in parts:
                    results["node"] = node_part(args, em, dep, token_file, inputs, name)
                if "drain" in parts:
                    results["drain"] = drain_part(args, em, dep, token_file, inputs, name)
            finally:
                dep.down()
    formats = {
        "router": {
            "start_s": ".1f", "gone_s": ".2f", "left": "d", "stale": "d", "restart_s": ".1f",
            "said_unloaded": "d", "serving_again_s": ".1f", "models_after_ok": "d",
            "same_plan_id": "d", "stop_rc": "d",
        },
        "node": {
            "node": "", "out_after_ms": ".0f", "window_sent": "d", "window_lost": "d",
            "window_lost_pct": ".2f", "sent": "d", "lost": "d", "back_s": ".1f",
        },
        "drain": {
            "node": "", "sent": "d", "lost": "d", "drain_waited_s": ".2f",
            "batches_left": ".0f", "inferences_while_drained": ".0f",
        },
    }  # fmt: skip
    titles = {
        "router": "router kill -9, then serve again on the same ports",
        "node": f"a node's process kill -9 at {args.rate:g} req/s (lost: in the "
        f"{LOSS_WINDOW_S:g} s after the kill; back: started empty, no traffic)",
        "drain": f"drain and undrain under {args.rate:g} req/s",
    }
    for part, got in results.items():
        _table(titles[part], got, formats[part])
        for i, r in enumerate(got):
            for metric, value in r.items():
                if not isinstance(value, str):
                    record(f"{part}-{i + 1}", metric, value)
    with Warehouse.open(args.warehouse_path) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(
        f"stored {len(rows)} rows in {args.warehouse_path} (bench_serving, bench operations)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
