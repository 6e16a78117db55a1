"""A node per server: `poolpipe node --gpus N` serves N GPUs of its host from one Triton,
and to the router each GPU is a node of its own (poolpipe/domain/gpus.py): a partition
model per GPU, named for it and placed on it, checked, taken out, refilled and drained
alone. Real processes: the node command (emulating T4s), its Triton, the router."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from poolpipe.domain.inventory import InventoryError, parse_inventory
from poolpipe.store.warehouse import Warehouse
from tests.test_emulation import BLOCK_US, SCALE, _node, _stop, t4_warehouse  # noqa: F401
from tests.test_serving import onboarded_tiny  # noqa: F401

pytestmark = pytest.mark.integration


def _inventory(grpc: str, gpus: int, down: tuple[str, ...] = ()) -> dict:
    return {
        "servers": [{"name": "s0", "bandwidth_gbps": 1}],
        "nodes": [{"name": "s0", "server": "s0", "device": "T4", "grpc": grpc, "gpus": gpus}],
        "down": list(down),
    }


def test_an_inventory_node_of_several_gpus_is_as_many_gpus_each_marked_down_alone():
    inv = parse_inventory(_inventory("10.0.0.2:8001", 4, ("s0/gpu1",)))
    assert [g.name for g in inv.gpus_by_device(live_only=True)["T4"]] == [
        "s0/gpu0", "s0/gpu2", "s0/gpu3"
    ]  # fmt: skip
    (pool,) = inv.cluster().pools
    assert (pool.count, pool.gpus_per_server) == (3, 3)
    assert "gpus = 4" in inv.to_toml()
    for down, said in (
        (("s0/gpu4",), "node s0 has GPUs s0/gpu0 .. s0/gpu3"),
        (("s0/gpux",), "not listed"),
        (("s1/gpu0",), "not listed"),
    ):
        with pytest.raises(InventoryError, match=said):
            parse_inventory(_inventory("10.0.0.2:8001", 4, down))
    for gpus in (0, -1, 1.5, True):
        with pytest.raises(InventoryError, match="is not an integer >= 1"):
            parse_inventory(_inventory("10.0.0.2:8001", gpus))
    with pytest.raises(InventoryError, match="one GPU"):
        parse_inventory(_inventory("10.0.0.2:8001", 1, ("s0/gpu0",)))


def test_bad_gpu_counts_are_refused_before_anything_starts(tmp_path):
    for bad in ("0", "-2"):
        r = subprocess.run(
            [sys.executable, "-m", "poolpipe_cli", "node", "--workspace", str(tmp_path),
             "--device", "T4", "--emulate", "--gpus", bad],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and "a node serves at least one GPU" in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.log"))  # no Triton was started


def _wait(what, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_node_of_three_gpus_serves_each_as_a_node_of_its_own(t4_warehouse, tmp_path):  # noqa: F811
    """tiny's blocks 0-2 on two vGPUs (GPUs 0 and 1), 2-4 on GPU 2, all three GPUs of one
    emulated T4 node: each GPU runs its own partition model (named and placed for it); two
    GPUs run batches at once; one GPU's model gone takes that GPU out alone, which is
    refilled and comes back; a GPU drained takes no batches while the other serves."""
    import tritonclient.grpc as tg

    from poolpipe.domain.cluster import Cluster, GpuPool
    from poolpipe.domain.plan import manual_plan
    from tests.test_serving import _grpc, _infer
    from triton_backend.deploy.deployment import Deployment
    from triton_backend.node.triton import RemoteNode

    with Warehouse.open(t4_warehouse) as w:
        profile = w.load_profile("tiny")
    cluster = Cluster("t4x3", 1.0, (GpuPool("T4", 3, 3, (1,)),))
    plan = manual_plan("tiny", 400e3, cluster, [(0, 2, "T4", 2), (2, 4, "T4", 1)], 1, profile)
    proc, grpc, said = _node(
        tmp_path, "--device", "T4", "--emulate", "--time-scale", str(SCALE), "--gpus", "3"
    )
    try:
        assert "3 x T4, EMULATED" in "".join(said)
        while not re.search(r"watch (127\.0\.0\.1:\d+)", "".join(said)):
            said.append(proc.stdout.readline())
        watch = re.search(r"watch (127\.0\.0\.1:\d+)", "".join(said)).group(1)
        table = _inventory(grpc, 3)
        table["nodes"][0]["watch"] = watch
        inv = parse_inventory(table, "node.toml")
        dep = Deployment.up(plan, t4_warehouse, tmp_path / "router", inventory=inv)
        try:
            ids = {n.name: n.node_id for n in dep.nodes.values()}
            assert sorted(ids) == ["s0/gpu0", "s0/gpu1", "s0/gpu2"]
            assert ids["s0/gpu1"] == f"{grpc}/gpu1"
            first = dep.layout.pool_partition[0]
            c = tg.InferenceServerClient(grpc)
            loaded = {m["name"] for m in c.get_inference_statistics(as_json=True)["model_stats"]}
            assert {f"{first}__gpu0", f"{first}__gpu1"} <= loaded
            assert not {first, f"{first}__gpu2"} & loaded  # one model per partition and GPU
            config = c.get_model_config(f"{first}__gpu1", as_json=True)["config"]
            assert config["parameters"]["poolpipe_gpu"]["string_value"] == "1"

            # two GPUs at once: a batch on each of GPU 0 and 1 (one vGPU each) side by side
            # end in about one stage time, not two
            x = np.zeros((1, 3, 32, 32), np.float32)
            stage_s = 2 * BLOCK_US[0] * SCALE / 1e6

            def call(gpu: int) -> None:
                i = tg.InferInput("input", [1, 3, 32, 32], "FP32")
                i.set_data_from_numpy(x)
                with tg.InferenceServerClient(grpc) as cc:
                    cc.infer(f"{first}__gpu{gpu}", [i])

            call(0), call(1)  # warm
            t0 = time.perf_counter()
            both = [threading.Thread(target=call, args=(g,)) for g in (0, 1)]
            [t.start() for t in both]
            [t.join() for t in both]
            assert time.perf_counter() - t0 < 1.8 * stage_s

            mod, client = _grpc(dep)
            for _ in range(4):
                assert _infer(mod, client, x).as_numpy(dep.ios[0].outputs[0].name).shape == (
                    1,
                    1000,
                )

            # GPU 1's model gone (its instances failed): that GPU alone leaves service,
            # the router finds it live without its models, loads them, and it returns
            gpu1 = RemoteNode("s0/gpu1", "T4", grpc, gpu=1)
            gpu1.unload(first)
            _wait("GPU 1 out", lambda: dep.core.down_nodes() == {f"{grpc}/gpu1"}, 20)
            assert [d["node"] for d in dep.down_nodes()] == ["s0/gpu1"]
            for _ in range(4):  # served on GPU 0 meanwhile
                _infer(mod, client, x)
            _wait("GPU 1 back", lambda: not dep.core.down_nodes(), 60)
            assert first in gpu1.models()

            # GPU 0 drained: no batch on it, GPU 1 serves
            before = c.get_inference_statistics(f"{first}__gpu0", as_json=True)
            out = dep.drain("s0/gpu0")
            assert out["node"] == "s0/gpu0" and dep.core.drained_nodes() == {f"{grpc}/gpu0"}
            for _ in range(6):
                _infer(mod, client, x)
            after = c.get_inference_statistics(f"{first}__gpu0", as_json=True)
            count = lambda s: int(s["model_stats"][0]["inference_count"] or 0)  # noqa: E731
            assert count(after) == count(before)
            dep.undrain("s0/gpu0")
            assert dep.core.stats["tiny"].on_time >= 14
            assert RemoteNode("s0/gpu0", "T4", grpc, gpu=0).models() == [first]

            # the node's process gone: its watch connection breaks, all three GPUs leave
            _stop(proc)
            _wait("all out", lambda: dep.core.down_nodes() == {f"{grpc}/gpu{i}" for i in range(3)})
            assert sorted(d["node"] for d in dep.down_nodes()) == [f"s0/gpu{i}" for i in range(3)]
        finally:
            dep.down()
    finally:
        _stop(proc)
