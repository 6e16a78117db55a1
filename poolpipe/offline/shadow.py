"""Shadow models: an ONNX stand-in for a profiled model whose blocks move the real bytes.

An emulated GPU node (docs/serving.md, "Emulated GPUs") takes its timing from a profile,
but the network must still carry what the real model would send. A shadow model is built
from an imported profile (PPipe layout: `boundary-bytes/<model>.csv` and
`layers/<model>/{shapes,cuts}.json`): the model's real input (name, dtype, shape), one block
per profiled block, each giving a feature map that is exactly the profiled boundary size on
the wire (fp32 in the model, sent as fp16 between partitions like any feature map), and the
model's real output. The compute is a copy with zero padding or cropping (ONNX `Pad`):
trivial next to the emulated time. The planner's transfer model counts the profiled bytes
(the warehouse keeps them, not the cut table's fp32 sizes).

Block 0 is Flatten → Pad; blocks 1..B-2 are one Pad each; the last block is Pad → Reshape
to the real output (with a Cast where the input or output is not fp32). The shadow is
onboarded like any model, cut at exactly these block boundaries (`ShadowModel.cuts`, layer
positions), under the profiled model's name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import ProfileError
from poolpipe.offline.onnxgraph import BATCH_DIM
from poolpipe.offline.partitions import WIRE_DTYPE, TensorSpec
from poolpipe.offline.zoo import IR_VERSION, OPSET

WIRE_BYTES = np.dtype(WIRE_DTYPE).itemsize


@dataclass(frozen=True)
class ShadowModel:
    model: str
    path: Path
    cuts: tuple[int, ...]  # layer positions of the block boundaries, 0 and N included
    boundary_bytes: tuple[int, ...]  # bytes leaving block i at batch 1 (wire dtype)
    input: TensorSpec
    output: TensorSpec


def _tensor(shapes: dict, name: str, where: Path) -> TensorSpec:
    entry = shapes.get(name)
    if entry is None:
        raise ProfileError(f"{where}: no entry for tensor {name!r}")
    try:
        dtype = np.dtype(entry["dtype"])
        shape = [int(d) for d in entry["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: tensor {name!r}: bad dtype or shape ({exc})") from None
    if len(shape) < 2 or shape[0] != -1 or any(d < 1 for d in shape[1:]):
        raise ProfileError(
            f"{where}: tensor {name!r} has shape {shape}; a shadow needs -1 (the batch) "
            "first and positive sizes after it"
        )
    return TensorSpec(name, dtype, tuple(shape[1:]))


def model_io(root: Path, model: str) -> tuple[TensorSpec, TensorSpec]:
    """The model's input and output (one each) from `layers/<model>/{cuts,shapes}.json`."""
    layers = Path(root) / "layers" / model
    cuts_file, shapes_file = layers / "cuts.json", layers / "shapes.json"
    for f in (cuts_file, shapes_file):
        if not f.is_file():
            raise ProfileError(
                f"{f}: file is missing; a shadow model needs the model's input and output "
                "shapes (the PPipe artifact's layers/<model>/ folder)"
            )
    try:
        cuts = json.loads(cuts_file.read_text())
        shapes = json.loads(shapes_file.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{layers}: not valid JSON ({exc})") from None
    if not isinstance(cuts, list) or len(cuts) < 2 or not isinstance(shapes, dict):
        raise ProfileError(f"{cuts_file}: expected a list of cut positions (at least two)")
    first = cuts[0].get("cut", []) if isinstance(cuts[0], dict) else []
    # the last entry is the position after the output; the one before it, after the last node
    last = cuts[-2].get("cut", []) if isinstance(cuts[-2], dict) else []
    if len(first) != 1 or len(last) != 1:
        raise ProfileError(
            f"{cuts_file}: a shadow model needs one input and one output tensor, found "
            f"{len(first)} and {len(last)}"
        )
    return _tensor(shapes, first[0], shapes_file), _tensor(shapes, last[0], shapes_file)


def _pad(src: str, dst: str, width: int, nodes: list, inits: list, k: int) -> None:
    """(B, n) -> (B, n + width): zeros appended, or the tail cropped where width < 0."""
    pads = f"pads_{k}"
    inits.append(numpy_helper.from_array(np.array([0, 0, 0, width], dtype=np.int64), pads))
    nodes.append(helper.make_node("Pad", [src, pads], [dst], name=f"block{k}/pad"))


def make_shadow(root: Path, profile: ModelProfile, out: Path) -> ShadowModel:
    """Write the shadow of `profile` (imported from `root`: its boundary sizes are the
    profile's, its input and output come from `root`'s layers folder) to `out`."""
    root, model = Path(root), profile.name
    boundary = []
    for i, b in enumerate(profile.boundary_bytes):
        if b < WIRE_BYTES:
            raise ProfileError(
                f"{root / 'boundary-bytes' / f'{model}.csv'}: row {i + 1}: {b:g} bytes is no "
                "feature map"
            )
        boundary.append(math.ceil(b / WIRE_BYTES) * WIRE_BYTES)
    inp, outp = model_io(root, model)
    n_in, n_out = math.prod(inp.dims), math.prod(outp.dims)  # per sample
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []

    def info(name: str, dtype: int, n: int) -> None:
        infos.append(helper.make_tensor_value_info(name, dtype, [BATCH_DIM, n]))

    src_dtype = helper.np_dtype_to_tensor_dtype(inp.dtype)
    f32 = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32))
    nodes.append(helper.make_node("Flatten", [inp.name], ["flat"], axis=1, name="block0/flatten"))
    info("flat", src_dtype, n_in)
    prev = "flat"
    if inp.dtype != np.float32:  # feature maps are floats (partitions send them as fp16)
        nodes.append(helper.make_node("Cast", ["flat"], ["flat32"], to=f32, name="block0/cast"))
        info("flat32", f32, n_in)
        prev = "flat32"
    cuts = [0]
    width = n_in
    for k, b in enumerate(boundary):
        n = b // WIRE_BYTES  # fp32 in the model, fp16 (b bytes) on the wire
        name = f"fmap_{k}"
        _pad(prev, name, n - width, nodes, inits, k)
        info(name, f32, n)
        cuts.append(len(nodes))
        prev, width = name, n
    last = len(boundary)
    _pad(prev, "tail", n_out - width, nodes, inits, last)
    info("tail", f32, n_out)
    if outp.dtype != np.float32:
        out_dtype = helper.np_dtype_to_tensor_dtype(outp.dtype)
        nodes.append(helper.make_node("Cast", ["tail"], ["tail_c"], to=out_dtype, name="out/cast"))
        info("tail_c", out_dtype, n_out)
        prev = "tail_c"
    else:
        out_dtype, prev = f32, "tail"
    inits.append(numpy_helper.from_array(np.array([-1, *outp.dims], dtype=np.int64), "out_shape"))
    nodes.append(helper.make_node("Reshape", [prev, "out_shape"], [outp.name], name="out/shape"))
    cuts.append(len(nodes))
    graph = helper.make_graph(
        nodes,
        f"{model}-shadow",
        [helper.make_tensor_value_info(inp.name, src_dtype, [BATCH_DIM, *inp.dims])],
        [helper.make_tensor_value_info(outp.name, out_dtype, [BATCH_DIM, *outp.dims])],
        inits,
        value_info=infos,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    proto.ir_version = IR_VERSION
    proto.doc_string = (
        f"shadow of {model}: the real input/output and boundary sizes from {root}, "
        "trivial compute; its timing is emulated from the GPU profiles"
    )
    onnx.checker.check_model(proto)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(out))
    return ShadowModel(model, out, tuple(cuts), tuple(boundary), inp, outp)
