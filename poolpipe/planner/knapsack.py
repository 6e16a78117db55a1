"""An exact upper bound from a knapsack over pipeline options, for incumbents the MILP
proves slowly.

With the LP duals of pruning.py (π_k per GPU type, μ_m per model, Σ_m μ_m w_m >= 1) every
plan satisfies

    z <= Σ_c μ_m x_c = Σ_k π_k Σ_c g_ck - Σ_c pen_c <= D - Σ_c pen_c,

where pipeline c of model m serves x_c with g_ck = Σ_{d on type k} n_d / v_d GPUs and
pen_c = π·g_c - μ_m x_c >= 0 (D = Σ_k π_k N_k). Only the breakpoints x = t_d·j matter, each
with its fewest vGPU counts n_d = ceil(x / t_d) (pruning.breakpoints): an *option*
(value μ_m x, GPUs g). A plan better than an incumbent z0 uses only options with
pen < D - z0, typically a thousand or so, and its value is at most the best total value of
distinct options whose GPUs fit the cluster, Σ g_k <= N_k. That is a 0/1 knapsack over a
grid of GPU fractions (1/lcm of the shares on each type), solved exactly by dynamic
programming. So no plan scores above max(z0, that best value).

The knapsack relaxes only the rounding of GPU buckets (Σ n / v per bucket rounds up) and
the use of one option per pipeline. The MILP's own LP bound is weak where it is, because
it treats vGPU counts as fractions, which the options do not: on the single-model P=3
ablation the knapsack proves in about a second what HiGHS's branch and bound takes 30 s
to close.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from poolpipe.cluster import Cluster
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.pruning import CandidateBounds, breakpoints

# Largest options x grid cells the dynamic programme may touch (about 1.5 ns each), and
# largest grid (8 bytes a cell).
MAX_WORK = 2e9
MAX_CELLS = 8_000_000
CHUNK = 256  # candidates priced at once (arrays are candidates x breakpoints x partitions)
# Relative slack in favour of keeping an option (float round-off in duals and penalties).
PEN_RTOL = 1e-7


@dataclass
class KnapsackBound:
    bound: float  # every plan scores at most max(incumbent, bound)
    options: int  # options priced into the knapsack
    cells: int  # size of its GPU grid
    seconds: float


def knapsack_bound(
    candidates: list[list[CandidatePipeline]],
    cb: CandidateBounds,
    cluster: Cluster,
    incumbent: float,
    max_work: float = MAX_WORK,
) -> KnapsackBound | None:
    """The bound above, or None when the knapsack would be too large to solve quickly.

    `cb` must hold duals that are feasible for every candidate in `candidates` (those of
    `candidate_bounds` over these candidates or a superset of them).
    """
    t0 = time.perf_counter()
    types = [p.gpu for p in cluster.pools]
    tix = {g: i for i, g in enumerate(types)}
    counts = np.array([p.count for p in cluster.pools], dtype=float)
    pis = cb.gpu_prices
    max_pen = cb.dual_bound - incumbent + PEN_RTOL * max(1.0, abs(cb.dual_bound))
    unit = np.ones(len(types), dtype=int)  # grid step per type: 1 / lcm of its shares
    for cands in candidates:
        for c in cands:
            for p in c.partitions:
                unit[tix[p.gpu]] = math.lcm(int(unit[tix[p.gpu]]), p.share)
    cap = (counts * unit).astype(int)
    cells = int(np.prod(cap + 1))
    if cells > MAX_CELLS:
        return None
    values: list[np.ndarray] = []
    gpus: list[np.ndarray] = []
    for m, cands in enumerate(candidates):
        mu = float(cb.model_prices[m])
        by_depth: dict[int, list[CandidatePipeline]] = {}
        for c in cands:
            by_depth.setdefault(len(c.partitions), []).append(c)
        for group in by_depth.values():
            for s in range(0, len(group), CHUNK):
                x, g = _options(group[s : s + CHUNK], tix, counts, pis, mu, max_pen)
                values.append(mu * x)
                gpus.append(g)
                if sum(len(v) for v in values) * cells > max_work:
                    return None
    value = np.concatenate(values) if values else np.empty(0)
    cost = np.rint(np.concatenate(gpus) * unit).astype(int) if gpus else np.empty((0, len(types)))
    best = np.zeros(tuple(cap + 1))  # best[u]: most value with GPUs <= u (grid units)
    for val, need in zip(value, cost, strict=True):
        if (need > cap).any():
            continue
        hi = tuple(slice(int(a), None) for a in need)
        lo = tuple(slice(0, int(c - a + 1)) for c, a in zip(cap, need, strict=True))
        # The right side is evaluated before writing: each option is used at most once.
        np.maximum(best[hi], best[lo] + val, out=best[hi])
    bound = float(best[tuple(cap)])
    return KnapsackBound(bound, len(value), cells, time.perf_counter() - t0)


def _options(
    group: list[CandidatePipeline],
    tix: dict[str, int],
    counts: np.ndarray,
    pis: np.ndarray,
    mu: float,
    max_pen: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Throughput x and GPUs per type g of the options with pen <= max_pen (equal depths)."""
    t = np.array([[p.vgpu_throughput for p in c.partitions] for c in group])
    v = np.array([[p.share for p in c.partitions] for c in group], dtype=float)
    k = np.array([[tix[p.gpu] for p in c.partitions] for c in group])
    x, valid, n = breakpoints(t, (t * v * counts[k]).min(axis=1))
    onehot = np.eye(len(counts))[k]  # [C, D, K]
    g = np.einsum("cjd,cdk->cjk", n / v[:, None, :], onehot)  # [C, D·J, K]
    ok = valid & (g @ pis - mu * x <= max_pen)
    return x[ok], g[ok]
