"""`poolpipe simulate` and `poolpipe capacity` on a real warehouse with real plans."""

from __future__ import annotations

import json

import duckdb
import pytest

from poolpipe_cli import main

GROUP = "colorization-v2,googlenet-v3-pytorch,repvgg-b3"


@pytest.fixture
def planned(ppipe_dir, warehouse_path, tmp_path):
    wh = ["--warehouse", str(warehouse_path)]
    assert main([*wh, "profiles", "import-ppipe", str(ppipe_dir)]) == 0
    paths = {}
    for strategy in ("ppipe", "np"):
        out = tmp_path / f"{strategy}.json"
        argv = [
            *wh,
            "plan",
            "--cluster",
            "hc2-small",
            "--models",
            GROUP,
            "--weights",
            "0.30,0.33,0.37",
            "--slo-scale",
            "5",
            "--margin",
            "0.4",
            "--strategy",
            strategy,
            "--packing",
            "per-position",
            "--delivery",
            "off",  # the MILP's plans: these tests are about simulating given plans
            "--out",
            str(out),
        ]
        assert main(argv) == 0
        paths[strategy] = out
    return wh, paths


def test_simulate_json_and_replayed_arrival_file(planned, tmp_path, capsys, warehouse_path):
    wh, paths = planned
    capsys.readouterr()
    arrivals = tmp_path / "times.txt"
    arrivals.write_text("\n".join(f"{i * 10_000} googlenet-v3-pytorch" for i in range(500)))
    argv = [
        *wh,
        "simulate",
        "--plan",
        str(paths["ppipe"]),
        "--arrivals",
        str(arrivals),
        "--duration",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {m["name"]: m for m in doc["models"]}
    assert by["googlenet-v3-pytorch"]["arrived"] == 500  # exactly the file, whatever the rate
    assert by["colorization-v2"]["arrived"] == 0
    g = by["googlenet-v3-pytorch"]
    assert g["on_time"] + g["late"] + g["dropped"] == 500
    assert g["attainment"] == 1.0  # 100 req/s, evenly spaced: well below the 222 planned
    con = duckdb.connect(str(warehouse_path))
    assert con.execute("SELECT count(*) FROM sim_runs").fetchone() == (3,)
    con.close()
    # the readable table
    assert (
        main(
            [
                *wh,
                "simulate",
                "--plan",
                str(paths["ppipe"]),
                "--duration",
                "1",
                "--load-factor",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "attainment" in out and "GPU utilization" in out
    # the same arrivals with every short batch filled with dummy requests (Piccolo): the
    # same requests, each stage as long as its planned batch's (np plans batches above 1)
    got = {}
    for extra in ([], ["--dummy-fill"]):
        assert main([*argv[:4], str(paths["np"]), *argv[5:], *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        got[bool(extra)] = {m["name"]: m for m in doc["models"]}["googlenet-v3-pytorch"]
    assert got[True]["arrived"] == got[False]["arrived"] == 500
    assert got[True]["latency_p50_us"] > got[False]["latency_p50_us"]


def test_capacity_json_with_a_baseline(planned, capsys, warehouse_path):
    wh, paths = planned
    capsys.readouterr()
    argv = [
        *wh,
        "capacity",
        "--plan",
        str(paths["ppipe"]),
        "--baseline-plans",
        str(paths["np"]),
        "--duration",
        "2",
        "--search",
        "bisect",
        "--step",
        "0.1",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["strategy"] for p in doc["plans"]] == ["ppipe", "np"]
    for p in doc["plans"]:
        for name, m in p["models"].items():
            assert 0.0 <= m["capacity"] <= 1.0
            tried = {float(k): v for k, v in m["attainment"].items()}
            if m["capacity"] > 0:
                assert tried[m["capacity"]] >= 0.99, name
            # bisection stops below the first failing grid point above the capacity
            above = [k for k in tried if k > m["capacity"]]
            if above:
                assert tried[min(above)] < 0.99, name
    con = duckdb.connect(str(warehouse_path))
    assert con.execute("SELECT count(*) FROM capacity_results").fetchone() == (6,)
    con.close()


def test_capacity_explains_where_requests_wait(planned, capsys):
    wh, paths = planned
    capsys.readouterr()
    argv = [*wh, "capacity", "--plan", str(paths["ppipe"]), "--duration", "4"]
    argv += ["--search", "bisect", "--step", "0.1", "--explain"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ex = doc["explain"]
    caps = doc["plans"][0]["models"]
    planned_rate = {
        m["name"]: m["throughput"] for m in json.loads(paths["ppipe"].read_text())["models"]
    }
    assert [m["name"] for m in ex["models"]] == list(caps)
    for m in ex["models"]:
        assert m["limit"] and m["why"]
        assert 0 <= m["on_time"] <= 1 and m["arrived"] > 0
        assert m["queue_p50_us"] <= m["queue_p99_us"]
        cap = caps[m["name"]]["capacity"]  # explained at its capacity (or at 5%)
        assert m["rate"] == pytest.approx((cap or 0.05) * planned_rate[m["name"]])
    pools = ex["pools"]
    assert pools and all(0 < p["utilisation"] <= 1 and p["batches"] > 0 for p in pools)
    assert all(0 <= p["wait_p50_us"] <= p["wait_p99_us"] for p in pools)
    assert all(0 <= x["utilisation"] <= 1 for x in ex["links"])
    # a model limited by a pool names one of its own pipelines' pools
    for m in ex["models"]:
        if m["limit"].startswith("pipeline"):
            assert any(
                p["model"] == m["name"] and m["limit"].startswith(f"pipeline {p['pipeline']} ")
                for p in pools
            )
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "what limits it" in out and "busiest links" in out and "wait p99 ms" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arrivals", "sometimes"], "neither poisson, gamma:CV nor an existing file"),
        (["--data-plane", "reservation", "--plan", "nope.json"], "nope.json does not exist"),
    ],
)
def test_simulate_errors_name_the_bad_input(planned, capsys, extra, message):
    wh, paths = planned
    capsys.readouterr()
    argv = [*wh, "simulate", "--plan", str(paths["ppipe"]), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_capacity_refuses_a_fixed_list_and_mismatched_baselines(planned, tmp_path, capsys):
    wh, paths = planned
    lst = tmp_path / "t.txt"
    lst.write_text("0\n")
    assert main([*wh, "capacity", "--plan", str(paths["ppipe"]), "--arrivals", str(lst)]) == 2
    assert "no load factor to search" in capsys.readouterr().err.replace("\n", " ")
