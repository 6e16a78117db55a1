"""Solved candidate pipelines read back as a `Plan`: pipelines, models, objective and the
solver's account."""

from __future__ import annotations

import time

from poolpipe.domain.plan import (
    ModelPlan,
    PartitionPlan,
    PipelinePlan,
    Plan,
    SolverInfo,
)
from poolpipe.planner.candidates import CandidatePipeline
from poolpipe.planner.exact import Solved
from poolpipe.planner.request import PlanRequest


def pipeline_plan(cand: CandidatePipeline, counts: list[int]) -> PipelinePlan:
    """A candidate with its vGPU counts as a plan's pipeline, at its fluid throughputs (a
    candidate planned with headroom keeps its pools and paths, not its reduced figures)."""
    parts = tuple(
        PartitionPlan(
            start=p.start,
            end=p.end,
            gpu=p.gpu,
            share=p.share,
            vgpus=n,
            latency_us=p.latency_us,
            transfer_us=p.transfer_us,
            vgpu_throughput=p.fluid_throughput,
        )
        for p, n in zip(cand.partitions, counts, strict=True)
    )
    return PipelinePlan(
        batch=cand.batch,
        latency_us=cand.latency_us,
        throughput=min(q.throughput for q in parts),
        partitions=parts,
    )


def assemble(
    req: PlanRequest,
    strategy: str,
    max_partitions: int,
    pipelines: list[list[PipelinePlan]],
    lam: list[float | None],
    solver: SolverInfo,
    meta: dict | None = None,
) -> Plan:
    models = tuple(
        ModelPlan(
            name=m.name,
            weight=w,
            slo_us=slo,
            throughput=sum(p.throughput for p in pipes),
            pipelines=tuple(sorted(pipes, key=lambda p: -p.throughput)),
            est_throughput=lam[i],
        )
        for i, (m, w, slo, pipes) in enumerate(
            zip(req.models, req.weights, req.slos_us, pipelines, strict=True)
        )
    )
    objective = min(m.throughput / m.weight for m in models)
    if req.count_inputs:  # Plan.verify counts them too
        meta = {**(meta or {}), "inputs": "counted"}
    return Plan(
        strategy=strategy,
        cluster=req.cluster,
        packing=req.packing,
        margin=req.margin,
        max_partitions=max_partitions,
        models=models,
        objective=objective,
        solver=solver,
        meta=meta or {},
    )


def solver_info(solved: list[Solved], started: float) -> SolverInfo:
    last = solved[-1]
    statuses = {s.result.status for s in solved}
    status = "optimal" if statuses == {"optimal"} else ",".join(sorted(statuses))
    return SolverInfo(
        name=last.result.solver,
        status=status,
        gap=max(s.result.gap for s in solved),
        seconds=time.perf_counter() - started,
        milp_seconds=sum(s.result.seconds for s in solved),
        num_vars=last.group.milp.num_vars,
        num_integer=last.group.milp.num_integer,
        num_rows=last.group.milp.num_rows,
        candidates=sum(len(c) for c in last.kept),
        feasible_configs=sum(e.feasible for e in last.enumerations),
        proof=last.proof,
    )
