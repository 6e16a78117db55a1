"""Time-dilated emulation (docs/design/emulation.md): a plan dilated by D (latencies and
SLOs x D, throughputs and NICs / D), and an emulated cluster built from a clusters-file
preset (servers of gpus_per_server GPUs, a node slot per GPU, NICs / D)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolpipe.domain.cluster import load_cluster
from poolpipe.domain.inventory import Inventory, InventoryNode, InventoryServer
from poolpipe.domain.plan import dilated, time_scale, undilated
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.errors import PoolpipeError
from poolpipe.scheduler.topology import build_topology
from poolpipe.store.warehouse import REPO_ROOT, Warehouse
from testbed.netns import EmulatedCluster, EmulationError

GROUP2 = REPO_ROOT / "data" / "ppipe-gpu-group2"


@pytest.fixture(scope="module")
def group2_plan(tmp_path_factory):
    from poolpipe.planner import make_plan
    from poolpipe.store.plan_inputs import plan_request

    profiles = load_ppipe_dir(GROUP2)
    path = tmp_path_factory.mktemp("dilation") / "wh.duckdb"
    with Warehouse.open(path) as wh:
        wh.store_profiles(profiles)
        req = plan_request(
            wh,
            [p.name for p in profiles],
            "hc2-small",
            clusters_file=GROUP2 / "clusters.toml",
            weights=[0.30, 0.33, 0.37],
            slo_scale=5.0,
        )
        return make_plan(req), {p.name: p for p in profiles}, path


def test_a_dilated_plan_is_the_same_plan_d_times_slower(group2_plan):
    plan, profiles, _ = group2_plan
    # what it delivers is stated x D slower too (the envelope of a router serving it), and
    # the rates the cost objective asked for (what a router checks a plan it loads by)
    stated = tuple(replace(m, deliverable=0.8 * m.throughput) for m in plan.models)
    asked = {m.name: 0.5 * m.throughput for m in plan.models}
    plan = replace(plan, models=stated, meta={**plan.meta, "rates": asked})
    slow = dilated(plan, 20.0)
    assert slow.meta["time_scale"] == 20.0
    assert slow.cluster.bandwidth_gbps == pytest.approx(plan.cluster.bandwidth_gbps / 20)
    assert slow.objective == pytest.approx(plan.objective / 20)
    for m, s in zip(plan.models, slow.models, strict=True):
        assert s.slo_us == pytest.approx(m.slo_us * 20)
        assert s.throughput == pytest.approx(m.throughput / 20)
        assert s.deliverable == pytest.approx(m.deliverable / 20)
        assert slow.meta["rates"][m.name] == pytest.approx(asked[m.name] / 20)
        for p, q in zip(m.pipelines, s.pipelines, strict=True):
            assert q.latency_us == pytest.approx(p.latency_us * 20)
            assert [(a.start, a.end, a.gpu, a.vgpus) for a in q.partitions] == [
                (a.start, a.end, a.gpu, a.vgpus) for a in p.partitions
            ]
    # the router builds its topology from it: the same pools, deadlines and links x D
    topo, slow_topo = build_topology(plan, profiles), build_topology(slow, profiles)
    assert [(p.start, p.end, p.gpu) for p in topo.pools] == [
        (p.start, p.end, p.gpu) for p in slow_topo.pools
    ]
    for p, q in zip(topo.pools, slow_topo.pools, strict=True):
        assert q.transfer_in_us == pytest.approx(p.transfer_in_us * 20)
    back = dilated(slow, 1 / 20)
    assert back.meta["time_scale"] == pytest.approx(1.0)
    assert back.models[0].slo_us == pytest.approx(plan.models[0].slo_us)
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(PoolpipeError, match="time scale must be a number > 0"):
            dilated(plan, bad)


def test_an_emulated_cluster_from_a_preset_has_a_node_per_gpu():
    cluster = load_cluster(GROUP2 / "clusters.toml", "hc2-small")
    em = EmulatedCluster.from_cluster(cluster, REPO_ROOT / "out" / "unused", time_scale=20)
    # 4 L4 on one server, 12 T4 two to a server; nothing is built until it is entered
    assert em._slots == [4, 2, 2, 2, 2, 2, 2] and em.servers == 7
    assert em.devices == ["L4"] * 4 + ["T4"] * 12
    assert em.bandwidth_gbps == pytest.approx(10 / 20)
    with pytest.raises(EmulationError, match="time scale must be > 0"):
        EmulatedCluster.from_cluster(cluster, REPO_ROOT / "out" / "unused", time_scale=0)


def test_a_capacity_search_may_start_at_a_guess():
    """loadgen.bisect_grid: the same largest passing step from a guess (the live search
    starts at the plan's stated figure, the simulator's at the live answer), asking fewer
    loads when the guess is near, above or below it."""
    from testbed.loadgen import bisect_grid

    for answer in (0, 1, 5, 15, 16):
        for guess in (None, 0, 1, answer, answer + 1, 16, 40):
            asked: list[int] = []

            def passes(i: int, answer: int = answer, asked: list[int] = asked) -> bool:
                asked.append(i)
                return i <= answer

            assert bisect_grid(passes, 16, guess) == answer, (answer, guess)
            if guess == answer and answer:
                assert asked[0] == answer and len(asked) <= 5
            if guess == answer + 1 and 0 < answer < 16:  # one step high: two loads asked
                assert asked == [answer + 1, answer], asked
            if guess == answer and 0 < answer < 16:  # right: the step above it asked next
                assert asked == [answer, answer + 1], asked
    # a guess far too high: 1, 2, 4, 8 steps down, then bisected (not from 0)
    asked = []
    assert bisect_grid(lambda i: asked.append(i) or i <= 3, 32, 22) == 3
    assert asked[:5] == [22, 21, 19, 15, 7] and len(asked) <= 8, asked
    # a guess far too low: 1, 2, 4, 8 steps up, then bisected (not up to the top)
    asked = []
    assert bisect_grid(lambda i: asked.append(i) or i <= 20, 32, 5) == 20
    assert asked[:5] == [5, 6, 8, 12, 20] and len(asked) <= 8, asked


def test_a_rate_is_judged_on_its_traces_together():
    """loadgen.rate_passes: >= 99% on time over all of a rate's traces, not each; a trace
    after which the traces can no longer pass ends the rate; a narrow failure is judged
    again on more traces (`extra`), all of them together."""
    from testbed.loadgen import rate_passes

    def traces(*figures: tuple[float, int]):
        driven: list[int] = []

        def run(k: int) -> tuple[float, int]:
            driven.append(k)
            return figures[k]

        return run, driven

    run, driven = traces((0.985, 200), (1.0, 200))  # 3 late of 400: passes together
    ok, share = rate_passes(2, run)
    assert ok and share == pytest.approx(397 / 400) and driven == [0, 1]
    run, driven = traces((0.975, 200), (1.0, 200))  # 5 late: 4 are allowed
    assert rate_passes(2, run)[0] is False and driven == [0]  # (no second trace driven)
    run, driven = traces((0.99, 200), (0.985, 200))  # 2 + 3 late of 400
    ok, share = rate_passes(2, run)
    assert not ok and share == pytest.approx(395 / 400) and driven == [0, 1]
    assert rate_passes(1, traces((0.99, 100))[0]) == (True, pytest.approx(0.99))
    # a narrow failure is driven further and judged on every trace: 7 late of 400 fail
    # two traces, of 800 pass four
    run, driven = traces((0.985, 200), (0.98, 200), (1.0, 200), (1.0, 200))
    ok, share = rate_passes(2, run, extra=2)
    assert ok and share == pytest.approx(793 / 800) and driven == [0, 1, 2, 3]
    # one more trace where that is enough (6 of 600 late)
    run, driven = traces((0.99, 200), (0.985, 200), (0.995, 200), (1.0, 200))
    assert rate_passes(2, run, extra=2) == (True, pytest.approx(594 / 600)) and driven == [0, 1, 2]
    # a clear failure is not: 9 late of 400 can no longer pass in 800
    run, driven = traces((0.98, 200), (0.975, 200), (1.0, 200), (1.0, 200))
    assert rate_passes(2, run, extra=2)[0] is False and driven == [0, 1]
    # nor one that the extra traces do not rescue (9 late of 600)
    run, driven = traces((0.99, 200), (0.985, 200), (0.98, 200), (1.0, 200))
    assert rate_passes(2, run, extra=2)[0] is False and driven == [0, 1, 2]


def test_a_live_capacity_comes_with_the_interval_of_its_share_on_time():
    """testbed.emulated.wilson: the 95% Wilson interval the main job prints beside a live
    capacity (the requests it was judged on, their share on time)."""
    from testbed.emulated import wilson

    lo, hi = wilson(1.0, 141)  # every request of two 1-s traces on time
    assert hi == 1.0 and 0.973 < lo < 0.974
    narrow, wide = wilson(0.99, 1000), wilson(0.99, 100)
    assert wide[0] < narrow[0] < 0.99 < narrow[1] < wide[1]
    assert wilson(0.5, 0) == (0.0, 1.0)  # nothing judged: nothing known


def _emulated_inventory(d: float) -> Inventory:
    """hc2-small as an emulated cluster at time scale `d` lists it: NICs at 10 Gbit/s / d."""
    servers = [("s0", "L4", 4)] + [(f"s{k}", "T4", 2) for k in range(1, 7)]
    return Inventory(
        tuple(InventoryServer(name, 10.0 / d) for name, _, _ in servers),
        tuple(
            InventoryNode(f"{gpu}-{name}-{i}", name, gpu, f"10.0.0.{k}:{8001 + i}", (1, 2, 3, 4))
            for k, (name, gpu, count) in enumerate(servers)
            for i in range(count)
        ),
    )


def test_a_replan_of_a_router_at_a_time_scale_plans_undilated_and_serves_dilated(group2_plan):
    """The re-plan flows against a router serving emulated nodes at time scale D (its plan
    dilated; its inventory's NICs / D): planned from the profiles as they are, for the
    NICs x D and the router's rates x D, and served dilated by D again."""
    from flows.replan import advise_plan, new_plan, surviving_cluster

    plan, _, wh = group2_plan
    slow, inv = dilated(plan, 10.0), _emulated_inventory(10.0)
    with Warehouse.open(wh) as w:
        offered = surviving_cluster(w, None, None, inv, [], 10.0)
    assert offered.bandwidth_gbps == pytest.approx(10.0)
    again = new_plan.fn(str(wh), slow, [0.30, 0.33, 0.37], None, None, inv, [])
    assert time_scale(again) == pytest.approx(10.0)
    assert [m.slo_us for m in again.models] == pytest.approx([m.slo_us for m in slow.models])
    assert again.cluster.bandwidth_gbps == pytest.approx(1.0)
    # what the router serves now, planned again: about as much (not a plan for SLOs x D)
    assert undilated(again).objective == pytest.approx(plan.objective, rel=0.1)
    seen = {m.name: 0.1 * m.throughput / 10 for m in slow.models}  # req/s at the router
    status = {"load": {"models": {n: {"req_s": {"10s": r, "60s": r, "300s": r}}
                                  for n, r in seen.items()}}}  # fmt: skip
    a = advise_plan.fn(str(wh), slow, status, offered, 0.2, None)
    assert a.rates == pytest.approx({n: 10 * r for n, r in seen.items()})
    assert a.plan is not None and time_scale(a.plan) == 1.0
    with pytest.raises(PoolpipeError, match=r"keeps no rate over 30s \(it keeps 10s, 60s, 300s\)"):
        advise_plan.fn(str(wh), slow, status, offered, 0.2, None, ("30s",))


def test_every_rate_of_a_search_drives_one_pattern():
    """loadgen.scaled_poisson_times / mix_times(scaled=True): the same arrivals and models
    at every rate, times / rate (a burst that decides one rate is in all of them)."""
    import numpy as np

    from testbed.loadgen import mix_times

    slow, m_slow = mix_times(100.0, [0.3, 0.7], 10.0, seed=5, scaled=True)
    fast, m_fast = mix_times(250.0, [0.3, 0.7], 10.0, seed=5, scaled=True)
    assert 850 < len(slow) < 1150 and 2250 < len(fast) < 2750
    assert np.allclose(fast[: len(slow)] * 2.5, slow) and (m_fast[: len(slow)] == m_slow).all()
    assert fast.max() < 10.0 and (np.diff(fast) >= 0).all()
    other, _ = mix_times(100.0, [0.3, 0.7], 10.0, seed=6, scaled=True)
    assert not np.array_equal(other[:50], slow[:50])


def test_a_ladders_loads_are_judged_together_as_shares_that_do_not_rise_with_the_load():
    """loadgen.kept_rungs: the main job's runs of 2026-12-02, each load one trace. A load
    that lost 3 of 261 below one that kept 296 of 297 is kept with it (pooled 0.993); a
    plan whose shares fall through 99% keeps the loads before; a rise that, pooled, stays
    under 99% keeps nothing more; a load kept alone is never lost."""
    import numpy as np

    from testbed.loadgen import kept_rungs

    n = [200, 261, 297]
    assert kept_rungs([1.000, 258 / 261, 296 / 297], n) == 3  # ppipe: all three
    assert kept_rungs([1.000, 259 / 261, 291 / 297], n) == 2  # np: 212 req/s
    assert kept_rungs([1.000, 257 / 261, 291 / 297], n) == 1
    assert kept_rungs([1.000, 254 / 261, 296 / 297], n) == 1  # pooled 0.986: still under
    assert kept_rungs([197 / 200, 259 / 261, 293 / 297], n) == 0  # pooled 0.989: none
    assert kept_rungs([0.995, 0.992, 0.993], n) == 3
    assert kept_rungs([], []) == 0
    # never fewer than judged one at a time below the first failure
    rng = np.random.default_rng(5)
    for _ in range(300):
        shares = list(1.0 - rng.integers(0, 6, 3) / 261)
        alone = next((k for k, s in enumerate(shares) if s < 0.99), 3)
        assert kept_rungs(shares, [261] * 3) >= alone


def test_a_plan_that_keeps_every_load_of_the_ladder_is_driven_further():
    """loadgen.climb_ladder: the main job's ladder (grid steps 15, 19, 22 of ppipe's plan
    rate over 32); a plan that keeps all three is driven at 25, the gap of the top two
    further, and no more than `beyond` loads; one that missed a load below is not; a load
    further that is missed leaves the figure where the ladder put it; none past `top`."""
    from testbed.loadgen import climb_ladder

    def plan(lost_at: dict[int, int]):
        asked: list[int] = []

        def drive(i: int) -> tuple[float, int]:
            asked.append(i)
            return 1.0 - lost_at.get(i, 0) / 300, 300

        return asked, drive

    asked, drive = plan({})
    assert climb_ladder([15, 19, 22], drive, beyond=1, top=32) == ([15, 19, 22, 25], 4)
    assert asked == [15, 19, 22, 25]
    asked, drive = plan({})
    assert climb_ladder([15, 19, 22], drive, beyond=3, top=26) == ([15, 19, 22, 25], 4)
    asked, drive = plan({25: 9})  # 0.970 further: kept the three below still
    assert climb_ladder([15, 19, 22], drive, beyond=2, top=32) == ([15, 19, 22, 25], 3)
    asked, drive = plan({19: 7})  # missed in the ladder (pooled 0.988): nothing further
    assert climb_ladder([15, 19, 22], drive, beyond=2, top=32) == ([15, 19, 22], 1)
    assert asked == [15, 19, 22]
    asked, drive = plan({})
    assert climb_ladder([15, 19, 22], drive) == ([15, 19, 22], 3)  # beyond 0: the ladder
    assert climb_ladder([], drive, beyond=2) == ([], 0)


def test_the_load_that_sets_a_ladders_figure_by_a_request_or_two_is_driven_once_more():
    """loadgen.climb_ladder `again`: the first load not kept, where it failed narrowly
    (kept, were one more trace of its size all on time), is driven one trace more and
    judged on both, once a ladder; a clear failure, a load kept and the loads below are
    not."""
    from testbed.loadgen import climb_ladder

    def plan(lost: dict[int, int], lost_again: dict[int, int]):
        asked: list[tuple[str, int]] = []

        def drive(i: int) -> tuple[float, int]:
            asked.append(("drive", i))
            return 1.0 - lost.get(i, 0) / 300, 300

        def again(i: int) -> tuple[float, int]:
            asked.append(("again", i))
            return 1.0 - lost_again.get(i, 0) / 300, 300

        return asked, drive, again

    # 4 of 300 lost at 25 (0.987), none of 300 more: 0.993, kept; none further past top
    asked, drive, again = plan({25: 4}, {})
    assert climb_ladder([15, 19, 22], drive, 1, 25, again=again) == ([15, 19, 22, 25], 4)
    assert asked == [("drive", 15), ("drive", 19), ("drive", 22), ("drive", 25), ("again", 25)]
    # the trace more loses as many: 0.987 of 600, not kept, and not driven a third time
    asked, drive, again = plan({25: 4}, {25: 4})
    assert climb_ladder([15, 19, 22], drive, 1, 32, again=again) == ([15, 19, 22, 25], 3)
    assert asked.count(("again", 25)) == 1
    # 7 of 300 (0.977): would miss 99% with 300 more on time; not driven again
    asked, drive, again = plan({22: 7}, {})
    assert climb_ladder([15, 19, 22], drive, 1, 32, again=again) == ([15, 19, 22], 2)
    assert all(kind == "drive" for kind, _ in asked)
    # narrowly missed in the ladder, kept on a trace more: driven further
    asked, drive, again = plan({19: 4, 22: 3}, {})  # pooled 0.988
    assert climb_ladder([15, 19, 22], drive, 1, 32, again=again) == ([15, 19, 22, 25], 4)
    assert asked[3:] == [("again", 19), ("drive", 25)]
    # two loads narrowly missed: the first driven again, once a ladder
    asked, drive, again = plan({19: 4, 22: 4}, {})
    assert climb_ladder([15, 19, 22], drive, 1, 32, again=again) == ([15, 19, 22], 2)
    assert asked[3:] == [("again", 19)]
    # without `again`, as before
    asked, drive, _ = plan({25: 4}, {})
    assert climb_ladder([15, 19, 22], drive, 1, 32) == ([15, 19, 22, 25], 3)


def test_the_typical_arrival_pattern_is_the_one_nearest_the_mean_share():
    """loadgen.nearest_to_mean: the pattern whose shares (per plan and load) lie nearest
    their means over all patterns, each in its own standard deviations; not the kindest to
    either plan."""
    from testbed.loadgen import nearest_to_mean

    shares = {
        200: [1.000, 0.992, 0.986],  # kind at the first two loads, harsh at the third
        1200: [0.995, 0.986, 0.990],  # the means: 0.99525, 0.98675, 0.990
        2200: [0.990, 0.984, 0.993],  # harsh at the first, kind at the third
        3200: [0.996, 0.985, 0.991],
    }
    assert nearest_to_mean(shares) == 1200
    del shares[1200]  # the means now 0.9953, 0.9870, 0.9900: 3200 nearest
    assert nearest_to_mean(shares) == 3200
    # a load near 99% and one far past the capacity whose shares spread widely (in the sum
    # of plain squares 2 is nearest, kind at the first load): each in its own spread
    wide = {
        1: [0.990, 1.0, 0.90],
        2: [0.996, 1.0, 0.94],
        3: [0.984, 1.0, 0.97],
        4: [0.991, 1.0, 0.99],  # the mean at the first load: 0.99025
    }
    assert nearest_to_mean(wide) == 4
    assert nearest_to_mean({7: [0.9], 5: [0.9]}) == 5  # a tie: the lowest seed
    with pytest.raises(ValueError):
        nearest_to_mean({})
    with pytest.raises(ValueError):
        nearest_to_mean({1: [], 2: []})


def test_a_comparison_on_short_traces_is_driven_with_the_typical_pattern(group2_plan):
    """testbed.emulated.typical_pattern on hc2-small's ppipe plan: of four patterns, the one
    whose simulated shares at two loads near its capacity lie nearest the mean of the four
    (each share simulated again here), with the mean and the patterns that keep 99%."""
    import numpy as np

    from poolpipe.scheduler.topology import simulated_topology
    from testbed.emulated import MAF19, simulated_share, typical_pattern

    plan, profiles, _ = group2_plan
    weights = {m.name: w for m, w in zip(plan.models, MAF19, strict=True)}
    rates = [0.6 * plan.objective, 0.8 * plan.objective]
    chosen = typical_pattern({"ppipe": (plan, 1)}, profiles, weights, rates, 1.25, candidates=4)
    seeds = [200, 1200, 2200, 3200]
    assert chosen["candidates"] == 4 and chosen["seed"] in seeds
    topo = simulated_topology(plan, profiles)
    w = [weights[m.name] for m in topo.models]
    got = {s: [simulated_share(topo, w, r, 1.25, s) for r in rates] for s in seeds}
    share = {s: np.array([on / n for on, n in v]) for s, v in got.items()}
    mean = np.mean(list(share.values()), axis=0)
    sd = np.std(list(share.values()), axis=0)  # each share in its own spread
    z = {s: np.divide(v - mean, sd, out=np.zeros_like(v), where=sd > 0) for s, v in share.items()}
    dist = {s: float((v**2).sum()) for s, v in z.items()}
    assert dist[chosen["seed"]] == min(dist.values())
    assert len(set(dist.values())) > 1  # the patterns differ: a choice was made
    for k, r in enumerate(rates):
        assert chosen["shares"]["ppipe"][r] == share[chosen["seed"]][k]
        assert chosen["mean"]["ppipe"][r] == pytest.approx(mean[k])
        assert 0 <= chosen["kept"]["ppipe"][r] <= 4
