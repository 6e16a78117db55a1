"""Profile an onboarded model's blocks on this machine's device: the flow that runs on each
GPU type's work pool (one deployment per type in prefect.yaml), adding that device's
latencies to the warehouse beside the others."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import DEFAULT_BATCHES, artifact_key, io_error_only, markdown_table, report
from poolpipe.offline.engines import EngineInfo, build_all, make_engine
from poolpipe.offline.profiler import Measurement, latency_of, profile_blocks, sum_vs_whole
from poolpipe.store.warehouse import Warehouse


@task(name="load-blocks", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def load_blocks(warehouse: str | None, name: str) -> tuple[list[Path], Path | None]:
    with Warehouse.open(warehouse) as wh:
        return wh.onboarded_blocks(name), wh.whole_model_file(name)


@task(name="build", cache_policy=NO_CACHE)
def build_task(  # one engine artifact per file (blocks, then the whole model when given)
    name: str, files: list[Path], engine: str, threads: int, max_batch: int
) -> list[Path]:
    eng = make_engine(engine, threads=threads, out_dir=files[0].parent / "engines")
    return build_all(eng, files, name, max_batch, report)


@task(name="profile", cache_policy=NO_CACHE)
def profile_task(
    name: str,
    files: list[Path],
    built: list[Path],
    engine: str,
    threads: int,
    batches: list[int],
    warmup: int,
    reps: int,
    with_whole: bool,
) -> tuple[EngineInfo, list[Measurement]]:
    """Time the blocks (and, `with_whole`, the last file: the whole model beside them)."""
    eng = make_engine(engine, threads=threads, out_dir=files[0].parent / "engines")
    n = len(files) - 1 if with_whole else len(files)
    ms = profile_blocks(
        eng,
        name,
        built[:n],
        files[:n],
        (built[-1], files[-1]) if with_whole else None,
        batches,
        warmup=warmup,
        reps=reps,
        progress=report,
    )
    return eng.info, ms


@task(name="store", cache_policy=NO_CACHE, retries=3, retry_condition_fn=io_error_only)
def store_task(
    warehouse: str | None,
    name: str,
    info: EngineInfo,
    measurements: list[Measurement],
    settings: dict,
) -> None:
    with Warehouse.open(warehouse) as wh:
        wh.store_measurements(name, info, measurements, settings=settings)


@flow(name="profile-model", log_prints=True)
def profile_model(
    name: str,
    warehouse: str | None = None,
    batches: list[int] = list(DEFAULT_BATCHES),  # noqa: B006 (Prefect parameters)
    engine: str = "onnxruntime",
    threads: int = 1,
    warmup: int = 2,
    reps: int = 15,
) -> tuple[EngineInfo, list[Measurement]]:
    """Measure every block of model NAME (and the whole model) on this machine's device at
    every batch size; replace this device's latencies in the warehouse."""
    warehouse = worker.warehouse(warehouse)
    batches = sorted(set(batches))
    blocks, whole = load_blocks(warehouse, name)
    files = blocks + ([whole] if whole is not None else [])
    built = build_task(name, files, engine, threads, max(batches))
    info, ms = profile_task(
        name, files, built, engine, threads, batches, warmup, reps, whole is not None
    )
    store_task(warehouse, name, info, ms, {"warmup": warmup, "reps": reps, "batches": batches})
    lo, hi = batches[0], batches[-1]
    rows = [
        [str(k), f"{latency_of(ms, k, lo) / 1e3:.3f}", f"{latency_of(ms, k, hi) / 1e3:.3f}"]
        for k in range(len(blocks))
    ]
    sums = sum_vs_whole(ms)
    rows.append(["sum", f"{sums[lo][0] / 1e3:.3f}", f"{sums[hi][0] / 1e3:.3f}"])
    create_markdown_artifact(
        key=artifact_key("profile", name, info.device),
        description=f"{name}: block latencies on {info.device}",
        markdown=f"# {name} on {info.device} ({info.engine} {info.version})\n\n"
        + markdown_table(["block", f"ms b={lo}", f"ms b={hi}"], rows),
    )
    return info, ms
