"""The group MILP over enumerated candidate pipelines: only vGPU counts are integer.

Variables
    z                      max-min normalised throughput (the objective)
    x[c] >= 0              throughput of candidate pipeline c
    n[c, d] in Z+          vGPUs of c's d-th partition
    G[k, v] in Z+          (per-share)    GPUs of type k carved into v shares
    C[m, d, k] in Z+       (per-position) GPUs of type k at position d of model m
Constraints
    (a) x[c] <= thr[c, d] * n[c, d]                    a pipeline runs at its slowest pool
    (b) w[m] * z <= sum_c x[c]                         max-min over models
        (cost objective: sum_c x[c] >= rate[m], minimise sum of price[k] x GPUs of k)
    (c) per-share:    sum n[c,d] over bucket (k,v) <= v * G[k, v];  sum_v G[k, v] <= N[k]
                      (a bucket per model, (k, v, m), where models may not share a GPU:
                      Cluster.mixed_model_interference unset, the default)
        per-position: sum n[c,d] / v over (m, d, k) <= C[m, d, k];  sum C[., ., k] <= N[k]
    Whole-GPU buckets (v = 1) use the n's directly instead of a G / C variable.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from poolpipe.domain.cluster import Cluster
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.solvers import Milp


@dataclass
class GroupMilp:
    milp: Milp
    z: int
    x: list[list[int]]  # [model][candidate] -> var
    n: list[list[list[int]]]  # [model][candidate][partition] -> var
    gpu_rows: dict[str, int]  # GPU type -> its row (c): physical GPUs used <= N[k]

    def gpu_terms(self, gpu: str) -> dict[int, float]:
        row = self.gpu_rows[gpu]
        s, e = self.milp.row_start[row], self.milp.row_start[row + 1]
        return dict(zip(self.milp.row_index[s:e], self.milp.row_value[s:e], strict=True))

    def minimise_gpus(self, gpu: str, z_min: float) -> int:
        """Turn the MILP into: fewest GPUs of `gpu` for an objective of at least z_min.

        The objective becomes the integer count of `gpu`'s physical GPUs (returned variable,
        still at most N[gpu]); z is fixed from below. Used by the decomposition proof.
        """
        milp = self.milp
        milp.cost[self.z] = 0.0
        milp.lower[self.z] = z_min
        row = self.gpu_rows[gpu]
        used = milp.add_var(upper=milp.row_upper[row], cost=-1.0, integer=True)
        milp.add_row({**self.gpu_terms(gpu), used: -1.0}, upper=0.0)
        milp.row_upper[row] = math.inf
        return used


def build_group_milp(
    candidates: list[list[CandidatePipeline]],
    weights: list[float],
    cluster: Cluster,
    packing: str,
    budgets: dict[str, int] | None = None,
) -> GroupMilp:
    """The group MILP; `budgets` caps the GPUs of some types below the cluster's counts."""
    milp = Milp()
    count = {p.gpu: min(p.count, (budgets or {}).get(p.gpu, p.count)) for p in cluster.pools}
    z = milp.add_var(cost=1.0)
    xs, ns, buckets = _add_pipelines(milp, candidates, count, packing, cluster.mixes_models)
    for m, xm in enumerate(xs):
        # (b) w z - sum x <= 0
        milp.add_row({z: weights[m], **{x: -1.0 for x in xm}}, upper=0.0)
    gpu_rows = {
        gpu: milp.add_row(terms, upper=float(count[gpu]))
        for gpu, terms in _add_packing(milp, buckets, count, packing).items()
    }
    return GroupMilp(milp=milp, z=z, x=xs, n=ns, gpu_rows=gpu_rows)


def build_cost_milp(
    candidates: list[list[CandidatePipeline]],
    rates: list[float],
    cluster: Cluster,
    packing: str,
    prices: dict[str, float],
) -> GroupMilp:
    """The cost MILP: the same pipelines and packing as the group MILP, each model's
    pipelines serving at least its rate, minimising the price of the physical GPUs used
    (maximising its negative, in price_units; `z` is unused and fixed at 0)."""
    milp = Milp()
    count = {p.gpu: p.count for p in cluster.pools}
    z = milp.add_var(upper=0.0)
    xs, ns, buckets = _add_pipelines(milp, candidates, count, packing, cluster.mixes_models)
    for m, xm in enumerate(xs):
        milp.add_row({x: 1.0 for x in xm}, lower=rates[m])
    units, _ = price_units(prices)
    gpu_rows = {}
    for gpu, terms in _add_packing(milp, buckets, count, packing).items():
        gpu_rows[gpu] = milp.add_row(terms, upper=float(count[gpu]))
        for var, coef in terms.items():  # each term counts physical GPUs of `gpu`
            milp.cost[var] = -units[gpu] * coef
    return GroupMilp(milp=milp, z=z, x=xs, n=ns, gpu_rows=gpu_rows)


def price_units(prices: dict[str, float]) -> tuple[dict[str, float], float]:
    """Prices as whole multiples of 10^-d (d <= 6, the fewest that make them whole), and
    10^d: an objective of whole numbers lets the solver round its bound up to the next
    attainable cost (found 2x faster on the slowest cost benchmark). Prices with more
    digits stay as they are (scale 1)."""
    for d in range(7):
        scale = 10.0**d
        if all(
            abs(p * scale - round(p * scale)) <= 1e-9 * max(1.0, p * scale) for p in prices.values()
        ):
            return {g: float(round(p * scale)) for g, p in prices.items()}, scale
    return dict(prices), 1.0


def bucket_key(gpu: str, share: int, model: int, position: int, packing: str, mixes: bool) -> tuple:
    """The GPU bucket of the packing rule a partition's vGPUs take from: per-share, the
    GPUs of a type carved into `share` (each model's own unless models may share a GPU);
    per-position, a model's GPUs of a type at a position."""
    if packing == "per-share":
        return (gpu, share) if mixes else (gpu, share, model)
    return (gpu, model, position)


def _add_pipelines(
    milp: Milp,
    candidates: list[list[CandidatePipeline]],
    count: dict[str, int],
    packing: str,
    mixes: bool = False,
    owners: list | None = None,
) -> tuple[list[list[int]], list[list[list[int]]], dict[tuple, dict[int, float]]]:
    """x and n variables and rows (a) of every candidate; the n's by GPU bucket (`mixes`:
    models may share a physical GPU; `owners`: per-share, the model each candidate list's
    GPUs are counted for, where several lists are one model's: segments of it)."""
    xs: list[list[int]] = []
    ns: list[list[list[int]]] = []
    # bucket -> {n var: coefficient}, per packing mode
    buckets: dict[tuple, dict[int, float]] = defaultdict(dict)
    for m, cands in enumerate(candidates):
        xm, nm = [], []
        for c in cands:
            cap = min(p.vgpu_throughput * p.share * count[p.gpu] for p in c.partitions)
            x = milp.add_var(upper=cap)
            n_vars = []
            for d, p in enumerate(c.partitions):
                n = milp.add_var(upper=p.share * count[p.gpu], integer=True)
                milp.add_row({x: 1.0, n: -p.vgpu_throughput}, upper=0.0)  # (a)
                owner = owners[m] if owners is not None and packing == "per-share" else m
                key = bucket_key(p.gpu, p.share, owner, d, packing, mixes)
                buckets[key][n] = 1.0 / p.share if packing == "per-position" else 1.0
                n_vars.append(n)
            xm.append(x)
            nm.append(n_vars)
        xs.append(xm)
        ns.append(nm)
    return xs, ns, buckets


def _add_packing(
    milp: Milp, buckets: dict[tuple, dict[int, float]], count: dict[str, int], packing: str
) -> dict[str, dict[int, float]]:
    """(c) GPU packing: per GPU type, the terms whose sum is its physical GPUs used."""
    per_type: dict[str, dict[int, float]] = defaultdict(dict)
    for key, terms in buckets.items():
        gpu = key[0]
        if packing == "per-share":
            share = key[1]
            if share == 1:
                per_type[gpu].update(terms)
                continue
            g = milp.add_var(upper=count[gpu], integer=True)
            milp.add_row({**terms, g: -float(share)}, upper=0.0)
            per_type[gpu][g] = 1.0
        else:
            if all(abs(coef - 1.0) < 1e-12 for coef in terms.values()):
                per_type[gpu].update(terms)
                continue
            # Scale by the lcm of the shares so the row has integer coefficients.
            lcm = math.lcm(*(round(1.0 / coef) for coef in terms.values()))
            g = milp.add_var(upper=count[gpu], integer=True)
            milp.add_row(
                {**{n: coef * lcm for n, coef in terms.items()}, g: -float(lcm)}, upper=0.0
            )
            per_type[gpu][g] = 1.0
    return per_type


Chosen = list[tuple[CandidatePipeline, list[int]]]  # one model's pipelines and vGPU counts


def served(cand: CandidatePipeline, counts: list[int]) -> float:
    """What a pipeline serves with these vGPU counts: its slowest pool."""
    return min(n * p.vgpu_throughput for n, p in zip(counts, cand.partitions, strict=True))


def chosen_objective(chosen: list[Chosen], weights: list[float]) -> float:
    """The max-min objective of pipelines with these vGPU counts."""
    return min(
        sum(served(c, counts) for c, counts in picked) / w
        for picked, w in zip(chosen, weights, strict=True)
    )


def chosen_fits(chosen: list[Chosen], cluster: Cluster, packing: str) -> bool:
    """Do these vGPU counts fit the cluster's GPUs under the packing rule (constraint (c))?"""
    return _overshoot(_buckets(chosen, packing, cluster.mixes_models), cluster) == 0


def _buckets(chosen: list[Chosen], packing: str, mixes: bool) -> dict[tuple, Fraction]:
    """The GPUs (fractional) the pipelines take from each GPU bucket of the packing rule."""
    buckets: dict[tuple, Fraction] = defaultdict(Fraction)
    for m, picked in enumerate(chosen):
        for c, counts in picked:
            for key, n in _bucket_terms(c, counts, m, packing, mixes):
                buckets[key] += n
    return buckets


def _bucket_terms(
    cand: CandidatePipeline, counts: list[int], m: int, packing: str, mixes: bool
) -> list[tuple[tuple, Fraction]]:
    """The GPUs a pipeline's partitions take from each GPU bucket of the packing rule."""
    return [
        (bucket_key(p.gpu, p.share, m, d, packing, mixes), Fraction(n, p.share))
        for d, (p, n) in enumerate(zip(cand.partitions, counts, strict=True))
    ]


def gpus_used(chosen: list[Chosen], packing: str, mixes: bool = False) -> dict[str, int]:
    """Whole GPUs of each type the pipelines take (each bucket of the packing rounded up;
    `mixes`: models may share a GPU)."""
    return _used(_buckets(chosen, packing, mixes))


def _used(buckets: dict[tuple, Fraction]) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for key, gpus in buckets.items():
        used[key[0]] += math.ceil(gpus)
    return used


def _overshoot(buckets: dict[tuple, Fraction], cluster: Cluster) -> int:
    """Whole GPUs the buckets (each rounded up) take beyond the cluster's, over all types."""
    used = _used(buckets)
    count = {p.gpu: p.count for p in cluster.pools}
    return sum(max(0, n - count.get(gpu, 0)) for gpu, n in used.items())


def fit_by_swaps(
    chosen: list[Chosen],
    candidates: list[list[CandidatePipeline]],
    cluster: Cluster,
    packing: str,
    rounds: int = 4,
) -> list[Chosen] | None:
    """Make vGPU counts that overshoot the cluster once buckets round up fit it, serving as
    much: repeatedly replace the one pipeline whose swap for another candidate of its model
    (with that candidate's fewest vGPUs for the same throughput) most reduces the overshoot.
    None when `rounds` such swaps do not make it fit.

    The knapsacks (knapsack.py) price fractional GPUs, so their solution may leave two
    partly used buckets where a slightly costlier share would have filled one.
    """
    plan = [list(picked) for picked in chosen]
    mixes = cluster.mixes_models
    buckets = _buckets(plan, packing, mixes)
    over = _overshoot(buckets, cluster)
    for _ in range(rounds):
        if over == 0:
            break
        best: tuple[int, int, int, CandidatePipeline, list[int]] | None = None
        for m, picked in enumerate(plan):
            for i, (c, counts) in enumerate(picked):
                x = served(c, counts)
                old = _bucket_terms(c, counts, m, packing, mixes)
                _shift(buckets, old, -1)
                for alt in candidates[m]:
                    if alt is c:
                        continue
                    need = [math.ceil(x / p.vgpu_throughput * (1 - 1e-12)) for p in alt.partitions]
                    new = _bucket_terms(alt, need, m, packing, mixes)
                    _shift(buckets, new, 1)
                    left = _overshoot(buckets, cluster)
                    _shift(buckets, new, -1)
                    if left < over and (best is None or left < best[0]):
                        best = (left, m, i, alt, need)
                _shift(buckets, old, 1)
        if best is None:
            return None
        over, m, i, alt, need = best
        c, counts = plan[m].pop(i)
        _shift(buckets, _bucket_terms(c, counts, m, packing, mixes), -1)
        _shift(buckets, _bucket_terms(alt, need, m, packing, mixes), 1)
        same = next((j for j, (c2, _) in enumerate(plan[m]) if c2 is alt), None)
        if same is None:
            plan[m].append((alt, need))
        else:  # merged with the pipeline already on it: serves at least the sum
            plan[m][same] = (alt, [a + b for a, b in zip(plan[m][same][1], need, strict=True)])
    return plan if over == 0 else None


def _shift(buckets: dict[tuple, Fraction], terms: list[tuple[tuple, Fraction]], sign: int) -> None:
    """Add (sign 1) or take away (sign -1) a pipeline's bucket terms."""
    for key, n in terms:
        buckets[key] += sign * n
