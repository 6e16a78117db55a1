"""Shared fixtures: the shipped PPipe profiles (skipped when ../shared is absent), tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.profiles import LatencyTable, ModelProfile

PPIPE_DIR = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "ppipe-gpu"


@pytest.fixture(scope="session")
def ppipe_dir() -> Path:
    if not (PPIPE_DIR / "block-latency").is_dir():
        pytest.skip(f"shipped PPipe profiles not found at {PPIPE_DIR} (../shared is absent)")
    return PPIPE_DIR


@pytest.fixture(scope="session")
def ppipe_profiles(ppipe_dir: Path) -> dict[str, ModelProfile]:
    from poolpipe.domain.profiles import load_ppipe_dir

    return {p.name: p for p in load_ppipe_dir(ppipe_dir)}


@pytest.fixture
def warehouse_path(tmp_path: Path) -> Path:
    return tmp_path / "wh.duckdb"


def tiny_model(
    name: str,
    tables: dict[tuple[str, int], list[list[float]]],
    boundary_bytes: list[float],
) -> ModelProfile:
    """A hand-made profile: tables[(gpu, share)] = rows per block, columns per batch (µs)."""
    lat = {
        k: LatencyTable(k[0], k[1], np.asarray(rows, dtype=float), source="test")
        for k, rows in tables.items()
    }
    nb = len(next(iter(tables.values())))
    return ModelProfile(name=name, num_blocks=nb, tables=lat, boundary_bytes=tuple(boundary_bytes))


def tiny_cluster(
    pools: list[tuple[str, int, int, tuple[int, ...]]], bandwidth_gbps: float = 10.0
) -> Cluster:
    return Cluster(
        name="tiny",
        bandwidth_gbps=bandwidth_gbps,
        pools=tuple(GpuPool(g, n, h, s) for g, n, h, s in pools),
    )


@pytest.fixture(scope="session")
def prefect_api():
    """One real Prefect API (temporary server and database) for every flow test: starting it
    costs seconds, so the whole session shares it."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
