"""`poolpipe simulate` and `poolpipe capacity`: run plans through the discrete-event simulator."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rich.progress import Progress, TaskID
from rich.table import Table

from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import CHECK_PLANES, DATA_PLANES, Topology
from poolpipe.scheduler.topology import filled, simulated_topology
from poolpipe.sim import ArrivalSpec, SimConfig, SimResult, load_scenario, run_once
from poolpipe.sim.capacity import SEARCHES, CapacityResult, search_capacity
from poolpipe.sim.explain import explain
from poolpipe.sim.records import capacity_rows, sim_rows
from poolpipe.store.plan_inputs import check_plan
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import console, counted


def _read_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise PoolpipeError(f"plan file {path} does not exist; write one with poolpipe plan --out")
    return Plan.load(p)


def _lay_out(
    plans: list[Plan], warehouse: str | None, where: list[str], fill: bool = False
) -> list[Topology]:
    """The plans' topologies as the simulator runs them (each checked against the profiles
    first, named by `where`; a plan's counted inputs on its NICs: simulated_topology),
    with the profiles read in one short warehouse session (the warehouse is not held while
    the simulator computes). `fill`: every short batch filled with dummy requests
    (topology.filled)."""
    names = sorted({m.name for plan in plans for m in plan.models})
    with Warehouse.open(warehouse) as wh:
        profiles = {name: wh.load_profile(name) for name in names}
        for plan, name in zip(plans, where, strict=True):
            check_plan(wh, plan, name)
    topos = [simulated_topology(plan, profiles) for plan in plans]
    return [filled(t) for t in topos] if fill else topos


def _store(warehouse: str | None, table: str, rows: list[dict]) -> None:
    with Warehouse.open(warehouse) as wh:
        wh.store_rows(table, rows)


def _reference_rates(args: argparse.Namespace, plan: Plan) -> list[float] | None:
    if not getattr(args, "rates_from", None):
        return None
    ref = Plan.load(Path(args.rates_from))
    return _match_rates(ref, plan, args.rates_from)


def _match_rates(ref: Plan, plan: Plan, where: str) -> list[float]:
    names = [m.name for m in plan.models]
    if sorted(names) != sorted(m.name for m in ref.models):
        raise PoolpipeError(
            f"{where} plans {[m.name for m in ref.models]} but the plan to run has {names}; "
            "rates can only come from a plan of the same models"
        )
    return [ref.model(n).throughput for n in names]


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise PoolpipeError(f"--seeds takes integers separated by commas, got {text!r}") from None
    if not seeds:
        raise PoolpipeError("--seeds is empty")
    return seeds


def print_sim(result: SimResult, title: str) -> None:
    t = Table(title=title, title_justify="left")
    for col in (
        "model",
        "req/s",
        "arrived",
        "on time",
        "late",
        "dropped",
        "attainment",
        "p50 ms",
        "p99 ms",
    ):
        t.add_column(col, justify="left" if col == "model" else "right")
    for m in result.models:
        t.add_row(
            m.name,
            f"{m.rate_per_s:,.1f}",
            f"{m.arrived:,}",
            f"{m.on_time:,}",
            f"{m.late:,}",
            f"{m.dropped:,}",
            f"{m.attainment:.4f}",
            f"{m.latency_p50_us / 1e3:.2f}",
            f"{m.latency_p99_us / 1e3:.2f}",
        )
    console.print(t)
    util = ", ".join(f"{g} {u:.1%}" for g, u in result.utilization.items())
    console.print(
        f"GPU utilization {util}  |  {result.batches:,} batches, {result.probes_per_batch:.2f} "
        f"probes and {result.sched_us_per_batch_median:.1f} µs scheduling per batch (median)  "
        f"|  transfer wait {result.transfer_wait_us_mean:.0f} µs  |  "
        f"{result.requests_per_wall_s:,.0f} simulated req per wall s"
    )
    if result.drop_reasons:
        console.print(
            "drops: " + ", ".join(f"{n:,} {why}" for why, n in result.drop_reasons.items())
        )


def cmd_simulate(args: argparse.Namespace) -> int:
    spec = ArrivalSpec.parse(args.arrivals)
    plan = _read_plan(args.plan)
    (topo,) = _lay_out([plan], args.warehouse, [args.plan], args.dummy_fill)
    rates = _reference_rates(args, plan)
    scenario = None
    if args.scenario:
        scenario = load_scenario(
            args.scenario,
            gpu_counts=dict(topo.gpu_counts),
            models=[m.name for m in topo.models],
            load_plan=lambda path: _lay_out(
                [_read_plan(path)], args.warehouse, [str(path)], args.dummy_fill
            )[0],
        )
    config = SimConfig(duration_s=args.duration, seed=args.seed, jitter=args.jitter)
    with console.status("simulating ..."):
        result = run_once(
            topo, spec, args.load_factor, config, args.data_plane, rates, scenario=scenario
        )
    _store(
        args.warehouse,
        "sim_runs",
        sim_rows(
            result,
            label=args.label or ("cli:" + Path(args.scenario).name if args.scenario else "cli"),
            config=str(args.plan),
            strategy=plan.strategy,
            cluster=plan.cluster.name,
            arrivals=spec.describe(),
            load_factor=args.load_factor,
            seed=args.seed,
            jitter=args.jitter,
        ),
    )
    if args.plot:
        plot_timeline(result, Path(args.plot), title=f"{plan.strategy} on {plan.cluster.name}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print_sim(
        result,
        f"{plan.strategy} plan on {plan.cluster.name}, {result.data_plane} data plane, "
        f"{spec.describe()} arrivals at load factor {args.load_factor:g}, {args.duration:g} s",
    )
    if scenario is not None:
        print_timeline(result)
    if args.plot:
        console.print(f"per-second plot written to {args.plot}")
    return 0


def _seconds(result: SimResult) -> list[dict[str, int]]:
    """All models together, per second of simulated time (by arrival)."""
    series = list(result.per_second.values())
    n = len(series[0]["arrived"]) if series else 0
    return [{k: sum(s[k][i] for s in series) for k in series[0]} for i in range(n)]


def print_timeline(result: SimResult) -> None:
    """The scenario's events, rollouts and the per-second outcomes around them."""
    for e in result.events:
        what = e.get("plan") or ", ".join(e.get("nodes", [])) or "no GPU of that type left"
        console.print(f"  {e['at_s']:7.2f} s  {e['kind']:<9} {what}")
    for r in result.rollouts:
        console.print(
            f"  rollout to {r['plan']} at {r['at_s']:.2f} s: downtime {r['downtime_ms']:.2f} ms "
            f"(simulated), {counted(r['held'], 'request')} held, {r['failed']} failed"
        )
    t = Table(title="per second of simulated time (by arrival, all models)", title_justify="left")
    for col in ("second", "arrived", "on time", "late", "dropped", "failed", "attainment"):
        t.add_column(col, justify="right")
    marks = {int(e["at_s"]) for e in result.events}
    for i, row in enumerate(_seconds(result)):
        if not row["arrived"]:
            continue
        t.add_row(
            f"{i}{' *' if i in marks else ''}",
            *(f"{row[k]:,}" for k in ("arrived", "on_time", "late", "dropped", "failed")),
            f"{row['on_time'] / row['arrived']:.3f}",
        )
    console.print(t)


def plot_timeline(result: SimResult, path: Path, title: str) -> None:
    """Per-second attainment per model, with the scenario's events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, s in result.per_second.items():
        att = [
            o / a if a else float("nan") for o, a in zip(s["on_time"], s["arrived"], strict=True)
        ]
        ax.plot(range(len(att)), att, label=name, linewidth=1.2)
    for e in result.events:
        ax.axvline(e["at_s"], color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(e["kind"], (e["at_s"], 0.02), rotation=90, fontsize=7, color="grey")
    ax.set_xlabel("simulated second (by arrival)")
    ax.set_ylabel("on time / arrived")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_capacity(args: argparse.Namespace) -> int:
    spec = ArrivalSpec.parse(args.arrivals)
    seeds = _seeds(args.seeds)
    paths = [args.plan] + [p.strip() for p in (args.baseline_plans or "").split(",") if p.strip()]
    plans = [_read_plan(path) for path in paths]
    topos = _lay_out(plans, args.warehouse, [str(p) for p in paths], args.dummy_fill)
    plan = plans[0]
    # every plan runs at the reference plan's absolute rates, in its own model order
    runs = [
        (path, p, topo, _match_rates(plan, p, path))
        for path, p, topo in zip(paths, plans, topos, strict=True)
    ]
    results: list[tuple[str, Plan, CapacityResult]] = []
    with Progress(console=console, transient=True) as progress:
        for path, p, topo, rates in runs:
            task = progress.add_task(f"{p.strategy}: searching", total=None)

            def point(lf: float, att: dict[str, float], task: TaskID = task, p: Plan = p) -> None:
                worst = min(att.values())
                progress.update(
                    task, description=f"{p.strategy}: load {lf:.2f} → worst {worst:.4f}"
                )

            cap = search_capacity(
                topo,
                spec,
                duration_s=args.duration,
                seeds=seeds,
                data_plane=args.data_plane,
                reference_rates=rates,
                method=args.search,
                step=args.step,
                jitter=args.jitter,
                on_point=point,
            )
            progress.remove_task(task)
            results.append((path, p, cap))
    _store(
        args.warehouse,
        "capacity_results",
        [
            row
            for path, p, cap in results
            for row in capacity_rows(
                cap,
                label=args.label or "cli",
                config=path,
                strategy=p.strategy,
                cluster=p.cluster.name,
                data_plane=args.data_plane,
                arrivals=spec.describe(),
                search=args.search,
                seeds=seeds,
                duration_s=args.duration,
            )
        ],
    )
    if args.json:
        doc = {
            "reference_plan": args.plan,
            "data_plane": args.data_plane,
            "arrivals": spec.describe(),
            "search": args.search,
            "seeds": seeds,
            "duration_s": args.duration,
            "plans": [
                {
                    "plan": path,
                    "strategy": p.strategy,
                    "simulations": cap.simulations,
                    "models": {
                        name: {
                            "capacity": cap.capacity[name],
                            "attainment": cap.points(name),
                        }
                        for name in cap.models
                    },
                }
                for path, p, cap in results
            ],
        }
        if args.explain:
            ex = explain(topos[0], _explained_rates(results[0][1], results[0][2], runs[0][3]),
                         duration_s=args.duration, seed=seeds[0])  # fmt: skip
            doc["explain"] = {
                "models": [asdict(m) for m in ex.models],
                "pools": [asdict(p) for p in ex.pools],
                "links": [asdict(x) for x in ex.links],
            }
        print(json.dumps(doc, indent=2))
        return 0
    table = Table(
        title=f"capacity (largest load factor with ≥ 99% on time; late = miss) on "
        f"{plan.cluster.name}, {args.data_plane} data plane, {spec.describe()}, "
        f"seeds {args.seeds}, {args.duration:g} s",
        title_justify="left",
    )
    table.add_column("model")
    for _, p, _ in results:
        table.add_column(p.strategy, justify="right")
    for name in results[0][2].models:
        table.add_row(name, *[f"{cap.capacity[name]:.2f}" for _, _, cap in results])
    table.add_section()
    table.add_row(
        "mean",
        *[f"{sum(c.capacity.values()) / len(c.capacity):.3f}" for _, _, c in results],
    )
    console.print(table)
    if args.explain:
        _, p, cap = results[0]
        rates = _explained_rates(p, cap, runs[0][3])
        print_explanation(p, topos[0], rates, args.duration, seeds[0])
    return 0


# a model that keeps no load at all is explained at this share of its planned rate
EXPLAIN_FLOOR = 0.05


def _explained_rates(plan: Plan, cap: CapacityResult, reference: list[float]) -> list[float]:
    """Each model at its capacity (of the reference rates); one that keeps none at a small
    share of its planned rate."""
    return [
        cap.capacity[m.name] * r if cap.capacity[m.name] > 0 else EXPLAIN_FLOOR * m.throughput
        for m, r in zip(plan.models, reference, strict=True)
    ]


def print_explanation(
    plan: Plan, topo: Topology, rates: list[float], duration_s: float, seed: int
) -> None:
    """Where the plan's requests wait at its deliverable load (sim/explain.py): per model,
    its drops and what limits it; per pool, how busy and how long batches waited; the
    busiest links."""
    with console.status("simulating at the deliverable load ..."):
        ex = explain(topo, rates, duration_s=duration_s, seed=seed)
    t = Table(
        title=f"{plan.strategy} on {plan.cluster.name} at each model's deliverable load "
        f"(Poisson, seed {seed}, {duration_s:g} s): what limits it",
        title_justify="left",
    )
    for col in ("model", "req/s", "on time", "dropped / late", "queued p50/p99 ms", "limited by"):
        t.add_column(col, justify="left" if col in ("model", "limited by") else "right")
    for m in ex.models:
        lost = ", ".join(f"{n:,} {why}" for why, n in sorted(m.drops.items())) or "none"
        t.add_row(
            m.name,
            f"{m.rate:,.1f}",
            f"{m.on_time:.4f}",
            lost,
            f"{m.queue_p50_us / 1e3:.2f} / {m.queue_p99_us / 1e3:.2f}",
            f"{m.limit}: {m.why}",
        )
    console.print(t)
    t = Table(title="pools", title_justify="left")
    for col in ("model", "pipeline", "blocks", "GPU", "vGPUs", "busy", "batches", "mean batch",
                "wait p50 ms", "wait p99 ms"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("model", "GPU") else "right")
    for p in ex.pools:
        t.add_row(
            p.model,
            str(p.pipeline),
            f"[{p.blocks[0]},{p.blocks[1]})",
            p.gpu if p.share == 1 else f"{p.gpu}/{p.share}",
            str(p.vgpus),
            f"{p.utilisation:.0%}",
            f"{p.batches:,}",
            f"{p.mean_batch:.2f}",
            f"{p.wait_p50_us / 1e3:.2f}",
            f"{p.wait_p99_us / 1e3:.2f}",
        )
    console.print(t)
    busiest = sorted(ex.links, key=lambda x: -x.utilisation)[:LINKS_SHOWN]
    if busiest:
        console.print(
            "busiest links: "
            + "; ".join(
                f"{x.direction}link of server {x.server} ({x.gpu}) {x.utilisation:.0%} busy, "
                f"waits p99 {x.wait_p99_us / 1e3:.2f} ms"
                for x in busiest
            ),
            highlight=False,
        )


LINKS_SHOWN = 4


def add_commands(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--arrivals",
        default="poisson",
        help="poisson | gamma:CV | an Azure Functions 2021 trace (csv) | a file of arrival "
        "times in µs, one per line (optionally followed by a model name)",
    )
    common.add_argument("--duration", type=float, default=30.0, help="simulated seconds (30)")
    common.add_argument(
        "--data-plane",
        choices=DATA_PLANES + CHECK_PLANES,
        default="reservation",
        help="reservation (default); reactive, eager, deferred: baselines; reference: the "
        "reservation plane's specification (slower); checked: both, stopping at the first "
        "decision where they differ",
    )
    common.add_argument(
        "--jitter", type=float, default=0.0, help="execution-time CV (0: as profiled)"
    )
    common.add_argument(
        "--dummy-fill",
        action="store_true",
        help="fill every batch below its pipeline's planned batch with dummy requests "
        "(Piccolo): it runs as long as the planned batch (scripts/bench_dummy_fill.py "
        "measures what it does)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("--label", help="label stored with the results")

    sim = sub.add_parser("simulate", parents=[common], help="simulate a plan at one load factor")
    sim.add_argument("--plan", required=True, help="plan JSON (poolpipe plan --out)")
    sim.add_argument("--load-factor", type=float, default=0.9, help="x the plan's req/s (0.9)")
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument(
        "--rates-from", help="plan whose throughput is load factor 1.0 (default: --plan)"
    )
    sim.add_argument(
        "--scenario",
        help="TOML file of timed events: gpu_down / gpu_up (gpu, count) and rollout (plan); "
        "adds per-second outcomes and rollout downtimes",
    )
    sim.add_argument("--plot", help="write per-second attainment to this PNG")
    sim.set_defaults(func=cmd_simulate)

    cap = sub.add_parser(
        "capacity",
        parents=[common],
        help="largest load factor with >= 99%% attainment, per model",
    )
    cap.add_argument("--plan", required=True, help="the ppipe plan: its req/s are load 1.0")
    cap.add_argument(
        "--baseline-plans", help="comma-separated plans run at the same absolute rates"
    )
    cap.add_argument("--seeds", default="1", help="comma-separated seeds, pooled (1)")
    cap.add_argument(
        "--search",
        choices=SEARCHES,
        default="step",
        help="step: down from 1.0 (the paper's); bisect: fewer simulations",
    )
    cap.add_argument("--step", type=float, default=0.05, help="load-factor grid (0.05)")
    cap.add_argument(
        "--explain",
        action="store_true",
        help="then simulate the plan once at each model's capacity and say where its "
        "requests wait: per model its drops and the pool or link that limits it, per pool "
        "how busy and how long batches wait for a vGPU, the busiest links",
    )
    cap.set_defaults(func=cmd_capacity)
