"""Bring a plan up on this machine: partition files, one rendered repository and one
tritonserver node per physical GPU of the plan's topology, and the router (PyTriton) in
front; and take it down again."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolpipe.deployment import Layout, layout
from poolpipe.errors import PoolpipeError
from poolpipe.partitions import PartitionFile, make_partition
from poolpipe.plan import Plan
from poolpipe.scheduler import build_topology, make_data_plane
from poolpipe.scheduler.topology import Topology, with_latencies
from poolpipe.warehouse import Warehouse
from triton_backend.env import fix_this_process, free_ports, triton_home
from triton_backend.nodes import TritonNode, stop_nodes
from triton_backend.repository import render_partition
from triton_backend.router import ModelIO, RouterCore

_CPU = re.compile(r"^cpu-(\d+)t$")


def threads_of(device: str) -> int:
    m = _CPU.match(device)
    if not m:
        raise PoolpipeError(
            f"device type {device!r} is not a CPU class (cpu-<threads>t); GPU node types need "
            "a GPU node running Triton's onnxruntime or tensorrt backend"
        )
    return int(m.group(1))


def build_partitions(
    plan: Plan, wh: Warehouse, lay: Layout, out_dir: Path
) -> dict[str, PartitionFile]:
    parts: dict[str, PartitionFile] = {}
    for p in lay.placements:
        if p.partition in parts:
            continue
        whole = wh.whole_model_file(p.model)
        if whole is None or not whole.is_file():
            raise PoolpipeError(
                f"model {p.model} has no onboarded files; run: poolpipe onboard MODEL.onnx "
                f"--name {p.model}"
            )
        parts[p.partition] = make_partition(
            whole, p.model, wh.block_layers(p.model), p.start, p.end, out_dir
        )
    return parts


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
) -> dict[int, tuple[float, ...]]:
    """Each pool's latency at every batch size as the router sees it: one stage call over
    gRPC to a node of the pool (compute plus the call's own cost), median of `reps`."""
    import tritonclient.grpc as grpcclient

    from triton_backend.router import _triton_type

    measured: dict[tuple[str, int], float] = {}
    out: dict[int, tuple[float, ...]] = {}
    for pool in topo.pools:
        name = lay.pool_partition[pool.id]
        node = nodes[lay.vgpu_node[pool.vgpus[0]]]
        part = parts[name]
        client = grpcclient.InferenceServerClient(node.grpc_url)
        lats = [float("nan")]
        rng = np.random.default_rng(0)
        for b in range(1, len(pool.latency_us)):
            key = (f"{node.device}/{name}", b)
            if key not in measured:
                inputs = []
                for t in part.inputs:
                    x = rng.standard_normal((b, *t.dims)).astype(t.dtype)
                    i = grpcclient.InferInput(t.name, list(x.shape), _triton_type(x.dtype))
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


@dataclass
class Deployment:
    plan: Plan
    topo: Topology
    layout: Layout
    nodes: dict[str, TritonNode]
    core: RouterCore
    workspace: Path
    ios: list[ModelIO]
    http_port: int = 0
    grpc_port: int = 0
    triton: object | None = field(default=None, repr=False)

    @classmethod
    def up(
        cls,
        plan: Plan,
        warehouse: str | Path | None,
        workspace: Path,
        *,
        plane: str = "reservation",
        router_instances: int = 16,
        max_batch: int = 8,
        wake_guard_us: float = 1500.0,
        reply_margin_us: float = 2000.0,
    ) -> Deployment:
        workspace = Path(workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        with Warehouse.open(warehouse) as wh:
            profiles = {m.name: wh.load_profile(m.name) for m in plan.models}
            topo = build_topology(plan, profiles)
            lay = layout(topo)
            parts = build_partitions(plan, wh, lay, workspace / "partitions")
        nodes: dict[str, TritonNode] = {}
        dep: Deployment | None = None
        triton_home(workspace)  # once, before the nodes start side by side
        try:
            for spec in lay.nodes:
                repo = workspace / "repos" / spec.name
                shutil.rmtree(repo, ignore_errors=True)
                for p in lay.placements:
                    if p.node == spec.name:
                        render_partition(
                            parts[p.partition],
                            repo,
                            instances=p.instances,
                            threads=threads_of(spec.gpu),
                            max_batch=max_batch,
                        )
                nodes[spec.name] = TritonNode(spec.name, spec.gpu, repo, workspace)

            def bring_up(node: TritonNode) -> None:
                node.start()
                for p in lay.placements:
                    if p.node == node.name:
                        node.load(p.partition)

            with ThreadPoolExecutor(max(1, len(nodes))) as pool:
                list(pool.map(bring_up, nodes.values()))
            ios = model_io(topo, lay, parts)
            live = with_latencies(topo, calibrate(topo, lay, nodes, parts))
            core = RouterCore(
                live,
                make_data_plane(plane, live, wake_guard_us=wake_guard_us),
                lay.pool_partition,
                {v: nodes[n].grpc_url for v, n in lay.vgpu_node.items()},
                ios,
                reply_margin_us=reply_margin_us,
            ).start()
            dep = cls(plan, topo, lay, nodes, core, workspace, ios)
            dep._serve(router_instances)
            return dep
        except BaseException:
            if dep is not None:
                dep.down()
            else:
                stop_nodes(list(nodes.values()))
            raise

    def _serve(self, instances: int, attempts: int = 3) -> None:
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
            triton.run()
        except BaseException:
            triton.stop()
            raise
        self.triton = triton

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
