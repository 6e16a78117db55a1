"""Warm start: an earlier plan (the serving one) as the first plan of a re-plan.

After GPUs are lost the serving plan usually no longer fits. Its pipelines are found among
the new candidates (same blocks, GPU types and shares per partition; the batch may differ
since λ̂ changed), then vGPUs are taken away where the cluster is short, one at a time from
the pipeline whose model keeps the most normalised throughput afterwards, until the plan fits.
What is left is a feasible plan for the new cluster: the pruning's first incumbent and the
MILP's start. It only makes the search start higher; the proofs are unchanged.
"""

from __future__ import annotations

import math
from collections import defaultdict

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import Plan
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.formulation import Chosen, chosen_objective, gpus_used, served

# a vGPU count rounds up only when the throughput it must serve exceeds it by more than this
_ROUND = 1e-12


def warm_chosen(
    plan: Plan | None,
    names: list[str],
    candidates: list[list[CandidatePipeline]],
    weights: list[float],
    cluster: Cluster,
    packing: str,
) -> tuple[list[Chosen], float] | None:
    """`plan`'s pipelines as candidates with vGPU counts fitting `cluster`, and their max-min
    objective; None when the plan gives nothing to start from (no plan, a model it does not
    serve with any of today's candidates, or nothing left after fitting)."""
    if plan is None:
        return None
    served_by = {m.name: m for m in plan.models}
    chosen: list[Chosen] = []
    for name, cands in zip(names, candidates, strict=True):
        model = served_by.get(name)
        if model is None:
            return None
        picked = _match(model.pipelines, cands)
        if not picked:
            return None
        chosen.append(picked)
    fitted = _shrink_to_fit(chosen, weights, cluster, packing)
    if fitted is None:
        return None
    objective = chosen_objective(fitted, weights)
    return (fitted, objective) if objective > 0 else None


def _match(pipelines, cands: list[CandidatePipeline]) -> Chosen:
    """Each planned pipeline as the candidate with its blocks, types and shares that serves
    the most with its vGPU counts; counts of two pipelines on one candidate add up."""
    index: dict[tuple, list[CandidatePipeline]] = defaultdict(list)
    for c in cands:
        index[tuple((p.start, p.end, p.gpu, p.share) for p in c.partitions)].append(c)
    merged: dict[int, tuple[CandidatePipeline, list[int]]] = {}
    for pipe in pipelines:
        key = tuple((p.start, p.end, p.gpu, p.share) for p in pipe.partitions)
        counts = [p.vgpus for p in pipe.partitions]
        same = index.get(key)
        if not same:
            continue  # no longer within the SLO budget (or dominated by another shape)
        best = max(same, key=lambda c: served(c, counts))
        if id(best) in merged:
            counts = [a + b for a, b in zip(merged[id(best)][1], counts, strict=True)]
        merged[id(best)] = (best, counts)
    return [(c, _trimmed(c, counts)) for c, counts in merged.values()]


def _trimmed(cand: CandidatePipeline, counts: list[int]) -> list[int]:
    """The fewest vGPUs per partition that serve what the pipeline's slowest pool serves."""
    x = served(cand, counts)
    return [math.ceil(x / p.vgpu_throughput * (1 - _ROUND)) for p in cand.partitions]


def _short(chosen: list[Chosen], cluster: Cluster, packing: str) -> set[str]:
    """GPU types whose buckets, each rounded up to whole GPUs, take more than the cluster has."""
    used = gpus_used(chosen, packing, cluster.mixes_models)
    have = {p.gpu: p.count for p in cluster.pools}
    return {gpu for gpu, n in used.items() if n > have.get(gpu, 0)}


def _shrink_to_fit(
    chosen: list[Chosen], weights: list[float], cluster: Cluster, packing: str
) -> list[Chosen] | None:
    plan = [[(c, list(n)) for c, n in picked] for picked in chosen]
    while short := _short(plan, cluster, packing):
        best: tuple[float, int, int, int] | None = None  # (model's ratio after, m, i, d)
        for m, picked in enumerate(plan):
            total = sum(served(c, n) for c, n in picked)
            for i, (c, n) in enumerate(picked):
                for d, p in enumerate(c.partitions):
                    if p.gpu not in short or n[d] == 0:
                        continue
                    less = [*n[:d], n[d] - 1, *n[d + 1 :]]
                    after = (total - served(c, n) + served(c, less)) / weights[m]
                    if best is None or after > best[0]:
                        best = (after, m, i, d)
        if best is None:
            return None
        _, m, i, d = best
        c, n = plan[m][i]
        n[d] -= 1
        n = _trimmed(c, n)
        if min(n) == 0:
            plan[m].pop(i)
        else:
            plan[m][i] = (c, n)
    return plan
