"""Queueing headroom of a pool: the share of its vGPUs' throughput that a pool of c vGPUs
can be loaded to while losing at most 1% of a Poisson stream to waiting beyond a deadline.

A pool of c vGPUs, each serving one batch in a fixed time s, fed Poisson requests, where a
request that would wait more than W = r·s for a vGPU is turned away (the data plane drops a
request that cannot make its deadline): the M/D/c queue with deadlines. `utilisation(c, r)`
is the largest load ρ (of c/s) at which at most TARGET_LOSS of the requests are turned away.
It grows with c (pooling) and with r (slack): one vGPU with a slack of one stage serves
about 14% of its throughput, 16 vGPUs with a slack of two stages 99%.

The table is simulated once (`python -m poolpipe.planner.headroom` writes
headroom_table.json beside this file; tests/test_deliverable.py re-simulates cells of it)
and interpolated in log c and log r. The planner uses it to shape plans (planner/
deliverable.py); what a plan delivers is then measured by simulating the plan itself.
"""

from __future__ import annotations

import json
import math
import sys
from functools import cache
from pathlib import Path

import numpy as np

TABLE = Path(__file__).with_name("headroom_table.json")
TARGET_LOSS = 0.01
POOL_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
SLACKS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
# simulation of one (c, ρ, r) point: independent replicas side by side, customers each,
# the first `warm` of each not counted
REPLICAS = 64
CUSTOMERS = 4000
WARM = 400
SEARCH_STEPS = 14  # bisection steps over ρ in (0, RHO_MAX]
RHO_MAX = 1.25


def loss(c: int, rho: float, r: float, seed: int = 0) -> float:
    """The share of requests turned away in the M/D/c queue with deadline r (in service
    times) at load rho (per vGPU), by simulation (common random numbers for one seed, so
    that the loss is monotone in rho within a search)."""
    rng = np.random.default_rng(seed)
    gaps = rng.standard_exponential((CUSTOMERS, REPLICAS)) / (rho * c)
    free = np.zeros((REPLICAS, c))  # per replica, when each vGPU is next free (sorted)
    t = np.zeros(REPLICAS)
    lost = 0
    for k in range(CUSTOMERS):
        t += gaps[k]
        first = free[:, 0]
        start = np.maximum(t, first)
        ok = start - t <= r
        free[:, 0] = np.where(ok, start + 1.0, first)
        if c > 1:
            free.sort(axis=1)
        if k >= WARM:
            lost += int(REPLICAS - ok.sum())
    return lost / (REPLICAS * (CUSTOMERS - WARM))


def simulate_utilisation(c: int, r: float, seed: int = 0) -> float:
    """The largest rho with loss(c, rho, r) <= TARGET_LOSS, by bisection."""
    lo, hi = 0.0, RHO_MAX
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        if loss(c, mid, r, seed) <= TARGET_LOSS:
            lo = mid
        else:
            hi = mid
    return lo


def write_table(path: Path = TABLE) -> None:
    rows = []
    for c in POOL_SIZES:
        rows.append([round(simulate_utilisation(c, r), 4) for r in SLACKS])
        print(f"c={c}: {rows[-1]}", file=sys.stderr, flush=True)
    doc = {
        "what": "largest load per vGPU of an M/D/c queue with deadline r service times that "
        f"turns away at most {TARGET_LOSS:g} of a Poisson stream",
        "made_by": "python -m poolpipe.planner.headroom",
        "pool_sizes": list(POOL_SIZES),
        "slacks": list(SLACKS),
        "utilisation": rows,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


@cache
def _table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    doc = json.loads(TABLE.read_text())
    u = np.minimum(np.asarray(doc["utilisation"], dtype=float), 1.0)
    return np.log(doc["pool_sizes"]), np.log(doc["slacks"]), u


def utilisation(c: np.ndarray | float, r: np.ndarray | float) -> np.ndarray:
    """The table at pool sizes `c` (>= 1; above the table its last row) and slacks `r`
    (service times; clipped to the table's range), bilinear in log c and log r, capped at
    1. Arrays broadcast."""
    lc, lr, u = _table()
    x = np.clip(np.log(np.maximum(np.asarray(c, dtype=float), 1.0)), lc[0], lc[-1])
    rr = np.asarray(r, dtype=float)
    y = np.clip(np.log(np.maximum(np.where(np.isfinite(rr), rr, 1e9), 1e-12)), lr[0], lr[-1])
    i = np.clip(np.searchsorted(lc, x, side="right") - 1, 0, len(lc) - 2)
    j = np.clip(np.searchsorted(lr, y, side="right") - 1, 0, len(lr) - 2)
    fx = (x - lc[i]) / (lc[i + 1] - lc[i])
    fy = (y - lr[j]) / (lr[j + 1] - lr[j])
    top = u[i, j] * (1 - fy) + u[i, j + 1] * fy
    bottom = u[i + 1, j] * (1 - fy) + u[i + 1, j + 1] * fy
    return np.asarray(top * (1 - fx) + bottom * fx)


def pool_utilisation(c: float, r: float) -> float:
    """`utilisation` for one pool."""
    return float(utilisation(c, r)) if math.isfinite(c) else 1.0


if __name__ == "__main__":
    write_table()
