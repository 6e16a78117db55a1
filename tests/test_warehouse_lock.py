"""A warehouse another process holds (reliability issue): readers wait it out, writers spool
their rows beside it and the next open writes them in, and a busy warehouse is named with
its holder. The holder is a real second process with the DuckDB file open."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from poolpipe.errors import WarehouseBusyError
from poolpipe.store.warehouse import Warehouse, spool_dir, store_rows_durably
from poolpipe_cli import main
from testbed.holder import hold_elsewhere as hold


def row(i: int) -> dict:
    return {
        "run_at": datetime(2026, 11, 23, 6, 0, i),
        "run_label": "lock-test",
        "bench": "lock",
        "config": f"c{i}",
        "metric": "m",
        "value": float(i),
        "host": None,
    }


def bench_rows(path) -> list[tuple]:
    with Warehouse.open(path) as wh:
        return wh.con.execute(
            "SELECT config, value FROM bench_serving WHERE run_label = 'lock-test' ORDER BY value"
        ).fetchall()


def test_a_busy_warehouse_is_named_with_its_holder(warehouse_path):
    Warehouse.open(warehouse_path).close()
    proc = hold(warehouse_path, 30)
    try:
        with pytest.raises(WarehouseBusyError, match=rf"{warehouse_path.name} is in use by"):
            Warehouse.open(warehouse_path, wait_s=0.3)
        with pytest.raises(WarehouseBusyError, match=rf"\(PID {proc.pid}\)"):
            Warehouse.open(warehouse_path, wait_s=0)
    finally:
        proc.kill()
        proc.wait()


def test_rows_written_while_busy_are_spooled_and_written_on_the_next_open(warehouse_path):
    Warehouse.open(warehouse_path).close()
    assert store_rows_durably(warehouse_path, "bench_serving", [row(0)], wait_s=1.0)
    proc = hold(warehouse_path, 30)
    try:
        assert not store_rows_durably(warehouse_path, "bench_serving", [row(1), row(2)], wait_s=0.2)
        assert not store_rows_durably(warehouse_path, "bench_serving", [row(3)], wait_s=0.2)
        assert len(list(spool_dir(warehouse_path).glob("*.jsonl"))) == 2
    finally:
        proc.kill()
        proc.wait()
    # the next open (any command) writes them, oldest first, and empties the spool
    assert bench_rows(warehouse_path) == [("c0", 0.0), ("c1", 1.0), ("c2", 2.0), ("c3", 3.0)]
    assert not list(spool_dir(warehouse_path).glob("*.jsonl"))
    with Warehouse.open(warehouse_path) as wh:  # and only once
        assert wh.replay_spool() == 0
    assert len(bench_rows(warehouse_path)) == 4


def test_a_reader_waits_for_the_holder_to_finish(warehouse_path, capsys):
    Warehouse.open(warehouse_path).close()
    proc = hold(warehouse_path, 1.5)
    try:
        # `profiles list` failed at once while `poolpipe simulate` held the file
        assert main(["--warehouse", str(warehouse_path), "profiles", "list"]) == 0
    finally:
        proc.wait()
    assert "error" not in capsys.readouterr().err


def test_a_spool_file_that_cannot_be_written_is_set_aside(warehouse_path):
    Warehouse.open(warehouse_path).close()
    folder = spool_dir(warehouse_path)
    folder.mkdir()
    (folder / "00000000000000000001-1-bench_serving.jsonl").write_text('{"table": "nosuch"}\n{}\n')
    good = row(7)
    proc = hold(warehouse_path, 30)
    try:
        store_rows_durably(warehouse_path, "bench_serving", [good], wait_s=0.1)
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.1)
    with Warehouse.open(warehouse_path) as wh:
        assert len(wh.spool_problems) == 1 and "unreadable" in wh.spool_problems[0]
    assert bench_rows(warehouse_path) == [("c7", 7.0)]
    assert len(list(folder.glob("*.unreadable"))) == 1
