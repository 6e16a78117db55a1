"""Split an ONNX model into block files: load → layer profile → cuts → pre-partition →
graphsurgeon extraction; and check that the blocks in sequence reproduce the whole model.

The block files of one split go into one folder (`block_NN.onnx` plus `whole.onnx`, the
checked model with constants folded into initializers), which the caller publishes once
everything else has succeeded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from poolpipe.errors import ModelError
from poolpipe.offline.cuts import CutPolicy, Partitioning, given_cuts, prepartition
from poolpipe.offline.onnxgraph import (
    InputShapes,
    cut_table,
    extract_block,
    load_model,
    measure_shapes,
    memory_of,
    profile_layers,
    random_inputs,
    session,
)

WHOLE_FILE = "whole.onnx"

# progress(step, done, total): how far a long step has come
Progress = Callable[[str, int, int], None]


def block_file(index: int) -> str:
    return f"block_{index:02d}.onnx"


@dataclass(frozen=True)
class BlockFile:
    index: int
    layer_start: int  # layers [layer_start, layer_end) in graph order
    layer_end: int
    first_layer: str
    path: Path
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    out_bytes: float  # bytes of all outputs at batch 1: the boundary after this block
    layer_us: float  # sum of its layers in the (unoptimized) layer profile


@dataclass(frozen=True)
class SplitResult:
    model: str
    source: Path
    sha256: str
    folder: Path
    layers: int
    partitioning: Partitioning
    blocks: tuple[BlockFile, ...]
    # what a vGPU holds of it (onnxgraph.memory_of): its weights, and its largest tensor in
    # and out per sample
    weight_bytes: float | None = None
    activation_bytes: float | None = None

    @property
    def whole_path(self) -> Path:
        return self.folder / WHOLE_FILE

    def moved_to(self, folder: Path) -> SplitResult:
        """The same split after its folder was renamed to `folder`."""
        blocks = tuple(
            BlockFile(**{**b.__dict__, "path": folder / b.path.name}) for b in self.blocks
        )
        return replace(self, folder=folder, blocks=blocks)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_model(
    path: Path,
    name: str,
    folder: Path,
    *,
    n_blocks: int = 10,
    policy: CutPolicy | None = None,
    method: str = "balanced",
    layer_runs: int = 3,
    threads: int = 1,
    progress: Progress | None = None,
    cuts: Sequence[int] | None = None,
    input_shapes: InputShapes | None = None,
) -> SplitResult:
    """Cut the model at `path` into `n_blocks` block files written to `folder` (at the
    layer positions `cuts`, 0 and N included, where given: then `n_blocks` is unused),
    its inputs' non-batch dimensions set from `input_shapes` where given."""
    path = Path(path)
    model = load_model(path, name, input_shapes)
    if progress:
        progress("split: tensor shapes", 0, 1)
    model = measure_shapes(model, name)
    if len(model.graph.node) < 2:
        raise ModelError(
            f"{name}: split: the model has {len(model.graph.node)} layer(s), so there is no "
            "cut to split it at; onboard a model with at least two layers"
        )
    if progress:
        progress("split: layer profile", 0, 1)
    layers = profile_layers(model, name, runs=layer_runs, threads=threads)
    if progress:
        progress("split: layer profile", 1, 1)
    table = cut_table(model, name, layers)
    part = (
        given_cuts(table, cuts)
        if cuts is not None
        else prepartition(table, n_blocks, policy=policy, method=method)
    )
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / WHOLE_FILE))
    blocks = []
    for k, (a, b) in enumerate(part.blocks):
        if progress:
            progress("split: extract blocks", k, len(part.blocks))
        block = extract_block(model, table, a, b)
        out = folder / block_file(k)
        onnx.save(block, str(out))
        blocks.append(
            BlockFile(
                index=k,
                layer_start=a,
                layer_end=b,
                first_layer=table.layers[a],
                path=out,
                inputs=table.crossing[a],
                outputs=table.crossing[b],
                out_bytes=table.crossing_bytes[b],
                layer_us=part.block_us[k],
            )
        )
    if progress:
        progress("split: extract blocks", len(part.blocks), len(part.blocks))
    weights, activations = memory_of(model)
    return SplitResult(
        model=name,
        source=path.resolve(),
        sha256=sha256_of(path),
        folder=folder,
        layers=len(table.layers),
        partitioning=part,
        blocks=tuple(blocks),
        weight_bytes=weights,
        activation_bytes=activations,
    )


def run_in_sequence(
    blocks: Sequence[onnx.ModelProto],
    feeds: dict[str, np.ndarray],
    outputs: Sequence[str],
    boundary_dtype: type | None = None,
) -> list[np.ndarray]:
    """Run blocks one after another, each fed from what came before; optionally cast every
    boundary feature map to `boundary_dtype` and back (what the serving path does)."""
    values = dict(feeds)
    for block in blocks:
        ins = {i.name: values[i.name] for i in block.graph.input}
        outs = session(block).run(None, ins)
        for o, v in zip(block.graph.output, outs, strict=True):
            values[o.name] = (
                v.astype(boundary_dtype).astype(v.dtype)
                if boundary_dtype is not None and v.dtype.kind == "f"
                else v
            )
    return [values[o] for o in outputs]


def verify_split(split: SplitResult, batch: int = 2, seed: int = 0) -> tuple[float, float]:
    """Max abs error of the blocks in sequence against the whole model, over the output's
    scale (max abs), in fp32 and with fp16 boundaries. Raises if fp32 exceeds 1e-4.
    A model with a fixed batch dimension is checked at that batch size."""
    whole = onnx.load(str(split.whole_path))
    fixed = {
        d.dim_value
        for i in whole.graph.input
        for d in i.type.tensor_type.shape.dim[:1]
        if d.HasField("dim_value") and d.dim_value > 0
    }
    batch = min(fixed) if fixed else batch
    blocks = [onnx.load(str(b.path)) for b in split.blocks]
    feeds = random_inputs(whole, batch, seed=seed)
    names = [o.name for o in whole.graph.output]
    try:
        want = session(whole).run(None, feeds)
        got32 = run_in_sequence(blocks, feeds, names)
        got16 = run_in_sequence(blocks, feeds, names, np.float16)
    except Exception as exc:
        raise ModelError(
            f"{split.model}: verify: running at batch {batch} failed ({exc})"
        ) from None
    errors = []
    for got in (got32, got16):
        err = 0.0
        for w, g in zip(want, got, strict=True):
            scale = float(np.abs(w).max()) or 1.0
            err = max(err, float(np.abs(g.astype(np.float64) - w).max()) / scale)
        errors.append(err)
    if not errors[0] <= 1e-4:
        raise ModelError(
            f"{split.model}: verify: the blocks in sequence differ from the whole model by "
            f"{errors[0]:.2e} of the output scale (limit 1e-4); the split is wrong"
        )
    return errors[0], errors[1]
