"""Onboard the shadow of a profiled model (poolpipe.offline.shadow) as a Prefect flow.

The shadow is generated from the imported profile, onboarded under the profiled model's
name like any model (split at its block boundaries, built, verified, profiled on this
machine) and then given the profile's device tables (L4, T4, ...), boundary sizes,
reference latency and SLO: what the planner plans with and what emulated GPU nodes time
their stages by.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import artifact_key, io_error_only
from flows.onboard import OnboardResult, onboard_model
from poolpipe.domain.profiles import ModelProfile, load_ppipe_dir
from poolpipe.errors import ProfileError
from poolpipe.offline.shadow import ShadowModel, make_shadow
from poolpipe.store.warehouse import Warehouse


@dataclass
class ShadowResult:
    shadow: ShadowModel
    onboarded: OnboardResult
    profile: ModelProfile


def profile_of(profiles: str | Path, model: str, devices: list[str] | None = None) -> ModelProfile:
    """`model`'s imported profile from a PPipe folder, with the tables of `devices` only."""
    known = {p.name: p for p in load_ppipe_dir(Path(profiles))}
    if model not in known:
        raise ProfileError(
            f"{profiles}: no profile of model {model!r}; profiled: {', '.join(sorted(known))}"
        )
    profile = known[model]
    if devices:
        missing = sorted(set(devices) - set(profile.gpus))
        if missing:
            raise ProfileError(
                f"{profiles}: model {model} has no profile on {', '.join(missing)}; "
                f"profiled on {', '.join(profile.gpus)}"
            )
        tables = {k: t for k, t in profile.tables.items() if k[0] in devices}
        profile = replace(profile, tables=tables)
    return profile


@task(
    name="store-device-tables",
    cache_policy=NO_CACHE,
    retries=3,
    retry_delay_seconds=2,
    retry_condition_fn=io_error_only,
)
def store_tables_task(warehouse: str | None, profile: ModelProfile, source: str) -> None:
    with Warehouse.open(warehouse) as wh:
        wh.store_device_tables(profile, {"source": source, "shadow": True})


@flow(name="onboard-shadow", log_prints=True)
def onboard_shadow(
    model: str,
    profiles: str,
    warehouse: str | None = None,
    devices: list[str] | None = None,
    batches: list[int] = [1, 2],  # noqa: B006 (Prefect parameters)
    reps: int = 3,
) -> ShadowResult:
    """Generate MODEL's shadow from the profile folder PROFILES, onboard it under MODEL's
    name and give it the profile's tables of DEVICES (all where not given)."""
    warehouse = worker.warehouse(warehouse)
    profile = profile_of(profiles, model, devices)
    with tempfile.TemporaryDirectory(prefix="poolpipe-shadow-") as tmp:
        shadow = make_shadow(Path(profiles), profile, Path(tmp) / f"{model}.onnx")
        onboarded = onboard_model(
            str(shadow.path),
            model,
            warehouse=warehouse,
            batches=batches,
            reps=reps,
            warmup=1,
            slo_ms=profile.slo_us / 1e3 if profile.slo_us else None,
            cuts=list(shadow.cuts),
            replace=True,  # a shadow stands in for the profile of that name
        )
    store_tables_task(warehouse, profile, str(profiles))
    create_markdown_artifact(
        key=artifact_key("shadow", model),
        description=f"{model}: shadow onboarded with its profiled device tables",
        markdown=(
            f"# {model} (shadow)\n\ninput {shadow.input.name} {list(shadow.input.dims)} "
            f"{shadow.input.dtype}, output {shadow.output.name} {list(shadow.output.dims)}; "
            f"{profile.num_blocks} blocks; boundaries (bytes at batch 1): "
            f"{', '.join(f'{b:,}' for b in shadow.boundary_bytes)}; device tables: "
            f"{', '.join(f'{g}/{v}' for g, v in sorted(profile.tables))} from {profiles}."
        ),
    )
    return ShadowResult(shadow, onboarded, profile)
