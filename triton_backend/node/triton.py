"""Stage-worker nodes: Triton servers in explicit model-control mode, reached by address.

`RemoteNode` is a node someone else started (the operator, `poolpipe node`, the emulated
cluster): the router knows only its gRPC address and uploads partition models through
Triton's model repository API (config and files in the load request; nothing on a shared
disk). `TritonNode` is a node this process starts: a `tritonserver` process (the binary of
the nvidia-pytriton wheel) on its own ports, used the same way."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poolpipe.client.control import node_headers, node_restrictions
from poolpipe.domain.gpus import gpu_node, model_of, model_on
from poolpipe.errors import PoolpipeError
from triton_backend.env import free_ports, libpython_first, libs_path, triton_home

if TYPE_CHECKING:
    from poolpipe.domain.inventory import InventoryGpu

log_ = logging.getLogger(__name__)


class NodeError(PoolpipeError):
    pass


class RepositoryAPI:
    """What the router does to a node, over its gRPC address only: load (uploading the
    model's config and files), unload, list, check liveness."""

    name: str
    device: str
    key: str | None  # what its restricted APIs expect (poolpipe.client.control.node_key)
    # which GPU of a node of several this is (poolpipe/domain/gpus.py): its partitions'
    # models carry the index and go on that GPU; None: a node of one GPU
    gpu: int | None = None

    @property
    def grpc_url(self) -> str:
        raise NotImplementedError

    @property
    def node_id(self) -> str:
        """What the router knows it by: its gRPC address, with the GPU's index where its
        node serves several (the GPU is the failure domain then)."""
        return gpu_node(self.grpc_url, self.gpu)

    def model_name(self, partition: str) -> str:
        """The Triton model that runs `partition` here."""
        return model_on(partition, self.gpu)

    @property
    def http_address(self) -> str | None:
        """Its KServe v2 HTTP host:port where known (the router's stage calls use it)."""
        return None

    @property
    def watch_address(self) -> str | None:
        """Its process's watch port where known: a connection there breaks the moment the
        process ends (NodeWatch)."""
        return None

    @property
    def _headers(self) -> dict[str, str] | None:
        return node_headers(self.key)

    def grpc_client(self):
        """A client on a channel of its own: gRPC shares connections between a process's
        channels to one address, and one to a node that was down is in reconnect back-off
        (failing at once) for seconds after the node answers again."""
        import tritonclient.grpc as grpcclient
        from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

        return grpcclient.InferenceServerClient(
            self.grpc_url,
            channel_args=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )

    def live(self, timeout_s: float = 2.0) -> bool:
        try:
            with contextlib.closing(self.grpc_client()) as c:
                return bool(c.is_server_live(client_timeout=timeout_s))
        except Exception:
            return False

    def load(
        self,
        model: str,
        config: str | None = None,
        files: dict[str, bytes] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        """Load partition `model`; with `config` (the model config as JSON) and `files` (path
        in the model's folder -> contents, e.g. "1/model.onnx"), upload it: the node keeps
        the files only while the model is loaded. On a GPU of a node of several, the model
        is named for the GPU and placed on it (on_gpu)."""
        payload = None if files is None else {f"file:{k}": v for k, v in files.items()}
        if self.gpu is not None:
            model = self.model_name(model)
            config = None if config is None else on_gpu(config, model, self.gpu)
        try:
            with contextlib.closing(self.grpc_client()) as c:
                c.load_model(
                    model,
                    headers=self._headers,
                    config=config,
                    files=payload,
                    client_timeout=timeout_s,
                )
                if not c.is_model_ready(model):
                    raise NodeError(f"{model} is not ready after loading")
        except Exception as exc:
            raise self._error(f"loading {model}", exc) from None

    def unload(self, model: str) -> None:
        """Unload partition `model` (on this GPU, on a node of several)."""
        with contextlib.closing(self.grpc_client()) as c:
            c.unload_model(self.model_name(model), headers=self._headers)

    def models(self) -> list[str]:
        """The partitions loaded now (on this GPU, on a node of several: uploaded models
        are in no repository index; the statistics endpoint lists every loaded model). A
        node whose management APIs expect another key than this process's is a NodeError
        saying so."""
        try:
            with contextlib.closing(self.grpc_client()) as c:
                stats = c.get_inference_statistics(headers=self._headers, as_json=True)
        except Exception as exc:
            raise self._error("listing its models", exc) from None
        names = {model_of(m["name"], self.gpu) for m in stats.get("model_stats", [])}
        return sorted(n for n in names if n is not None)

    def _error(self, what: str, exc: BaseException) -> NodeError:
        """What went wrong, naming a token that does not match as such."""
        text = _short(exc)
        where = f"node {self.name} ({self.node_id})"
        if "expecting header" in text and "poolpipe-key" in text:
            if self.key is None:
                return NodeError(
                    f"{where}: {what} was refused: the node's management API is restricted to "
                    "a key, and this process has no token; give it the node's token file "
                    "(--token-file)"
                )
            return NodeError(
                f"{where}: {what} was refused: the node's management API is restricted to a "
                "key that does not match this router's token (the node was started with "
                "another --token-file); give the node and the router the same token file"
            )
        return NodeError(f"{where}: {what} failed ({text})")


def on_gpu(config: str, name: str, gpu: int) -> str:
    """A model config (the load request's JSON) as model `name` on GPU `gpu` of its node:
    Triton's GPU instances placed there (`gpus: [gpu]`), and the `poolpipe_gpu` parameter
    by which a Python-backend partition (KIND_MODEL) places itself there."""
    data = json.loads(config)
    data["name"] = name
    for group in data.get("instance_group", []):
        if group.get("kind") == "KIND_GPU":
            group["gpus"] = [gpu]
    data.setdefault("parameters", {})["poolpipe_gpu"] = {"string_value": str(gpu)}
    return json.dumps(data)


def _short(exc: BaseException) -> str:
    """An error's message without the client's framing, one line."""
    text = str(exc.message() if hasattr(exc, "message") and callable(exc.message) else exc)
    return " ".join(text.split())[:500]


def trace_options(endpoint: str | None, name: str) -> tuple[str, ...]:
    """tritonserver options that trace, with OpenTelemetry, the calls that carry a W3C
    trace context (a traced request's stage calls from the router: the node's spans are
    children of the router's stage span) and no other (rate 0), exported over OTLP/HTTP to
    `endpoint` (headers from $OTEL_EXPORTER_OTLP_HEADERS, read by Triton's exporter);
    none without an endpoint."""
    if not endpoint:
        return ()
    return (
        "--trace-config=mode=opentelemetry",
        "--trace-config=rate=0",
        "--trace-config=count=-1",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=opentelemetry,url={endpoint}",
        "--trace-config=opentelemetry,resource=service.name=poolpipe-node",
        f"--trace-config=opentelemetry,resource=service.instance.id={name}",
    )


@dataclass
class RemoteNode(RepositoryAPI):
    """A running node this process did not start, by its gRPC address."""

    name: str
    device: str
    address: str  # host:port of its gRPC endpoint
    server: str = ""
    key: str | None = field(default=None, repr=False)
    http: str | None = None  # host:port of its KServe v2 HTTP endpoint, where given
    watch: str | None = None  # host:port of its process's watch port (NodeWatch), where given
    gpu: int | None = None  # which GPU of a node of several (RepositoryAPI.gpu)

    @classmethod
    def of(cls, gpu: InventoryGpu, key: str | None) -> RemoteNode:
        """The inventory's GPU (of its node), reached at the node's addresses with `key`."""
        n = gpu.node
        return cls(gpu.name, n.device, n.grpc, n.server, key, n.http, n.watch, gpu.gpu)

    @property
    def grpc_url(self) -> str:
        return self.address

    @property
    def watch_address(self) -> str | None:
        return self.watch

    @property
    def http_address(self) -> str | None:
        return self.http

    @property
    def alive(self) -> bool:
        return self.live()


@dataclass
class TritonNode(RepositoryAPI):
    """One stage worker this process runs: a tritonserver process (with its own model
    repository folder, empty unless something renders into it)."""

    name: str
    device: str  # device type, e.g. cpu-1t
    repo: Path
    workspace: Path
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    address: str = "127.0.0.1"  # where its HTTP and gRPC ports listen
    key: str | None = field(default=None, repr=False)  # restricts its management APIs
    process: subprocess.Popen | None = field(default=None, repr=False)
    # SIGTERM tritonserver when this process dies, however it dies (even SIGKILL): a
    # router's Triton and its local nodes, a `poolpipe node`'s server (see spawn_tied)
    die_with_parent: bool = True
    # more environment for tritonserver and its models (POOLPIPE_EMULATE_TIME_SCALE: the
    # node emulates its GPU device type, see model_repo_templates/python_onnx_model.py)
    environment: dict[str, str] = field(default_factory=dict)
    # more tritonserver options (the router's: headers forwarded to its door as parameters)
    options: tuple[str, ...] = ()

    @property
    def _host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address

    @property
    def http_url(self) -> str:
        return f"{self._host}:{self.http_port}"

    @property
    def http_address(self) -> str | None:
        return self.http_url

    @property
    def grpc_url(self) -> str:
        return f"{self._host}:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        return self.workspace / f"{self.name}.log"

    def start(self, timeout_s: float = 60.0) -> TritonNode:
        home = triton_home(self.workspace)
        missing = [p for p in ("http_port", "grpc_port", "metrics_port") if not getattr(self, p)]
        for p, port in zip(missing, free_ports(len(missing)), strict=True):
            setattr(self, p, port)
        self.repo.mkdir(parents=True, exist_ok=True)
        env = libpython_first()
        env["LD_LIBRARY_PATH"] += f":{libs_path()}"
        env.update(self.environment)
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            "--model-control-mode=explicit",
            f"--backend-directory={home / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.address}",
            f"--grpc-address={self.address}",
            "--exit-timeout-secs=2",
            "--log-verbose=0",
            "--strict-readiness=true",
            *node_restrictions(self.key),
            *self.options,
        ]
        self._check_ports()
        sweep_uploads()
        sweep_regions()
        t0 = time.monotonic()
        for attempt in (1, 2):
            log = open(self.log_path, "ab")  # noqa: SIM115 (the process keeps it)
            if self.die_with_parent:
                self.process = spawn_tied(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            else:
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            log.close()
            try:
                self._wait(lambda c: c.is_server_live(), timeout_s, "start")
                break
            except NodeError as exc:
                # tritonserver died while starting, its log one line of gRPC's poller
                # ("epoll_wait error: Bad file descriptor"; once in ~400 starts in the test
                # suite): started once more. A port taken, or anything it says, is final.
                if attempt == 2 or "exited" not in str(exc) or "already in use" in str(exc):
                    raise
                log_.warning("%s; starting it once more", exc)
        # the gRPC endpoint answers too (the HTTP one can be up a moment before it)
        self._wait(lambda _: self.live(1.0), timeout_s, "start (gRPC)")
        log_.info(
            "%s (%s) up in %.1f s at %s (gRPC) and %s (HTTP); its log: %s",
            self.name,
            self.device,
            time.monotonic() - t0,
            self.grpc_url,
            self.http_url,
            self.log_path,
        )
        return self

    def _check_ports(self) -> None:
        """Refuse ports another process holds (a leftover Triton of a router or node that
        died would answer for ours: it is named, not reused)."""
        refuse_taken_ports(
            f"node {self.name}",
            self.address,
            {
                "http port": self.http_port,
                "grpc port": self.grpc_port,
                "metrics port": self.metrics_port,
            },
        )

    def client(self):
        import tritonclient.http as th

        return th.InferenceServerClient(self.http_url, connection_timeout=5, network_timeout=120)

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise NodeError(f"node {self.name}: tritonserver exited ({what}); {self._tail()}")
            try:
                with contextlib.closing(self.client()) as c:
                    if ok(c):
                        return
            except Exception as exc:  # not up yet
                last = str(exc)
            time.sleep(0.1)
        raise NodeError(f"node {self.name}: {what} timed out after {timeout_s:.0f} s ({last})")

    def _tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        return "log: " + " | ".join(lines[-n:])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            # it died on its own (a crash, the OOM killer): its stubs, now children of
            # init, would keep spinning and holding their shared memory
            reap(orphan_stubs(self.repo), grace_s=0.0)
            return
        stubs = descendants(self.process.pid)
        folders = model_folders(stubs)
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        reap(stubs, folders=folders)
        log_.info("stopped %s", self.name)

    def kill(self) -> None:
        """Die at once, as a crashed node does (fault tests): tritonserver and its backend
        stub processes (a stub outlives a killed server and keeps spinning on a core)."""
        if self.process is not None and self.process.poll() is None:
            stubs = descendants(self.process.pid)
            self.process.kill()
            self.process.wait()
            reap(stubs, grace_s=0.0)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a running process (not a zombie), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), fields[19])


def _tie_to_parent() -> Callable[[], None] | None:
    """A child's preexec_fn: Linux sends the child SIGTERM when the thread that started it
    ends (PR_SET_PDEATHSIG); spawn_tied starts children from a thread that ends only with
    the process. None where prctl is not Linux's."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that: nobody would tell us
            os._exit(1)

    return preexec


class _Spawner:
    """One thread, alive as long as the process, that starts the children tied to it: the
    kernel's parent-death signal follows the thread that forked, and threads of a pool end
    when idle (a node started from one would get SIGTERM then)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pid = 0

    def run(self, cmd: list[str], kw: dict) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():  # (a fork has none)
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._loop, name="poolpipe-spawner", daemon=True
                )
                self._thread.start()
                self._pid = os.getpid()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((cmd, kw, done))
        ok, out = done.get()
        if not ok:
            raise out
        return out

    def _loop(self) -> None:
        while True:
            cmd, kw, done = self._jobs.get()
            try:
                done.put((True, subprocess.Popen(cmd, preexec_fn=_tie_to_parent(), **kw)))
            except BaseException as exc:
                done.put((False, exc))


_SPAWNER = _Spawner()


def spawn_tied(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kw)`, the child sent SIGTERM when this process dies, however
    it dies (SIGKILL, the OOM killer), from whichever thread it is started."""
    return _SPAWNER.run(cmd, kw)


def refuse_taken_ports(whose: str, address: str, ports: dict[str, int]) -> None:
    """NodeError naming the first of `ports` (label -> port; 0: chosen later, free) that
    another process listens on at `address`, and that process: a leftover Triton of a router
    or node that died would otherwise answer for the new one."""
    for label, port in ports.items():
        holder = port_holder(address, port) if port else None
        if holder is not None:
            raise NodeError(
                f"{whose}: {label} {port} on {address} is taken by {holder}; stop it (a Triton "
                "left by an earlier router or node that died?) or choose another port"
            )


def port_holder(address: str, port: int) -> str | None:
    """Who listens on TCP `port` (at `address`, or at every address), if anyone: "PROGRAM
    (pid N)" where /proc tells, else "another process"; None when nobody listens there.
    Connections a killed server left closing do not count: a new server binds over them."""
    listening = _listening(port)
    if listening is None:  # no /proc/net: ask the kernel by binding
        host = address or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host.strip("[]"), port))
                return None
            except OSError:
                return "another process"
    if not listening:
        return None
    pid = _socket_pid(listening)
    if pid is None:
        return "another process"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        program = Path(argv[0].decode(errors="replace")).name
    except (OSError, IndexError):
        program = "a process"
    return f"{program} (pid {pid})"


def _listening(port: int) -> set[str] | None:
    """The inodes of the TCP sockets listening on `port` (Linux /proc/net, this network
    namespace's); None where /proc/net cannot be read."""
    found: set[str] = set()
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{f[9]}]")
    return found if read else None


def _socket_pid(inodes: set[str]) -> int | None:
    """A process holding one of these sockets (Linux /proc), if found. A descriptor closed
    while it is read is passed over, not the process that had it (the holder's other
    threads open and close descriptors meanwhile)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return int(d.name)
            except OSError:
                continue
    return None


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux /proc)."""
    return _stat(pid) is not None


def descendants(pid: int) -> list[tuple[int, str]]:
    """The processes below `pid` (Linux /proc) with their start times, children first."""
    parent: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None:
            parent[int(d.name)] = st
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [(c, st[1]) for c, st in parent.items() if st[0] == p]
        out += kids
        todo += [c for c, _ in kids]
    return out


def _argv(pid: int | str) -> list[bytes]:
    """Process `pid`'s command line (Linux /proc), [] where it is gone or unreadable. A
    Python-backend stub's names its model file, then its shared-memory region."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def orphan_stubs(repo: Path) -> list[tuple[int, str]]:
    """Python-backend stub processes still running models of `repo` (found by their
    command lines, which name the model file under it) whose server is gone."""
    where = str(Path(repo).resolve())
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = _argv(d.name)
        if argv and argv[0].endswith(b"triton_python_backend_stub") and len(argv) > 1:
            model = Path(argv[1].decode(errors="replace"))
            if str(model.resolve()).startswith(where) and (st := _stat(int(d.name))):
                out.append((int(d.name), st[1]))
    return out


# A Python-backend model's shared memory: Triton makes a region of /dev/shm, then starts the
# stub that names it, and removes it when the model is unloaded; a Triton stopped outright
# in between (a signal during its start-up) leaves it behind, mapped by no process.
_REGION_PREFIX = "triton_python_backend_shm_region"


def _shm_regions(pids: list[int]) -> list[str]:
    """The Python-backend shared-memory regions these stub processes name."""
    prefix = _REGION_PREFIX.encode()
    names = []
    for p in pids:
        names += [a.decode() for a in _argv(p) if a.startswith(prefix)]
    return names


# Where Triton puts a model loaded with its files (the repository API's uploads): a folder
# of /tmp (whatever TMPDIR says) that it removes when the model is unloaded, and leaves
# behind when the server stops with the model loaded (a shutdown, a crash).
_UPLOAD_NAME = r"folder[A-Za-z0-9]{6}"
_UPLOAD_FOLDER = re.compile(rf"/tmp/{_UPLOAD_NAME}")


# An upload folder or a router's door folder untouched this long, whose owner is gone, is
# left over (a Triton, a router killed outright); younger ones may be being set up
STALE_AFTER_S = 60.0


def sweep_uploads(root: Path = Path("/tmp"), now: float | None = None) -> list[Path]:
    """Remove the upload folders (`root`/folderXXXXXX) of Python-backend models that a
    Triton killed outright left behind, and the empty folders its Python backend makes
    for execution environments (`root`/python_env_XXXXXX, which we never use), and return
    them: this user's, untouched for STALE_AFTER_S, run by no stub process (whose command
    line names the model file), and made before every running tritonserver started (so
    none of them made it). Another user's folders and those of any live server are left
    alone."""
    now = time.time() if now is None else now
    candidates = []
    with contextlib.suppress(OSError):
        for d in root.iterdir():
            upload = re.fullmatch(_UPLOAD_NAME, d.name)
            if not upload and not re.fullmatch(r"python_env_[A-Za-z0-9]{6}", d.name):
                continue
            with contextlib.suppress(OSError):
                st = d.stat()
                old = st.st_uid == os.getuid() and now - st.st_mtime > STALE_AFTER_S
                if old and (
                    next(d.glob("*/model.py"), None) is not None
                    if upload
                    else next(d.iterdir(), None) is None
                ):
                    candidates.append((d, st.st_mtime))
    if not candidates or not Path("/proc").is_dir():  # (who runs what: Linux's /proc)
        return []
    in_use: set[str] = set()
    servers_since = math.inf  # when the earliest running tritonserver started
    boot, tick = _boot_time(), os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        argv = _argv(proc.name)
        model = argv[1].decode(errors="replace") if len(argv) > 1 else ""
        if m := re.match(rf"(.*/{_UPLOAD_NAME})/", model):
            in_use.add(m.group(1))
        if argv and argv[0].endswith(b"tritonserver") and (ps := _stat(int(proc.name))):
            servers_since = min(servers_since, boot + int(ps[1]) / tick)
    removed = []
    for d, mtime in candidates:
        # (a process's start is known to a second here: /proc/stat's btime)
        if str(d) not in in_use and mtime < servers_since - 2.0:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log_.info("removed %d folders a stopped Triton left in %s", len(removed), root)
    return removed


def sweep_regions(root: Path = Path("/dev/shm"), now: float | None = None) -> list[Path]:
    """Remove the Python-backend shared-memory regions (`root`/triton_python_backend_shm_
    region_*) that a Triton stopped outright left behind, and return them: this user's,
    untouched for STALE_AFTER_S, mapped by no process and named by no running stub. A
    region being set up is young, and one in use is mapped by its Triton and its stub."""
    now = time.time() if now is None else now
    candidates = []
    with contextlib.suppress(OSError):
        for f in root.iterdir():
            if not f.name.startswith(_REGION_PREFIX):
                continue
            with contextlib.suppress(OSError):
                st = f.stat()
                if st.st_uid == os.getuid() and now - st.st_mtime > STALE_AFTER_S:
                    candidates.append(f)
    if not candidates or not Path("/proc").is_dir():  # (who maps what: Linux's /proc)
        return []
    procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    in_use = set(_shm_regions([int(p.name) for p in procs]))  # named by a running stub
    for proc in procs:
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                if _REGION_PREFIX in line:
                    in_use.add(line.rsplit(" ", 1)[-1])
    removed = []
    for f in candidates:
        if f.name not in in_use and str(f) not in in_use:
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    if removed:
        log_.info(
            "removed %d shared-memory regions a stopped Triton left in %s", len(removed), root
        )
    return removed


def _boot_time() -> float:
    """When this machine booted (seconds since the epoch; /proc/stat's btime)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def model_folders(procs: list[tuple[int, str]]) -> list[Path]:
    """The upload folders of the models these (pid, start time) stubs run, while they run
    (a stub's command line names its model file, e.g. /tmp/folderAb12Cd/1/model.py)."""
    out = []
    for p, _ in still_running(procs):
        argv = _argv(p)
        m = _UPLOAD_FOLDER.match(argv[1].decode(errors="replace")) if len(argv) > 1 else None
        if m and Path(m.group()) not in out:
            out.append(Path(m.group()))
    return out


def still_running(procs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Those of these (pid, start time) processes still running (not a later process that
    took the pid: its start time differs)."""
    return [(p, t) for p, t in procs if (st := _stat(p)) is not None and st[1] == t]


def shm_regions(procs: list[tuple[int, str]]) -> list[str]:
    """The shared-memory regions these (pid, start time) stubs name, while they run."""
    return _shm_regions([p for p, _ in still_running(procs)])


def reap(
    procs: list[tuple[int, str]],
    grace_s: float = 5.0,
    regions: list[str] | None = None,
    folders: list[Path] | None = None,
) -> None:
    """Kill what is left of `procs` after `grace_s` (Triton's stubs exit on their own after
    a clean shutdown; after a crash they do not), and remove the shared memory they held
    that nobody removed (after a crash, Triton does not): `regions`, taken with shm_regions
    before the stubs were killed, or else those the stubs still running name; and their
    models' upload folders (a stopped Triton leaves them): `folders`, taken with
    model_folders before the server was stopped, or else those of the stubs still running.
    A pid taken by another process since is left alone (its start time differs)."""

    if regions is None:
        regions = shm_regions(procs)
    if folders is None:
        folders = model_folders(procs)
    try:
        _reap(lambda: still_running(procs), grace_s)
    finally:
        for name in regions:
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / name).unlink()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def _reap(alive: Callable[[], list[tuple[int, str]]], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while (procs := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p, _ in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while alive() and time.monotonic() < deadline:  # SIGKILL is delivered asynchronously
        time.sleep(0.01)


def stop_nodes(nodes: list[TritonNode], timeout_s: float = 10.0) -> None:
    """Stop several nodes at once (each takes up to its exit timeout)."""
    stubs = [s for n in nodes if n.alive and n.process for s in descendants(n.process.pid)]
    folders = model_folders(stubs)
    for n in nodes:
        if n.alive and n.process is not None:
            n.process.terminate()
    deadline = time.monotonic() + timeout_s
    for n in nodes:
        if n.process is not None and n.process.poll() is None:
            try:
                n.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.process.kill()
                n.process.wait()
    reap(stubs, folders=folders)
    if nodes:
        log_.info("stopped %s", ", ".join(n.name for n in nodes))
