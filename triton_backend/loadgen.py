"""Open-loop load from a client's side: requests sent at given times with tritonclient's
asyncio gRPC client, each answer timed and classified (ok, dropped, failed, error)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from triton_backend.router import DROP_MARKER, FAIL_MARKER


@dataclass(frozen=True)
class Shot:
    sent_s: float  # when it was sent, from the start of the run
    latency_s: float
    outcome: str  # ok | dropped | failed | error


def poisson_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, n))


async def _drive(
    url: str, model: str, inputs: dict[str, np.ndarray], times_s: np.ndarray, timeout_s: float
) -> list[Shot]:
    import tritonclient.grpc as tg
    import tritonclient.grpc.aio as tga

    from triton_backend.repository import kserve_dtype

    client = tga.InferenceServerClient(url)
    prepared = []
    for name, x in inputs.items():
        i = tg.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
        i.set_data_from_numpy(x)
        prepared.append(i)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    shots: list[Shot] = []

    async def one(t: float) -> None:
        delay = t0 + t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = loop.time()
        try:
            await client.infer(model, prepared, client_timeout=timeout_s)
            outcome = "ok"
        except Exception as exc:
            text = str(exc)
            outcome = (
                "dropped" if DROP_MARKER in text else "failed" if FAIL_MARKER in text else "error"
            )
        shots.append(Shot(sent - t0, loop.time() - sent, outcome))

    try:
        await asyncio.gather(*(one(float(t)) for t in times_s))
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
    return asyncio.run(_drive(url, model, inputs, times_s, timeout_s))


def summarize(shots: list[Shot], slo_s: float, duration_s: float) -> dict[str, float]:
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
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "goodput": on_time / duration_s if duration_s > 0 else 0.0,
    }


def burst(
    url: str, model: str, inputs: dict[str, np.ndarray], n: int, slo_ms: float | None = None
) -> list[Shot]:
    """n requests sent at once over KServe v2 HTTP, each on its own connection (opened
    first), with request bodies built beforehand: the client's own cost stays out of the
    latencies (each is timed from the moment its bytes are written), as it would with n
    clients on other hosts. Answers: 200 ok, 503 dropped, anything else an error."""
    return asyncio.run(_burst(url, model, inputs, n, slo_ms))


async def _burst(
    url: str, model: str, inputs: dict[str, np.ndarray], n: int, slo_ms: float | None
) -> list[Shot]:
    import tritonclient.http as th

    from triton_backend.repository import kserve_dtype

    prepared = []
    for name, x in inputs.items():
        i = th.InferInput(name, list(x.shape), kserve_dtype(x.dtype))
        i.set_data_from_numpy(x, binary_data=True)
        prepared.append(i)
    params = None if slo_ms is None else {"slo_ms": slo_ms}
    body, json_size = th.InferenceServerClient.generate_request_body(prepared, parameters=params)
    host, port = url.rsplit(":", 1)
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {url}\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {json_size}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    request = head + body
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Shot:
        sent = loop.time()
        writer.write(request)
        status = (await reader.readline()).split()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        text = await reader.readexactly(length)
        took = loop.time() - sent
        writer.close()
        code = status[1] if len(status) > 1 else b""
        outcome = "ok" if code == b"200" else "dropped" if code == b"503" else "error"
        if outcome == "error" and FAIL_MARKER.encode() in text:
            outcome = "failed"
        return Shot(sent - t0, took, outcome)

    shots = await asyncio.gather(*(one(r, w) for r, w in conns))
    return sorted(shots, key=lambda s: s.sent_s)


CAPACITY_STEPS = 16  # live capacity is found to 1/16 of the top rate
CAPACITY_TARGET = 0.99  # the share of requests on time that a load must keep


def bisect_grid(passes: Callable[[int], bool], top: int) -> int:
    """The largest i in [0, top] with passes(i), assuming passing falls with i (0 passes)."""
    if passes(top):
        return top
    lo, hi = 0, top
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
    multiple of top/CAPACITY_STEPS, whose Poisson trace of `duration_s` keeps >=
    CAPACITY_TARGET of requests on time, bisected live; beside it the simulator's, found the
    same way on the same traces with the stage times measured on these nodes just before
    (the grid and the traces depend on `top` only, so plans searched with one `top` see the
    same loads). `on_point(rate, on_time)` after each live probe."""
    model, url = dep.ios[0].name, dep.grpc_url
    drive(url, model, inputs, poisson_times(0.3 * top, 2.0, seed=0))  # warm-up
    dep.core.take_stage_factors()
    drive(url, model, inputs, poisson_times(0.5 * top, 3.0, seed=100))
    factors = [list(f) for f in dep.core.take_stage_factors()]
    live: dict[float, float] = {}
    sim: dict[float, float] = {}

    def trace(i: int) -> tuple[float, np.ndarray]:
        rate = i * top / CAPACITY_STEPS
        return rate, poisson_times(rate, duration_s, 200 + i)

    def sim_passes(i: int) -> bool:
        rate, times = trace(i)
        sim[rate] = dep.simulate(times, duration_s, factors).attainment
        return sim[rate] >= CAPACITY_TARGET

    def live_passes(i: int) -> bool:
        rate, times = trace(i)
        live[rate] = summarize(drive(url, model, inputs, times), slo_s, duration_s)["attainment"]
        on_point(rate, live[rate])
        return live[rate] >= CAPACITY_TARGET

    sim_i = bisect_grid(sim_passes, CAPACITY_STEPS)
    live_i = bisect_grid(live_passes, CAPACITY_STEPS)
    return {
        "planned": sum(m.throughput for m in dep.core.topo.models),
        "top": top,
        "sim": sim_i * top / CAPACITY_STEPS,
        "live": live_i * top / CAPACITY_STEPS,
        "capped": live_i == CAPACITY_STEPS,
        "sim_capped": sim_i == CAPACITY_STEPS,
        "live_points": live,
        "sim_points": sim,
    }
