"""Requests entering mid-model through the live router: a real ONNX model onboarded by the
flows, streams entering at every block planned re-aligned (a real MILP), served by real
tritonserver nodes; a client's feature map at each entry block (cut from the same model
files) answered as the whole model answers its input, and bad entry input refused."""

from __future__ import annotations

import numpy as np
import pytest

from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.domain.entry import EntryStream
from poolpipe.offline.onnxgraph import session
from poolpipe.offline.partitions import make_partition
from poolpipe.offline.zoo import make_model
from poolpipe.planner.graft import GraftRequest, group_at, plan_streams
from poolpipe.store.plan_inputs import check_plan
from poolpipe.store.warehouse import Warehouse
from tests.test_serving import _grpc

pytestmark = pytest.mark.integration
BLOCKS = 4


def _sent(mod, named: dict[str, np.ndarray]) -> list:
    """KServe v2 inputs of the arrays by name (FP16 feature maps, FP32 raw inputs)."""
    out = []
    for name, a in named.items():
        i = mod.InferInput(name, list(a.shape), "FP16" if a.dtype == np.float16 else "FP32")
        i.set_data_from_numpy(a)
        out.append(i)
    return out


@pytest.fixture(scope="module")
def onboarded(prefect_api, tmp_path_factory):
    from flows.onboard import onboard_model

    tmp = tmp_path_factory.mktemp("graft")
    wh = str(tmp / "wh.duckdb")
    path = make_model("resnet50", tmp / "m.onnx", width=0.125, image=32, seed=3)
    onboard_model(str(path), "m", warehouse=wh, blocks=BLOCKS, batches=[1, 2], reps=2)
    return wh, tmp


def test_every_entry_block_through_the_router_answers_as_the_whole_model(onboarded, capsys):
    from tritonclient.utils import InferenceServerException

    from triton_backend.deploy.deployment import Deployment

    wh, tmp = onboarded
    with Warehouse.open(wh) as w:
        profile = w.load_profile("m")
        whole_path = w.whole_model_file("m")
        layers = w.block_layers("m")
    streams = tuple(EntryStream(f"cam{p}", "m", p, 3_000e3, 1.0, 3_000e3) for p in range(BLOCKS))
    cluster = Cluster("graft-local", 10.0, (GpuPool("cpu-1t", 8, 1, (1,)),))
    req = GraftRequest(streams, {"m": profile}, cluster, margin=0.3, headroom=False)
    # entries 1 and 2 re-aligned at 2 (an alignment part [1, 2) and a shared suffix [2, 4))
    groups = [group_at(req, "m", e) for e in ((0,), (1, 2), (3,))]
    doc, _ = plan_streams(req, "realigned", groups=groups).document()
    with Warehouse.open(wh) as w:  # what poolpipe serve checks: segments of a model it has
        check_plan(w, doc)
    assert {m.name for m in doc.models} == {"m", "m.1-2", "m.2-4", "m.3-4"}
    assert doc.meta["apps"]["cam1"]["parts"] == {"m.1-2": "m.1-2", "m.2-4": "m.2-4"}
    dep = Deployment.up(doc, wh, tmp / "ws")
    try:
        mod, client = _grpc(dep)
        x = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
        (want,) = session(whole_path).run(None, {"input": x})
        scale = np.abs(want).max()
        for p in range(BLOCKS):
            if p == 0:
                inputs = {"input": x}
            else:  # the client's blocks [0, p), cut from the same files as the server's
                head = make_partition(whole_path, "client", layers, 0, p, tmp / "client")
                fmap = session(head.path).run(None, {"input": x})
                inputs = {f"in_{k}": a for k, a in enumerate(fmap)}
            io = dep.core.apps.ios[f"cam{p}"]
            assert [t.name for t in io.inputs] == list(inputs)
            got = client.infer(f"cam{p}", _sent(mod, inputs)).as_numpy(io.outputs[0].name)
            assert got.shape == want.shape
            assert np.abs(got - want).max() / scale < 2e-2, p  # fp16 between stages
        # the shared suffix served both entries re-aligned into it
        stats = dep.core.stats
        assert stats["m.2-4"].on_time == 2 and stats["m.1-2"].on_time == 1
        # each batch's members recorded by stream (one request at a time: batches of one)
        members = dep.core.batch_members()
        assert members["m.2-4"]["members"] == {"cam1": 1, "cam2": 1}, members
        assert members["m.1-2"]["members"] == {"cam1": 1} and members["m"]["batches"] == 1
        # the client's budget left is the request's deadline: a long one answered, one no
        # pipeline meets even idle refused (the fix named) before anything runs
        sent = _sent(mod, inputs)  # entry 3's feature map
        kept = client.infer("cam3", sent, parameters={"slo_ms": 2500})
        assert kept.as_numpy(io.outputs[0].name).shape == want.shape
        before = stats["m.3-4"].arrivals
        with pytest.raises(InferenceServerException, match="too short for this plan") as refused:
            client.infer("cam3", sent, parameters={"slo_ms": 0.01})
        assert "send slo_ms of at least" in str(refused.value)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value.status()
        assert stats["m.3-4"].arrivals == before
        # a feature map of the wrong shape is refused before anything runs
        bad = mod.InferInput("in_0", [1, 3, 32, 32], "FP16")
        bad.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float16))
        with pytest.raises(InferenceServerException, match="in_0"):
            client.infer("cam2", [bad])
        assert stats["m.2-4"].arrivals == 2 and stats["cam3"].arrivals == 2
        # the hybrid client: its blocks timed here, an entry the plan serves, the answer
        from poolpipe.client.hybrid import HybridClient, doors

        gates = doors(doc.meta, "m")
        assert gates == {p: f"cam{p}" for p in range(BLOCKS)}
        table = next(iter(profile.tables.values()))
        hybrid = HybridClient(
            f"127.0.0.1:{dep.grpc_port}",
            whole_path,
            layers,
            gates,
            table.latency_us[:, 0],
            3_000e3,
            tmp / "hybrid",
            margin=0.3,
        )
        try:
            hybrid.measure({"input": x})
            assert all(t > 0 for t in hybrid.client_us[: BLOCKS - 1])
            for uplink in (1e3, 1e12):  # bytes/s: a slow link and a fast one
                got = hybrid.infer({"input": x}, uplink)
                assert got.entry == hybrid.choose(uplink)[0] and got.door == gates[got.entry]
                (out,) = got.outputs.values()
                assert np.abs(out - want).max() / scale < 2e-2, got
            # the slow link: an entry whose feature map is least to upload
            sizes = hybrid.upload_bytes
            assert sizes[hybrid.choose(1e3)[0]] == min(sizes[:BLOCKS])
        finally:
            hybrid.close()
        # the same as a load test from the command line, against the plan file served
        from poolpipe_cli import main

        doc.save(tmp / "plan.json")
        argv = ["--warehouse", wh, "graft", "client", str(tmp / "plan.json"), "--model", "m"]
        argv += ["--router", f"127.0.0.1:{dep.grpc_port}", "--slo-ms", "3000"]
        argv += ["--requests", "6", "--rate", "20", "--workspace", str(tmp / "cli")]
        assert main(argv) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "6 requests: 6 on time (100.0%), 0 late, 0 dropped, 0 refused" in text, text
    finally:
        dep.down()


def test_the_load_replan_follows_the_entry_mix(onboarded, prefect_api):
    """Clients move to another entry point: the router watches each stream's rate (its
    status's load), and the load-replan flow's cost objective plans the streams again at
    the rates seen, with the same segments, and rolls the plan out on the running router,
    whose doors answer after it."""
    from flows.replan import load_replan
    from poolpipe.client.control import new_token_file, read_token
    from triton_backend.deploy.serving import ServingProcess

    wh, tmp = onboarded
    with Warehouse.open(wh) as w:
        profile = w.load_profile("m")
    streams = (
        EntryStream("raw", "m", 0, 3_000e3, 2.0, 3_000e3),
        EntryStream("edge", "m", 2, 3_000e3, 2.0, 3_000e3),
    )
    cluster = Cluster("graft-local", 10.0, (GpuPool("cpu-1t", 8, 1, (1,)),))
    req = GraftRequest(streams, {"m": profile}, cluster, margin=0.3, headroom=False)
    doc, _ = plan_streams(req, "realigned", groups=[group_at(req, "m", (0, 2))]).document()
    assert doc.meta["graft"]["streams"][1]["rate"] == 2.0
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(doc, label="test-graft-follow")
    token_file = tmp / "follow.token"
    new_token_file(token_file)
    server = ServingProcess(
        doc, wh, tmp / "ws-follow", plan_id=plan_id, stats_interval_s=3600, metrics_port=0,
        token=read_token(token_file),
    )  # fmt: skip
    try:
        mod, client = _grpc(server.deployment)
        ios = server.deployment.core.apps.ios
        io = ios["edge"]
        fmap = [np.zeros((1, *t.dims), t.dtype) for t in io.inputs]

        def send(door: str, arrays: list[np.ndarray]) -> None:
            named = {t.name: a for t, a in zip(ios[door].inputs, arrays, strict=True)}
            client.infer(door, _sent(mod, named))

        import time

        def watched() -> dict:  # the load watch samples once a second
            return server.status()["load"]

        deadline = time.monotonic() + 20
        while not watched().get("sampled_s") and time.monotonic() < deadline:
            time.sleep(0.25)
        for _ in range(12):  # every client now enters at block 2
            send("edge", fmap)
        while watched()["models"]["edge"]["req_s"]["60s"] == 0 and time.monotonic() < deadline:
            time.sleep(0.25)
        load = watched()["models"]
        assert set(load) == {"raw", "edge"}, load  # the streams are the load watched
        assert load["edge"]["req_s"]["60s"] > 0 and load["edge"]["envelope_req_s"] == 2.0
        gen = server.deployment.generation
        follow = load_replan(
            router=f"127.0.0.1:{server.deployment.grpc_port}", event="poolpipe.load.mix",
            why="clients moved to block 2", min_interval_s=0, objective="cost",
            warehouse=wh, token_file=str(token_file), rate_windows=["60s"],
        )  # fmt: skip
        assert follow["objective"] == "cost" and follow["rolled_out"] is True, follow
        assert follow["rates"]["raw"] == 0 and follow["rates"]["edge"] > 0
        assert server.deployment.generation == gen + 1
        served = server.deployment.plan
        rates = {st["name"]: st["rate"] for st in served.meta["graft"]["streams"]}
        # planned for the mix seen: edge at its rate x 1.2 (headroom), raw at the floor
        assert rates["edge"] == pytest.approx(follow["rates"]["edge"] * 1.2), rates
        assert rates["raw"] == pytest.approx(0.01 * 2.0), rates
        assert {m.name for m in served.models} == {m.name for m in doc.models}
        x = np.zeros((1, 3, 32, 32), np.float32)
        send("raw", [x])  # both doors answer on the new plan
        send("edge", fmap)
    finally:
        server.close()


def test_hybrid_clients_on_hosts_of_their_own_upload_over_their_links(onboarded, tmp_path):
    """Client classes in namespaces of their own (testbed/hybrid_load.py): each sends its
    feature map to the router on the cluster's network over a rate-limited link; every
    answer comes back, and a slow link's requests take at least their bytes' time on it,
    plus the client's blocks' (emulated) time."""
    from testbed.hybrid_load import ClientClass, run_clients
    from testbed.netns import EmulatedCluster, unavailable
    from triton_backend.deploy.deployment import Deployment

    if unavailable():
        pytest.skip(f"no network namespaces: {unavailable()}")
    wh, _ = onboarded
    with Warehouse.open(wh) as w:
        profile = w.load_profile("m")
    streams = (EntryStream("edge", "m", 2, 3_000e3, 1.0, 3_000e3),)
    cluster = Cluster("graft-local", 10.0, (GpuPool("cpu-1t", 8, 1, (1,)),))
    req = GraftRequest(streams, {"m": profile}, cluster, margin=0.3, headroom=False)
    doc, _ = plan_streams(req, "realigned").document()
    with EmulatedCluster(1, tmp_path / "em") as em:
        dep = Deployment.up(doc, wh, tmp_path / "ws", listen=em.router_address)
        try:
            io = dep.core.apps.ios["edge"]
            tensors = [(t.name, list(t.dims), np.dtype(t.dtype).name) for t in io.inputs]
            size = sum(np.dtype(t.dtype).itemsize * int(np.prod(t.dims)) for t in io.inputs)
            mbit = {"slow": size * 8 / 1e6 / 0.2, "fast": 1000.0}  # slow: 200 ms a map
            classes = [
                ClientClass(em.add_client(rate)[0], "edge", tensors, [0.0, 1.0, 2.0], 0.05, 3.0)
                for rate in mbit.values()
            ]
            slow, fast = run_clients(dep.grpc_url, classes, tmp_path / "clients")
        finally:
            dep.down()
    assert [o for *_, o in slow + fast] == ["ok"] * 6, (slow, fast)
    assert all(e2e >= 0.05 + 0.2 * 0.9 for _, e2e, _ in slow), slow  # tc's burst: 10% off
    assert max(e2e for _, e2e, _ in fast) < min(e2e for _, e2e, _ in slow), (slow, fast)
