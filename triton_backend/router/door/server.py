"""The router's front door: its own tritonserver (KServe v2 HTTP/gRPC) with a Python-backend
model per served model name and `poolpipe_control`, through which other processes roll out
plans and read figures. Each of those models is model.py, which hands every request
to the router process at once over a Unix socket (inbox.py). Clients reach the runtime only
through here.

Why not PyTriton (the router's door before): measured with `./run bench-ingress`, an echo
through PyTriton cost 3.7 ms p50 and 3,939 µs of CPU per request, and a burst of 500 held
requests waited in Triton's queue out of sight (last answer after 6.7 s); through Triton's
own Python backend 0.66 ms, 540 µs and 0.47 s."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from poolpipe.client.control import CONTROL_MODEL
from poolpipe.runtime import FORWARDED_HEADERS
from triton_backend import DOOR_QUEUE, DOOR_RING_MB
from triton_backend.node.repository import kserve_dtype, triton_dtype
from triton_backend.node.triton import STALE_AFTER_S, TritonNode
from triton_backend.router.core import ModelIO, RouterCore
from triton_backend.router.door.inbox import Door
from triton_backend.router.served import refused

DOOR_MODEL = Path(__file__).with_name("model.py")
SHARED_MEMORY = Path("/dev/shm")
WARM_UP = 40  # requests per served model at start-up (a stub's first calls are slower)


MAX_ROWS = 4096  # rows per request the door takes (Triton refuses more with a 400)


def door_config(
    name: str,
    inputs: Sequence[tuple[str, str, Sequence[int]]],
    outputs: Sequence[tuple[str, str, Sequence[int]]],
    instances: int,
    socket_path: Path,
    batched: bool = True,
    wait_cap_ms: float = 100.0,
    senders: int = 4,
    ring: Path | None = None,
    ring_mb: float = 0.0,
    queue_wait_ms: float | None = None,
    queue_max: int = 0,
) -> str:
    """config.pbtxt of a door model: (name, TYPE_..., dims after the batch) per tensor.
    `batched`: Triton's dynamic batcher hands `execute` every request queued at that
    moment (each still a request of its own; nothing waits for a fuller batch), so a
    burst is handed over in a few calls instead of one call per request. `wait_cap_ms`:
    the most a request of a burst is taken to have waited in Triton before the door saw
    it; `senders`: threads sending answers side by side; `ring` / `ring_mb`: the folder of
    each instance's ring and its size (0: inputs go down the socket; see model.py).
    `queue_wait_ms` / `queue_max` (batched doors): Triton refuses a request (UNAVAILABLE,
    HTTP 503) that waited longer than that in its queue ahead of the door, or that finds
    `queue_max` requests there (None / 0: no bound). The door takes every queued request
    whenever it is free, so that queue only grows where the router's host cannot keep up:
    its requests then wait, unseen by the router, until they cannot be on time, and each
    holds its inputs (a 2.4-MB image at 43 req/s is 100 MB a second)."""

    def tensors(ts: Sequence[tuple[str, str, Sequence[int]]]) -> str:
        return ", ".join(
            f'{{ name: "{n}" data_type: {t} dims: [ '
            f"{', '.join(str(d) for d in (dims if batched else [-1, *dims]))} ] }}"
            for n, t, dims in ts
        )

    policy = []
    if queue_wait_ms is not None:
        policy += [
            "timeout_action: REJECT",
            f"default_timeout_microseconds: {queue_wait_ms * 1e3:.0f}",
        ]
    if queue_max > 0:
        policy.append(f"max_queue_size: {queue_max}")
    queue = f" default_queue_policy {{ {' '.join(policy)} }}" if policy else ""
    batching = (
        f"max_batch_size: {MAX_ROWS}\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: 0{queue} }}\n"
        if batched
        else "max_batch_size: 0\n"
    )
    return (
        f'name: "{name}"\nbackend: "python"\n{batching}'
        f"input [ {tensors(inputs)} ]\noutput [ {tensors(outputs)} ]\n"
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
        + "".join(
            f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
            for k, v in (
                ("poolpipe_door", socket_path),
                ("poolpipe_wait_cap_ms", f"{wait_cap_ms:g}"),
                ("poolpipe_senders", senders),
                ("poolpipe_door_ring", ring or ""),
                ("poolpipe_door_ring_mb", f"{ring_mb:g}" if ring else "0"),
            )
        )
    )


DOOR_PREFIX = "poolpipe-door-"
RING_PREFIX = "poolpipe-door-ring-"  # model.py's


def sweep_doors(
    root: Path | None = None, now: float | None = None, rings: Path = SHARED_MEMORY
) -> list[Path]:
    """Remove the door folders (`root`, default the temporary folder, /poolpipe-door-*) of
    routers killed outright, and return them: this user's, untouched for STALE_AFTER_S,
    whose socket takes no connection (a live router's does). So too a door's ring left in
    `rings` by a stub that died before its router mapped it (a mapped one has no name)."""
    root = Path(tempfile.gettempdir()) if root is None else root
    now = time.time() if now is None else now
    removed = []
    for f in rings.glob(f"{RING_PREFIX}*"):
        with contextlib.suppress(OSError):
            st = f.stat()
            if st.st_uid == os.getuid() and now - st.st_mtime > STALE_AFTER_S:
                f.unlink()
                removed.append(f)
    for d in root.glob(f"{DOOR_PREFIX}*"):
        if not d.is_dir() or d.name.startswith(RING_PREFIX):
            continue
        try:
            st = d.stat()
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime <= STALE_AFTER_S:
            continue
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(d / "door.sock"))
                continue  # a live router's
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


class Frontend:
    """The router's tritonserver on `address` (loopback by default) and its door; `warmed`
    counts the warm-up requests answered."""

    def __init__(
        self,
        core: RouterCore,
        ios: Sequence[ModelIO],
        workspace: Path,
        instances: int = 1,
        control: Callable[[dict], dict] | None = None,
        address: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        key: str | None = None,
        metrics_port: int = 0,
        ring_mb: float = DOOR_RING_MB,
        ring_dir: Path | None = None,
        queue_max: int = DOOR_QUEUE,
    ):
        """`key`: restricts this Triton's management APIs (model repository, ...), as the
        nodes' are. `metrics_port`: its own Prometheus metrics (0: a free one).
        `ring_mb`: each door instance's ring of inputs (0: none, inputs go down the door's
        socket), in `ring_dir` (default /dev/shm where there is one, else the door's own
        folder). `queue_max`: the requests each door's Triton queue holds at most (0: no
        bound); a request waits there no longer than the longest SLO served (door_config)."""
        if ring_mb < 0:
            raise ValueError(f"a door's ring takes 0 MB or more, got {ring_mb:g}")
        if queue_max < 0:
            raise ValueError(f"a door's queue holds 0 requests or more, got {queue_max}")
        self.core = core
        self.ios = list(ios)
        self.workspace = Path(workspace)
        self.instances = instances
        self.control = control
        self.ring_mb = ring_mb
        self.ring_dir = ring_dir
        self.queue_max = queue_max
        self.node = TritonNode(
            "router-triton",
            "router",
            self.workspace / "router-repo",
            self.workspace,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            address=address,
            key=key,
            # a load balancer's arrival stamp reaches the door as a request parameter
            options=(
                f"--http-header-forward-pattern={FORWARDED_HEADERS}",
                f"--grpc-header-forward-pattern={FORWARDED_HEADERS}",
            ),
        )
        self.warmed = 0
        self.door: Door | None = None
        self._dir: Path | None = None

    @property
    def http_port(self) -> int:
        return self.node.http_port

    @property
    def grpc_port(self) -> int:
        return self.node.grpc_port

    def start(self) -> Frontend:
        try:
            # The socket's path must fit in 108 bytes: a short private folder, not the
            # workspace (mkdtemp makes it 0700: only this user can reach the door).
            sweep_doors()
            self._dir = Path(tempfile.mkdtemp(prefix=DOOR_PREFIX))
            sock = self._dir / "door.sock"
            self.door = Door(self.core, sock, self.control).open()
            self._render(sock)
            self.node.start()
            # side by side: Triton loads them in parallel (each starts a Python stub, about
            # 1.5 s on two cores; four models 5.7 s one after another, 1.9 s together)
            names = [*(io.name for io in self.ios), *([CONTROL_MODEL] * bool(self.control))]
            with ThreadPoolExecutor(max(1, len(names))) as loads:
                list(loads.map(self.node.load, names))
            self._warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.node.stop()
        if self.door is not None:
            self.door.close()
            self.door = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _render(self, sock: Path) -> None:
        repo = self.node.repo
        shutil.rmtree(repo, ignore_errors=True)
        models = {
            io.name: (
                [(t.name, triton_dtype(t.dtype), t.dims) for t in io.inputs],
                [(t.name, triton_dtype(t.dtype), t.dims) for t in io.outputs],
            )
            for io in self.ios
        }
        if self.control is not None:
            models[CONTROL_MODEL] = (
                [("command", "TYPE_STRING", ())],
                [("result", "TYPE_STRING", ())],
            )
        ring = self.ring_dir or (SHARED_MEMORY if SHARED_MEMORY.is_dir() else sock.parent)
        wait_ms = self._longest_slo_ms()
        for name, (ins, outs) in models.items():
            (repo / name / "1").mkdir(parents=True)
            served = name != CONTROL_MODEL  # (a command is a few bytes, and never refused)
            (repo / name / "config.pbtxt").write_text(
                door_config(
                    name, ins, outs, self.instances, sock, self._batched(name), ring=ring,
                    ring_mb=self.ring_mb if served else 0.0,
                    queue_wait_ms=wait_ms if served else None,
                    queue_max=self.queue_max if served else 0,
                )
            )  # fmt: skip
            shutil.copy(DOOR_MODEL, repo / name / "1" / "model.py")

    def _longest_slo_ms(self) -> float | None:
        """The longest SLO of the served models and applications (ms; on emulated GPUs at
        time scale D, D times theirs): a request that waited that long ahead of the door
        cannot be on time, whatever it is a request of."""
        slos = [m.slo_us for m in self.core.runtime.topo.models]
        if self.core.apps is not None:
            slos += [a.slo_us for a in self.core.apps.apps]
        return max(slos) / 1e3 if slos else None

    def _batched(self, name: str) -> bool:
        """Whether a door takes rows as Triton's batch (not the control model, and not an
        application's: its outputs stack the parts its rows made, of any number)."""
        apps = self.core.apps
        return name != CONTROL_MODEL and (apps is None or name not in apps.ios)

    def _warm_up(self) -> None:
        """WARM_UP requests per served model, a few at a time (the models side by side), so
        that the door's first calls are behind it; then as many again for the reply
        margin's first samples (the first round's, taken cold, are forgotten); then the
        router's statistics start from zero."""
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio

        async def warm_model(client, io: ModelIO, slo_us: float) -> int:
            inputs = []
            for t in io.inputs:
                i = grpcclient.InferInput(t.name, [1, *t.dims], kserve_dtype(t.dtype))
                i.set_data_from_numpy(np.zeros((1, *t.dims), t.dtype))
                inputs.append(i)
            params = {"slo_ms": 10 * slo_us / 1e3}  # no drop for lack of time
            answered = refusals = 0
            for k in range(WARM_UP // 2):
                # a cold door may keep one longer than the SLO in its queue (refused there):
                # after WARM_UP // 4 rounds of 4, rounds again until WARM_UP are answered
                n = 4 if k < WARM_UP // 4 else min(4, WARM_UP - answered)
                if n <= 0 or (k >= WARM_UP // 4 and not refusals):
                    break
                answers = await asyncio.gather(
                    *(client.infer(io.name, inputs, parameters=params) for _ in range(n)),
                    return_exceptions=True,
                )
                answered += sum(not isinstance(a, BaseException) for a in answers)
                refusals += sum(isinstance(a, BaseException) and refused(str(a)) for a in answers)
            return answered

        async def warm() -> int:
            # one model's warm-up waits on its own pipelines (on emulated GPUs at time scale
            # D, D times their stage times): the models' run side by side
            client = grpcaio.InferenceServerClient(self.node.grpc_url)
            try:
                topo = self.core.runtime.topo
                served = {m.name: m.slo_us for m in topo.models}
                counts = await asyncio.gather(
                    *(warm_model(client, io, served[io.name]) for io in self.ios
                      if io.name in served)  # not applications
                )  # fmt: skip
                return sum(counts)
            finally:
                await client.close()

        with ThreadPoolExecutor(1) as pool:  # asyncio.run needs a thread without a loop
            self.warmed = pool.submit(asyncio.run, warm()).result()
            self.core.restart_margin()
            self.warmed += pool.submit(asyncio.run, warm()).result()
        self.core.reset_stats()
