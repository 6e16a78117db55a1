"""One simulation of a plan at a load factor: topology, arrivals, data plane, result."""

from __future__ import annotations

from collections.abc import Sequence

from poolpipe.scheduler import Topology, make_data_plane
from poolpipe.sim.arrivals import ArrivalSpec, generate
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import SimResult
from poolpipe.sim.scenario import Scenario


def run_once(
    topo: Topology,
    arrivals: ArrivalSpec,
    load_factor: float,
    config: SimConfig,
    data_plane: str = "reservation",
    reference_rates: Sequence[float] | None = None,
    scenario: Scenario | None = None,
) -> SimResult:
    """Simulate `topo` with each model's rate = load factor x reference rate (req/s).

    The reference defaults to the plan's own throughput; pass the ppipe plan's throughputs
    to run a baseline plan at the same absolute rates.
    """
    base = (
        list(reference_rates)
        if reference_rates is not None
        else [m.throughput for m in topo.models]
    )
    rates = [load_factor * r for r in base]
    times, models = generate(
        arrivals, rates, config.duration_s, config.seed, [m.name for m in topo.models]
    )
    dp = make_data_plane(data_plane, topo)
    return Simulator(topo, dp, times, models, config, scenario).run()
