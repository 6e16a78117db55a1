"""The plan: pooled pipelines per model, as dataclasses, JSON, and a constraint check.

`Plan.verify(profiles)` re-derives every latency and throughput from the profiles (through
`ModelCosts`, the one definition of docs/design/planner.md's formulas) and checks GPU
counts, shares, contiguity, batch unification, partition count and the SLO budget.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.costs import ModelCosts
from poolpipe.domain.memory import GB, fits, share_bytes, vgpu_bytes
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import (
    PlanFormatError,
    PlanVerificationError,
    PoolpipeError,
    UnknownNameError,
)

STRATEGIES = ("ppipe", "np", "dart-r")
PACKINGS = ("per-share", "per-position")
# Relative slack when comparing re-derived figures with the stored ones (float round-off).
VERIFY_RTOL = 1e-6


@dataclass(frozen=True)
class PartitionPlan:
    start: int  # blocks [start, end)
    end: int
    gpu: str
    share: int  # v: each vGPU is 1/v of a physical GPU
    vgpus: int
    latency_us: float  # compute latency at the pipeline's batch
    transfer_us: float  # sending the batch's output feature map (0 for the last partition)
    vgpu_throughput: float  # samples/s of one vGPU

    @property
    def gpus(self) -> float:
        return self.vgpus / self.share

    @property
    def throughput(self) -> float:
        return self.vgpus * self.vgpu_throughput


@dataclass(frozen=True)
class PipelinePlan:
    batch: int
    latency_us: float  # planned end-to-end latency
    throughput: float  # req/s: min over partitions of vgpus x vGPU throughput
    partitions: tuple[PartitionPlan, ...]


@dataclass(frozen=True)
class ModelPlan:
    name: str
    weight: float
    slo_us: float
    throughput: float
    pipelines: tuple[PipelinePlan, ...]
    est_throughput: float | None = None  # λ̂ used for the batch-wait term
    # req/s served with >= 99% on time under Poisson arrivals at the plan's throughputs,
    # found by simulating the plan (sim/deliverable.py); None: not measured
    deliverable: float | None = None


@dataclass(frozen=True)
class SolverInfo:
    name: str
    status: str
    gap: float
    seconds: float  # whole planning wall time (enumeration + all solves)
    milp_seconds: float = 0.0
    num_vars: int = 0
    num_integer: int = 0
    num_rows: int = 0
    candidates: int = 0  # pipelines left after pruning
    feasible_configs: int = 0  # SLO-feasible (cuts, buckets, batch) combinations before
    proof: str = "milp"  # what proved the bound: milp | decomposition | knapsack | lp


@dataclass(frozen=True)
class Plan:
    strategy: str
    cluster: Cluster
    packing: str
    margin: float
    max_partitions: int
    models: tuple[ModelPlan, ...]
    objective: float
    solver: SolverInfo
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def deliverable(self) -> float | None:
        """The objective as delivered: the least deliverable req/s per weight over the
        models (None where the plan was not simulated)."""
        if not self.models or any(m.deliverable is None for m in self.models):
            return None
        return min(float(m.deliverable or 0.0) / m.weight for m in self.models)

    def model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.name == name:
                return m
        raise UnknownNameError(
            f"plan has no model {name!r}; it has {[m.name for m in self.models]}"
        )

    # ------------------------------------------------------------------ GPU accounting

    def owner(self, model: str) -> str:
        """The model whose GPUs a model of the plan takes from: itself, or for a segment
        of a model (domain/entry.py) the model it is cut from, as its partitions would
        (`meta["segments"]`)."""
        rec = (self.meta.get("segments") or {}).get(model)
        return str(rec["model"]) if isinstance(rec, Mapping) and "model" in rec else model

    def gpus_used(self) -> dict[str, int]:
        """Physical GPUs per type under the plan's packing rule."""
        if self.packing == "per-share":
            # a GPU carved into `share` vGPUs; each model's own unless models may share
            vgpus: dict[tuple[str, int, str], int] = defaultdict(int)
            for m in self.models:
                owner = "" if self.cluster.mixes_models else self.owner(m.name)
                for p in m.pipelines:
                    for part in p.partitions:
                        vgpus[(part.gpu, part.share, owner)] += part.vgpus
            used: dict[str, int] = defaultdict(int)
            for (gpu, share, _), n in vgpus.items():
                used[gpu] += math.ceil(n / share - 1e-9)
            return dict(used)
        per_pos: dict[tuple[str, int, str], float] = defaultdict(float)
        for m in self.models:
            for p in m.pipelines:
                for d, part in enumerate(p.partitions):
                    per_pos[(m.name, d, part.gpu)] += part.gpus
        used = defaultdict(int)
        for (_, _, gpu), g in per_pos.items():
            used[gpu] += math.ceil(g - 1e-9)
        return dict(used)

    @property
    def counts_inputs(self) -> bool:
        """Planned with each request's inputs counted on its first server's NIC
        (PlanRequest.count_inputs)."""
        return self.meta.get("inputs") == "counted"

    # ------------------------------------------------------------------ verification

    def verify(self, profiles: Mapping[str, ModelProfile]) -> None:
        """Raise PlanVerificationError listing every violated constraint."""
        problems: list[str] = []
        if self.strategy not in (*STRATEGIES, "manual"):
            problems.append(f"unknown strategy {self.strategy!r}")
        if self.packing not in PACKINGS:
            problems.append(f"unknown packing {self.packing!r}")
        for m in self.models:
            if m.name not in profiles:
                problems.append(f"{m.name}: no profile to verify against")
                continue
            problems.extend(self._verify_model(m, profiles[m.name]))
        for gpu, used in self.gpus_used().items():
            try:
                have = self.cluster.pool(gpu).count
            except UnknownNameError:
                problems.append(f"GPU type {gpu} is not in cluster {self.cluster.name}")
                continue
            if used > have:
                problems.append(
                    f"{gpu}: plan uses {used} GPUs ({self.packing}), cluster has {have}"
                )
        rates: Mapping[str, float] = (
            self.meta.get("rates") or {} if self.meta.get("objective") == "cost" else {}
        )
        for m in self.models if rates else ():
            want = float(rates.get(m.name, 0.0))
            if m.throughput < want * (1 - VERIFY_RTOL) - 1e-6:
                problems.append(f"{m.name}: serves {m.throughput:.3f} req/s, asked {want:.3f}")
        if self.models:
            achieved = min(m.throughput / m.weight for m in self.models)
            if self.objective > achieved * (1 + VERIFY_RTOL) + 1e-6:
                problems.append(
                    f"objective {self.objective:.6g} exceeds min throughput/weight {achieved:.6g}"
                )
        if problems:
            raise PlanVerificationError(
                f"plan ({self.strategy}, {self.cluster.name}) violates {len(problems)} "
                "constraint(s):\n  " + "\n  ".join(problems)
            )

    def _verify_model(self, m: ModelPlan, profile: ModelProfile) -> list[str]:
        problems: list[str] = []
        costs = ModelCosts(
            profile,
            self.cluster,
            m.slo_us,
            self.margin,
            m.est_throughput,
            inputs=self.counts_inputs,
        )
        budget = costs.budget_us()
        total = 0.0
        for pi, p in enumerate(m.pipelines):
            where = f"{m.name} pipeline {pi}"
            if not 1 <= len(p.partitions) <= self.max_partitions:
                problems.append(
                    f"{where}: {len(p.partitions)} partitions (max {self.max_partitions})"
                )
            if self.strategy in ("np", "dart-r") and any(q.share != 1 for q in p.partitions):
                problems.append(f"{where}: {self.strategy} uses whole GPUs only")
            if self.strategy == "np" and len(p.partitions) != 1:
                problems.append(f"{where}: np plans do not partition")
            edges = [q.start for q in p.partitions] + [p.partitions[-1].end] if p.partitions else []
            contiguous = all(
                a.end == b.start for a, b in zip(p.partitions, p.partitions[1:], strict=False)
            )
            if (
                not p.partitions
                or edges[0] != 0
                or edges[-1] != profile.num_blocks
                or not contiguous
            ):
                problems.append(
                    f"{where}: partitions "
                    + " ".join(f"[{q.start},{q.end})" for q in p.partitions)
                    + f" do not cover blocks 0..{profile.num_blocks} one after another"
                )
                continue
            parts = []
            capacity = math.inf
            for d, q in enumerate(p.partitions):
                if (q.gpu, q.share) not in costs.kvs:
                    problems.append(
                        f"{where} partition {d}: {q.gpu} share 1/{q.share} not allowed/profiled"
                    )
                    capacity = 0.0
                    continue
                if q.vgpus < 1:
                    problems.append(f"{where} partition {d}: {q.vgpus} vGPUs")
                kv = costs.kv_index(q.gpu, q.share)
                if p.batch > profile.tables[(q.gpu, q.share)].max_batch:
                    problems.append(
                        f"{where} partition {d}: batch {p.batch} not profiled on {q.gpu}/{q.share}"
                    )
                    capacity = 0.0
                    continue
                memory = self.cluster.pool(q.gpu).memory
                if not fits(profile, memory, q.share, p.batch):
                    problems.append(
                        f"{where} partition {d}: a vGPU on {q.gpu}/{q.share} at batch {p.batch} "
                        f"needs {vgpu_bytes(profile, p.batch) / GB:.2f} GB, more than its share "
                        f"of the GPU's memory ({share_bytes(memory, q.share) / GB:.2f} GB of "
                        f"{memory:g} GB); give the GPU's memory_gb in the cluster if it has "
                        "more, or plan with it (the planner leaves such partitions out)"
                    )
                parts.append((kv, q.start, q.end))
                capacity = min(
                    capacity, q.vgpus * costs.vgpu_throughput(kv, p.batch, q.start, q.end)
                )
            if len(parts) == len(p.partitions):
                lat = costs.pipeline_latency_us(p.batch, parts)
                if not lat <= budget * (1 + VERIFY_RTOL):
                    problems.append(f"{where}: latency {lat:.1f} µs exceeds budget {budget:.1f} µs")
            if p.throughput > capacity * (1 + VERIFY_RTOL) + 1e-9:
                problems.append(f"{where}: throughput {p.throughput:.3f} > capacity {capacity:.3f}")
            total += p.throughput
        if m.deliverable is not None and not (
            0 <= m.deliverable <= m.throughput * (1 + VERIFY_RTOL) + 1e-6
        ):
            problems.append(
                f"{m.name}: deliverable {m.deliverable:.3f} req/s is not within 0 and its "
                f"throughput {m.throughput:.3f}"
            )
        if abs(total - m.throughput) > VERIFY_RTOL * max(1.0, total) + 1e-6:
            problems.append(
                f"{m.name}: throughput {m.throughput:.3f} != sum of pipelines {total:.3f}"
            )
        return problems

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "packing": self.packing,
            "margin": self.margin,
            "max_partitions": self.max_partitions,
            "cluster": self.cluster.to_dict(),
            "objective": self.objective,
            "deliverable": self.deliverable,
            "solver": {k: _json_float(v) for k, v in asdict(self.solver).items()},
            "models": [
                {
                    "name": m.name,
                    "weight": m.weight,
                    "slo_us": m.slo_us,
                    "est_throughput": m.est_throughput,
                    "throughput": m.throughput,
                    "deliverable": m.deliverable,
                    "pipelines": [
                        {
                            "throughput": p.throughput,
                            "batch": p.batch,
                            "latency_us": p.latency_us,
                            "partitions": [
                                {
                                    "blocks": [q.start, q.end],
                                    "gpu": q.gpu,
                                    "share": q.share,
                                    "vgpus": q.vgpus,
                                    "gpus": q.gpus,
                                    "latency_us": q.latency_us,
                                    "transfer_us": q.transfer_us,
                                    "vgpu_throughput": q.vgpu_throughput,
                                }
                                for q in p.partitions
                            ],
                        }
                        for p in m.pipelines
                    ],
                }
                for m in self.models
            ],
            "meta": dict(self.meta),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan") -> Plan:
        """A plan from its JSON form; PlanFormatError names `where` and the bad field."""
        f = _Fields(where)
        c = f.mapping(d, "cluster")
        solver = dict(f.mapping(d, "solver"))
        for key in ("gap", "seconds", "milp_seconds"):
            if solver.get(key) is None and key in solver:
                solver[key] = math.inf
        try:
            info = SolverInfo(**solver)
        except TypeError as e:
            raise PlanFormatError(f"{where}: field solver: {e}") from None
        try:
            name = f.text(c, "name", "cluster")
            cluster = Cluster.from_dict(name, dict(c), where=f"{where} cluster")
        except PoolpipeError as e:
            raise PlanFormatError(str(e)) from None
        models = []
        for i, m in enumerate(f.items(d, "models")):
            at = f"models[{i}]"
            pipes = []
            for j, p in enumerate(f.items(m, "pipelines", at)):
                pat = f"{at}.pipelines[{j}]"
                parts = []
                for k, q in enumerate(f.items(p, "partitions", pat)):
                    qat = f"{pat}.partitions[{k}]"
                    blocks = f.items(q, "blocks", qat)
                    if len(blocks) != 2:
                        raise PlanFormatError(f"{where}: {qat}.blocks must be [start, end]")
                    parts.append(
                        PartitionPlan(
                            start=f.integer(blocks, 0, f"{qat}.blocks"),
                            end=f.integer(blocks, 1, f"{qat}.blocks"),
                            gpu=f.text(q, "gpu", qat),
                            share=f.integer(q, "share", qat),
                            vgpus=f.integer(q, "vgpus", qat),
                            latency_us=f.number(q, "latency_us", qat),
                            transfer_us=f.number(q, "transfer_us", qat),
                            vgpu_throughput=f.number(q, "vgpu_throughput", qat),
                        )
                    )
                pipes.append(
                    PipelinePlan(
                        batch=f.integer(p, "batch", pat),
                        latency_us=f.number(p, "latency_us", pat),
                        throughput=f.number(p, "throughput", pat),
                        partitions=tuple(parts),
                    )
                )
            est = m.get("est_throughput") if isinstance(m, Mapping) else None
            dlv = m.get("deliverable") if isinstance(m, Mapping) else None
            models.append(
                ModelPlan(
                    name=f.text(m, "name", at),
                    weight=f.number(m, "weight", at),
                    slo_us=f.number(m, "slo_us", at),
                    est_throughput=None if est is None else f.number(m, "est_throughput", at),
                    throughput=f.number(m, "throughput", at),
                    pipelines=tuple(pipes),
                    deliverable=None if dlv is None else f.number(m, "deliverable", at),
                )
            )
        meta = d.get("meta", {})
        return cls(
            strategy=f.text(d, "strategy"),
            packing=f.text(d, "packing"),
            margin=f.number(d, "margin"),
            max_partitions=f.integer(d, "max_partitions"),
            cluster=cluster,
            objective=f.number(d, "objective"),
            solver=info,
            models=tuple(models),
            meta=meta if isinstance(meta, Mapping) else {},
        )

    @classmethod
    def load(cls, path: Path) -> Plan:
        """A plan JSON file; PlanFormatError names the file and what is wrong with it."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except OSError as e:
            raise PlanFormatError(f"cannot read plan file {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanFormatError(
                f"{path} is not a plan JSON file ({e}); write plans with poolpipe plan --out"
            ) from None
        if not isinstance(doc, Mapping):
            raise PlanFormatError(f"{path}: a plan is a JSON object, got {type(doc).__name__}")
        return cls.from_dict(doc, where=str(path))


class _Fields:
    """Typed reads of a plan's JSON fields, naming the file and the field when one is
    missing or of the wrong type."""

    def __init__(self, where: str):
        self.where = where

    def _get(self, d: Any, key: str | int, at: str) -> Any:
        name = f"{at}.{key}" if at and isinstance(key, str) else f"{at}[{key}]" if at else key
        try:
            return d[key], name
        except (KeyError, IndexError, TypeError):
            raise PlanFormatError(f"{self.where}: field {name} is missing") from None

    def _bad(self, name: str, want: str, got: Any) -> PlanFormatError:
        return PlanFormatError(f"{self.where}: field {name} must be {want}, got {got!r}")

    def mapping(self, d: Any, key: str, at: str = "") -> Mapping[str, Any]:
        v, name = self._get(d, key, at)
        if not isinstance(v, Mapping):
            raise self._bad(name, "an object", v)
        return v

    def items(self, d: Any, key: str, at: str = "") -> list[Any]:
        v, name = self._get(d, key, at)
        if not isinstance(v, list):
            raise self._bad(name, "a list", v)
        return v

    def text(self, d: Any, key: str, at: str = "") -> str:
        v, name = self._get(d, key, at)
        if not isinstance(v, str) or not v:
            raise self._bad(name, "a non-empty string", v)
        return v

    def number(self, d: Any, key: str, at: str = "") -> float:
        v, name = self._get(d, key, at)
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
            raise self._bad(name, "a number", v)
        return float(v)

    def integer(self, d: Any, key: str | int, at: str = "") -> int:
        v, name = self._get(d, key, at)
        if isinstance(v, bool) or not (
            isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        ):
            raise self._bad(str(name), "a whole number", v)
        return int(v)


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def manual_plan(
    model: str,
    slo_us: float,
    cluster: Cluster,
    partitions: Sequence[tuple[int, int, str, int]],
    batch: int,
    profile: ModelProfile | None = None,
) -> Plan:
    """A plan written by hand: one pipeline of (first block, end block, GPU type, vGPUs)
    partitions on whole GPUs, for pinning a layout (tests, benchmarks, operators). With the
    model's profile, latencies and throughputs are filled in from it."""

    def latency(a: int, b: int, gpu: str) -> float | None:
        if profile is None or (gpu, 1) not in profile.tables:
            return None
        return float(profile.tables[(gpu, 1)].latency_us[a:b, batch - 1].sum())

    def part(a: int, b: int, gpu: str, n: int) -> PartitionPlan:
        lat = latency(a, b, gpu)
        if lat is None:  # unknown: placeholders of 1
            return PartitionPlan(a, b, gpu, 1, n, 1.0, 0.0, 1.0)
        return PartitionPlan(a, b, gpu, 1, n, lat, 0.0, batch * 1e6 / lat)

    parts = tuple(part(*p) for p in partitions)
    throughput = min(p.throughput for p in parts)
    pipe = PipelinePlan(batch, sum(p.latency_us for p in parts), throughput, parts)
    return Plan(
        strategy="manual",
        cluster=cluster,
        packing="per-share",
        margin=0.0,
        max_partitions=len(parts),
        models=(ModelPlan(model, 1.0, slo_us, throughput, (pipe,)),),
        objective=throughput,
        solver=SolverInfo("manual", "given", 0.0, 0.0),
    )


def watched_load(plan: Plan) -> dict[str, tuple[float | None, float]]:
    """What a router's load is measured by under `plan`: per name (a model; a plan of
    entry streams, meta graft, each stream: its mix of entry points is the load), the rate
    the plan states it serves at 99% on time (None: it states none) and its weight."""
    streams = (plan.meta.get("graft") or {}).get("streams")
    if streams:  # sized on what it delivers: each stream at its rate
        return {str(s["name"]): (float(s["rate"]), float(s["rate"])) for s in streams}
    return {
        m.name: (None if m.deliverable is None else float(m.deliverable), m.weight)
        for m in plan.models
    }


def dilated(plan: Plan, d: float) -> Plan:
    """`plan` on a cluster `d` times slower (time-warped emulation, ../shared/docs/
    docs/design/emulation.md): latencies and SLOs x d, throughputs (the deliverable ones too)
    and the NIC bandwidth / d. What a
    router serving emulated GPU nodes at time scale d plans its deadlines and links by;
    `meta["time_scale"]` records d (figures are reported back x d)."""
    if not (math.isfinite(d) and d > 0):
        raise PoolpipeError(f"a time scale must be a number > 0, got {d!r}")

    def part(q: PartitionPlan) -> PartitionPlan:
        return replace(
            q,
            latency_us=q.latency_us * d,
            transfer_us=q.transfer_us * d,
            vgpu_throughput=q.vgpu_throughput / d,
        )

    models = tuple(
        replace(
            m,
            slo_us=m.slo_us * d,
            throughput=m.throughput / d,
            est_throughput=None if m.est_throughput is None else m.est_throughput / d,
            deliverable=None if m.deliverable is None else m.deliverable / d,
            pipelines=tuple(
                replace(
                    p,
                    latency_us=p.latency_us * d,
                    throughput=p.throughput / d,
                    partitions=tuple(part(q) for q in p.partitions),
                )
                for p in m.pipelines
            ),
        )
        for m in plan.models
    )
    scale = float(plan.meta.get("time_scale", 1.0)) * d
    meta = {**plan.meta, "time_scale": scale}
    if isinstance(plan.meta.get("rates"), dict):  # the cost objective's rates asked for
        meta["rates"] = {m: float(r) / d for m, r in plan.meta["rates"].items()}
    if isinstance(plan.meta.get("apps"), dict):  # applications: SLOs, budgets x d, rates / d
        meta["apps"] = {name: _dilated_app(rec, d) for name, rec in plan.meta["apps"].items()}
        if isinstance(plan.meta.get("apps_rates"), dict):
            meta["apps_rates"] = {a: r / d for a, r in plan.meta["apps_rates"].items()}
    if isinstance(plan.meta.get("graft"), dict):  # entry streams: budgets x d, rates / d
        meta["graft"] = _dilated_graft(plan.meta["graft"], d)
    return replace(
        plan,
        cluster=replace(plan.cluster, bandwidth_gbps=plan.cluster.bandwidth_gbps / d),
        models=models,
        objective=plan.objective / d,
        meta=meta,
    )


def time_scale(plan: Plan) -> float:
    """The time scale `plan` is served at (`dilated`; 1: real GPUs)."""
    return float(plan.meta.get("time_scale", 1.0))


def undilated(plan: Plan) -> Plan:
    """`plan` at time scale 1 (what `dilated` made of it, undone)."""
    d = time_scale(plan)
    if d == 1:
        return plan
    back = dilated(plan, 1 / d)
    return replace(back, meta={**back.meta, "time_scale": 1.0})


def _dilated_graft(rec: dict, d: float) -> dict:
    """A plan's record of its entry streams (planner.graft), its times x d, rates / d."""
    out = dict(rec)
    if isinstance(out.get("streams"), list):
        out["streams"] = [
            {**st, "budget_us": st["budget_us"] * d, "slo_us": st["slo_us"] * d,
             "rate": st["rate"] / d}
            for st in out["streams"]
        ]  # fmt: skip
    if isinstance(out.get("asked"), dict):
        out["asked"] = {n: r / d for n, r in out["asked"].items()}
    if isinstance(out.get("groups"), list):
        out["groups"] = [
            {**g, "fragments": [[e, b * d] for e, b in g["fragments"]]} for g in out["groups"]
        ]
    return out


def _dilated_app(rec: dict, d: float) -> dict:
    """An application's record in a plan's meta (planner.apps), its times x d."""
    out = dict(rec)
    if "slo_us" in out:
        out["slo_us"] = out["slo_us"] * d
    for key in ("budgets_us", "planned_budgets_us"):
        if isinstance(out.get(key), dict):
            out[key] = {m: b * d for m, b in out[key].items()}
    if isinstance(out.get("spec"), dict) and "slo_ms" in out["spec"]:
        out["spec"] = {**out["spec"], "slo_ms": out["spec"]["slo_ms"] * d}
    return out
