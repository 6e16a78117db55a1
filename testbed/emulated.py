"""The paper's models live on emulated GPUs (../shared/docs/emulation.md): shadows of the
profiled models onboarded from the shipped profiles (data/ppipe-gpu-group2), a clusters-file
preset as network namespaces with one emulated GPU node per GPU, a plan served there at
time scale D (the router sees the dilated plan: SLOs x D, NICs / D; the nodes stretch the
profiled latencies x D), and the live capacity of a model mix found beside the
simulator's. Every figure leaves here undilated (rates x D, times / D).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from poolpipe.domain.plan import Plan, dilated
from poolpipe.store.warehouse import REPO_ROOT, Warehouse
from testbed.loadgen import CAPACITY_STEPS, CAPACITY_TARGET, bisect_grid, drive_mix, mix_times
from testbed.netns import EmulatedCluster
from testbed.predict import predict

GROUP2_DIR = REPO_ROOT / "data" / "ppipe-gpu-group2"
GROUP2 = ("colorization-v2", "googlenet-v3-pytorch", "repvgg-b3")
MAF19 = (0.30, 0.33, 0.37)


def onboard_shadows(
    warehouse: str, models=GROUP2, profiles: Path = GROUP2_DIR, devices=("L4", "T4")
) -> list[str]:
    """Onboard the shadow of each of `models` the warehouse cannot serve yet with these
    devices' tables (no block files: not onboarded, or imported profiles only; or tables
    missing) by the flow onboard-shadow; returns those onboarded now."""
    from flows.shadow import onboard_shadow

    with Warehouse.open(warehouse) as wh:
        known = set(wh.model_names())
        todo = [
            m
            for m in models
            if m not in known
            or wh.whole_model_file(m) is None
            or not set(devices) <= {g for g, _ in wh.load_profile(m).tables}
        ]
    for m in todo:
        onboard_shadow(m, str(profiles), warehouse=warehouse, devices=list(devices))
    return todo


def group_plans(
    warehouse: str, cluster: str, models=GROUP2, weights=MAF19, clusters_file=None
) -> dict[str, tuple[Plan, int]]:
    """The ppipe and np plans of `models` at the paper's SLOs (5x reference) on `cluster`
    (stored; with their ids)."""
    from poolpipe.planner import make_plan
    from poolpipe.store.plan_inputs import plan_request

    out = {}
    with Warehouse.open(warehouse) as wh:
        req = plan_request(
            wh,
            list(models),
            cluster,
            clusters_file=clusters_file or GROUP2_DIR / "clusters.toml",
            weights=list(weights),
            slo_scale=5.0,
        )
        for strategy in ("ppipe", "np"):
            plan = make_plan(replace(req, strategy=strategy))
            out[strategy] = (plan, wh.store_plan(plan, label=f"emulated:{strategy}"))
    return out


@dataclass
class MixLoad:
    """What a client sends to a served model mix: one request per model, its weight and
    its (dilated) SLO."""

    url: str
    requests: list[tuple[str, dict[str, np.ndarray]]]
    weights: list[float]
    slos_s: list[float]

    @classmethod
    def of(cls, dep, weights: dict[str, float]) -> MixLoad:
        requests, slos = [], []
        for io in dep.ios:
            x = np.random.default_rng(0).standard_normal((1, *io.inputs[0].dims))
            requests.append((io.name, {io.inputs[0].name: x.astype(io.inputs[0].dtype)}))
            slos.append(dep.core.topo.models[dep.core.topo.model_index(io.name)].slo_us / 1e6)
        return cls(dep.grpc_url, requests, [weights[io.name] for io in dep.ios], slos)

    def run(
        self, rate: float, duration_s: float, seed: int
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """Drive `rate` (dilated req/s) for `duration_s`: (share on time, times, models)."""
        times, which = mix_times(rate, self.weights, duration_s, seed)
        shots = drive_mix(self.url, self.requests, times, which)
        on_time = sum(1 for s in shots if s.outcome == "ok" and s.latency_s <= self.slos_s[s.model])
        return (on_time / len(times) if len(times) else 1.0), times, which


def mix_capacity(
    dep,
    load: MixLoad,
    top: float,
    duration_s: float,
    traces: int = 2,
    on_point: Callable[[str, float, float], None] = lambda kind, rate, att: None,
) -> dict:
    """Live and simulated capacity (dilated req/s) of the mix `dep` serves: the highest
    multiple of top/CAPACITY_STEPS at which each of `traces` Poisson traces keeps >=
    CAPACITY_TARGET on time, bisected (loadgen.bisect_grid: the simulator first, on the
    same traces and the stage times measured just before; the live search starts from its
    answer)."""
    load.run(0.3 * top, 2.0, seed=0)  # warm-up
    dep.core.take_stage_factors()
    load.run(0.5 * top, 4.0, seed=100)
    factors = [list(f) for f in dep.core.take_stage_factors()]
    points: dict[str, dict[float, float]] = {"live": {}, "sim": {}}

    def passes(kind: str, i: int) -> bool:
        rate = i * top / CAPACITY_STEPS
        for k in range(traces):
            seed = 200 + i + 1000 * k
            if kind == "sim":
                times, which = mix_times(rate, load.weights, duration_s, seed)
                got = predict(dep, times, duration_s, factors, models=which).attainment
            else:
                got = load.run(rate, duration_s, seed)[0]
            points[kind][rate] = min(got, points[kind].get(rate, got))
            on_point(kind, rate, got)
            if got < CAPACITY_TARGET:
                return False
        return True

    found = {"sim": bisect_grid(lambda i: passes("sim", i), CAPACITY_STEPS)}
    # the live search starts next to the simulator's answer
    found["live"] = bisect_grid(lambda i: passes("live", i), CAPACITY_STEPS, guess=found["sim"])
    return {
        "top": top,
        "sim": found["sim"] * top / CAPACITY_STEPS,
        "live": found["live"] * top / CAPACITY_STEPS,
        "sim_capped": found["sim"] == CAPACITY_STEPS,
        "capped": found["live"] == CAPACITY_STEPS,
        "points": points,
    }


@contextlib.contextmanager
def emulated_nodes(cluster, workspace: Path, time_scale: float, token_file: Path):
    """`cluster` (a preset) as namespaces, an emulated GPU node per GPU at `time_scale`,
    named <GPU>-<i> as a plan's layout names them; yields the EmulatedCluster."""
    with EmulatedCluster.from_cluster(cluster, workspace, time_scale) as em:
        count: dict[str, int] = {}
        for k, gpu in enumerate(em.devices):
            i = count.get(gpu, 0)
            count[gpu] = i + 1
            em.start_node(
                k, gpu, name=f"{gpu}-{i}", wait=False, token_file=token_file,
                emulate=True, time_scale=time_scale,
            )  # fmt: skip
        for k in range(len(em.nodes)):
            em.wait_node(k, 300)
        yield em


def serve_dilated(plan: Plan, plan_id: int, warehouse: str, workspace: Path, d: float, **kw):
    """A ServingProcess of `plan` dilated by `d` (what the router plans deadlines by)."""
    from triton_backend.serve import ServingProcess

    return ServingProcess(
        dilated(plan, d),
        warehouse,
        workspace,
        plan_id=plan_id,
        stats_interval_s=3600,
        metrics_port=0,
        **kw,
    )
