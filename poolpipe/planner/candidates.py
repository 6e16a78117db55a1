"""Enumerate every SLO-feasible pooled pipeline of a model, then drop the dominated ones.

A pipeline is (batch b, partitions (kv, [i, j)) covering all blocks). Its *signature* is the
ordered list of (GPU type, share) buckets of its partitions. Two pipelines with the same
signature consume the same resources per vGPU, so if one offers at least the other's vGPU
throughput in every partition, the other can never be needed: any solution using it stays
feasible, and is no worse, with the first one in its place (same vGPU counts). Pruning those
is exact in both packing modes. In `per-share` packing, a pipeline with two adjacent
partitions in the same bucket is also dominated, by the pipeline that merges them: with the
same n1 + n2 vGPUs it serves at least min(n1·t1, n2·t2), because 1/t_merged <= 1/t1 + 1/t2
(compute adds up, NIC limits only apply at the outer ends), and it is faster end to end.

In `per-position` packing the resource a partition uses is GPUs of its type at its position,
Σ n / v, whatever its share v. So pipeline c' also dominates c when their partitions have the
same GPU types position by position and, at every position, v' is a multiple of v and one
GPU of c' serves at least as much as one GPU of c (v'·t' >= v·t): c's n vGPUs become
n·v'/v vGPUs of c' on the same GPUs, serving at least as much (`drop_share_dominated`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from poolpipe.domain.costs import US_PER_S, ModelCosts
from poolpipe.planner.headroom import utilisation

# Relative tolerance under which two vGPU throughputs count as equal for dominance.
DOMINANCE_RTOL = 1e-12
# The least share of a vGPU's throughput headroom planning plans for (a pool whose slack
# the table puts below it is still worth a little).
MIN_HEADROOM = 0.01
# Rows per block of the cross-share dominance test (its arrays are rows x group size x D).
_DOM_CHUNK = 512


@dataclass(frozen=True)
class CandidatePartition:
    kv: int  # index into ModelCosts.kvs
    gpu: str
    share: int
    start: int  # blocks [start, end)
    end: int
    latency_us: float  # compute latency at the pipeline's batch
    transfer_us: float  # time to send the batch's output feature map (0 for the last)
    vgpu_throughput: float  # samples/s one vGPU is planned for, NIC limits included
    # the share of its fluid throughput that vGPU throughput is (headroom planning,
    # headroom.py: < 1 where the pool needs room for queueing; 1: fluid)
    headroom: float = 1.0

    @property
    def fluid_throughput(self) -> float:
        """Samples/s one vGPU sustains at 100% busy, NIC limits included."""
        return self.vgpu_throughput / self.headroom


@dataclass(frozen=True)
class CandidatePipeline:
    batch: int
    partitions: tuple[CandidatePartition, ...]
    latency_us: float  # planned end-to-end latency incl. transfers and batch wait

    @property
    def signature(self) -> tuple[int, ...]:
        return tuple(p.kv for p in self.partitions)


@dataclass
class Enumeration:
    pipelines: list[CandidatePipeline]
    considered: int  # (cuts, signature, batch) combinations priced
    feasible: int  # of those, meeting the SLO budget
    best_latency_us: float  # smallest planned end-to-end latency of any combination


def _pareto_keep(points: np.ndarray, order_key: np.ndarray) -> np.ndarray:
    """Indices of non-dominated rows (maximising every column); ties keep lowest order_key."""
    order = np.argsort(order_key, kind="stable")
    pts = points[order]
    n = len(pts)
    if n <= 1:
        return order
    tol = DOMINANCE_RTOL * np.maximum(np.abs(pts[:, None, :]), np.abs(pts[None, :, :]))
    ge = (pts[None, :, :] >= pts[:, None, :] - tol).all(-1)  # ge[i, j]: j >= i everywhere
    eq = ge & ge.T
    gt = ge & ~eq  # j dominates i strictly somewhere
    earlier_dup = np.tril(eq, k=-1).any(axis=1)  # an equal row came earlier in order
    keep = ~gt.any(axis=1) & ~earlier_dup
    return order[keep]


def enumerate_pipelines(
    costs: ModelCosts, max_partitions: int, merge_same_bucket: bool
) -> Enumeration:
    """All non-dominated SLO-feasible pipelines with 1..max_partitions partitions."""
    B = costs.num_blocks
    K = len(costs.kvs)
    budget = costs.budget_us()
    out: list[CandidatePipeline] = []
    considered = feasible_count = 0
    best_latency = math.inf
    if K == 0:
        return Enumeration([], 0, 0, math.inf)
    batches = np.arange(1, costs.max_batch + 1)
    for D in range(1, min(max_partitions, B) + 1):
        combos = list(itertools.combinations(range(1, B), D - 1))
        C = len(combos)
        cuts = np.array(combos, dtype=int).reshape(C, D - 1)
        bounds = np.concatenate(
            [np.zeros((C, 1), dtype=int), cuts, np.full((C, 1), B, dtype=int)], axis=1
        )
        starts, ends = bounds[:, :-1], bounds[:, 1:]  # [C, D]
        # Per-segment latency and vGPU throughput for every kv and batch: [nb, K, C, D].
        pre = costs.lat_prefix  # [K, nbmax, B+1]
        lat_seg = np.stack(
            [pre[:, b - 1, :][:, ends] - pre[:, b - 1, :][:, starts] for b in batches]
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            compute_thr = batches[:, None, None, None] * US_PER_S / lat_seg
        nic = np.minimum(costs.down[:, starts], costs.up[:, ends])[None]  # [1, K, C, D]
        thr_seg = np.minimum(compute_thr, nic)
        # Transfers: sender of boundary ends[d]-1 for every internal cut, times batch.
        tau_sum = costs.tau_us[cuts - 1].sum(axis=1) if D > 1 else np.zeros(C)  # [C]
        fixed = (
            batches[:, None] * (tau_sum[None, :] + costs.tau_in_us)
            + np.array([costs.batch_wait_us(int(b)) for b in batches])[:, None]
        )  # [nb, C]
        for sig in itertools.product(range(K), repeat=D):
            if merge_same_bucket and any(sig[d] == sig[d + 1] for d in range(D - 1)):
                continue
            lat_parts = np.stack([lat_seg[:, k, :, d] for d, k in enumerate(sig)], axis=-1)
            thr_parts = np.stack([thr_seg[:, k, :, d] for d, k in enumerate(sig)], axis=-1)
            e2e = lat_parts.sum(axis=-1) + fixed  # [nb, C]; NaN where a batch is missing
            room = _headroom(costs, batches, thr_parts, e2e)  # [nb, C, D]
            thr_parts = thr_parts * room
            valid = np.isfinite(e2e)
            considered += int(valid.sum())
            if valid.any():
                best_latency = min(best_latency, float(e2e[valid].min()))
            ok = valid & (e2e <= budget) & (thr_parts > 0).all(axis=-1)
            # every partition's vGPU fits its share of the GPU's memory at the batch
            fit = np.stack([costs.fits_memory[k, batches - 1] for k in sig], axis=-1).all(-1)
            ok &= fit[:, None]
            if not ok.any():
                continue
            bi, ci = np.nonzero(ok)
            feasible_count += len(bi)
            keep = _pareto_keep(thr_parts[bi, ci], e2e[bi, ci])
            for idx in keep:
                b_idx, c_idx = int(bi[idx]), int(ci[idx])
                out.append(
                    _make_pipeline(
                        costs,
                        sig,
                        int(batches[b_idx]),
                        bounds[c_idx],
                        lat_parts[b_idx, c_idx],
                        thr_parts[b_idx, c_idx],
                        float(e2e[b_idx, c_idx]),
                        room[b_idx, c_idx],
                    )
                )
    return Enumeration(out, considered, feasible_count, best_latency)


def _headroom(
    costs: ModelCosts, batches: np.ndarray, thr: np.ndarray, e2e: np.ndarray
) -> np.ndarray:
    """Per partition [nb, C, D], the share of its vGPU throughput planned for: 1 (fluid),
    or with `costs.headroom_rate` (req/s) the utilisation a pool sized for that rate keeps
    with 99% of requests within the slack the SLO leaves the pipeline (headroom.py: the
    pool's vGPUs at the rate, its batch time at its throughput, slack SLO - latency)."""
    if costs.headroom_rate is None:
        return np.ones_like(thr)
    with np.errstate(divide="ignore", invalid="ignore"):
        service_us = batches[:, None, None] * US_PER_S / thr
        slack = (costs.slo_us - e2e)[..., None] / service_us
        pool = np.maximum(1.0, costs.headroom_rate / thr)
    room = utilisation(np.where(np.isfinite(pool), pool, 1.0), np.nan_to_num(slack, nan=0.0))
    return np.where(thr > 0, np.maximum(room, MIN_HEADROOM), 1.0)


def drop_share_dominated(pipelines: list[CandidatePipeline]) -> list[CandidatePipeline]:
    """Per-position packing: drop pipelines another one dominates across shares (above).

    Ties (same shares, same per-GPU throughput) keep the lower-latency pipeline.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, c in enumerate(pipelines):
        groups.setdefault(tuple(p.gpu for p in c.partitions), []).append(i)
    keep = np.zeros(len(pipelines), dtype=bool)
    for idx in groups.values():
        order = sorted(idx, key=lambda i: (pipelines[i].latency_us, i))
        parts = [pipelines[i].partitions for i in order]
        v = np.array([[p.share for p in ps] for ps in parts])
        g = np.array([[p.share * p.vgpu_throughput for p in ps] for ps in parts])  # per GPU
        n = len(order)
        for s in range(0, n, _DOM_CHUNK):
            a = slice(s, s + _DOM_CHUNK)  # rows: candidates that may be dominated
            divides = (v[None, :, :] % v[a, None, :] == 0).all(-1)  # [A, n]: v_a | v_b
            ge = (g[None, :, :] >= g[a, None, :] * (1 - DOMINANCE_RTOL)).all(-1)
            dom = divides & ge  # dom[i, j]: j weakly dominates i
            same = (v[None, :, :] == v[a, None, :]).all(-1) & (
                g[None, :, :] <= g[a, None, :] * (1 + DOMINANCE_RTOL)
            ).all(-1)  # j equals i: only an earlier j (lower latency) counts
            rows = np.arange(s, min(s + _DOM_CHUNK, n))
            earlier = np.arange(n)[None, :] < rows[:, None]
            dom &= ~same | earlier
            dom[np.arange(len(rows)), rows] = False
            keep[np.asarray(order)[rows]] = ~dom.any(axis=1)
    return [c for c, k in zip(pipelines, keep, strict=True) if k]


def _make_pipeline(
    costs: ModelCosts,
    sig: tuple[int, ...],
    batch: int,
    bounds: np.ndarray,
    lats: np.ndarray,
    thrs: np.ndarray,
    e2e: float,
    room: np.ndarray,
) -> CandidatePipeline:
    parts = []
    for d, kv in enumerate(sig):
        gpu, share = costs.kvs[kv]
        start, end = int(bounds[d]), int(bounds[d + 1])
        parts.append(
            CandidatePartition(
                kv=kv,
                gpu=gpu,
                share=share,
                start=start,
                end=end,
                latency_us=float(lats[d]),
                transfer_us=costs.transfer_out_us(batch, end),
                vgpu_throughput=float(thrs[d]),
                headroom=float(room[d]),
            )
        )
    return CandidatePipeline(batch=batch, partitions=tuple(parts), latency_us=e2e)
