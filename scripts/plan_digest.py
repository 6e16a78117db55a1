"""Plans, every field but solve time, on a fixed set of requests: the check that a change
to the planner left every plan, bound and proof as it was. The paper's 24 main
configurations (six groups on the four large clusters, maf19 mix, P = 2) with ppipe in both
packings and np and dart-r per-position; the six groups on a four-type cluster
(4t-few-new, per-share: proven by the surrogate knapsack); the 18 single models at P = 3;
and the cheapest ppipe plan serving half of each main per-position plan's rates on
hc2-large: 126 plans.

    .venv/bin/python scripts/plan_digest.py --save before.json      # on the code before
    .venv/bin/python scripts/plan_digest.py --compare before.json   # on the code after

A plan that hit a time limit depends on the machine's speed, not only on the code: those
are listed and left out of the comparison (`--compare` says which). So may the way a plan
was proven where a step's own time limit (the group MILP's 2 s before the decomposition)
is close: the same plan proven another way is shown apart, and does not fail the check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from poolpipe.cli.common import ppipe_dir
from poolpipe.domain.cluster import Cluster, GpuPool, load_clusters
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.planner import PlanRequest, make_plan

console = Console()
TIME_FIELDS = {"seconds", "milp_seconds", "wall_s", "solve_s", "created_at", "created"}
FOUR_TYPES = {"L4": 5, "V100": 5, "T4": 40, "P4": 50}
GPUS_PER_SERVER = {"L4": 4, "V100": 4, "T4": 2, "P4": 1}


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in sorted(x.items()) if k not in TIME_FIELDS}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return round(x, 9)
    return x


def requests(quick: bool) -> list[tuple[str, PlanRequest]]:
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
        return PlanRequest(
            models=tuple(profiles[n] for n in g),
            weights=mix,
            slos_us=tuple(5 * profiles[n].reference_latency_us for n in g),
            cluster=cluster,
            strategy=strategy,
            packing=packing,
            margin=0.4,
            max_partitions=2,
            time_limit_s=60.0,
        )

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
        req = PlanRequest(
            models=(profiles[name],),
            weights=(1.0,),
            slos_us=(5 * profiles[name].reference_latency_us,),
            cluster=clusters["hc2-large"],
            strategy="ppipe",
            packing="per-position",
            margin=0.4,
            max_partitions=3,
            time_limit_s=60.0,
        )
        out.append((f"single:{name}", req))
    return out


def digest(quick: bool) -> dict[str, Any]:
    jobs = requests(quick)
    out: dict[str, Any] = {}
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("planning", total=len(jobs) + len(jobs) // 5)
        for key, req in jobs:
            plan = make_plan(req)
            out[key] = _clean(json.loads(plan.to_json()))
            bar.advance(task)
            if key.endswith("hc2-large:ppipe:per-position"):
                rates = tuple(0.5 * m.throughput for m in plan.models)
                cost_req = replace(
                    req, objective="cost", rates=rates, prices={"L4": 0.56, "T4": 0.35}
                )
                out[f"{key}:cost50"] = _clean(json.loads(make_plan(cost_req).to_json()))
                bar.advance(task)
    return out


def _timed_out(doc: dict[str, Any]) -> bool:
    return (doc.get("solver") or {}).get("status") not in ("optimal",)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the digest to this JSON file")
    what.add_argument("--compare", type=Path, help="compare with a digest saved before")
    ap.add_argument("--quick", action="store_true", help="2 groups on hc2-large, 3 singles")
    args = ap.parse_args()
    got = digest(args.quick)
    if args.save:
        args.save.write_text(json.dumps(got, indent=1, sort_keys=True))
        unproven = sorted(k for k, v in got.items() if _timed_out(v))
        console.print(f"{len(got)} plans saved to {args.save}; not proven: {unproven or 'none'}")
        return 0
    before = json.loads(args.compare.read_text())
    differ, skipped, paths = [], [], []
    for key in sorted(set(before) | set(got)):
        a, b = before.get(key), got.get(key)
        if a is None or b is None:
            differ.append(f"{key}: only {'before' if b is None else 'now'}")
        elif _timed_out(a) or _timed_out(b):
            skipped.append(key)
        elif a != b:
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            shown = "; ".join(
                f"{k}: {str(a.get(k))[:160]} -> {str(b.get(k))[:160]}" for k in fields
            )
            (paths if fields == ["solver"] else differ).append(f"{key}: {shown}")
    for line in differ:
        console.print(f"[red]{line}[/red]")
    for line in paths:
        console.print(f"[yellow]{line}[/yellow]")
    n = len(set(before) | set(got))
    same = n - len(differ) - len(skipped) - len(paths)
    console.print(
        f"{same} of {n} plans identical (every field but time); {len(paths)} the same plan "
        f"proven another way (a step's time limit met or not: run again); {len(skipped)} "
        f"left out, not proven in one of the runs: {skipped or 'none'}"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
