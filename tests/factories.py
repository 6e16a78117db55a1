"""Hand-built topologies and requests for stepping data planes without a plan or a clock."""

from __future__ import annotations

from collections.abc import Sequence

from poolpipe.scheduler import Request, Topology
from poolpipe.scheduler.topology import Model, Pipeline, Pool, Server, VGpu


def make_topology(
    stages: Sequence[tuple[Sequence[int], Sequence[float], float]],
    *,
    batch: int = 1,
    slo_us: float = 100.0,
    throughput: float = 100.0,
    inputs: float = 0.0,
) -> Topology:
    """One model, one pipeline. Each stage: (server of each vGPU, latency per batch 1..B,
    transfer-in µs per sample). Servers are numbered from 0 and all hold GPU type "G".
    `inputs`: the first stage's transfer-in, its requests' inputs (topology.with_inputs)."""
    return make_pipelines(
        [stages], batch=batch, slo_us=slo_us, throughput=throughput, inputs=inputs
    )


def make_pipelines(
    pipelines: Sequence[Sequence[tuple[Sequence[int], Sequence[float], float]]],
    *,
    batch: int = 1,
    slo_us: float = 100.0,
    throughput: float = 100.0,
    inputs: float = 0.0,
) -> Topology:
    """One model, a pipeline per entry, each its stages as for make_topology (every stage
    a pool of its own; the first one's transfer-in is `inputs`, its requests' inputs)."""
    servers = sorted({s for stages in pipelines for st in stages for s in st[0]})
    vgpus: list[VGpu] = []
    pools: list[Pool] = []
    pipes: list[Pipeline] = []
    for i, stages in enumerate(pipelines):
        first = len(pools)
        for d, (on, lats, tau) in enumerate(stages):
            ids = []
            for srv in on:
                ids.append(len(vgpus))
                vgpus.append(VGpu(len(vgpus), len(pools), "G", 1, len(vgpus), srv))
            pools.append(
                Pool(
                    len(pools),
                    0,
                    i,
                    d,
                    "G",
                    1,
                    d,
                    d + 1,
                    tuple(ids),
                    (float("nan"), *lats),
                    inputs if d == 0 else tau,
                )
            )
        pipes.append(Pipeline(i, 0, i, batch, tuple(range(first, len(pools))), throughput, 0.0))
    model = Model(0, "m", slo_us, 1.0, throughput, tuple(range(len(pipes))))
    return Topology(
        cluster_name="hand",
        servers=tuple(Server(s, "G", s) for s in servers),
        vgpus=tuple(vgpus),
        pools=tuple(pools),
        pipelines=tuple(pipes),
        models=(model,),
        gpu_counts={"G": len(vgpus)},
    )


def make_requests(n: int, *, start_us: float = 0.0, gap_us: float = 0.0, slo_us: float = 100.0):
    return [Request(i, 0, start_us + i * gap_us, start_us + i * gap_us + slo_us) for i in range(n)]


def dynamic_classifier(path, *, convs: int = 4, batch: int | str = "N", fixed_reshape=False):
    """An ONNX classifier as exporters write one with a dynamic image size: x [N, 3, H, W];
    the batch is read with Shape/Gather into a Reshape target that stays alive across the
    convolutions (every cut among them is crossed by that shape tensor), then Reshape to
    [N, 8, H*W], a mean, a MatMul and a Softmax. `fixed_reshape` writes the target as the
    constant [1, 8, -1], so that the model runs at batch 1 only."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits: list = []

    def init(name: str, arr) -> str:
        inits.append(numpy_helper.from_array(arr, name))
        return name

    if fixed_reshape:
        nodes = [helper.make_node("Identity", [init("t", np.array([1, 8, -1]))], ["target"])]
    else:
        nodes = [
            helper.make_node("Shape", ["x"], ["s"], name="shape"),
            helper.make_node("Gather", ["s", init("i0", np.array([0]))], ["n"], name="gather"),
            helper.make_node(
                "Concat", ["n", init("rest", np.array([8, -1]))], ["target"], name="concat", axis=0
            ),
        ]
    y, c = "x", 3
    for k in range(convs):
        w = init(f"w{k}", (rng.standard_normal((8, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32))
        nodes.append(helper.make_node("Conv", [y, w], [f"c{k}"], name=f"conv{k}", pads=[1] * 4))
        nodes.append(helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}"))
        y, c = f"r{k}", 8
    fc = init("fc", rng.standard_normal((8, 4)).astype(np.float32))
    nodes += [
        helper.make_node("Reshape", [y, "target"], ["flat"], name="reshape"),
        helper.make_node("ReduceMean", ["flat"], ["mean"], name="mean", axes=[2], keepdims=0),
        helper.make_node("MatMul", ["mean", fc], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "dynamic-classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, "H", "W"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
