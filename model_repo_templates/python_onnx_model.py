"""Triton Python-backend model: one partition (an ONNX file) run with ONNX Runtime.

Uploaded to each node as <partition>/1/model.py beside model.onnx; the thread count comes
from the config's `intra_op_threads` parameter (a node class's device type), the execution
providers from `providers` (on GPU nodes CUDA, TensorRT first where onnxruntime-gpu has it;
each instance on the GPU Triton gives it).

Called plainly, it answers its partition's outputs. Called as a hop of a chain (request
parameter `poolpipe_next`: JSON list of the hops after this one, each {"url", "model"} and
optionally "after_us" and "http"; `[]` on the last), it sends its feature map straight to
the next hop's node with the rest of the chain, over KServe v2 HTTP to "http" where the hop
has one (_HttpHops; its bytes through the node's feed, "feed", where the hop names one),
else over gRPC to "url" (no sooner than "after_us" after it took the
request, or than "at_ns" on this host's CLOCK_MONOTONIC where the hop has it and it is
sooner: the transfer's reserved start, so that a stage ending early does not send into a
link the router reserved for another transfer, and one that began late but ended in time
sends in its slot; the instance is free meanwhile) and
answers, once the chain's answer comes back, the whole model's outputs
(`poolpipe_outputs`: their names) and POOLPIPE_HOPS: per row, (start, end, sent) in
nanoseconds of each hop's own monotonic clock, this hop first: start when the instance took
the request (before reading its inputs), end when its outputs were ready to go (the feature
map encoded for the next hop), sent when they went: the instance's own time, nearer to
what the router's calibration measures through a whole call than its compute alone (the
router's recalibration compares the two). What Triton spends before `execute`, handing the
stub its inputs, is still outside it: on emulated hc2-small at D = 10, about 7 ms beside
googlenet-v3's 42-ms T4 stage, where the stub's own reading and encoding take about 1 ms.
Its instance is free for the next batch while the rest of the chain runs. Where the chain ends in {"answer": "host:port",
"id"} (the router's inbox, triton_backend/router/answers.py), the last hop sends the model's
outputs there instead, with every hop's times (`poolpipe_hops`: those of the hops before,
carried along), from a sender thread per inbox, and the calls back along the chain carry
POOLPIPE_HOPS alone (`poolpipe_outputs` is then []). `poolpipe_budget_us` (optional): the time
left until the chain must be done; the next hop gets what is left of it after this hop's
compute, and a hop with nothing left does not forward ("POOLPIPE_HOP 1: POOLPIPE_DEADLINE
..."). (A queue policy refusing hops that waited past a timeout was tried: this Triton's
dynamic batcher then stalled calls for 0.5 s now and then.) With a `poolpipe_key`
parameter in the config, a chain is followed only when `poolpipe_sig` (HMAC-SHA256 of the
chain with the key) is right: nobody without it can make the node send data elsewhere. An
error down the chain is answered as "POOLPIPE_HOP k: ..." with k the failing hop, counted
from this one.

On a node that emulates a GPU device type (`poolpipe node --emulate`: its Triton has
POOLPIPE_EMULATE_TIME_SCALE = D), the partition runs its ONNX file on the CPU (a shadow
model's trivial compute) and completes each batch at its start + the profiled latency of
its block range at that batch size (1/emulation.json, which the router uploads with it) x
D: never earlier, waiting without holding a CPU. A batch larger than the profiled sizes is
refused. Each emulated stage is counted in poolpipe_emulated_stages_total{model, late}: late
when it ended more than max(0.3 ms, 2%) after its due time (the host, not the emulated GPU,
was the bottleneck).
"""

import hashlib
import hmac
import json
import os
import queue
import select
import socket
import struct
import threading
import time

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

# Imported with the model, not on a chain's first forward: there the import (and gRPC's
# set-up) took ~100 ms, so a new generation's first chains missed short SLOs.
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
EMULATE = os.environ.get("POOLPIPE_EMULATE_TIME_SCALE")  # D, on nodes that emulate a GPU
LATE_FLOOR_NS, LATE_SHARE = 300_000, 0.02  # an emulated stage later than this is counted
HOPS = "POOLPIPE_HOPS"
FORWARD_TIMEOUT_S = 60.0
# The next node's feed (triton_backend/node/feed.py: its protocol): a feature map of at
# least FEED_MIN_BYTES goes with its call to the node's process over its watch port, which
# places it in shared memory and calls its Triton; an address whose feed could not be
# reached is not tried again for FEED_RETRY_S.
FEED_MAGIC = b"POOLPIPE-FEED/1\n"
FEED_ALIGN = 64
# (the node's environment may lower it: POOLPIPE_FEED_MIN_BYTES, the cluster tests' tiny maps)
FEED_MIN_BYTES = int(os.environ.get("POOLPIPE_FEED_MIN_BYTES", 64 << 10))
FEED_RETRY_S = 10.0


class _HttpHops:
    """Feature maps to the next hop over KServe v2 HTTP with binary tensors, where the chain
    names the hop's HTTP address ("http"). On loopback here 4.3 MB reached a Python-backend
    model 1.1-2.6x sooner this way than through tritonclient's gRPC client (`./run
    bench-ingress --parts sizes`; a TCP socket alone: 1.2-1.8 ms); over gRPC googlenet-v3's
    feature maps reached their next node 1.1-1.7x their reserved transfers. Each call waits
    for the rest of the chain on a thread of a pool (the instance is free meanwhile), on a
    kept-alive connection of the address's; one whose reused connection was closed before
    any answer came goes again once on a new one.

    Where the hop names the next node's feed ("feed": its watch address), a map of
    FEED_MIN_BYTES or more goes with its call over a kept-alive connection there (a ``C``
    message): the node places it in its shared memory and calls its own Triton with the
    inputs named there (Triton's system shared memory), past the HTTP front end, which took
    8.7 ms to hand a 2.7 MB map to a model here, the feed 1.7 (p50, loopback: `./run
    bench-ingress --parts sizes`); the answer comes back on the same connection. A feed
    that cannot be reached: the map goes inline."""

    WORKERS = 32

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.sent = {"feed": 0, "inline": 0}  # maps sent each way
        self.pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="poolpipe-hop")
        self.idle = {}  # address -> idle connections
        self.feed_idle = {}  # feed address -> idle connections
        self.feed_off = {}  # feed address -> when to try it again
        self.lock = threading.Lock()

    def infer(self, address, model, arrays, outputs, parameters, done, feed=None):
        """Call `model` at `address` with `arrays` (in_0, in_1, ...), through the node's
        feed at `feed` where given; `done(result, error)` from a pool thread:
        result.as_numpy(name), or error (a str) and None."""
        self.pool.submit(self._call, address, model, arrays, outputs, parameters, done, feed)

    def _call(self, address, model, arrays, outputs, parameters, done, feed=None):
        try:
            xs = [np.ascontiguousarray(x) for x in arrays]
            got = None
            if feed and sum(x.nbytes for x in xs) >= FEED_MIN_BYTES:
                got = self._feed_call(feed, model, xs, outputs, parameters)
            with self.lock:
                self.sent["inline" if got is None else "feed"] += 1
            if got is None:
                text = json.dumps(
                    _header(xs, [{"binary_data_size": x.nbytes} for x in xs], outputs, parameters),
                    separators=(",", ":"),
                ).encode()
                parts = [memoryview(x).cast("B") for x in xs]
                head = (
                    f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {address}\r\n"
                    "Content-Type: application/octet-stream\r\n"
                    f"Inference-Header-Content-Length: {len(text)}\r\n"
                    f"Content-Length: {len(text) + sum(len(p) for p in parts)}\r\n\r\n"
                ).encode() + text
                got = self._send(address, [head, *parts])
            status, size, body = got
        except Exception as exc:  # unreachable, timed out, closed
            done(None, str(exc) or type(exc).__name__)
            return
        if status != 200:
            try:
                why = str(json.loads(body)["error"])
            except (ValueError, KeyError, TypeError):
                why = f"HTTP {status}: {body[:200].decode(errors='replace')}"
            done(None, why)
            return
        done(_HttpResult(body, size), None)

    def _feed_call(self, feed, model, xs, outputs, parameters):
        """Call `model` with `xs` through the next node's feed at `feed` (a ``C`` message:
        the arrays and the call in one write, the node's Triton called there): (status,
        size, body), or None where the feed cannot be used (none there, it broke): the
        call then goes inline."""
        with self.lock:
            if self.feed_off.get(feed, 0.0) > time.monotonic():
                return None
            idle = self.feed_idle.setdefault(feed, [])
            sock = idle.pop() if idle else None
        sizes = [-(-x.nbytes // FEED_ALIGN) * FEED_ALIGN for x in xs]
        where = [
            {"shared_memory_offset": sum(sizes[:k]), "shared_memory_byte_size": x.nbytes}
            for k, x in enumerate(xs)
        ]
        call = {"model": model, "request": _header(xs, where, outputs, parameters)}
        text = json.dumps(call, separators=(",", ":")).encode()
        message = [b"C" + struct.pack(">Q", sum(sizes))]
        for x, n in zip(xs, sizes):
            message += [memoryview(x).cast("B"), bytes(n - x.nbytes)]
        message.append(struct.pack(">I", len(text)) + text)
        for fresh in (sock is None, True):
            try:
                if fresh:
                    sock = self._feed_connection(feed)
                try:
                    for part in message:
                        sock.sendall(part)
                except OSError as exc:
                    raise _Unanswered(str(exc)) from None
                return self._read_answer(sock, self.feed_idle.setdefault(feed, []))
            except _Unanswered:  # a kept connection the node closed; or no feed there
                if sock is not None:
                    sock.close()
                sock = None
                if fresh:  # no feed there (a node without one, or an older one): inline
                    with self.lock:
                        self.feed_off[feed] = time.monotonic() + FEED_RETRY_S
                    return None
        return None

    @staticmethod
    def _feed_connection(feed):
        host, _, port = feed.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(FORWARD_TIMEOUT_S)
        sock.sendall(FEED_MAGIC)
        return sock

    def _send(self, address, parts):
        with self.lock:
            idle = self.idle.setdefault(address, [])
            sock = idle.pop() if idle else None
        if sock is not None:
            try:
                return self._exchange(address, sock, parts)
            except _Unanswered:
                pass  # the node closed it while idle: once more on a new connection
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._exchange(address, sock, parts)

    def _exchange(self, address, sock, parts):
        try:
            sock.settimeout(FORWARD_TIMEOUT_S)
            try:
                for part in parts:
                    sock.sendall(part)
            except OSError as exc:
                raise _Unanswered(str(exc)) from None
        except BaseException:
            sock.close()
            raise
        return self._read_answer(sock, self.idle.setdefault(address, []))

    def _read_answer(self, sock, idle):
        """(status, inference header size, body) of the HTTP answer on `sock`; the
        connection back to `idle` after it unless the answer closes it."""
        try:
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise (
                        _Unanswered("closed before answering")
                        if not buf
                        else OSError("closed in its answer's head")
                    )
                buf += chunk
            raw, _, rest = buf.partition(b"\r\n\r\n")
            lines = raw.split(b"\r\n")
            status = int(lines[0].split(None, 2)[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            need = int(headers.get(b"content-length", b"0"))
            body = bytearray(need)
            view = memoryview(body)
            got = min(len(rest), need)
            view[:got] = rest[:got]
            while got < need:
                n = sock.recv_into(view[got:])
                if not n:
                    raise OSError("closed in its answer's body")
                got += n
            size = int(headers.get(b"inference-header-content-length", need))
        except BaseException:
            sock.close()
            raise
        if headers.get(b"connection", b"").lower() == b"close":
            sock.close()
        else:
            with self.lock:
                idle.append(sock)
        return status, size, bytes(body)

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for socks in [*self.idle.values(), *self.feed_idle.values()]:
                for sock in socks:
                    sock.close()
            self.idle.clear()
            self.feed_idle.clear()


def _header(xs, where, outputs, parameters):
    """A KServe v2 request header: inputs in_0, in_1, ... of `xs`, each with its
    parameters from `where`; `outputs` binary."""
    return {
        "inputs": [
            {
                "name": f"in_{k}",
                "shape": list(x.shape),
                "datatype": np_to_triton_dtype(x.dtype),
                "parameters": w,
            }
            for k, (x, w) in enumerate(zip(xs, where))
        ],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs],
        "parameters": parameters,
    }


class _Unanswered(OSError):
    """A kept connection closed before any byte of the answer came."""


class _HttpResult:
    """An answer's binary outputs by name, as tritonclient's results give them."""

    def __init__(self, body, size):
        self.arrays = {}
        offset = size
        for o in json.loads(body[:size]).get("outputs", []):
            dtype = np.dtype(triton_to_np_dtype(o["datatype"]))
            n = o.get("parameters", {}).get("binary_data_size")
            if n is None:
                self.arrays[o["name"]] = np.asarray(o["data"], dtype).reshape(o["shape"])
                continue
            self.arrays[o["name"]] = np.frombuffer(
                body, dtype, n // dtype.itemsize, offset
            ).reshape(o["shape"])
            offset += n

    def as_numpy(self, name):
        return self.arrays[name]


def chain_signature(key, chain):
    return hmac.new(key.encode(), chain.encode(), hashlib.sha256).hexdigest()


def _carried(params):
    """The times (start, end, sent ns) of the chain's hops before this one."""
    text = params.get("poolpipe_hops", "")
    return [int(t) for t in text.split(",")] if text else []


def _exit_with_server() -> None:
    """Leave as soon as the Triton that started this stub has gone. The stub watches its
    server by sending it signal 0, which a server that died but is not yet reaped (a zombie)
    still passes: a node's Triton killed outright, or given up on by the router killed
    outright (pid 1 reaps such orphans when it gets to it), left its stubs running, each
    with its shared-memory region. A thread waits on the server's pidfd, readable once the
    server has exited, reaped or not (no polling: with a thread waking twice a second
    instead, ppipe kept 0.973 on time at 212 req/s in two main jobs, 0.985-0.992 in six
    without), then removes the region the stub's command line names (nobody else maps it
    now) and exits the stub. The same in
    triton_backend/router/door/model.py: each stub's model file stands alone."""
    try:
        server = os.pidfd_open(os.getppid())
    except (AttributeError, OSError):  # not Linux 5.3+: the stub as Triton made it
        return

    def watch() -> None:
        select.select([server], [], [])
        try:
            with open("/proc/self/cmdline", "rb") as f:
                for arg in f.read().split(b"\0"):
                    if arg.startswith(b"triton_python_backend_shm_region"):
                        os.unlink(os.path.join("/dev/shm", arg.decode()))
        except OSError:
            pass
        os._exit(0)

    threading.Thread(target=watch, name="poolpipe-server-watch", daemon=True).start()


class TritonPythonModel:
    def initialize(self, args):
        _exit_with_server()
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        # as profiled (poolpipe.offline.engines.OrtEngine): idle threads must not spin
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.name = config.get("name", "partition")
        self.table_ns = None
        if EMULATE:
            self._emulate(args, float(EMULATE))
            so.intra_op_num_threads = 1
        wanted = (
            ["CPUExecutionProvider"]
            if EMULATE
            else params.get("providers", "CPUExecutionProvider").split(",")
        )
        have = ort.get_available_providers()
        providers = [p for p in wanted if p in have]
        if not providers:
            raise RuntimeError(
                f"none of the execution providers {wanted} is in this node's onnxruntime "
                f"({have}); a GPU node needs onnxruntime-gpu"
            )
        # the GPU this partition runs on: on a node of several GPUs (poolpipe node --gpus)
        # its model names one (poolpipe_gpu); else device 0 of those the node sees
        device = params.get("poolpipe_gpu") or str(args.get("model_instance_device_id", "0"))
        options = [{"device_id": device} if p != "CPUExecutionProvider" else {} for p in providers]
        self.session = ort.InferenceSession(path, so, providers=providers, provider_options=options)
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.key = params.get("poolpipe_key") or None
        self.clients = {}
        # the maps sent each way, counted from `execute` (a metric changed from another
        # thread crashed Triton), its family made once a map was sent: a model holding one
        # left its shared-memory region behind when its Triton was killed outright
        # (tests/test_serving.py::test_a_crashed_nodes_stubs_and_shared_memory_are_cleaned_up)
        self.ways = None
        self.counted = {"feed": 0, "inline": 0}
        self.http = _HttpHops()
        self.outboxes = {}  # the router's inbox address -> its answers' queue
        self.lock = threading.Lock()

    def execute(self, requests):
        self._count_maps()
        for request in requests:
            began = time.monotonic_ns()  # the instance's time for this request (see above)
            sender = request.get_response_sender()
            try:
                params = json.loads(request.parameters() or "{}")
                feeds = {
                    name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in self.inputs
                }
                chain = params.get("poolpipe_next")
                if chain is not None:
                    self._check(chain, params.get("poolpipe_sig", ""))
                start = time.monotonic_ns()  # (its wait in this node's queue is not known)
                due = None if self.table_ns is None else self._due(start, feeds)
                outs = self.session.run(self.outputs, feeds)
                end = time.monotonic_ns() if due is None else self._until(due)
                if chain is None:
                    self._send(sender, dict(zip(self.outputs, outs)))
                    continue
                hops = json.loads(chain)
                rows = len(outs[0])
                if not hops:  # the last hop: the model's outputs and this hop's times
                    mine = np.tile(np.array([began, end, end], np.int64), (rows, 1))
                    self._send(sender, {**dict(zip(self.outputs, outs)), HOPS: mine})
                    continue
                if "answer" in hops[0]:  # the last hop: its outputs straight to the router
                    times = [*_carried(params), began, end, end]
                    self._answer(sender, hops[0], times, dict(zip(self.outputs, outs)), rows)
                    continue
                self._forward(sender, outs, hops, params, began)
            except Exception as exc:  # answer this request with the error, keep serving
                self._fail(sender, f"POOLPIPE_HOP 0: {exc}")
        return None

    def _count_maps(self):
        with self.http.lock:
            sent = dict(self.http.sent)
        if sent == self.counted:
            return
        if self.ways is None:
            self.maps = maps = pb_utils.MetricFamily(  # kept: its metrics need it
                name="poolpipe_feature_maps_total",
                description="Feature maps sent on to the next hop over HTTP (via: feed, the "
                "next node's shared memory; inline, in the call)",
                kind=pb_utils.MetricFamily.COUNTER,
            )
            self.ways = {v: maps.Metric(labels={"model": self.name, "via": v}) for v in sent}
        for via, n in sent.items():
            if n > self.counted[via]:
                self.ways[via].increment(n - self.counted[via])
        self.counted = sent

    # ------------------------------------------------------------------ emulation

    def _emulate(self, args, scale):
        path = os.path.join(args["model_repository"], args["model_version"], "emulation.json")
        if not os.path.exists(path):
            raise RuntimeError(
                f"{self.name}: this node emulates a GPU (--emulate) but the partition came "
                "without its profiled latencies (1/emulation.json): is the node's device in "
                "the inventory a GPU type?"
            )
        with open(path) as f:
            table = json.load(f)["latency_us"]
        if not table or not all(x > 0 for x in table):
            raise RuntimeError(f"{self.name}: emulation.json has no positive latencies")
        self.table_ns = [int(x * scale * 1e3) for x in table]
        self.family = family = pb_utils.MetricFamily(  # kept: its metrics need it
            name="poolpipe_emulated_stages_total",
            description="Emulated stages (late: ended beyond max(0.3 ms, 2%) after due)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.on_time = family.Metric(labels={"model": self.name, "late": "false"})
        self.late = family.Metric(labels={"model": self.name, "late": "true"})

    def _due(self, start, feeds):
        rows = len(next(iter(feeds.values())))
        if not 1 <= rows <= len(self.table_ns):
            raise ValueError(
                f"a batch of {rows} is beyond the profiled batch sizes 1..{len(self.table_ns)} "
                f"of {self.name}"
            )
        return start, self.table_ns[rows - 1]

    def _until(self, due):
        """Wait (asleep) until the emulated stage is due; count it, late or not."""
        start, took = due
        left = start + took - time.monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9)
        end = time.monotonic_ns()
        over = end - start - took
        (self.late if over > max(LATE_FLOOR_NS, LATE_SHARE * took) else self.on_time).increment(1)
        return end

    # ------------------------------------------------------------------ chains

    def _check(self, chain, sig):
        if self.key is not None and not hmac.compare_digest(
            chain_signature(self.key, chain), str(sig)
        ):
            raise ValueError("refused: the chain is not signed with this cluster's key")

    def _client(self, url):
        with self.lock:
            c = self.clients.get(url)
            if c is None:
                c = self.clients[url] = grpcclient.InferenceServerClient(url)
            return c

    def _forward(self, sender, outs, hops, params, start):
        """Send the feature map to the next hop (at its reserved transfer start, counted
        from `start`: when this hop took the request, or on this host's clock where the hop
        has it and it is sooner); answer when the chain's answer is back."""
        nxt, rest = hops[0], json.dumps(hops[1:])
        names = json.loads(params.get("poolpipe_outputs", "[]"))
        if nxt.get("http"):  # over HTTP (_HttpHops): the arrays as they are
            inputs = [np.ascontiguousarray(x) for x in outs]
            wanted = [*names, HOPS]
        else:
            inputs = []
            for k, x in enumerate(outs):
                t = grpcclient.InferInput(f"in_{k}", list(x.shape), np_to_triton_dtype(x.dtype))
                t.set_data_from_numpy(np.ascontiguousarray(x))
                inputs.append(t)
            wanted = [grpcclient.InferRequestedOutput(n) for n in [*names, HOPS]]
        end = time.monotonic_ns()  # its outputs ready to go
        forward = {"poolpipe_next": rest, "poolpipe_outputs": json.dumps(names)}
        if self.key is not None:
            forward["poolpipe_sig"] = chain_signature(self.key, rest)
        due = start + int(float(nxt.get("after_us", 0)) * 1e3)
        if nxt.get("at_ns") is not None:  # the reserved start on this host's clock
            due = min(due, int(nxt["at_ns"]))
        wait = due - time.monotonic_ns()
        if wait > 0:  # its reserved transfer start: sent then, from a timer
            timer = threading.Timer(
                wait / 1e9,
                self._send_on,
                (sender, nxt, inputs, wanted, forward, params, names, start, end),
            )
            timer.daemon = True
            timer.start()
            return
        self._send_on(sender, nxt, inputs, wanted, forward, params, names, start, end)

    def _send_on(self, sender, nxt, inputs, wanted, forward, params, names, start, end):
        sent = time.monotonic_ns()
        if params.get("poolpipe_budget_us") is not None:
            left = int(float(params["poolpipe_budget_us"]) - (sent - start) / 1e3)
            if left <= 0:
                self._fail(sender, "POOLPIPE_HOP 1: POOLPIPE_DEADLINE: no time left to forward")
                return
            forward["poolpipe_budget_us"] = str(left)
        # every hop's times travel on with the feature map, for an answer sent straight
        # to the router from the last node
        forward["poolpipe_hops"] = ",".join(str(t) for t in [*_carried(params), start, end, sent])

        def done(result, error):
            try:
                if error is not None:
                    message = error.message() if hasattr(error, "message") else str(error)
                    if message.startswith("POOLPIPE_HOP "):  # renumber from this hop
                        k, _, why = message[len("POOLPIPE_HOP ") :].partition(":")
                        message = f"POOLPIPE_HOP {int(k) + 1}:{why}"
                    else:
                        message = f"POOLPIPE_HOP 1: {nxt.get('http') or nxt['url']}: {message}"
                    self._fail(sender, message)
                    return
                answer = {n: result.as_numpy(n) for n in names}
                theirs = result.as_numpy(HOPS)
                mine = np.tile(np.array([start, end, sent], np.int64), (len(theirs), 1))
                answer[HOPS] = np.concatenate([mine, theirs], axis=1)
                self._send(sender, answer)
            except Exception as exc:
                self._fail(sender, f"POOLPIPE_HOP 0: {exc}")

        if nxt.get("http"):
            self.http.infer(
                nxt["http"], nxt["model"], inputs, wanted, forward, done, nxt.get("feed")
            )
            return
        self._client(nxt["url"]).async_infer(
            nxt["model"],
            inputs,
            done,
            outputs=wanted,
            parameters=forward,
            client_timeout=FORWARD_TIMEOUT_S,
        )

    # ------------------------------------------------------------------ answers

    def _answer(self, sender, to, times, tensors, rows):
        """Send the model's outputs to the router's inbox `to["answer"]` (host:port) from
        that address's sender thread (the instance is free meanwhile); then answer the call
        with this chain's hop times alone, or with the error if the answer could not go."""
        addr = str(to["answer"])
        with self.lock:
            out = self.outboxes.get(addr)
            if out is None:
                out = self.outboxes[addr] = queue.SimpleQueue()
                threading.Thread(target=self._answers, args=(addr, out), daemon=True).start()
        mine = np.tile(np.array(times[-3:], np.int64), (rows, 1))
        out.put((str(to["id"]), times, tensors, sender, mine))

    def _answers(self, addr, out):
        host, _, port = addr.rpartition(":")
        sock = None
        while True:
            key, times, tensors, sender, mine = out.get()
            arrays = [np.ascontiguousarray(v) for v in tensors.values()]
            head = json.dumps(
                {
                    "id": key,
                    "rows": [int(t) for t in times],
                    "tensors": [[n, a.dtype.str, list(a.shape)] for n, a in zip(tensors, arrays)],
                }
            ).encode()
            error = None
            for _ in range(2):  # a connection the router closed: once more on a new one
                try:
                    if sock is None:
                        sock = socket.create_connection((host.strip("[]"), int(port)), 10)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(struct.pack(">I", len(head)) + head)
                    for a in arrays:
                        sock.sendall(memoryview(a).cast("B"))
                    error = None
                    break
                except OSError as exc:
                    error = exc
                    if sock is not None:
                        sock.close()
                    sock = None
            if error is None:
                self._send(sender, {HOPS: mine})
            else:
                self._fail(sender, f"POOLPIPE_HOP 0: its answer to the router at {addr}: {error}")

    @staticmethod
    def _send(sender, tensors):
        sender.send(
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in tensors.items()
                ]
            ),
            flags=FINAL,
        )

    @staticmethod
    def _fail(sender, message):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def finalize(self):
        for c in self.clients.values():
            c.close()
        self.http.close()
