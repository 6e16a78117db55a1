"""The observed load against a served plan's envelope (poolpipe/runtime/envelope.py): rates
over sliding windows from cumulative counts, and the events when the load leaves it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.errors import PoolpipeError
from poolpipe.runtime.envelope import (
    ABOVE,
    BELOW,
    MIX,
    ArrivalRates,
    Envelope,
    EnvelopeConfig,
)

NAMES = ("a", "b", "c")
DELIVERABLE = (100.0, 50.0, 20.0)
WEIGHTS = (0.5, 0.3, 0.2)


def run(series, config=None, seed=0):
    """Feed per-second Poisson arrivals at `series[t]` (req/s per model) and return the
    events with the second each fired at."""
    rng = np.random.default_rng(seed)
    rates = ArrivalRates(len(NAMES))
    env = Envelope(NAMES, DELIVERABLE, WEIGHTS, config)
    counts = [0] * len(NAMES)
    events = []
    for t, lam in enumerate(series):
        counts = [c + int(rng.poisson(x)) for c, x in zip(counts, lam, strict=True)]
        rates.sample(t * 1e6, counts)
        events += [(t, e) for e in env.check(t * 1e6, rates)]
    return events


def at_share(share, mix=WEIGHTS):
    """Rates with each model at `share` of its deliverable rate (the plan's mix unless a
    total is spread by `mix`)."""
    if mix is WEIGHTS:
        return tuple(share * d for d in DELIVERABLE)
    total = share * sum(DELIVERABLE)
    return tuple(total * m for m in mix)


def test_rates_over_windows_from_cumulative_counts():
    r = ArrivalRates(2, (10.0, 60.0))
    assert r.rates(10) == (0.0, 0.0)
    for t in range(121):  # model 0 at 5 req/s, model 1 at 2 req/s then 8 after 100 s
        r.sample(t * 1e6, [5 * t, 2 * min(t, 100) + 8 * max(0, t - 100)])
    assert r.rates(10) == pytest.approx((5.0, 8.0))
    assert r.rates(60) == pytest.approx((5.0, (40 * 2 + 20 * 8) / 60))
    assert r.sampled_s() >= 60 and r.arrived(10) == 130
    r.sample(121e6, [0, 0])  # counters from zero (a new plan): windows start anew
    assert r.rates(10) == (0.0, 0.0)
    with pytest.raises(PoolpipeError, match="3 arrival counts for 2 models"):
        r.sample(122e6, [1, 2, 3])


@settings(max_examples=25, deadline=None)
@given(
    share=st.floats(0.5, 0.7),
    seed=st.integers(0, 2**16),
    wobble=st.floats(0.0, 0.1),
)
def test_noise_inside_the_envelope_fires_nothing(share, seed, wobble):
    """Poisson arrivals at a steady share of the deliverable rates, at the plan's mix, moved
    by a slow wave of up to `wobble`: no event in 30 minutes."""
    series = [at_share(share * (1 + wobble * np.sin(t / 120))) for t in range(1800)]
    assert run(series, seed=seed) == []


def test_a_rise_fires_once_and_again_only_after_coming_back():
    series = [at_share(0.6)] * 300 + [at_share(1.1)] * 300 + [at_share(0.6)] * 300
    series += [at_share(1.1)] * 120
    events = run(series)
    assert [e.kind for _, e in events] == [ABOVE, ABOVE]
    (t1, e1), (t2, _) = events
    assert 300 < t1 < 360 and 900 < t2 < 960  # within the short window of the rise
    assert "above 0.9 of its deliverable" in e1.why and e1.rates[0] > 90


def test_a_fall_fires_only_when_held_long_enough():
    cfg = EnvelopeConfig(hold_s=600)
    short_lull = [at_share(0.6)] * 400 + [at_share(0.2)] * 500 + [at_share(0.6)] * 400
    assert run(short_lull, cfg) == []
    long_lull = [at_share(0.6)] * 400 + [at_share(0.2)] * 1200
    events = run(long_lull, cfg)
    assert [e.kind for _, e in events] == [BELOW]
    t, e = events[0]
    # below over the 300-s window about 200 s after the fall, then held 600 s
    assert 400 + 600 < t < 400 + 300 + 600 + 30
    assert "for 600 s" in e.why or "for 60" in e.why


def test_a_mix_that_shifts_fires_and_noise_in_the_mix_does_not():
    shifted = [at_share(0.5)] * 400 + [at_share(0.4, (0.25, 0.55, 0.2))] * 400
    events = run(shifted)
    assert [e.kind for _, e in events] == [MIX]
    t, e = events[0]
    assert 400 < t < 700 and e.mix[1] > 0.45 and "away from the plan's" in e.why
    # a small shift (0.05 of the mix) stays inside
    assert run([at_share(0.5, (0.55, 0.27, 0.18))] * 900) == []


def test_envelope_inputs_are_checked():
    with pytest.raises(PoolpipeError, match="plan it with --delivery"):
        Envelope(NAMES, (100.0, 0.0, 20.0), WEIGHTS)
    with pytest.raises(PoolpipeError, match="a deliverable rate and a weight per model"):
        Envelope(NAMES, DELIVERABLE, (1.0,))
    with pytest.raises(PoolpipeError, match="0 < low < high"):
        EnvelopeConfig(low=0.9, high=0.5)
    with pytest.raises(PoolpipeError, match="rate windows"):
        ArrivalRates(2, (0.0,))
