"""A router's readiness for a load balancer's health check: `GET /ready` answers 200 while
the router serves (its door models loaded and warmed, a live path for every model of its
plan), 404 while it stops but still serves the requests it has (draining), and 503 with
the reason otherwise. Triton's own `/v2/health/ready` cannot say so: it
answers 200 before the door models are loaded, and a Python-backend model stays ready
with every node behind it gone.

A small HTTP server of its own (stdlib), on the router's address, in a daemon thread."""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

READY_PATH = "/ready"
# What the check answers: serving; stopping but still serving what it has (HAProxy's
# `http-check disable-on-404` sends it nothing new and lets its requests finish, where a
# router marked down has its sessions shut); not serving.
READY, DRAINING, NOT_READY = "ready", "draining", "not ready"
STATUS_CODES = {READY: 200, DRAINING: 404, NOT_READY: 503}


class _InThread:
    """A socket server of ours, served from a daemon thread until close()."""

    def _serve(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        self.port = int(server.server_address[1])  # type: ignore[index]
        self._thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ReadinessServer(_InThread):
    """Serves `check()` (READY, DRAINING or NOT_READY; why; more fields for the body) at
    READY_PATH. Its caller names a taken port before anything starts (ServingProcess)."""

    def __init__(
        self,
        address: str,
        port: int,
        check: Callable[[], tuple[str, str, dict]],
    ):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != READY_PATH:
                    self._send(404, {"error": f"not found; ask {READY_PATH}"})
                    return
                try:
                    state, why, more = outer.check()
                except Exception as exc:  # stopping, or a loop too busy to answer
                    state, why, more = NOT_READY, f"no answer from the router ({exc})", {}
                body = {"ready": state == READY, "state": state, "why": why, **more}
                self._send(STATUS_CODES[state], body)

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:  # health checks every second
                pass

        self.check = check
        self._serve(_Server((address, port), Handler), "poolpipe-ready")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A checker that hangs up once it has the status line (HAProxy does) is no error."""


class WeightAgent(_InThread):
    """HAProxy's agent-check: to each connection, `reply()` (a percentage such as "150%",
    which HAProxy applies to the server's configured weight) and a newline, then closed."""

    def __init__(self, address: str, port: int, reply: Callable[[], str]):
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    line = outer.reply()
                except Exception:  # stopping, or a loop too busy to answer: keep the weight
                    line = "100%"
                with contextlib.suppress(OSError):
                    self.request.sendall(f"{line}\n".encode())

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.reply = reply
        self._serve(Server((address, port), Handler), "poolpipe-agent")
