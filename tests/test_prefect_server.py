"""poolpipe's deployments against a real Prefect server and real process workers: the
`prefect` CLI deploys prefect.yaml, workers (started as an operator would, with the settings
in their environment) run onboarding, profiling and planning, and the server's scheduler
creates runs of a scheduled deployment. SQLite, loopback, everything stopped afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from poolpipe.offline.zoo import make_model
from poolpipe.store.warehouse import Warehouse
from triton_backend.env import free_ports

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOLS = ("onboarding", "cpu", "L4", "T4", "P4", "V100")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

pytestmark = pytest.mark.integration


class Server:
    def __init__(self, home: Path):
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}/api"
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
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self) -> Server:
        port = self.url.split(":")[2].split("/")[0]
        self._spawn(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port], self.log, {}
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
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

    def worker(self, pool: str, log: Path, **env: str) -> subprocess.Popen:
        return self._spawn(
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"],
            log,
            env,
        )

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
        logs = self.http.post(
            "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
        ).json()
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect")
    srv = Server(home)
    try:
        srv.start()
        for pool in POOLS:
            r = srv.cli("work-pool", "create", pool, "--type", "process")
            assert r.returncode == 0, r.stdout + r.stderr
        yield srv
    finally:
        srv.stop()


def test_deploy_all_and_the_listing_commands(server):
    r = server.cli("deploy", "--all")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    names = {
        "onboard-model/onboard",
        "plan/plan",
        "profile-model/profile-cpu",
        "profile-model/profile-L4",
        "rollout/rollout",
        "nightly-replan/nightly-replan",
    }
    for name in names:
        assert server.deployment(name)["work_pool_name"]
    for args in (
        ("deployment", "ls"),
        ("work-pool", "ls"),
        ("flow-run", "ls"),
        ("artifact", "ls"),
        ("work-pool", "inspect", "onboarding"),
    ):
        r = server.cli(*args)
        assert r.returncode == 0, (args, (r.stdout + r.stderr)[-2000:])
    assert "plan/plan" in server.cli("deployment", "ls").stdout
    nightly = server.deployment("nightly-replan/nightly-replan")
    assert "router" not in nightly["parameters"]  # the worker's setting, not the deployer's
    assert nightly["schedules"] and nightly["schedules"][0]["schedule"]["cron"] == "0 3 * * *"


def test_workers_onboard_profile_and_plan_into_the_warehouse(server, tmp_path):
    assert server.deployment("plan/plan")  # deployed by the test above
    wh = tmp_path / "wh.duckdb"
    Warehouse.open(wh).close()  # the cluster's warehouse, made on the control host
    model = make_model("resnet50", tmp_path / "r.onnx", width=0.125, image=32)
    server.worker(
        "onboarding",
        tmp_path / "onboarding-worker.log",
        POOLPIPE_HOME=str(REPO),
        POOLPIPE_WAREHOUSE=str(wh),
    )
    # this one has no warehouse setting: its run must stop and say so, creating nothing
    server.worker("cpu", tmp_path / "cpu-worker.log", POOLPIPE_HOME=str(REPO))
    small = {"blocks": 4, "batches": [1, 2], "warmup": 1, "reps": 2}
    state, logs = server.run(
        "onboard-model/onboard", {"model_path": str(model), "name": "tiny"} | small
    )
    assert state == "COMPLETED", logs[-3000:]

    profile = {"name": "tiny", "batches": [1, 2], "threads": 2, "warmup": 1, "reps": 2}
    default = REPO / "warehouse" / "poolpipe.duckdb"
    existed = default.exists()
    state, logs = server.run("profile-model/profile-cpu", profile)
    assert state == "FAILED" and "POOLPIPE_WAREHOUSE" in logs, logs[-3000:]
    assert default.exists() == existed  # no empty warehouse next to the code
    state, logs = server.run("profile-model/profile-cpu", profile | {"warehouse": str(wh)})
    assert state == "COMPLETED", logs[-3000:]

    plan = {
        "models": ["tiny"],
        "cluster": "local",
        "clusters_file": str(REPO / "local-clusters.toml"),
        "slo_ms": {"tiny": 200.0},
        "packing": "per-position",
        "mip_gap": 0.01,
        "time_limit_s": 30,
        "label": "through-a-worker",
    }
    state, logs = server.run("plan/plan", plan)
    assert state == "COMPLETED", logs[-3000:]
    with Warehouse.open(wh) as w:
        devices = {
            r[0]
            for r in w.con.execute(
                "SELECT DISTINCT gpu_type FROM block_latency WHERE model = 'tiny'"
            ).fetchall()
        }
        (packing,) = w.con.execute(
            "SELECT packing FROM plans WHERE label = 'through-a-worker'"
        ).fetchone()
    assert devices == {"cpu-1t", "cpu-2t"} and packing == "per-position"

    # a schedule on the plan deployment: the server's scheduler creates the run, a worker
    # executes it
    dep = server.deployment("plan/plan")
    anchor = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
    r = server.http.post(
        f"/deployments/{dep['id']}/schedules",
        json=[
            {
                "schedule": {"interval": 3600, "anchor_date": anchor},
                "active": True,
                "parameters": plan | {"label": "scheduled"},
            }
        ],
    )
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 120
    done = []
    while time.monotonic() < deadline and not done:
        runs = server.http.post(
            "/flow_runs/filter",
            json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}, "limit": 50},
        ).json()
        auto = [fr for fr in runs if fr["auto_scheduled"]]
        done = [fr for fr in auto if fr["state"]["type"] == "COMPLETED"]
        time.sleep(1)
    assert done, json.dumps([(fr["name"], fr["state"]["type"]) for fr in auto])
    with Warehouse.open(wh) as w:
        assert w.con.execute("SELECT count(*) FROM plans WHERE label = 'scheduled'").fetchone()[0]
