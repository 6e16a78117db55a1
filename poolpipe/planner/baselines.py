"""DART-r (docs/design/planner.md): NP's GPU split per model, then one high-class and one
low-class GPU per pair running the best 2-partition whole-GPU pipeline, leftovers running
the whole model."""

from __future__ import annotations

import math
from dataclasses import replace

from poolpipe.domain.plan import PipelinePlan, Plan
from poolpipe.errors import PoolpipeError
from poolpipe.planner.candidates import CandidatePipeline, enumerate_pipelines
from poolpipe.planner.exact import Solved, model_costs, solve_group
from poolpipe.planner.readback import assemble, pipeline_plan, solver_info
from poolpipe.planner.request import PlanRequest


def _split_gpus_like_np(req: PlanRequest, np_plan: Plan) -> list[dict[str, int]]:
    """GPUs per model and type as the NP plan uses them; unused GPUs split evenly."""
    alloc = [
        {
            gpu: sum(p.partitions[0].vgpus for p in m.pipelines if p.partitions[0].gpu == gpu)
            for gpu in (q.gpu for q in req.cluster.pools)
        }
        for m in np_plan.models
    ]
    for pool in req.cluster.pools:
        spare = pool.count - sum(a[pool.gpu] for a in alloc)
        each, extra = divmod(max(spare, 0), len(alloc))
        for i, a in enumerate(alloc):
            a[pool.gpu] += each + (1 if i < extra else 0)
    return alloc


def plan_dart_r(
    req: PlanRequest, lam: list[float | None], lam_solved: Solved | None, started: float
) -> Plan:
    if len(req.cluster.pools) != 2:
        raise PoolpipeError(
            f"dart-r pairs one high-class with one low-class GPU, so it needs a cluster of "
            f"exactly two GPU types; {req.cluster.name} has {len(req.cluster.pools)}"
        )
    np_req = replace(req, strategy="np")
    costs_np = model_costs(req, lam, whole_gpus_only=True)
    np_solved = solve_group(np_req, costs_np, 1, "whole-GPU")
    np_pipes = [[pipeline_plan(c, n) for c, n in picked] for picked in np_solved.chosen]
    np_plan = assemble(np_req, "np", 1, np_pipes, lam, solver_info([np_solved], started))
    alloc = _split_gpus_like_np(req, np_plan)

    pipelines: list[list[PipelinePlan]] = []
    for i, costs in enumerate(costs_np):
        profile = costs.profile
        # High class: the type that runs this whole model faster at batch 1.
        speed = sorted(
            (p.gpu for p in req.cluster.pools),
            key=lambda g: profile.whole_latency_us(g) if (g, 1) in profile.tables else math.inf,
        )
        high, low = speed[0], speed[1]
        pairs = min(alloc[i][high], alloc[i][low])
        larger = high if alloc[i][high] > alloc[i][low] else low
        leftover = abs(alloc[i][high] - alloc[i][low])
        two = enumerate_pipelines(costs, 2, merge_same_bucket=False).pipelines
        # A pair holds one GPU of each class: no pipeline may use one class twice.
        pair_options = [c for c in two if len({p.gpu for p in c.partitions}) == len(c.partitions)]
        pipes: dict[tuple, tuple[CandidatePipeline, int]] = {}

        def add(cand: CandidatePipeline, count: int, pipes: dict = pipes) -> None:
            key = (cand.batch, tuple((p.gpu, p.start, p.end) for p in cand.partitions))
            prev = pipes.get(key, (cand, 0))[1]
            pipes[key] = (cand, prev + count)

        if pairs and pair_options:
            add(max(pair_options, key=lambda c: (_one_each(c), -c.latency_us)), pairs)
        singles = [
            c for c in pair_options if len(c.partitions) == 1 and c.partitions[0].gpu == larger
        ]
        if leftover and singles:
            add(max(singles, key=lambda c: (_one_each(c), -c.latency_us)), leftover)
        pipelines.append([pipeline_plan(c, [n] * len(c.partitions)) for c, n in pipes.values()])
    runs = [s for s in (lam_solved, np_solved) if s is not None]
    info = replace(solver_info(runs, started), candidates=0)
    meta = {"gpu_split": alloc}
    return assemble(req, "dart-r", 2, pipelines, lam, info, meta)


def _one_each(c: CandidatePipeline) -> float:
    """Throughput of a pipeline with one vGPU per partition."""
    return min(p.vgpu_throughput for p in c.partitions)
