"""Serving on an emulated multi-host cluster (docs/design/cluster.md): `--servers` network
namespaces with `--bandwidth-gbps` NICs limited by tc in both directions, a `poolpipe node`
(cpu-1t) in each, the router in the root namespace attached by their inventory. A generated
ResNet-50 and a 2-partition plan (each partition on half the nodes) are served with both
transports:

- `router`: every stage called from the router (feature maps go node -> router -> node);
- `chain`:  the first node sends its feature map straight to the next.

At each load: what crossed the router's interface against the requests' own inputs and
outputs (target <= 1.1x with `chain`), what went server to server, attainment measured
by the client beside the simulator's prediction on the router's calibrated topology (with
stage times drawn from a calibration run of its own at the same load: on the shared cores
of one host they grow with the load), p50 / p99, and a chain's overhead (how much
later than its reservations' end the answer came: forwarding, the stubs, the answer's way
back; waits for a vGPU or link as booked are not overhead). With each transport, the live
capacity at >= 99% on time (bisected up to --capacity-top) beside the simulator's on the
same traces (with --capacity; it runs first, and the loads are then 1/3, 2/3 and all of
each transport's live capacity unless --rates names them). Then, with `chain`, under the
middle load: a rollout (the cut moves one block; requests unanswered, failed, the switch's
downtime against SLO + 100 ms) and a node killed (SIGKILL) and restarted empty at its
address (no request may hang; the router must upload its models and put it back in
service); last, the whole model on every node (np) rolled out and its capacity found on
the same nodes. Stored in the warehouse (bench_serving, bench "cluster"). Needs root (network
namespaces).

    ./run bench-cluster [--servers 4] [--bandwidth-gbps 1] [--duration 15] [--rates 5,10,15]
                        [--capacity [--capacity-top 400]]
"""

from __future__ import annotations

import argparse
import os
import signal
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

from poolpipe.client.control import new_token_file
from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.plan import manual_plan
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import scratch_dir, teardown_on_sigterm
from testbed.predict import predict

console = Console(width=None if sys.stdout.isatty() else 170)
TIMEOUT_S = 30.0  # a client gives up on a request after this long: it hung


def iface_bytes(name: str) -> int:
    stats = Path("/sys/class/net") / name / "statistics"
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def unanswered(shots: list, sent: int, timeout_s: float = TIMEOUT_S) -> int:
    """Requests with no answer: never back, or back only when the client gave up."""
    return sent - len(shots) + sum(1 for x in shots if x.latency_s >= 0.99 * timeout_s)


def capacity_loads(live: float) -> list[float]:
    """Three loads up to a live capacity: 1/3, 2/3 and all of it (of 1 req/s when no rate
    passed)."""
    top = live if live > 0 else 1.0
    return [round(top * f, 1) for f in (1 / 3, 2 / 3, 1.0)]


def rollout_phase(dep, plan, args, inputs: dict, rate: float) -> dict:
    """Steady load for 3 x --duration; the rollout to `plan` starts after 1/4 of it."""
    from testbed.loadgen import client_figures, drive, poisson_times

    duration = 3 * args.duration
    times = poisson_times(rate, duration, 77)
    done: dict = {}

    def roll() -> None:
        time.sleep(duration / 4)
        done["r"] = dep.rollout(plan, args.warehouse)

    t = threading.Thread(target=roll)
    t.start()
    shots = drive(dep.grpc_url, dep.ios[0].name, inputs, times, timeout_s=TIMEOUT_S)
    t.join()
    r = done["r"]
    s = client_figures(shots, args.slo_ms / 1e3, duration)
    return {
        "status": r.status,
        "reason": r.reason,
        "prepare_s": r.prepare_s,
        "downtime_ms": r.downtime_ms,
        "held": r.held,
        "sent": len(times),
        "unanswered": unanswered(shots, len(times)),
        "failed": s["failed"],
        "dropped": s["dropped"],
        "attainment": s["attainment"],
    }


def node_loss_phase(dep, em, token_file: Path, args, inputs: dict, rate: float) -> dict:
    """Steady load for 3 x --duration: after one third a node of a two-node pool is killed
    (SIGKILL, its Triton with it), after two thirds started again, empty, at its address;
    the router must find it, upload its models and put it back in service."""
    from testbed.loadgen import client_figures, drive, poisson_times

    part = next(
        p.partition
        for p in dep.layout.placements
        if sum(q.partition == p.partition for q in dep.layout.placements) > 1
    )
    node = next(p.node for p in dep.layout.placements if p.partition == part)
    k = next(i for i, s in enumerate(em.nodes) if s.node_name == dep.nodes[node].name)
    victim = em.nodes[k]
    duration = 3 * args.duration
    times = poisson_times(rate, duration, 78)
    marks: dict[str, float] = {}
    recovered = dep.core.runtime.recoveries

    def chaos() -> None:
        time.sleep(args.duration)
        marks["kill"] = time.monotonic()
        em.stop_node(k, signal.SIGKILL)
        time.sleep(args.duration)
        marks["restart"] = time.monotonic()
        em.start_node(k, victim.device, name=victim.node_name, token_file=token_file)
        deadline = time.monotonic() + 120
        while dep.core.runtime.recoveries == recovered and time.monotonic() < deadline:
            time.sleep(0.05)
        marks["back"] = time.monotonic()

    t = threading.Thread(target=chaos)
    t0 = time.monotonic()
    t.start()
    shots = drive(dep.grpc_url, dep.ios[0].name, inputs, times, timeout_s=TIMEOUT_S)
    t.join()
    slo = args.slo_ms / 1e3
    kill, restart = marks["kill"] - t0, marks["restart"] - t0
    phase = {
        "before": [x for x in shots if x.sent_s < kill],
        "down": [x for x in shots if kill <= x.sent_s < restart],
        "after": [x for x in shots if x.sent_s >= restart],
    }
    s = client_figures(shots, slo, duration)
    back = dep.core.runtime.recoveries > recovered
    return {
        "node": victim.node_name,
        "sent": len(times),
        "unanswered": unanswered(shots, len(times)),
        "failed": s["failed"],
        "dropped": s["dropped"],
        "attainment": s["attainment"],
        **{f"attainment_{k}": client_figures(v, slo, 1)["attainment"] for k, v in phase.items()},
        "returned": int(back),
        "return_s": marks["back"] - marks["restart"] if back else float("nan"),
    }


def events_table(events: dict[str, dict], args) -> None:
    if not events:
        return
    t = Table(
        title="events under load (chain transport)",
        title_justify="left",
    )
    for col in ("event", "outcome", "sent", "unanswered", "failed", "dropped", "on time"):
        t.add_column(col, justify="right")
    r = events["rollout"]
    slack = args.slo_ms + 100
    t.add_row(
        "rollout (cut moves)",
        f"{' '.join(x for x in (r['status'], r['reason']) if x)}; "
        f"downtime {r['downtime_ms']:.0f} ms "
        f"({'<=' if r['downtime_ms'] <= slack else '>'} SLO + 100 ms), {r['held']} held",
        str(r["sent"]),
        str(r["unanswered"]),
        str(r["failed"]),
        str(r["dropped"]),
        f"{r['attainment']:.3f}",
    )
    n = events["node loss"]
    back = (
        f"back in service {n['return_s']:.1f} s after its restart"
        if n["returned"]
        else "NOT back in service"
    )
    t.add_row(
        f"node {n['node']} killed",
        f"{back}; on time before / down / after: {n['attainment_before']:.3f} / "
        f"{n['attainment_down']:.3f} / {n['attainment_after']:.3f}",
        str(n["sent"]),
        str(n["unanswered"]),
        str(n["failed"]),
        str(n["dropped"]),
        f"{n['attainment']:.3f}",
    )
    console.print(t)


def capacity_table(capacity: dict[str, dict], args) -> None:
    from testbed.loadgen import CAPACITY_STEPS, CAPACITY_TARGET

    if not capacity:
        return
    t = Table(
        title=f"capacity on the same nodes (>= {CAPACITY_TARGET:.0%} on time, bisected to "
        f"{args.capacity_top / CAPACITY_STEPS:g} req/s, {args.capacity_duration:g} s a probe)",
        title_justify="left",
    )
    for col in ("plan", "planned req/s", "simulator req/s", "live req/s", "probes: live / sim"):
        t.add_column(col, justify="right")
    for label, c in capacity.items():
        both = sorted(set(c["live_points"]) & set(c["sim_points"]))
        t.add_row(
            label,
            f"{c['planned']:.0f}",
            f"{'>= ' if c['sim_capped'] else ''}{c['sim']:.1f}",
            f"{'>= ' if c['capped'] else ''}{c['live']:.1f}",
            ", ".join(
                f"{r:.0f}: {c['live_points'][r]:.3f} / {c['sim_points'][r]:.3f}" for r in both
            ),
        )
    console.print(t)


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--servers", type=int, default=4, help="emulated servers, one node each (4)")
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0, help="each server's NIC (1)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per load (15)")
    ap.add_argument(
        "--rates",
        default=None,
        help="req/s, comma-separated; default: with --capacity 1/3, 2/3 and 1 x each "
        "transport's live capacity, else 5,10,15",
    )
    ap.add_argument("--slo-ms", type=float, default=400.0, help="SLO (400)")
    ap.add_argument("--cut", type=int, default=1, help="blocks on the first partition (1 of 4)")
    ap.add_argument(
        "--capacity",
        action="store_true",
        help="first search each plan's live capacity (about 5 minutes per plan); the loads "
        "then follow from it unless --rates is given",
    )
    ap.add_argument(
        "--capacity-top", type=float, default=120.0, help="capacity searched up to (120 req/s)"
    )
    ap.add_argument(
        "--capacity-duration", type=float, default=8.0, help="seconds per capacity probe (8)"
    )
    args = ap.parse_args()

    from testbed.netns import EmulatedCluster, unavailable

    why = unavailable()
    if why:
        console.print(f"[red]cannot emulate a cluster here:[/] {why}")
        return 2
    from flows.onboard import onboard_model
    from poolpipe.offline.zoo import make_model
    from testbed.loadgen import client_figures, drive, live_capacity, poisson_times
    from triton_backend.deploy.deployment import Deployment

    rows = BenchRows(args.label)
    record = partial(rows.record, "cluster")

    tmp = scratch_dir("bench-cluster-")
    name = "bench-cluster-resnet"
    path = make_model("resnet50", tmp / "m.onnx", width=0.5, image=64)
    with console.status("onboarding the benchmark model (cpu-1t) ..."):
        # (the benchmark's own model: a run before this one left it in the warehouse)
        onboard_model(
            str(path), name, warehouse=args.warehouse, blocks=4, batches=[1, 2, 3, 4],
            replace=True,
        )  # fmt: skip
    with Warehouse.open(args.warehouse) as wh:
        profile = wh.load_profile(name)
    half = args.servers // 2
    cluster = Cluster("emulated", args.bandwidth_gbps, (GpuPool("cpu-1t", args.servers, 1, (1,)),))
    plan = manual_plan(
        name,
        args.slo_ms * 1e3,
        cluster,
        [(0, args.cut, "cpu-1t", half), (args.cut, 4, "cpu-1t", args.servers - half)],
        4,
        profile,
    )
    fixed_rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    if fixed_rates is None and not args.capacity:
        fixed_rates = [5.0, 10.0, 15.0]
    results: dict[str, list[tuple[float, dict]]] = {}
    events: dict[str, dict] = {}
    capacity: dict[str, dict] = {}

    def search(dep, inputs: dict) -> dict:
        return live_capacity(
            dep, inputs, args.capacity_top, args.capacity_duration, args.slo_ms / 1e3
        )

    with EmulatedCluster(args.servers, tmp / "cluster", args.bandwidth_gbps) as em:
        token_file = tmp / "token"
        token = new_token_file(token_file)
        with console.status(f"starting {args.servers} nodes in their namespaces ..."):
            for k in range(args.servers):
                em.start_node(k, "cpu-1t", wait=False, token_file=token_file)
            for k in range(args.servers):
                em.wait_node(k)
        inv = em.inventory()
        for transport in ("router", "chain"):
            with console.status(f"{transport}: uploading and calibrating ..."):
                dep = Deployment.up(
                    plan,
                    args.warehouse,
                    tmp / transport,
                    inventory=inv,
                    token=token,
                    transport=transport,
                )
            try:
                x = np.zeros((1, *dep.ios[0].inputs[0].dims), np.float32)
                in_name = dep.ios[0].inputs[0].name
                out = dep.ios[0].outputs[0]
                out_bytes = int(np.prod(out.dims)) * np.dtype(out.dtype).itemsize
                first = next(p for p in dep.layout.placements if p.start == 0)
                fmap = sum(
                    int(np.prod(t.dims)) * np.dtype(t.dtype).itemsize
                    for t in dep.parts[first.partition].outputs
                )
                url = dep.grpc_url
                drive(url, name, {in_name: x}, poisson_times(5, 2, 0))  # warm-up
                if args.capacity:
                    with console.status(f"{transport}: capacity ..."):
                        capacity[f"{half}+{half} nodes, {transport}"] = found = search(
                            dep, {in_name: x}
                        )
                rates = fixed_rates or capacity_loads(found["live"])
                results[transport] = []
                for k, rate in enumerate(rates):
                    # stage times at this load (on two shared cores they grow with it), from
                    # a run of its own: the simulator predicts the measured run with them
                    dep.core.take_stage_factors()
                    dep.core.take_answer_delays()
                    drive(url, name, {in_name: x}, poisson_times(rate, args.duration, 100 + k))
                    factors = dep.core.take_stage_factors()
                    delays = dep.core.take_answer_delays()
                    times = poisson_times(rate, args.duration, k + 1)
                    before = (
                        iface_bytes(em.bridge),
                        sum(em.link_bytes(s)[1] for s in range(args.servers)),
                    )
                    dep.core.take_chain_overheads()
                    shots = drive(url, name, {in_name: x}, times)
                    overheads = dep.core.take_chain_overheads()
                    router_bytes = iface_bytes(em.bridge) - before[0]
                    servers_out = sum(em.link_bytes(s)[1] for s in range(args.servers)) - before[1]
                    s = client_figures(shots, args.slo_ms / 1e3, args.duration)
                    answered = s["ok"]
                    payload = len(shots) * x.nbytes + answered * out_bytes
                    sim = predict(dep, times, args.duration, factors, answer_delays=delays)
                    s |= {
                        "router_bytes": router_bytes,
                        "payload_bytes": payload,
                        "ratio": router_bytes / max(1, payload),
                        "server_out_bytes": servers_out,
                        "fmap_bytes": fmap * answered,
                        "sim": sim.attainment,
                        "overhead_p50_ms": float(np.median(overheads)) / 1e3 if overheads else 0,
                        "overhead_p99_ms": (
                            float(np.percentile(overheads, 99)) / 1e3 if overheads else 0
                        ),
                    }
                    results[transport].append((rate, s))
                    config = f"{transport}@{rate:g}req/s"
                    for metric in (
                        "attainment",
                        "sim",
                        "p50_ms",
                        "p99_ms",
                        "ratio",
                        "router_bytes",
                        "payload_bytes",
                        "server_out_bytes",
                        "overhead_p50_ms",
                        "overhead_p99_ms",
                    ):
                        record(config, metric, s[metric])
                if transport == "chain":
                    rate = rates[len(rates) // 2]
                    second = manual_plan(
                        name,
                        args.slo_ms * 1e3,
                        cluster,
                        [(0, args.cut + 1, "cpu-1t", half), (args.cut + 1, 4, "cpu-1t", half)],
                        4,
                        profile,
                    )
                    inputs = {in_name: x}
                    with console.status(f"rollout under {rate:g} req/s ..."):
                        events["rollout"] = rollout_phase(dep, second, args, inputs, rate)
                    with console.status(f"a node killed under {rate:g} req/s ..."):
                        events["node loss"] = node_loss_phase(
                            dep, em, token_file, args, inputs, rate
                        )
                    for event, e in events.items():
                        for metric, value in e.items():
                            if isinstance(value, int | float):
                                record(f"chain {event}@{rate:g}req/s", metric, value)
                if transport == "chain" and args.capacity:
                    # whole-model serving on the same nodes
                    whole = manual_plan(
                        name,
                        args.slo_ms * 1e3,
                        cluster,
                        [(0, 4, "cpu-1t", args.servers)],
                        4,
                        profile,
                    )
                    with console.status("whole model (np): rollout and capacity ..."):
                        r = dep.rollout(whole, args.warehouse)
                        if r.status != "done":
                            raise SystemExit(f"the rollout to the np plan failed: {r.reason}")
                        capacity[f"{args.servers} nodes, whole model (np)"] = search(
                            dep, {in_name: x}
                        )
                for label, c in capacity.items():
                    for metric in ("planned", "sim", "live"):
                        record(f"capacity {label}", f"{metric}_req_s", c[metric])
            finally:
                dep.down()

    t = Table(
        title=f"emulated cluster: {args.servers} servers, {args.bandwidth_gbps:g} Gbit/s NICs, "
        f"ResNet-50 (width 0.5, 64 px) cut after block {args.cut} of 4, SLO {args.slo_ms:g} ms",
        title_justify="left",
    )
    for col in (
        "transport",
        "req/s",
        "router iface MB",
        "inputs+outputs MB",
        "ratio",
        "servers sent MB",
        "feature maps MB",
        "live",
        "simulator",
        "points apart",
        "p50 ms",
        "p99 ms",
        "chain overhead p50/p99 ms",
    ):
        t.add_column(col, justify="right")
    for transport, runs in results.items():
        for rate, s in runs:
            gap = abs(s["attainment"] - s["sim"]) * 100
            ok = "" if transport != "chain" or s["ratio"] <= 1.1 else " (> 1.1)"
            t.add_row(
                transport,
                f"{rate:g}",
                f"{s['router_bytes'] / 1e6:.2f}",
                f"{s['payload_bytes'] / 1e6:.2f}",
                f"{s['ratio']:.2f}{ok}",
                f"{s['server_out_bytes'] / 1e6:.2f}",
                f"{s['fmap_bytes'] / 1e6:.2f}",
                f"{s['attainment']:.3f}",
                f"{s['sim']:.3f}",
                f"{gap:.1f}{'' if gap <= 2 else ' (> 2)'}",
                f"{s['p50_ms']:.1f}",
                f"{s['p99_ms']:.1f}",
                f"{s['overhead_p50_ms']:.1f} / {s['overhead_p99_ms']:.1f}"
                if transport == "chain"
                else "",
            )
        t.add_section()
    console.print(t)
    events_table(events, args)
    capacity_table(capacity, args)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench cluster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
