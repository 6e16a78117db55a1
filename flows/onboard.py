"""Onboard an ONNX model: split → build → verify → profile → store, as a Prefect flow.

The block files are written to a staging folder and published (renamed into place) inside
the warehouse transaction that stores the model, so a failure at any step leaves both the
warehouse and the blocks folder as they were.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import settings as worker
from flows.common import DEFAULT_BATCHES, artifact_key, io_error_only, markdown_table, report
from flows.profile import build_task, profile_task
from poolpipe.errors import ModelError
from poolpipe.offline.cuts import METHODS, CutPolicy
from poolpipe.offline.engines import EngineInfo
from poolpipe.offline.profiler import Measurement, latency_of, sum_vs_whole
from poolpipe.offline.split import SplitResult, split_model, verify_split
from poolpipe.store.warehouse import Warehouse

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class OnboardResult:
    split: SplitResult
    info: EngineInfo
    measurements: list[Measurement]
    verify_errors: tuple[float, float]
    seconds: dict[str, float] = field(default_factory=dict)
    # stored plans that served the model this onboarding replaced: made for its old blocks
    outdated_plans: list[int] = field(default_factory=list)


def blocks_root(warehouse: str | None) -> Path:
    with Warehouse.open(warehouse) as wh:
        return wh.path.parent / "blocks"


def check_name_free(warehouse: str | None, name: str, replace: bool) -> list[int]:
    """Refuse to onboard over a model the warehouse holds unless `replace`; the stored plans
    that serve it (which the new blocks outdate) where it is replaced."""
    with Warehouse.open(warehouse) as wh:
        origin = wh.model_origin(name)
        plans = wh.plans_using(name) if origin else []
    if origin is None:
        return []
    if not replace:
        used = (
            f"; plans {', '.join(map(str, plans))} serve it and would need planning again"
            if plans
            else ""
        )
        raise ModelError(
            f"{name}: the warehouse holds a model of this name already (from "
            f"{origin[0].removeprefix('onboard:')}, {origin[1]:%Y-%m-%d %H:%M}){used}; onboard "
            "it under another --name, or pass --replace to replace it"
        )
    return plans


@task(name="split", cache_policy=NO_CACHE)
def split_task(
    model_path: str,
    name: str,
    staging: Path,
    blocks: int,
    method: str,
    max_cut_tensors: int,
    threads: int,
    cuts: list[int] | None = None,
    input_shapes: dict[str, list[int]] | None = None,
) -> SplitResult:
    return split_model(
        Path(model_path),
        name,
        staging,
        n_blocks=blocks,
        policy=CutPolicy(max_cut_tensors),
        method=method,
        threads=threads,
        progress=report,
        cuts=cuts,
        input_shapes={k: tuple(v) for k, v in (input_shapes or {}).items()},
    )


@task(name="verify", cache_policy=NO_CACHE)
def verify_task(split: SplitResult) -> tuple[float, float]:
    report("verify", 0, 1)
    errors = verify_split(split)
    report("verify", 1, 1)
    return errors


@task(
    name="store",
    cache_policy=NO_CACHE,
    retries=3,
    retry_delay_seconds=2,
    retry_condition_fn=io_error_only,
)
def store_task(
    warehouse: str | None,
    split: SplitResult,
    info: EngineInfo,
    measurements: list[Measurement],
    verify_errors: tuple[float, float],
    slo_us: float | None,
    settings: dict,
) -> SplitResult:
    """Store the model and publish its block folder in one step (all or nothing)."""
    report("store", 0, 1)
    final = split.folder.parent.parent / split.model
    old = final.with_name(f".old-{split.model}-{uuid.uuid4().hex[:8]}")
    moved: list[tuple[Path, Path]] = []

    def publish() -> None:
        if final.exists():
            final.rename(old)
            moved.append((final, old))
        split.folder.rename(final)
        moved.append((split.folder, final))

    published = split.moved_to(final)
    try:
        with Warehouse.open(warehouse) as wh:
            wh.store_onboarding(
                published,
                info,
                measurements,
                verify_errors=verify_errors,
                slo_us=slo_us,
                settings=settings,
                before_commit=publish,
            )
    except BaseException:
        for src, dst in reversed(moved):  # put the folders back as they were
            dst.rename(src)
        raise
    shutil.rmtree(old, ignore_errors=True)
    report("store", 1, 1)
    return published


def block_rows(result: OnboardResult) -> list[list[str]]:
    """The block table: layers, boundary, latency at the smallest and largest batch."""
    shown = _shown_batches(result)
    rows = []
    for b in result.split.blocks:
        rows.append(
            [
                str(b.index),
                f"[{b.layer_start}, {b.layer_end})",
                b.first_layer,
                str(len(b.outputs)),
                f"{b.out_bytes / 1024:,.1f}",
                *(f"{latency_of(result.measurements, b.index, x) / 1e3:.3f}" for x in shown),
            ]
        )
    sums = sum_vs_whole(result.measurements)
    for label, pick in (("sum of blocks", 0), ("whole model", 1)):
        rows.append(["", "", label, "", "", *(f"{sums[x][pick] / 1e3:.3f}" for x in shown)])
    return rows


def _shown_batches(result: OnboardResult) -> list[int]:
    """The smallest and the largest batch profiled (one column where they are the same)."""
    batches = sorted({m.batch for m in result.measurements})
    return sorted({batches[0], batches[-1]})


def block_header(result: OnboardResult) -> list[str]:
    return [
        "block",
        "layers",
        "first layer",
        "tensors out",
        "KiB out (b=1)",
        *(f"ms b={x}" for x in _shown_batches(result)),
    ]


@flow(name="onboard-model", log_prints=True)
def onboard_model(
    model_path: str,
    name: str,
    warehouse: str | None = None,
    blocks: int = 10,
    batches: list[int] = list(DEFAULT_BATCHES),  # noqa: B006 (Prefect parameters)
    engine: str = "onnxruntime",
    threads: int = 1,
    method: str = "balanced",
    max_cut_tensors: int = 1,
    warmup: int = 2,
    reps: int = 15,
    slo_ms: float | None = None,
    cuts: list[int] | None = None,
    input_shapes: dict[str, list[int]] | None = None,
    replace: bool = False,
) -> OnboardResult:
    """Split MODEL into blocks (at the layer positions `cuts` where given; its inputs'
    dimensions after the batch from `input_shapes` where the file leaves them to run time),
    build them on this machine's engine, check that they reproduce the model, profile them
    at every batch size and store everything. A model of the same name is replaced only
    with `replace`."""
    warehouse = worker.warehouse(warehouse)
    if not NAME_RE.match(name):
        raise ModelError(
            f"{name!r}: the model name must start with a letter or digit and hold only "
            "letters, digits, '_', '.' and '-'"
        )
    if method not in METHODS:
        raise ModelError(f"{name}: unknown pre-partitioning method {method!r}; choose {METHODS}")
    batches = sorted(set(batches))
    outdated = check_name_free(warehouse, name, replace)
    staging = blocks_root(warehouse) / ".staging" / f"{name}-{uuid.uuid4().hex[:8]}"
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        split = split_task(
            model_path, name, staging, blocks, method, max_cut_tensors, threads, cuts, input_shapes
        )
        seconds["split"] = time.perf_counter() - t0
        t = time.perf_counter()
        files = [b.path for b in split.blocks] + [split.whole_path]
        built = build_task(name, files, engine, threads, max(batches))
        seconds["build"] = time.perf_counter() - t
        t = time.perf_counter()
        errors = verify_task(split)
        seconds["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        info, measurements = profile_task(
            name, files, built, engine, threads, batches, warmup, reps, with_whole=True
        )
        seconds["profile"] = time.perf_counter() - t
        t = time.perf_counter()
        settings = {"warmup": warmup, "reps": reps, "batches": batches}
        if input_shapes:
            settings["input_shapes"] = input_shapes
        slo_us = slo_ms * 1e3 if slo_ms is not None else None
        split = store_task(warehouse, split, info, measurements, errors, slo_us, settings)
        seconds["store"] = time.perf_counter() - t
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = OnboardResult(split, info, measurements, errors, seconds, outdated)
    part = split.partitioning
    create_markdown_artifact(
        key=artifact_key("onboard", name),
        description=f"{name}: blocks and latencies on {info.device}",
        markdown=(
            f"# {name} on {info.device} ({info.engine} {info.version})\n\n"
            f"{split.layers} layers, {len(split.blocks)} blocks ({part.method}, cuts crossed "
            f"by <= {part.policy.max_tensors} tensor(s), layer-profile balance "
            f"{part.balance:.2f}); blocks vs whole model: max error {errors[0]:.1e} (fp32), "
            f"{errors[1]:.1e} (fp16 boundaries).\n\n"
            + markdown_table(block_header(result), block_rows(result))
        ),
    )
    return result
