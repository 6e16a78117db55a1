"""Open-loop load from a client's side: requests sent at given times with tritonclient's
asyncio gRPC client, each answer timed and classified (ok, dropped, failed, error)."""

from __future__ import annotations

import asyncio
import selectors
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.predict import predict
from triton_backend.router.kserve_http import parse_head
from triton_backend.router.served import DROP_MARKER, FAIL_MARKER, refused


@dataclass(frozen=True)
class Shot:
    sent_s: float  # when it was sent, from the start of the run
    latency_s: float
    outcome: str  # ok | dropped | refused | failed | error
    model: int = 0  # which of the requests driven (drive_mix)


def poisson_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, n))


def grpc_inputs(inputs: dict[str, np.ndarray]) -> list:
    """tritonclient gRPC inputs holding these arrays (by input name)."""
    import tritonclient.grpc as tg

    from triton_backend.node.repository import kserve_dtype

    prepared = []
    for name, x in inputs.items():
        i = tg.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
        i.set_data_from_numpy(x)
        prepared.append(i)
    return prepared


def stage_time_ns(client, model: str, inputs: dict[str, np.ndarray], output: str) -> int:
    """A node's own time for one call of partition `model` (tritonclient gRPC `client`):
    called as a chain's last hop, it answers its start and end (POOLPIPE_HOPS)."""
    import json

    import tritonclient.grpc as tg

    r = client.infer(
        model,
        grpc_inputs(inputs),
        parameters={"poolpipe_next": "[]", "poolpipe_outputs": json.dumps([output])},
        outputs=[tg.InferRequestedOutput(output), tg.InferRequestedOutput("POOLPIPE_HOPS")],
    )
    start, end = r.as_numpy("POOLPIPE_HOPS")[0][:2]
    return int(end - start)


async def _drive(
    url: str,
    requests: list[tuple[str, dict[str, np.ndarray]]],
    times_s: np.ndarray,
    which: np.ndarray,
    timeout_s: float,
) -> list[Shot]:
    import tritonclient.grpc.aio as tga

    client = tga.InferenceServerClient(url)
    prepared = [(model, grpc_inputs(inputs)) for model, inputs in requests]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    shots: list[Shot] = []

    async def one(t: float, k: int) -> None:
        delay = t0 + t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = loop.time()
        model, inputs = prepared[k]
        try:
            await client.infer(model, inputs, client_timeout=timeout_s)
            outcome = "ok"
        except Exception as exc:
            text = str(exc)
            outcome = (
                "dropped"
                if DROP_MARKER in text
                else "refused"
                if refused(text)
                else "failed"
                if FAIL_MARKER in text
                else "error"
            )
        shots.append(Shot(sent - t0, loop.time() - sent, outcome, k))

    try:
        await asyncio.gather(*(one(float(t), int(k)) for t, k in zip(times_s, which, strict=True)))
    finally:
        await client.close()
    return sorted(shots, key=lambda s: s.sent_s)


def drive(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    times_s: np.ndarray,
    timeout_s: float = 30.0,
) -> list[Shot]:
    """Send one request at each time (seconds from now); block until all are answered."""
    which = np.zeros(len(times_s), dtype=int)
    return asyncio.run(_drive(url, [(model, inputs)], times_s, which, timeout_s))


def drive_mix(
    url: str,
    requests: list[tuple[str, dict[str, np.ndarray]]],
    times_s: np.ndarray,
    which: np.ndarray,
    timeout_s: float = 60.0,
) -> list[Shot]:
    """Send request `requests[which[i]]` (model, inputs) at each time `times_s[i]`."""
    return asyncio.run(_drive(url, requests, times_s, which, timeout_s))


def scaled_poisson_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Poisson arrivals at `rate` within `duration_s`: the unit-rate arrivals of `seed`,
    their times / `rate`, so that every rate drives the same pattern (common random
    numbers: a burst that decides one rate is in all of them)."""
    rng = np.random.default_rng(seed)
    chunks, t = [], 0.0
    while True:  # fixed-size draws: the same sequence whatever the rate
        cum = t + np.cumsum(rng.exponential(1.0, 1024))
        chunks.append(cum)
        t = float(cum[-1])
        if t >= rate * duration_s:
            break
    units = np.concatenate(chunks)
    return units[units < rate * duration_s] / rate


def mix_times(
    rate: float, weights: list[float], duration_s: float, seed: int, scaled: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrivals at `rate`, each request's model drawn by `weights` (`scaled`: the
    same arrivals and models at every rate, scaled_poisson_times)."""
    times = (scaled_poisson_times if scaled else poisson_times)(rate, duration_s, seed)
    w = np.asarray(weights, dtype=float)
    which = np.random.default_rng(seed + 7).choice(len(w), size=len(times), p=w / w.sum())
    return times, which


def client_figures(shots: list[Shot], slo_s: float, duration_s: float) -> dict[str, float]:
    """What the client saw of a run: sent, on time (within `slo_s`), answered, dropped,
    failed, latency p50/p99 of the answers (ms), goodput (on time per second)."""
    n = len(shots)
    ok = [s for s in shots if s.outcome == "ok"]
    lat = np.asarray([s.latency_s for s in ok]) * 1e3
    on_time = sum(1 for s in ok if s.latency_s <= slo_s)
    return {
        "sent": n,
        "attainment": on_time / n if n else 1.0,
        "ok": len(ok),
        "dropped": sum(1 for s in shots if s.outcome == "dropped"),
        "failed": sum(1 for s in shots if s.outcome in ("failed", "error")),
        "refused": sum(1 for s in shots if s.outcome == "refused"),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "goodput": on_time / duration_s if duration_s > 0 else 0.0,
    }


def burst(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    n: int,
    slo_ms: float | None = None,
    timeout_s: float = 30.0,
) -> list[Shot]:
    """n requests sent at once over KServe v2 HTTP, each on its own connection (all opened
    first), with request bodies built beforehand, as n clients on other hosts would send
    them. Each is timed from just before its bytes go to the kernel (a blocking send: the
    server takes them as fast as it reads) to when the kernel received its answer's last
    bytes (SO_TIMESTAMPNS), so the client's own work reading n answers on cores it shares
    with the server stays out of the latencies (where the kernel gives no timestamp, from
    when the answer was read). Answers: 200 ok, 503 dropped, anything else an error; none
    within `timeout_s`: an error timed at `timeout_s`."""
    import tritonclient.http as th

    from triton_backend.node.repository import kserve_dtype

    prepared = []
    for name, x in inputs.items():
        i = th.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
        i.set_data_from_numpy(x, binary_data=True)
        prepared.append(i)
    params = None if slo_ms is None else {"slo_ms": slo_ms}
    body, json_size = th.InferenceServerClient.generate_request_body(prepared, parameters=params)
    host, port = url.rsplit(":", 1)
    request = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {url}\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {json_size}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    stamp_opt = getattr(socket, "SO_TIMESTAMPNS", 35)  # 35: Linux's, where Python lacks it
    socks = []
    stamped = True
    for _ in range(n):
        s = socket.create_connection((host.strip("[]"), int(port)))
        try:
            s.setsockopt(socket.SOL_SOCKET, stamp_opt, 1)
        except OSError:
            stamped = False
        socks.append(s)
    sent = []
    try:
        for s in socks:
            sent.append(time.time_ns())
            s.sendall(request)
        answers = _read_answers(socks, stamp_opt if stamped else None, timeout_s)
    finally:
        for s in socks:
            s.close()
    t0 = sent[0]
    shots = []
    for k, (t_ns, code, text) in enumerate(answers):
        if t_ns is None:
            shots.append(Shot((sent[k] - t0) / 1e9, timeout_s, "error"))
            continue
        outcome = "ok" if code == 200 else "dropped" if code == 503 else "error"
        if outcome == "error" and FAIL_MARKER.encode() in text:
            outcome = "failed"
        shots.append(Shot((sent[k] - t0) / 1e9, max(0.0, (t_ns - sent[k]) / 1e9), outcome))
    return shots


def _read_answers(
    socks: list, stamp_opt: int | None, timeout_s: float
) -> list[tuple[int | None, int, bytes]]:
    """Each connection's answer: (when its last bytes came, ns of CLOCK_REALTIME, or None
    if it did not come; HTTP status; body)."""
    sel = selectors.DefaultSelector()
    bufs = [bytearray() for _ in socks]
    out: list[tuple[int | None, int, bytes]] = [(None, 0, b"")] * len(socks)
    for k, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, k)
    left = len(socks)
    deadline = time.monotonic() + timeout_s
    anc = socket.CMSG_SPACE(16)
    while left and time.monotonic() < deadline:
        for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
            k, s = key.data, socks[key.data]
            try:
                data, cmsgs, _, _ = s.recvmsg(1 << 16, anc)
            except BlockingIOError:
                continue
            except OSError:
                data, cmsgs = b"", []
            t_ns = time.time_ns()
            for level, kind, raw in cmsgs:
                if stamp_opt is not None and level == socket.SOL_SOCKET and kind == stamp_opt:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    t_ns = sec * 1_000_000_000 + nsec
            buf = bufs[k]
            buf += data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if data:
                    continue
                out[k] = (None, 0, b"")  # closed before a whole answer came
            else:
                try:
                    code, headers = parse_head(bytes(buf[:end]))
                    length = int(headers.get(b"content-length", b"0"))
                except (ValueError, IndexError):
                    code, length = 0, 0
                if data and len(buf) < end + 4 + length:
                    continue
                out[k] = (t_ns, code, bytes(buf[end + 4 :]))
            sel.unregister(s)
            left -= 1
    sel.close()
    return out


CAPACITY_STEPS = 16  # live capacity is found to 1/16 of the top rate
CAPACITY_TARGET = 0.99  # the share of requests on time that a load must keep
TRACES_PER_RATE = 2  # traces a rate is judged on together (see rate_passes)


def keeps_target(missed: float, requests: float) -> bool:
    """Whether `requests` with `missed` of them not on time keep CAPACITY_TARGET (a
    float's round-off is not a miss)."""
    return missed <= (1.0 - CAPACITY_TARGET) * requests + 1e-6


def rate_passes(
    traces: int, run: Callable[[int], tuple[float, int]], extra: int = 0
) -> tuple[bool, float]:
    """Judge one rate on `traces` traces together: `run(k)` drives trace k and gives (share
    on time, requests). The rate passes when all its traces' requests together keep >=
    CAPACITY_TARGET on time; the next trace is driven only while they still can (the
    traces to come taken as large as this one). Returns (passed, share on time so far).
    Judged one trace at a time, a 1-s trace of 130 requests failed at its second miss and
    passed at its first: the emulated main job's capacities moved by a quarter between
    runs on that. `extra`: a rate that failed narrowly (it would still pass were up to
    `extra` more traces of the same size all on time) is driven that many traces more, one
    at a time while it can still pass, and judged on them all: near the capacity one or two
    misses decide, and two traces of some hundred requests cannot tell 98.5% from 99.5%."""
    on = total = 0.0
    last = traces + extra
    k = 0
    while k < last:
        share, n = run(k)
        on += share * n
        total += n
        k += 1
        missed = total - on
        if not keeps_target(missed, total + (last - k) * n):
            return False, on / total
        if k >= traces and keeps_target(missed, total):
            break
    return True, on / total if total else 1.0


def kept_rungs(shares: Sequence[float], counts: Sequence[int]) -> int:
    """How many of a ladder's loads, from the lowest, keep CAPACITY_TARGET on time, judged
    together: a load's share on time does not rise with the load, so the shares (one trace a
    load, `counts` requests each) are fitted so, adjacent loads whose shares rise pooled
    until none does (pooled adjacent violators, weighted by requests: the monotone fit), and
    the loads whose fitted share keeps the target are kept. Judged each alone below the
    first that failed, a load that lost 3 of 261 (0.989) set a plan's figure where the next
    load above kept 0.997 of 297 (the main job, 2026-12-02): pooled, the two keep 0.993. A
    load kept alone is never lost by pooling (it is pooled only with loads above that keep
    more), so the figure is at least the one judged alone."""
    blocks: list[list[float]] = []  # [requests on time, requests, loads] per pooled run
    for share, n in zip(shares, counts, strict=True):
        blocks.append([share * n, float(n), 1])
        while len(blocks) > 1 and (
            blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]  # rises: pool
        ):
            on, m, k = blocks.pop()
            blocks[-1][0] += on
            blocks[-1][1] += m
            blocks[-1][2] += k
    kept = 0
    for on, m, k in blocks:
        if not keeps_target(m - on, m):
            break
        kept += int(k)
    return kept


def nearest_to_mean(shares: Mapping[int, Sequence[float]]) -> int:
    """The key (an arrival pattern's seed) whose shares on time (one per plan and load, in
    the same order for every key) lie nearest their means over all keys: the least sum of
    squares, each share's distance in its own standard deviations over the keys (a load
    far past a plan's capacity spreads most and would outweigh the loads near 99%; one
    where every key gives the same share counts for nothing). The typical pattern, neither
    kinder nor harsher than the mean to any plan. Ties go to the lowest key."""
    if not shares:
        raise ValueError("no patterns to choose from")
    keys = sorted(shares)
    m = np.asarray([shares[k] for k in keys], dtype=float)
    if m.ndim != 2 or m.shape[1] == 0:
        raise ValueError("every pattern needs the same number of shares, at least one")
    sd = m.std(axis=0)
    z = np.divide(m - m.mean(axis=0), sd, out=np.zeros_like(m), where=sd > 0)
    return keys[int(np.argmin((z**2).sum(axis=1)))]


def ladder_gap(rungs: Sequence[int]) -> int:
    """The grid steps between a ladder's top two loads (ascending), 1 with fewer: how far
    climb_ladder drives a plan that keeps them all, a load at a time."""
    return rungs[-1] - rungs[-2] if len(rungs) > 1 else 1


def further_loads(rungs: Sequence[int], beyond: int, top: int | None = None) -> list[int]:
    """The loads climb_ladder may drive past a ladder (grid steps, ascending): up to
    `beyond`, each the gap between the ladder's top two above the last, none above `top`."""
    if not rungs:
        return []
    gap = ladder_gap(rungs)
    out = [rungs[-1] + gap * (j + 1) for j in range(beyond)]
    return [i for i in out if top is None or i <= top]


def climb_ladder(
    rungs: Sequence[int],
    drive: Callable[[int], tuple[float, int]],
    beyond: int = 0,
    top: int | None = None,
    again: Callable[[int], tuple[float, int]] | None = None,
) -> tuple[list[int], int]:
    """Drives each of a ladder's loads (grid steps, ascending; `drive(i)`: the share on
    time and the requests of one trace there), then, while every load so far is kept
    (kept_rungs), up to `beyond` loads more, each the gap between the ladder's top two
    above the last, none above `top`: a plan that keeps the ladder's top is not given the
    top as its figure where it keeps more. `again(i)`: one more trace at load i (the next
    of its pattern); the first load not kept is driven it where it failed narrowly (it
    would keep the target were the trace as large and all on time) and judged on both,
    once a ladder (a trace costs the main job 25 s of its six minutes):
    one trace of some 350 requests lost 279 req/s by one request where the simulator kept
    it on the same trace (the main job, 6b464a2), and one trace more at the load that
    sets the figure costs less than a second trace at every load. Returns the loads driven
    and how many of them, from the lowest, are kept."""
    driven = sorted(rungs)
    shares: list[float] = []
    counts: list[int] = []
    tried = False  # `again` is called once a ladder

    def judge() -> int:
        nonlocal tried
        kept = kept_rungs(shares, counts)
        if again is not None and kept < len(driven) and not tried:
            n = counts[kept]
            if not keeps_target((1.0 - shares[kept]) * n, 2 * n):  # not narrowly
                return kept
            tried = True
            share, m = again(driven[kept])
            shares[kept] = (shares[kept] * n + share * m) / (n + m)
            counts[kept] = n + m
            kept = kept_rungs(shares, counts)
        return kept

    for i in driven:
        share, n = drive(i)
        shares.append(share)
        counts.append(n)
    kept = judge()
    for nxt in further_loads(driven, beyond, top):
        if kept < len(driven):
            break
        share, n = drive(nxt)
        driven.append(nxt)
        shares.append(share)
        counts.append(n)
        kept = judge()
    return driven, kept


def bisect_grid(passes: Callable[[int], bool], top: int, guess: int | None = None) -> int:
    """The largest i in [0, top] with passes(i), assuming passing falls with i (0 passes);
    asked first at `guess` (clamped to 1..top) where given, else at `top`. Below a guess
    that failed, it asks 1, 2, 4, ... steps under the last that failed until one passes,
    then bisects between them: a guess from the plan's stated figure fails by a step or
    two when a trace or two of a live search lose a request more than the rest, and
    bisecting from 0 then drove loads far below the capacity (half the guess, then three
    quarters), two traces each. Above a guess that passed, the same upwards (1, 2, 4, ...
    steps over the last that passed until one fails): bisecting up to `top` drove a rate
    far above the capacity first, where a live trace costs as much as one near it."""
    if guess is None:
        if passes(top):
            return top
        lo, hi = 0, top
    else:
        guess = max(1, min(top, guess))
        if passes(guess):
            lo, hi, up = guess, top + 1, 1
            while lo + up <= top:
                if not passes(lo + up):
                    hi = lo + up
                    break
                lo, up = lo + up, 2 * up
        else:
            lo, hi, down = 0, guess, 1
            while hi - down > 0:
                if passes(hi - down):
                    lo = hi - down
                    break
                hi, down = hi - down, 2 * down
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


def live_capacity(
    dep: Any,
    inputs: dict[str, np.ndarray],
    top: float,
    duration_s: float,
    slo_s: float,
    on_point: Callable[[float, float], None] = lambda rate, att: None,
) -> dict:
    """Capacity of what deployment `dep` serves (its first model): the highest rate, a
    multiple of top/CAPACITY_STEPS, at which TRACES_PER_RATE Poisson traces of `duration_s`
    keep >= CAPACITY_TARGET of their requests on time (rate_passes), bisected live; beside
    it the simulator's, found the same way on the same traces with the stage times
    measured on these nodes just before (the grid and the traces depend on `top` only, so
    plans searched with one `top` see the same loads). One trace was not enough: near the
    knee a rate that passed once kept 0.66 on time in the next run. The points are each
    rate's share on time over its traces. `on_point(rate, on_time)` after each live run."""
    model, url = dep.ios[0].name, dep.grpc_url
    drive(url, model, inputs, poisson_times(0.3 * top, 2.0, seed=0))  # warm-up
    dep.take_stage_factors()
    dep.take_answer_delays()
    drive(url, model, inputs, poisson_times(0.5 * top, 3.0, seed=100))
    factors = [list(f) for f in dep.take_stage_factors()]
    delays = dep.take_answer_delays()
    live: dict[float, float] = {}
    sim: dict[float, float] = {}

    def passes(i: int, points: dict[float, float], on_time: Callable[..., float]) -> bool:
        rate = i * top / CAPACITY_STEPS

        def trace(k: int) -> tuple[float, int]:
            times = poisson_times(rate, duration_s, 200 + i + 1000 * k)
            return on_time(rate, times), len(times)

        ok, points[rate] = rate_passes(TRACES_PER_RATE, trace)
        return ok

    def simulated(rate: float, times: np.ndarray) -> float:
        return predict(dep, times, duration_s, factors, answer_delays=delays).attainment

    def measured(rate: float, times: np.ndarray) -> float:
        got = client_figures(drive(url, model, inputs, times), slo_s, duration_s)["attainment"]
        on_point(rate, got)
        return got

    def sim_passes(i: int) -> bool:
        return passes(i, sim, simulated)

    def live_passes(i: int) -> bool:
        return passes(i, live, measured)

    sim_i = bisect_grid(sim_passes, CAPACITY_STEPS)
    live_i = bisect_grid(live_passes, CAPACITY_STEPS)
    return {
        "planned": sum(m.throughput for m in dep.topo.models),
        "top": top,
        "sim": sim_i * top / CAPACITY_STEPS,
        "live": live_i * top / CAPACITY_STEPS,
        "capped": live_i == CAPACITY_STEPS,
        "sim_capped": sim_i == CAPACITY_STEPS,
        "live_points": live,
        "sim_points": sim,
    }
