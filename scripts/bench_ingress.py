"""The router's way in and out, measured without a plan: an echo model behind the two
mechanisms the router can be hosted in, on loopback, with tritonclient.

- pytriton: PyTriton (the router's front door today), an async echo callable bound with
  `--instances` instances, so that each instance holds one request until it is answered;
- native: Triton's own Python backend, one instance, whose `execute` hands each request's
  response sender on and returns at once (the model config stays non-decoupled, so KServe
  v2 HTTP keeps working); the answer is sent later from another thread.

For each: one request at a time over HTTP and gRPC (p50/p99 ms); CPU time per request of
every process involved (Triton, its Python-backend stubs, and for PyTriton this process,
where its callables run, less the client's CPU measured against the native server); and a
burst of `--burst` concurrent gRPC requests each held `--hold-ms` before its answer, where
the instances decide whether a request is seen at once or waits in Triton's queue out of
the router's sight (time until the last answer, and the p99 of the time from sending to
the model seeing the request).

Then (`--parts sizes`) what a chain's hop costs to move a feature map into the next
node's model: the native echo sent inputs of `--sizes-mb` one at a time over KServe v2
HTTP with binary tensors and over tritonclient's gRPC (answering one value, as a hop
answers its times), from sending until the model's `execute` saw them (p50/p90 ms),
beside the same bytes through a node's feed (triton_backend/node/feed.py: sent with the
call over a TCP connection to the node's process, which places them in shared memory
registered with that Triton and calls the model naming where, as a chain's hop sends a map
of 64 KB or more) and through a TCP socket alone on loopback.

Printed as tables and stored in the warehouse (bench_serving, bench = "ingress"; the sizes
with config "native <protocol> <MB> MB").

    ./run bench-ingress [--requests 500] [--burst 500] [--hold-ms 100] [--instances 8]
        [--parts ingress,sizes] [--sizes-mb 0.004,1,4.3] [--size-requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from poolpipe.store.warehouse import Warehouse
from testbed import teardown_on_sigterm
from testbed.cpu import cpu_seconds
from triton_backend.env import fix_this_process, free_ports

console = Console(width=None if sys.stdout.isatty() else 150)

NATIVE_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "seen_ns" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# The sizes part's model: batched as a partition is (max_batch_size > 0)
SINK_CONFIG = NATIVE_CONFIG.replace('"echo"', '"sink"').replace(
    "max_batch_size: 0", "max_batch_size: 8"
)

# Answers from a timer thread when the request asks for a hold; `seen_ns` is when execute
# saw the request (CLOCK_MONOTONIC, the same clock in every process of the host).
NATIVE_MODEL = """
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            seen = np.array([time.monotonic_ns()], dtype=np.int64)
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            params = json.loads(r.parameters())
            hold = float(params.get("hold_ms", 0)) / 1e3
            y = x[:1] if params.get("sink") else x  # sink: a small answer, as a chain's hop
            out = pb_utils.InferenceResponse(
                [pb_utils.Tensor("y", y), pb_utils.Tensor("seen_ns", seen)]
            )
            sender = r.get_response_sender()
            if hold:
                threading.Timer(hold, sender.send, (out, FINAL)).start()
            else:
                sender.send(out, FINAL)
        return None
"""


class Native:
    """A stage-worker node (TritonNode: the same tritonserver, start-up and stop, stubs
    included) serving only the echo model."""

    name = "native"

    def __init__(self, workspace: Path):
        from triton_backend.node.triton import TritonNode

        repo = workspace / "repo"
        for name, config in (("echo", NATIVE_CONFIG), ("sink", SINK_CONFIG)):
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "config.pbtxt").write_text(config)
            (repo / name / "1" / "model.py").write_text(NATIVE_MODEL)
        self.node = TritonNode("native", "cpu", repo, workspace).start()
        try:
            self.node.load("echo")
            self.node.load("sink")
        except BaseException:
            self.node.stop()
            raise
        self.http, self.grpc = self.node.http_port, self.node.grpc_port
        self.pids = [self.node.process.pid]

    def stop(self) -> None:
        self.node.stop()


class PyTritonEcho:
    name = "pytriton"

    def __init__(self, workspace: Path, instances: int):
        fix_this_process()
        from pytriton.model_config import ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        self.http, self.grpc, metrics = free_ports(3)

        async def echo(requests):
            out = []
            for req in requests:
                seen = np.array([time.monotonic_ns()], dtype=np.int64)
                hold = float((req.parameters or {}).get("hold_ms", 0)) / 1e3
                if hold:
                    await asyncio.sleep(hold)
                out.append({"y": req["x"], "seen_ns": seen})
            return out

        self.triton = Triton(
            config=TritonConfig(
                http_address="127.0.0.1",
                http_port=self.http,
                grpc_address="127.0.0.1",
                grpc_port=self.grpc,
                metrics_port=metrics,
                exit_timeout_secs=2,
                log_file=workspace / "pytriton.log",
            )
        )
        self.triton.bind(
            model_name="echo",
            infer_func=[echo] * instances,
            inputs=[Tensor(name="x", dtype=np.float32, shape=(-1,))],
            outputs=[
                Tensor(name="y", dtype=np.float32, shape=(-1,)),
                Tensor(name="seen_ns", dtype=np.int64, shape=(1,)),
            ],
            config=ModelConfig(batching=False),
            strict=True,
        )
        self.triton.run()
        self.pids = [os.getpid()]  # Triton and its stubs are this process's children

    def stop(self) -> None:
        self.triton.stop()


def wait_ready(port: int) -> None:
    import tritonclient.http as th

    c = th.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if c.is_model_ready("echo"):
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError("the echo model did not come up")


def one_at_a_time(server, protocol: str, n: int) -> tuple[np.ndarray, float, float]:
    """Latencies (ms) of n requests sent one after another; CPU seconds per request of the
    server's processes (with this process, where PyTriton's callables run) and of this
    process alone (the client, when the server runs elsewhere)."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    mod = th if protocol == "http" else tg
    port = server.http if protocol == "http" else server.grpc
    client = mod.InferenceServerClient(f"127.0.0.1:{port}")
    i = mod.InferInput("x", [16], "FP32")
    i.set_data_from_numpy(np.ones(16, np.float32))
    for _ in range(20):  # warm
        client.infer("echo", [i])
    lat = []
    cpu0, own0 = cpu_seconds(server.pids), time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        client.infer("echo", [i])
        lat.append((time.perf_counter() - t) * 1e3)
    cpu, own = cpu_seconds(server.pids) - cpu0, time.process_time() - own0
    return np.asarray(lat), cpu / n, own / n


def burst(server, n: int, hold_ms: float) -> tuple[float, float]:
    """n concurrent gRPC requests, each held hold_ms: seconds until the last answer, and the
    p99 of sent -> seen by the model (ms)."""
    import tritonclient.grpc as tg
    import tritonclient.grpc.aio as tga

    async def run() -> tuple[float, list[float]]:
        client = tga.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        i = tg.InferInput("x", [16], "FP32")
        i.set_data_from_numpy(np.ones(16, np.float32))

        async def one() -> float:
            sent = time.monotonic_ns()
            r = await client.infer("echo", [i], parameters={"hold_ms": hold_ms})
            return (int(r.as_numpy("seen_ns")[0]) - sent) / 1e6

        t0 = time.monotonic()
        waits = await asyncio.gather(*(one() for _ in range(n)))
        took = time.monotonic() - t0
        await client.close()
        return took, waits

    took, waits = asyncio.run(run())
    return took, float(np.percentile(waits, 99))


def _row(args, now, config: str, metric: str, value) -> dict:
    """A bench_serving row of this benchmark."""
    return {
        "run_at": now,
        "run_label": args.label,
        "bench": "ingress",
        "config": config,
        "metric": metric,
        "value": float(value),
        "host": socket.gethostname(),
    }


def sent_to_seen(server, protocol: str, mb: float, n: int) -> np.ndarray:
    """ms from sending an input of `mb` MB until the sink model's execute saw it, n requests
    one at a time (after 5 to warm)."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    mod = th if protocol == "http" else tg
    port = server.http if protocol == "http" else server.grpc
    client = mod.InferenceServerClient(f"127.0.0.1:{port}")
    x = np.random.default_rng(0).random((1, max(1, int(mb * 1e6 / 4))), dtype=np.float32)
    seen = []
    for k in range(n + 5):
        i = mod.InferInput("x", list(x.shape), "FP32")
        if protocol == "http":
            i.set_data_from_numpy(x, binary_data=True)
            wanted = [th.InferRequestedOutput("seen_ns", binary_data=True)]
        else:
            i.set_data_from_numpy(x)
            wanted = [tg.InferRequestedOutput("seen_ns")]
        sent = time.monotonic_ns()
        r = client.infer("sink", [i], outputs=wanted, parameters={"sink": True})
        if k >= 5:
            seen.append((int(r.as_numpy("seen_ns").flat[0]) - sent) / 1e6)
    client.close()
    return np.asarray(seen)


def feed_to_seen(server, mb: float, n: int) -> np.ndarray:
    """ms from sending an input of `mb` MB with its call into the node's feed (a ``C``
    message) until the sink model's execute saw it, n requests one at a time (after 5 to
    warm)."""
    import json
    import struct

    import tritonclient.http as th

    from triton_backend.node.feed import FEED_MAGIC, FEED_REGION, FeedRegion, http_answer
    from triton_backend.node.watch import NodeWatch

    feed = FeedRegion(max(16, int(4 * mb) + 1))
    feed.triton = f"127.0.0.1:{server.http}"
    client = th.InferenceServerClient(feed.triton)
    watch = None
    try:
        feed.register(client, None)
        watch = NodeWatch("127.0.0.1", 0, feed)
        x = np.random.default_rng(0).random((1, max(1, int(mb * 1e6 / 4))), dtype=np.float32)
        where = {"shared_memory_offset": 0, "shared_memory_byte_size": x.nbytes}
        request = {
            "inputs": [
                {"name": "x", "shape": list(x.shape), "datatype": "FP32", "parameters": where}
            ],
            "outputs": [{"name": "seen_ns", "parameters": {"binary_data": False}}],
            "parameters": {"sink": True},
        }
        text = json.dumps({"model": "sink", "request": request}).encode()
        seen = []
        with socket.create_connection(("127.0.0.1", watch.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(FEED_MAGIC)
            for k in range(n + 5):
                sent = time.monotonic_ns()
                sock.sendall(b"C" + struct.pack(">Q", x.nbytes))
                sock.sendall(memoryview(x).cast("B"))
                sock.sendall(struct.pack(">I", len(text)) + text)
                head, _, body = http_answer(sock)[0].partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the feed's call failed: {body[:200]!r}")
                if k >= 5:
                    out = json.loads(body)["outputs"][0]["data"][0]
                    seen.append((int(out) - sent) / 1e6)
        client.unregister_system_shared_memory(FEED_REGION)
        return np.asarray(seen)
    finally:
        if watch is not None:
            watch.close()
        client.close()
        feed.close()


def socket_ms(mb: float, n: int) -> np.ndarray:
    """ms to send `mb` MB through a TCP socket on loopback until the receiver has it all
    (its one-byte receipt back), n times."""
    import threading

    data = bytes(max(1, int(mb * 1e6)))
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            for _ in range(n + 5):
                got = 0
                while got < len(data):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        return
                    got += len(chunk)
                conn.sendall(b"k")

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    out = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for k in range(n + 5):
            a = time.monotonic_ns()
            c.sendall(data)
            c.recv(1)
            if k >= 5:
                out.append((time.monotonic_ns() - a) / 1e6)
    t.join(5)
    srv.close()
    return np.asarray(out)


def sizes(args, now, rows: list[dict]) -> None:
    table = Table(title="an input into a Python-backend model: sent -> execute saw it (ms)")
    cols = (
        "MB",
        "HTTP p50 / p90",
        "gRPC p50 / p90",
        "gRPC / HTTP",
        "feed p50 / p90",
        "TCP socket p50",
    )
    for col in cols:
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="bench-ingress-") as tmp:
        with console.status("native: starting ..."):
            server = Native(Path(tmp))
        try:
            wait_ready(server.http)
            for mb in args.sizes_mb:
                with console.status(f"{mb:g} MB ..."):
                    got = {
                        p: sent_to_seen(server, p, mb, args.size_requests) for p in ("http", "grpc")
                    }
                    got["feed"] = feed_to_seen(server, mb, args.size_requests)
                    tcp = socket_ms(mb, args.size_requests)
                for protocol, ms in [*got.items(), ("socket", tcp)]:
                    for q in (50, 90):
                        rows.append(
                            _row(
                                args,
                                now,
                                f"native {protocol} {mb:g} MB",
                                f"sent_to_seen_p{q}_ms",
                                np.percentile(ms, q),
                            )
                        )
                h, g, fd = got["http"], got["grpc"], got["feed"]
                table.add_row(
                    f"{mb:g}",
                    f"{np.percentile(h, 50):.2f} / {np.percentile(h, 90):.2f}",
                    f"{np.percentile(g, 50):.2f} / {np.percentile(g, 90):.2f}",
                    f"{np.percentile(g, 50) / np.percentile(h, 50):.2f}x",
                    f"{np.percentile(fd, 50):.2f} / {np.percentile(fd, 90):.2f}",
                    f"{np.percentile(tcp, 50):.2f}",
                )
        finally:
            server.stop()
    console.print(table)


def main() -> int:
    teardown_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--warehouse", default=None)
    ap.add_argument("--label", default="bench")
    ap.add_argument("--requests", type=int, default=500, help="one-at-a-time requests (500)")
    ap.add_argument("--burst", type=int, default=500, help="concurrent requests (500)")
    ap.add_argument("--hold-ms", type=float, default=100.0, help="each burst request's hold")
    ap.add_argument("--instances", type=int, default=8, help="PyTriton instances (8)")
    ap.add_argument(
        "--parts", default="ingress,sizes", help="ingress (echo, bursts), sizes (MB inputs)"
    )
    ap.add_argument("--sizes-mb", default="0.004,1,4.3", help="input sizes of the sizes part (MB)")
    ap.add_argument("--size-requests", type=int, default=40, help="requests per size (40)")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"ingress", "sizes"}:
        ap.error(f"--parts: choose among ingress, sizes (got {args.parts!r})")
    try:
        args.sizes_mb = [float(x) for x in args.sizes_mb.split(",")]
    except ValueError:
        ap.error(f"--sizes-mb: numbers of MB joined by commas (got {args.sizes_mb!r})")
    if not all(0 < x <= 64 for x in args.sizes_mb):
        ap.error("--sizes-mb: each size above 0 and at most 64 MB")

    now = datetime.now(UTC).replace(tzinfo=None)
    rows: list[dict] = []
    table = Table(title="router ingress: echo through PyTriton vs Triton's Python backend")
    for col in ("mechanism", "HTTP p50/p99 ms", "gRPC p50/p99 ms", "server CPU µs/req"):
        table.add_column(col, justify="right")
    table.add_column(
        f"burst {args.burst} × hold {args.hold_ms:g} ms: last answer s", justify="right"
    )
    table.add_column("sent → seen p99 ms", justify="right")
    client_cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-ingress-") as tmp:
        for kind in ("native", "pytriton") if "ingress" in parts else ():
            ws = Path(tmp) / kind
            ws.mkdir()
            with console.status(f"{kind}: starting ..."):
                server = Native(ws) if kind == "native" else PyTritonEcho(ws, args.instances)
            try:
                wait_ready(server.http)
                label = kind if kind == "native" else f"pytriton ×{args.instances}"
                with console.status(f"{kind}: one request at a time ..."):
                    http, _, _ = one_at_a_time(server, "http", args.requests)
                    grpc, cpu, own = one_at_a_time(server, "grpc", args.requests)
                if kind == "native":  # this process was the client alone
                    client_cpu = own
                else:  # PyTriton's callables share this process with the client
                    cpu -= client_cpu
                with console.status(f"{kind}: burst ..."):
                    took, seen99 = burst(server, args.burst, args.hold_ms)
            finally:
                server.stop()
            figures = {
                "http_p50_ms": np.percentile(http, 50),
                "http_p99_ms": np.percentile(http, 99),
                "grpc_p50_ms": np.percentile(grpc, 50),
                "grpc_p99_ms": np.percentile(grpc, 99),
                "cpu_us_per_request": cpu * 1e6,
                "burst_last_answer_s": took,
                "burst_sent_to_seen_p99_ms": seen99,
            }
            for metric, value in figures.items():
                rows.append(_row(args, now, label, metric, value))
            f = figures
            table.add_row(
                label,
                f"{f['http_p50_ms']:.2f} / {f['http_p99_ms']:.2f}",
                f"{f['grpc_p50_ms']:.2f} / {f['grpc_p99_ms']:.2f}",
                f"{f['cpu_us_per_request']:.0f}",
                f"{took:.2f}",
                f"{seen99:.1f}",
            )
    if "ingress" in parts:
        console.print(table)
    if "sizes" in parts:
        sizes(args, now, rows)
    with Warehouse.open(args.warehouse) as wh:
        wh.store_rows("bench_serving", rows)
        console.print(f"stored {len(rows)} rows in {wh.path} (bench_serving, bench = ingress)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
