"""Hybrid clients' requests entering mid-model (Graft), planned three ways and simulated.

A mix per --clusters entry: for each of --models, one client class per --uplinks rate
(Mbit/s) choosing its entry block by Neurosurgeon's rule (domain/entry.py choose_entry:
the client's blocks at the P4's latencies x --client-slowdown, its feature map uploaded
compressed --compress times, the server's blocks at the L4's over 1 - the plans' margin
0.4), its budget what the SLO
leaves after its blocks and the upload; rates --rates (req/s) in turn over the streams.
The streams are planned (planner/graft.py, cost objective, 1 per GPU-hour, each plan sized
on what it delivers) re-aligned, per fragment (each entry block apart) and as raw input
(every client sending its input with the whole SLO; the upload not counted), and each plan
is simulated at the streams' rates on seeds it was not sized on (--seeds, --duration s).

Prints the mix, then a row per plan: GPUs, cost against the per-fragment and raw plans,
the least stream's share on time (the two seeds pooled), planning time; stores them in the
warehouse (bench_serving, bench "hybrid"). --live (or --only-live): group 2's streams
re-aligned on EMULATED --live-cluster, served by the router, each client class a host of
its own behind a rate-limited link sending its feature maps at --live-load x its rate
(live_part; bench "hybrid-live"; root, namespaces).

    ./run bench-hybrid [--clusters hc2-large] [--models repvgg-b3,tf_efficientdet_d1,convnext_large]
                       [--uplinks 50,100,150,200,300,400,600,800,1200,1600]
                       [--rates 40,80,120,160] [--duration 30]
                       [--live | --only-live] [--live-load 0.8] [--time-scale 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.entry import EntryStream, choose_entry
from poolpipe.domain.profiles import ModelProfile, load_ppipe_dir
from poolpipe.errors import PoolpipeError
from poolpipe.planner.graft import HOWS, GraftRequest, plan_streams, unservable
from poolpipe.sim.apps import app_attainment_at
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)


def client_side(
    p: ModelProfile, slowdown: float, compress: float, client_gpu: str
) -> tuple[np.ndarray, list[float]]:
    """A client's blocks' latencies (µs, the client GPU's x `slowdown`) and the bytes it
    uploads at each entry block (the raw input, then each boundary / `compress`)."""
    client = p.tables[(client_gpu, 1)].latency_us[:, 0] * slowdown
    assert p.input_bytes is not None
    return client, [p.input_bytes, *(b / compress for b in p.boundary_bytes)]


def mix(
    profiles: dict[str, ModelProfile],
    models: list[str],
    uplinks_text: str,
    rates_text: str,
    slowdown: float,
    compress: float,
    client_gpu: str = "P4",
) -> list[tuple[EntryStream, float]]:
    """The streams of the module doc, each with its client class's uplink (Mbit/s; a
    class whose every entry misses the SLO is left out, and said); uplinks (Mbit/s) and
    rates (req/s) as the options give them, comma-separated."""
    uplinks = [float(x) for x in uplinks_text.split(",")]
    rates = [float(x) for x in rates_text.split(",")]
    out: list[tuple[EntryStream, float]] = []
    for m in models:
        p = profiles[m]
        assert p.slo_us is not None
        client, upload = client_side(p, slowdown, compress, client_gpu)
        server = p.tables[("L4", 1)].latency_us[:, 0]
        for mbps in uplinks:
            try:
                entry, budget = choose_entry(client, upload, mbps * 1e6 / 8, server, p.slo_us, 0.4)
            except PoolpipeError as e:
                console.print(f"{m} at {mbps:g} Mbit/s left out: {e}", highlight=False)
                continue
            rate = rates[len(out) % len(rates)]
            out.append((EntryStream(f"{m}.{mbps:g}mbps", m, entry, budget, rate, p.slo_us), mbps))
    return out


def print_mix(streams: list[EntryStream]) -> None:
    table = Table("stream", "entry block", "budget (ms)", "SLO (ms)", "req/s", title="the mix")
    for s in streams:
        table.add_row(
            s.name, str(s.entry), f"{s.budget_us / 1e3:.1f}", f"{s.slo_us / 1e3:.1f}", f"{s.rate:g}"
        )
    console.print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--clusters", default="hc2-large")
    ap.add_argument("--models", default="repvgg-b3,tf_efficientdet_d1,convnext_large")
    ap.add_argument(
        "--uplinks",
        default="50,100,150,200,300,400,600,800,1200,1600",
        help="Mbit/s per client class",
    )
    ap.add_argument("--rates", default="40,80,120,160", help="req/s, in turn over the streams")
    ap.add_argument("--client-slowdown", type=float, default=1.0, help="x the P4 latency (1)")
    ap.add_argument("--compress", type=float, default=4.0, help="feature maps uploaded / (4)")
    ap.add_argument("--seeds", default="21,22", help="simulation seeds (21,22)")
    ap.add_argument(
        "--merge", choices=("first", "best"), default="first", help="re-aligned merging (first)"
    )
    ap.add_argument("--duration", type=float, default=30.0, help="simulated s per seed (30)")
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument(
        "--live",
        action="store_true",
        help="also serve a mix of group 2's streams on EMULATED --live-cluster (namespaces, "
        "root) and send their feature maps at --live-load x their rates",
    )
    ap.add_argument("--only-live", action="store_true", help="the live part alone")
    ap.add_argument("--live-cluster", default="hc2-small")
    ap.add_argument("--live-models", default="googlenet-v3-pytorch,repvgg-b3")
    ap.add_argument("--live-uplinks", default="200,400,800,1600", help="live: Mbit/s")
    ap.add_argument("--live-compress", type=float, default=8.0, help="live: (8)")
    ap.add_argument("--live-rates", default="5,10,15", help="live: req/s, in turn (5,10,15)")
    ap.add_argument("--live-load", type=float, default=0.8, help="live: x the rates (0.8)")
    ap.add_argument("--live-duration", type=float, default=120.0, help="live: s, dilated (120)")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=20.0,
        help="live: D (20; at 10 this two-core host's own time per stage call is a larger "
        "share of a stage and costs 1-2 points on time)",
    )
    args = ap.parse_args()
    if args.only_live:
        rows = BenchRows(args.label)
        live_part(args, rows)
        with Warehouse.open(args.warehouse) as wh:
            wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows (bench_serving, bench 'hybrid-live')")
        return 0
    started = time.monotonic()
    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    models = args.models.split(",")
    unknown = [m for m in models if m not in profiles]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not in {args.profiles}")
    classes = mix(
        profiles, models, args.uplinks, args.rates, args.client_slowdown, args.compress
    )
    streams = [s for s, _ in classes]
    print_mix(streams)
    seeds = [int(x) for x in args.seeds.split(",")]
    rows = BenchRows(args.label)
    for name in args.clusters.split(","):
        if name not in clusters:
            ap.error(f"--clusters: {name} not in {args.profiles / 'clusters.toml'}")
        req = GraftRequest(tuple(streams), profiles, clusters[name], merge=args.merge)
        plans = {}
        for how in HOWS:
            try:
                plans[how] = plan_streams(req, how, sized=True)
            except PoolpipeError as e:
                console.print(f"{name} {how}: {e}", highlight=False)
        table = Table(
            "plan",
            "GPUs",
            "cost",
            "saved vs per-fragment",
            "saved vs raw",
            "sized (asked / rate)",
            "least stream on time",
            "groups",
            "planning s",
            title=f"{name}: {len(streams)} streams",
        )
        for how, gp in plans.items():
            doc, segs = gp.document()
            on_time = app_attainment_at(
                doc,
                segs,
                gp.request.apps,
                {s.name: s.rate for s in streams},
                seeds=seeds,
                duration_s=args.duration,
            )
            least = min(on_time.values())
            raise_ = max(gp.asked[s.name] / s.rate for s in streams)
            vs = {
                other: f"{1 - gp.cost_per_hour / plans[other].cost_per_hour:+.1%}"
                if other in plans and other != how
                else ""
                for other in ("per-fragment", "raw")
            }
            groups = " ".join(
                f"{g.model.split('_')[0][:8]}{list(g.entries)}x{len(g.fragments)}"
                for g in gp.groups
                if len(g.fragments) > 1 and how == "realigned"
            )
            table.add_row(
                how,
                " + ".join(f"{n} {g}" for g, n in gp.gpus.items()),
                f"{gp.cost_per_hour:g}",
                vs["per-fragment"],
                vs["raw"],
                f"x{raise_:.2f}",
                f"{least:.4f}",
                groups or "-",
                f"{gp.seconds:.1f}",
            )
            cfg = f"{name} {how}"
            rows.record("hybrid", cfg, "gpus", sum(gp.gpus.values()))
            rows.record("hybrid", cfg, "cost_per_hour", gp.cost_per_hour)
            rows.record("hybrid", cfg, "least_on_time", least)
            rows.record("hybrid", cfg, "planning_s", gp.seconds)
        console.print(table)
    if args.live:
        live_part(args, rows)
    console.print(f"{time.monotonic() - started:.0f} s in all", highlight=False)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
    console.print(f"stored {len(rows)} rows (bench_serving, bench 'hybrid')")
    return 0


def live_part(args: argparse.Namespace, rows: BenchRows) -> None:
    """--live-models of group 2 (shadow models, testbed.emulated), a stream per model and
    --live-uplinks rate (clients at the T4's latencies x --client-slowdown, feature maps
    uploaded --live-compress times compressed), planned re-aligned (and per fragment and raw
    for their GPUs) for EMULATED --live-cluster (one emulated GPU node per GPU in
    namespaces, time scale D, inputs counted on the first NICs), served by the router.
    Each client class is a host of its own (testbed/hybrid_load.py): a namespace whose
    link is set so that its feature map (the door's tensors, zeros: the emulated nodes run
    no model) takes the upload time the mix assumed at its uplink, x D; its requests are
    captured Poisson at --live-load x its rate, wait the client's blocks' profiled time
    (x D, EMULATED) and go up that link to the router. Share on time end to end (the
    stream's SLO: client, upload, server) beside the plan simulated at the same rates
    (the server's part, by its budget). Figures undilated."""
    from poolpipe.client.control import new_token_file
    from poolpipe.sim.apps import simulate_apps
    from poolpipe.sim.engine import SimConfig
    from testbed import scratch_dir
    from testbed.emulated import GROUP2, emulated_nodes, group2_inputs, serve_dilated
    from testbed.hybrid_load import ClientClass, run_clients
    from testbed.loadgen import poisson_times
    from testbed.netns import unavailable

    why = unavailable()
    if why:
        console.print(f"the live part is skipped: {why}")
        return
    d = args.time_scale
    with console.status("onboarding the shadows of group 2 (flow onboard-shadow) ..."):
        warehouse, profiles, cluster = group2_inputs(args.warehouse, args.live_cluster)
    models = args.live_models.split(",")
    unknown = [m for m in models if m not in GROUP2]
    if unknown:
        raise PoolpipeError(f"--live-models: {', '.join(unknown)} not of group 2 {GROUP2}")
    classes = mix(
        profiles, models, args.live_uplinks, args.live_rates, args.client_slowdown,
        args.live_compress, client_gpu="T4",
    )  # fmt: skip
    req = GraftRequest(tuple(s for s, _ in classes), profiles, cluster, count_inputs=True)
    bad = unservable(req)
    for why in bad.values():
        console.print(f"left out: {why}", highlight=False)
    classes = [(s, up) for s, up in classes if s.name not in bad]
    streams = [s for s, _ in classes]
    req = GraftRequest(tuple(streams), profiles, cluster, count_inputs=True)
    print_mix(streams)
    with console.status(f"planning {len(streams)} streams for {cluster.name} ..."):
        gp = plan_streams(req, "realigned", sized=True)
        for how in HOWS[1:]:
            try:
                other = plan_streams(req, how, sized=True)
                console.print(
                    f"{how}: {' + '.join(f'{n} {g}' for g, n in other.gpus.items())}",
                    highlight=False,
                )
            except PoolpipeError as e:
                console.print(f"{how}: {e}", highlight=False)
    doc, segs = gp.document()
    with Warehouse.open(warehouse) as wh:
        plan_id = wh.store_plan(doc, label="bench-hybrid:live")
    console.print(
        f"{len(streams)} streams of {', '.join(models)} re-aligned on {cluster.name}: "
        f"{' + '.join(f'{n} {g}' for g, n in gp.gpus.items())}, groups (entries x streams) "
        + " ".join(f"{g.model}{list(g.entries)}x{len(g.fragments)}" for g in gp.groups),
        highlight=False,
    )
    tmp = scratch_dir("bench-hybrid-live-")
    token_file = tmp / "token"
    token = new_token_file(token_file)
    names = [s.name for s in streams]
    rates = [s.rate * args.live_load for s in streams]  # undilated req/s
    seed = 900
    with emulated_nodes(cluster, tmp / "cluster", d, token_file) as em:
        server = serve_dilated(
            doc, plan_id, warehouse, tmp / "serve", d, name="emulated-hybrid", token=token,
            inventory=em.inventory(), listen=em.router_address,
        )  # fmt: skip
        try:
            dep = server.deployment
            clients = []
            for i, (s, uplink) in enumerate(classes):
                p = profiles[s.model]
                client_us, upload = client_side(p, args.client_slowdown, args.live_compress, "T4")
                io = dep.core.apps.ios[s.name]
                tensors = [(t.name, list(t.dims), np.dtype(t.dtype).name) for t in io.inputs]
                sent_bytes = sum(np.dtype(t.dtype).itemsize * np.prod(t.dims) for t in io.inputs)
                # the link carries the door's tensors in the upload time the mix assumed
                namespace, _ = em.add_client(uplink / d * sent_bytes / upload[s.entry])
                times = poisson_times(rates[i] / d, args.live_duration, seed + i)
                clients.append(
                    ClientClass(
                        namespace, s.name, tensors, times.tolist(),
                        float(client_us[: s.entry].sum()) * d / 1e6, s.slo_us * d / 1e6,
                    )
                )  # fmt: skip
            total = sum(rates)
            with console.status(
                f"{total:.0f} req/s live from {len(clients)} client hosts for "
                f"{args.live_duration:g} s ..."
            ):
                shots = run_clients(dep.grpc_url, clients, tmp / "clients")
            members = dep.core.batch_members()
            reasons = dict(dep.core.runtime.drop_reasons)
            # each pool's stage latency at a batch of one and its input's transfer (ms,
            # undilated): the plan's, as the router calibrated it, as it scaled it since
            base, now = dep.core.runtime.base_topo, dep.core.runtime.topo
            pools = [
                (base.models[p.model].name, p.gpu, p.share, len(p.vgpus),
                 [q.latency_us[1] / d / 1e3 for q in (p, now.pools[p.id])],
                 p.transfer_in_us / d / 1e3)
                for p in base.pools
            ]  # fmt: skip
            parts = {n: st.counts() for n, st in dep.core.runtime.stats.items()}
        finally:
            server.close()
    alone = simulate_apps(
        doc, segs, gp.request.apps, dict(zip(names, rates, strict=True)),
        SimConfig(duration_s=args.live_duration / d * 4, seed=seed),
    )  # fmt: skip
    t = Table(
        "stream", "entry", "req/s", "uplink (Mbit/s)", "sent", "on time, end to end",
        "server's part, simulated",
        title=f"EMULATED {cluster.name}, D = {d:g}: {args.live_load:g} x each stream's rate "
        f"from a client host per stream, {args.live_duration:g} s dilated (figures undilated)",
    )  # fmt: skip
    sent_all = on_all = 0
    for i, s in enumerate(streams):
        c = clients[i]
        on = sum(1 for _, e2e, out in shots[i] if out == "ok" and e2e <= c.slo_s)
        sent = len(c.times_s)
        sent_all, on_all = sent_all + sent, on_all + on
        share = on / sent if sent else float("nan")
        t.add_row(
            s.name, str(s.entry), f"{rates[i]:.1f}", f"{classes[i][1]:g}", str(sent),
            f"{share:.2%}", f"{alone.attainment(s.name):.2%}",
        )  # fmt: skip
        rows.record("hybrid-live", f"{cluster.name}:D{d:g}:{s.name}", "live_attainment", share)
    overall = on_all / sent_all if sent_all else float("nan")
    t.add_row(
        "all", "", f"{sum(rates):.1f}", "", str(sent_all), f"{overall:.2%}",
        f"{alone.attainment():.2%}",
    )  # fmt: skip
    rows.record("hybrid-live", f"{cluster.name}:D{d:g}", "live_attainment", overall)
    console.print(t)
    outcomes: dict[str, int] = {}
    for i, c in enumerate(clients):
        for _, e2e, out in shots[i]:
            key = out if out != "ok" else "late" if e2e > c.slo_s else ""
            if key:
                outcomes[key] = outcomes.get(key, 0) + 1
    if outcomes:  # what the misses were, and the router's reasons for its drops
        console.print(
            "missed: " + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
            + (f"; the router's drops: {reasons}" if reasons else ""),
            highlight=False,
        )
        for n, c in sorted(parts.items()):
            if c.get("dropped") or c.get("late"):
                console.print(f"  part {n}: {c}", highlight=False)
        for name, gpu, share, vgpus, (cal, scaled), into in pools:
            planned = doc.model(name).pipelines[0].latency_us / 1e3
            console.print(
                f"  pool {name} on {vgpus} {gpu}/{share}: stage {cal:.2f} ms calibrated, "
                f"{scaled:.2f} ms now, input {into:.2f} ms (pipeline planned {planned:.2f} ms)",
                highlight=False,
            )
    uses: dict[str, int] = {}
    for n in names:
        for part in doc.meta["apps"][n]["parts"].values():
            uses[part] = uses.get(part, 0) + 1
    for m, r in members.items():  # a shared part's batches that held several streams
        if uses.get(m, 0) < 2:
            continue
        console.print(
            f"{m}: {r['mixed']} of {r['batches']} batches held requests of two streams or more",
            highlight=False,
        )
        rows.record("hybrid-live", f"{cluster.name}:D{d:g}:{m}", "mixed_batches", r["mixed"])


if __name__ == "__main__":
    sys.exit(main())
