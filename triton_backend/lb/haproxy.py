"""The load balancer in front of the routers: HAProxy, its configuration rendered from the
inventory's router tier (poolpipe.domain.tier) and run as a process of ours.

What the rendered configuration does, and why:
- KServe v2 over HTTP and over gRPC (h2), each a front end with the routers as weighted
  back ends (round robin by weight: a router's weight is its shard's share of the load).
  A router with a weight agent (`agent` in the inventory, `serve --agent-port`) has that
  weight scaled by what its shard serves now against its first plan (HAProxy's
  agent-check: the agent answers a percentage, e.g. 200% once it has adopted a lost
  router's nodes and re-planned, 50% with half its GPUs down).
- Stamps the microsecond each request arrived (ARRIVAL_STAMP, overwriting any a client
  sent): a router's Triton forwards it to the door, whose deadline runs from it. A gRPC
  client's deadline (the time it had left, `grpc-timeout`) is copied beside it
  (CLIENT_TIMEOUT) and taken off the request: the router's gRPC server would consume it
  and reset the stream at the deadline; the router ends the request's SLO there where it
  comes first, and drops what it cannot serve by then with an answer.
- Asks each router's readiness check (`GET /ready` on its ready port), not Triton's: a
  router without a live path gets no requests `fall` checks later (503: marked down); one
  stopping gets no new ones and finishes its own (404: HAProxy's disable-on-404).
- A router marked down has its sessions shut (no request hangs on it); a connection that
  cannot be opened is retried on another router (nothing was sent yet).
- Logs (haproxy.log beside the configuration) routers going down and up and every request
  that failed, not those that went well.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from poolpipe.domain.inventory import Inventory
from poolpipe.domain.tier import BalancerSpec, split_address
from poolpipe.errors import PoolpipeError
from poolpipe.runtime import ARRIVAL_STAMP, CLIENT_TIMEOUT
from triton_backend.node.triton import port_holder, refuse_taken_ports, spawn_tied
from triton_backend.router.readiness import READY_PATH

INSTALL_HINT = (
    "install HAProxy (Debian/Ubuntu: `apt-get install haproxy`, as root; ./run does so "
    "where it can) or name its binary with --haproxy"
)
SERVER_TIMEOUT_S = 60  # the longest a router may take to answer one request
H2_STREAMS = 1000  # requests one gRPC connection may have open at once


class BalancerError(PoolpipeError):
    pass


def find_haproxy(binary: str | None = None) -> str:
    """The HAProxy binary to run: `binary`, else the one on PATH; BalancerError naming the
    fix where there is none."""
    path = shutil.which(binary or "haproxy")
    if path is None:
        raise BalancerError(
            f"{binary or 'haproxy'}: HAProxy is not installed here (not on PATH); {INSTALL_HINT}"
        )
    return path


def balancer_spec(inv: Inventory) -> BalancerSpec:
    """The inventory's [balancer]; BalancerError naming the fix where it has no router tier."""
    if inv.balancer is None or not inv.routers:
        raise BalancerError(
            f"{inv.source}: no router tier to balance: add a [balancer] and [[routers]] "
            "(see `poolpipe lb --help`)"
        )
    return inv.balancer


# how the messages of Triton's JSON parser begin (answered 500 by Triton's front end)
UNPARSED = '"failed to parse" "Unable to parse"'


def render(inv: Inventory) -> str:
    """haproxy.cfg for the inventory's [balancer] and [[routers]]."""
    b = balancer_spec(inv)
    stamp = f"    http-request set-header {ARRIVAL_STAMP} %[date(0,us)]"
    out = [
        "# rendered by `poolpipe lb` from " + inv.source + "; edit the inventory, not this",
        "global",
        "    maxconn 8000",  # needs about twice as many open files (ulimit -n)
        # one gRPC channel's burst at once: beyond the h2 default (100), a client that
        # cancels streams at its deadline races HAProxy's count and gets REFUSED_STREAM
        f"    tune.h2.max-concurrent-streams {H2_STREAMS}",
        "    log stdout format raw local0",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlog-normal",  # the log: routers down and up, requests that failed
        "    timeout connect 1s",
        "    timeout client 60s",
        f"    timeout server {SERVER_TIMEOUT_S}s",
        "    timeout http-request 10s",
        "    retries 2",
        "    retry-on conn-failure",
        "    option redispatch 1",
        "",
        "frontend kserve_http",
        f"    bind {b.http}",
        stamp,
        # Triton's HTTP front end files a body it cannot parse (not JSON, cut short, no
        # inputs, data of the wrong count or type) as an internal error: the client's
        # mistake is answered 400 here, its message kept (only 500s are waited for)
        "    http-response wait-for-body time 1s if { status 500 }",
        f"    http-response set-status 400 if {{ status 500 }} {{ res.body -m sub {UNPARSED} }}",
        "    default_backend routers_http",
        "",
        "frontend kserve_grpc",
        f"    bind {b.grpc} proto h2",
        stamp,
        # the time a gRPC client with a deadline had left when its call went on the wire
        f"    http-request set-header {CLIENT_TIMEOUT} %[req.hdr(grpc-timeout)] "
        "if { req.hdr(grpc-timeout) -m found }",
        # ... and the router alone acts on it: a router's Triton that also did would reset
        # streams at the deadline, racing the router's explicit drop
        "    http-request del-header grpc-timeout",
        "    default_backend routers_grpc",
        "",
    ]
    for proto in ("http", "grpc"):
        out += [
            f"backend routers_{proto}",
            "    balance roundrobin",
            f"    option httpchk GET {READY_PATH}",
            "    http-check expect status 200",
            "    http-check disable-on-404",  # a router stopping: nothing new, its own finish
            f"    default-server inter {b.check_ms}ms fall {b.fall} rise {b.rise} "
            "on-marked-down shutdown-sessions",
        ]
        for r in inv.routers:
            host, port = split_address(r.ready)
            target = r.http if proto == "http" else f"{r.grpc} proto h2"
            agent = ""
            if r.agent:  # its weight x the share of its first plan it serves now (%)
                a_host, a_port = split_address(r.agent)
                agent = (
                    f" agent-check agent-addr {a_host} agent-port {a_port} "
                    f"agent-inter {b.check_ms}ms"
                )
            out.append(
                f"    server {r.name} {target} weight {r.weight} "
                f"check addr {host} port {port} check-proto h1{agent}"
            )
        out.append("")
    if b.stats is not None:
        out += ["listen stats", f"    bind {b.stats}", "    stats enable", "    stats uri /", ""]
    return "\n".join(out).rstrip() + "\n"


class Balancer:
    """HAProxy running the rendered configuration (`workspace`/haproxy.cfg, its output in
    haproxy.log), tied to this process: it stops when we do, however we do."""

    def __init__(self, inv: Inventory, workspace: Path, binary: str | None = None):
        self.inv = inv
        self.spec = balancer_spec(inv)
        self.workspace = Path(workspace)
        self.binary = binary
        self.config = self.workspace / "haproxy.cfg"
        self.log_path = self.workspace / "haproxy.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> Balancer:
        haproxy = find_haproxy(self.binary)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.config.write_text(render(self.inv))
        check = subprocess.run(
            [haproxy, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True
        )
        if check.returncode:
            why = (check.stdout + check.stderr).strip()
            raise BalancerError(f"HAProxy refuses {self.config}: {why}")
        listens = self.listens()
        for label, address in listens.items():
            host, port = split_address(address)
            refuse_taken_ports("the balancer", host, {label: port})
        with open(self.log_path, "ab") as log:
            self.process = spawn_tied(
                [haproxy, "-db", "-f", str(self.config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while not all(_listening(a) for a in listens.values()):
            if self.process.poll() is not None:
                raise BalancerError(f"HAProxy exited while starting: {self._tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BalancerError(f"HAProxy did not listen within {timeout_s:g} s")
            time.sleep(0.05)
        return self

    def listens(self) -> dict[str, str]:
        b = self.spec
        out = {"HTTP port": b.http, "gRPC port": b.grpc}
        if b.stats is not None:
            out["stats port"] = b.stats
        return out

    @property
    def http_url(self) -> str:
        return _reachable(self.spec.http)

    @property
    def grpc_url(self) -> str:
        return _reachable(self.spec.grpc)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _tail(self, n: int = 10) -> str:
        with contextlib.suppress(OSError):
            return " / ".join(self.log_path.read_text().strip().splitlines()[-n:])
        return "no output"

    def __enter__(self) -> Balancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reachable(address: str) -> str:
    """A bind address as clients on this host reach it (a wildcard: loopback)."""
    host, port = split_address(address)
    return f"127.0.0.1:{port}" if host in ("", "*", "0.0.0.0") else address


def _listening(address: str) -> bool:
    return port_holder(*split_address(address)) is not None
