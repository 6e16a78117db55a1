"""The emulation checked against a real GPU (docs/design/emulation.md): where a machine
with an NVIDIA GPU is lent, profile a model's blocks there, then serve it both really and
emulated from those profiles, and report the difference.

`run` (on the GPU machine: PyTorch, no Triton, no warehouse; writes OUT):
 1. Profile. A ResNet-50 in PyTorch (fp32 on the CUDA cores, random weights, image N x N)
    cut into six blocks; each block's time at batch 1..B, alone (share 1) and with two
    vGPUs running it at once (share 2: two streams, as two MPS shares). Written in the
    PPipe profiles' layout (block-latency/<model>-<GPU>-<share>.csv, boundary bytes).
 2. Two plans on that one GPU, from those profiles: `whole` (the model on one vGPU, share
    1) and `pipe` (two partitions, each on a vGPU of share 2, both on the GPU at once, cut
    where the slower stage is fastest at batch B). SLO: --slo-factor x the whole model's
    profiled time at batch 1. Batch: the largest whose pipeline time fits half the SLO.
 3. Each plan served by the router's own executor (RouterCore: `poolpipe serve`'s data
    plane, runtime and relay transport; no Triton front end, no network): once on the
    real GPU (testbed/gpu.py: each vGPU a worker with its own stream and CUDA graphs) and
    once on emulated stages (each asleep until its start + the profiled latency of its
    blocks, as `poolpipe node --emulate` keeps time), at 1/3, 2/3 and 1 x the simulated
    capacity, on the same Poisson traces; and simulated on those traces.
 Written: OUT/result.json and the profile CSVs.

`report DIR`: a run's tables (stage times real vs profiled; attainment real, emulated,
simulated), stored in the warehouse (bench_serving, bench "gpu").

    python3 scripts/bench_gpu.py run --out OUT [--image 448] [--max-batch 8]
        [--duration 6] [--slo-factor 5]                   # on the GPU machine
    ./run bench-gpu report OUT                            # here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "resnet50"
LOADS = (1 / 3, 2 / 3, 1.0)
TOLERANCE = (300.0, 0.02)  # a stage beyond max(0.3 ms, 2%) of its profiled time is late
TARGET = 0.99  # capacity: the largest rate with this share on time (simulated)


# ------------------------------------------------------------------ plans from profiles


def stage_table(table: list[list[float]], first: int, last: int) -> list[float]:
    """A partition's time per batch 1..B: the sum of its blocks' (the planner's model)."""
    return [sum(table[b][i] for b in range(first, last + 1)) for i in range(len(table[0]))]


def plans(profiles: dict[int, list[list[float]]], slo_factor: float) -> dict[str, dict]:
    """`whole` and `pipe` from the block profiles (share -> [block][batch-1] µs)."""
    blocks = len(profiles[1])
    whole = stage_table(profiles[1], 0, blocks - 1)
    slo = slo_factor * whole[0]
    top = len(whole)
    best = min(
        range(blocks - 1),
        key=lambda c: max(
            stage_table(profiles[2], 0, c)[top - 1],
            stage_table(profiles[2], c + 1, blocks - 1)[top - 1],
        ),
    )
    out = {
        "whole": {"slo_us": slo, "stages": [{"first": 0, "last": blocks - 1, "share": 1}]},
        "pipe": {
            "slo_us": slo,
            "stages": [
                {"first": 0, "last": best, "share": 2},
                {"first": best + 1, "last": blocks - 1, "share": 2},
            ],
        },
    }
    for plan in out.values():
        for st in plan["stages"]:
            st["latency_us"] = stage_table(profiles[st["share"]], st["first"], st["last"])
        fits = [
            b
            for b in range(1, top + 1)
            if sum(st["latency_us"][b - 1] for st in plan["stages"]) <= slo / 2
        ]
        plan["batch"] = b = max(fits) if fits else 1
        plan["throughput"] = b / max(st["latency_us"][b - 1] for st in plan["stages"]) * 1e6
    return out


def topology(name: str, plan: dict, gpu: str) -> Any:
    from poolpipe.scheduler.topology import Model, Pipeline, Pool, Server, Topology, VGpu

    stages = plan["stages"]
    b = plan["batch"]
    vgpus = tuple(VGpu(k, k, gpu, st["share"], 0, 0) for k, st in enumerate(stages))
    pools = tuple(
        Pool(
            k,
            0,
            0,
            k,
            gpu,
            st["share"],
            st["first"],
            st["last"] + 1,
            (k,),
            (math.nan, *st["latency_us"]),
            0.0,
        )
        for k, st in enumerate(stages)
    )
    latency = sum(st["latency_us"][b - 1] for st in stages)
    pipe = Pipeline(0, 0, 0, b, tuple(range(len(stages))), plan["throughput"], latency)
    model = Model(0, MODEL, plan["slo_us"], 1.0, plan["throughput"], (0,))
    return Topology(
        f"one-{gpu}-{name}", (Server(0, gpu, 0),), vgpus, pools, (pipe,), (model,), {gpu: 1}
    )


def arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration_s * 1.5) + 20)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return t[t < duration_s]


def simulate(
    topo: Any,
    times_s: np.ndarray,
    duration_s: float,
    margin_us: float,
    served: dict[str, Any] | None = None,
) -> Any:
    """The simulator on these arrivals: stage times as profiled, or, given a live run's
    figures (`served`, from serve()), as that run measured them (each stage's time drawn
    from its measured / reserved factors), with its reply margin and wake guard floor."""
    from poolpipe.scheduler import make_data_plane
    from poolpipe.sim.engine import SimConfig, Simulator

    if served is None:
        dp = make_data_plane("reservation", topo)
        cfg = SimConfig(duration_s=duration_s, reply_margin_us=margin_us)
    else:
        dp = make_data_plane("reservation", topo, wake_guard_us=served["wake_guard_us"])
        cfg = SimConfig(
            duration_s=duration_s,
            reply_margin_us=served["reply_margin_us"],
            stage_factors=served["stage_factors"],
            recalibrate=served["recalibrate"],
        )
    res = Simulator(topo, dp, times_s * 1e6, np.zeros(len(times_s), np.int64), cfg).run()
    return res.models[0]


def sim_capacity(topo: Any, duration_s: float, margin_us: float, seed: int) -> float:
    """The largest Poisson rate the simulator serves >= TARGET on time (bisection)."""
    hi = topo.models[0].throughput * 1.5
    lo = 0.0
    for _ in range(12):
        mid = (lo + hi) / 2
        ok = simulate(topo, arrivals(mid, duration_s, seed), duration_s, margin_us).attainment
        lo, hi = (mid, hi) if ok >= TARGET else (lo, mid)
    return lo


# ------------------------------------------------------------------ serving


def serve(
    topo: Any,
    plan: dict,
    stages_factory: Any,
    times_s: np.ndarray,
    wake_guard_us: float,
    gc_freeze: bool = True,
) -> dict[str, Any]:
    """Serve `times_s` (seconds from now) through a RouterCore; the client's account, and
    the full collections the process made meanwhile (each stops the router's loop).
    `gc_freeze` False thaws what RouterCore.start froze (the A/B of --no-gc-freeze)."""
    import gc

    from poolpipe.offline.partitions import TensorSpec
    from poolpipe.runtime import MarginMeter
    from poolpipe.scheduler import make_data_plane
    from triton_backend.router.core import RouterCore
    from triton_backend.router.served import ModelIO, served_plan

    i64 = np.dtype(np.int64)
    io = ModelIO(MODEL, (TensorSpec("x", i64, (1,)),), (TensorSpec("y", i64, (1,)),))
    n = len(plan["stages"])
    served = served_plan(
        topo,
        make_data_plane("reservation", topo, wake_guard_us=wake_guard_us),
        {k: f"p{k}" for k in range(n)},
        {k: f"vgpu{k}" for k in range(n)},
        [io],
    )
    made: list[Any] = []

    def factory(loop: asyncio.AbstractEventLoop) -> Any:
        made.append(stages_factory(loop))
        return made[0]

    core = RouterCore(served, stage_timeout_s=10.0, margin=MarginMeter(), stages=factory).start()
    if not gc_freeze:
        gc.unfreeze()
    full_ms: list[float] = []
    began = [0]

    def collected(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter_ns()
            else:
                full_ms.append((time.perf_counter_ns() - began[0]) / 1e6)

    gc.callbacks.append(collected)
    slo_ns = plan["slo_us"] * 1e3
    done: list[tuple[int, int, str | None]] = []  # (arrived, answered, code)
    reasons: Counter[str] = Counter()  # why requests were not served
    x = np.zeros((1, 1), np.int64)

    def answered(arrived: int, outs: Any, code: str | None, msg: str) -> None:
        done.append((arrived, time.monotonic_ns(), code))
        if code is not None:
            reasons[msg.split(": ", 1)[-1]] += 1

    def take(due: int) -> None:  # on the router's loop, as the door hands it a request
        try:
            core.take(MODEL, [x], None, due, partial(answered, due))
        except Exception as exc:  # refused at the door: dropped
            done.append((due, due, "REFUSED"))
            reasons[f"refused: {exc}"] += 1

    def feed() -> None:
        """Each request handed to the loop at its time from a thread of its own (as a
        socket wakes the loop), not by the loop's timers: those round a wait up to the
        millisecond (epoll), which made arrivals 0.55 ms late at p50."""
        t0 = time.monotonic_ns() + 20_000_000
        for t in times_s:
            due = t0 + int(t * 1e9)
            left = due - time.monotonic_ns()
            if left > 0:
                time.sleep(left / 1e9)
            core.loop.call_soon_threadsafe(take, due)

    cpu0 = time.process_time()
    feed()
    deadline = time.monotonic() + 15
    while len(done) < len(times_s) and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu = time.process_time() - cpu0
    gc.callbacks.remove(collected)
    factors = core.take_stage_factors()
    margin_us, recalibrate = core.runtime.reply_margin_us, core.runtime.config.recalibrate
    core.stop()
    stages = made[0]
    on_time = sum(1 for a, e, c in done if c is None and e - a <= slo_ns)
    answered_ = [e - a for a, e, c in done if c is None]
    calls = [(c.model, c.rows, (c.end_s - c.start_s) * 1e6) for c in stages.calls]
    return {
        "arrived": len(times_s),
        "on_time": on_time,
        "late": sum(1 for a, e, c in done if c is None and e - a > slo_ns),
        "dropped": sum(1 for _, _, c in done if c is not None),
        "unanswered": len(times_s) - len(done),
        "attainment": on_time / len(times_s) if len(times_s) else 1.0,
        "latency_p50_us": float(np.percentile(answered_, 50)) / 1e3 if answered_ else None,
        "latency_p99_us": float(np.percentile(answered_, 99)) / 1e3 if answered_ else None,
        "calls": calls,
        "process_cpu_s": cpu,
        "not_served": dict(reasons),
        "gc_full": len(full_ms),
        "gc_full_max_ms": max(full_ms, default=0.0),
        "gc_frozen": gc_freeze,
        # for the simulator on this run's stage times (not written out)
        "stage_factors": factors,
        "reply_margin_us": margin_us,
        "recalibrate": recalibrate,
        "wake_guard_us": wake_guard_us,
        "worst_logit_diff": getattr(stages, "worst", None),
        "checked_rows": getattr(stages, "checked", None),
    }


def row_line(row: dict[str, Any]) -> str:
    """One load's figures on a line: on time per mode, stage times, why not served."""
    modes = [m for m in ("real", "emulated") if m in row]
    parts = [
        "on time "
        + " ".join(f"{m} {row[m]['attainment']:.3f}" for m in modes)
        + f" simulated {row['sim_attainment']:.3f} (on the stage times measured: "
        + " ".join(f"{m} {row[m].get('sim_measured_attainment', math.nan):.3f}" for m in modes)
        + ")"
    ]
    for m in modes:
        st = row[m]["stages"]
        parts.append(
            f"{m} stages x{st.get('ratio_p50', math.nan):.3f} p50 "
            f"x{st.get('ratio_p99', math.nan):.3f} p99 of profiled"
        )
    full = [row[m].get("gc_full", 0) for m in modes]
    longest = max(row[m].get("gc_full_max_ms", 0.0) for m in modes)
    parts.append(f"full collections {' + '.join(map(str, full))}, longest {longest:.0f} ms")
    for m in modes:
        why = row[m].get("not_served") or {}
        if why:
            parts.append(f"{m} not served: " + ", ".join(f"{k} {n}" for k, n in why.items()))
    return "; ".join(parts)


def stage_accuracy(calls: list, plan: dict) -> dict[str, float]:
    """Each stage call's time against the profiled time of its partition at its batch:
    the ratio, the excess (µs) and the share late beyond max(0.3 ms, 2%)."""
    if not calls:
        return {}
    over, ratio, late = [], [], 0
    for model, rows, took in calls:
        due = plan["stages"][int(model[1:])]["latency_us"][rows - 1]
        over.append(took - due)
        ratio.append(took / due)
        late += took - due > max(TOLERANCE[0], TOLERANCE[1] * due)
    return {
        "calls": len(calls),
        "ratio_p50": float(np.percentile(ratio, 50)),
        "ratio_p99": float(np.percentile(ratio, 99)),
        "over_p50_us": float(np.percentile(over, 50)),
        "over_p99_us": float(np.percentile(over, 99)),
        "late_share": late / len(calls),
        "mean_batch": float(np.mean([c[1] for c in calls])),
    }


# ------------------------------------------------------------------ run (on the GPU)


def timer_overshoot(n: int = 300, sleep_s: float = 0.001) -> dict[str, float]:
    """How late this host wakes a sleeper (µs past 1 ms asked; p50 and p99): a thread in
    time.sleep, as an emulated stage waits, and a coroutine in asyncio.sleep, as the
    router's timers wait. Where these are large, live runs lose to the simulator by them."""
    late = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        time.sleep(sleep_s)
        late.append((time.perf_counter_ns() - t0) / 1e3 - sleep_s * 1e6)

    async def loop_late() -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            await asyncio.sleep(sleep_s)
            out.append((time.perf_counter_ns() - t0) / 1e3 - sleep_s * 1e6)
        return out

    aio = asyncio.run(loop_late())
    return {
        "sleep_p50_us": float(np.percentile(late, 50)),
        "sleep_p99_us": float(np.percentile(late, 99)),
        "asyncio_p50_us": float(np.percentile(aio, 50)),
        "asyncio_p99_us": float(np.percentile(aio, 99)),
    }


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from poolpipe import native
    from testbed.gpu import BLOCK_NAMES, Gpu, GpuStages, Part, Worker, profile_blocks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.switch_interval_us:
        # the router and the stages share this process (on a cluster: separate processes);
        # a stage thread that wakes waits at most this long for the router's GIL
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    t0 = time.perf_counter()
    gpu = Gpu.open(args.image)
    if not gpu.cuda and not args.allow_cpu:
        print(
            "bench_gpu run: no CUDA device here (torch.cuda.is_available() is False); run it "
            "where a GPU is, or pass --allow-cpu for a smoke run whose times mean nothing"
        )
        return 2
    batches = list(range(1, args.max_batch + 1))
    workers = [Worker(gpu, batches) for _ in range(2)]
    for w in workers:
        w.warm()
    print(
        f"{gpu.name}: torch {torch.__version__}, image {args.image}, batches 1..{args.max_batch}; "
        f"CUDA graphs captured in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    timers = timer_overshoot()
    print(
        "host timers, µs late past 1 ms (p50 / p99): time.sleep "
        f"{timers['sleep_p50_us']:.0f} / {timers['sleep_p99_us']:.0f}, asyncio.sleep "
        f"{timers['asyncio_p50_us']:.0f} / {timers['asyncio_p99_us']:.0f}",
        flush=True,
    )
    if args.replay:
        # another run's profiles: its plans served on emulated stages only (the host's
        # part of a device run, reproduced where no GPU is)
        was = json.loads((Path(args.replay) / "result.json").read_text())
        profiles = {int(s): t for s, t in was["profiles"].items()}
        device = was["device"]
        print(f"replaying {device}'s profiles from {args.replay}: emulated stages only")
    else:
        device = gpu.name
        profiles = {s: profile_blocks(workers[:s], batches, s, args.reps) for s in (1, 2)}
        tag = f"{MODEL}-{args.image}"
        for share, table in profiles.items():
            lines = [",".join(f"{x:.0f}" for x in row) for row in table]
            (out / f"{tag}-{device}-{share}.csv").write_text("\n".join(lines) + "\n")
        (out / f"{tag}.bytes.csv").write_text("\n".join(map(str, gpu.boundary_bytes())) + "\n")
        print(
            f"profiled in {time.perf_counter() - t0:.1f} s (share 1 / share 2, batch 1 and "
            f"{args.max_batch}, µs):",
            flush=True,
        )
        for b, name in enumerate(BLOCK_NAMES):
            p1, p2 = profiles[1][b], profiles[2][b]
            cells = f"{p1[0]:8.0f} {p1[-1]:8.0f}   {p2[0]:8.0f} {p2[-1]:8.0f}"
            print(f"  {name:7s} {cells}", flush=True)
    result: dict[str, Any] = {
        "device": device,
        "device_full": torch.cuda.get_device_name() if gpu.cuda else "cpu",
        "replayed_from": args.replay,
        "torch": torch.__version__,
        "hot_path": native.status(),
        "image": args.image,
        "max_batch": args.max_batch,
        "duration_s": args.duration,
        "wake_guard_us": args.wake_guard_us,
        "switch_interval_us": sys.getswitchinterval() * 1e6,
        "gc_freeze": not args.no_gc_freeze,
        "timers": timers,
        "profiles": {str(s): t for s, t in profiles.items()},
        "boundary_bytes": gpu.boundary_bytes(),
        "blocks": list(BLOCK_NAMES),
        "plans": plans(profiles, args.slo_factor),
        "runs": [],
    }
    for name, plan in result["plans"].items():
        topo = topology(name, plan, device)
        plan["sim_capacity"] = cap = sim_capacity(topo, args.duration, MARGIN_US, args.seed)
        cut = ", ".join(
            f"blocks {s['first']}-{s['last']} share {s['share']}" for s in plan["stages"]
        )
        print(
            f"{name}: {cut}; SLO {plan['slo_us'] / 1e3:.1f} ms, batch {plan['batch']}, "
            f"planned {plan['throughput']:.0f} req/s, simulated capacity {cap:.0f} req/s",
            flush=True,
        )
        last = len(plan["stages"]) - 1
        parts = {
            f"p{k}": Part(st["first"], st["last"], "y" if k == last else "out_0")
            for k, st in enumerate(plan["stages"])
        }
        real = partial(
            GpuStages,
            workers={f"vgpu{k}": workers[k] for k in range(len(parts))},
            parts=parts,
            max_batch=args.max_batch,
        )
        emulated = partial(
            real, emulate={m: plan["stages"][k]["latency_us"] for k, m in enumerate(parts)}
        )
        for k, load in enumerate(LOADS):
            rate = load * cap
            times = arrivals(rate, args.duration, args.seed + 1 + k)
            sim = simulate(topo, times, args.duration, MARGIN_US)
            row: dict[str, Any] = {
                "plan": name,
                "load": load,
                "rate": rate,
                "sim_attainment": sim.attainment,
            }
            modes = (("real", real), ("emulated", emulated))
            for mode, factory in modes[1:] if args.replay else modes:
                got = serve(
                    topo, plan, factory, times, args.wake_guard_us, not args.no_gc_freeze
                )
                got["stages"] = stage_accuracy(got.pop("calls"), plan)
                measured = simulate(topo, times, args.duration, MARGIN_US, got)
                got["sim_measured_attainment"] = measured.attainment
                got.pop("stage_factors")
                row[mode] = got
            result["runs"].append(row)
            print(f"  load {load:.2f} ({rate:.0f} req/s): {row_line(row)}", flush=True)
    if gpu.cuda:
        result["gpu_memory_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    for w in workers:
        w.close()
    result["wall_s"] = time.perf_counter() - t0
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'result.json'} in {result['wall_s']:.0f} s")
    return 0


MARGIN_US = 1_000.0  # the live reply margin's floor (MarginMeter), given the simulator too


# ------------------------------------------------------------------ report (here)


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from poolpipe.store.bench_rows import BenchRows
    from poolpipe.store.warehouse import Warehouse

    console = Console(width=None if sys.stdout.isatty() else 150)
    path = Path(args.dir) / "result.json"
    if not path.exists():
        console.print(
            f"[red]no result.json in {args.dir}[/red]: give the folder that "
            "`bench_gpu.py run --out` wrote"
        )
        return 2
    res = json.loads(path.read_text())
    dev = res["device"]
    if res.get("replayed_from"):
        console.print(
            f"[red]{args.dir} is a replay[/red] of {res['replayed_from']} (emulated stages only, "
            "nothing real to compare): its figures are in its result.json and the run's output"
        )
        return 2
    console.print(
        f"REAL GPU: {res['device_full']} (torch {res['torch']}); ResNet-50 fp32, "
        f"image {res['image']}, batches 1..{res['max_batch']}; router hot path "
        f"{res['hot_path']}; {res['duration_s']:g} s per trace; GIL switch interval "
        f"{res.get('switch_interval_us', 5000):.0f} µs"
    )
    if "timers" in res:
        t = res["timers"]
        console.print(
            "host timers, µs late past 1 ms (p50 / p99): time.sleep "
            f"{t['sleep_p50_us']:.0f} / {t['sleep_p99_us']:.0f}, asyncio.sleep "
            f"{t['asyncio_p50_us']:.0f} / {t['asyncio_p99_us']:.0f}"
        )
    pt = Table(title=f"Block profiles on the real {dev} (µs; median of the calls)")
    pt.add_column("block")
    top = res["max_batch"]
    for share in ("1", "2"):
        pt.add_column(f"share {share}, batch 1", justify="right")
        pt.add_column(f"share {share}, batch {top}", justify="right")
    for b, name in enumerate(res["blocks"]):
        cells = []
        for share in ("1", "2"):
            row = res["profiles"][share][b]
            cells += [f"{row[0]:,.0f}", f"{row[-1]:,.0f}"]
        pt.add_row(f"{b} {name}", *cells)
    console.print(pt)
    rows = BenchRows(args.label)
    st = Table(
        title=f"Served on the real {dev} and emulated from its profiles (same router, "
        "same traces); simulated on those traces"
    )
    for col in (
        "plan",
        "load",
        "req/s",
        "on time real",
        "emul.",
        "sim.",
        "real-emul.",
        "stage real/prof. p50",
        "p99",
        "late real",
        "late emul.",
        "batch real",
        "batch emul.",
    ):
        st.add_column(col, justify="left" if col == "plan" else "right")
    for k, run in enumerate(res["runs"]):
        r, e = run["real"], run["emulated"]
        rs, es = r["stages"], e["stages"]
        st.add_row(
            run["plan"],
            f"{run['load']:.2f}",
            f"{run['rate']:.0f}",
            f"{r['attainment']:.3f}",
            f"{e['attainment']:.3f}",
            f"{run['sim_attainment']:.3f}",
            f"{(r['attainment'] - e['attainment']) * 100:+.1f} pt",
            f"{rs.get('ratio_p50', math.nan):.3f}",
            f"{rs.get('ratio_p99', math.nan):.3f}",
            f"{rs.get('late_share', math.nan):.1%}",
            f"{es.get('late_share', math.nan):.1%}",
            f"{rs.get('mean_batch', math.nan):.2f}",
            f"{es.get('mean_batch', math.nan):.2f}",
        )
        config = f"{dev}/{run['plan']}/load{k % len(LOADS) + 1}"
        for metric, value in (
            ("rate", run["rate"]),
            ("attainment_real", r["attainment"]),
            ("attainment_emulated", e["attainment"]),
            ("attainment_sim", run["sim_attainment"]),
            ("attainment_sim_measured_real", r.get("sim_measured_attainment", math.nan)),
            ("attainment_sim_measured_emulated", e.get("sim_measured_attainment", math.nan)),
            ("stage_ratio_p50", rs.get("ratio_p50", math.nan)),
            ("stage_ratio_p99", rs.get("ratio_p99", math.nan)),
            ("stage_late_share_real", rs.get("late_share", math.nan)),
            ("stage_late_share_emulated", es.get("late_share", math.nan)),
        ):
            rows.record("gpu", config, metric, value)
    console.print(st)
    worst = [run["real"]["worst_logit_diff"] for run in res["runs"]]
    checked = sum(run["real"]["checked_rows"] or 0 for run in res["runs"])
    console.print(
        f"answers checked: {checked} rows' logits against the whole model's, largest "
        f"difference {max(worst):.2e}; plans: "
        + "; ".join(
            f"{n} (blocks "
            + " + ".join(f"{s['first']}-{s['last']} share {s['share']}" for s in p["stages"])
            + f") SLO {p['slo_us'] / 1e3:.1f} ms, batch {p['batch']}, simulated capacity "
            f"{p['sim_capacity']:.0f} req/s"
            for n, p in res["plans"].items()
        )
    )
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench gpu)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="on a GPU machine: profile, serve real and emulated")
    run.add_argument("--out", required=True, help="folder for result.json and the profiles")
    run.add_argument("--image", type=int, default=448, help="image side (448)")
    run.add_argument("--max-batch", type=int, default=8, help="largest batch profiled (8)")
    run.add_argument("--reps", type=int, default=20, help="timed calls per profile point (20)")
    run.add_argument("--duration", type=float, default=6.0, help="seconds per trace (6)")
    run.add_argument(
        "--slo-factor",
        type=float,
        default=5.0,
        help="SLO = this x the whole model's batch-1 time (5)",
    )
    run.add_argument(
        "--wake-guard-us",
        type=float,
        default=1_000.0,
        help="the live data plane's wake guard (1000 µs)",
    )
    run.add_argument(
        "--switch-interval-us",
        type=float,
        default=200.0,
        help="Python's GIL switch interval for this process (200 µs; 0: Python's own, "
        "5000): a waking stage thread waits for the router's GIL at most this long",
    )
    run.add_argument("--seed", type=int, default=1)
    run.add_argument(
        "--replay",
        metavar="DIR",
        default=None,
        help="serve another run's plans (its result.json's profiles) on emulated stages only: "
        "the host's side of a device run, where no GPU is",
    )
    run.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="serve with the process's heap thawed (RouterCore.start freezes it, so that a "
        "full collection does not walk all of PyTorch with the router's loop stopped)",
    )
    run.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run without CUDA (a smoke run: its times mean nothing)",
    )
    rep = sub.add_parser("report", help="here: a run's tables, stored in the warehouse")
    rep.add_argument("dir", help="the folder `run --out` wrote")
    rep.add_argument("--warehouse", default=None)
    rep.add_argument("--label", default="bench")
    args = ap.parse_args()
    for name in ("image", "max_batch", "reps"):
        if args.cmd == "run" and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.cmd == "run" and args.duration <= 0:
        ap.error("--duration must be > 0")
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
