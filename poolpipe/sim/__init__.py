"""Discrete-event simulation of plans: the cluster, arrival processes, metrics, and the
capacity search. It drives the data planes of `poolpipe.scheduler`; it never restates them.
"""

from __future__ import annotations

from poolpipe.sim.arrivals import ArrivalSpec, generate
from poolpipe.sim.engine import SimConfig, Simulator
from poolpipe.sim.metrics import ATTAINMENT_TARGET, ModelOutcome, SimResult
from poolpipe.sim.runner import run_once

__all__ = [
    "ATTAINMENT_TARGET",
    "ArrivalSpec",
    "ModelOutcome",
    "SimConfig",
    "SimResult",
    "Simulator",
    "generate",
    "run_once",
]
