"""poolpipe's deployments against a real Prefect server and real process workers: the
`prefect` CLI deploys prefect.yaml, workers (started as an operator would, with the settings
in their environment) run onboarding, profiling and planning, and the server's scheduler
creates runs of a scheduled deployment. A device worker runs in its own network namespace
and mount namespace, with the warehouse's folder hidden from it: the profiling results reach
the warehouse through the exchange storage. SQLite; the server listens on an address this
test gives a veth pair (loopback when namespaces are refused); everything torn down after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from poolpipe.offline.zoo import make_model
from poolpipe.store.warehouse import Warehouse
from testbed.prefect_server import Server

REPO = Path(__file__).resolve().parents[1]
POOLS = ("onboarding", "cpu", "L4", "T4", "P4", "V100")

pytestmark = pytest.mark.integration


class Net:
    """A network namespace joined to the root namespace by a veth pair, on a private /24
    that no interface here uses."""

    def __init__(self) -> None:
        self.ns = f"ppt{os.getpid()}"
        self.host_if, self.ns_if = f"ppth{os.getpid()}", f"pptn{os.getpid()}"
        used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        k = next(k for k in range(200, 250) if f"10.213.{k}." not in used)
        self.host_ip, self.ns_ip = f"10.213.{k}.1", f"10.213.{k}.2"

    def up(self) -> None:
        ns = ["ip", "netns", "exec", self.ns]
        for cmd in (
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.ns],
            ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            [*ns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
            [*ns, "ip", "link", "set", self.ns_if, "up"],
            [*ns, "ip", "link", "set", "lo", "up"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def down(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)


@contextmanager
def network() -> Iterator[tuple[Net | None, str]]:
    net = Net()
    try:
        net.up()
    except (OSError, FileNotFoundError) as exc:
        net.down()
        yield None, f"network namespaces are not permitted here ({exc})"
        return
    try:
        yield net, ""
    finally:
        net.down()


@pytest.fixture(scope="module")
def net():
    with network() as found:
        yield found


@pytest.fixture(scope="module")
def server(tmp_path_factory, net):
    home = tmp_path_factory.mktemp("prefect")
    srv = Server(home, net[0].host_ip if net[0] else "127.0.0.1")
    try:
        srv.start()
        for pool in POOLS:
            r = srv.cli("work-pool", "create", pool, "--type", "process")
            assert r.returncode == 0, r.stdout + r.stderr
        yield srv
    finally:
        srv.stop()


def control_host(server: Server, folder: Path, **env: str) -> tuple[Path, Path]:
    """The warehouse (made once, as an operator would) and a model in `folder`, and the
    onboarding pool's worker with its settings."""
    wh = folder / "wh.duckdb"
    Warehouse.open(wh).close()
    model = make_model("resnet50", folder / "r.onnx", width=0.125, image=32)
    server.worker(
        "onboarding",
        folder.parent / f"{folder.name}-onboarding-worker.log",
        POOLPIPE_HOME=str(REPO),
        POOLPIPE_WAREHOUSE=str(wh),
        **env,
    )
    return wh, model


@pytest.fixture
def workers(server):
    with server.workers():
        yield


def test_deploy_all_and_the_listing_commands(server):
    r = server.cli("deploy", "--all")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    names = {
        "onboard-model/onboard",
        "plan/plan",
        "profile-on-pool/profile",
        "measure-blocks/profile-cpu",
        "measure-blocks/profile-L4",
        "rollout/rollout",
        "nightly-replan/nightly-replan",
        "load-replan/load-replan",
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


def test_a_routers_load_event_runs_the_load_replan_deployment(server):
    """What `poolpipe serve --prefect-events` sends when the load leaves its plan's envelope
    (flows.replan.load_event_emitter, in a process of its own as a router would be, at the
    server's API) makes the server's automation from prefect.yaml's trigger create a run of
    load-replan with the router's address, the event and its reason as parameters. (No
    worker takes it: the run is deleted.)"""
    dep = server.deployment("load-replan/load-replan")  # deployed by the first test
    send = (
        "from flows.replan import load_event_emitter\n"
        "from poolpipe.runtime.envelope import EnvelopeEvent\n"
        "e = EnvelopeEvent('above', ('tiny',), 0.0, (12.5,), (10.0,), (1.0,), (1.0,),\n"
        "                  'tiny 12.5 req/s over the last 60 s')\n"
        "load_event_emitter('edge-1')('10.9.9.9:8001', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", send], cwd=REPO, env=server.env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    deadline, runs = time.monotonic() + 90, []
    while time.monotonic() < deadline and not runs:
        runs = server.http.post(
            "/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}}}
        ).json()
        time.sleep(1)
    assert len(runs) == 1, "no run of load-replan after the event"
    params = runs[0]["parameters"]
    assert params["router"] == "10.9.9.9:8001" and params["event"] == "poolpipe.load.above"
    assert params["why"] == "tiny 12.5 req/s over the last 60 s"
    assert params["min_interval_s"] == 1800  # the deployment's own
    # the clean-up: a server busy beside the suite answered it 503 once (CI, 336e9b5)
    for _ in range(10):
        gone = server.http.client.delete(f"/flow_runs/{runs[0]['id']}")
        if gone.status_code < 500:
            break
        time.sleep(1)
    gone.raise_for_status()


def test_workers_onboard_profile_and_plan_into_the_warehouse(server, workers, tmp_path):
    assert server.deployment("plan/plan")  # deployed by the test above
    wh, model = control_host(server, tmp_path)
    # a CPU host of the same machine: it reads and writes no warehouse
    server.worker("cpu", tmp_path / "cpu-worker.log", POOLPIPE_HOME=str(REPO))
    small = {"blocks": 4, "batches": [1, 2], "warmup": 1, "reps": 2}
    state, logs = server.run(
        "onboard-model/onboard", {"model_path": str(model), "name": "tiny"} | small
    )
    assert state == "COMPLETED", logs[-3000:]

    profile = {"name": "tiny", "pool": "cpu", "batches": [1, 2], "threads": 2, "reps": 2}
    missing = tmp_path / "nowhere" / "wh.duckdb"
    state, logs = server.run("profile-on-pool/profile", profile | {"warehouse": str(missing)})
    assert state == "FAILED" and "does not exist on this worker's host" in logs, logs[-3000:]
    assert not missing.parent.exists()  # no empty warehouse made
    state, logs = server.run("profile-on-pool/profile", profile)
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
    (last,) = server.http.post(
        "/flow_runs/filter", json={"sort": "EXPECTED_START_TIME_DESC", "limit": 1}
    ).json()
    r = server.cli("flow-run", "logs", last["id"])  # the CLI reads a run's logs (422 before)
    assert r.returncode == 0 and "422" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
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


def test_a_device_host_sharing_no_files_profiles_into_the_warehouse(server, net, workers, tmp_path):
    """The device worker: another network namespace (it reaches the server over the veth
    pair) and another mount namespace in which the warehouse's folder (warehouse file, blocks,
    model) is an empty tmpfs. Blocks and measurements pass through the exchange folder."""
    found, why = net
    if found is None:
        pytest.skip(why)
    control, exchange = tmp_path / "control", tmp_path / "exchange"
    control.mkdir()
    wh, model = control_host(server, control, POOLPIPE_STORAGE=str(exchange))
    hide = f'mount -t tmpfs tmpfs {control} && test ! -e {wh} && exec "$@"'
    server.worker(
        "P4",  # a pool of its own: no worker of the earlier tests polls it
        tmp_path / "device-worker.log",
        wrap=[
            *("ip", "netns", "exec", found.ns),
            *("unshare", "--mount", "--propagation", "private"),
            *("sh", "-c", hide, "sh"),
        ],
        POOLPIPE_HOME=str(REPO),
    )
    small = {"blocks": 3, "batches": [1, 2], "warmup": 1, "reps": 2}
    state, logs = server.run(
        "onboard-model/onboard", {"model_path": str(model), "name": "far"} | small
    )
    assert state == "COMPLETED", logs[-3000:]
    profile = {"name": "far", "pool": "P4", "batches": [1, 2], "engine": "onnxruntime"}
    state, logs = server.run("profile-on-pool/profile", profile | {"threads": 2, "reps": 2})
    assert state == "COMPLETED", logs[-3000:] + (tmp_path / "device-worker.log").read_text()[-3000:]
    with Warehouse.open(wh) as w:
        rows = w.con.execute(
            "SELECT DISTINCT gpu_type, provenance FROM block_latency WHERE model = 'far' "
            "AND gpu_type = 'cpu-2t'"
        ).fetchall()
    assert rows and json.loads(rows[0][1])["pool"] == "P4"
    assert not any(exchange.rglob("*.onnx"))  # the exchange is cleaned up after the run
