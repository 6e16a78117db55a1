"""What a planning run depends on, validated: models, weights, SLOs, cluster, strategy and
solver options."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.plan import PACKINGS, STRATEGIES, Plan
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import PoolpipeError
from poolpipe.planner.solvers import DEFAULT_MIP_GAP, DEFAULT_TIME_LIMIT_S, SOLVERS

OBJECTIVES = ("maxmin", "cost")
# planner/deliverable.py: plan for what is delivered, state it only, or neither
DELIVERY = ("maximise", "state", "off")


@dataclass(frozen=True)
class PlanRequest:
    """Everything a planning run depends on."""

    models: tuple[ModelProfile, ...]
    weights: tuple[float, ...]
    slos_us: tuple[float, ...]
    cluster: Cluster
    strategy: str = "ppipe"
    packing: str = "per-share"
    margin: float = 0.4
    max_partitions: int = 2
    solver: str = "highs"
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    mip_gap: float = DEFAULT_MIP_GAP
    threads: int | None = None
    batch_wait: bool = True  # include the batch-fill estimate in pipeline latency
    # count each request's inputs on its first server's NIC (ModelCosts.inputs; the paper's
    # transfer model does not): plans a live cluster can carry when inputs are large
    count_inputs: bool = False
    # "maxmin": the most normalised throughput on the cluster's GPUs; "cost": the cheapest
    # GPUs (prices per GPU-hour) that serve `rates` (req/s per model) within their SLOs
    objective: str = "maxmin"
    rates: tuple[float, ...] | None = None
    prices: Mapping[str, float] = field(default_factory=dict)
    # cost: also price the cheapest np plan and the cheapest plan on each GPU type alone
    # for the same rates (one more MILP each), for the user to compare
    cost_alternatives: bool = True
    # max-min: an earlier plan (the serving one) fitted to this cluster is the first plan
    # the search starts from (warm.py); the result is the same, found sooner
    warm_start: Plan | None = field(default=None, compare=False)
    # headroom planning (planner/deliverable.py): per model the req/s its pools are sized
    # for, each vGPU planned at the utilisation that leaves room for queueing; None: fluid
    headroom_rates: tuple[float, ...] | None = None
    # what the plan delivers (planner/deliverable.py): "maximise" chooses the plan that
    # serves the most with >= 99% on time, by simulation, and states it; "state" states
    # the fluid plan's; "off" plans fluid only (no simulation)
    delivery: str = "maximise"
    # "maximise" also plans at these margins (each a fraction of the SLO held back, as
    # `margin`) and keeps the plan that delivers the most: a smaller margin admits larger
    # batches and slower GPUs, whose waiting the simulation then measures (max-min
    # ppipe and np; dart-r plans as its heuristic does)
    search_margins: tuple[float, ...] = ()
    # where the cluster cannot hold a pipeline of every model at once (the max-min optimum
    # is 0): plan the models it can serve together and name the others in
    # meta["unserved"] (what a user planning a group asks for: `poolpipe plan`, the plan
    # flow); False: the max-min plan of them all, which serves some nothing (what
    # comparisons of strategies, shards and bounds need)
    leave_out: bool = False

    def __post_init__(self) -> None:
        n = len(self.models)
        if n == 0:
            raise PoolpipeError("no models to plan; pass --models A,B,...")
        if len(self.weights) != n or len(self.slos_us) != n:
            raise PoolpipeError(
                f"{n} models but {len(self.weights)} weights and {len(self.slos_us)} SLOs; "
                "give one weight (--weights) and one SLO per model"
            )
        names = [m.name for m in self.models]
        if len(set(names)) != n:
            raise PoolpipeError(f"a model is listed twice: {names}")
        if any(not (w > 0 and math.isfinite(w)) for w in self.weights):
            raise PoolpipeError(f"weights must be positive numbers, got {list(self.weights)}")
        if any(not (s > 0 and math.isfinite(s)) for s in self.slos_us):
            raise PoolpipeError(f"SLOs must be positive numbers of µs, got {list(self.slos_us)}")
        if self.strategy not in STRATEGIES:
            raise PoolpipeError(
                f"unknown strategy {self.strategy!r}; choose {', '.join(STRATEGIES)}"
            )
        if self.packing not in PACKINGS:
            raise PoolpipeError(f"unknown packing {self.packing!r}; choose {', '.join(PACKINGS)}")
        if not 0 <= self.margin < 1:
            raise PoolpipeError(f"margin must be in [0, 1), got {self.margin}")
        if any(not 0 <= m < 1 for m in self.search_margins):
            raise PoolpipeError(
                f"search margins must be in [0, 1), got {list(self.search_margins)}"
            )
        if self.search_margins and (self.delivery != "maximise" or self.objective != "maxmin"):
            raise PoolpipeError(
                "search margins are tried by the max-min planner's search for what plans "
                f"deliver; not with delivery {self.delivery!r} and objective "
                f"{self.objective!r}: use --delivery maximise and --objective maxmin, or "
                "drop --search-margins"
            )
        if self.max_partitions < 1:
            raise PoolpipeError(f"max partitions must be >= 1, got {self.max_partitions}")
        if self.solver not in SOLVERS:
            raise PoolpipeError(f"unknown solver {self.solver!r}; choose {', '.join(SOLVERS)}")
        if self.delivery not in DELIVERY:
            raise PoolpipeError(f"unknown delivery {self.delivery!r}; choose {', '.join(DELIVERY)}")
        if self.headroom_rates is not None and (
            len(self.headroom_rates) != n or not all(_positive(r) for r in self.headroom_rates)
        ):
            raise PoolpipeError(
                f"headroom rates must be one req/s > 0 per model, got {self.headroom_rates}"
            )
        if self.objective not in OBJECTIVES:
            raise PoolpipeError(
                f"unknown objective {self.objective!r}; choose {', '.join(OBJECTIVES)}"
            )
        if self.objective == "cost":
            self._check_cost_inputs()
            if self.warm_start is not None:
                raise PoolpipeError("a warm start applies to max-min planning, not to cost")
        for m in self.models:
            if not any(gpu in m.gpus for gpu in (p.gpu for p in self.cluster.pools)):
                raise PoolpipeError(
                    f"model {m.name} has no profile for any GPU type of cluster "
                    f"{self.cluster.name} ({[p.gpu for p in self.cluster.pools]}); it has {m.gpus}"
                )

    def only(self, keep: list[int]) -> PlanRequest:
        """The same request for the models at positions `keep` (in that order)."""

        def pick(values: tuple | None) -> tuple | None:
            return None if values is None else tuple(values[i] for i in keep)

        return replace(
            self,
            models=tuple(self.models[i] for i in keep),
            weights=tuple(self.weights[i] for i in keep),
            slos_us=tuple(self.slos_us[i] for i in keep),
            rates=pick(self.rates),
            headroom_rates=pick(self.headroom_rates),
            warm_start=None,
        )

    def _check_cost_inputs(self) -> None:
        names = [m.name for m in self.models]
        if self.rates is None or len(self.rates) != len(names):
            raise PoolpipeError(
                f"the cost objective needs a rate (req/s) for each of {names}; give "
                "--rates " + ",".join(f"{n}=RATE" for n in names)
            )
        check_rates(dict(zip(names, self.rates, strict=True)))
        check_prices(self.cluster, self.prices)
        if self.strategy == "dart-r":
            raise PoolpipeError("the cost objective plans ppipe or np, not dart-r")


def check_rates(rates: Mapping[str, float]) -> None:
    """The cost objective's rates (req/s by name): finite and > 0, the bad ones named."""
    bad = [f"{n}={r}" for n, r in rates.items() if not _positive(r)]
    if bad:
        raise PoolpipeError(f"rates must be finite req/s > 0, got {', '.join(bad)}")


def check_prices(cluster: Cluster, prices: Mapping[str, float]) -> None:
    """A price per GPU-hour, finite and > 0, for every GPU type of `cluster`; the missing
    and bad ones named, with where to give them."""
    gpus = [p.gpu for p in cluster.pools]
    missing = [g for g in gpus if g not in prices]
    if missing:
        raise PoolpipeError(
            f"no price for GPU type(s) of cluster {cluster.name}: missing "
            f"{', '.join(missing)} (per GPU-hour, for the cost objective); give "
            "price_per_hour in the clusters file or --prices "
            + ",".join(f"{g}=PRICE" for g in gpus)
        )
    bad = [f"{g}={prices[g]}" for g in gpus if not _positive(prices[g])]
    if bad:
        raise PoolpipeError(f"prices must be finite amounts > 0, got {', '.join(bad)}")


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def group_request(
    profiles: Mapping[str, ModelProfile],
    group: Sequence[str],
    weights: Sequence[float],
    cluster: Cluster,
    strategy: str = "ppipe",
    packing: str = "per-position",
    *,
    slo_scale: float = 5.0,
    margin: float = 0.4,
    max_partitions: int = 2,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    delivery: str = "off",
) -> PlanRequest:
    """A configuration as the paper's main results plan it: the models of `group` at the
    mix `weights`, each with an SLO of `slo_scale` times its reference latency, planned
    with `margin` held back and pipelines of at most `max_partitions` partitions, by the
    fluid MILP as published (`delivery` "off"; "maximise" plans for what is delivered)."""
    slos = []
    for n in group:
        ref = profiles[n].reference_latency_us
        if ref is None:
            raise PoolpipeError(f"model {n} has no reference latency to scale an SLO from")
        slos.append(slo_scale * ref)
    return PlanRequest(
        models=tuple(profiles[n] for n in group),
        weights=tuple(weights),
        slos_us=tuple(slos),
        cluster=cluster,
        strategy=strategy,
        packing=packing,
        margin=margin,
        max_partitions=max_partitions,
        time_limit_s=time_limit_s,
        delivery=delivery,
    )
