"""Simulator results, every field but wall-clock time, on a fixed set of configurations: the
check that a change to the runtime, the data planes or the simulator left every decision as
it was. The six groups of the paper on hc2-large (ppipe plans, maf19 mix), each under the
four data planes with and without execution jitter (48 runs), and each group's plan through a
scenario (5 T4s down and back, then a rollout to its np plan): 54 runs.

    .venv/bin/python scripts/sim_digest.py --save before.json      # on the code before
    .venv/bin/python scripts/sim_digest.py --compare before.json   # on the code after

`--compare` prints each configuration that differs with its first differing fields and
exits 1 if any does; `--quick` takes two groups and 5 s of simulated time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from poolpipe.cli.common import ppipe_dir
from poolpipe.domain.cluster import load_clusters
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan
from poolpipe.scheduler import DATA_PLANES, build_topology
from poolpipe.sim import ArrivalSpec, SimConfig, load_scenario, run_once

# What wall-clock time decides: left out of the digest.
WALL_FIELDS = {
    "wall_s",
    "requests_per_wall_s",
    "sched_us_per_batch_median",
    "sched_us_per_batch_mean",
}
LOAD_FACTOR = 0.9
JITTERS = (0.0, 0.2)

console = Console()


def _clean(x: Any) -> Any:
    """JSON-comparable: NaN as the string "nan", wall-clock fields dropped."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in sorted(x.items()) if k not in WALL_FIELDS}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return x


def digest(quick: bool) -> dict[str, Any]:
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
            plans = {}
            for strategy in ("ppipe", "np"):
                plans[strategy] = make_plan(
                    PlanRequest(
                        models=tuple(profiles[n] for n in group),
                        weights=tuple(workloads["mixes"]["maf19"]),
                        slos_us=tuple(5 * profiles[n].reference_latency_us for n in group),
                        cluster=cluster,
                        strategy=strategy,
                        packing="per-position",
                        margin=0.4,
                        max_partitions=2,
                    )
                )
            topo = build_topology(plans["ppipe"], profiles, larger_batches=True)
            for plane in DATA_PLANES:
                for jitter in JITTERS:
                    res = run_once(
                        topo,
                        ArrivalSpec("poisson"),
                        LOAD_FACTOR,
                        SimConfig(duration, seed=1, jitter=jitter),
                        plane,
                    )
                    out[f"g{gi}/{plane}/jitter{jitter:g}"] = _clean(res.to_dict())
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
            from poolpipe.domain.plan import Plan

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
                "reservation",
                scenario=scenario,
            )
            out[f"g{gi}/scenario"] = _clean(res.to_dict())
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the digest to this JSON file")
    what.add_argument("--compare", type=Path, help="compare with a digest saved before")
    ap.add_argument("--quick", action="store_true", help="2 groups, 5 s simulated")
    args = ap.parse_args()
    got = digest(args.quick)
    if args.save:
        args.save.write_text(json.dumps(got, indent=1, sort_keys=True))
        sha = hashlib.sha256(json.dumps(got, sort_keys=True).encode()).hexdigest()[:16]
        console.print(f"{len(got)} configurations saved to {args.save} (sha256 {sha})")
        return 0
    try:
        before = json.loads(args.compare.read_text())
    except (OSError, ValueError) as exc:
        console.print(f"[red]cannot read the saved digest {args.compare}: {exc}[/red]")
        return 2
    differ = 0
    for key in sorted(set(before) | set(got)):
        if key not in before or key not in got:
            console.print(f"{key}: only {'before' if key in before else 'now'}")
            differ += 1
            continue
        diffs = _first_differences(before[key], got[key])
        if diffs:
            differ += 1
            console.print(f"[red]{key} differs[/red]: " + "; ".join(diffs))
    same = len(set(before) & set(got)) - differ + sum(1 for k in got if k not in before)
    console.print(
        f"{same} of {len(set(before) | set(got))} configurations identical"
        + ("" if differ else " (every field but wall-clock time)")
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
