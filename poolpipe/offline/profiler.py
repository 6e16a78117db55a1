"""Measure blocks (and the whole model beside them) on an engine, per batch size.

For each batch size every block and the whole model are bound once and warmed up. Then the
`reps` timed runs are taken in rounds: in each round every unit in turn runs once untimed
(its weights back in cache, as for a stage worker that runs one partition over and over)
and then `ROUND_REPS` times back to back, each run timed alone. Spreading every unit's runs
over the whole measurement makes a slow spell of a shared machine (seconds long on this VM)
hit the blocks and the whole model alike, so their sums compare; timing each unit's runs in
one go let such a spell move one unit by 10%. (Sessions do not spin their idle threads, see
engines.OrtEngine; with spinning, alternating sessions made each other up to 3x slower.)
Median and p99 per (block, batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from poolpipe.errors import ModelError
from poolpipe.offline.engines import Engine, Runner
from poolpipe.offline.onnxgraph import random_inputs, tensor_infos
from poolpipe.offline.split import Progress

WHOLE = -1  # block index of the whole model in measurements
ROUND_REPS = 3  # timed runs of a unit per round


@dataclass(frozen=True)
class Measurement:
    block: int  # WHOLE for the whole model
    batch: int
    median_us: float
    p99_us: float
    reps: int


def check_batches(model: onnx.ModelProto, name: str, what: str, batches: Sequence[int]) -> None:
    """A batch size the model's inputs cannot take is refused before anything runs."""
    infos = tensor_infos(model)
    consts = {t.name for t in model.graph.initializer}
    for i in model.graph.input:
        if i.name in consts:
            continue
        dim = infos[i.name].shape[0] if infos[i.name].shape else None
        if isinstance(dim, int) and dim > 0:
            bad = [b for b in batches if b != dim]
            if bad:
                raise ModelError(
                    f"{name}: profile: {what} has input {i.name!r} with a fixed batch "
                    f"dimension of {dim}, so batch {bad[0]} cannot run; export the model with "
                    f"a dynamic batch axis, or profile with --batches {dim}"
                )


def profile_blocks(
    engine: Engine,
    name: str,
    built: Sequence[Path],
    block_files: Sequence[Path],
    whole: tuple[Path, Path] | None,
    batches: Sequence[int],
    *,
    warmup: int = 2,
    reps: int = 15,
    progress: Progress | None = None,
) -> list[Measurement]:
    """Time every block (`built[i]`, made from `block_files[i]`) and, when given, the whole
    model (built, onnx) at every batch size."""
    if reps < 1 or warmup < 0:
        raise ModelError(f"{name}: profile: need reps >= 1 and warmup >= 0")
    if not batches or any(b < 1 for b in batches):
        raise ModelError(f"{name}: profile: batch sizes must be >= 1, got {list(batches)}")
    units: list[tuple[int, Path, Path]] = [
        (k, b, f) for k, (b, f) in enumerate(zip(built, block_files, strict=True))
    ]
    if whole is not None:
        units.append((WHOLE, whole[0], whole[1]))
    models = {k: onnx.load(str(f), load_external_data=False) for k, _, f in units}
    for k, _, _ in units:
        check_batches(models[k], name, _what(k), batches)
    runners: dict[int, Runner] = {k: engine.load(b, name, _what(k)) for k, b, _ in units}
    out: list[Measurement] = []
    total = len(batches) * len(runners)
    step = 0
    for batch in batches:
        times: dict[int, list[float]] = {k: [] for k in runners}
        for k, r in runners.items():
            feeds = random_inputs(models[k], batch, seed=k + 1)
            try:
                r.bind(feeds)
            except Exception as exc:
                raise ModelError(
                    f"{name}: profile: {_what(k)} rejects batch {batch} ({exc})"
                ) from None
        for k, r in runners.items():
            for _ in range(warmup):
                _run(r, name, k, batch)
        rounds = -(-reps // ROUND_REPS)
        for rnd in range(rounds):
            for k, r in runners.items():
                _run(r, name, k, batch)  # untimed: back in cache after the other units
                for _ in range(min(ROUND_REPS, reps - rnd * ROUND_REPS)):
                    times[k].append(_run(r, name, k, batch))
                if rnd == rounds - 1:
                    step += 1
                    if progress:
                        progress(f"profile: batch {batch}", step, total)
        for k, ts in times.items():
            arr = np.asarray(ts)
            out.append(
                Measurement(k, batch, float(np.median(arr)), float(np.percentile(arr, 99)), len(ts))
            )
    return out


def _run(r: Runner, name: str, k: int, batch: int) -> float:
    """One timed run (µs); an engine failure becomes a ModelError naming the unit."""
    t0 = time.perf_counter_ns()
    try:
        r.execute()
    except Exception as exc:
        raise ModelError(
            f"{name}: profile: {_what(k)} failed at batch {batch} "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r})"
        ) from None
    return (time.perf_counter_ns() - t0) / 1e3


def _what(k: int) -> str:
    return "the whole model" if k == WHOLE else f"block {k}"


def sum_vs_whole(measurements: Sequence[Measurement]) -> dict[int, tuple[float, float]]:
    """Per batch size: (sum of the blocks' medians, the whole model's median)."""
    out: dict[int, tuple[float, float]] = {}
    for b in sorted({m.batch for m in measurements}):
        blocks = sum(m.median_us for m in measurements if m.batch == b and m.block != WHOLE)
        whole = next((m.median_us for m in measurements if m.batch == b and m.block == WHOLE), 0)
        out[b] = (blocks, whole)
    return out


def latency_of(measurements: Sequence[Measurement], block: int, batch: int) -> float:
    for m in measurements:
        if m.block == block and m.batch == batch:
            return m.median_us
    return float("nan")
