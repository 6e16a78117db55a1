"""The load follower (planner/follow.py): when it asks for a plan, for what rates, and
which plans it rolls out."""

from __future__ import annotations

import pytest

from poolpipe.errors import PoolpipeError
from poolpipe.planner.follow import CHECK, FollowConfig, LoadFollower, Want, judge
from poolpipe.runtime.envelope import EnvelopeConfig

NAMES = ("a", "b")


def _drive(f: LoadFollower, rates, start_s: float, end_s: float, counts: list[int], step=10.0):
    """Constant `rates` (req/s per model) from start_s to end_s, sampled every `step` s:
    the first Want, or None."""
    t = start_s
    while t < end_s:
        t += step
        for k, r in enumerate(rates):
            counts[k] += round(r * step)
        want = f.observe(t, counts)
        if want is not None:
            return want
    return None


def _follower(**kw) -> LoadFollower:
    f = LoadFollower(NAMES, FollowConfig(**kw))
    f.served([100.0, 50.0], [2.0, 1.0], cost=10.0, gpus={"T4": 8, "L4": 2}, now_s=0.0)
    return f


def test_a_load_inside_the_envelope_asks_only_at_the_periodic_check():
    f = _follower()
    counts = [0, 0]
    assert _drive(f, (60.0, 30.0), 0.0, 1790.0, counts) is None  # 0.6 of deliverable
    want = _drive(f, (60.0, 30.0), 1790.0, 1900.0, counts)
    assert want is not None and want.kind == CHECK and want.at_s == 1800.0
    assert want.rates == pytest.approx({"a": 72.0, "b": 36.0})  # x 1.2
    # a plan no cheaper by 10% is not rolled out, and the next check is 30 min on
    roll, why = f.judge(want, cost=9.5, gpus={"T4": 7, "L4": 2})
    assert not roll and "less than 10% saved" in why
    f.kept(1800.0)
    assert _drive(f, (60.0, 30.0), 1800.0, 3590.0, counts) is None
    want = _drive(f, (60.0, 30.0), 3590.0, 3700.0, counts)
    assert want is not None and want.kind == CHECK
    assert f.judge(want, cost=8.9, gpus={"T4": 6, "L4": 2})[0]  # 11% saved
    # another L4 for two T4s, no cheaper: the served plan delivers what is asked, it stays
    roll, why = f.judge(want, cost=10.0, gpus={"T4": 6, "L4": 3})
    assert not roll and "less than 10% saved" in why
    # rates asked above what the served plan delivers: the plan for them goes out
    more = Want(CHECK, "a look", 3600.0, {"a": 120.0, "b": 36.0})
    roll, why = f.judge(more, cost=12.0, gpus={"T4": 8, "L4": 3})
    assert roll and why == "check: the plan served delivers less than asked for a"


def test_a_rise_asks_at_once_after_a_rollout_long_enough_ago():
    f = _follower(min_interval_s=1800.0)
    counts = [0, 0]
    f.served([100.0, 50.0], [2.0, 1.0], 10.0, {"T4": 8}, now_s=0.0)
    assert _drive(f, (60.0, 30.0), 0.0, 600.0, counts) is None
    # above 0.9 of a's deliverable at 10 min: waits for the 30 minutes since the rollout
    assert _drive(f, (95.0, 30.0), 600.0, 1790.0, counts) is None
    want = _drive(f, (95.0, 30.0), 1790.0, 1900.0, counts)
    assert want is not None and want.kind == "above" and want.at_s == 1800.0
    assert want.rates["a"] == pytest.approx(95.0 * 1.2)
    # the rates asked for are the larger of the short and the long window's
    assert want.rates["b"] == pytest.approx(36.0)
    assert f.judge(want, cost=5.0, gpus={"T4": 4})[0]  # a rise is always acted on
    f.served([130.0, 50.0], [2.0, 1.0], 12.0, {"T4": 10}, now_s=1860.0)
    assert _drive(f, (95.0, 30.0), 1860.0, 3600.0, counts) is None  # inside the new one


def test_a_fall_held_long_enough_asks_before_the_periodic_check():
    f = _follower(min_interval_s=0.0, check_s=1e6)
    counts = [0, 0]
    assert _drive(f, (60.0, 30.0), 0.0, 400.0, counts) is None
    want = _drive(f, (20.0, 10.0), 400.0, 2000.0, counts)  # 0.2 of deliverable
    assert want is not None and want.kind == "below"
    # the long window has to fall below 0.6 first, then it holds for 10 minutes
    assert 400.0 + 600.0 < want.at_s < 400.0 + 300.0 + 600.0 + 20.0
    assert not _follower().judge(want, cost=10.0, gpus={"T4": 8})[0]


def test_follow_config_and_order_are_checked():
    with pytest.raises(PoolpipeError, match="headroom"):
        FollowConfig(headroom=-1)
    with pytest.raises(PoolpipeError, match="shrink"):
        FollowConfig(shrink=1.0)
    with pytest.raises(PoolpipeError, match="check_s"):
        FollowConfig(check_s=0)
    with pytest.raises(PoolpipeError, match="served must be called"):
        LoadFollower(NAMES).observe(1.0, [0, 0])
    assert FollowConfig().envelope == EnvelopeConfig(high=0.9, low=0.6, hold_s=600.0)


def test_a_plan_that_states_nothing_it_delivers_is_judged_by_its_gpus():
    """Where the served plan states no deliverable rates (a hand-made one), a plan for the
    load that needs more GPUs of some type than it has goes out."""
    new, served = {"T4": 6, "L4": 3}, {"T4": 8, "L4": 2}
    roll, why = judge(CHECK, "a look", 10.0, new, 10.0, served, 0.1)
    assert roll and why == "check: the load needs more L4"
    assert not judge(CHECK, "a look", 10.0, new, 10.0, served, 0.1, short=[])[0]
