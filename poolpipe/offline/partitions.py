"""Partition files: blocks [start, end) of an onboarded model as one ONNX model that a stage
worker serves, with positional tensor names and fp16 feature maps at its boundaries.

A partition's inputs are the tensors crossing into its first block, named `in_0, in_1, ...`;
its outputs those crossing out of its last block, `out_0, ...` (the next partition's inputs,
in the same order). Boundary tensors travel as fp16; Cast nodes inside the file convert
them, so the same file serves on any engine (ONNX Runtime in a Python-backend model here,
Triton's onnxruntime or TensorRT backends on GPU nodes). The first partition takes the
model's own inputs and the last returns the model's own outputs, both as the model has them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from poolpipe.errors import ModelError
from poolpipe.offline.onnxgraph import BATCH_DIM, cut_table, extract_block, load_model, tensor_infos

WIRE_DTYPE = np.float16  # feature maps between stages


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the partition's name for it (in_k / out_k, or the model's own name)
    dtype: np.dtype
    dims: tuple[int, ...]  # without the batch dimension


def row_bytes(specs: Iterable[TensorSpec]) -> float:
    """The bytes of one row (a request's share of a batch) of each of these tensors."""
    return float(sum(np.dtype(t.dtype).itemsize * math.prod(t.dims) for t in specs))


@dataclass(frozen=True)
class PartitionFile:
    model: str
    start: int  # blocks [start, end)
    end: int
    path: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def partition_name(model: str, start: int, end: int, tag: str = "") -> str:
    """Name of the Triton model serving blocks [start, end) of `model`; `tag` tells the
    models of one rollout generation from the next (both are loaded during a rollout)."""
    return f"{model}__b{start:02d}-{end:02d}" + (f"__{tag}" if tag else "")


def _spec(name: str, dtype: np.dtype, shape: tuple) -> TensorSpec:
    dims = tuple(int(d) if isinstance(d, int) and d > 0 else -1 for d in shape[1:])
    return TensorSpec(name, np.dtype(dtype), dims)


def make_partition(
    whole_path: Path,
    model: str,
    block_layers: list[tuple[int, int]],
    start: int,
    end: int,
    out_dir: Path,
    tag: str = "",
    offset: int = 0,
) -> PartitionFile:
    """Write blocks [start, end) (layer ranges `block_layers`) of the model at `whole_path`
    as one ONNX file with fp16 boundaries; return where it is and its tensors. `offset`:
    `model` is a segment of the model at `whole_path` beginning at that block
    (domain/entry.py): its blocks [start, end) are the whole model's [start + offset,
    end + offset), named by the segment's own indices."""
    if not 0 <= start + offset < end + offset <= len(block_layers) or offset < 0:
        raise ModelError(
            f"{model}: partition [{start}, {end}) is outside its {len(block_layers)} blocks"
            + (f" (from block {offset})" if offset else "")
        )
    whole = load_model(whole_path, model)
    table = cut_table(whole, model)
    a, b = block_layers[start + offset][0], block_layers[end + offset - 1][1]
    part = extract_block(whole, table, a, b)
    infos = tensor_infos(whole)
    first, last = start + offset == 0, end + offset == len(block_layers)
    g = part.graph
    wire = helper.np_dtype_to_tensor_dtype(np.dtype(WIRE_DTYPE))
    casts_in, casts_out = [], []
    ins: list[TensorSpec] = []
    outs: list[TensorSpec] = []
    for k, vi in enumerate(list(g.input)):
        info = infos[vi.name]
        if first:
            ins.append(_spec(vi.name, info.dtype, info.shape))
            continue
        _check_float(model, start, end, vi.name, info.dtype)
        new = f"in_{k}"
        casts_in.append(
            helper.make_node(
                "Cast", [new], [vi.name], to=vi.type.tensor_type.elem_type, name=f"cast_{new}"
            )
        )
        g.input.remove(vi)
        g.input.insert(k, helper.make_tensor_value_info(new, wire, [BATCH_DIM, *info.shape[1:]]))
        ins.append(_spec(new, np.dtype(WIRE_DTYPE), info.shape))
    for k, vo in enumerate(list(g.output)):
        info = infos[vo.name]
        if last:
            outs.append(_spec(vo.name, info.dtype, info.shape))
            continue
        _check_float(model, start, end, vo.name, info.dtype)
        new = f"out_{k}"
        casts_out.append(helper.make_node("Cast", [vo.name], [new], to=wire, name=f"cast_{new}"))
        g.output.remove(vo)
        g.output.insert(k, helper.make_tensor_value_info(new, wire, [BATCH_DIM, *info.shape[1:]]))
        outs.append(_spec(new, np.dtype(WIRE_DTYPE), info.shape))
    nodes = casts_in + list(g.node) + casts_out
    del g.node[:]
    g.node.extend(nodes)
    try:
        onnx.checker.check_model(part)
    except Exception as exc:
        raise ModelError(f"{model}: partition [{start}, {end}) is not valid ({exc})") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{partition_name(model, start, end, tag)}.onnx"
    onnx.save(part, str(path))
    return PartitionFile(model, start, end, path, tuple(ins), tuple(outs))


def _check_float(model: str, start: int, end: int, tensor: str, dtype: np.dtype) -> None:
    if dtype.kind != "f":
        raise ModelError(
            f"{model}: partition [{start}, {end}): boundary tensor {tensor!r} is {dtype}, but "
            "feature maps between stages travel as fp16; cut the model elsewhere"
        )
