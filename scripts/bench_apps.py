"""Applications planned on the paper's clusters: the SLO split jointly with the pools (one
MILP) against an equal split, a split in proportion to the models' latencies and Nexus's
split-then-plan (each model's budget chosen by its cost alone), each of those planned with
the same MILP; then the cost objective: the cheapest GPUs serving --rate-share of what the
joint split serves, pooled (budgets chosen jointly, from the cheapest of the fixed splits'
plans) beside the fixed splits' and whole-model pipelines; then the
joint split's plan simulated through the serving runtime at --loads x its planned rates
(each application request answered once, on time only when all its parts were). Prints
three tables and stores their rows in the warehouse (bench_serving, bench "apps").

The two mixes (SLO = --slo-scale x the reference latencies along the application's
slowest path, as the paper sets each model's SLO at 5x its own):

- traffic: tf_efficientdet_d1 finds the vehicles of a frame, repvgg-b3 classifies three
  crops of each (fan-out 3, shadow inputs);
- traffic + scene, weights 1:1: scene is googlenet-v3-pytorch deciding a frame is worth a
  look, then a segmentation (fcn-d6) and a detector (atss) on it, joined by repvgg-b3
  (fan-in: it waits for both).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poolpipe.domain.apps import parse_apps
from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.errors import SolverError
from poolpipe.planner.apps import (
    SPLITS,
    AppPlan,
    AppPlanRequest,
    app_plan_document,
    cheapest_apps,
    cheapest_by_split,
    plan_apps,
)
from poolpipe.planner.solvers import SOLVERS, gurobi_available
from poolpipe.sim.apps import part_profiles, simulate_apps
from poolpipe.sim.engine import SimConfig
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir
from testbed import scratch_dir, teardown_on_sigterm

console = Console()
REPO = Path(__file__).resolve().parents[1]
# Example prices per GPU-hour, as bench_planner's (on-demand list prices of one cloud, 2025).
PRICES = {"L4": 0.56, "T4": 0.35, "P4": 0.60, "V100": 2.48}
DET, CLS = "tf_efficientdet_d1", "repvgg-b3"
GATE, SEG, DET2 = (
    "googlenet-v3-pytorch",
    "fcn-d6_r101-d16_4xb2-40k_cityscapes-512x1024",
    ("atss_r101_fpn_1x_coco"),
)
TRAFFIC = {
    "name": "traffic",
    "edges": [{"from": DET, "to": CLS, "fanout": 3, "transform": "shadow"}],
}
SCENE = {
    "name": "scene",
    "edges": [
        {"from": GATE, "to": SEG},
        {"from": GATE, "to": DET2},
        {"from": SEG, "to": CLS, "transform": "shadow"},
        {"from": DET2, "to": CLS, "transform": "shadow"},
    ],
}
MIXES = {"traffic": [TRAFFIC], "traffic+scene": [TRAFFIC, SCENE]}


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profiles", type=Path, default=None, help="PPipe profiles (shipped ones)")
    ap.add_argument("--clusters", default="hc2-large,hc4-large")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--slo-scale", type=float, default=5.0, help="SLO x reference latencies (5)")
    ap.add_argument("--grid", type=int, default=10, help="budgets per model (SLO x k/grid)")
    ap.add_argument("--margin", type=float, default=0.4)
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per MILP (30)")
    ap.add_argument(
        "--solver",
        choices=SOLVERS,
        default="highs",
        help="MILP solver (highs; gurobi where gurobipy and a licence are installed: pip's "
        "gurobipy brings a size-limited one the max-min MILPs fit, not the cost MILP)",
    )
    ap.add_argument(
        "--rate-share",
        type=float,
        default=0.5,
        help="cost part: the rates to serve, as a share of what the joint split serves (0.5)",
    )
    ap.add_argument(
        "--prices",
        default=",".join(f"{g}={p}" for g, p in PRICES.items()),
        help="cost part: price per GPU-hour per type",
    )
    ap.add_argument("--loads", default="0.5,0.8,1.0", help="simulated: x the planned rates")
    ap.add_argument("--duration", type=float, default=10.0, help="simulated seconds a load")
    ap.add_argument(
        "--live",
        action="store_true",
        help="also serve --live-spec on EMULATED --live-cluster (namespaces, root) and compare "
        "its attainment live and simulated at --live-loads x its planned rate",
    )
    ap.add_argument("--live-spec", default=str(REPO / "data" / "apps-example.toml"))
    ap.add_argument("--live-cluster", default="hc2-small")
    ap.add_argument("--live-loads", default="0.33,0.67,1.0")
    ap.add_argument("--time-scale", type=float, default=10.0, help="the live part's D (10)")
    ap.add_argument(
        "--live-duration", type=float, default=10.0, help="live: seconds a load, dilated (10)"
    )
    ap.add_argument("--only-live", action="store_true", help="the live part alone")
    ap.add_argument(
        "--count-inputs",
        action="store_true",
        help="live: plan counting each part's inputs on its first server's NIC (the main "
        "job's plans do; here it moved colorization-v2's budget from 72 to 60 ms at the same "
        "objective and lost most of its parts live at the planned rate: docs/benchmarks.md)",
    )
    ap.add_argument(
        "--sim-seeds",
        type=int,
        default=5,
        help="live: the simulator's stage-time draws averaged over this many seeds (5)",
    )
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    if args.solver == "gurobi" and not (usable := gurobi_available())[0]:
        ap.error(f"--solver gurobi: {usable[1]}")
    console.print(f"MILP solver: {args.solver}")
    root = args.profiles or ppipe_dir()
    profiles = {p.name: p for p in load_ppipe_dir(root)}
    clusters = load_clusters(root / "clusters.toml")
    t = Table(
        title=f"applications planned: SLO split jointly with the pools (grid of "
        f"{args.grid} budgets per model, margin {args.margin}; started from nexus's plan) vs an "
        "equal split, a split in proportion to the models' latencies and Nexus's "
        "split-then-plan (req/s of the least served application per unit of weight)",
        title_justify="left",
    )
    for col in (
        "cluster",
        "mix",
        "SLO ms",
        "joint",
        "equal",
        "proportional",
        "nexus",
        "joint / equal",
        "joint / prop.",
        "joint / nexus",
        "joint s",
        "joint budgets ms",
    ):
        t.add_column(
            col, justify="left" if col in ("cluster", "mix", "joint budgets ms") else "right"
        )
    prices = {g: float(p) for g, _, p in (x.partition("=") for x in args.prices.split(","))}
    c = Table(
        title=f"the cheapest GPUs serving {args.rate_share:.0%} of what the joint split serves "
        "(prices per GPU-hour: " + ", ".join(f"{g} {p:g}" for g, p in prices.items()) + ")",
        title_justify="left",
    )
    for col in (
        "cluster",
        "mix",
        "rates req/s",
        "best fixed split",
        "pooled",
        "GPUs",
        "whole-model",
        "GPUs ",
        "whole / pooled",
        "pooled s",
    ):
        c.add_column(col, justify="left" if col in ("cluster", "mix", "GPUs", "GPUs ") else "right")
    if args.only_live:
        rows = BenchRows(args.label)
        live_part(args, rows)
        _store(args.warehouse, rows)
        return 0
    loads = [float(x) for x in args.loads.split(",")]
    sims = Table(
        title=f"the joint split's plan simulated ({args.duration:g} s a load, Poisson): "
        "attainment of each application (its requests on time, all parts included)",
        title_justify="left",
    )
    for col in ("cluster", "mix", "application", *(f"load {x:g}" for x in loads), "parts/req"):
        sims.add_column(
            col, justify="left" if col in ("cluster", "mix", "application") else "right"
        )
    rows = BenchRows(args.label)
    for cname, mix in itertools.product(args.clusters.split(","), args.mixes.split(",")):
        specs = []
        for spec in MIXES[mix]:
            path_ref = _slowest_path_ref(spec, profiles)
            specs.append({**spec, "slo_ms": round(args.slo_scale * path_ref / 1e3, 1)})
        apps = tuple(parse_apps({"apps": specs}, f"mix {mix}", profiles))
        req = AppPlanRequest(
            apps,
            profiles,
            clusters[cname],
            grid=args.grid,
            margin=args.margin,
            time_limit_s=args.time_limit,
            solver=args.solver,
        )
        with console.status(f"{cname}, {mix}: equal, proportional, nexus ..."):
            equal = plan_apps(req, "equal")
            prop = plan_apps(req, "proportional")
            nexus = plan_apps(req, "nexus")
        with console.status(f"{cname}, {mix}: joint (from nexus's plan) ..."):
            joint = plan_apps(req, start=nexus)
        budgets = "; ".join(
            f"{a}/{m.split('_')[0].split('-')[0]} {b / 1e3:.0f}"
            for (a, m), b in joint.budgets.items()
        )
        t.add_row(
            cname,
            mix,
            ", ".join(f"{a.slo_us / 1e3:g}" for a in apps),
            f"{joint.objective:.1f}",
            f"{equal.objective:.1f}",
            f"{prop.objective:.1f}",
            f"{nexus.objective:.1f}",
            *(
                f"{joint.objective / p.objective:.2f}" if p.objective else "-"
                for p in (equal, prop, nexus)
            ),
            f"{joint.seconds:.1f} ({joint.status}"
            + (f", gap {joint.gap:.2%})" if joint.status != "optimal" else ")"),
            budgets,
        )
        config = f"{cname}:{mix}:x{args.slo_scale:g}:grid{args.grid}"
        for metric, v in (
            ("joint", joint.objective),
            ("equal", equal.objective),
            ("proportional", prop.objective),
            ("nexus", nexus.objective),
            ("joint_seconds", joint.seconds),
            ("joint_optimal", float(joint.status == "optimal")),
            ("joint_gap", joint.gap),
        ):
            rows.record("apps", config, metric, v)
        rates = {a.name: args.rate_share * joint.rates[a.name] for a in apps}
        with console.status(f"{cname}, {mix}: the cheapest GPUs, pooled and whole-model ..."):
            try:
                pooled, fixed, whole = _cheapest(req, rates, prices)
            except SolverError as exc:
                if req.solver == "highs":
                    raise
                # (the joint cost MILP is larger than gurobipy's size-limited licence takes)
                console.print(f"{cname}, {mix}: the cost MILPs on HiGHS ({exc})")
                pooled, fixed, whole = _cheapest(replace(req, solver="highs"), rates, prices)
            best = min(fixed, key=lambda s: _cost(fixed[s]))
        assert pooled.cost_per_hour is not None and whole.cost_per_hour is not None
        c.add_row(
            cname,
            mix,
            ", ".join(f"{a} {r:.0f}" for a, r in rates.items()),
            f"{_cost(fixed[best]):.2f} ({best})",
            f"{pooled.cost_per_hour:.2f}",
            _gpus(pooled.gpus_used),
            f"{whole.cost_per_hour:.2f}",
            _gpus(whole.gpus_used),
            f"{whole.cost_per_hour / pooled.cost_per_hour:.2f}",
            f"{pooled.seconds:.1f} ({pooled.status}"
            + (f", gap {pooled.gap:.2%})" if pooled.status != "optimal" else ")"),
        )
        doc, _ = app_plan_document(req, joint)
        parts = part_profiles(doc, profiles)
        results = []
        for load in loads:
            with console.status(f"{cname}, {mix}: simulating load {load:g} ..."):
                offered = {a.name: load * joint.rates[a.name] for a in apps}
                res = simulate_apps(
                    doc, parts, apps, offered, SimConfig(duration_s=args.duration, seed=1)
                )
            results.append(res)
            for a in apps:
                rows.record(
                    "apps", f"{config}:sim", f"attainment:{a.name}:{load:g}", res.attainment(a.name)
                )
        for a in apps:
            made = sum(r.apps[a.name]["arrived"] for r in results)
            sims.add_row(
                cname,
                mix,
                a.name,
                *(f"{r.attainment(a.name):.1%}" for r in results),
                f"{sum(r.parts_made for r in results) / max(1, made):.2f}"
                if len(apps) == 1
                else "-",
            )
        for metric, v in (
            ("cost_pooled", pooled.cost_per_hour),
            *((f"cost_{k}", p.cost_per_hour) for k, p in fixed.items() if p is not None),
            ("cost_whole", whole.cost_per_hour),
            ("cost_seconds", pooled.seconds),
            ("cost_optimal", float(pooled.status == "optimal")),
        ):
            rows.record("apps", f"{config}:rates{args.rate_share:g}", metric, v)
    console.print(t)
    console.print(c)
    console.print(sims)
    if args.live:
        live_part(args, rows)
    _store(args.warehouse, rows)
    return 0


def _store(warehouse: str | None, rows: BenchRows) -> None:
    with Warehouse.open(warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench apps)")


def live_part(args: argparse.Namespace, rows: BenchRows) -> None:
    """An application spec (group-2 models) planned for an EMULATED cluster (shadow
    models, one emulated GPU node per GPU in namespaces, time scale D), served live by the
    router, and its attainment at each load beside the simulator's on the same plan.
    Figures undilated."""
    import time

    from poolpipe.client.control import new_token_file
    from poolpipe.domain.apps import load_apps
    from testbed.emulated import (
        MixLoad,
        emulated_nodes,
        group2_inputs,
        serve_dilated,
    )
    from testbed.netns import unavailable
    from testbed.predict import predict_apps

    why = unavailable()
    if why:
        console.print(f"the live part is skipped: {why}")
        return
    d = args.time_scale
    with console.status("onboarding the shadows of group 2 (flow onboard-shadow) ..."):
        warehouse, profiles, cluster = group2_inputs(args.warehouse, args.live_cluster)
    apps = load_apps(args.live_spec, known_models=profiles)
    req = AppPlanRequest(
        tuple(apps), profiles, cluster, grid=args.grid, margin=args.margin,
        time_limit_s=args.time_limit, count_inputs=args.count_inputs, solver=args.solver,
    )  # fmt: skip
    with console.status(f"planning {args.live_spec} for {cluster.name} ..."):
        joint = plan_apps(req, start=plan_apps(req, "nexus"))
    doc, _ = app_plan_document(req, joint)
    with Warehouse.open(warehouse) as wh:
        plan_id = wh.store_plan(doc, label="bench-apps:live")
    parts = part_profiles(doc, profiles)
    tmp = scratch_dir("bench-apps-live-")
    token_file = tmp / "token"
    token = new_token_file(token_file)
    fractions = [float(x) for x in args.live_loads.split(",")]
    t = Table(
        title=f"EMULATED {cluster.name} (shadow models, time scale D = {d:g}; figures "
        f"undilated): {args.live_spec}'s joint-split plan, attainment live (at the client) and "
        f"simulated, {args.live_duration:g} s (dilated) a load. simulated: on the same trace, "
        "the router's calibrated topology (inputs on the first NICs, its budgets, margin and "
        "wake guard) and the stage times the live run measured (as the main job compares "
        f"them), the mean of {args.sim_seeds} draws of them; plan alone: the plan simulated "
        "on a Poisson trace of its own, no inputs, reserved stage times",
        title_justify="left",
    )
    for col in ("application", "load", "req/s", "sent", "live", "simulated", "points apart",
                "plan alone", "live: parts dropped, by model"):  # fmt: skip
        t.add_column(
            col,
            justify="left" if col in ("application", "live: parts dropped, by model") else "right",
        )
    t0 = time.perf_counter()
    with emulated_nodes(cluster, tmp / "cluster", d, token_file) as em:
        console.print(
            f"EMULATED {cluster.name}: {len(em.nodes)} GPU nodes on {em.servers} servers, "
            f"D = {d:g}; up in {time.perf_counter() - t0:.0f} s"
        )
        server = serve_dilated(
            doc, plan_id, warehouse, tmp / "serve", d, name="emulated-apps", token=token,
            inventory=em.inventory(),
        )  # fmt: skip
        try:
            dep = server.deployment
            for k, app in enumerate(apps):
                io = dep.core.apps.ios[app.name]
                x = np.zeros((1, *io.inputs[0].dims), io.inputs[0].dtype)
                load = MixLoad(
                    dep.grpc_url, [(app.name, {io.inputs[0].name: x})], [1.0],
                    [app.slo_us * d / 1e6],
                )  # fmt: skip
                for j, frac in enumerate(fractions):
                    rate = frac * joint.rates[app.name]  # undilated req/s
                    seed = 700 + 10 * k + j
                    before = {m: c.dropped for m, c in dep.core.stats.items()}
                    dep.core.take_stage_factors()
                    dep.core.take_answer_delays()
                    topo0 = dep.core.runtime.topo  # as calibrated before this run
                    with console.status(f"{app.name}: {rate:.0f} req/s live ..."):
                        times, shots = load.send(rate / d, args.live_duration, seed)
                    factors = [list(f) for f in dep.core.take_stage_factors()]
                    delays = dep.core.take_answer_delays()
                    lost = {
                        m.split(".", 1)[1]: c.dropped - before.get(m, 0)
                        for m, c in dep.core.stats.items()
                        if m.startswith(f"{app.name}.") and c.dropped > before.get(m, 0)
                    }
                    live = load.share_on_time(shots, len(times)) if len(times) else 1.0
                    mine = np.full(len(times), dep.core.apps.index[app.name])
                    # the stage times drawn at random: the mean over sim_seeds draws
                    sim = float(np.mean([
                        predict_apps(
                            dep, times, mine, args.live_duration, factors, seed=s, topo=topo0,
                            answer_delays=delays,
                        ).attainment(app.name)
                        for s in range(1, args.sim_seeds + 1)
                    ]))  # fmt: skip
                    alone = simulate_apps(
                        doc, parts, [app], {app.name: rate},
                        SimConfig(duration_s=args.live_duration / d, seed=seed),
                    ).attainment(app.name)  # fmt: skip
                    t.add_row(
                        app.name, f"{frac:g}", f"{rate:.0f}", str(len(times)), f"{live:.1%}",
                        f"{sim:.1%}", f"{100 * (live - sim):+.1f}", f"{alone:.1%}",
                        ", ".join(f"{m} {n}" for m, n in lost.items()) or "-",
                    )  # fmt: skip
                    config = f"{cluster.name}:D{d:g}:{app.name}:{frac:g}"
                    rows.record("apps-live", config, "live_attainment", live)
                    rows.record("apps-live", config, "sim_attainment", sim)
                    rows.record("apps-live", config, "plan_sim_attainment", alone)
                    rows.record("apps-live", config, "rate", rate)
        finally:
            server.close()
    console.print(t)


def _cheapest(req, rates, prices):
    """Each fixed split's cheapest GPUs, the joint split's from the cheapest of them, and
    whole-model pipelines': (pooled, {split: plan}, whole)."""
    by_split = cheapest_by_split(req, rates, prices)
    pooled = by_split.pop(SPLITS[0])
    return pooled, by_split, cheapest_apps(req, rates, prices, whole=True)


def _cost(plan: AppPlan | None) -> float:
    return math.inf if plan is None or plan.cost_per_hour is None else plan.cost_per_hour


def _gpus(used: dict[str, int]) -> str:
    return ", ".join(f"{n} {g}" for g, n in sorted(used.items()) if n)


def _slowest_path_ref(spec: dict, profiles: dict) -> float:
    """The application's slowest path by the models' reference latencies (µs)."""
    app = parse_apps({"apps": [{**spec, "slo_ms": 1e9}]}, "mix", profiles)[0]
    ref = {m: profiles[m].reference_latency_us for m in app.models}
    return max(sum(ref[m] for m in p) for p in app.paths())


if __name__ == "__main__":
    raise SystemExit(main())
