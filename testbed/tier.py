"""A router tier of processes on this host, as an operator runs one: stage-worker nodes
(`poolpipe node`), routers (`poolpipe serve --nodes INV --router NAME`), each a process of
its own (its own session: one can be killed as a crash of its host would), all with one
token, and the inventory that lists them with a balancer."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from poolpipe.client.control import new_token_file
from poolpipe.domain.inventory import Inventory, parse_inventory
from triton_backend.env import free_ports
from triton_backend.node.triton import RemoteNode, descendants, model_folders, reap, shm_regions

POOLPIPE = [sys.executable, "-m", "poolpipe_cli"]


class ProcessTier:
    """Nodes n0.. of `device` on servers s0.. (one each) and routers r0.. driving the
    nodes `shards[k]` lists, behind a balancer, on loopback; `serve_args`: more arguments
    of every router (the plan first)."""

    def __init__(
        self,
        workspace: Path,
        device: str,
        shards: list[list[int]],
        serve_args: list[str],
    ):
        self.workspace, self.device, self.serve_args = workspace, device, serve_args
        self.token_file = workspace / "tier.token"
        self.token = new_token_file(self.token_file)
        n_nodes = 1 + max(k for shard in shards for k in shard)
        ports = iter(free_ports(4 * n_nodes + 4 * len(shards) + 2))
        self.node_ports = [[next(ports) for _ in range(4)] for _ in range(n_nodes)]
        # http, grpc, ready, weight agent
        self.router_ports = [[next(ports) for _ in range(4)] for _ in shards]
        lb_http, lb_grpc = next(ports), next(ports)
        data = {
            "servers": [{"name": f"s{k}", "bandwidth_gbps": 10} for k in range(n_nodes)],
            "nodes": [
                {
                    "name": f"n{k}",
                    "server": f"s{k}",
                    "device": device,
                    "grpc": f"127.0.0.1:{g}",
                    "http": f"127.0.0.1:{h}",
                    "watch": f"127.0.0.1:{w}",
                }
                for k, (g, h, _, w) in enumerate(self.node_ports)
            ],
            "balancer": {"http": f"127.0.0.1:{lb_http}", "grpc": f"127.0.0.1:{lb_grpc}"},
            "routers": [
                {
                    "name": f"r{k}",
                    "http": f"127.0.0.1:{h}",
                    "grpc": f"127.0.0.1:{g}",
                    "ready": f"127.0.0.1:{r}",
                    "agent": f"127.0.0.1:{a}",
                    "nodes": [f"n{i}" for i in shard],
                }
                for k, ((h, g, r, a), shard) in enumerate(
                    zip(self.router_ports, shards, strict=True)
                )
            ],
        }
        self.inventory: Inventory = parse_inventory(data, "bench inventory")
        self.inventory_file = workspace / "tier.toml"
        self.inventory_file.write_text(self.inventory.to_toml())
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self.crashed: list[tuple[int, str]] = []  # processes a crash took down
        self._regions: list[str] = []  # and the shared memory they held
        self._folders: list[Path] = []  # and their models' upload folders

    def _spawn(self, what: str, cmd: list[str]) -> None:
        log = open(self.workspace / f"{what}.log", "ab")  # noqa: SIM115 (the process keeps it)
        self._logs.append(log)
        self.procs[what] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _until(self, ok, what: str, proc: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if self.procs[proc].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not happen; see {self.workspace / proc}.log")
            time.sleep(0.2)

    def start(self) -> ProcessTier:
        for k, (g, h, m, w) in enumerate(self.node_ports):
            self._spawn(f"n{k}", [
                *POOLPIPE, "node", "--device", self.device, "--name", f"n{k}", "--grpc-port",
                str(g), "--http-port", str(h), "--metrics-port", str(m), "--watch-port", str(w),
                "--workspace", str(self.workspace / f"n{k}"), "--token-file",
                str(self.token_file),
            ])  # fmt: skip
        for k, (g, *_) in enumerate(self.node_ports):
            node = RemoteNode(f"n{k}", self.device, f"127.0.0.1:{g}")
            self._until(node.live, f"node n{k} answering", f"n{k}")
        for k in range(len(self.router_ports)):
            self.start_router(k)
            self._until(lambda k=k: self.ready(k), f"router r{k} ready", f"r{k}")
        return self

    def start_router(self, k: int) -> None:
        self._spawn(f"r{k}", [
            *POOLPIPE, "serve", *self.serve_args, "--nodes", str(self.inventory_file),
            "--router", f"r{k}", "--workspace", str(self.workspace / f"r{k}"),
            "--token-file", str(self.token_file), "--stats-interval", "3600",
        ])  # fmt: skip

    def ready(self, k: int) -> bool:
        url = f"http://127.0.0.1:{self.router_ports[k][2]}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            return False

    def router_grpc(self, k: int) -> str:
        return f"127.0.0.1:{self.router_ports[k][1]}"

    def pids(self, what: str) -> list[int]:
        """The process `what` (r0, n1, ...) and every process below it."""
        pid = self.procs[what].pid
        return [pid, *(p for p, _ in descendants(pid))]

    def crash(self, what: str) -> None:
        """SIGKILL `what`'s process group (the router, its Triton and stubs), as a crash of
        its host would."""
        proc = self.procs[what]
        procs = descendants(proc.pid)
        self.crashed += procs
        self._regions += shm_regions(procs)
        self._folders += model_folders(procs)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Routers first (they take their models off the nodes), then the nodes; a crash's
        leftovers (stubs, shared memory) reaped."""
        order = sorted(self.procs, key=lambda w: (not w.startswith("r"), w))
        for what in order:
            proc = self.procs[what]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.crash(what)
        for proc in self.procs.values():
            proc.wait()
        for log in self._logs:
            log.close()
        reap(self.crashed, grace_s=5.0, regions=self._regions, folders=self._folders)

    def __enter__(self) -> ProcessTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
