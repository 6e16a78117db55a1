"""Engines and the block profiler on real ONNX Runtime sessions; TensorRT where it exists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolpipe.errors import ModelError, PoolpipeError
from poolpipe.offline.engines import OrtEngine, TensorRTEngine, make_engine, tensorrt_available
from poolpipe.offline.onnxgraph import load_model, random_inputs, session
from poolpipe.offline.profiler import WHOLE, profile_blocks, sum_vs_whole
from poolpipe.offline.split import split_model, verify_split
from poolpipe.offline.zoo import make_model
from poolpipe_cli.onboard import parse_batches


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eng")
    path = make_model("efficientnet", tmp / "e.onnx", width=0.25, image=32)
    return split_model(path, "eff", tmp / "blocks", n_blocks=3, layer_runs=1)


def test_ort_runner_matches_a_plain_session(split):
    eng = OrtEngine(threads=1)
    assert eng.info.device == "cpu-1t" and eng.info.engine == "onnxruntime"
    block = load_model(split.blocks[1].path)
    feeds = random_inputs(block, 3, seed=5)
    runner = eng.load(eng.build(split.blocks[1].path, "eff", "block 1", 8), "eff", "block 1")
    runner.bind(feeds)
    runner.execute()
    got = runner.outputs()
    want = session(block).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_profiler_measures_every_block_and_the_whole_model(split):
    eng = OrtEngine(threads=1)
    files = [b.path for b in split.blocks]
    steps = []
    ms = profile_blocks(
        eng,
        "eff",
        files,
        files,
        (split.whole_path, split.whole_path),
        [1, 32],
        warmup=1,
        reps=3,
        progress=lambda s, d, t: steps.append((s, d, t)),
    )
    assert {(m.block, m.batch) for m in ms} == {(k, b) for k in (0, 1, 2, WHOLE) for b in (1, 32)}
    assert all(m.p99_us >= m.median_us > 0 and m.reps == 3 for m in ms)
    sums = sum_vs_whole(ms)
    # 32 images cost more than one, for the blocks and for the whole model (32, not a few:
    # a few images of this small model cost hardly more than one, less than a busy host's noise)
    assert sums[32][0] > sums[1][0] and sums[32][1] > sums[1][1]
    assert steps[-1][1:] == (2 * 4, 2 * 4)  # batch sizes x (3 blocks + whole)


def test_verify_split_measures_fp16_boundaries(split):
    e32, e16 = verify_split(split)
    assert e32 <= 1e-4 and 0 < e16 < 5e-2


def test_unknown_engine_and_cuda_without_a_gpu_are_refused():
    with pytest.raises(PoolpipeError, match="unknown engine"):
        make_engine("tvm")
    if not tensorrt_available():
        with pytest.raises(PoolpipeError, match="use --engine onnxruntime"):
            TensorRTEngine(Path("x"))


def test_a_block_the_engine_cannot_load_is_a_model_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(ModelError, match=r"^m: build: onnxruntime cannot run block 3"):
        OrtEngine().build(bad, "m", "block 3", 8)


def test_parse_batches():
    assert parse_batches("1-4,8") == [1, 2, 3, 4, 8]
    assert parse_batches("2") == [2]
    for bad in ("0-3", "a", "1-x", ""):
        with pytest.raises(PoolpipeError, match="--batches"):
            parse_batches(bad)


@pytest.mark.skipif(
    not tensorrt_available(), reason="TensorRT needs an NVIDIA GPU and the tensorrt package"
)
def test_tensorrt_engine_matches_onnx_runtime(split, tmp_path):  # pragma: no cover - GPU only
    pytest.importorskip("torch")
    eng = TensorRTEngine(tmp_path / "engines", fp16=False, tf32=False)
    block = split.blocks[0]
    plan = eng.build(block.path, "eff", "block 0", 4)
    assert plan.is_file() and eng.timing_cache.is_file()
    feeds = random_inputs(load_model(block.path), 4)
    runner = eng.load(plan, "eff", "block 0")
    runner.bind(feeds)
    runner.execute()
    want = session(load_model(block.path)).run(None, feeds)
    for g, w in zip(runner.outputs(), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
