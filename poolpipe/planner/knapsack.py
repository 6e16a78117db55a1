"""An exact upper bound from knapsacks over pipeline options, for incumbents the MILP
proves slowly.

With the LP duals of pruning.py (π_k per GPU type, μ_m per model, Σ_m μ_m w_m >= 1) every
plan with objective z >= 0 satisfies

    z <= Σ_m μ_m X_m = Σ_k π_k Σ_c g_ck - Σ_c pen_c <= D - Σ_c pen_c,

where X_m is what model m serves, pipeline c of model m serves x_c with
g_ck = Σ_{d on type k} n_d / v_d GPUs, pen_c = π·g_c - μ_m x_c >= 0 and D = Σ_k π_k N_k.
Only the breakpoints x = t_d·j matter, each with its fewest vGPU counts n_d = ceil(x / t_d)
(pruning.breakpoints): an *option* (throughput x, GPUs g). A plan better than an incumbent
z0 uses only options with pen < D - z0: typically a thousand or so in all.

Per model m, a 0/1 knapsack over a grid of GPU fractions (1/lcm of the shares on each type)
gives F_m(u), the most model m serves with distinct options using at most u GPUs. A plan
at z needs, for every model, some u_m with F_m(u_m) >= w_m·z and Σ_m u_m <= N: with one
model that is F(N) >= w·z; with several, per model the fewest GPUs of the second type for
each count of the first, combined over models by a min-plus convolution. The largest z
that passes (bisected) bounds every plan above z0.

The knapsacks relax only the rounding of GPU buckets (Σ n / v per bucket rounds up) and the
use of one option per pipeline. The MILP's own LP bound is weak where the knapsacks are
not, because it treats vGPU counts as fractions: on the single-model P=3 ablation the bound
proves in about a second what HiGHS's branch and bound takes 30 s to close.

On three or more GPU types a grid per type would be too large (four types at 1/12 GPU:
301³ × 26 cells per model), so the grid keeps two dimensions. Types the LP leaves unpriced
(π_k = 0) are dropped: a relaxation. Of the priced ones, the one with the most dual value
π_k N_k stays exact; the others are folded into one *surrogate* capacity, their GPUs
weighted by their duals: any plan has Σ_k π_k g_k <= Σ_k π_k N_k over them, so on a grid of
SURROGATE_CELLS steps an option costs the floor of its weighted GPUs (a sum of floors is
at most the floor of the sum) and the capacity is the floor of the total. Still an upper
bound on every plan; it proves the clusters whose other types are not saturated, and stops
short where every type is (the plan may trade one folded type for another).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from poolpipe.domain.cluster import Cluster
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.formulation import Chosen
from poolpipe.planner.pruning import CHUNK, CandidateBounds, breakpoints, depth_groups

# Largest options x grid cells the dynamic programmes may touch (about 1.5 ns each),
# largest grid (8 bytes a cell, one grid per model), and most bits kept to read the
# knapsacks' solutions back (one per option and cell).
MAX_WORK = 2e9
MAX_CELLS = 2_000_000
MAX_TRACE_BITS = 5e8  # 62 MB
# Relative slack in favour of keeping an option (float round-off in duals and penalties).
PEN_RTOL = 1e-7
BISECT_RTOL = 1e-7  # precision of the multi-model bound
# Steps of the surrogate capacity (three or more GPU types); 6,000 gave the same bounds on
# the benchmark's four-type clusters.
SURROGATE_CELLS = 1500
FLOOR_TOL = 1e-9  # round-off kept in favour of the relaxation when flooring grid costs


@dataclass
class KnapsackBound:
    bound: float  # every plan scores at most max(incumbent, bound)
    options: int  # options priced into the knapsacks
    cells: int  # size of each GPU grid
    seconds: float
    # The knapsacks' own solution at the bound, per model (options of one pipeline merged):
    # a plan whenever its GPU buckets round up within the cluster (check before use).
    chosen: list[Chosen] | None = None


def knapsack_bound(
    candidates: list[list[CandidatePipeline]],
    weights: list[float],
    cb: CandidateBounds,
    cluster: Cluster,
    incumbent: float,
    max_work: float = MAX_WORK,
) -> KnapsackBound | None:
    """The bound above, or None when the knapsacks would be too large to solve quickly.

    `cb` must hold duals that are feasible for every candidate in `candidates` (those of
    `candidate_bounds` over these candidates or a superset of them).
    """
    t0 = time.perf_counter()
    prepared = _prepare(candidates, cb, cluster, incumbent, max_work)
    if prepared is None:
        return None
    options, cap, cells = prepared
    n_options = sum(len(o[0]) for o in options)
    trace = n_options * cells <= MAX_TRACE_BITS
    solved = [_knapsack(x, need, cap, trace) for x, need, _ in options]
    tables = [best for best, _ in solved]
    if len(tables) == 1:
        # (no higher than the LP's bound, which holds too: a surrogate capacity's grid,
        # floored in favour of the relaxation, can reach a hair above it)
        bound = min(float(tables[0][tuple(cap)]) / weights[0], cb.dual_bound)
        cells_used: list[tuple[int, ...]] | None = [tuple(cap)]
    else:
        bound, reached = _bisect(tables, weights, cap, incumbent, cb.dual_bound)
        cells_used = _split(tables, weights, cap, reached)
    chosen = None
    if trace and cells_used is not None:
        chosen = [
            _read_back(taken, need, picks, tuple(cap + 1), cell)
            for (_, taken), (_, need, picks), cell in zip(solved, options, cells_used, strict=True)
        ]
    return KnapsackBound(bound, n_options, cells, time.perf_counter() - t0, chosen)


def _model_options(
    cands: list[CandidatePipeline],
    tix: dict[str, int],
    counts: np.ndarray,
    pis: np.ndarray,
    mu: float,
    max_pen: float,
) -> tuple[np.ndarray, np.ndarray, list[tuple[CandidatePipeline, list[int]]]]:
    """One model's options with pen <= max_pen: throughput x [O], GPUs per type g [O, K],
    and each one's pipeline and vGPU counts."""
    xs, gs = [np.empty(0)], [np.empty((0, len(counts)))]
    picks: list[tuple[CandidatePipeline, list[int]]] = []
    for idx, t_all, v_all, k_all, x_max in depth_groups(cands, tix, counts):
        for s in range(0, len(idx), CHUNK):
            sl = slice(s, s + CHUNK)
            t, v, k = t_all[sl], v_all[sl], k_all[sl]
            x, valid, n = breakpoints(t, x_max[sl])
            onehot = np.eye(len(counts))[k]  # [C, D, K]
            g = np.einsum("cjd,cdk->cjk", n / v[:, None, :], onehot)  # [C, D·J, K]
            ok = valid & (g @ pis - mu * x <= max_pen)
            xs.append(x[ok])
            gs.append(g[ok])
            rows, cols = np.nonzero(ok)
            picks.extend(
                (cands[idx[s + r]], [int(q) for q in n[r, j]])
                for r, j in zip(rows, cols, strict=True)
            )
    return np.concatenate(xs), np.concatenate(gs), picks


def _knapsack(
    value: np.ndarray, cost: np.ndarray, cap: np.ndarray, trace: bool
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """best[u]: the most total value of distinct options whose costs sum to <= u; with
    `trace`, per option the (packed) cells where taking it improved best, to read back."""
    best = np.zeros(tuple(cap + 1))
    taken: list[np.ndarray | None] = []
    for val, need in zip(value, cost, strict=True):
        if (need > cap).any():
            taken.append(None)
            continue
        hi = tuple(slice(int(a), None) for a in need)
        lo = tuple(slice(0, int(c - a + 1)) for c, a in zip(cap, need, strict=True))
        gain = best[lo] + val  # evaluated before writing: each option is used at most once
        if trace:
            better = np.zeros(best.shape, dtype=bool)
            better[hi] = gain > best[hi]
            taken.append(np.packbits(better, axis=None))
        np.maximum(best[hi], gain, out=best[hi])
    return best, taken


def _read_back(
    taken: list[np.ndarray | None],
    cost: np.ndarray,
    picks: list[tuple[CandidatePipeline, list[int]]],
    shape: tuple[int, ...],
    cell: tuple[int, ...],
) -> Chosen:
    """The options behind best[cell], one entry per pipeline (an option's counts added)."""
    used: dict[int, tuple[CandidatePipeline, list[int]]] = {}
    u = np.array(cell)
    for i in range(len(taken) - 1, -1, -1):
        bits = taken[i]
        if bits is None:
            continue
        flat = int(np.ravel_multi_index(tuple(int(a) for a in u), shape))
        if (bits[flat >> 3] >> (7 - (flat & 7))) & 1:
            cand, counts = picks[i]
            prev = used.get(id(cand), (cand, [0] * len(counts)))[1]
            used[id(cand)] = (cand, [a + b for a, b in zip(prev, counts, strict=True)])
            u = u - cost[i]
    return list(used.values())


def _bisect(
    tables: list[np.ndarray], weights: list[float], cap: np.ndarray, lo: float, hi: float
) -> tuple[float, float]:
    """(smallest z found unreachable, largest found reachable): no plan scores above the
    first; the knapsacks reach the second (lo, the incumbent, is assumed reachable)."""
    if _reachable(tables, weights, cap, hi):
        return hi, hi
    while hi - lo > BISECT_RTOL * max(abs(hi), 1.0):
        mid = (lo + hi) / 2
        if _reachable(tables, weights, cap, mid):
            lo = mid
        else:
            hi = mid
    return hi, lo


def _reachable(tables: list[np.ndarray], weights: list[float], cap: np.ndarray, z: float) -> bool:
    """Can every model m get u_m with F_m(u_m) >= w_m·z and Σ u_m <= cap?"""
    total, _, _ = _combine(tables, weights, z)
    return bool(total.min() <= _second(cap))


def _split(
    tables: list[np.ndarray], weights: list[float], cap: np.ndarray, z: float
) -> list[tuple[int, ...]] | None:
    """Per model, the grid cell it gets in a split that reaches z (None: none does)."""
    total, fewests, picks = _combine(tables, weights, z)
    within = np.flatnonzero(total <= _second(cap))
    if not len(within):
        return None
    first = int(within[0])
    firsts = []
    for pick in reversed(picks):  # models 1.. in reverse; model 0 takes what is left
        firsts.append(int(pick[first]))
        first -= firsts[-1]
    firsts = [first, *reversed(firsts)]
    return [(a, int(f[a])) if len(cap) > 1 else (a,) for a, f in zip(firsts, fewests, strict=True)]


def _combine(
    tables: list[np.ndarray], weights: list[float], z: float
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Min-plus convolution of the models' needs at objective z.

    Returns total[a], the fewest second-type units with which all models reach z using a
    first-type units; per model, its fewest second-type units per first-type units; and per
    model after the first, the first-type units it takes at each total a (to read back).
    """
    total: np.ndarray | None = None
    fewests, picks = [], []
    for table, w in zip(tables, weights, strict=True):
        ok = (table >= w * z).reshape(table.shape[0], -1)  # [first type, second type]
        fewest = np.where(ok.any(axis=1), ok.argmax(axis=1), np.inf)
        fewests.append(fewest)
        if total is None:
            total = fewest
            continue
        combined = np.full_like(total, np.inf)
        pick = np.zeros(len(total), dtype=int)
        for a in np.flatnonzero(np.isfinite(fewest)):
            cand = total[: len(total) - a] + fewest[a]
            better = cand < combined[a:]
            combined[a:][better] = cand[better]
            pick[a:][better] = a
        total = combined
        picks.append(pick)
    assert total is not None
    return total, fewests, picks


def _second(cap: np.ndarray) -> int:
    """Grid units of the second GPU type (0 on a one-type cluster)."""
    return int(cap[1]) if len(cap) > 1 else 0


def knapsack_reaches(
    candidates: list[list[CandidatePipeline]],
    weights: list[float],
    cb: CandidateBounds,
    cluster: Cluster,
    z: float,
    max_work: float = MAX_WORK,
) -> bool | None:
    """Can the knapsacks reach objective z? False proves that no plan scores z or more
    (a plan that does uses only options with pen <= D - z, and relaxes to the knapsacks);
    None when they would be too large to solve quickly."""
    prepared = _prepare(candidates, cb, cluster, z, max_work)
    if prepared is None:
        return None
    options, cap, _ = prepared
    tables = [_knapsack(x, need, cap, False)[0] for x, need, _ in options]
    return _reachable(tables, weights, cap, z)


def _prepare(
    candidates: list[list[CandidatePipeline]],
    cb: CandidateBounds,
    cluster: Cluster,
    incumbent: float,
    max_work: float,
) -> tuple[list, np.ndarray, int] | None:
    """Every model's options with pen below D - incumbent, in grid units (x, cost per grid
    dimension, picks), the grid's capacity per dimension and its cells; None if too large
    (see knapsack_bound). One dimension per GPU type on one or two types; otherwise the
    surrogate grid of the module docstring."""
    tix = {p.gpu: i for i, p in enumerate(cluster.pools)}
    counts = np.array([p.count for p in cluster.pools], dtype=float)
    unit = np.ones(len(counts), dtype=int)  # grid step per type: 1 / lcm of its shares
    for cands in candidates:
        for c in cands:
            for p in c.partitions:
                unit[tix[p.gpu]] = math.lcm(int(unit[tix[p.gpu]]), p.share)
    type_cap = (counts * unit).astype(int)
    grid = _grid(cb.gpu_prices, counts, unit, type_cap)
    cap = grid.cap
    cells = int(np.prod(cap + 1))
    if cells > MAX_CELLS:
        return None
    max_pen = cb.dual_bound - incumbent + PEN_RTOL * max(1.0, abs(cb.dual_bound))
    options = []
    for m, cands in enumerate(candidates):
        mu = float(cb.model_prices[m])
        x, g, picks = _model_options(cands, tix, counts, cb.gpu_prices, mu, max_pen)
        options.append((x, grid.costs(np.rint(g * unit).astype(int)), picks))
        if sum(len(o[0]) for o in options) * cells > max_work:
            return None
    return options, cap, cells


@dataclass
class _Grid:
    """The knapsacks' grid: exact GPU types (grid units), then at most one surrogate."""

    exact: list[int]  # type indices kept as their own dimension
    cap: np.ndarray  # capacity per dimension
    folded: list[int]  # type indices folded into the surrogate dimension (may be empty)
    weights: np.ndarray | None = None  # surrogate weight per grid unit of each folded type
    step: float = 1.0  # weighted GPUs per surrogate cell

    def costs(self, units: np.ndarray) -> np.ndarray:
        """Options' costs per dimension from their grid units per type [O, K]."""
        cols = [units[:, k] for k in self.exact]
        if self.folded:
            assert self.weights is not None
            weighted = units[:, self.folded] @ self.weights / self.step
            cols.append(np.maximum(np.floor(weighted - FLOOR_TOL), 0).astype(int))
        return np.stack(cols, axis=1)


def _grid(pis: np.ndarray, counts: np.ndarray, unit: np.ndarray, type_cap: np.ndarray) -> _Grid:
    """Exact on one or two types; otherwise see the module docstring."""
    k_all = list(range(len(counts)))
    if len(k_all) <= 2:
        return _Grid(k_all, type_cap, [])
    priced = sorted((k for k in k_all if pis[k] > 0), key=lambda k: -pis[k] * counts[k])
    if len(priced) <= 2:  # the unpriced types relax
        exact = sorted(priced) or [0]
        return _Grid(exact, type_cap[exact], [])
    first, folded = priced[0], sorted(priced[1:])
    weights = pis[folded] / unit[folded]  # dual value of one grid unit
    total = float(weights @ type_cap[folded])
    step = total / SURROGATE_CELLS
    cap = np.array([type_cap[first], math.floor(total / step + FLOOR_TOL)])
    return _Grid([first], cap, folded, weights, step)
