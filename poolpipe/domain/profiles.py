"""Block latency tables and boundary sizes of a model, and the loader for PPipe's CSV layout.

A model is cut into B blocks in execution order; its profile holds, per (GPU type, share),
the latency of every block at every measured batch size, and the bytes of each boundary
feature map at batch 1.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolpipe.errors import ProfileError

# The paper's SLO is this multiple of the whole model's batch-1 latency on one L4.
DEFAULT_SLO_SCALE = 5.0

# What one stage call on a node costs beyond its blocks' run where no router has measured it
# (serving_stats.call_overhead_ms): Triton, its Python backend and the call's own transfers;
# 0.7-3.4 ms a call on the 2-core development machine for a 1-ms classifier.
DEFAULT_CALL_OVERHEAD_US = 2_500.0
ONBOARDED = "onboard:"  # the source of a model onboarded (split and profiled) here


@dataclass(frozen=True)
class ServedReference:
    """What an SLO scale multiplies for one model. The paper's profiles (and shadows of
    them) keep the paper's reference: the whole model's run at batch 1 on the reference
    GPU. A model onboarded here is referred to as it is served: its run, plus one stage
    call's cost on a node and the reply margin the router holds back, so that `--slo-scale
    5` leaves a 1-ms model as much room as its serving path needs (its run alone would
    give 5 ms, less than the path takes)."""

    run_us: float
    call_us: float = 0.0
    reply_us: float = 0.0

    @property
    def us(self) -> float:
        return self.run_us + self.call_us + self.reply_us

    def slo_us(self, scale: float) -> float:
        return scale * self.us

    def describe(self, scale: float) -> str:
        if not (self.call_us or self.reply_us):
            return f"SLO {scale:g} x {self.run_us / 1e3:.3g} ms reference"
        return (
            f"SLO {scale:g} x {self.us / 1e3:.3g} ms = {self.slo_us(scale) / 1e3:.3g} ms: the "
            f"model as served, its run {self.run_us / 1e3:.3g} ms + a stage call "
            f"{self.call_us / 1e3:.3g} ms + the reply margin {self.reply_us / 1e3:.3g} ms"
        )


def served_reference(
    profile: ModelProfile, call_us: float = DEFAULT_CALL_OVERHEAD_US, reply_us: float = 0.0
) -> ServedReference | None:
    """The reference an SLO scale multiplies (ServedReference); None where the model has no
    reference latency. `call_us`, `reply_us`: the serving path's costs (measured where a
    router has served the model, else defaults), counted for onboarded models only."""
    ref = profile.reference_latency_us
    if not ref:
        return None
    if not str(profile.meta.get("source", "")).startswith(ONBOARDED):
        return ServedReference(ref)
    return ServedReference(ref, call_us, reply_us)


@dataclass(frozen=True)
class LatencyTable:
    """Latency (µs) of each block at batch sizes 1..max_batch on one GPU type at share 1/v."""

    gpu: str
    share: int  # v: the block ran on 1/v of a physical GPU
    latency_us: np.ndarray  # shape (num_blocks, max_batch); column b-1 is batch b
    source: str = "unknown"  # provenance: where the numbers come from

    def __post_init__(self) -> None:
        if self.share < 1:
            raise ProfileError(f"{self.gpu}: share must be >= 1, got {self.share}")
        if self.latency_us.ndim != 2 or self.latency_us.shape[1] < 1:
            raise ProfileError(f"{self.gpu}/{self.share}: latency table must be blocks x batches")
        bad = ~np.isfinite(self.latency_us) | (self.latency_us <= 0)
        if bad.any():
            i, b = (int(x) for x in np.argwhere(bad)[0])
            raise ProfileError(
                f"{self.gpu}/{self.share}: row {i + 1} (block {i}), batch {b + 1}: latency "
                f"{self.latency_us[i, b]!r} µs; every latency must be a finite number > 0 "
                f"({int(bad.sum())} such cells)"
            )

    def check_grows_with_batch(self, where: str) -> None:
        """Raise ProfileError naming `where`, the row and the column where a block's latency
        does not grow with the batch (a table of one figure copied, or columns swapped):
        imported tables must; measured ones may wobble and are not checked."""
        lat = self.latency_us
        if lat.shape[1] < 2:
            return
        flat = np.argwhere(np.diff(lat, axis=1) <= 0)
        if len(flat):
            i, b = (int(x) for x in flat[0])
            raise ProfileError(
                f"{where}: row {i + 1} (block {i}): latency at batch {b + 2} "
                f"({lat[i, b + 1]:g} µs) is not above batch {b + 1}'s ({lat[i, b]:g} µs); "
                f"latencies must grow with the batch ({len(flat)} such cells)"
            )

    @property
    def max_batch(self) -> int:
        return int(self.latency_us.shape[1])


@dataclass(frozen=True)
class ModelProfile:
    """Everything the planner needs to know about one model."""

    name: str
    num_blocks: int
    tables: Mapping[tuple[str, int], LatencyTable]  # (gpu, share) -> table
    boundary_bytes: tuple[float, ...]  # bytes leaving block i at batch 1, i = 0..B-2
    reference_latency_us: float | None = None  # whole model, batch 1, reference GPU
    slo_us: float | None = None  # default SLO (reference x DEFAULT_SLO_SCALE when imported)
    meta: Mapping[str, str] = field(default_factory=dict)
    # bytes of one request's inputs as a client sends them (None: not known); what the
    # planner counts on the first server's NIC where asked (PlanRequest.count_inputs)
    input_bytes: float | None = None
    # GPU memory (domain/memory.py; None: not known): the model's weights, and its largest
    # tensor in and out per sample (the activations a batch holds at once)
    weight_bytes: float | None = None
    activation_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ProfileError(f"model {self.name}: needs at least one block")
        if len(self.boundary_bytes) != self.num_blocks - 1:
            raise ProfileError(
                f"model {self.name}: {len(self.boundary_bytes)} boundary sizes for "
                f"{self.num_blocks} blocks (need {self.num_blocks - 1})"
            )
        if self.input_bytes is not None and not (
            self.input_bytes > 0 and math.isfinite(self.input_bytes)
        ):
            raise ProfileError(
                f"model {self.name}: input size must be a positive number of bytes, got "
                f"{self.input_bytes}"
            )
        for what, value in (("weights", self.weight_bytes), ("activations", self.activation_bytes)):
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ProfileError(
                    f"model {self.name}: {what} must be a number of bytes >= 0, got {value}"
                )
        for key, table in self.tables.items():
            if table.latency_us.shape[0] != self.num_blocks:
                raise ProfileError(
                    f"model {self.name}: table {key[0]}/{key[1]} has "
                    f"{table.latency_us.shape[0]} blocks, expected {self.num_blocks}"
                )

    @property
    def gpus(self) -> list[str]:
        return sorted({gpu for gpu, _ in self.tables})

    def shares(self, gpu: str) -> list[int]:
        return sorted(v for g, v in self.tables if g == gpu)

    def whole_latency_us(self, gpu: str, share: int = 1, batch: int = 1) -> float:
        """Sum of block latencies (each at least 1 µs, as the planner counts them)."""
        table = self.tables[(gpu, share)]
        return float(np.maximum(table.latency_us[:, batch - 1], 1.0).sum())


# ----------------------------------------------------------------------------- CSV parsing


def _parse_number(path: Path, row: int, col: int, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ProfileError(
            f"{path}: row {row}, column {col}: {cell.strip()!r} is not a number"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(
            f"{path}: row {row}, column {col}: {cell.strip()!r} must be finite and >= 0"
        )
    return value


def read_matrix(path: Path) -> np.ndarray:
    """A header-less numeric CSV, all rows the same length; errors name file and row (1-based)."""
    if not path.is_file():
        raise ProfileError(f"{path}: file is missing")
    rows: list[list[float]] = []
    width: int | None = None
    with path.open(newline="") as f:
        for i, cells in enumerate(csv.reader(f), start=1):
            if not cells or all(not c.strip() for c in cells):
                continue
            values = [_parse_number(path, i, j, c) for j, c in enumerate(cells, start=1)]
            if width is None:
                width = len(values)
            elif len(values) != width:
                raise ProfileError(
                    f"{path}: row {i} has {len(values)} values, earlier rows have {width} "
                    "(ragged table)"
                )
            rows.append(values)
    if not rows:
        raise ProfileError(f"{path}: file is empty")
    return np.asarray(rows, dtype=float)


def parse_block_latency_name(path: Path) -> tuple[str, str, int]:
    """`<model>-<GPU>-<v>.csv` -> (model, gpu, v); model names may contain dashes."""
    parts = path.stem.rsplit("-", 2)
    if len(parts) != 3 or not parts[2].isdigit() or not parts[0] or not parts[1]:
        raise ProfileError(
            f"{path}: file name must be <model>-<GPU>-<share>.csv (e.g. resnet50-T4-2.csv)"
        )
    return parts[0], parts[1], int(parts[2])


def load_ppipe_dir(root: Path) -> list[ModelProfile]:
    """Read every model of a PPipe profile folder (see its README); all or nothing.

    Raises ProfileError naming the file (and row) of the first problem found.
    """
    root = Path(root)
    lat_dir = root / "block-latency"
    bnd_dir = root / "boundary-bytes"
    ref_file = root / "reference-latency.csv"
    for needed in (lat_dir, bnd_dir):
        if not needed.is_dir():
            raise ProfileError(f"{needed}: folder is missing (is {root} a PPipe profile folder?)")
    references = _read_reference_latency(ref_file)

    tables: dict[str, dict[tuple[str, int], LatencyTable]] = {}
    for path in sorted(lat_dir.glob("*.csv")):
        model, gpu, share = parse_block_latency_name(path)
        matrix = read_matrix(path)
        try:
            table = LatencyTable(gpu=gpu, share=share, latency_us=matrix, source="ppipe-artifact")
        except ProfileError as e:  # name the file and its row (block i is row i + 1)
            raise ProfileError(f"{path}: {e}") from None
        table.check_grows_with_batch(str(path))
        tables.setdefault(model, {})[(gpu, share)] = table
    if not tables:
        raise ProfileError(f"{lat_dir}: no <model>-<GPU>-<share>.csv files found")

    profiles = []
    for model, by_key in sorted(tables.items()):
        block_counts = {t.latency_us.shape[0] for t in by_key.values()}
        if len(block_counts) != 1:
            detail = ", ".join(
                f"{g}-{v}: {t.latency_us.shape[0]}" for (g, v), t in sorted(by_key.items())
            )
            raise ProfileError(
                f"{lat_dir}: model {model} has tables with different block counts ({detail})"
            )
        num_blocks = block_counts.pop()
        bnd_path = bnd_dir / f"{model}.csv"
        boundary = read_matrix(bnd_path)
        if boundary.shape[1] != 1:
            raise ProfileError(f"{bnd_path}: expected one number per row, got {boundary.shape[1]}")
        if boundary.shape[0] != num_blocks - 1:
            raise ProfileError(
                f"{bnd_path}: {boundary.shape[0]} rows, but model {model} has {num_blocks} "
                f"blocks so it needs {num_blocks - 1} boundary sizes"
            )
        if model not in references:
            raise ProfileError(f"{ref_file}: no row for model {model}")
        reference = references[model]
        profiles.append(
            ModelProfile(
                name=model,
                num_blocks=num_blocks,
                tables=by_key,
                boundary_bytes=tuple(float(x) for x in boundary[:, 0]),
                reference_latency_us=reference,
                slo_us=reference * DEFAULT_SLO_SCALE,
                meta={"source": "ppipe-artifact", "path": str(root)},
                input_bytes=ppipe_input_bytes(root, model),
                activation_bytes=ppipe_activation_bytes(root, model),
            )
        )
    return profiles


def ppipe_input_bytes(root: Path, model: str) -> float | None:
    """The bytes of one request's inputs from the artifact's `layers/<model>/cuts.json`
    (the tensors crossing the cut before the first layer) and `shapes.json`; None where
    the folder has no such files."""
    layers = Path(root) / "layers" / model
    cuts_file, shapes_file = layers / "cuts.json", layers / "shapes.json"
    if not (cuts_file.is_file() and shapes_file.is_file()):
        return None
    try:
        cuts = json.loads(cuts_file.read_text())
        shapes = json.loads(shapes_file.read_text())
        names = cuts[0]["cut"]
        total = 0.0
        for name in names:
            entry = shapes[name]
            dims = [int(d) for d in entry["shape"][1:]]
            if any(d < 1 for d in dims):
                raise ValueError(f"tensor {name!r} has shape {entry['shape']}")
            total += math.prod(dims) * np.dtype(entry["dtype"]).itemsize
    except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ProfileError(
            f"{layers}: cannot read the model's input size from cuts.json and shapes.json ({exc})"
        ) from None
    if not total > 0:
        raise ProfileError(f"{cuts_file}: the first cut names no input tensor")
    return float(total)


def ppipe_activation_bytes(root: Path, model: str) -> float | None:
    """Twice the model's largest tensor per sample (an input and an output held at once)
    from the artifact's `layers/<model>/shapes.json`; None where the folder has none."""
    shapes_file = Path(root) / "layers" / model / "shapes.json"
    if not shapes_file.is_file():
        return None
    try:
        shapes = json.loads(shapes_file.read_text())
        largest = 0.0
        for entry in shapes.values():
            dims = [int(d) for d in entry["shape"][1:]]
            if any(d < 1 for d in dims):
                continue  # (a shape tensor's unknown length: no activation of note)
            largest = max(largest, math.prod(dims) * np.dtype(entry["dtype"]).itemsize)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{shapes_file}: cannot read the tensors' sizes ({exc})") from None
    return 2.0 * largest


def _read_reference_latency(path: Path) -> dict[str, float]:
    if not path.is_file():
        raise ProfileError(f"{path}: file is missing")
    out: dict[str, float] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or len(header) != 2:
            raise ProfileError(f"{path}: row 1 must be the header model,<latency_us>")
        for i, cells in enumerate(reader, start=2):
            if not cells:
                continue
            if len(cells) != 2:
                raise ProfileError(f"{path}: row {i} must have 2 values, has {len(cells)}")
            value = _parse_number(path, i, 2, cells[1])
            if value <= 0:
                raise ProfileError(f"{path}: row {i}: latency must be > 0")
            out[cells[0].strip()] = value
    return out
