"""Import of the shipped profiles into a real DuckDB file; corrupted copies; schema versions."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.errors import ProfileError, UnknownNameError, WarehouseError
from poolpipe.store.warehouse import LATEST_VERSION, Warehouse

MODEL = "colorization-v2"


def counts(path: Path) -> dict[str, int]:
    with Warehouse.open(path) as wh:
        return {
            t: wh.con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]  # type: ignore[index]
            for t in ("models", "block_latency", "block_boundaries", "blocks", "gpu_types")
        }


def test_import_shipped_profiles_roundtrip(ppipe_dir, warehouse_path):
    profiles = load_ppipe_dir(ppipe_dir)
    assert len(profiles) == 18
    with Warehouse.open(warehouse_path) as wh:
        wh.store_profiles(profiles)
        back = wh.load_profile(MODEL)
    orig = next(p for p in profiles if p.name == MODEL)
    assert back.num_blocks == orig.num_blocks == 10
    assert back.boundary_bytes == orig.boundary_bytes
    assert set(back.tables) == set(orig.tables)
    for key, table in orig.tables.items():
        assert (back.tables[key].latency_us == table.latency_us).all()
    assert back.slo_us == pytest.approx(5 * 14350.472)
    # Every cell of every CSV is a row: 18 models, 13 tables each, blocks x batches.
    expected = sum(t.latency_us.size for p in profiles for t in p.tables.values())
    assert counts(warehouse_path)["block_latency"] == expected


def test_each_models_input_size_comes_from_the_layers_files_and_is_kept(tmp_path, warehouse_path):
    """The shipped group-2 folder (no ../shared needed): the bytes of one request's inputs
    from layers/<model>/cuts.json and shapes.json, stored and read back; a folder without
    them leaves the size unknown; a shape that cannot be read is named."""
    from poolpipe.store.warehouse import REPO_ROOT

    group2 = REPO_ROOT / "data" / "ppipe-gpu-group2"
    sizes = {p.name: p.input_bytes for p in load_ppipe_dir(group2)}
    assert sizes == {
        "colorization-v2": 1 * 512 * 512 * 4,
        "googlenet-v3-pytorch": 3 * 598 * 598 * 4,
        "repvgg-b3": 3 * 448 * 448 * 4,
    }
    # and twice the largest tensor per sample: what a batch's activations hold of a GPU
    acts = {p.name: p.activation_bytes for p in load_ppipe_dir(group2)}
    shapes = json.loads((group2 / "layers" / "repvgg-b3" / "shapes.json").read_text())
    largest = max(math.prod(e["shape"][1:]) * 4 for e in shapes.values())  # all float32
    assert acts["repvgg-b3"] == 2 * largest
    with Warehouse.open(warehouse_path) as wh:
        wh.store_profiles(load_ppipe_dir(group2))
        back = wh.load_profile("repvgg-b3")
        assert back.input_bytes == 3 * 448 * 448 * 4
        assert back.activation_bytes == acts["repvgg-b3"] and back.weight_bytes is None
    bare = tmp_path / "bare"
    shutil.copytree(group2, bare, ignore=shutil.ignore_patterns("layers"))
    assert {p.input_bytes for p in load_ppipe_dir(bare)} == {None}
    assert {p.activation_bytes for p in load_ppipe_dir(bare)} == {None}
    broken = tmp_path / "broken"
    shutil.copytree(group2, broken)
    (broken / "layers" / "repvgg-b3" / "shapes.json").write_text('{"input": {"dtype": "<f4"}}')
    with pytest.raises(ProfileError, match="repvgg-b3: cannot read the model's input size"):
        load_ppipe_dir(broken)


def test_import_is_idempotent(ppipe_dir, warehouse_path):
    profiles = load_ppipe_dir(ppipe_dir)
    with Warehouse.open(warehouse_path) as wh:
        wh.store_profiles(profiles)
    first = counts(warehouse_path)
    with Warehouse.open(warehouse_path) as wh:
        wh.store_profiles(profiles)
    assert counts(warehouse_path) == first


@pytest.fixture
def ppipe_copy(ppipe_dir, tmp_path) -> Path:
    dst = tmp_path / "ppipe"
    for sub in ("block-latency", "boundary-bytes"):
        shutil.copytree(ppipe_dir / sub, dst / sub)
    for f in ("reference-latency.csv", "clusters.toml", "workloads.toml"):
        shutil.copy(ppipe_dir / f, dst / f)
    return dst


def _rewrite(path: Path, row: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[row - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda d: _rewrite(d / "block-latency" / f"{MODEL}-T4-2.csv", 3, "28216,abc"),
            rf"{MODEL}-T4-2.csv: row 3, column 2: 'abc' is not a number",
        ),
        (
            lambda d: _rewrite(d / "block-latency" / f"{MODEL}-L4-1.csv", 5, "-5,1,2,3,4,5,6,7"),
            rf"{MODEL}-L4-1.csv: row 5, column 1: '-5' must be finite and >= 0",
        ),
        (
            lambda d: _rewrite(d / "block-latency" / f"{MODEL}-V100-1.csv", 2, "1,2,3"),
            rf"{MODEL}-V100-1.csv: row 2 has 3 values, earlier rows have 8 \(ragged",
        ),
        (
            lambda d: _rewrite(d / "boundary-bytes" / f"{MODEL}.csv", 9, ""),
            rf"{MODEL}.csv: 8 rows, but model {MODEL} has 10 blocks so it needs 9",
        ),
        (
            lambda d: (d / "boundary-bytes" / f"{MODEL}.csv").unlink(),
            rf"{MODEL}.csv: file is missing",
        ),
        (
            lambda d: _rewrite(d / "reference-latency.csv", 5, "someone-else,1000"),
            rf"reference-latency.csv: no row for model {MODEL}",
        ),
        (
            lambda d: (d / "block-latency" / f"{MODEL}-P4-1.csv").rename(
                d / "block-latency" / f"{MODEL}-P4-x.csv"
            ),
            r"file name must be <model>-<GPU>-<share>.csv",
        ),
        (
            lambda d: _rewrite(d / "block-latency" / f"{MODEL}-T4-1.csv", 10, "nan,1,1,1,1,1,1,1"),
            r"row 10, column 1: 'nan' must be finite",
        ),
        (  # zeros were accepted and planned at 80,000,000 req/s
            lambda d: _rewrite(d / "block-latency" / f"{MODEL}-L4-1.csv", 4, "0,0,0,0,0,0,0,0"),
            rf"{MODEL}-L4-1.csv: L4/1: row 4 \(block 3\), batch 1: latency 0.0 µs; every "
            r"latency must be a finite number > 0 \(8 such cells\)",
        ),
        (
            lambda d: _rewrite(
                d / "block-latency" / f"{MODEL}-L4-1.csv", 2, "9,8,10,11,12,13,14,15"
            ),
            rf"{MODEL}-L4-1.csv: row 2 \(block 1\): latency at batch 2 \(8 µs\) is not above "
            r"batch 1's \(9 µs\); latencies must grow with the batch",
        ),
    ],
)
def test_corrupted_copy_is_rejected_and_nothing_is_written(
    ppipe_copy, warehouse_path, corrupt, message
):
    from poolpipe_cli import main

    assert (
        main(["--warehouse", str(warehouse_path), "profiles", "import-ppipe", str(ppipe_copy)]) == 0
    )
    before = counts(warehouse_path)
    corrupt(ppipe_copy)
    with pytest.raises(ProfileError, match=message):
        load_ppipe_dir(ppipe_copy)
    assert (
        main(["--warehouse", str(warehouse_path), "profiles", "import-ppipe", str(ppipe_copy)]) == 2
    )
    assert counts(warehouse_path) == before


def test_write_failure_mid_transaction_rolls_back(ppipe_dir, warehouse_path):
    profiles = load_ppipe_dir(ppipe_dir)[:2]
    with Warehouse.open(warehouse_path) as wh:
        wh.store_profiles(profiles)
    before = counts(warehouse_path)
    with Warehouse.open(warehouse_path) as wh:
        wh.con.execute("DROP TABLE block_boundaries")  # the import fails after deleting rows
        with pytest.raises(Exception, match="block_boundaries"):
            wh.store_profiles(profiles)
        n = wh.con.execute("SELECT count(*) FROM block_latency").fetchone()
        assert n is not None and n[0] == before["block_latency"]


def test_unknown_model_says_how_to_import(warehouse_path):
    with (
        Warehouse.open(warehouse_path) as wh,
        pytest.raises(UnknownNameError, match="poolpipe profiles import-ppipe"),
    ):
        wh.load_profile("resnet50")


def test_new_file_is_created_at_latest_version(warehouse_path):
    with Warehouse.open(warehouse_path) as wh:
        assert wh.schema_version() == LATEST_VERSION


def test_older_schema_is_refused_with_the_fix_and_migrate_fixes_it(warehouse_path):
    import duckdb

    con = duckdb.connect(str(warehouse_path))
    con.execute(
        "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
        "applied_at TIMESTAMP)"
    )
    con.close()
    with pytest.raises(WarehouseError, match=r"run: poolpipe .*wh\.duckdb") as refused:
        Warehouse.open(warehouse_path)
    from poolpipe_cli import main

    # the command the message names is one that runs
    command = str(refused.value).partition("run: poolpipe ")[2].split()
    assert main(command) == 0
    with Warehouse.open(warehouse_path) as wh:
        assert wh.schema_version() == LATEST_VERSION


def test_newer_schema_is_refused(warehouse_path):
    with Warehouse.open(warehouse_path) as wh:
        wh.con.execute("INSERT INTO schema_version VALUES (999, 'future', now())")
    with pytest.raises(WarehouseError, match="newer than this poolpipe"):
        Warehouse.open(warehouse_path)


def test_foreign_duckdb_file_is_refused(warehouse_path):
    import duckdb

    con = duckdb.connect(str(warehouse_path))
    con.execute("CREATE TABLE something (x INTEGER)")
    con.close()
    with pytest.raises(WarehouseError, match="not a poolpipe warehouse"):
        Warehouse.open(warehouse_path)
