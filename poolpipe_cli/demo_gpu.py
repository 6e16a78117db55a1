"""`poolpipe demo` on emulated GPUs (the main job's default; docs/design/emulation.md).

1. Offline, on real compute: a generated ResNet-50 is split into blocks, built and profiled
   on this CPU (Prefect flow onboard-model) into the warehouse.
2. The paper's group 2 (colorization-v2, googlenet-v3-pytorch, repvgg-b3) from real L4 and
   T4 profiles shipped in data/ppipe-gpu-group2 (from the PPipe artifact): shadow models
   onboarded (flow onboard-shadow), planned for hc2-small (4 L4 + 12 T4) at the maf19 mix
   with ppipe and with whole-model serving (np).
3. hc2-small EMULATED: a network namespace per server with a tc-limited NIC, an emulated GPU
   node (tritonserver) per GPU that completes each batch at its profiled latency, all of it
   time-dilated by D (latencies and SLOs x D, NICs and rates / D).
4. ppipe served there; its capacity found live and by the simulator; np rolled out under
   load on the same nodes; np's capacity; tables and plots. Figures undilated.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.table import Table

from poolpipe.errors import PoolpipeError
from poolpipe_cli.common import counted, parse_margins, step
from poolpipe_cli.common import demo_console as console

EMULATED = "EMULATED GPUs: real processes, network and bytes; device times from the profiles"


def cmd_demo_gpu(args: argparse.Namespace) -> int:
    from flows.onboard import onboard_model
    from poolpipe.client.control import new_token_file
    from poolpipe.offline.profiler import sum_vs_whole
    from poolpipe.offline.zoo import make_model
    from poolpipe.store.warehouse import Warehouse
    from poolpipe_cli.onboard import progress_bar
    from testbed import emulated as emu
    from triton_backend.deploy.prepare import check_serves_all

    d = args.time_scale
    if d <= 0:
        raise PoolpipeError(f"--time-scale must be > 0, got {d:g}")
    if args.traces < 1:
        raise PoolpipeError(f"--traces must be >= 1, got {args.traces}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with Warehouse.open(args.warehouse) as wh:
        warehouse = str(wh.path)

    name = "demo-resnet"
    step(
        f"offline, on real compute: a generated ResNet-50 ({args.image}x{args.image}) split "
        "into blocks, built and profiled on this CPU (Prefect flow onboard-model)"
    )
    path = make_model("resnet50", out / f"{name}.onnx", width=args.width, image=args.image)
    with progress_bar(name):
        r = onboard_model(
            str(path), name, warehouse=warehouse, blocks=6, batches=[1, 2], reps=3, replace=True
        )
    console.print(
        f"  {r.split.layers} layers in {len(r.split.blocks)} blocks, each checked against the "
        f"whole model; whole model at batch 1: {sum_vs_whole(r.measurements)[1][1] / 1e3:.1f} "
        f"ms on cpu-1t; stored in {warehouse}"
    )

    step(
        f"the paper's group 2 ({', '.join(emu.GROUP2)}) from real L4 and T4 profiles shipped in "
        f"{_rel(emu.GROUP2_DIR)} (the PPipe artifact): shadow models with the real inputs and "
        "feature-map sizes (Prefect flow onboard-shadow)"
    )
    with console.status("onboarding shadows ..."):
        done = emu.onboard_shadows(warehouse)
    console.print(f"  onboarded now: {', '.join(done) or 'none (already in the warehouse)'}")

    step(
        f"planning {args.cluster} for the maf19 mix ({', '.join(f'{w:.2f}' for w in emu.MAF19)}), "
        "SLO 5x each model's reference latency: ppipe and whole-model serving (np)"
    )
    margins = parse_margins(args.search_margins)
    plans = emu.group_plans(warehouse, args.cluster, search_margins=margins)
    _plans_table(plans)
    for plan, _ in plans.values():
        check_serves_all(plan)
    cluster = plans["ppipe"][0].cluster

    token_file = out / "serve" / "control.token"
    token = new_token_file(token_file)
    weights = dict(zip(emu.GROUP2, emu.MAF19, strict=True))

    def point(plan: str, kind: str, rate: float, att: float) -> None:
        what = "live     " if kind == "live" else "simulated"
        console.print(
            f"  {plan:5} {what} {rate * d:6.1f} req/s: {att:.3f} on time", highlight=False
        )

    t0 = time.perf_counter()
    with emu.emulated_nodes(cluster, out / "cluster", d, token_file, node_per_server=True) as em:
        step(
            f"{cluster.name} EMULATED at time scale D = {d:g}: {sum(em.gpus)} GPUs on "
            f"{em.servers} servers, a node (tritonserver) per server serving its GPUs (network "
            f"namespaces on {em.subnet}, NICs {cluster.bandwidth_gbps:g} Gbit/s / D by tc); up "
            f"in {time.perf_counter() - t0:.0f} s"
        )
        res = emu.compare_plans(
            plans,
            warehouse,
            em,
            out / "serve",
            d,
            weights,
            args.duration,
            token=token,
            transport=args.transport,
            traces=args.traces,
            # warm-up traces of 0.5 s at most, a rollout of 1.5 s (undilated)
            warm_up_s=min(args.duration, 0.5 * d),
            rollout_s=min(3 * args.duration, 1.5 * d),
            guide=True,  # each live search from the simulator's figure after the warm-up
            ladder=args.compare == "loads",
            # a plan that keeps every load driven one load further (about 26 s here), so
            # that its figure is not the ladder's top where it keeps more
            beyond=1,
            # the traces of the typical one of 64 arrival patterns (typical_pattern), a
            # few seconds of the simulator before the cluster serves
            typical=emu.TYPICAL_PATTERNS,
            on_point=point,
            on_step=step,
        )
    _results(res, d, args)
    _store(res, warehouse, cluster.name, d, res["transport"])
    _plots(out, res, d, cluster.name)
    console.print(
        f"plots in {out}/ (capacity.png, rollout.png); capacities in the warehouse "
        f"(bench_serving, bench demo); {time.perf_counter() - t_start:.0f} s in all\n{EMULATED}."
    )
    return 0


# Trace length (undilated s) at which the main job's figures stopped moving between runs:
# two runs of 5-s traces (docs/benchmarks-history.md, the main job).
SETTLED_TRACE_S = 5.0


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _plans_table(plans: dict) -> None:
    from poolpipe_cli.plans import describe_pipeline

    t = Table(
        title="plans (the planner's figures; inputs counted on the NICs): fluid req/s, and "
        "what each delivers with >= 99% on time (simulated by the planner)",
        title_justify="left",
    )
    for col, just in (("plan", "left"), ("model", "left"), ("fluid req/s", "right"),
                      ("deliverable", "right"),
                      ("pipelines: blocks GPU/share×vGPUs, batch", "left")):  # fmt: skip
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for strategy, (plan, plan_id) in plans.items():
        for k, m in enumerate(plan.models):
            t.add_row(
                f"{strategy} (#{plan_id})" if k == 0 else "",
                m.name,
                f"{m.throughput:.1f}",
                "-" if m.deliverable is None else f"{m.deliverable:.1f}",
                "; ".join(f"{describe_pipeline(p)} b{p.batch}" for p in m.pipelines),
            )
        used = plan.gpus_used()
        gpus = ", ".join(f"{p.gpu} {used.get(p.gpu, 0)}/{p.count}" for p in plan.cluster.pools)
        stated = "-" if plan.deliverable is None else f"[bold]{plan.deliverable:.1f}[/]"
        t.add_row(
            "", "[bold]all (objective)[/]", f"[bold]{plan.objective:.1f}[/]", stated,
            f"GPUs used: {gpus}",
        )  # fmt: skip
    console.print(t)


def live_ratio_text(pp: dict, whole: dict, d: float) -> str:
    """ppipe's live figure over np's (np's above 0), as the main job says it: of the loads
    both were driven at (a ladder), where one plan kept all of them ("at least"), and where
    ppipe kept none (below the lowest: "less than", not 0.00x)."""
    if not pp["ladder"]:
        return f"{pp['live'] / whole['live']:.2f}x"
    lowest = min(pp["ladder"])
    if not whole["live"]:  # np below the lowest load: ppipe's figure over it, a bound
        if not pp["live"]:
            return (
                f"an unknown multiple ({lowest * d:.0f} req/s, the lowest load both were "
                "driven at, was kept >= 99% by neither)"
            )
        return (
            f"more than {pp['live'] / lowest:.2f}x (np kept 99% at none of the loads both "
            f"were driven at, the lowest {lowest * d:.0f} req/s; ppipe "
            f"{'at least ' if pp['capped'] else ''}{pp['live'] * d:.0f})"
        )
    ratio = f"{pp['live'] / whole['live']:.2f}x"
    if not pp["live"]:
        return (
            f"less than {lowest / whole['live']:.2f}x (ppipe kept 99% at none of the loads "
            f"both were driven at, the lowest {lowest * d:.0f} req/s; np "
            f"{whole['live'] * d:.0f})"
        )
    ratio = ("at least " if pp["capped"] and not whole["capped"] else "") + ratio
    both = pp["capped"] and whole["capped"]
    return (
        f"{ratio} (of the loads driven: {pp['live'] * d:.0f} against "
        f"{whole['live'] * d:.0f} req/s{', each kept every one' if both else ''})"
    )


def live_over_sim(r: dict) -> str:
    """A plan's live figure over its simulated one, as far as the two are known: a figure
    that is a bound (the plan kept every load driven or searched: "capped") makes the
    ratio one ("<=", ">="), two make it unknown. On a ladder the simulated figure is the
    one judged as live's, on the same loads and traces ("sim_ladder"): a search on a finer
    grid found loads the ladder never drove live (346 req/s beside a live 245 that lost
    279 by one request, 6b464a2)."""
    sim, sim_capped = r["sim"], r["sim_capped"]
    ladder = r.get("sim_ladder") is not None
    if ladder:
        sim, sim_capped = r["sim_ladder"], r["sim_ladder_capped"]
    if sim and ladder and r["capped"] and sim_capped:  # the same loads, all kept by both
        return "1.00 (both kept every load)"
    if not sim or (r["capped"] and sim_capped):
        return "-"
    bound = ">= " if r["capped"] else "<= " if sim_capped else ""
    return f"{bound}{r['live'] / sim:.2f}"


def sim_text(r: dict, d: float) -> str:
    """A plan's simulated figure (undilated): on a ladder, the one on the same loads and
    then the searched one."""
    searched = f"{'>= ' if r['sim_capped'] else ''}{r['sim'] * d:.0f}"
    if r.get("sim_ladder") is None:
        return searched
    return f"{'>= ' if r['sim_ladder_capped'] else ''}{r['sim_ladder'] * d:.0f} ({searched})"


def _results(res: dict, d: float, args: argparse.Namespace) -> None:
    from testbed.emulated import (
        EXTRA_TRACES,
        HOST_BUSY_SHARE,
        HOST_LATE_SHARE,
        host_above,
        judged_text,
        traces_text,
    )

    traces = traces_text(args.traces)
    ladder = res["ppipe"]["ladder"]
    if ladder:
        _side_by_side(res, d, f"{traces} of {args.duration / d:g} s a load")
        how = (
            "live: the highest of those loads kept >= 99% on time, judged together (a share "
            "on time does not rise with the load: loads above whose share rose are pooled with "
            "the one below; a plan that kept every one driven a load further); "
            "a load that failed by a request or two (it would keep 99% were one trace more "
            "all on time) driven one trace more; simulated: the same loads judged the same "
            f"way on the same traces, and (in brackets) searched on them, rates "
            f"{res['ppipe']['step'] * d:.1f} req/s apart"
        )
    else:
        how = (
            f">= 99% on time over {traces} of {args.duration / d:g} s a rate "
            f"({args.traces + EXTRA_TRACES} where "
            f"{'it fails' if args.traces == 1 else 'they fail'} narrowly), "
            f"rates {res['ppipe']['step'] * d:.1f} req/s apart"
        )
    t = Table(
        title=f"capacity on the same EMULATED nodes: {how} "
        f"(D = {d:g}, transport {res['transport']}; figures undilated)",
        title_justify="left",
    )
    for col in ("plan", "planned (fluid) req/s", "deliverable (stated)", "simulated req/s",
                "live req/s", "live / simulated", "on time at live (95% interval, requests)",
                "above it: stages late on the host, host CPU"):  # fmt: skip
        t.add_column(col, justify="right")
    for strategy in ("ppipe", "np"):
        r = res[strategy]
        t.add_row(
            strategy,
            f"{r['planned']:.1f}",
            "-" if r.get("deliverable") is None else f"{r['deliverable']:.1f}",
            sim_text(r, d),
            f"{'>= ' if r['capped'] else ''}{r['live'] * d:.0f}",
            live_over_sim(r),
            judged_text(r),
            host_above(r),
        )
    console.print(t)
    for strategy in ("ppipe", "np"):
        r = res[strategy]
        if r["host_bound"]:
            console.print(
                f"[bold]{strategy}'s live figure is this host's limit, not the plan's[/]: at "
                f"{r['above'] * d:.0f} req/s, the rate above it, "
                f"{r['host_late_above'] or 0:.1%} of the emulated stages ended late on the "
                f"host (the nodes' count; the bound is {HOST_LATE_SHARE:.0%}) and "
                f"{r['host_cpu_above']:.0%} of its CPU time was busy (the bound is "
                f"{HOST_BUSY_SHARE:.0%}): run it on a quieter host or at a larger --time-scale"
            )
    pp, whole = res["ppipe"], res["np"]
    if whole["live"] or whole["ladder"]:
        sim = f"{pp['sim'] / whole['sim']:.2f}x" if whole["sim"] else "-"
        if whole.get("sim_ladder"):  # on the same loads, as live's; then the searched one
            bound = (
                "at least " if pp["sim_ladder_capped"] and not whole["sim_ladder_capped"] else ""
            )
            on_loads = pp["sim_ladder"] / whole["sim_ladder"]
            sim = f"{bound}{on_loads:.2f}x on those loads, {sim} searched"
        stated = (
            f"{pp['deliverable'] / whole['deliverable']:.2f}x"
            if pp.get("deliverable") and whole.get("deliverable")
            else "-"
        )
        ratio = live_ratio_text(pp, whole, d)
        limited = [s for s in ("ppipe", "np") if res[s]["host_bound"]]
        # a figure the host set is not the plan's: the ratio says so before it is read
        host = (
            f"On this host ({' and '.join(limited)}'s figure its limit, above): " if limited else ""
        )
        console.print(
            f"{host}ppipe serves [bold]{ratio}[/] the load of whole-model "
            f"serving live (simulator {sim}; the planner states {stated} of what they deliver, "
            f"{pp['planned'] / whole['planned']:.2f}x of their fluid figures). Both plans count "
            "each request's "
            "inputs on its first server's NIC (googlenet-v3's are 4.3 MB; the paper's "
            "transfer model leaves them out, and its plans overload the L4 server's NIC: "
            "`poolpipe compare` with and without --count-inputs). The simulator times the "
            "same inputs, and answers each batch as much later than reserved as the live "
            "runs' were beyond their stages' own time (inputs and maps late on their links, "
            "the answers on their way back: colorization-v2's are 2 MB), not reserving the "
            "answers on their server's uplink (docs/serving.md)."
        )
    if ladder and args.duration / d < SETTLED_TRACE_S:
        fewest = min(res["ppipe"]["requests"]["live"].values())
        console.print(
            f"One trace of {args.duration / d:g} s a load ({fewest} requests at the lowest): "
            "near 99% a request or two decide a load (the intervals above), and the figures "
            f"move by a load between runs. --duration {SETTLED_TRACE_S * d:g} ("
            f"{SETTLED_TRACE_S:g}-s traces, {SETTLED_TRACE_S * d / args.duration:.0f}x the "
            "requests; the job takes about three times as long) settles them "
            "(docs/benchmarks-history.md, the main job)."
        )
    roll = res["rollout"]
    att = roll["attainment"]
    console.print(
        f"rollout ppipe -> np under {roll['rate'] * d:.0f} req/s: {roll['status']}; "
        f"prepared in {roll['prepare_s']:.1f} s wall clock while ppipe served, switch "
        f"{roll['downtime_ms']:.1f} ms wall clock, {counted(roll['held'], 'request')} held, "
        f"{roll['failed']} failed, {roll['unanswered']} of {roll['sent']} unanswered; on time "
        f"before {att['before']:.3f}, while preparing {att['preparing']:.3f}, after "
        f"{att['after']:.3f}",
        highlight=False,
    )


def _side_by_side(res: dict, d: float, traces: str) -> None:
    """Both plans' share on time at the same offered loads, live and simulated."""
    from testbed.emulated import wilson

    typ = f", seed {res['pattern']['seed']}" if "pattern" in res else ""
    t = Table(
        title=f"on time at the same offered loads on the same EMULATED nodes ({traces}, the "
        f"same pattern scaled{typ}; live with its 95% interval and requests, simulated on the same "
        f"traces; D = {d:g}, figures undilated; -: not driven)",
        title_justify="left",
    )
    t.add_column("offered req/s", justify="right")
    for strategy in ("ppipe", "np"):
        t.add_column(f"{strategy} live", justify="right")
        t.add_column(f"{strategy} simulated", justify="right")
    for rate in sorted({*res["ppipe"]["ladder"], *res["np"]["ladder"]}):
        row = [f"{rate * d:.0f}"]
        for strategy in ("ppipe", "np"):
            r = res[strategy]
            live, n = r["points"]["live"].get(rate), r["requests"]["live"].get(rate, 0)
            sim = r["points"]["sim"].get(rate)
            if live is None:
                row.append("-")
            else:
                lo, hi = wilson(live, n)
                row.append(f"{live:.3f} ({lo:.3f}-{hi:.3f}, {n})")
            row.append("-" if sim is None else f"{sim:.3f}")
        t.add_row(*row)
    console.print(t)


def _store(res: dict, warehouse: str, cluster: str, d: float, transport: str) -> None:
    from poolpipe.store.bench_rows import BenchRows
    from poolpipe.store.warehouse import Warehouse

    rows = BenchRows("demo")
    for strategy in ("ppipe", "np"):
        r = res[strategy]
        config = f"{cluster}/{strategy}/D{d:g}/{transport}/emulated"
        for metric, value in (
            ("capacity_live_req_s", r["live"] * d),
            ("capacity_sim_req_s", r["sim"] * d),
            (
                "capacity_sim_ladder_req_s",
                None if r.get("sim_ladder") is None else r["sim_ladder"] * d,
            ),
            ("planned_req_s", r["planned"]),
            ("deliverable_req_s", r.get("deliverable")),
            ("live_requests_judged", r["live_requests"]),
            ("live_on_time_low95", r["live_interval"][0]),
            ("host_late_share_above", r["host_late_above"]),
            ("host_cpu_busy_above", r["host_cpu_above"]),
            ("host_bound", float(r["host_bound"])),
        ):
            if value is not None:
                rows.record("demo", config, metric, value)
        if "pattern" in res:  # the arrival pattern's seed (typical_pattern)
            rows.record("demo", config, "pattern_seed", res["pattern"]["seed"])
        for rate in r["ladder"]:  # the loads both plans were driven at
            at = f"{config}/load{rate * d:.0f}"
            rows.record("demo", at, "on_time_live", r["points"]["live"][rate])
            rows.record("demo", at, "requests_live", r["requests"]["live"][rate])
            rows.record("demo", at, "on_time_sim", r["points"]["sim"][rate])
    with Warehouse.open(warehouse) as wh:
        wh.store_rows("bench_serving", rows)


def _plots(out: Path, res: dict, d: float, cluster: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for strategy, color in (("ppipe", "tab:blue"), ("np", "tab:orange")):
        for kind, style in (("live", "o-"), ("sim", "s:")):
            pts = sorted(res[strategy]["points"][kind].items())
            ax.plot(
                [r * d for r, _ in pts],
                [a for _, a in pts],
                style,
                color=color,
                label=f"{strategy} {'live' if kind == 'live' else 'simulator'}",
            )
        ax.axvline(res[strategy]["planned"], color=color, lw=0.8, ls="--")
    ax.axhline(0.99, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("offered load (req/s, Poisson, maf19 mix; dashed: planned)")
    ax.set_ylabel("share on time (over a rate's traces)")
    ax.set_title(f"group 2 on {cluster}, EMULATED GPUs (D = {d:g})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)

    roll = res["rollout"]
    fig, ax = plt.subplots(figsize=(6, 3))
    t = [a / d for a, _ in roll["timeline"]]
    ax.step(t, [s for _, s in roll["timeline"]], where="post", label="share on time")
    ax.axvline(roll["start_s"] / d, color="grey", ls="--", lw=0.8, label="rollout starts")
    ax.axvline(
        (roll["start_s"] + roll["prepare_s"]) / d, color="k", ls="--", lw=0.8, label="switch"
    )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds (undilated)")
    ax.set_title(
        f"ppipe -> np under {roll['rate'] * d:.0f} req/s, EMULATED GPUs (D = {d:g})", fontsize=9
    )
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rollout.png", dpi=120)
    plt.close(fig)
