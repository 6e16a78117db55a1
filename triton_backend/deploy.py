"""Bring a plan up on this machine: partition files, one rendered repository and one
tritonserver node per physical GPU of the plan's topology, and the router (PyTriton) in
front; and take it down again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import re
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolpipe.client.control import CONTROL_MODEL
from poolpipe.domain.plan import Plan
from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import PartitionFile, make_partition
from poolpipe.runtime.placement import Layout, layout
from poolpipe.scheduler import build_topology, make_data_plane
from poolpipe.scheduler.topology import Topology, with_latencies
from poolpipe.sim.metrics import SimResult
from poolpipe.store.warehouse import Warehouse
from triton_backend.env import fix_this_process, free_ports, triton_home
from triton_backend.nodes import TritonNode, stop_nodes
from triton_backend.repository import render_partition
from triton_backend.router import REPLY_MARGIN_US, ModelIO, RouterCore, ServedPlan

_CPU = re.compile(r"^cpu-(\d+)t$")


def threads_of(device: str) -> int:
    m = _CPU.match(device)
    if not m:
        raise PoolpipeError(
            f"device type {device!r} is not a CPU class (cpu-<threads>t); GPU node types need "
            "a GPU node running Triton's onnxruntime or tensorrt backend"
        )
    return int(m.group(1))


# make_partition's arguments: whole model, model, block layers, start, end, out dir, tag
PartitionJob = tuple[Path, str, list[tuple[int, int]], int, int, Path, str]


def partition_jobs(wh: Warehouse, lay: Layout, out_dir: Path) -> dict[str, PartitionJob]:
    """make_partition's arguments for every partition of the layout (warehouse reads only)."""
    jobs: dict[str, PartitionJob] = {}
    for p in lay.placements:
        if p.partition in jobs:
            continue
        whole = wh.whole_model_file(p.model)
        if whole is None or not whole.is_file():
            raise PoolpipeError(
                f"model {p.model} has no onboarded files; run: poolpipe onboard MODEL.onnx "
                f"--name {p.model}"
            )
        layers = wh.block_layers(p.model)
        jobs[p.partition] = (whole, p.model, layers, p.start, p.end, out_dir, p.tag)
    return jobs


def _prepare(
    plan: Plan, warehouse: str | Path | None, workspace: Path, tag: str, isolated: bool = False
) -> tuple[Topology, Layout, dict[str, PartitionFile]]:
    """Topology, layout and partition files of `plan`. `isolated`: cut the partitions out
    of the whole model in a separate process, as a rollout does while this process serves:
    the ONNX surgery is seconds of pure-Python work that would otherwise hold the GIL from
    the router (measured: 3.4 s of CPU for two ResNet-50 partitions)."""
    with Warehouse.open(warehouse) as wh:
        profiles = {m.name: wh.load_profile(m.name) for m in plan.models}
        topo = build_topology(plan, profiles)
        lay = layout(topo, tag)
        jobs = partition_jobs(wh, lay, workspace / "partitions")
    if not isolated:
        return topo, lay, {name: make_partition(*args) for name, args in jobs.items()}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(make_partition, *args) for name, args in jobs.items()}
        return topo, lay, {name: f.result() for name, f in futures.items()}


def _place(
    lay: Layout,
    parts: dict[str, PartitionFile],
    nodes: dict[str, TritonNode],
    workspace: Path,
    max_batch: int,
    loaded: list[tuple[TritonNode, str]],
    started: list[TritonNode],
) -> None:
    """Render every placement into its node's repository, start the nodes that are not
    running yet and load the partition models (recorded in `loaded` and `started`, so that
    a failure can be undone)."""
    for spec in lay.nodes:
        if spec.name not in nodes:
            repo = workspace / "repos" / spec.name
            shutil.rmtree(repo, ignore_errors=True)
            nodes[spec.name] = node = TritonNode(spec.name, spec.gpu, repo, workspace)
            started.append(node)
        node = nodes[spec.name]
        for p in lay.placements:
            if p.node == spec.name:
                render_partition(
                    parts[p.partition],
                    node.repo,
                    instances=p.instances,
                    threads=threads_of(spec.gpu),
                    max_batch=max_batch,
                )

    def bring_up(node: TritonNode) -> None:
        if not node.alive:
            node.start()
        for p in lay.placements:
            if p.node == node.name:
                node.load(p.partition)
                loaded.append((node, p.partition))

    todo = [nodes[s.name] for s in lay.nodes]
    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        list(pool.map(bring_up, todo))


def _served(
    live: Topology, lay: Layout, nodes: dict[str, TritonNode], ios: list[ModelIO], options: dict
) -> ServedPlan:
    """What the router needs to serve a calibrated topology on these nodes."""
    return ServedPlan.of(
        live,
        make_data_plane(options["plane"], live, wake_guard_us=options["wake_guard_us"]),
        lay.pool_partition,
        {v: nodes[n].grpc_url for v, n in lay.vgpu_node.items()},
        ios,
    )


def model_io(topo: Topology, lay: Layout, parts: dict[str, PartitionFile]) -> list[ModelIO]:
    ios = []
    for m in topo.models:
        pipe = topo.pipelines[m.pipelines[0]]
        first = parts[lay.pool_partition[pipe.pools[0]]]
        last = parts[lay.pool_partition[pipe.pools[-1]]]
        ios.append(ModelIO(m.name, first.inputs, last.outputs))
    return ios


def calibrate(
    topo: Topology,
    lay: Layout,
    nodes: dict[str, TritonNode],
    parts: dict[str, PartitionFile],
    reps: int = 5,
    known: dict[tuple, float] | None = None,
) -> dict[int, tuple[float, ...]]:
    """Each pool's latency at every batch size as the router sees it: one stage call over
    gRPC to a node of the pool (compute plus the call's own cost), median of `reps`.
    `known` (updated in place) holds earlier measurements by (device, model, blocks, batch):
    a rollout measures only partitions the serving plan does not already run."""
    import tritonclient.grpc as grpcclient

    from triton_backend.repository import kserve_dtype

    measured = known if known is not None else {}
    out: dict[int, tuple[float, ...]] = {}
    for pool in topo.pools:
        name = lay.pool_partition[pool.id]
        node = nodes[lay.vgpu_node[pool.vgpus[0]]]
        part = parts[name]
        client = grpcclient.InferenceServerClient(node.grpc_url)
        lats = [float("nan")]
        rng = np.random.default_rng(0)
        for b in range(1, len(pool.latency_us)):
            key = (node.device, part.model, part.start, part.end, b)
            if key not in measured:
                inputs = []
                for t in part.inputs:
                    x = rng.standard_normal((b, *t.dims)).astype(t.dtype)
                    i = grpcclient.InferInput(t.name, list(x.shape), kserve_dtype(x.dtype))
                    i.set_data_from_numpy(x)
                    inputs.append(i)
                times = []
                for r in range(reps + 1):
                    t0 = time.perf_counter()
                    client.infer(name, inputs)
                    if r:
                        times.append((time.perf_counter() - t0) * 1e6)
                measured[key] = float(np.median(times))
            lats.append(measured[key])
        client.close()
        out[pool.id] = tuple(lats)
    return out


@dataclass(frozen=True)
class RolloutResult:
    status: str  # "done" or "rolled back"
    reason: str
    plan_from: str
    plan_to: str
    prepare_s: float  # rendering, loading and calibrating while the old plan serves
    downtime_ms: float  # intake paused
    held: int  # requests that arrived during the switch (served after it)
    failed: int  # requests the flush could not finish (answered with an error)


@dataclass
class Deployment:
    plan: Plan
    topo: Topology
    layout: Layout
    nodes: dict[str, TritonNode]
    core: RouterCore
    workspace: Path
    ios: list[ModelIO]
    options: dict
    generation: int = 0
    http_port: int = 0
    grpc_port: int = 0
    triton: object | None = field(default=None, repr=False)
    control: Callable[[dict], dict] | None = field(default=None, repr=False)
    calibration: dict[tuple, float] = field(default_factory=dict, repr=False)
    warmed: int = 0  # warm-up requests answered at start-up (one per router instance)

    @classmethod
    def up(
        cls,
        plan: Plan,
        warehouse: str | Path | None,
        workspace: Path,
        *,
        plane: str = "reservation",
        router_instances: int = 8,
        max_batch: int = 8,
        wake_guard_us: float = 5000.0,
        reply_margin_us: float = REPLY_MARGIN_US,
        control: Callable[[dict], dict] | None = None,
    ) -> Deployment:
        """`control`: answers JSON commands sent to the router's `poolpipe_control` model
        (rollouts and statistics from other processes); none when not given.
        `router_instances`: requests the router takes at once (more wait in Triton's queue,
        where the router cannot see them yet). `reply_margin_us`: held back from every
        request's deadline for its way in and out through PyTriton and gRPC."""
        workspace = Path(workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        options = {
            "plane": plane,
            "max_batch": max_batch,
            "wake_guard_us": wake_guard_us,
            "reply_margin_us": reply_margin_us,
        }
        nodes: dict[str, TritonNode] = {}
        dep: Deployment | None = None
        triton_home(workspace)  # once, before the nodes start side by side
        try:
            topo, lay, parts = _prepare(plan, warehouse, workspace, "g0")
            _place(lay, parts, nodes, workspace, max_batch, loaded=[], started=[])
            ios = model_io(topo, lay, parts)
            known: dict[tuple, float] = {}
            live = with_latencies(topo, calibrate(topo, lay, nodes, parts, known=known))
            core = RouterCore(
                _served(live, lay, nodes, ios, options), reply_margin_us=reply_margin_us
            ).start()
            dep = cls(plan, topo, lay, nodes, core, workspace, ios, options, control=control)
            dep.calibration = known
            dep._serve(router_instances)
            return dep
        except BaseException:
            if dep is not None:
                dep.down()
            else:
                stop_nodes(list(nodes.values()))
            raise

    def rollout(
        self, plan: Plan, warehouse: str | Path | None, flush_timeout_s: float | None = None
    ) -> RolloutResult:
        """Move to `plan` with pipeline-flush migration: load the new partition models on
        every node while the old ones serve, pause intake, flush, switch, resume, unload the
        old models. A failure before the switch unloads what was loaded and keeps the old
        plan serving; the result says why."""
        tag = f"g{self.generation + 1}"
        names = lambda p: ",".join(m.name for m in p.models)  # noqa: E731
        label_from = f"{self.plan.strategy}:{names(self.plan)}@gen{self.generation}"
        label_to = f"{plan.strategy}:{names(plan)}@gen{self.generation + 1}"
        loaded: list[tuple[TritonNode, str]] = []
        started: list[TritonNode] = []
        t0 = time.perf_counter()
        try:
            topo, lay, parts = _prepare(plan, warehouse, self.workspace, tag, isolated=True)
            served = {io.name: io for io in self.ios}
            ios = model_io(topo, lay, parts)
            for io in ios:
                if io.name not in served:
                    raise PoolpipeError(
                        f"the new plan serves {io.name}, which this router does not; "
                        "start a new router for new models (poolpipe serve)"
                    )
                if io != served[io.name]:
                    raise PoolpipeError(f"{io.name}: the new plan's tensors differ")
            _place(
                lay, parts, self.nodes, self.workspace, self.options["max_batch"], loaded, started
            )
            live = with_latencies(
                topo, calibrate(topo, lay, self.nodes, parts, known=self.calibration)
            )
        except Exception as exc:
            for node, partition in loaded:
                with contextlib.suppress(Exception):
                    node.unload(partition)
            stop_nodes(started)
            for node in started:
                self.nodes.pop(node.name, None)
            return RolloutResult(
                "rolled back", str(exc), label_from, label_to, time.perf_counter() - t0, 0, 0, 0
            )
        prepare_s = time.perf_counter() - t0
        slo_s = max(m.slo_us for m in topo.models) / 1e6
        res = self.core.switch(
            _served(live, lay, self.nodes, ios, self.options),
            flush_timeout_s if flush_timeout_s is not None else 2 * slo_s + 1.0,
        )
        old = self.layout
        self.plan, self.topo, self.layout = plan, topo, lay
        self.generation += 1
        for p in old.placements:
            with contextlib.suppress(Exception):
                self.nodes[p.node].unload(p.partition)
        idle = [n for name, n in self.nodes.items() if name not in {s.name for s in lay.nodes}]
        stop_nodes(idle)
        for n in idle:
            self.nodes.pop(n.name)
        return RolloutResult(
            "done",
            "",
            label_from,
            label_to,
            prepare_s,
            res["downtime_us"] / 1e3,
            int(res["held"]),
            int(res["failed"]),
        )

    def simulate(
        self,
        arrivals_s: np.ndarray,
        duration_s: float,
        stage_factors: Sequence[Sequence[float]] = (),
        models: np.ndarray | None = None,
    ) -> SimResult:
        """The simulator's prediction for these arrivals (seconds; model indexes, default all
        the first) on what this deployment serves: the router's calibrated topology, the same
        data plane, wake guard and reply margin, and stage times drawn from `stage_factors`
        (per pool, measured / reserved, from `core.take_stage_factors()` of earlier runs)."""
        from poolpipe.sim.engine import SimConfig, Simulator

        topo = self.core.topo
        arrivals = np.asarray(arrivals_s, dtype=float)
        plane = make_data_plane(
            self.options["plane"], topo, wake_guard_us=self.options["wake_guard_us"]
        )
        return Simulator(
            topo,
            plane,
            arrivals * 1e6,
            np.zeros(len(arrivals), dtype=int) if models is None else models,
            SimConfig(
                duration_s=duration_s,
                stage_factors=tuple(tuple(f) for f in stage_factors),
                reply_margin_us=self.options["reply_margin_us"],
            ),
        ).run()

    def restart_node(self, name: str) -> None:
        """Start a stopped or crashed node again on its ports with its partition models;
        the router notices it answering and puts its vGPUs back in service."""
        node = self.nodes[name]
        node.stop()
        node.start()
        for p in self.layout.placements:
            if p.node == name:
                node.load(p.partition)

    def _serve(self, instances: int, attempts: int = 5) -> None:
        # PyTriton 0.7 has a start-up race between a model's instances (instance k may
        # connect to instance 0's handshake socket between its bind and its listen, and the
        # load fails with "Connection refused"); a fresh start is the cure.
        for attempt in range(1, attempts + 1):
            try:
                self._start_pytriton(instances)
                return
            except Exception as exc:
                if attempt == attempts or "handshake" not in str(exc):
                    raise
                logging.getLogger(__name__).warning(
                    "router start-up hit PyTriton's handshake race; starting again"
                )

    def _start_pytriton(self, instances: int) -> None:
        fix_this_process()
        _lengthen_pytriton_handshake()
        from pytriton.model_config import ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        self.http_port, self.grpc_port, metrics = free_ports(3)
        triton = Triton(
            config=TritonConfig(
                http_address="127.0.0.1",
                http_port=self.http_port,
                grpc_address="127.0.0.1",
                grpc_port=self.grpc_port,
                metrics_port=metrics,
                exit_timeout_secs=2,
            ),
        )  # PyTriton's own short workspace path: its Unix sockets must fit in 108 bytes
        try:
            for io in self.ios:
                triton.bind(
                    model_name=io.name,
                    infer_func=[router_callable(self.core, io)] * instances,
                    inputs=[
                        Tensor(name=t.name, dtype=t.dtype, shape=(-1, *t.dims)) for t in io.inputs
                    ],
                    outputs=[
                        Tensor(name=t.name, dtype=t.dtype, shape=(-1, *t.dims)) for t in io.outputs
                    ],
                    config=ModelConfig(batching=False),
                    strict=True,
                )
            if self.control is not None:
                triton.bind(
                    model_name=CONTROL_MODEL,
                    infer_func=control_callable(self.control),
                    inputs=[Tensor(name="command", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="result", dtype=bytes, shape=(1,))],
                    config=ModelConfig(batching=False),
                )
            triton.run()
        except BaseException:
            triton.stop()
            raise
        self.triton = triton
        self._warm_up(instances)

    def _warm_up(self, instances: int) -> None:
        """One request per router instance, all at once, so that each instance has served
        before any client does: a PyTriton instance's first call costs about 40 ms more
        (measured: with 32 instances, 21 of the first 300 requests over 30 ms, then none).
        Then the router's statistics start from zero."""
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio

        from triton_backend.repository import kserve_dtype

        async def warm() -> int:
            client = grpcaio.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
            try:
                calls = []
                for io in self.ios:
                    slo_us = self.core.topo.models[self.core.topo.model_index(io.name)].slo_us
                    inputs = []
                    for t in io.inputs:
                        i = grpcclient.InferInput(t.name, [1, *t.dims], kserve_dtype(t.dtype))
                        i.set_data_from_numpy(np.zeros((1, *t.dims), t.dtype))
                        inputs.append(i)
                    params = {"slo_ms": 10 * slo_us / 1e3}  # no drop for lack of time
                    calls += [
                        client.infer(io.name, inputs, parameters=params) for _ in range(instances)
                    ]
                answers = await asyncio.gather(*calls, return_exceptions=True)
                return sum(not isinstance(a, BaseException) for a in answers)
            finally:
                await client.close()

        with ThreadPoolExecutor(1) as pool:  # asyncio.run needs a thread without a loop
            self.warmed = pool.submit(asyncio.run, warm()).result()
        self.core.reset_stats()

    def down(self) -> None:
        if self.triton is not None:
            self.triton.stop()  # type: ignore[attr-defined]
            self.triton = None
        self.core.stop()
        stop_nodes(list(self.nodes.values()))

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def router_callable(core: RouterCore, io: ModelIO):
    """The PyTriton inference callable of one served model (one client request per call)."""

    async def infer(requests):
        responses = []
        for req in requests:
            slo_ms = req.parameters.get("slo_ms") if req.parameters else None
            futures = core.submit(
                io.name,
                {t.name: req[t.name] for t in io.inputs},
                float(slo_ms) * 1e3 if slo_ms is not None else None,
            )
            rows = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            responses.append(
                {t.name: np.concatenate([r[t.name] for r in rows]) for t in io.outputs}
            )
        return responses

    return infer


def control_callable(handle: Callable[[dict], dict]):
    """PyTriton callable of the control model: one JSON command in, one JSON result out."""

    def infer(requests):
        out = []
        for req in requests:
            raw = req["command"].reshape(-1)[0]
            try:
                result = handle(json.loads(raw.decode() if isinstance(raw, bytes) else raw))
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            out.append({"result": np.array([json.dumps(result).encode()], dtype=object)})
        return out

    return infer


_HANDSHAKE_PATCHES = (
    (b"timeout_s: float = 1.0", b"timeout_s: float = 60.0"),
    (
        b"""        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.0, should_stop_before_s - time.time()))
        sock.connect(socket_path.as_posix())
""",
        b"""        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.0, should_stop_before_s - time.time()))
            try:
                sock.connect(socket_path.as_posix())
                break
            except ConnectionRefusedError:
                sock.close()
                if time.time() >= should_stop_before_s:
                    raise
                time.sleep(0.01)
""",
    ),
)


def _lengthen_pytriton_handshake() -> None:
    """PyTriton 0.7 gives a model's instances 1 s and a single connection attempt to fetch
    their configuration from instance 0, which starts alongside them: with many instances on
    few cores, instance 0 has created its socket but is not listening yet, and the model
    fails to load ("Connection refused"). The proxy file PyTriton sends to Triton gets a
    60 s timeout and retries the connection. A no-op where the code differs."""
    from pytriton.models import model as ptmodel

    original = ptmodel.Model.get_proxy_model_files
    if getattr(original, "_poolpipe", False):
        return

    def patched(self):
        files = original(self)
        for key, content in files.items():
            if key.endswith("communication.py") and all(
                old in content for old, _ in _HANDSHAKE_PATCHES
            ):
                for old, new in _HANDSHAKE_PATCHES:
                    content = content.replace(old, new)
                files[key] = content
        return files

    patched._poolpipe = True  # type: ignore[attr-defined]
    ptmodel.Model.get_proxy_model_files = patched
