"""Layout anchors: keep a block's residual adds fused on ONNX Runtime's CPU engine.

On x86, ONNX Runtime rewrites convolutions to a blocked channel layout (NCHWc) and fuses each
residual `Add` (and the `Relu` after it) into the convolution that produces one of its
operands, provided *both* operands are in that layout. Inside a whole model they are. A
block cut out of the middle of a residual network gets its skip tensor as a graph input in
plain NCHW, which the layout pass converts only for convolutions, so the `Add` stays an
unfused NCHW kernel, its output stays NCHW, and every later residual add of the block is
left unfused too, with a layout reorder before and after each. Measured on ResNet-50 cut in
10 blocks (batch 4, one thread): the blocks spent 8.0 ms in unfused adds, 4.8 ms in
relus and 33 ms in reorders, against 313 ms of convolutions.

The fix is an *anchor*: a depthwise 1x1 convolution with unit weights on such an input. It
computes x · 1 = x exactly, and being a convolution it is converted to NCHWc, so the input
enters the block's graph in the blocked layout and every add downstream fuses as in the
whole model. It is applied when the engine loads a file (ONNX Runtime on CPU, and the CPU
stage workers), never to the block files themselves, which stay engine-neutral.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

# NCHWc block size is 8 (AVX2) or 16 (AVX-512) channels; a multiple of 16 converts on both.
CHANNEL_ALIGN = 16
# Consumers that need every operand in the blocked layout to run (and fuse) in it.
NEEDS_ALL_BLOCKED = frozenset({"Add", "Sum", "Mul", "Concat"})
SUFFIX = "__nchwc_anchor"


def _channels(vi: onnx.ValueInfoProto, fp32_only: bool) -> int | None:
    """Channel count of a 4-D tensor (fp32 only, unless it is a Cast's source)."""
    tt = vi.type.tensor_type
    if len(tt.shape.dim) != 4 or (fp32_only and tt.elem_type != onnx.TensorProto.FLOAT):
        return None
    c = tt.shape.dim[1]
    return c.dim_value if c.HasField("dim_value") and c.dim_value > 0 else None


def anchor_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of `model` with an anchor on every 4-D float input (or fp32 Cast of an input,
    as in fp16-boundary partitions) that feeds an add, sum, mul or concat and whose channel
    count converts to NCHWc; and how many anchors were added (0: the model is returned)."""
    g = model.graph
    consts = {t.name for t in g.initializer}
    shapes: dict[str, onnx.ValueInfoProto] = {
        vi.name: vi for vi in list(g.input) + list(g.value_info)
    }
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    graph_inputs = [i.name for i in g.input if i.name not in consts]
    # entry tensor -> index of the node after which its anchor goes (-1: before all nodes)
    entries: dict[str, int] = {}
    for name in graph_inputs:
        entries[name] = -1
    for k, node in enumerate(g.node):
        if (
            node.op_type == "Cast"
            and node.input[0] in graph_inputs
            and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in node.attribute)
        ):
            entries[node.output[0]] = k
    chosen: dict[str, tuple[int, int]] = {}  # entry -> (after index, channels)
    for name, after in entries.items():
        users = consumers.get(name, [])
        if not any(u.op_type in NEEDS_ALL_BLOCKED for u in users):
            continue
        src = name if after < 0 else g.node[after].input[0]
        vi = shapes.get(name) or shapes.get(src)
        if vi is None:
            continue
        c = _channels(vi, fp32_only=after < 0)
        if c is None or c % CHANNEL_ALIGN:
            continue
        chosen[name] = (after, c)
    if not chosen:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    anchored = {name: name + SUFFIX for name in chosen}
    for node in og.node:
        for i, x in enumerate(node.input):
            if x in anchored:
                node.input[i] = anchored[x]
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    for name, (after, c) in chosen.items():
        weight = numpy_helper.from_array(np.ones((c, 1, 1, 1), np.float32), name + SUFFIX + "_w")
        og.initializer.append(weight)
        new_nodes.setdefault(after, []).append(
            helper.make_node(
                "Conv",
                [name, weight.name],
                [anchored[name]],
                name=name + SUFFIX,
                group=c,
                kernel_shape=[1, 1],
            )
        )
    nodes = list(new_nodes.get(-1, []))
    for k, node in enumerate(og.node):
        nodes.append(node)
        nodes.extend(new_nodes.get(k, []))
    del og.node[:]
    og.node.extend(nodes)
    return out, len(chosen)


def anchored_file(path: Path) -> onnx.ModelProto | None:
    """The ONNX file at `path` with anchors, or None when it needs none, cannot be read (the
    engine that loads it names what is wrong), or keeps its weights in external files (an
    in-memory copy would lose them)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None
    model, added = anchor_inputs(model)
    return model if added else None
