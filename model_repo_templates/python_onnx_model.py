"""Triton Python-backend model: one partition (an ONNX file) run with ONNX Runtime.

Uploaded to each node as <partition>/1/model.py beside model.onnx; the thread count comes
from the config's `intra_op_threads` parameter (a node class's device type), the execution
providers from `providers` (on GPU nodes CUDA, TensorRT first where onnxruntime-gpu has it;
each instance on the GPU Triton gives it).

Called plainly, it answers its partition's outputs. Called as a hop of a chain (request
parameter `poolpipe_next`: JSON list of the hops after this one, each {"url", "model"} and
optionally "after_us"; `[]` on the last), it sends its feature map straight to the next
hop's node with the rest of the chain (no sooner than "after_us" after it took the
request: the transfer's reserved start, so that a stage ending early does not send into a
link the router reserved for another transfer; the instance is free meanwhile) and
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
from tritonclient.utils import np_to_triton_dtype

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
EMULATE = os.environ.get("POOLPIPE_EMULATE_TIME_SCALE")  # D, on nodes that emulate a GPU
LATE_FLOOR_NS, LATE_SHARE = 300_000, 0.02  # an emulated stage later than this is counted
HOPS = "POOLPIPE_HOPS"
FORWARD_TIMEOUT_S = 60.0


def chain_signature(key, chain):
    return hmac.new(key.encode(), chain.encode(), hashlib.sha256).hexdigest()


def _carried(params):
    """The times (start, end, sent ns) of the chain's hops before this one."""
    text = params.get("poolpipe_hops", "")
    return [int(t) for t in text.split(",")] if text else []


class TritonPythonModel:
    def initialize(self, args):
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
        self.outboxes = {}  # the router's inbox address -> its answers' queue
        self.lock = threading.Lock()

    def execute(self, requests):
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
        from `start`: when this hop took the request); answer when the chain's answer is
        back."""
        nxt, rest = hops[0], json.dumps(hops[1:])
        names = json.loads(params.get("poolpipe_outputs", "[]"))
        inputs = []
        for k, x in enumerate(outs):
            t = grpcclient.InferInput(f"in_{k}", list(x.shape), np_to_triton_dtype(x.dtype))
            t.set_data_from_numpy(np.ascontiguousarray(x))
            inputs.append(t)
        end = time.monotonic_ns()  # its outputs ready to go
        wanted = [grpcclient.InferRequestedOutput(n) for n in [*names, HOPS]]
        forward = {"poolpipe_next": rest, "poolpipe_outputs": json.dumps(names)}
        if self.key is not None:
            forward["poolpipe_sig"] = chain_signature(self.key, rest)
        wait = start + int(float(nxt.get("after_us", 0)) * 1e3) - time.monotonic_ns()
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
                        message = f"POOLPIPE_HOP 1: {nxt['url']}: {message}"
                    self._fail(sender, message)
                    return
                answer = {n: result.as_numpy(n) for n in names}
                theirs = result.as_numpy(HOPS)
                mine = np.tile(np.array([start, end, sent], np.int64), (len(theirs), 1))
                answer[HOPS] = np.concatenate([mine, theirs], axis=1)
                self._send(sender, answer)
            except Exception as exc:
                self._fail(sender, f"POOLPIPE_HOP 0: {exc}")

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
