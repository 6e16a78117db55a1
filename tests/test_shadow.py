"""Shadow models (poolpipe.offline.shadow): generated from the GPU profiles shipped in
data/, onboarded under the profiled model's name by the real Prefect flow, cut at the
profiled blocks; their feature maps are the profiled sizes on the wire (fp16 between
partitions) and the warehouse holds the profile's device tables for planning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.errors import ProfileError
from poolpipe.offline.onnxgraph import session
from poolpipe.offline.partitions import WIRE_DTYPE
from poolpipe.offline.shadow import make_shadow
from poolpipe.store.warehouse import REPO_ROOT, Warehouse

GROUP2 = REPO_ROOT / "data" / "ppipe-gpu-group2"


def test_shadow_onboarded_blocks_give_the_profiled_sizes(prefect_api, tmp_path):
    from flows.shadow import onboard_shadow, profile_of

    wh_path = str(tmp_path / "wh.duckdb")
    r = onboard_shadow("repvgg-b3", str(GROUP2), warehouse=wh_path, devices=["L4", "T4"])
    profile = profile_of(GROUP2, "repvgg-b3", ["L4", "T4"])
    with Warehouse.open(wh_path) as wh:
        blocks = [onnx.load(str(p)) for p in wh.onboarded_blocks("repvgg-b3")]
        stored = wh.load_profile("repvgg-b3")
    assert len(blocks) == profile.num_blocks == 10
    # the warehouse plans with the profile: its tables, boundary sizes and SLO
    assert {k for k in stored.tables if k[0] in ("L4", "T4")} == set(profile.tables)
    for key, table in profile.tables.items():
        np.testing.assert_allclose(stored.tables[key].latency_us, table.latency_us)
    assert stored.boundary_bytes == profile.boundary_bytes
    assert stored.slo_us == pytest.approx(profile.slo_us)
    # the real input shape goes in; each block gives the profiled bytes per request on the
    # wire (fp16 between partitions); the last gives the real output
    batch = 2
    x = np.random.default_rng(0).standard_normal((batch, 3, 448, 448)).astype(np.float32)
    values = {"input": x}
    for k, block in enumerate(blocks):
        ins = {i.name: values[i.name] for i in block.graph.input}
        (out,) = session(block).run(None, ins)
        values[block.graph.output[0].name] = out
        if k < len(blocks) - 1:
            wire = out.astype(WIRE_DTYPE).nbytes
            assert wire == batch * profile.boundary_bytes[k], f"block {k}"
    assert out.shape == (batch, 1000)
    assert r.shadow.input.dims == (3, 448, 448)


def test_shadow_of_a_bad_profile_names_the_file(tmp_path):
    root = tmp_path / "prof"
    shutil.copytree(GROUP2, root)
    bad = root / "layers" / "repvgg-b3" / "shapes.json"
    shapes = json.loads(bad.read_text())
    shapes["input"]["shape"] = [3, 448, 448]  # no batch dimension
    bad.write_text(json.dumps(shapes))
    profiles = {p.name: p for p in load_ppipe_dir(root)}
    with pytest.raises(ProfileError, match=r"shapes\.json.*-1 \(the batch\) first"):
        make_shadow(root, profiles["repvgg-b3"], tmp_path / "s.onnx")
    (root / "layers" / "googlenet-v3-pytorch" / "cuts.json").unlink()
    with pytest.raises(ProfileError, match=r"cuts\.json: file is missing"):
        make_shadow(root, profiles["googlenet-v3-pytorch"], tmp_path / "s.onnx")
    assert not (tmp_path / "s.onnx").exists()


def test_shipped_group2_profiles_match_the_artifact(ppipe_dir: Path):
    """data/ppipe-gpu-group2 is a faithful subset of ../shared/profiles/ppipe-gpu."""
    for sub in ("block-latency", "boundary-bytes"):
        for f in (GROUP2 / sub).iterdir():
            assert f.read_bytes() == (ppipe_dir / sub / f.name).read_bytes(), f
    for model in ("colorization-v2", "googlenet-v3-pytorch", "repvgg-b3"):
        ours = json.loads((GROUP2 / "layers" / model / "shapes.json").read_text())
        theirs = json.loads((ppipe_dir / "layers" / model / "shapes.json").read_text())
        assert ours and all(theirs[k] == v for k, v in ours.items())
