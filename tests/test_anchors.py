"""Layout anchors (poolpipe.offline.anchors): exact outputs, residual adds fused again by ONNX
Runtime's CPU layout pass, and applied where CPU engines load files (profiler engine, stage
workers)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from poolpipe.offline.anchors import SUFFIX, anchor_inputs, anchored_file
from poolpipe.offline.cuts import CutPolicy
from poolpipe.offline.engines import OrtEngine
from poolpipe.offline.onnxgraph import random_inputs, session
from poolpipe.offline.partitions import make_partition
from poolpipe.offline.split import split_model
from poolpipe.offline.zoo import make_model
from triton_backend.node.repository import render_partition


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout")
    path = make_model("resnet50", tmp / "r.onnx", width=0.25, image=32)
    # two-tensor cuts: blocks that start inside a residual block get the skip as an input
    return split_model(
        path, "r", tmp / "blocks", n_blocks=8, layer_runs=1, policy=CutPolicy(max_tensors=2)
    )


def _mid_residual(split):
    """A block whose input feeds a residual add (where it is cut depends on layer timings)."""
    for b in split.blocks:
        if any(
            n.op_type == "Add" and set(n.input) & set(b.inputs)
            for n in onnx.load(str(b.path)).graph.node
        ):
            return b
    raise AssertionError(f"no block starts inside a residual block: {split.partitioning.cuts}")


def _optimized_ops(model: onnx.ModelProto, tmp_path) -> Counter:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def test_anchors_are_exact_and_let_residual_adds_fuse(split, tmp_path):
    block = onnx.load(str(_mid_residual(split).path))
    anchored, added = anchor_inputs(block)
    assert added >= 1
    assert any(n.name.endswith(SUFFIX) for n in anchored.graph.node)
    onnx.checker.check_model(anchored)
    feeds = random_inputs(block, 3, seed=2)
    # as written the anchor is exact (x * 1); optimized, the fused kernels sum in another order
    plain = [session(m, optimize=False).run(None, feeds) for m in (anchored, block)]
    for got, want in zip(*plain, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(
        session(anchored).run(None, feeds), session(block).run(None, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    before, after = _optimized_ops(block, tmp_path), _optimized_ops(anchored, tmp_path)
    assert before["Add"] > 0, "ONNX Runtime fused the block's adds without help"
    assert after["Add"] == 0  # every residual add fused into its convolution


def test_a_model_without_such_inputs_is_returned_as_is(split):
    first = onnx.load(str(split.blocks[0].path))  # image input feeds a convolution only
    model, added = anchor_inputs(first)
    assert added == 0 and model is first


def test_the_cpu_engine_runs_anchored_blocks(split):
    b = _mid_residual(split)
    assert anchored_file(b.path) is not None  # what the engine hands ONNX Runtime
    eng = OrtEngine(threads=1)
    runner = eng.load(eng.build(b.path, "r", "block", 8), "r", "block")
    block = onnx.load(str(b.path))
    feeds = random_inputs(block, 2, seed=3)
    runner.bind(feeds)
    runner.execute()
    for got, want in zip(runner.outputs(), session(block).run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fp16_partitions_are_anchored_after_their_cast_in_the_stage_repository(split, tmp_path):
    k = split.blocks.index(_mid_residual(split))
    layers = [(b.layer_start, b.layer_end) for b in split.blocks]
    part = make_partition(split.whole_path, "r", layers, k, len(layers), tmp_path / "parts")
    folder = render_partition(part, tmp_path / "repo", backend="python")
    served = onnx.load(str(folder / "1" / "model.onnx"))
    anchors = [n for n in served.graph.node if n.name.endswith(SUFFIX)]
    assert anchors, "the stage worker's model has no anchor"
    casts = {n.output[0] for n in served.graph.node if n.op_type == "Cast"}
    assert all(a.input[0] in casts for a in anchors)  # on the fp32 side of the boundary
    original = onnx.load(str(part.path))
    feeds = random_inputs(original, 2, seed=4)
    for got, want in zip(
        session(served, optimize=False).run(None, feeds),
        session(original, optimize=False).run(None, feeds),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


def test_the_nodes_file_is_made_where_the_partition_is_cut(split, tmp_path):
    """write_node_onnx (run in a rollout's cutting process) leaves beside each partition
    the file a CPU node runs, so that loading reads bytes instead of anchoring under the
    router's GIL: anchored where anchors are needed, the partition itself (a link)
    otherwise; a node file older than its partition is not used."""
    from triton_backend.node.repository import node_onnx, node_onnx_path, write_node_onnx

    layers = [(b.layer_start, b.layer_end) for b in split.blocks]
    k = split.blocks.index(_mid_residual(split))
    mid = make_partition(split.whole_path, "r", layers, k, k + 1, tmp_path / "parts")
    first = make_partition(split.whole_path, "r", layers, 0, 1, tmp_path / "parts")
    for part in (mid, first):
        want = node_onnx(part)  # made here: no node file yet
        assert not node_onnx_path(part).exists()
        write_node_onnx(part)
        assert node_onnx_path(part).read_bytes() == want == node_onnx(part)
    assert node_onnx(mid) != mid.path.read_bytes()  # anchored
    assert node_onnx_path(first).samefile(first.path)  # needs none: the partition itself
    stale = node_onnx_path(mid)
    stale.write_bytes(b"not onnx")
    os.utime(stale, ns=(1, 1))
    made = node_onnx(mid)  # made anew from the partition, as before the file was written
    assert made != b"not onnx" and onnx.load_from_string(made).graph.node
