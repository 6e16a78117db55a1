"""Requests entering mid-model (domain/entry.py, planner/graft.py): segments, the stream
spec, the client's choice of entry, shared suffix pools planned and simulated."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from poolpipe.domain.entry import (
    EntrySpecError,
    EntryStream,
    choose_entry,
    parse_streams,
    segment,
)
from poolpipe.errors import PoolpipeError
from poolpipe.planner.graft import (
    GraftRequest,
    Group,
    _each_merged,
    _merged,
    _Planner,
    group_at,
    plan_streams,
)
from poolpipe.sim.apps import app_attainment_at, simulate_apps
from poolpipe.sim.engine import SimConfig
from tests.conftest import tiny_model

MODELS = ("repvgg-b3", "tf_efficientdet_d1")


@pytest.fixture(scope="module")
def hc2_large(ppipe_dir):
    from poolpipe.domain.cluster import load_cluster

    return load_cluster(ppipe_dir / "clusters.toml", "hc2-large")


def test_a_segment_is_its_blocks_as_a_model_of_their_own():
    m = tiny_model(
        "m",
        {("A", 1): [[1, 2], [3, 4], [5, 6], [7, 8]]},
        [100.0, 200.0, 300.0],
    )
    m = type(m)(**{**m.__dict__, "input_bytes": 50.0})
    s = segment(m, 1, 3)
    assert s.name == "m.1-3" and s.num_blocks == 2
    assert s.tables[("A", 1)].latency_us.tolist() == [[3, 4], [5, 6]]
    assert s.boundary_bytes == (200.0,)
    assert s.input_bytes == 100.0  # what leaves block 0 enters block 1
    assert s.meta["segment_of"] == "m" and s.meta["blocks"] == "1-3"
    assert segment(m, 0, 2).input_bytes == 50.0
    assert segment(m, 0, 4) is m
    with pytest.raises(PoolpipeError, match=r"blocks \[3, 3\) are not a segment"):
        segment(m, 3, 3)


def test_the_stream_spec_names_what_is_wrong(ppipe_profiles):
    good = {"model": "repvgg-b3", "entry": 3, "budget_ms": 30, "rate": 10}
    (s,) = parse_streams({"streams": [good]}, ppipe_profiles)
    assert (s.name, s.entry, s.budget_us, s.rate) == ("repvgg-b3.e3", 3, 30_000.0, 10.0)
    assert s.slo_us == ppipe_profiles["repvgg-b3"].slo_us
    bad = [
        ({**good, "model": "nope"}, "model 'nope' is not profiled"),
        ({**good, "entry": 10}, "entry 10: a block of repvgg-b3, 0 .* to 9"),
        ({**good, "budget_ms": 0}, "budget_ms must be a number > 0"),
        ({**good, "budget_ms": 60}, "budget_ms 60 is more than its SLO"),
        ({**good, "colour": 1}, "unknown field.*colour"),
    ]
    for row, message in bad:
        with pytest.raises(EntrySpecError, match=message):
            parse_streams({"streams": [row]}, ppipe_profiles, "f.toml")
    with pytest.raises(EntrySpecError, match=r"repvgg-b3\.e3 given twice"):
        parse_streams({"streams": [good, good]}, ppipe_profiles)
    with pytest.raises(EntrySpecError, match=r"no \[\[streams\]\]"):
        parse_streams({}, ppipe_profiles)


def test_the_client_chooses_the_entry_of_least_estimate_within_the_slo():
    # three blocks; client 10/10/10 ms, server 2/2/2 ms; uploads 8/1/4 MB at 1 MB/s
    # entry 0: 0 + 8000 + 6 ms; entry 1: 10 + 1000 + 4; entry 2: 20 + 4000 + 2
    entry, budget = choose_entry([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 2_000e3)
    assert entry == 1
    assert budget == pytest.approx(2_000e3 - 10e3 - 1_000e3)
    with pytest.raises(PoolpipeError, match="no entry block fits the SLO of 1000 ms"):
        choose_entry([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 1_000e3)


def _streams(profiles, rate=60.0):
    out = []
    for m in MODELS:
        slo = profiles[m].slo_us
        for entry, share in ((1, 0.8), (3, 0.75)):
            out.append(EntryStream(f"{m}.e{entry}", m, entry, slo * share, rate, slo))
    return tuple(out)


def test_a_shared_suffix_serves_both_entry_points_and_segments_share_gpus(
    ppipe_profiles, hc2_large
):
    streams = _streams(ppipe_profiles)
    req = GraftRequest(streams, ppipe_profiles, hc2_large, headroom=False)
    planner = _Planner(req, "realigned", lambda line: None)
    rates = {s.name: s.rate for s in streams}
    chosen = {m: (group_at(req, m, (1, 3)),) for m in MODELS}
    plan = planner.all(chosen, rates)
    from poolpipe.planner.graft import app_request

    areq, _ = app_request(req, [g for gs in chosen.values() for g in gs])
    from poolpipe.planner.apps import app_plan_document

    doc, profiles = app_plan_document(areq, plan)
    names = {m.name for m in doc.models}
    assert names == {f"{m}.{a}-{b}" for m in MODELS for a, b in ((1, 3), (3, 10))}
    for m in MODELS:  # the suffix plans for both streams' rates
        assert doc.model(f"{m}.3-10").throughput >= 2 * 60.0 - 1e-6
        assert doc.owner(f"{m}.1-3") == m
    # segments of one model count the GPUs they share once, as the MILP did
    assert doc.gpus_used() == {g: n for g, n in plan.gpus_used.items() if n}
    result = simulate_apps(doc, profiles, areq.apps, rates, SimConfig(duration_s=10, seed=4))
    for m in MODELS:
        suffix = result.parts[f"{m}.3-10"]["arrivals"]
        entered = sum(result.apps[f"{m}.e{e}"]["arrived"] for e in (1, 3))
        assert suffix == entered - result.parts[f"{m}.1-3"]["dropped"]
        assert result.parts[f"{m}.1-3"]["arrivals"] == result.apps[f"{m}.e1"]["arrived"]
        # the suffix batched requests of both entry points together (its batches' members
        # recorded); the alignment part only ever holds entry 1's
        suffix, head = result.batches[f"{m}.3-10"], result.batches[f"{m}.1-3"]
        assert suffix["mixed"] > 0 and f"{m}.e1 + {m}.e3" in suffix["members"], suffix
        assert set(suffix["members"]) <= {f"{m}.e1", f"{m}.e3", f"{m}.e1 + {m}.e3"}
        assert head["mixed"] == 0 and set(head["members"]) == {f"{m}.e1"}


@pytest.mark.parametrize(
    ("shares", "rate"),
    [
        (((1, 0.9), (3, 0.85), (4, 0.8)), 150.0),  # every grouping costs 5
        (((1, 0.6), (3, 0.9), (4, 0.9)), 150.0),  # all in one costs 6, the rest 5
        (((1, 0.9), (2, 0.9), (4, 0.55)), 100.0),  # apart 3, any merge 4
    ],
)
def test_realigned_merging_finds_the_cheapest_grouping_of_a_small_mix(
    ppipe_profiles, hc2_large, shares, rate
):
    m = "convnext_large"
    slo = ppipe_profiles[m].slo_us
    streams = tuple(EntryStream(f"s{e}", m, e, slo * share, rate, slo) for e, share in shares)
    req = GraftRequest(streams, ppipe_profiles, hc2_large, headroom=False)
    planner = _Planner(req, "realigned", lambda line: None)
    rates = {s.name: s.rate for s in streams}
    frags = sorted((s.entry, s.budget_us) for s in streams)
    brute = {}
    for cuts in itertools.product((False, True), repeat=len(frags) - 1):
        groups, current = [], [frags[0]]
        for f, cut in zip(frags[1:], cuts, strict=True):
            if cut:
                groups.append(Group(m, tuple(current)))
                current = []
            current.append(f)
        groups.append(Group(m, tuple(current)))
        brute[tuple(groups)] = planner.price(tuple(groups), rates)
    fragment = plan_streams(req, "per-fragment")
    for merge in ("first", "best"):
        got = plan_streams(dataclasses.replace(req, merge=merge), "realigned")
        assert got.cost_per_hour == pytest.approx(min(brute.values())), merge
        assert got.cost_per_hour <= fragment.cost_per_hour
    assert fragment.cost_per_hour == pytest.approx(brute[tuple(Group(m, (f,)) for f in frags)])
    # priced with a bound (as merging prices its trials): dearer is proven, not solved
    dearest = max(brute, key=lambda g: brute[g])
    assert brute[dearest] < float("inf")
    fresh = _Planner(req, "realigned", lambda line: None)
    assert fresh.price(dearest, rates, at_most=brute[dearest] - 1) == float("inf")
    assert fresh.price(dearest, rates, at_most=brute[dearest]) == pytest.approx(brute[dearest])


def test_a_sized_plan_keeps_its_streams_on_time_on_seeds_it_did_not_use(ppipe_profiles, hc2_large):
    streams = _streams(ppipe_profiles, rate=100.0)
    req = GraftRequest(streams, ppipe_profiles, hc2_large)
    got = plan_streams(req, "realigned", sized=True)
    assert got.on_time is not None and min(got.on_time.values()) >= 0.99
    doc, profiles = got.document()
    assert doc.meta["graft"]["how"] == "realigned"
    rates = {s.name: s.rate for s in streams}
    held = app_attainment_at(doc, profiles, got.request.apps, rates, seeds=(31, 32), duration_s=20)
    assert min(held.values()) >= 0.985, held


def test_raw_and_per_fragment_plans_are_made_as_said(ppipe_profiles, hc2_large):
    streams = _streams(ppipe_profiles)
    req = GraftRequest(streams, ppipe_profiles, hc2_large, headroom=False)
    raw = plan_streams(req, "raw")
    doc, _ = raw.document()
    assert {m.name for m in doc.models} == set(MODELS)  # whole models, shared by streams
    budgets = {a: r["budgets_us"] for a, r in doc.meta["apps"].items()}
    for s in streams:  # the whole SLO
        assert sum(budgets[s.name].values()) == pytest.approx(s.slo_us)
    fragment = plan_streams(req, "per-fragment")
    doc, _ = fragment.document()
    assert {m.name for m in doc.models} == {f"{m}.{e}-10" for m in MODELS for e in (1, 3)}
    with pytest.raises(PoolpipeError, match="how 'x'"):
        plan_streams(req, "x")
    assert np.isfinite(raw.cost_per_hour) and raw.cost_per_hour > 0


def test_the_client_leaves_the_server_what_a_plan_at_its_margin_needs():
    # entry 1 leaves 2000 - 10 - 1000 = 990 ms for 4 ms of server blocks; at margin 0.5 the
    # server's part is 8 ms for entry 1, 12 ms for entry 0: entry 1 still least
    assert choose_entry([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 2_000e3, 0.5)[0] == 1
    # a budget of 1016 ms: the estimate at margin 0.5 (10 + 1000 + 8) no longer fits
    with pytest.raises(PoolpipeError, match="no entry block fits"):
        choose_entry([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 1_016e3, 0.5)
    assert choose_entry([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 1_016e3)[0] == 1


def test_the_graft_plan_command_compares_the_plans_and_writes_one(ppipe_dir, tmp_path, capsys):
    from poolpipe.domain.plan import Plan
    from poolpipe_cli import main

    spec = tmp_path / "streams.toml"
    spec.write_text(
        "[[streams]]\nmodel = 'repvgg-b3'\nentry = 1\nbudget_ms = 38\nrate = 120\n"
        "[[streams]]\nmodel = 'repvgg-b3'\nentry = 2\nbudget_ms = 33\nrate = 160\n"
    )
    out = tmp_path / "plan.json"
    argv = ["graft", "plan", str(spec), "--cluster", "hc2-large", "--profiles", str(ppipe_dir)]
    assert main([*argv, "--no-sizing", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for how in ("realigned", "per-fragment", "raw"):
        assert f"│ {how} " in text
    assert "repvgg-b3.e1" in text and "written to" in text
    doc = Plan.load(out)
    assert doc.meta["graft"]["how"] == "realigned"
    assert {doc.owner(m.name) for m in doc.models} == {"repvgg-b3"}
    spec.write_text("[[streams]]\nmodel = 'nope'\nentry = 1\nbudget_ms = 38\nrate = 1\n")
    assert main(argv) == 2
    assert "model 'nope' is not profiled" in capsys.readouterr().err


def test_the_client_chooses_only_among_the_entries_a_plan_serves():
    args = ([10e3] * 3, [8e6, 1e6, 4e6], 1e6, [2e3] * 3, 9_000e3)
    assert choose_entry(*args)[0] == 1
    assert choose_entry(*args, entries=[0, 2]) == (2, 9_000e3 - 20e3 - 4_000e3)
    with pytest.raises(PoolpipeError, match="entries: blocks 0 to 2"):
        choose_entry(*args, entries=[3])


def test_a_stream_no_pipeline_serves_in_its_budget_is_named(ppipe_profiles, hc2_large):
    slo = ppipe_profiles["repvgg-b3"].slo_us
    streams = (
        EntryStream("ok", "repvgg-b3", 1, slo * 0.8, 10.0, slo),
        EntryStream("tight", "repvgg-b3", 1, 1_000.0, 10.0, slo),
    )
    req = GraftRequest(streams, ppipe_profiles, hc2_large)
    from poolpipe.planner.graft import unservable

    assert list(unservable(req)) == ["tight"]
    assert unservable(req, "raw") == {}  # its whole SLO from block 0
    with pytest.raises(PoolpipeError, match=r"tight \(repvgg-b3 from block 1\): its blocks"):
        plan_streams(req, "per-fragment")


def test_streams_at_one_entry_with_other_budgets_are_fragments_of_their_own(
    ppipe_profiles, hc2_large
):
    m = "convnext_large"
    slo = ppipe_profiles[m].slo_us
    streams = (
        EntryStream("loose", m, 1, slo * 0.9, 50.0, slo),
        EntryStream("tight", m, 1, slo * 0.5, 50.0, slo),
    )
    req = GraftRequest(streams, ppipe_profiles, hc2_large, headroom=False)
    doc, _ = plan_streams(req, "per-fragment").document()
    # the same blocks, planned apart: two parts, the second one's name tagged
    assert {x.name for x in doc.models} == {f"{m}.1-10", f"{m}.1-10.g1"}
    assert {doc.owner(x.name) for x in doc.models} == {m}
    budgets = {a: r["budgets_us"] for a, r in doc.meta["apps"].items()}
    assert list(budgets["loose"].values()) == [pytest.approx(slo * 0.9)]
    assert list(budgets["tight"].values()) == [pytest.approx(slo * 0.5)]
    one = plan_streams(req, "realigned", groups=[group_at(req, m, (1,))]).document()[0]
    assert {x.name for x in one.models} == {f"{m}.1-10"}  # one pool for both, planned at 0.5
    assert one.model(f"{m}.1-10").slo_us == pytest.approx(slo * 0.5)
    with pytest.raises(PoolpipeError, match=r"stream tight .* is in 0 groups"):
        plan_streams(req, "realigned", groups=[Group(m, ((1, slo * 0.9),))])


def test_the_entry_mix_moving_is_the_load_a_plan_of_streams_is_advised_for(
    ppipe_profiles, hc2_large
):
    """A plan of streams records them: the router watches each stream's rate (its mix of
    entry points), and the advice for another mix plans the streams again as they were
    planned, at the new rates; dilated and back, the streams are the same."""
    from poolpipe.domain.plan import dilated, undilated, watched_load
    from poolpipe.planner.advise import advise, profiled_models
    from poolpipe.planner.follow import short_of

    streams = _streams(ppipe_profiles)
    req = GraftRequest(streams, ppipe_profiles, hc2_large, headroom=False)
    doc, _ = plan_streams(req, "realigned").document()
    watched = watched_load(doc)
    assert watched == {s.name: (60.0, 60.0) for s in streams}
    assert profiled_models(doc) == sorted(MODELS)
    back = undilated(dilated(doc, 10.0))
    for was, got in zip(doc.meta["graft"]["streams"], back.meta["graft"]["streams"], strict=True):
        assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in was.items()}
    assert watched_load(dilated(doc, 10.0))[streams[0].name][0] == pytest.approx(6.0)
    # clients move to deeper entries: the entry-3 streams' rate triples, entry 1's falls
    moved = {s.name: 180.0 if s.entry == 3 else 20.0 for s in streams}
    a = advise(doc, ppipe_profiles, moved, hc2_large, headroom=0.0, delivery="off")
    assert a.plan is not None and a.why_not is None
    again = {st["name"]: st["rate"] for st in a.plan.meta["graft"]["streams"]}
    assert again == pytest.approx(moved)
    assert a.plan.meta["graft"]["how"] == "realigned" and a.cost_per_hour > 0
    # the same segments (a running router rolls it out), their pools sized anew
    assert {m.name for m in a.plan.models} == {m.name for m in doc.models}
    # the suffix of each model now serves what both entries send: 200 req/s
    for m in MODELS:
        assert a.plan.model(f"{m}.3-10").throughput >= 200.0 - 1e-6
    assert sorted(short_of({n: d for n, (d, _) in watched.items()}, a.asked)) == sorted(
        s.name for s in streams if s.entry == 3
    )
    with pytest.raises(PoolpipeError, match="no stream of"):
        advise(doc, ppipe_profiles, {"nobody": 1.0}, hc2_large)


def test_a_client_slo_no_path_meets_is_refused_naming_the_least_that_is():
    """An application request's own SLO (a hybrid client's budget left) is checked before
    anything runs: each part's earliest end, after its parents' fastest paths, against
    its due time scaled to that SLO; the refusal names the least SLO that passes."""
    from poolpipe.domain.apps import App, Edge
    from poolpipe.runtime.apps import check_app_slo, served_app
    from poolpipe.runtime.intake import BadRequest

    app = App("cam", 40e3, 1.0, ("m.1-3", "m.3-10"), (Edge("m.1-3", "m.3-10"),))
    served = served_app(app, {"m.1-3": 15e3, "m.3-10": 25e3}, {"m.1-3": "a", "m.3-10": "b"})
    fastest = {"a": 6e3, "b": 12e3}.__getitem__
    # due: a by 15 ms, b by 40 (after a); earliest ends: a at 6 ms, b at 6 + 12 = 18
    check_app_slo(served, 40e3, fastest, 0.0)  # the plan's own
    check_app_slo(served, 18e3, fastest, 0.0)  # b's due scaled to 18 ms: just fits
    with pytest.raises(BadRequest, match=r"too short.*b ends 18.00 ms.*at least 18.00") as e:
        check_app_slo(served, 17e3, fastest, 0.0)
    least = float(str(e.value).rsplit(" ", 1)[-1]) * 1e3
    check_app_slo(served, least, fastest, 0.0)
    with pytest.raises(BadRequest, match=r"1 ms held back.*at least 19\.00"):
        check_app_slo(served, 18.5e3, fastest, 1e3)  # the reply margin counts


def _frag_groups(m, frags):
    return tuple(Group(m, (f,)) for f in frags)


def test_merging_tries_each_entry_blocks_fragments_together_first():
    frags = [(1, 10.0), (1, 20.0), (3, 10.0), (3, 20.0)]
    start = _frag_groups("m", frags)
    asked = []

    def price(groups, at_most):  # a group costs 2, one entry block's together cost 1.5
        asked.append(tuple(g.entries for g in groups))
        return sum(2.0 if len(g.entries) > 1 else 1.5 for g in groups) - 0.5 * (len(groups) == 1)

    got = _merged(start, price)
    assert asked[:2] == [((1,), (1,), (3,), (3,)), ((1,), (3,))]  # the jump after the start
    assert [g.fragments for g in got] == [tuple(frags)]  # then merged on: [1, 3] at 1.5
    # one entry block's fragments dearer together (a tight budget holds the loose back):
    # merged pairwise from the start, as before
    asked.clear()

    def dearer_jump(groups, at_most):
        asked.append(tuple(g.entries for g in groups))
        return 10.0 if len(groups) == 2 and groups[0].entries == (1,) else float(len(groups))

    got = _merged(start, dearer_jump)
    assert asked[2] == ((1,), (3,), (3,))  # the first pair merged after the jump refused
    assert len(got) == 1 and got[0].fragments == tuple(frags)


def test_models_merge_at_once_and_an_error_in_one_stops_the_others():
    import threading

    a = _frag_groups("a", [(1, 1.0), (2, 1.0), (3, 1.0)])
    b = _frag_groups("b", [(1, 1.0), (2, 1.0)])
    both = threading.Barrier(2, timeout=10)  # broken unless both models price at once

    def price(groups, at_most):
        if len(groups) == {"a": 3, "b": 2}[groups[0].model]:  # each model's first price
            both.wait()
        return float(len(groups))

    got = _each_merged({"a": a, "b": b}, price, "first")
    assert [len(got["a"]), len(got["b"])] == [1, 1]  # every merge priced no dearer

    go, calls = threading.Event(), {"b": 0}

    def failing(groups, at_most):
        if groups[0].model == "a":
            raise RuntimeError("solver gone")
        calls["b"] += 1
        go.wait(10)
        return float(len(groups))

    # b's result is asked for first: a's error, not b's end, stops the merging
    threading.Timer(0.5, go.set).start()
    with pytest.raises(RuntimeError, match="solver gone"):
        _each_merged({"b": b, "a": a}, failing, "first")
    assert calls["b"] <= 1  # b's merging stopped at its next price


def test_the_shipped_stream_example_loads_and_every_stream_is_servable(ppipe_profiles, hc2_large):
    from pathlib import Path

    from poolpipe.domain.entry import load_streams
    from poolpipe.planner.graft import unservable

    path = Path(__file__).resolve().parents[1] / "data" / "streams-example.toml"
    streams = load_streams(path, ppipe_profiles)
    assert len({s.model for s in streams}) == 3 and len(streams) >= 8
    assert unservable(GraftRequest(streams, ppipe_profiles, hc2_large)) == {}
