"""Scenarios: timed events a simulation meets on its virtual clock, from a TOML file.

    [[events]]
    at_s = 10
    kind = "gpu_down"   # gpu_down | gpu_up | rollout
    gpu = "T4"          # device type; `count` of its GPUs (and their vGPUs) fail
    count = 5           # or `gpus = [0, 3]`: exactly those GPUs of the type
    [[events]]
    at_s = 25
    kind = "rollout"
    plan = "other-plan.json"   # relative to the scenario file

GPUs that fail are picked at random (seeded by the run's seed) among those alive; `gpu_up`
brings back the earliest failed first. The serving runtime meets every event with the
policies it uses live: a failed stage takes its node's vGPUs out and retries once, a node
that answers again returns, a rollout is a pipeline-flush migration.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import Topology

KINDS = ("gpu_down", "gpu_up", "rollout")


@dataclass(frozen=True)
class GpuChange:
    """GPUs of one type fail (gpu_down) or come back (gpu_up)."""

    kind: str  # gpu_down | gpu_up
    at_s: float
    gpu: str
    count: int = 1
    gpus: tuple[int, ...] = ()  # exactly these GPUs of the type (physical indices)


@dataclass(frozen=True)
class Rollout:
    kind: ClassVar[str] = "rollout"
    at_s: float
    topo: Topology  # the new plan, laid out
    label: str  # where it came from (the plan file)


ScenarioEvent = GpuChange | Rollout


@dataclass(frozen=True)
class Scenario:
    events: tuple[ScenarioEvent, ...]

    def describe(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in self.events:
            if isinstance(e, Rollout):
                out.append({"at_s": e.at_s, "kind": e.kind, "plan": e.label})
            else:
                what = {"gpus": list(e.gpus)} if e.gpus else {"count": e.count}
                out.append({"at_s": e.at_s, "kind": e.kind, "gpu": e.gpu, **what})
        return out


def load_scenario(
    path: Path | str,
    *,
    gpu_counts: dict[str, int],
    models: Sequence[str],
    load_plan: Callable[[Path], Topology],
) -> Scenario:
    """Read and check a scenario file against the cluster (`gpu_counts` per device type)
    and the served models; `load_plan` lays out a rollout's plan file."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PoolpipeError(f"scenario file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PoolpipeError(f"scenario file {path} is not TOML: {exc}") from None
    raw = doc.get("events")
    if not isinstance(raw, list) or not raw:
        raise PoolpipeError(f"{path}: no [[events]]; each has at_s and kind ({', '.join(KINDS)})")
    events = [_event(path, k, e, gpu_counts, models, load_plan) for k, e in enumerate(raw, 1)]
    return Scenario(tuple(sorted(events, key=lambda e: e.at_s)))


def _event(
    path: Path,
    k: int,
    e: Any,
    gpu_counts: dict[str, int],
    models: Sequence[str],
    load_plan: Callable[[Path], Topology],
) -> ScenarioEvent:
    where = f"{path}, event {k}"
    if not isinstance(e, dict):
        raise PoolpipeError(f"{where}: expected a table with at_s and kind")
    at_s = e.get("at_s")
    if (
        isinstance(at_s, bool)
        or not isinstance(at_s, int | float)
        or not (math.isfinite(at_s) and at_s >= 0)
    ):
        raise PoolpipeError(f"{where}: at_s must be a number of seconds >= 0, got {at_s!r}")
    kind = e.get("kind")
    allowed = {"at_s", "kind"} | ({"plan"} if kind == "rollout" else {"gpu", "count", "gpus"})
    unknown = sorted(set(e) - allowed)
    if kind not in KINDS:
        raise PoolpipeError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if unknown:
        raise PoolpipeError(f"{where}: unknown field(s) {unknown} for a {kind} event")
    if kind == "rollout":
        plan = e.get("plan")
        if not isinstance(plan, str) or not plan:
            raise PoolpipeError(f'{where}: a rollout needs plan = "PLAN.json"')
        file = Path(plan) if Path(plan).is_absolute() else path.parent / plan
        if not file.is_file():
            raise PoolpipeError(f"{where}: plan file {file} does not exist")
        topo = load_plan(file)
        names = sorted(m.name for m in topo.models)
        if names != sorted(models):
            raise PoolpipeError(
                f"{where}: {file.name} serves {names}, the simulated plan {sorted(models)}; "
                "a rollout must serve the same models"
            )
        return Rollout(float(at_s), topo, file.name)
    gpu = e.get("gpu")
    if gpu not in gpu_counts:
        raise PoolpipeError(
            f"{where}: gpu {gpu!r} is not a device type of the cluster ({sorted(gpu_counts)})"
        )
    count, gpus = e.get("count", 1), e.get("gpus", [])
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PoolpipeError(f"{where}: count must be a whole number >= 1, got {count!r}")
    total = gpu_counts[gpu]
    if not isinstance(gpus, list) or any(
        isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < total for g in gpus
    ):
        raise PoolpipeError(f"{where}: gpus must list {gpu} GPU numbers 0..{total - 1}")
    if "gpus" not in e and count > total:
        raise PoolpipeError(f"{where}: the cluster has {total} {gpu} GPUs, not {count}")
    return GpuChange(kind, float(at_s), gpu, len(gpus) or count, tuple(gpus))
