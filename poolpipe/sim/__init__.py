"""Discrete-event simulation of plans: a virtual clock and a simulated cluster driving the
serving runtime (and through it the data planes), arrival processes, scenarios of faults and
rollouts, metrics, and the capacity search. It never restates a serving policy.
"""

from __future__ import annotations

from poolpipe.sim.arrivals import ArrivalSpec, generate
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import ATTAINMENT_TARGET, ModelOutcome, SimResult
from poolpipe.sim.runner import run_once
from poolpipe.sim.scenario import Scenario, load_scenario

__all__ = [
    "ATTAINMENT_TARGET",
    "ArrivalSpec",
    "ModelOutcome",
    "Scenario",
    "SimConfig",
    "SimResult",
    "Simulator",
    "generate",
    "load_scenario",
    "run_once",
]
