"""Capacity that follows the load, live and compressed, on EMULATED GPUs, through Prefect.
EMULATED: not GPU measurements (docs/design/emulation.md).

The paper's group 2 (shadows of colorization-v2, googlenet-v3-pytorch and repvgg-b3 from
data/ppipe-gpu-group2, maf19 mix, SLO 5x) on --cluster, emulated at time scale D (a network
namespace per server, an emulated GPU node per GPU: every GPU of the cluster is a node of
the router's inventory). The router (`poolpipe serve --prefect-events`, in this process)
starts on the cheapest GPUs for the base load x 1.2 (`poolpipe advise`) and sends each time
the load leaves that plan's envelope to a real Prefect server as an event; prefect.yaml's
load-replan deployment (`prefect deploy --name load-replan`, its parameters set to the cost
objective as an operator would) and its trigger turn the event into a run that a process
worker of the onboarding pool (nice 10: it shares this host's cores with the cluster)
executes against the router: the cheapest GPUs for the rates seen x 1.2, rolled out by
pipeline flush where the load needs them or they save 10% of the cost.

The load (Poisson, maf19 mix, undilated req/s): --base x what the cluster's max-min plan
delivers for --phase-s[0] seconds, twice that for [1], half of it for [2]. Compressed time
constants: the envelope judges a rise over 30 s and a fall over 60 s held 20 s (serving:
60 s, 300 s, 600 s); the deployment re-plans at most once per 60 s (1800 s) on the
router's 10-s and 60-s rates (60 s and 300 s).

Reported: each event (when, why) and its run (created, started, ended, state, the
decision), how long after the event the new plan served (target 60 s), the GPUs in use
against the static plan for the peak (GPU-seconds), on time per phase and per 10 s, the
requests that failed or went unanswered, the nodes that joined and those released (after
the load: no model of the router loaded and no batch in flight). Wall seconds of this host;
rates undilated. A plot (timeline.png in --out); stored in the warehouse (bench_serving,
bench "follow-live").

    ./run bench-follow-live [--cluster hc2-small] [--time-scale 5] [--base 0.15]
                            [--phase-s 60,150,150] [--seed 1] [--out out/follow-live]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from rich.console import Console
from rich.table import Table

from poolpipe.store.bench_rows import BenchRows
from poolpipe.store.warehouse import Warehouse
from testbed import scratch_dir, teardown_on_sigterm
from testbed.prefect_server import REPO, TERMINAL, Server

console = Console(width=None if sys.stdout.isatty() else 170)
LEVELS = (1.0, 2.0, 0.5)  # the base load, twice it, half of it
HEADROOM = 0.2
MIN_INTERVAL_S = 60.0
RATE_WINDOWS = ["10s", "60s"]
TARGET_S = 60.0  # the new plan serves within this long of the event
BIN_S = 10.0
WARM_UP_S = 20.0
DEPLOYMENT = "follow-live"
ROW = re.compile(r"^\|\s*([a-z_]+)\s*\|\s*(.*?)\s*\|$", re.M)  # a decision's table row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="hc2-small", help="a preset of data/ppipe-gpu-group2")
    ap.add_argument("--time-scale", type=float, default=5.0, help="D (5)")
    ap.add_argument("--base", type=float, default=0.15, help="share of the max-min plan (0.15)")
    ap.add_argument("--phase-s", default="60,150,150", help="seconds at 1x, 2x, 0.5x")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "follow-live")
    ap.add_argument("--warehouse", type=Path, default=None, help="where results are stored")
    ap.add_argument("--label", default="bench")
    args = ap.parse_args()
    try:
        phases = [float(x) for x in args.phase_s.split(",")]
    except ValueError:
        phases = []
    if len(phases) != 3 or min(phases) <= 0:
        ap.error(f"--phase-s: {args.phase_s!r} is not three durations > 0 (e.g. 60,150,150)")
    if not 0 < args.base <= 0.5 or not args.time_scale >= 1:
        ap.error("need 0 < --base <= 0.5 (twice it is served) and --time-scale >= 1")
    teardown_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = scratch_dir("pp-follow-")
    (tmp / "prefect").mkdir()
    server = Server(tmp / "prefect", "127.0.0.1")
    try:
        with console.status("starting a Prefect server, deploying load-replan ..."):
            server.start()
            os.environ["PREFECT_API_URL"] = server.url  # the router's events, the flows here
            dep_id = deploy(server)
        return run(args, phases, tmp, server, dep_id, started)
    finally:
        server.stop()


def deploy(server: Server) -> str:
    """load-replan deployed from prefect.yaml, its parameters set for the compressed run."""
    for cmd in (
        ("work-pool", "create", "onboarding", "--type", "process"),
        ("deploy", "--name", "load-replan"),
    ):
        r = server.cli(*cmd)
        if r.returncode:
            raise SystemExit(f"prefect {' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-2000:]}")
    dep = server.deployment("load-replan/load-replan")
    params = {
        **dep["parameters"],
        "objective": "cost",
        "headroom": HEADROOM,
        "min_interval_s": MIN_INTERVAL_S,
        "rate_windows": RATE_WINDOWS,
    }
    server.http.client.patch(
        f"/deployments/{dep['id']}", json={"parameters": params}
    ).raise_for_status()
    return dep["id"]


def run(args, phases: list[float], tmp: Path, prefect: Server, dep_id: str, started: float):
    import testbed.emulated as emu
    from flows.replan import load_event_emitter
    from poolpipe.client.control import new_token_file, node_key
    from poolpipe.errors import PoolpipeError
    from poolpipe.planner.advise import advise
    from poolpipe.runtime.envelope import EnvelopeConfig
    from triton_backend.node.triton import RemoteNode

    d = args.time_scale
    wh = str(tmp / "serving.duckdb")
    with console.status("onboarding the shadows of group 2 (Prefect flow onboard-shadow) ..."):
        emu.onboard_shadows(wh)
    with console.status(f"planning {args.cluster}: max-min, then the cheapest GPUs ..."):
        maxmin, _ = emu.group_plans(wh, args.cluster)["ppipe"]
        with Warehouse.open(wh) as w:
            profiles = {m.name: w.load_profile(m.name) for m in maxmin.models}
        cluster = maxmin.cluster
        delivered = sum(float(m.deliverable or m.throughput) for m in maxmin.models)
        weights = dict(zip(emu.GROUP2, emu.MAF19, strict=True))
        base = args.base * delivered
        levels = [base * x for x in LEVELS]

        def cheapest(total: float):
            rates = {n: total * w for n, w in weights.items()}
            a = advise(maxmin, profiles, rates, cluster, headroom=HEADROOM)
            if a.plan is None:
                raise SystemExit(f"{args.cluster} cannot serve {total:.1f} req/s: {a.why_not}")
            return a.plan

        first, static = cheapest(base), cheapest(max(levels))
        with Warehouse.open(wh) as w:
            first_id = w.store_plan(first, label="follow-live:base")
    console.print(
        f"{args.cluster}: the max-min plan delivers {delivered:.1f} req/s at maf19; load "
        f"{' -> '.join(f'{r:.1f}' for r in levels)} req/s for "
        f"{' / '.join(f'{s:g}' for s in phases)} s; served first: {gpus(first)} (for "
        f"{base:.1f} x {1 + HEADROOM:g}); static plan for the peak: {gpus(static)}",
        highlight=False,
    )
    token_file = tmp / "control.token"
    token = new_token_file(token_file)
    prefect.worker(
        "onboarding",
        tmp / "worker.log",
        wrap=["nice", "-n", "10"],
        POOLPIPE_HOME=str(REPO),
        POOLPIPE_WAREHOUSE=wh,
        POOLPIPE_TOKEN_FILE=str(token_file),
    )
    events: list[tuple[float, object]] = []
    emit = load_event_emitter(DEPLOYMENT)

    def on_event(router: str, e) -> None:
        events.append((time.time(), e))
        emit(router, e)

    t0 = time.monotonic()
    with emu.emulated_nodes(cluster, tmp / "cluster", d, token_file) as em:
        console.print(
            f"{args.cluster} EMULATED at D = {d:g}: {len(em.nodes)} GPU nodes on {em.servers} "
            f"servers, up in {time.monotonic() - t0:.0f} s",
            highlight=False,
        )
        inventory = em.inventory()
        server = emu.serve_dilated(
            first, first_id, wh, tmp / "serve", d, name=DEPLOYMENT, token=token,
            inventory=inventory,
            envelope=EnvelopeConfig(hold_s=20.0, short_s=30.0, long_s=60.0),
            on_load_event=on_event,
        )  # fmt: skip
        try:
            served = Watch(server)
            shots, bounds = drive(server, weights, levels, phases, d, args.seed)
            settle(prefect, dep_id)
            served.stop()
            key = node_key(token)
            leftover = {
                n.name: (RemoteNode.of(n.each_gpu()[0], key).models(), next(
                    (s["batches"] for s in server.deployment.core.node_states()
                     if s["node"] == n.name), 0))
                for n in inventory.nodes
            }  # fmt: skip
            # the nodes the plans left: out of the router's inventory (poolpipe release)
            given_back = {}
            for name in sorted(
                set().union(*(c[3] for c in served.changes)) - served.changes[-1][3]
            ):
                try:
                    got = server.control({"op": "release", "node": name, "token": token})
                except PoolpipeError as exc:
                    got = {"ok": False, "error": str(exc)}
                given_back[name] = (
                    (True, f"out of the inventory, {got['nodes']} nodes left")
                    if got.get("ok")
                    else (False, f"not released: {got.get('error')}")
                )
        finally:
            server.close()
    runs = flow_runs(prefect, dep_id)
    res = report(
        args, d, phases, bounds, shots, events, runs, served, static, leftover, given_back, started
    )
    plot(args.out / "timeline.png", res, args.cluster, d)
    store(args, res)
    return 0


def gpus(plan) -> str:
    used = plan.gpus_used()
    return " + ".join(f"{n} {g}" for g, n in sorted(used.items())) or "none"


class Watch:
    """The plan the router serves, looked at every 0.2 s: (wall time, plan id, GPUs per
    type, nodes) at each change."""

    def __init__(self, server) -> None:
        self.server = server
        self.changes: list[tuple[float, int, dict[str, int], set[str]]] = []
        self._stop = threading.Event()
        self._look()
        self._thread = threading.Thread(target=self._loop, name="plan-watch", daemon=True)
        self._thread.start()

    def _look(self) -> None:
        dep = self.server.deployment
        pid = self.server.plan_id
        if not self.changes or self.changes[-1][1] != pid:
            nodes = {n.name for n in dep.nodes.values()}  # (the inventory's names)
            self.changes.append((time.time(), pid, dict(dep.plan.gpus_used()), nodes))

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._look()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def drive(server, weights, levels, phases, d, seed):
    """The phases' loads one after the other: (shots with wall send times, phase bounds)."""
    import testbed.emulated as emu

    dep = server.deployment
    load = emu.MixLoad.of(dep, weights)
    shots, bounds = [], []
    with console.status("") as status:
        # a fresh router recalibrates its pools in their first stage calls under load
        # (testbed/emulated.py's mix_capacity): the base load until it stops, not counted
        for k in range(emu.WARM_UP_TRACES):
            status.update(f"warm-up at {levels[0]:.1f} req/s for {WARM_UP_S:g} s ...")
            before = dep.core.recalibrations()
            load.run(levels[0] / d, WARM_UP_S, seed + 100 + k)
            if dep.core.recalibrations() == before:
                break
        console.print(
            f"warm-up: {k + 1} trace(s) of {WARM_UP_S:g} s at the base load until the router "
            "stopped recalibrating",
            highlight=False,
        )
        for k, (rate, dur) in enumerate(zip(levels, phases, strict=True)):
            status.update(f"load {rate:.1f} req/s for {dur:g} s (phase {k + 1} of 3) ...")
            start = time.time()
            times, got = load.send(rate / d, dur, seed + k)
            bounds.append((start, start + dur, rate, len(times)))
            shots += [(start + s.sent_s, s, load.on_time(s)) for s in got]
    return shots, bounds


def settle(prefect: Server, dep_id: str, timeout_s: float = 180.0) -> None:
    """Wait for the deployment's runs still going to end."""
    deadline = time.monotonic() + timeout_s
    with console.status("waiting for the re-plan runs still going ..."):
        while time.monotonic() < deadline:
            going = [r for r in flow_runs(prefect, dep_id) if r["state"] not in TERMINAL]
            if not going:
                return
            time.sleep(2)


def flow_runs(prefect: Server, dep_id: str) -> list[dict]:
    """The deployment's runs, oldest first: when created / started / ended (wall time),
    state, the event, and the decision its artifact records."""
    found = prefect.http.post(
        "/flow_runs/filter",
        json={"deployments": {"id": {"any_": [dep_id]}}, "sort": "EXPECTED_START_TIME_ASC"},
    ).json()
    out = []
    for r in found:
        arts = prefect.http.post(
            "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [r["id"]]}}}
        ).json()
        decision = {}
        for a in arts:
            if isinstance(a.get("data"), str):  # (the decision's markdown)
                decision |= dict(ROW.findall(a["data"]))
        out.append(
            {
                "created": _ts(r.get("created")),
                "start": _ts(r.get("start_time")),
                "end": _ts(r.get("end_time")),
                "state": r["state"]["type"],
                "event": r["parameters"].get("event", ""),
                "why": r["parameters"].get("why", ""),
                "decision": decision,
            }
        )
    return sorted(out, key=lambda r: r["created"] or 0.0)


def _ts(text: str | None) -> float | None:
    return None if not text else datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def report(
    args, d, phases, bounds, shots, events, runs, served, static, leftover, given_back, started
):
    t_begin, t_end = bounds[0][0], bounds[-1][1]
    sent = sum(b[3] for b in bounds)
    answered = len(shots)
    failed = sum(1 for _, s, _ in shots if s.outcome in ("failed", "error"))
    on_time = sum(ok for _, _, ok in shots)

    t = Table(title="the load's phases (undilated req/s; on time: answered within the SLO)",
              title_justify="left")  # fmt: skip
    for col in ("phase", "req/s", "s", "sent", "on time", "failed", "unanswered"):
        t.add_column(col, justify="right")
    per_phase = []
    for k, (a, b, rate, n) in enumerate(bounds):
        mine = [(s, ok) for at, s, ok in shots if a <= at < b]
        share = sum(ok for _, ok in mine) / n if n else math.nan
        per_phase.append(share)
        t.add_row(
            f"{LEVELS[k]:g}x", f"{rate:.1f}", f"{phases[k]:g}", str(n), f"{share:.4f}",
            str(sum(1 for s, _ in mine if s.outcome in ("failed", "error"))),
            str(n - len(mine)),
        )  # fmt: skip
    console.print(t)

    t = Table(title="events, their re-plan runs (Prefect) and the plans served "
              "(s from the start of the load)", title_justify="left")  # fmt: skip
    for col in ("event at", "why", "run created", "started", "ended", "state", "decision",
                "new plan serves", "after the event"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("why", "decision") else "right")
    switches = served.changes[1:]
    rows = match(events, runs, switches)
    for at, e, run, sw in rows:
        dec = run["decision"] if run else {}
        t.add_row(
            f"{at - t_begin:.0f}",
            e.why,
            _rel(run and run["created"], t_begin),
            _rel(run and run["start"], t_begin),
            _rel(run and run["end"], t_begin),
            run["state"].lower() if run else "no run",
            dec.get("why", "") + (f" (plan {dec['plan_id']})" if dec.get("plan_id") else ""),
            f"{sw[0] - t_begin:.0f}: {gpus_text(sw[2])}" if sw else "-",
            f"[bold]{sw[0] - at:.1f} s[/]" if sw else "-",
        )
    console.print(t)
    lags = [sw[0] - at for at, _, _, sw in rows if sw is not None]

    # GPU-seconds over the load: the plans served, against the static plan for the peak
    changes = served.changes
    gpu_s = 0.0
    for k, (at, _, used, _) in enumerate(changes):
        a = max(at, t_begin)
        b = min(changes[k + 1][0] if k + 1 < len(changes) else t_end, t_end)
        gpu_s += max(0.0, b - a) * sum(used.values())
    static_s = (t_end - t_begin) * sum(static.gpus_used().values())
    saving = 1 - gpu_s / static_s
    joined = sorted(set().union(*(c[3] for c in changes)) - changes[0][3])
    released = sorted(set().union(*(c[3] for c in changes[:-1])) - changes[-1][3])
    clean = {n: leftover[n] for n in released}
    console.print(
        f"GPU-seconds over the load: {gpu_s:.0f} following it against {static_s:.0f} for the "
        f"static plan for the peak ({gpus_text(static.gpus_used())}): {saving:.1%} fewer\n"
        f"nodes that joined: {', '.join(joined) or 'none'}; released: "
        + (", ".join(f"{n} ({len(m)} models loaded, {b} batches; {given_back[n][1]})"
                     for n, (m, b) in clean.items()) or "none")
        + f"\n{on_time}/{sent} requests on time ({on_time / max(sent, 1):.4f}); {failed} failed, "
        f"{sent - answered} unanswered; {len(events)} events, {len(runs)} runs, "
        f"{len(switches)} rollouts; new plan serving {', '.join(f'{x:.1f}' for x in lags) or '-'}"
        f" s after its event (target {TARGET_S:g} s); {time.monotonic() - started:.0f} s in all\n"
        f"EMULATED GPUs at D = {d:g}; wall seconds of this host",
        highlight=False,
    )  # fmt: skip
    timeline = []
    k = 0.0
    while t_begin + k < t_end:
        a, b = t_begin + k, t_begin + k + BIN_S
        mine = [ok for at, _, ok in shots if a <= at < b]
        timeline.append((k, len(mine) / BIN_S, sum(mine) / len(mine) if mine else math.nan))
        k += BIN_S
    return {
        "t_begin": t_begin,
        "t_end": t_end,
        "bounds": bounds,
        "per_phase": per_phase,
        "events": [(at - t_begin, e.kind) for at, e in events],
        "switches": [(at - t_begin, sum(u.values())) for at, _, u, _ in changes],
        "timeline": timeline,
        "lags": lags,
        "gpu_s": gpu_s,
        "static_s": static_s,
        "saving": saving,
        "on_time": on_time / max(sent, 1),
        "failed": failed,
        "unanswered": sent - answered,
        "sent": sent,
        "runs": len(runs),
        "rollouts": len(switches),
        "joined": joined,
        "released_clean": bool(clean)
        and all(not m and not b and given_back.get(n, (False,))[0] for n, (m, b) in clean.items()),
        "d": d,
    }


def match(events, runs, switches) -> list[tuple]:
    """Each event (wall time, event) with its run (the first not taken yet of its kind
    created from it on) and the plan change that run rolled out (by plan id): [(at, event,
    run or None, change or None)]."""
    out, taken = [], set()
    for at, e in events:
        k = next(
            (
                k
                for k, r in enumerate(runs)
                if k not in taken
                and (r["created"] or 0.0) >= at - 1
                and r["event"].endswith("." + e.kind)
            ),
            None,
        )
        taken.add(k)
        run = None if k is None else runs[k]
        pid = None if run is None else run["decision"].get("plan_id")
        out.append((at, e, run, next((c for c in switches if str(c[1]) == pid), None)))
    return out


def gpus_text(used: dict[str, int]) -> str:
    return " + ".join(f"{n} {g}" for g, n in sorted(used.items()) if n) or "none"


def _rel(at: float | None, t0: float) -> str:
    return "-" if at is None else f"{at - t0:.0f}"


def plot(path: Path, res: dict, cluster: str, d: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    xs = [k for k, _, _ in res["timeline"]]
    top.step(xs, [r * d for _, r, _ in res["timeline"]], where="post", label="req/s sent")
    top.set_ylabel("req/s (undilated)")
    gpu = top.twinx()
    sw = res["switches"]
    span = res["t_end"] - res["t_begin"]
    gpu.step([max(0.0, a) for a, _ in sw] + [span], [n for _, n in sw] + [sw[-1][1]],
             where="post", color="tab:green", label="GPUs in use")  # fmt: skip
    gpu.set_ylabel("GPUs in use", color="tab:green")
    gpu.set_ylim(0, max(n for _, n in sw) + 1)
    for at, kind in res["events"]:
        top.axvline(at, color="tab:red", lw=0.8, ls="--")
        top.text(at, top.get_ylim()[1] * 0.95, kind, fontsize=7, color="tab:red")
    bottom.plot(xs, [s for _, _, s in res["timeline"]], "o-", ms=3)
    bottom.axhline(0.99, color="grey", lw=0.8, ls="--")
    bottom.set_ylabel(f"on time per {BIN_S:g} s")
    bottom.set_xlabel("s from the start of the load (wall)")
    top.set_title(
        f"group 2 on {cluster}, EMULATED GPUs (D = {d:g}): events (red), re-plans through Prefect",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    console.print(f"plot: {path}")


def store(args, res: dict) -> None:
    bench = BenchRows(args.label)
    cfg = f"{args.cluster} D {res['d']:g} base {args.base:g} phases {args.phase_s} seed {args.seed}"
    lags = res["lags"] or [math.nan]
    for metric, value in (
        ("event_to_serving_s_max", max(lags)),
        ("event_to_serving_s_min", min(lags)),
        ("rollouts", res["rollouts"]),
        ("runs", res["runs"]),
        ("gpu_seconds_follow", res["gpu_s"]),
        ("gpu_seconds_static", res["static_s"]),
        ("gpu_seconds_saving", res["saving"]),
        ("on_time", res["on_time"]),
        ("failed", res["failed"]),
        ("unanswered", res["unanswered"]),
        ("requests", res["sent"]),
        ("released_clean", float(res["released_clean"])),
    ):
        bench.record("follow-live", cfg, metric, float(value))
    for k, share in enumerate(res["per_phase"]):
        bench.record("follow-live", f"{cfg} phase {k + 1}", "on_time", share)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", bench)
    console.print(f"stored {len(bench)} rows (bench_serving, bench 'follow-live')")


if __name__ == "__main__":
    sys.exit(main())
