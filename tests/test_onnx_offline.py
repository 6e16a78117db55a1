"""Offline pipeline on real ONNX models run with ONNX Runtime: generated architectures, cut
analysis, pre-partitioning, graphsurgeon block extraction and numerical equivalence."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.errors import ModelError, UnknownNameError
from poolpipe.offline.cuts import CutPolicy, CutTable, crossing_from_lifetimes, prepartition
from poolpipe.offline.layerdata import layer_cut_table
from poolpipe.offline.onnxgraph import (
    cut_table,
    extract_block,
    load_model,
    measure_shapes,
    parse_input_shapes,
    profile_layers,
    random_inputs,
    session,
)
from poolpipe.offline.split import split_model, verify_split
from poolpipe.offline.zoo import ZOO, make_model
from tests.factories import dynamic_classifier

SMALL = {"resnet50": (0.125, 32), "efficientnet": (0.25, 32), "unet": (0.125, 32)}


@pytest.fixture(scope="module", params=list(ZOO))
def small_model(request, tmp_path_factory):
    name = request.param
    width, image = SMALL[name]
    path = make_model(
        name, tmp_path_factory.mktemp(name) / f"{name}.onnx", width=width, image=image
    )
    model = load_model(path, name)
    return name, model, cut_table(model, name, profile_layers(model, name, runs=2))


def run_blocks(model, table, bounds, feeds, cast=None):
    values = dict(feeds)
    for a, b in itertools.pairwise(bounds):
        block = extract_block(model, table, a, b)
        ins = {i.name: values[i.name] for i in block.graph.input}
        outs = session(block).run(None, ins)
        for o, v in zip(block.graph.output, outs, strict=True):
            values[o.name] = v.astype(cast).astype(v.dtype) if cast is not None else v
    return [values[o.name] for o in model.graph.output]


def test_generated_models_have_a_dynamic_batch(small_model):
    name, model, _ = small_model
    sess = session(model)
    for batch in (1, 3):
        out = sess.run(None, random_inputs(model, batch))[0]
        assert out.shape[0] == batch and np.isfinite(out).all(), name


def test_blocks_in_sequence_reproduce_the_model(small_model):
    name, model, table = small_model
    part = prepartition(table, 6)
    feeds = random_inputs(model, 2, seed=3)
    want = session(model).run(None, feeds)[0]
    got = run_blocks(model, table, part.cuts, feeds)[0]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, name
    # fp16 feature maps between blocks: a measurable but small error
    half = run_blocks(model, table, part.cuts, feeds, cast=np.float16)[0]
    err = np.abs(half - want).max() / scale
    assert 0 < err < 5e-2, (name, err)


def test_unet_skips_cross_the_middle_cuts(tmp_path: Path):
    width, image = SMALL["unet"]
    model = load_model(make_model("unet", tmp_path / "u.onnx", width=width, image=image))
    table = cut_table(model, "unet")
    widest = max(len(c) for c in table.crossing)
    assert widest >= 4  # input of the bottleneck plus the open skip connections
    assert len(table.crossing[-1]) == 1  # the logits
    assert len(table.valid_cuts(CutPolicy(1))) < len(table.valid_cuts(CutPolicy(widest)))


def test_constants_never_cross_a_cut(tmp_path: Path):
    from onnx import TensorProto, helper, numpy_helper, save

    nodes = [
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node(
            "Constant", [], ["bias"], value=numpy_helper.from_array(np.ones(4, np.float32))
        ),
        helper.make_node("Relu", ["x"], ["r1"], name="r1"),
        helper.make_node("Relu", ["r1"], ["r2"], name="r2"),
        helper.make_node("Mul", ["r2", "two"], ["m"], name="m"),
        helper.make_node("Add", ["m", "bias"], ["y"], name="y"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "consts", io[:1], io[1:])
    path = tmp_path / "consts.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    model = load_model(path)
    table = cut_table(model, "consts")
    assert table.layers == ("r1", "r2", "m", "y")
    assert table.crossing == (("x",), ("r1",), ("r2",), ("m",), ("y",))
    feeds = random_inputs(model, 2)
    want = session(model).run(None, feeds)[0]
    assert np.array_equal(run_blocks(model, table, (0, 1, 2, 3, 4), feeds)[0], want)


def test_crossing_sets_by_hand():
    # x -> a -> b -> c(out); x also read by c: x crosses every cut until c
    life = [("x", -1, 2, 4.0), ("a", 0, 1, 8.0), ("b", 1, 2, 8.0), ("c", 2, 3, 4.0)]
    crossing, sizes = crossing_from_lifetimes(3, life)
    assert crossing == (("x",), ("x", "a"), ("x", "b"), ("c",))
    assert sizes == (4.0, 12.0, 12.0, 4.0)


def _table(lat, crossing=None):
    n = len(lat)
    cross = crossing or tuple(("t",) for _ in range(n + 1))
    return CutTable("m", tuple(f"l{i}" for i in range(n)), tuple(lat), cross, (1.0,) * (n + 1))


def test_balanced_split_by_hand():
    part = prepartition(_table([1, 1, 1, 1, 4]), 2)
    assert part.cuts == (0, 4, 5) and part.block_us == (4.0, 4.0) and part.balance == 1.0


@settings(max_examples=60, deadline=None)
@given(
    lat=st.lists(st.integers(1, 20), min_size=4, max_size=9),
    blocks=st.integers(2, 4),
)
def test_balanced_split_is_optimal(lat, blocks):
    blocks = min(blocks, len(lat))
    part = prepartition(_table(lat), blocks, method="balanced")
    mean = sum(lat) / blocks
    prefix = np.concatenate([[0], np.cumsum(lat)])

    def cost(cuts):
        b = (0, *cuts, len(lat))
        return sum((prefix[y] - prefix[x] - mean) ** 2 for x, y in itertools.pairwise(b))

    best = min(cost(c) for c in itertools.combinations(range(1, len(lat)), blocks - 1))
    assert cost(part.cuts[1:-1]) == pytest.approx(best)
    greedy = prepartition(_table(lat), blocks, method="greedy")
    assert len(greedy.block_us) == blocks and min(greedy.block_us) > 0


def test_too_few_valid_cuts_is_named():
    wide = tuple(("a", "b") for _ in range(6))
    with pytest.raises(ModelError, match="needs 4 valid cuts"):
        prepartition(_table([1] * 5, wide), 5, relax=False)
    # widening the policy finds them
    assert prepartition(_table([1] * 5, wide), 5).policy.max_tensors == 2


def test_bad_files_and_names(tmp_path: Path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf")
    with pytest.raises(ModelError, match=r"junk: load: .* not a valid ONNX model"):
        load_model(junk)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "missing.onnx", "missing")
    with pytest.raises(UnknownNameError, match="unknown model 'vgg'"):
        make_model("vgg", tmp_path / "x.onnx")


def test_shipped_layer_data_prepartitions(ppipe_dir):
    layers = ppipe_dir / "layers"
    for model in sorted(p.name for p in layers.iterdir())[:6]:
        table = layer_cut_table(layers, model, "L4")
        part = prepartition(table, 10)
        assert len(part.block_us) == 10 and part.balance < 3, model
        assert sum(part.block_us) == pytest.approx(sum(table.latency_us))


def test_a_models_memory_is_its_weights_and_its_largest_tensors(small_model):
    """What a vGPU holds of a model (memory_of): its initializers' bytes, and twice its
    largest tensor per sample, each counted by hand from the file."""
    from poolpipe.offline.onnxgraph import memory_of, tensor_infos

    name, model, _ = small_model
    weights, activations = memory_of(model)
    by_hand = sum(
        int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for t in model.graph.initializer
    )
    assert weights == by_hand > 0, name
    largest = max(
        b for b in (i.bytes_at_batch1() for i in tensor_infos(model).values()) if np.isfinite(b)
    )
    assert activations == 2 * largest > 0, name


def test_a_dynamic_image_size_is_refused_at_load_and_given_with_input_shape(tmp_path: Path):
    path = dynamic_classifier(tmp_path / "cls.onnx")
    with pytest.raises(ModelError, match=r"input 'x' has dimensions \?x3x\?x\?.*--input-shape x="):
        load_model(path, "cls")
    with pytest.raises(
        ModelError, match="'images', which is not an input of the model; its inputs: x"
    ):
        load_model(path, "cls", parse_input_shapes(["images=3x32x32"]))
    with pytest.raises(ModelError, match=r"gives 2 dimension.* the input has 3"):
        load_model(path, "cls", parse_input_shapes(["x=32x32"]))
    with pytest.raises(ModelError, match="fixes dimension 1 at 3"):
        load_model(path, "cls", parse_input_shapes(["x=4x32x32"]))
    for bad in ("x", "x=", "x=3x0x32", "x=3xax32", "=3x32x32"):
        with pytest.raises(ModelError, match="write NAME=DIMS"):
            parse_input_shapes([bad])
    split = split_model(
        path, "cls", tmp_path / "blocks", n_blocks=3, input_shapes=parse_input_shapes(["x=3x24x20"])
    )
    verify_split(split)
    # the blocks in sequence answer as the original file does at that size, at any batch
    original = session(onnx.load(str(path)))
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 24, 20)).astype(np.float32)
        values = {"x": x}
        for b in split.blocks:
            block = onnx.load(str(b.path))
            outs = session(block).run(None, {i.name: values[i.name] for i in block.graph.input})
            values.update(zip([o.name for o in block.graph.output], outs, strict=True))
        want = original.run(None, {"x": x})[0]
        assert values["probs"].shape == (batch, 4)
        assert np.abs(values["probs"] - want).max() <= 1e-5


def test_cuts_never_cross_a_shape_tensor(tmp_path: Path):
    path = dynamic_classifier(tmp_path / "cls.onnx")
    model = measure_shapes(load_model(path, "cls", {"x": (3, 16, 16)}), "cls")
    table = cut_table(model, "cls", profile_layers(model, "cls", runs=2))
    convs = range(4, 12)  # positions among the convolutions: the Reshape target crosses them
    assert all(table.not_data[i] == ("target",) for i in convs)
    part = prepartition(table, 3)  # relaxed to more tensors per cut, as onboarding does
    assert not set(part.cuts) & set(convs)
    assert all(table.carries_data(c) for c in part.cuts)
    with pytest.raises(ModelError, match=r"11 of its 14 positions are crossed by a shape or index"):
        prepartition(table, 5)
    # without the rule, the relaxed search would cut among the convolutions
    blind = CutTable(
        table.model, table.layers, table.latency_us, table.crossing, table.crossing_bytes
    )
    assert set(prepartition(blind, 3).cuts) & set(convs)


def test_a_fixed_batch_dimension_is_freed_or_refused_at_load(tmp_path: Path):
    freed = measure_shapes(
        load_model(dynamic_classifier(tmp_path / "b1.onnx", batch=1), "b1", {"x": (3, 8, 8)}), "b1"
    )
    dim = freed.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param == "batch" and not dim.HasField("dim_value")
    fixed = load_model(
        dynamic_classifier(tmp_path / "r.onnx", batch=1, fixed_reshape=True), "r", {"x": (3, 8, 8)}
    )
    with pytest.raises(
        ModelError, match=r"input 'x' has a fixed batch dimension of 1, .*output 'probs' does not"
    ):
        measure_shapes(fixed, "r")


def test_cli_checks_a_model_before_prefect_starts_and_cuts_it_with_input_shape(
    tmp_path: Path, capsys
):
    from poolpipe_cli import main as cli_main

    path = dynamic_classifier(tmp_path / "cls.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a protobuf")
    wh = str(tmp_path / "wh.duckdb")
    for model, says in ((junk, "not a valid ONNX model"), (path, "--input-shape x=3x640x640")):
        assert cli_main(["--warehouse", wh, "onboard", str(model)]) == 2
        assert says in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "wh.duckdb").exists()  # refused before anything was opened
    rc = cli_main(["models", "cuts", str(path), "--input-shape", "x=3x16x16", "--blocks", "3"])
    out = capsys.readouterr().out
    # blocks start at shape and after the Reshape (mean, fc or softmax, by measured times)
    assert rc == 0 and "shape" in out and ("mean" in out or "fc" in out or "softmax" in out)
    assert "conv" not in out and "relu" not in out  # never among the convolutions
