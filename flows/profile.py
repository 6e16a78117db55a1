"""Profile an onboarded model's blocks on a device, adding that device's latencies to the
warehouse beside the others.

- `profile-model`: on this machine, with the warehouse here (`poolpipe profile`);
- `profile-on-pool` (the warehouse's host) with `measure-blocks` (a host of the device's work
  pool, one deployment per type in prefect.yaml): the blocks travel to the device host through
  the exchange storage (flows/storage.py), the measurements come back the same way, and only
  the warehouse's host writes the warehouse. The two hosts share no files.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import cast

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows import storage
from flows.common import DEFAULT_BATCHES, artifact_key, io_error_only, markdown_table, report
from poolpipe.errors import PoolpipeError
from poolpipe.offline.engines import EngineInfo, build_all, make_engine
from poolpipe.offline.profiler import Measurement, latency_of, profile_blocks, sum_vs_whole
from poolpipe.store.warehouse import Warehouse, default_path


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
    block_table(name, info, ms, len(blocks), batches)
    return info, ms


def block_table(
    name: str, info: EngineInfo, ms: list[Measurement], n_blocks: int, batches: list[int]
) -> None:
    """The run's artifact: each block's latency at the smallest and largest batch."""
    lo, hi = batches[0], batches[-1]
    rows = [
        [str(k), f"{latency_of(ms, k, lo) / 1e3:.3f}", f"{latency_of(ms, k, hi) / 1e3:.3f}"]
        for k in range(n_blocks)
    ]
    sums = sum_vs_whole(ms)
    if lo in sums and hi in sums:
        rows.append(["sum", f"{sums[lo][0] / 1e3:.3f}", f"{sums[hi][0] / 1e3:.3f}"])
    create_markdown_artifact(
        key=artifact_key("profile", name, info.device),
        description=f"{name}: block latencies on {info.device}",
        markdown=f"# {name} on {info.device} ({info.engine} {info.version}, {info.host})\n\n"
        + markdown_table(["block", f"ms b={lo}", f"ms b={hi}"], rows),
    )


@flow(name="measure-blocks", log_prints=True)
def measure_blocks(
    name: str,
    storage_url: str,
    files: list[str],
    result_key: str,
    with_whole: bool = True,
    batches: list[int] = list(DEFAULT_BATCHES),  # noqa: B006 (Prefect parameters)
    engine: str = "onnxruntime",
    threads: int = 1,
    warmup: int = 2,
    reps: int = 15,
) -> dict:
    """On a host of the device's work pool: fetch model NAME's block FILES (keys; the whole
    model last when WITH_WHOLE) from the exchange storage at STORAGE_URL, build and time them
    on this machine's device, and write the measurements there under RESULT_KEY. Reads and
    writes no warehouse."""
    batches = sorted(set(batches))
    work = Path(tempfile.mkdtemp(prefix=f"poolpipe-{name}-"))
    try:
        local = storage.get_files(storage_url, files, work)
        built = build_task(name, local, engine, threads, max(batches))
        info, ms = profile_task(
            name, local, built, engine, threads, batches, warmup, reps, with_whole
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "info": dataclasses.asdict(info),
        "measurements": [dataclasses.asdict(m) for m in ms],
        "settings": {"warmup": warmup, "reps": reps, "batches": batches},
    }
    storage.put_json(storage_url, result_key, doc)
    block_table(name, info, ms, len(files) - int(with_whole), batches)
    return {"result_key": result_key, "device": info.device, "measurements": len(ms)}


@flow(name="profile-on-pool", log_prints=True)
def profile_on_pool(
    name: str,
    pool: str,
    warehouse: str | None = None,
    storage_url: str | None = None,
    batches: list[int] | None = None,
    engine: str | None = None,
    threads: int | None = None,
    warmup: int = 2,
    reps: int = 15,
    timeout_s: float = 3600.0,
) -> dict:
    """On the warehouse's host: profile model NAME's blocks on a host of work pool POOL (its
    deployment `measure-blocks/profile-POOL`). The blocks go there through the exchange
    storage (STORAGE_URL or $POOLPIPE_STORAGE; both hosts must reach it), the measurements
    come back the same way, and are stored here. BATCHES, ENGINE and THREADS default to the
    device deployment's own."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment

    warehouse = worker.warehouse(warehouse)
    url = storage.location(storage_url, Path(warehouse) if warehouse else default_path())
    blocks, whole = load_blocks(warehouse, name)
    files = blocks + ([whole] if whole is not None else [])
    prefix = f"profile/{name}/{uuid.uuid4().hex[:12]}"
    params: dict = {
        "name": name,
        "storage_url": url,
        "files": storage.put_files(url, f"{prefix}/blocks", files),
        "result_key": f"{prefix}/measurements.json",
        "with_whole": whole is not None,
        "warmup": warmup,
        "reps": reps,
    }
    for key, value in (("batches", batches), ("engine", engine), ("threads", threads)):
        if value is not None:
            params[key] = value
    deployment = f"measure-blocks/profile-{pool}"
    try:
        run = cast(FlowRun, run_deployment(deployment, parameters=params, timeout=timeout_s))
        state = run.state
        if state is None or not state.is_completed():
            raise PoolpipeError(
                f"{name}: profiling on pool {pool} ({deployment}, run {run.name}) ended "
                f"{state.name if state else 'without a state'}"
                + ("" if state and state.is_final() else f" within {timeout_s:g} s")
                + "; its logs say why (prefect flow-run logs)"
            )
        doc = storage.get_json(url, params["result_key"])
    finally:
        storage.remove(url, prefix)
    info = EngineInfo(**doc["info"])
    ms = [Measurement(**m) for m in doc["measurements"]]
    store_task(warehouse, name, info, ms, doc["settings"] | {"pool": pool})
    return {"device": info.device, "host": info.host, "measurements": len(ms)}
