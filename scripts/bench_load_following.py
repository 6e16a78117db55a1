"""A day, simulated: capacity that follows the load (planner/follow.py) against a static
plan sized for the peak.

The load (a synthetic diurnal trace): the models of the paper's --group at the maf19 mix on
--cluster. The total rate follows a raised cosine over the day, lowest at 04:00 (--trough of
the peak) and highest at 16:00; each model's share of it swings by +-`--swing` of its maf19
share, the three models a third of a day apart (the mix shifts: one model's morning is
another's evening):

    total(t) = peak x (trough + (1 - trough) (1 - cos(2 pi (t - 4 h) / 24 h)) / 2)
    share_k(t) ~ maf19_k x (1 + swing x sin(2 pi t / 24 h + 2 pi k / 3))

The peak is the largest share of what the cluster's max-min plan delivers at the maf19 mix,
from --peak down by 0.05, for which a static plan exists (below). Arrivals are
Poisson at these rates (thinning), --hour-s simulated seconds per hour (3600: a real day;
less compresses it: the follower's intervals are scaled alike, its rate windows are not).

The follower (planner/follow.py), the same code a router's load watch runs: the arrivals
sampled every --sample-s; the plan's envelope (above at 0.9 of what it delivers, below 0.6
for 10 minutes, the mix 0.2 away) and a look every 30 minutes ask for a plan for the rates
seen x 1.2 (the cheapest GPUs, sized on what they deliver: `poolpipe advise`); rolled out
--plan-delay-s after it was asked for (planning and loading) where the load needs it or it
saves 10% of the cost, at most once per 30 minutes. The static plan: the cheapest GPUs that
serve each model's peak rate x 1.2. Both are simulated over the same arrivals (the reservation
data plane; rollouts are the pipeline-flush migration on the virtual clock).

Prints the hours (req/s, GPUs in use, on time with each), the re-plans, and the totals
against the targets (>= 35% fewer GPU-hours, >= 99% on time in every hour and none below 98%,
<= 1 re-plan per 30 minutes, <= 0.1% of requests dropped in rollouts); stores them in the
warehouse (bench_serving, bench "load-following").

    ./run bench-load-following [--cluster hc2-small] [--group 2] [--peak 0.7]
                               [--trough 0.1] [--swing 0.5] [--hour-s 3600] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import make_plan
from poolpipe.planner.advise import advise
from poolpipe.planner.follow import FollowConfig, LoadFollower
from poolpipe.planner.request import group_request
from poolpipe.runtime.envelope import EnvelopeConfig
from poolpipe.scheduler import make_data_plane
from poolpipe.scheduler.topology import simulated_topology
from poolpipe.sim import SimConfig, Simulator
from poolpipe.sim.scenario import Rollout, Scenario
from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli.common import ppipe_dir

console = Console(width=None if sys.stdout.isatty() else 170)
HOURS = 24
TARGET_SAVING, TARGET_DAY, TARGET_HOUR, TARGET_DROPPED = 0.35, 0.99, 0.98, 0.001


def day_rates(t_h: np.ndarray, base: list[float], peak: float, trough: float, swing: float):
    """Per model its req/s at hours `t_h` (module docstring)."""
    total = peak * (trough + (1 - trough) * (1 - np.cos(2 * np.pi * (t_h - 4) / 24)) / 2)
    n = len(base)
    raw = np.array(
        [
            b * (1 + swing * np.sin(2 * np.pi * t_h / 24 + 2 * np.pi * k / n))
            for k, b in enumerate(base)
        ]
    )
    return raw / raw.sum(axis=0) * total


def arrivals(rate_fn, models: int, day_s: float, hour_s: float, seed: int):
    """Poisson arrivals at the rates of `rate_fn` (thinning): times (µs, ascending) and the
    model of each."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(0, HOURS, 24 * 60 + 1)
    top = rate_fn(grid).max(axis=1) * 1.01
    times, which = [], []
    for k in range(models):
        n = rng.poisson(top[k] * day_s)
        t = np.sort(rng.uniform(0, day_s, n))
        keep = rng.uniform(0, top[k], n) < rate_fn(t / hour_s)[k]
        times.append(t[keep] * 1e6)
        which.append(np.full(int(keep.sum()), k, dtype=np.int64))
    t_all, m_all = np.concatenate(times), np.concatenate(which)
    order = np.argsort(t_all, kind="stable")
    return t_all[order], m_all[order]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profiles", type=Path, default=ppipe_dir())
    ap.add_argument("--cluster", default="hc2-small")
    ap.add_argument("--group", type=int, default=2, help="the paper's group, from 1 (2)")
    ap.add_argument("--peak", type=float, default=0.7, help="share of the max-min plan (0.7)")
    ap.add_argument("--trough", type=float, default=0.1, help="night load / peak (0.1)")
    ap.add_argument("--swing", type=float, default=0.5, help="each model's share swings (0.5)")
    ap.add_argument("--hour-s", type=float, default=3600.0, help="simulated s per hour (3600)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="follower's sampling, s (10)")
    ap.add_argument("--plan-delay-s", type=float, default=60.0, help="ask to rollout, s (60)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warehouse", type=Path, default=None)
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    if not 0 < args.peak <= 1 or not 0 < args.trough <= 1 or not 0 <= args.swing < 1:
        ap.error("need 0 < --peak <= 1, 0 < --trough <= 1 and 0 <= --swing < 1")
    if not args.hour_s >= 60 or not 0 < args.sample_s <= args.hour_s / 6:
        ap.error("need --hour-s >= 60 and 0 < --sample-s <= hour-s / 6")
    profiles = {p.name: p for p in load_ppipe_dir(args.profiles)}
    clusters = load_clusters(args.profiles / "clusters.toml")
    if args.cluster not in clusters:
        ap.error(f"--cluster: no cluster {args.cluster!r} in {args.profiles / 'clusters.toml'}")
    wl = tomllib.loads((args.profiles / "workloads.toml").read_text())
    if not 1 <= args.group <= len(wl["groups"]):
        ap.error(f"--group: {args.group} is not a group (1..{len(wl['groups'])})")
    group, mix = wl["groups"][args.group - 1], list(wl["mixes"]["maf19"])
    cluster = clusters[args.cluster]
    scale = args.hour_s / 3600.0
    day_s = HOURS * args.hour_s
    started = time.monotonic()

    with console.status("planning the cluster's max-min plan (what it delivers) ..."):
        req = group_request(
            profiles, group, mix, cluster, "ppipe", "per-share", delivery="maximise"
        )
        maxmin = make_plan(req)
    delivered = sum(float(m.deliverable or m.throughput) for m in maxmin.models)
    config = FollowConfig(
        min_interval_s=1800 * scale,
        check_s=1800 * scale,
        envelope=EnvelopeConfig(high=0.9, low=0.6, hold_s=600 * scale),
    )
    names = list(group)
    hours_grid = np.linspace(0, HOURS, 24 * 60 + 1)

    def plan_for(rates: dict[str, float]) -> Plan | None:
        return advise(maxmin, profiles, rates, cluster, headroom=0.0).plan

    # the static plan: the cheapest GPUs serving each model's peak rate x 1.2; the peak
    # the largest share of the max-min plan (from --peak down, by 0.05) that has one
    share, static = args.peak, None
    with console.status("planning the static plan for the peak ...") as status:
        while static is None and share > 0.049:
            peaks = day_rates(hours_grid, mix, share * delivered, args.trough, args.swing)
            top = peaks.max(axis=1) * (1 + config.headroom)
            static = plan_for({n: float(p) for n, p in zip(names, top, strict=True)})
            if static is None:
                share = round(share - 0.05, 2)
                status.update(f"planning the static plan for the peak at {share:g} ...")
    if static is None:
        raise SystemExit(f"no static plan on {args.cluster} serves even 0.05 of its capacity")
    peak = share * delivered

    def rate_fn(t_h):
        return day_rates(np.atleast_1d(t_h), mix, peak, args.trough, args.swing)

    times, which = arrivals(rate_fn, len(group), day_s, args.hour_s, args.seed)
    console.print(
        f"{args.cluster}, group {args.group} ({', '.join(group)}): the max-min plan delivers "
        f"{delivered:.1f} req/s at maf19; peak {share:g} of it ({peak:.1f} req/s: the largest "
        f"from --peak {args.peak:g} down with a static plan), trough {args.trough:g} of the "
        f"peak, swing {args.swing:g}; {len(times):,} requests over {HOURS} h x "
        f"{args.hour_s:g} s",
        highlight=False,
    )

    # the follower over the day, on the arrivals: the plans and when they roll out
    follower = LoadFollower(names, config)
    at_0 = rate_fn(0.0)[:, 0] * (1 + config.headroom)
    first = plan_for({n: float(r) for n, r in zip(names, at_0, strict=True)}) or maxmin
    segments: list[tuple[float, Plan, str]] = [(0.0, first, "start")]
    follower.served(*_envelope_of(first), 0.0)
    plans_made, decisions = 2, []
    pending: tuple[float, Plan, str] | None = None
    t = 0.0
    per_model = [np.flatnonzero(which == k) for k in range(len(names))]
    sorted_times = [times[idx] for idx in per_model]
    with console.status("following the load over the day ...") as status:
        step = 0
        while t < day_s:
            t = min(day_s, (step + 1) * args.sample_s)
            step += 1
            if pending is not None and t >= pending[0]:
                at, plan, why = pending
                segments.append((at, plan, why))
                follower.served(*_envelope_of(plan), at)
                pending = None
            counts = [int(np.searchsorted(st, t * 1e6)) for st in sorted_times]
            want = follower.observe(t, counts)
            if want is None or pending is not None:
                continue
            status.update(
                f"following the load: {t / args.hour_s:.1f} h, planning ({want.kind}) ..."
            )
            # (rates the cluster cannot serve: the most it serves, the max-min plan)
            plan = plan_for(want.rates) or maxmin
            plans_made += 1
            cost, gpus = _cost(plan), plan.gpus_used()
            roll, why = follower.judge(want, cost, gpus)
            decisions.append((t, want.kind, roll, why, sum(gpus.values())))
            if roll:
                pending = (t + args.plan_delay_s * (1 if scale >= 1 else scale), plan, why)
            else:
                follower.kept(t)
    rollouts = [
        Rollout(at_s=at, topo=simulated_topology(plan, profiles), label=f"re-plan {i} ({why})")
        for i, (at, plan, why) in enumerate(segments[1:], 1)
    ]
    results = {}
    for label, topo, scenario in (
        ("follow", simulated_topology(first, profiles), Scenario(tuple(rollouts))),
        ("static", simulated_topology(static, profiles), None),
    ):
        with console.status(f"simulating the day with the {label} plan(s) ..."):
            sim = Simulator(
                topo,
                make_data_plane("reservation", topo),
                times,
                which,
                SimConfig(duration_s=day_s, seed=args.seed),
                scenario,
            )
            results[label] = sim.run()
    report(args, names, segments, static, results, decisions, plans_made, day_s, scale, started)
    return 0


def _cost(plan: Plan) -> float:
    return float(plan.meta.get("cost_per_hour", sum(plan.gpus_used().values())))


def _envelope_of(plan: Plan):
    deliverable = [float(m.deliverable or m.throughput) for m in plan.models]
    return deliverable, [m.weight for m in plan.models], _cost(plan), plan.gpus_used()


def report(args, names, segments, static, results, decisions, plans_made, day_s, scale, started):
    hour_s = args.hour_s
    # GPUs in use per hour (time-weighted) and GPU-hours
    bounds = [s[0] for s in segments] + [day_s]
    gpu_h = np.zeros(HOURS)
    for (at, plan, _), end in zip(segments, bounds[1:], strict=True):
        n = sum(plan.gpus_used().values())
        for h in range(HOURS):
            lo, hi = max(at, h * hour_s), min(end, (h + 1) * hour_s)
            if hi > lo:
                gpu_h[h] += n * (hi - lo) / hour_s
    static_n = sum(static.gpus_used().values())
    hourly = {}
    for label, r in results.items():
        arrived = np.zeros(HOURS)
        on_time = np.zeros(HOURS)
        for series in r.per_second.values():
            a = np.asarray(series["arrived"][: int(day_s)], dtype=float)
            o = np.asarray(series["on_time"][: int(day_s)], dtype=float)
            idx = (np.arange(len(a)) // hour_s).astype(int).clip(0, HOURS - 1)
            arrived += np.bincount(idx, a, HOURS)
            on_time += np.bincount(idx, o, HOURS)
        hourly[label] = (arrived, on_time)
    table = Table(title="the day, hour by hour (simulated; GPUs: time-weighted in use)")
    for col in ("hour", "req/s", "GPUs follow", "on time follow", "GPUs static", "on time static"):
        table.add_column(col, justify="right")
    for h in range(HOURS):
        a, o = hourly["follow"][0][h], hourly["follow"][1][h]
        sa, so = hourly["static"][0][h], hourly["static"][1][h]
        table.add_row(
            f"{h:02d}",
            f"{a / hour_s:.1f}",
            f"{gpu_h[h]:.1f}",
            f"{o / a if a else 1:.4f}",
            str(static_n),
            f"{so / sa if sa else 1:.4f}",
        )
    console.print(table)
    rolled = [d for d in decisions if d[2]]
    t = Table(title="plans asked for and what became of them")
    for col in ("at", "why", "rolled out", "GPUs", "reason"):
        t.add_column(col)
    for at, kind, roll, why, n in decisions:
        t.add_row(f"{at / hour_s:5.2f} h", kind, "yes" if roll else "no", str(n), why[:110])
    console.print(t)
    follow, stat = results["follow"], results["static"]
    failed = sum(int(x.get("failed", 0)) for x in follow.rollouts)
    held = sum(int(x.get("held", 0)) for x in follow.rollouts)
    rollout_at = [s[0] for s in segments[1:]]
    gaps = np.diff(rollout_at) / scale if len(rollout_at) > 1 else np.array([])
    by_hour = [o / a if a else 1.0 for a, o in zip(*hourly["follow"], strict=True)]
    s_by_hour = [o / a if a else 1.0 for a, o in zip(*hourly["static"], strict=True)]
    follow_gh, static_gh = float(gpu_h.sum()), float(static_n * HOURS)
    saving = 1 - follow_gh / static_gh
    hours_99 = sum(x >= TARGET_DAY for x in by_hour)
    rows = [
        (
            "GPU-hours",
            f"{follow_gh:.1f}",
            f"{static_gh:.1f}",
            f">= {TARGET_SAVING:.0%} fewer",
            f"{saving:.1%} fewer",
        ),
        (
            "on time, the day",
            f"{follow.attainment:.4f}",
            f"{stat.attainment:.4f}",
            f">= {TARGET_DAY}",
            "",
        ),
        (
            "hours >= 99% on time",
            f"{hours_99} of {HOURS}",
            f"{sum(x >= TARGET_DAY for x in s_by_hour)} of {HOURS}",
            f"{HOURS} of {HOURS}",
            "",
        ),
        ("lowest hour", f"{min(by_hour):.4f}", f"{min(s_by_hour):.4f}", f">= {TARGET_HOUR}", ""),
        (
            "re-plans rolled out",
            str(len(rolled)),
            "0",
            "<= 1 per 30 min",
            f"shortest gap {gaps.min() / 60:.0f} min" if gaps.size else "",
        ),
        (
            "requests failed in rollouts",
            f"{failed} ({failed / max(follow.arrived, 1):.4%})",
            "0",
            f"<= {TARGET_DROPPED:.1%}",
            f"{held} held",
        ),
        (
            "dropped (any reason)",
            str(sum(m.dropped for m in follow.models)),
            str(sum(m.dropped for m in stat.models)),
            "",
            "",
        ),
    ]
    summary = Table(title=f"follow against static (static: {static_n} GPUs all day)")
    for col in ("figure", "follow", "static", "target", ""):
        summary.add_column(col)
    for row in rows:
        summary.add_row(*row)
    console.print(summary)
    console.print(
        f"{plans_made} plans made (each the cheapest GPUs for its rates, sized on delivery); "
        f"{follow.arrived:,} requests; {time.monotonic() - started:.0f} s in all",
        highlight=False,
    )
    bench = BenchRows(args.label)
    cfg = (
        f"{args.cluster} g{args.group} peak {args.peak:g} trough {args.trough:g} swing "
        f"{args.swing:g} hour {hour_s:g}s seed {args.seed}"
    )
    for metric, value in (
        ("gpu_hours_follow", follow_gh),
        ("gpu_hours_static", static_gh),
        ("gpu_hours_saving", saving),
        ("on_time_follow", follow.attainment),
        ("on_time_static", stat.attainment),
        ("lowest_hour_follow", min(by_hour)),
        ("hours_at_99_follow", hours_99),
        ("replans_rolled_out", len(rolled)),
        ("shortest_gap_min", float(gaps.min() / 60) if gaps.size else math.nan),
        ("rollout_failed_share", failed / max(follow.arrived, 1)),
        ("requests", follow.arrived),
    ):
        bench.record("load-following", cfg, metric, float(value))
    for h in range(HOURS):
        bench.record("load-following", f"{cfg} hour {h:02d}", "gpus_follow", float(gpu_h[h]))
        bench.record("load-following", f"{cfg} hour {h:02d}", "on_time_follow", by_hour[h])
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", bench)
    console.print(f"stored {len(bench)} rows (bench_serving, bench 'load-following')")


if __name__ == "__main__":
    sys.exit(main())
