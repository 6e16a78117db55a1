"""Warehouse rows for simulation results and capacity searches (one row per model)."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from typing import Any

from poolpipe.sim.capacity import CapacityResult
from poolpipe.sim.metrics import SimResult


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def sim_rows(
    result: SimResult,
    *,
    label: str,
    config: str,
    strategy: str,
    cluster: str,
    arrivals: str,
    load_factor: float,
    seed: int,
    jitter: float,
) -> list[dict[str, Any]]:
    at, host = _now(), socket.gethostname()
    return [
        {
            "run_at": at,
            "run_label": label,
            "config": config,
            "plan_strategy": strategy,
            "cluster": cluster,
            "data_plane": result.data_plane,
            "arrivals": arrivals,
            "load_factor": load_factor,
            "seed": seed,
            "duration_s": result.duration_s,
            "jitter": jitter,
            "model": m.name,
            "rate_per_s": m.rate_per_s,
            "arrived": m.arrived,
            "on_time": m.on_time,
            "late": m.late,
            "dropped": m.dropped,
            "attainment": m.attainment,
            "latency_p50_us": m.latency_p50_us,
            "latency_p99_us": m.latency_p99_us,
            "probes_per_batch": result.probes_per_batch,
            "sched_us_per_batch": result.sched_us_per_batch_median,
            "wall_s": result.wall_s,
            "host": host,
        }
        for m in result.models
    ]


def capacity_rows(
    cap: CapacityResult,
    *,
    label: str,
    config: str,
    strategy: str,
    cluster: str,
    data_plane: str,
    arrivals: str,
    search: str,
    seeds: list[int],
    duration_s: float,
) -> list[dict[str, Any]]:
    at, host = _now(), socket.gethostname()
    return [
        {
            "run_at": at,
            "run_label": label,
            "config": config,
            "plan_strategy": strategy,
            "cluster": cluster,
            "data_plane": data_plane,
            "arrivals": arrivals,
            "search": search,
            "seeds": ",".join(map(str, seeds)),
            "duration_s": duration_s,
            "model": name,
            "capacity": cap.capacity[name],
            "points_json": json.dumps(cap.points(name)),
            "simulations": cap.simulations,
            "host": host,
        }
        for name in cap.models
    ]
