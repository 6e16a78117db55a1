"""Scenarios in the simulator: GPUs that fail and come back, and plan rollouts, met by the
serving runtime's own policies on the virtual clock (real shipped profiles, the published
PPipe plan for colorization / googlenet / repvgg on hc2-large)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.scheduler import build_topology, make_data_plane
from poolpipe.sim import ArrivalSpec, SimConfig, Simulator, run_once
from poolpipe.sim.scenario import GpuChange, Rollout, Scenario, load_scenario
from poolpipe_cli import main

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "data" / "reference" / "ppipe-published-g2-hc2-large.json"


@pytest.fixture(scope="module")
def published(ppipe_profiles):
    plan = Plan.load(PUBLISHED)
    return plan, build_topology(plan, ppipe_profiles, larger_batches=True)


def attainment(res, name: str, seconds: range) -> float:
    s = res.per_second[name]
    return sum(s["on_time"][i] for i in seconds) / sum(s["arrived"][i] for i in seconds)


def conserved(res) -> None:
    for m in res.models:
        assert m.on_time + m.late + m.dropped + m.failed == m.arrived
    for name, s in res.per_second.items():
        m = res.model(name)
        assert sum(s["arrived"]) == m.arrived and sum(s["failed"]) == m.failed


def test_losing_l4s_dips_attainment_and_their_return_restores_it(published):
    _, topo = published
    g = "googlenet-v3-pytorch"  # all on whole L4s: fail three of its five
    pools = [p for p in topo.pools if topo.models[p.model].name == g]
    mine = tuple(sorted({topo.vgpus[v].physical for p in pools for v in p.vgpus}))[:3]
    scenario = Scenario(
        (GpuChange("gpu_down", 2.0, "L4", 3, mine), GpuChange("gpu_up", 4.0, "L4", 3, mine))
    )
    cfg = SimConfig(duration_s=6.0, seed=4)
    res = run_once(topo, ArrivalSpec.parse("poisson"), 0.9, cfg, scenario=scenario)
    conserved(res)
    before, during, after = range(0, 2), range(2, 4), range(4, 6)
    assert attainment(res, g, during) < attainment(res, g, before) - 0.05
    assert attainment(res, g, after) > attainment(res, g, during) + 0.05
    down, up = res.events
    assert down["kind"] == "gpu_down" and down["nodes"] == [f"L4-{i}" for i in mine]
    assert up["nodes"] == down["nodes"]  # the same GPUs come back
    again = run_once(topo, ArrivalSpec.parse("poisson"), 0.9, cfg, scenario=scenario)
    assert again.models == res.models and again.per_second == res.per_second  # seeded


def test_failures_without_a_live_path_are_explicit(published):
    _, topo = published
    everything = Scenario((GpuChange("gpu_down", 1.0, "L4", 25),))
    res = run_once(
        topo,
        ArrivalSpec.parse("poisson"),
        0.5,
        SimConfig(duration_s=2.0, seed=1),
        scenario=everything,
    )
    conserved(res)
    g = res.model("googlenet-v3-pytorch")
    # batches running when the GPUs die fail (no L4 left to retry on); later requests are
    # answered at once (no pipeline can take them)
    assert g.failed > 0
    per = res.per_second["googlenet-v3-pytorch"]
    assert per["on_time"][1] == 0 and per["dropped"][1] + per["failed"][1] == per["arrived"][1]


def test_a_rollout_goes_through_the_flush_migration(published, ppipe_profiles):
    plan, topo = published
    # the same plan again, as a new generation: every batch in flight must end first
    new_topo = build_topology(plan, ppipe_profiles, larger_batches=True)
    scenario = Scenario((Rollout(2.0, new_topo, "same plan again"),))
    res = run_once(
        topo,
        ArrivalSpec.parse("poisson"),
        0.8,
        SimConfig(duration_s=4.0, seed=2),
        scenario=scenario,
    )
    conserved(res)
    (roll,) = res.rollouts
    slo_ms = max(m.slo_us for m in topo.models) / 1e3
    assert 0 < roll["downtime_ms"] <= slo_ms  # the flush waits for the batches in flight
    assert roll["held"] > 0 and roll["failed"] == 0
    assert res.attainment > 0.97


def test_an_event_after_the_last_arrival_still_happens(published):
    # Two requests in the first millisecond; the GPUs fail at 1.5 s and a rollout follows
    # at 1.8 s, long after the runtime went idle: both are played and reported.
    _, topo = published
    scenario = Scenario(
        (GpuChange("gpu_down", 1.5, "T4", 2, (0, 1)), Rollout(1.8, topo, "same plan"))
    )
    sim = Simulator(
        topo,
        make_data_plane("reservation", topo),
        np.array([0.0, 1_000.0]),
        np.array([0, 1]),
        SimConfig(duration_s=2.0),
        scenario,
    )
    res = sim.run()
    conserved(res)
    assert [e["kind"] for e in res.events] == ["gpu_down", "rollout"]
    assert res.events[0]["nodes"] == ["T4-0", "T4-1"] and len(res.rollouts) == 1


def test_an_event_past_the_end_of_the_run_is_refused(published):
    _, topo = published
    late = Scenario((GpuChange("gpu_down", 1.0, "T4"), GpuChange("gpu_up", 40.0, "T4")))
    with pytest.raises(PoolpipeError, match=r"gpu_up at 40 s is past the end of the run \(30 s\)"):
        run_once(topo, ArrivalSpec.parse("poisson"), 0.1, SimConfig(30.0), scenario=late)
    at_end = Scenario((GpuChange("gpu_down", 1.0, "L4", 1, (0,)),))
    res = run_once(topo, ArrivalSpec.parse("poisson"), 0.01, SimConfig(1.0), scenario=at_end)
    assert [e["at_s"] for e in res.events] == [1.0]  # at the very end: played


def test_scenario_files_are_checked(tmp_path, published, ppipe_profiles):
    _, topo = published
    kw = dict(
        gpu_counts=dict(topo.gpu_counts),
        models=[m.name for m in topo.models],
        load_plan=lambda p: build_topology(Plan.load(p), ppipe_profiles, larger_batches=True),
    )
    cases = {
        "events = 3": "no [[events]]",
        '[[events]]\nat_s = -1\nkind = "gpu_down"\ngpu = "T4"': "at_s must be a number",
        '[[events]]\nat_s = 1\nkind = "explode"': "kind must be one of",
        '[[events]]\nat_s = 1\nkind = "gpu_down"\ngpu = "A100"': "not a device type",
        '[[events]]\nat_s = 1\nkind = "gpu_down"\ngpu = "L4"\ncount = 26': "has 25 L4 GPUs",
        '[[events]]\nat_s = 1\nkind = "gpu_up"\ngpu = "L4"\ngpus = [30]': "GPU numbers 0..24",
        '[[events]]\nat_s = 1\nkind = "gpu_down"\ngpu = "L4"\nwhen = 3': "unknown field",
        '[[events]]\nat_s = 1\nkind = "rollout"\nplan = "nope.json"': "does not exist",
        "[[events]\n": "not TOML",
    }
    for k, (text, message) in enumerate(cases.items()):
        f = tmp_path / f"s{k}.toml"
        f.write_text(text)
        with pytest.raises(PoolpipeError, match=re.escape(message)) as err:
            load_scenario(f, **kw)
        assert str(f) in str(err.value)
    other = tmp_path / "other.json"
    doc = json.loads(PUBLISHED.read_text())
    doc["models"] = doc["models"][:1]
    other.write_text(json.dumps(doc))
    f = tmp_path / "roll.toml"
    f.write_text('[[events]]\nat_s = 1\nkind = "rollout"\nplan = "other.json"\n')
    with pytest.raises(PoolpipeError, match="must serve the same models"):
        load_scenario(f, **kw)


def test_cli_simulate_with_a_scenario(ppipe_dir, warehouse_path, tmp_path, capsys):
    wh = ["--warehouse", str(warehouse_path)]
    assert main([*wh, "profiles", "import-ppipe", str(ppipe_dir)]) == 0
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        '[[events]]\nat_s = 1\nkind = "gpu_down"\ngpu = "L4"\ngpus = [0, 1]\n'
        '[[events]]\nat_s = 2\nkind = "gpu_up"\ngpu = "L4"\ngpus = [0, 1]\n'
        f'[[events]]\nat_s = 2.5\nkind = "rollout"\nplan = "{PUBLISHED}"\n'
    )
    plot = tmp_path / "timeline.png"
    base = [*wh, "simulate", "--plan", str(PUBLISHED), "--duration", "3"]
    capsys.readouterr()
    assert main([*base, "--scenario", str(scenario), "--plot", str(plot), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in doc["events"]] == ["gpu_down", "gpu_up", "rollout"]
    assert doc["events"][0]["nodes"] == ["L4-0", "L4-1"]
    assert len(doc["rollouts"]) == 1 and doc["rollouts"][0]["downtime_ms"] >= 0
    for name, series in doc["per_second"].items():
        assert len(series["arrived"]) == 3 and set(series) >= {"on_time", "failed"}
        m = next(m for m in doc["models"] if m["name"] == name)
        assert sum(series["arrived"]) == m["arrived"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert main([*base, "--scenario", str(scenario)]) == 0
    out = capsys.readouterr().out
    assert "per second of simulated time" in out and "rollout to" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('[[events]]\nat_s = 1\nkind = "gpu_down"\ngpu = "V100"\n')
    assert main([*base, "--scenario", str(bad)]) == 2
    assert "not a device type" in capsys.readouterr().err
