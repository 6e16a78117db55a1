"""The emulation checked against a real GPU (scripts/bench_gpu.py, testbed/gpu.py).

The plans from block profiles need nothing; the GPU stages need PyTorch (not a dependency
of the project: where it is missing those tests skip). Without CUDA they run the same code
eagerly on the CPU, so what is checked is the bookkeeping, not the times: every request
through the router's executor over the pipeline's two workers gets the whole model's
logits, and an emulated stage never ends before its profiled time."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plans_from_block_profiles_cut_where_the_slower_stage_is_fastest():
    b = bench_gpu()
    # 4 blocks, batches 1..3 (µs); share 2 twice as slow
    one = [[100, 150, 200], [400, 700, 1000], [300, 500, 700], [50, 60, 70]]
    two = [[2 * x for x in row] for row in one]
    plans = b.plans({1: one, 2: two}, slo_factor=4.0)
    whole, pipe = plans["whole"], plans["pipe"]
    assert whole["slo_us"] == pytest.approx(4 * 850)
    assert whole["stages"][0]["latency_us"] == [850, 1410, 1970]
    assert whole["batch"] == 2  # 1410 fits half the SLO (1700), 1970 does not
    # at batch 3 the pipe's stages: cut after block 1 gives max(2400, 1540); after 0:
    # max(400, 4540); after 2: max(3800, 140): block 1 is the cut
    assert [(s["first"], s["last"], s["share"]) for s in pipe["stages"]] == [(0, 1, 2), (2, 3, 2)]
    assert pipe["stages"][0]["latency_us"] == [1000, 1700, 2400]
    assert pipe["batch"] == 1  # 1000 + 700 fits 1700
    assert pipe["throughput"] == pytest.approx(
        pipe["batch"] / max(s["latency_us"][pipe["batch"] - 1] for s in pipe["stages"]) * 1e6
    )
    topo = b.topology("pipe", pipe, "H100")
    assert [p.latency_us[1:] for p in topo.pools] == [(1000, 1700, 2400), (700, 1120, 1540)]
    assert math.isnan(topo.pools[0].latency_us[0]) and topo.gpu_counts == {"H100": 1}


def test_stage_accuracy_counts_a_stage_late_beyond_the_tolerance():
    b = bench_gpu()
    plan = {"stages": [{"latency_us": [1_000.0, 20_000.0]}]}
    got = b.stage_accuracy(
        [("p0", 1, 1_299.0), ("p0", 1, 1_301.0), ("p0", 2, 20_350.0), ("p0", 2, 20_450.0)], plan
    )
    assert got["calls"] == 4 and got["late_share"] == 0.5  # 0.3 ms; then 2% of 20 ms
    assert got["mean_batch"] == 1.5


def test_gpu_stages_serve_the_whole_models_answers_through_the_router():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (GPU machines have it)")
    from testbed.gpu import Gpu, GpuStages, Part, Worker, profile_blocks

    b = bench_gpu()
    gpu = Gpu.open(image=32)
    batches = [1, 2]
    workers = [Worker(gpu, batches) for _ in range(2)]
    try:
        profiles = {s: profile_blocks(workers[:s], batches, s, reps=2, warm=1) for s in (1, 2)}
        assert [len(r) for r in profiles[2]] == [2] * 6 and all(
            x > 0 for r in profiles[1] for x in r
        )
        plan = b.plans(profiles, slo_factor=1e4)["pipe"]  # generous: nothing here is timed
        topo = b.topology("pipe", plan, gpu.name)
        parts = {
            "p0": Part(plan["stages"][0]["first"], plan["stages"][0]["last"], "out_0"),
            "p1": Part(plan["stages"][1]["first"], plan["stages"][1]["last"], "y"),
        }
        nodes = {"vgpu0": workers[0], "vgpu1": workers[1]}
        times = np.arange(12) * 0.01
        made: list[GpuStages] = []

        def real(loop):
            made.append(GpuStages(loop, nodes, parts, max_batch=2))
            return made[-1]

        got = b.serve(topo, plan, real, times, wake_guard_us=1_000.0)
        assert got["on_time"] == 12 and got["dropped"] == 0, got
        assert made[0].checked == 12 and made[0].worst < 1e-4 * (
            1 + float(made[0].reference.abs().max())
        )
        assert not made[0].maps  # every feature map taken by the next stage
        assert {c[0] for c in got["calls"]} == {"p0", "p1"}

        lat = {m: plan["stages"][k]["latency_us"] for k, m in enumerate(parts)}

        def emulated(loop):
            made.append(GpuStages(loop, nodes, parts, max_batch=2, emulate=lat))
            return made[-1]

        got = b.serve(topo, plan, emulated, times, wake_guard_us=1_000.0)
        assert got["on_time"] == 12, got
        for model, rows, took in got["calls"]:  # never before its profiled time
            assert took >= lat[model][rows - 1] - 1.0
        assert torch.is_tensor(made[0].reference)
    finally:
        for w in workers:
            w.close()


def test_the_gpu_run_imports_without_triton_or_the_warehouse():
    """A lent GPU machine has PyTorch but neither tritonclient, PyTriton, DuckDB nor Prefect:
    what `bench_gpu.py run` imports (the router's executor, the in-process stages) must load
    there. Checked in a fresh interpreter where those packages cannot be imported."""
    code = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tritonclient", "pytriton", "duckdb", "prefect"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import bench_gpu, testbed.fake_stages, triton_backend.router.core
print("imported")
"""
    got = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0 and "imported" in got.stdout, got.stderr[-2000:]
