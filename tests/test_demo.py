"""The main job (`poolpipe demo`), small: on emulated GPUs (hc2-large scaled to 10 GPUs) and
the real-compute CPU demo (--cpu), each end to end in its own process, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poolpipe.domain.cluster import load_cluster
from poolpipe.errors import ClusterError
from testbed.emulated import GROUP2, GROUP2_DIR


def _demo(tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "COLUMNS": "160"}
    res = subprocess.run(
        [sys.executable, "-m", "poolpipe_cli", "--warehouse", str(tmp_path / "w.duckdb"),
         "demo", "--out", str(tmp_path / "out"), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    for noise in ("Traceback", "Warning", "WARNING", "Running HiGHS"):
        assert noise not in text, text[-3000:]
    return text


def test_demo_on_emulated_gpus(tmp_path: Path) -> None:
    from testbed.netns import unavailable

    if unavailable():
        pytest.skip(f"no network namespaces: {unavailable()}")
    text = _demo(
        tmp_path, "--cluster", "hc2-large@10", "--time-scale", "10", "--duration", "2",
        "--width", "0.25",
    )  # fmt: skip
    assert "EMULATED" in text and "shadow models" in text
    assert re.search(r"hc2-large@10 EMULATED at time scale D = 10: 10 GPUs on \d+ servers", text)
    assert "rollout ppipe -> np" in text and ": done;" in text
    # 0.2-s traces: the job says a request or two decide a load, and what settles it
    said = " ".join(text.split())  # as one line, wherever the console wrapped it
    assert "a request or two decide a load" in said and "--duration 50 (5-s traces" in said
    for plot in ("capacity.png", "rollout.png"):
        assert (tmp_path / "out" / plot).stat().st_size > 0
    # each live capacity with the requests it was judged on, and the host's share of it
    import duckdb

    with duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True) as db:
        rows = db.execute(
            "SELECT config, metric, value FROM bench_serving WHERE bench = 'demo'"
        ).fetchall()
    got = {(c.split("/")[1], m): v for c, m, v in rows}
    # both plans at the same offered loads (the default --compare loads), live and simulated
    assert "on time at the same offered loads" in text
    loads = {c.rsplit("/", 1)[1]: [] for c, m, _ in rows if m == "on_time_live"}
    for c, m, v in rows:
        if m == "on_time_live":
            loads[c.rsplit("/", 1)[1]].append(c.split("/")[1])
            assert 0.0 <= v <= 1.0
    both = [float(x[4:]) for x, s in loads.items() if sorted(s) == ["np", "ppipe"]]
    assert both, loads
    further: dict[str, int] = {}
    for x, s in loads.items():  # a plan that kept every load is driven one further
        if sorted(s) != ["np", "ppipe"]:
            assert len(s) == 1 and float(x[4:]) > max(both), loads
            further[s[0]] = further.get(s[0], 0) + 1
    assert all(k == 1 for k in further.values()), loads
    for strategy in ("ppipe", "np"):
        judged, live = got[strategy, "live_requests_judged"], got[strategy, "capacity_live_req_s"]
        assert judged > 0 or live == 0
        assert got[strategy, "host_bound"] in (0.0, 1.0)
        # the simulator's figure judged as live's: one of the loads driven, or none kept
        sim = got[strategy, "capacity_sim_ladder_req_s"]
        driven = [float(x[4:]) for x, s in loads.items() if strategy in s]
        assert sim == 0 or min(abs(sim - x) for x in driven) < 1, (sim, driven)
        busy = got.get((strategy, "host_cpu_busy_above"))
        assert busy is None or 0.0 <= busy <= 1.0


def test_demo_on_cpu(tmp_path: Path) -> None:
    text = _demo(
        tmp_path, "--cpu", "--loopback", "--width", "0.25", "--image", "32", "--loads", "0.5",
        "--duration", "2", "--max-rate", "20",
    )  # fmt: skip
    assert "live (router + Triton nodes) vs simulator" in text
    assert "rollout to whole-model serving" in text
    for plot in ("attainment_vs_load.png", "capacity.png"):
        assert (tmp_path / "out" / plot).stat().st_size > 0


def test_demo_refuses_a_plan_that_serves_a_model_nowhere(tmp_path: Path) -> None:
    from testbed.netns import unavailable

    if unavailable():
        pytest.skip(f"no network namespaces: {unavailable()}")
    res = subprocess.run(
        [sys.executable, "-m", "poolpipe_cli", "--warehouse", str(tmp_path / "w.duckdb"),
         "demo", "--out", str(tmp_path / "out"), "--cluster", "hc2-large@8", "--width", "0.25"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode != 0
    # (8 GPUs, 2 of them L4s: each model needs GPUs of its own, so the ppipe plan leaves
    # models out as np's does; which ones is the solver's choice among plans that all
    # serve nothing of some model)
    found = re.search(r"the (ppipe|np) plan for cluster hc2-large@8 serves (.+?) nowhere",
                      res.stderr.replace("\n", " "))  # fmt: skip
    assert found, res.stderr
    named = re.split(r",\s+", found.group(2).strip())
    assert named and set(named) <= set(GROUP2), res.stderr
    assert "nowhere" in res.stderr and "Traceback" not in res.stdout + res.stderr


def test_scaled_cluster_keeps_ratio_and_servers() -> None:
    path = GROUP2_DIR / "clusters.toml"
    c = load_cluster(path, "hc2-large@32")
    assert c.name == "hc2-large@32"
    assert [(p.gpu, p.count, p.gpus_per_server) for p in c.pools] == [("L4", 8, 4), ("T4", 24, 2)]
    assert load_cluster(path, "hc2-large@3").total_gpus == 3
    with pytest.raises(ClusterError, match="at least 2"):
        load_cluster(path, "hc2-large@1")
    with pytest.raises(ClusterError, match="GPU count"):
        load_cluster(path, "hc2-large@many")


def test_first_solver_prints_no_banner() -> None:
    code = (
        "import highspy\nfrom poolpipe.planner import solvers\n"
        "solvers._new_highs(highspy, False)\nsolvers._new_highs(highspy, False)\nprint('done')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "done\n", out.stdout + out.stderr


def test_the_live_ratio_says_less_than_where_ppipe_kept_none_of_the_loads() -> None:
    """A ladder where ppipe lost 3 of 200 at the lowest load read "ppipe serves 0.00x": it
    is below that load, so less than the lowest load over np's figure; where np lost it,
    more than ppipe's figure over that load."""
    from poolpipe_cli.demo_gpu import live_ratio_text

    ladder = [167 / 20, 212 / 20, 245 / 20]  # dilated req/s at D = 20
    np_ = {"live": 167 / 20, "ladder": ladder, "capped": False}
    none = {"live": 0.0, "ladder": ladder, "capped": False}
    said = live_ratio_text(none, np_, 20)
    assert said.startswith("less than 1.00x") and "lowest 167 req/s; np 167" in said, said
    kept = {"live": 245 / 20, "ladder": ladder, "capped": True}
    said = live_ratio_text(kept, np_, 20)
    assert said.startswith("at least 1.47x (of the loads driven: 245 against 167")
    assert live_ratio_text({"live": 2.0, "ladder": []}, {"live": 1.0}, 20) == "2.00x"
    # np lost the lowest load: above ppipe's figure over it, not a division by 0
    np_none = {"live": 0.0, "ladder": ladder, "capped": False}
    said = live_ratio_text(kept, np_none, 20)
    assert said.startswith("more than 1.47x (np kept 99% at none") and "ppipe at least 245" in said
    said = live_ratio_text(none, np_none, 20)
    assert said.startswith("an unknown multiple (167 req/s") and "by neither" in said


def test_live_over_simulated_is_a_bound_where_a_figure_is_one() -> None:
    """ppipe kept every load driven (live >= 279) and every rate simulated (>= 357): the
    table read "0.78" live / simulated, a ratio of two bounds; it says what is known."""
    from poolpipe_cli.demo_gpu import live_over_sim

    base = {"live": 14.0, "sim": 17.0, "capped": False, "sim_capped": False}
    assert live_over_sim(base) == "0.82"
    assert live_over_sim({**base, "capped": True}) == ">= 0.82"
    assert live_over_sim({**base, "sim_capped": True}) == "<= 0.82"
    assert live_over_sim({**base, "capped": True, "sim_capped": True}) == "-"
    assert live_over_sim({**base, "sim": 0.0}) == "-"
    # on a ladder, the simulated figure on the same loads, not the searched one (6b464a2:
    # live 245 that lost 279 by a request read 0.71 against a search that reached 346)
    ladder = {**base, "sim": 20.0, "sim_ladder": 14.0, "sim_ladder_capped": False}
    assert live_over_sim(ladder) == "1.00"
    assert live_over_sim({**ladder, "sim_ladder": 16.0}) == "0.88"
    assert live_over_sim({**ladder, "sim_ladder_capped": True}) == "<= 1.00"
    both = {**ladder, "capped": True, "sim_ladder_capped": True}
    assert live_over_sim(both) == "1.00 (both kept every load)"
    assert live_over_sim({**ladder, "sim_ladder": None}) == "0.70"  # searched: no ladder
