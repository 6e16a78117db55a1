"""A real Prefect server and process workers, started as an operator would (the settings in
their environment), for tests and benchmarks: `Server(home, host).start()`, `worker(pool,
log, **env)`, the `prefect` CLI against it (`cli`), deployments and runs through its REST
API (`http`), everything stopped by `stop`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from triton_backend.env import free_ports

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class Api:
    """The server's REST API, retried on 503 as Prefect's own client does: SQLite answers
    'database is locked' under the scheduler's and the workers' writes, which the server
    reports as 503."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=30)

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        for attempt in range(20):
            try:
                r = self.client.request(method, path, **kw)
            except httpx.TransportError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
                continue
            if r.status_code != 503:
                return r
            time.sleep(0.5)
        return r

    def get(self, path: str, **kw) -> httpx.Response:
        return self._call("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self._call("POST", path, **kw)

    def close(self) -> None:
        self.client.close()


class Server:
    def __init__(self, home: Path, host: str = "127.0.0.1"):
        (port,) = free_ports(1)
        self.url = f"http://{host}:{port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
            "PYTHONWARNINGS": "ignore",
        }
        for k in ("POOLPIPE_HOME", "POOLPIPE_WAREHOUSE", "POOLPIPE_ROUTER"):
            self.env.pop(k, None)  # a worker has only what its test gives it
        self.log = home / "server.log"
        self.procs: list[subprocess.Popen] = []
        self.http = Api(self.url)

    def start(self) -> Server:
        host, port = self.url.split("//")[1].split("/")[0].split(":")
        self._spawn([PREFECT, "server", "start", "--host", host, "--port", port], self.log, {})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.http.client.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.procs[0].poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"prefect server did not start: {self.log.read_text()[-2000:]}")

    def _spawn(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd,
            cwd=log.parent,
            env={**self.env, **env},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def worker(
        self, pool: str, log: Path, wrap: list[str] | None = None, **env: str
    ) -> subprocess.Popen:
        cmd = [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"]
        return self._spawn([*(wrap or []), *cmd], log, env)

    @contextmanager
    def workers(self) -> Iterator[None]:
        """Workers started inside are stopped at the end (also when a test fails)."""
        n = len(self.procs)
        try:
            yield
        finally:
            started, self.procs[n:] = self.procs[n:], []
            for p in started:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in started:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PREFECT, "--no-prompt", *args],
            cwd=REPO,
            env={**self.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=300,
        )

    def deployment(self, name: str) -> dict:
        r = self.http.get(f"/deployments/name/{name}")
        r.raise_for_status()
        return r.json()

    def run(self, name: str, params: dict, timeout_s: float = 300) -> tuple[str, str]:
        """Create a run of deployment `name` and wait for a worker to end it: (state, logs)."""
        dep = self.deployment(name)
        r = self.http.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
        r.raise_for_status()
        return self.wait(r.json()["id"], timeout_s)

    def wait(self, run_id: str, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.http.get(f"/flow_runs/{run_id}").json()["state"]["type"]
            if state in TERMINAL:
                break
            time.sleep(1)
        # The run's process ships its logs in batches, after its state may have landed:
        # wait (briefly) for them, and a little longer for the last batch.
        logs: list = []
        settle = time.monotonic() + 20
        while time.monotonic() < settle:
            now = self.http.post(
                "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
            ).json()
            if now and len(now) == len(logs):
                break
            logs = now
            time.sleep(2)
        return state, "\n".join(entry["message"] for entry in logs)

    def stop(self) -> None:
        self.http.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
