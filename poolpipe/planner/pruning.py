"""Exact LP-bound elimination of candidate pipelines before the MILP.

Aggregate the MILP's LP relaxation to one row per GPU type and one per model: a pipeline c
of model m uses a[c, k] = Σ_{d on type k} 1 / (v_d · t_d) GPUs of type k per req/s. Take a
feasible solution (π >= 0 per type, μ >= 0 per model, Σ μ_m w_m >= 1, Σ_k π_k a[c,k] >= μ_m)
of its dual. For every *integer* plan, with x_c = min_d t_d n_d served by vGPU counts n_c:

    z <= Σ_m μ_m w_m z <= Σ_c μ_m x_c
      =  Σ_k π_k Σ_c n-GPUs(c, k) - Σ_c penalty_c
      <= Σ_k π_k N_k - Σ_c penalty_c,
    penalty_c(n) = Σ_d π_{k_d} n_d / v_d - μ_m min_d t_d n_d  >= 0.

So a plan that uses c at all scores at most D - min_{n >= 1} penalty_c(n), D = Σ π_k N_k.
Candidates whose bound is below a plan already found can never be part of a better plan and
are dropped; the MILP over the rest is then exact for the whole set. The minimum over n is
attained at n_d = ceil(x / t_d) for x at a breakpoint t_d · j, which are enumerated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from poolpipe.domain.cluster import Cluster
from poolpipe.errors import SolverError
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.solvers import Milp, solve

# Work in chunks so the breakpoint arrays stay small (candidates x breakpoints x partitions).
CHUNK = 256
# Relative slack in favour of keeping a candidate (float round-off in duals and penalties).
KEEP_RTOL = 1e-7


@dataclass
class CandidateBounds:
    dual_bound: float  # D: upper bound on the objective of any plan (the LP optimum)
    bounds: list[np.ndarray]  # per model, per candidate: best objective of a plan using it
    seconds: float
    gpu_prices: np.ndarray  # π per GPU type, in the cluster's pool order
    model_prices: np.ndarray  # μ per model


def candidate_bounds(
    candidates: list[list[CandidatePipeline]], weights: list[float], cluster: Cluster
) -> CandidateBounds:
    t0 = time.perf_counter()
    types = [p.gpu for p in cluster.pools]
    tix = {g: i for i, g in enumerate(types)}
    counts = np.array([p.count for p in cluster.pools], dtype=float)
    K, M = len(types), len(candidates)
    # Dual LP: minimise Σ π_k N_k (our Milp maximises, so negate).
    milp = Milp()
    pi = [milp.add_var(cost=-counts[k]) for k in range(K)]
    mu = [milp.add_var() for _ in range(M)]
    milp.add_row({mu[m]: weights[m] for m in range(M)}, lower=1.0)
    for m, cands in enumerate(candidates):
        for c in cands:
            row: dict[int, float] = {mu[m]: -1.0}
            for p in c.partitions:
                row[pi[tix[p.gpu]]] = row.get(pi[tix[p.gpu]], 0.0) + 1.0 / (
                    p.share * p.vgpu_throughput
                )
            milp.add_row(row, lower=0.0)
    res = solve(milp, "highs", time_limit_s=60.0)
    if res.values is None or res.status != "optimal":
        raise SolverError(f"LP bound for candidate pruning failed ({res.status})")
    pis = np.maximum(res.values[:K], 0.0)
    mus = np.maximum(res.values[K:], 0.0)
    dual = float(pis @ counts)
    bounds = []
    for m, cands in enumerate(candidates):
        out = np.empty(len(cands))
        for idx, t, v, k, x_max in depth_groups(cands, tix, counts):
            coef = pis[k] / v  # [C, D]
            for s in range(0, len(idx), CHUNK):
                sl = slice(s, s + CHUNK)
                out[np.array(idx[sl])] = dual - _min_penalty(t[sl], coef[sl], x_max[sl], mus[m])
        bounds.append(out)
    return CandidateBounds(
        dual_bound=dual,
        bounds=bounds,
        seconds=time.perf_counter() - t0,
        gpu_prices=pis,
        model_prices=mus,
    )


def depth_groups(
    cands: list[CandidatePipeline], tix: dict[str, int], counts: np.ndarray
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The candidates by number of partitions, as arrays: their indices, and per partition
    vGPU throughput t, share v and GPU type index k [C, D]; x_max [C], the most the
    cluster's GPU counts let each serve."""
    by_depth: dict[int, list[int]] = {}
    for i, c in enumerate(cands):
        by_depth.setdefault(len(c.partitions), []).append(i)
    for idx in by_depth.values():
        t = np.array([[p.vgpu_throughput for p in cands[i].partitions] for i in idx])
        v = np.array([[p.share for p in cands[i].partitions] for i in idx], dtype=float)
        k = np.array([[tix[p.gpu] for p in cands[i].partitions] for i in idx])
        yield idx, t, v, k, (t * v * counts[k]).min(axis=1)


def breakpoints(t: np.ndarray, x_max: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The throughputs worth serving with a pipeline of vGPU throughputs t [C, D], per row.

    Any vGPU counts n serve x = min_d t_d·n_d, a breakpoint t_d·j, and need at least
    n_d = ceil(x / t_d) in each partition. Returns x [C, D·J], valid [C, D·J] (x <= x_max,
    the most the cluster's counts allow, or the first breakpoint of a partition) and those
    fewest counts n [C, D·J, D].
    """
    C, D = t.shape
    jmax = int(np.ceil((x_max[:, None] / t).max())) if C else 0
    jmax = max(1, min(jmax, 10_000))
    j = np.arange(1, jmax + 1, dtype=float)
    x = (t[:, :, None] * j[None, None, :]).reshape(C, D * jmax)
    valid = x <= x_max[:, None] * (1 + 1e-12)
    valid[:, ::jmax] = True  # x = t_d (one vGPU on the bottleneck) is always possible
    n = np.ceil(x[:, :, None] / t[:, None, :] - 1e-9)
    return x, valid, n


def _min_penalty(t: np.ndarray, coef: np.ndarray, x_max: np.ndarray, mu: float) -> np.ndarray:
    """min over breakpoints x = t_d·j <= x_max of Σ_d coef_d ceil(x/t_d) - mu·x, per row."""
    x, valid, n = breakpoints(t, x_max)
    pen = (coef[:, None, :] * n).sum(axis=2) - mu * x
    pen = np.where(valid, pen, math.inf)
    return np.maximum(pen.min(axis=1), 0.0)


def keep_mask(bounds: np.ndarray, incumbent: float) -> np.ndarray:
    """Candidates that could still appear in a plan at least as good as `incumbent`."""
    return bounds >= incumbent - KEEP_RTOL * max(1.0, abs(incumbent))
