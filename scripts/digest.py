"""Digests of simulator results and of plans, every field but time, on fixed sets of
runs: the check that a refactoring of the runtime, the data planes, the simulator or the
planner left every decision as it was.

    .venv/bin/python scripts/digest.py sim --save before.json       # on the code before
    .venv/bin/python scripts/digest.py sim --compare before.json    # on the code after
    .venv/bin/python scripts/digest.py plan --save before.json      # likewise for plans

`sim`: the six groups of the paper on hc2-large (ppipe plans, maf19 mix), each under the
four data planes with and without execution jitter (48 runs), and each group's plan through
a scenario (5 T4s down and back, then a rollout to its np plan): 54 runs, about a minute.

`plan`: the paper's 24 main configurations (six groups on the four large clusters, maf19,
P = 2) with ppipe in both packings and np and dart-r per-position; the six groups on a
four-type cluster (4t-few-new, per-share: proven by the surrogate knapsack); the 18 single
models at P = 3; and the cheapest ppipe plan serving half of each main per-position plan's
rates on hc2-large: 126 plans, about a minute. A plan that hit a time limit depends on the
machine's speed, not only on the code: those are listed and left out of the comparison. So
may the way a plan was proven where a step's own time limit (the group MILP's 2 s before
the decomposition) is close: the same plan proven another way is shown apart, and does not
fail the check.

`--compare` prints each run that differs with its first differing fields and exits 1 if
any does; `--quick` takes fewer runs. `sim --checked` runs every reservation-plane run (12,
and the 6 scenarios) with the checked plane (poolpipe/scheduler/checked.py): the fast plane
and its specification side by side, stopping at the first decision where they differ; what
it records is the fast plane's, so its digest compares equal to one saved without.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from poolpipe.domain.cluster import Cluster, GpuPool, load_clusters
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.planner.request import group_request
from poolpipe.scheduler import DATA_PLANES, PlaneDifference, build_topology
from poolpipe.sim import ArrivalSpec, SimConfig, load_scenario, run_once
from poolpipe_cli.common import ppipe_dir

# What wall-clock time decides: left out of the digests.
SIM_WALL_FIELDS = {
    "wall_s",
    "requests_per_wall_s",
    "sched_us_per_batch_median",
    "sched_us_per_batch_mean",
}
# What measures the data plane's work, not its decisions: kept, compared apart (a change
# that prunes probes exactly leaves every decision as it was and lowers these).
SIM_WORK_FIELDS = ("probes_per_batch",)
PLAN_TIME_FIELDS = {"seconds", "milp_seconds", "wall_s", "solve_s", "created_at", "created"}
LOAD_FACTOR = 0.9
JITTERS = (0.0, 0.2)
FOUR_TYPES = {"L4": 5, "V100": 5, "T4": 40, "P4": 50}
GPUS_PER_SERVER = {"L4": 4, "V100": 4, "T4": 2, "P4": 1}

console = Console()


def _clean(x: Any, drop: set[str]) -> Any:
    """JSON-comparable: NaN as the string "nan", floats to 9 places, `drop` fields left out."""
    if isinstance(x, dict):
        return {k: _clean(v, drop) for k, v in sorted(x.items()) if k not in drop}
    if isinstance(x, list | tuple):
        return [_clean(v, drop) for v in x]
    if isinstance(x, float):
        return "nan" if math.isnan(x) else round(x, 9)
    return x


# ---------------------------------------------------------------------------- simulator


def sim_digest(quick: bool, checked: bool = False) -> dict[str, Any]:
    profiles_dir = ppipe_dir()
    profiles = {p.name: p for p in load_ppipe_dir(profiles_dir)}
    cluster = load_clusters(profiles_dir / "clusters.toml")["hc2-large"]
    workloads = tomllib.loads((profiles_dir / "workloads.toml").read_text())
    groups = workloads["groups"][:2] if quick else workloads["groups"]
    duration = 5.0 if quick else 10.0
    out: dict[str, Any] = {}
    with Progress(console=console, transient=True) as bar, tempfile.TemporaryDirectory() as tmp:
        task = bar.add_task("simulating", total=len(groups) * (len(DATA_PLANES) * 2 + 1))
        for gi, group in enumerate(groups):
            mix = workloads["mixes"]["maf19"]
            plans = {
                s: make_plan(group_request(profiles, group, mix, cluster, s))
                for s in ("ppipe", "np")
            }
            topo = build_topology(plans["ppipe"], profiles, larger_batches=True)
            for plane in DATA_PLANES:
                for jitter in JITTERS:
                    res = run_once(
                        topo,
                        ArrivalSpec("poisson"),
                        LOAD_FACTOR,
                        SimConfig(duration, seed=1, jitter=jitter),
                        "checked" if checked and plane == "reservation" else plane,
                    )
                    # (a checked run recorded under the plane it checks: the same decisions)
                    got = res.to_dict() | {"data_plane": plane}
                    out[f"g{gi}/{plane}/jitter{jitter:g}"] = _clean(got, SIM_WALL_FIELDS)
                    bar.advance(task)
            np_file = Path(tmp) / f"g{gi}-np.json"
            np_file.write_text(plans["np"].to_json())
            scenario_file = Path(tmp) / f"g{gi}-scenario.toml"
            scenario_file.write_text(
                f'[[events]]\nat_s = {duration * 0.2:g}\nkind = "gpu_down"\ngpu = "T4"\n'
                f'count = 5\n[[events]]\nat_s = {duration * 0.4:g}\nkind = "gpu_up"\n'
                f'gpu = "T4"\ncount = 5\n[[events]]\nat_s = {duration * 0.6:g}\n'
                f'kind = "rollout"\nplan = "{np_file.name}"\n'
            )

            def lay_out(path: Path) -> Any:
                return build_topology(Plan.load(path), profiles, True)

            scenario = load_scenario(
                scenario_file,
                gpu_counts=dict(topo.gpu_counts),
                models=[m.name for m in topo.models],
                load_plan=lay_out,
            )
            res = run_once(
                topo,
                ArrivalSpec("poisson"),
                LOAD_FACTOR,
                SimConfig(duration, seed=1, jitter=0.1),
                "checked" if checked else "reservation",
                scenario=scenario,
            )
            got = res.to_dict() | {"data_plane": "reservation"}
            out[f"g{gi}/scenario"] = _clean(got, SIM_WALL_FIELDS)
            bar.advance(task)
    return out


# ---------------------------------------------------------------------------- planner


def plan_requests(quick: bool) -> list[tuple[str, PlanRequest]]:
    root = ppipe_dir()
    profiles = {p.name: p for p in load_ppipe_dir(root)}
    clusters = load_clusters(root / "clusters.toml")
    workloads = tomllib.loads((root / "workloads.toml").read_text())
    mix = tuple(workloads["mixes"]["maf19"])
    groups = workloads["groups"][:2] if quick else workloads["groups"]
    names = ("hc2-large",) if quick else ("hc1-large", "hc2-large", "hc3-large", "hc4-large")
    four = Cluster(
        "4t-few-new",
        10.0,
        tuple(
            GpuPool(g, n, GPUS_PER_SERVER[g], (1,) if g == "P4" else (1, 2, 3, 4))
            for g, n in FOUR_TYPES.items()
        ),
    )

    def group(g: list[str], cluster: Cluster, strategy: str, packing: str) -> PlanRequest:
        return group_request(profiles, g, mix, cluster, strategy, packing, time_limit_s=60.0)

    out = []
    for gi, g in enumerate(groups):
        for cname in names:
            for strategy, packing in (
                ("ppipe", "per-position"),
                ("ppipe", "per-share"),
                ("np", "per-position"),
                ("dart-r", "per-position"),
            ):
                out.append(
                    (
                        f"g{gi}:{cname}:{strategy}:{packing}",
                        group(g, clusters[cname], strategy, packing),
                    )
                )
        out.append((f"g{gi}:4t-few-new:ppipe:per-share", group(g, four, "ppipe", "per-share")))
    singles = sorted(profiles)[:3] if quick else sorted(profiles)
    for name in singles:
        req = group_request(profiles, [name], [1.0], clusters["hc2-large"], max_partitions=3)
        out.append((f"single:{name}", req))
    return out


def plan_digest(quick: bool) -> dict[str, Any]:
    jobs = plan_requests(quick)
    out: dict[str, Any] = {}
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("planning", total=len(jobs) + len(jobs) // 5)
        for key, req in jobs:
            plan = make_plan(req)
            out[key] = _clean(json.loads(plan.to_json()), PLAN_TIME_FIELDS)
            bar.advance(task)
            if key.endswith("hc2-large:ppipe:per-position"):
                rates = tuple(0.5 * m.throughput for m in plan.models)
                cost_req = replace(
                    req, objective="cost", rates=rates, prices={"L4": 0.56, "T4": 0.35}
                )
                out[f"{key}:cost50"] = _clean(
                    json.loads(make_plan(cost_req).to_json()), PLAN_TIME_FIELDS
                )
                bar.advance(task)
    return out


def _first_differences(a: Any, b: Any, path: str = "", out: list[str] | None = None) -> list[str]:
    out = [] if out is None else out
    if len(out) >= 5:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'before' if k in a else 'after'}")
            else:
                _first_differences(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _first_differences(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {str(a)[:60]} -> {str(b)[:60]}")
    return out


# ---------------------------------------------------------------------------- compare


def _unproven(doc: dict[str, Any]) -> bool:
    return "solver" in doc and (doc.get("solver") or {}).get("status") != "optimal"


def _work_apart(doc: dict[str, Any] | None, work: dict[str, list[float]]) -> dict[str, Any] | None:
    """`doc` less its SIM_WORK_FIELDS, whose values go to `work`."""
    if doc is None or not any(f in doc for f in SIM_WORK_FIELDS):
        return doc
    for f in SIM_WORK_FIELDS:
        if f in doc:
            work.setdefault(f, []).append(doc[f])
    return {k: v for k, v in doc.items() if k not in SIM_WORK_FIELDS}


def compare(before: dict[str, Any], got: dict[str, Any]) -> int:
    differ, skipped, paths = [], [], []
    work_a: dict[str, list[float]] = {}
    work_b: dict[str, list[float]] = {}
    for key in sorted(set(before) | set(got)):
        a, b = _work_apart(before.get(key), work_a), _work_apart(got.get(key), work_b)
        if a is None or b is None:
            differ.append(f"{key}: only {'before' if b is None else 'now'}")
        elif _unproven(a) or _unproven(b):
            skipped.append(key)
        elif a != b:
            diffs = _first_differences(a, b)
            solver_only = all(d.startswith("/solver") for d in diffs)
            (paths if solver_only else differ).append(f"{key}: {'; '.join(diffs)}")
    for line in differ:
        console.print(f"[red]{line}[/red]")
    for line in paths:
        console.print(f"[yellow]{line}[/yellow]")
    n = len(set(before) | set(got))
    same = n - len(differ) - len(skipped) - len(paths)
    console.print(f"{same} of {n} identical (every field but time and the plane's work)")
    for f in SIM_WORK_FIELDS:
        xs, ys = work_a.get(f, []), work_b.get(f, [])
        if xs and ys and xs != ys:
            console.print(f"{f}: mean {sum(xs) / len(xs):.3f} -> {sum(ys) / len(ys):.3f}")
    if paths:
        console.print(
            f"{len(paths)} the same plan proven another way (a step's time limit met or not: "
            "run again)"
        )
    if skipped:
        console.print(f"{len(skipped)} left out, not proven in one of the runs: {skipped}")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=("sim", "plan"), help="simulator results or plans")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--save", type=Path, help="write the digest to this JSON file")
    how.add_argument("--compare", type=Path, help="compare with a digest saved before")
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    ap.add_argument(
        "--checked",
        action="store_true",
        help="sim: the reservation runs with the fast plane checked against its specification",
    )
    args = ap.parse_args()
    if args.checked and args.what != "sim":
        ap.error("--checked is for sim digests")
    before = None
    if args.compare:
        try:
            before = json.loads(args.compare.read_text())
        except (OSError, ValueError) as exc:
            console.print(f"[red]cannot read the saved digest {args.compare}: {exc}[/red]")
            return 2
    try:
        if args.what == "sim":
            got = sim_digest(args.quick, args.checked)
        else:
            got = plan_digest(args.quick)
    except PlaneDifference as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    if before is not None:
        return compare(before, got)
    args.save.write_text(json.dumps(got, indent=1, sort_keys=True))
    unproven = sorted(k for k, v in got.items() if _unproven(v))
    console.print(
        f"{len(got)} runs saved to {args.save}" + (f"; not proven: {unproven}" if unproven else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
