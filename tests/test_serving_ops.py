"""Operating a served plan for real: per-minute statistics into the warehouse, Prometheus
metrics, rollouts requested through the router's control model by the Prefect rollout
flow, and the nightly re-planning flow deciding from the observed mix."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from poolpipe.store.warehouse import Warehouse
from tests.test_serving import (  # noqa: F401
    REPO,
    _grpc,
    _infer,
    hand_plan,
    onboarded_tiny,
    two_partition_plan,
)
from triton_backend.node.repository import node_onnx_path

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(onboarded_tiny):  # noqa: F811
    """A router whose control needs a token; the flows of this module find it through
    $POOLPIPE_TOKEN_FILE, as a worker would."""
    import os

    from poolpipe.client.control import TOKEN_FILE_VAR, new_token_file, read_token
    from triton_backend.deploy.serving import ServingProcess

    wh, tmp = onboarded_tiny
    token_file = tmp / "ops.token"
    new_token_file(token_file)
    before = os.environ.get(TOKEN_FILE_VAR)
    os.environ[TOKEN_FILE_VAR] = str(token_file)
    plan = two_partition_plan()
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(plan, label="test")
    srv = ServingProcess(
        plan,
        wh,
        tmp / "ws-ops",
        plan_id=plan_id,
        stats_interval_s=3600,
        metrics_port=0,
        router_instances=4,
        token=read_token(token_file),
    )
    yield srv
    srv.close()
    if before is None:
        os.environ.pop(TOKEN_FILE_VAR, None)
    else:
        os.environ[TOKEN_FILE_VAR] = before


def _send(server, n: int) -> None:
    """`n` requests answered. One that the router drops (its batch ran past the SLO on this
    host shared with the whole suite: an explicit drop, as designed) is asked again, once:
    these tests check what is served, not how fast."""
    from triton_backend.router.core import DROP_MARKER

    mod, client = _grpc(server.deployment)
    x = np.zeros((1, 3, 32, 32), np.float32)
    for _ in range(n):
        try:
            _infer(mod, client, x)
        except Exception as exc:
            if DROP_MARKER not in str(exc):
                raise
            _infer(mod, client, x)


def test_statistics_land_in_the_warehouse(server, onboarded_tiny):  # noqa: F811
    wh, _ = onboarded_tiny
    server.flush_stats()  # start a fresh window
    _send(server, 6)
    assert server.flush_stats() > 0
    with Warehouse.open(wh) as w:
        row = w.con.execute(
            "SELECT arrivals, on_time + late, dropped, failed, p50_ms, p99_ms, mean_batch, "
            "plan_id FROM serving_stats WHERE model = 'tiny' ORDER BY minute DESC, "
            "arrivals DESC LIMIT 1"
        ).fetchone()
        busy = w.con.execute(
            "SELECT count(*), sum(busy_ms) FROM serving_pool_busy WHERE model = 'tiny'"
        ).fetchone()
    assert row[:4] == (6, 6, 0, 0)
    assert 0 < row[4] <= row[5] and row[6] >= 1 and row[7] == server.plan_id
    assert busy[0] >= 2 and busy[1] > 0
    # what a stage call took on the nodes beyond the profiled run, for plan and serve
    with Warehouse.open(wh) as w:
        assert w.measured_call_overhead_us(["tiny"]) == pytest.approx(
            server.deployment.call_overhead_us()
        )
        assert w.measured_call_overhead_us(["another"]) is None


def test_requests_with_nan_or_infinite_inputs_are_counted(server):
    """An all-NaN input is served as sent (the model's answer to it is the client's), but
    counted by model for Prometheus and logged with the statistics window: it was served
    and counted on time without a word."""
    import logging

    mod, client = _grpc(server.deployment)
    before = server.deployment.core.nonfinite["tiny"]
    for value in (np.nan, np.inf):
        x = np.zeros((1, 3, 32, 32), np.float32)
        x[0, 1, 2, 3] = value
        with contextlib.suppress(Exception):  # served or dropped: counted at the door
            _infer(mod, client, x)
    _send(server, 1)  # finite: not counted
    assert server.deployment.core.nonfinite["tiny"] == before + 2
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    m = re.search(r'poolpipe_nonfinite_inputs_total\{model="tiny"\} (\S+)', text)
    assert m and float(m.group(1)) == before + 2, text[-2000:]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("poolpipe.serve")
    logger.addHandler(handler)
    try:
        server._say_nonfinite()
        server._say_nonfinite()  # nothing new since: said once
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records]
    assert len(said) == 1 and "NaN or infinite" in said[0] and "tiny 2" in said[0], said


def _load_sampled(server, timeout_s: float = 10.0) -> None:
    """Until the router's load watch has taken a sample since the requests just sent (it
    samples every second)."""
    import time

    before = server.load.figures().get("sampled_s", 0.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fig = server.load.figures()
        if fig["models"] and fig["sampled_s"] > before:
            return
        time.sleep(0.1)
    raise AssertionError(f"the load watch took no sample in {timeout_s:g} s")


def test_router_metrics_for_prometheus(server):
    _send(server, 2)
    _load_sampled(server)
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    m = re.search(r'poolpipe_requests_total\{model="tiny",outcome="arrivals"\} (\S+)', text)
    assert m and float(m.group(1)) >= 2
    assert "poolpipe_pool_busy_seconds_total" in text and "poolpipe_in_flight" in text
    assert "poolpipe_reply_margin_seconds" in text
    assert re.search(r'poolpipe_model_ready\{model="tiny"\} 1\.0', text)
    # the load observed: arrival rates over windows; the envelope's events (a hand-made
    # plan states no deliverable req/s: no envelope, no share of it)
    assert re.search(r'poolpipe_arrival_rate\{model="tiny",window="10s"\} [0-9.]+', text)
    assert re.search(r'poolpipe_envelope_events_total\{kind="above"\} 0\.0', text)
    assert "poolpipe_load_share{" not in text
    # what an autoscaler reads: the GPUs in use by type (the load's needs once advised)
    used = server.deployment.plan.gpus_used()
    for gpu, n in used.items():
        assert re.search(rf'poolpipe_gpus_in_use\{{gpu="{gpu}"\}} {n}\.0', text), text
    assert "# TYPE poolpipe_node_releasable gauge" in text


def test_the_load_read_from_the_router_leaves_an_envelope_and_says_so(server, caplog):
    """The router's own counters through a load watch (its plan stating a deliverable rate)
    whose envelope any load leaves (times given, not waited for): one `above` event, logged
    once with the model and its rate, counted; a second sample still above says nothing
    more."""
    from dataclasses import replace

    from poolpipe.runtime.envelope import EnvelopeConfig
    from triton_backend.deploy.envelope import LoadWatch

    core, dep = server.deployment.core, server.deployment
    stated = replace(
        dep.plan, models=tuple(replace(m, deliverable=m.throughput) for m in dep.plan.models)
    )
    watch = LoadWatch(
        lambda: core.stats,
        lambda: stated,
        EnvelopeConfig(high=2e-6, low=1e-6, short_s=1.0, long_s=1.0, hold_s=3600.0),
    )
    assert watch.sample(0.0) == []
    _send(server, 3)
    with caplog.at_level("WARNING", logger="poolpipe.serve"):
        events = watch.sample(1e6)
        assert watch.sample(2e6) == []  # still out: said once
    assert [e.kind for e in events] == ["above"] and events[0].rates[0] >= 3
    said = [r.getMessage() for r in caplog.records if "over the last 1 s" in r.getMessage()]
    assert len(said) == 1 and "the load left the plan's envelope (above): tiny" in said[0]
    fig = watch.figures()["models"]["tiny"]
    assert watch.events["above"] == 1
    assert fig["envelope_req_s"] == round(dep.plan.models[0].throughput, 2)


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Prometheus is not installed (Debian's prometheus package; ./run installs it as root)",
)
def test_a_real_prometheus_with_poolpipes_rules_and_dashboard_scrapes_the_router_and_nodes(
    server, tmp_path
):
    """deploy/prometheus/poolpipe.rules.yml loaded by a real Prometheus that scrapes the
    router's metrics and its nodes' Triton metrics every second: every target up, every
    rule evaluated without error, the recording rules' series there for the model and
    each of its pools while requests flow, and every query of the Grafana dashboard
    (deploy/grafana/poolpipe.json) returning series."""
    import subprocess
    import time

    from poolpipe.client import send_control
    from poolpipe.client.control import token_from
    from tests.test_grafana import panel_queries
    from tests.test_prometheus import RULES, rules_in_file
    from triton_backend.env import free_ports

    nodes = [f"127.0.0.1:{n.metrics_port}" for n in server.deployment.local.nodes.values()]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "poolpipe",
                "static_configs": [{"targets": [f"127.0.0.1:{server.metrics_port}"]}],
            },
            {"job_name": "triton", "static_configs": [{"targets": nodes}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # (JSON is YAML)
    port = free_ports(1)[0]
    api = f"http://127.0.0.1:{port}/api/v1"
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    pools = len(server.deployment.core.runtime.topo.pools)
    # what the load needs, as the load-replan flow tells a router (its panel plots it)
    used = server.deployment.plan.gpus_used()
    advice = {"needed": used, "in_use": used, "available": used, "headroom": 0.2, "rates": {}}
    router = f"127.0.0.1:{server.deployment.grpc_port}"
    assert send_control(router, {"op": "advice", "advice": advice}, token=token_from(None))["ok"]
    wanted = {
        "up == 1": 1 + len(nodes),
        'poolpipe:arrivals:rate5m{model="tiny"} > 0': 1,
        'poolpipe:attainment:ratio5m{model="tiny"} >= 0': 1,
        "poolpipe:pool_utilisation:ratio5m > 0": pools,
        "poolpipe:pool_utilisation_over_plan:ratio5m > 0": pools,
        'poolpipe:deliverable_headroom:ratio5m{model="tiny"}': 1,
        "nv_inference_request_success": 1,  # a node's own figure (at least one)
    }
    # and every panel of the Grafana dashboard shows something
    wanted.update({q: max(1, wanted.get(q, 1)) for q in panel_queries()})
    got: dict[str, int] = {}

    def count(query: str) -> int:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{api}/query", params={"query": query}, timeout=5)
            if r.status_code == 200:  # 503 "Service Unavailable" while Prometheus starts
                return len(r.json()["data"]["result"])
        return 0

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _send(server, 2)
            got = {q: count(q) for q in wanted}
            if all(got[q] >= k for q, k in wanted.items()):
                break
            time.sleep(0.5)
        rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log_text = (tmp_path / "prometheus.log").read_text()[-3000:]
    short = {q: (got.get(q, 0), k) for q, k in wanted.items() if got.get(q, 0) < k}
    assert not short, f"queries with fewer series than wanted (got, wanted): {short}\n{log_text}"
    assert got["up == 1"] == 1 + len(nodes), got
    health = {
        r.get("name"): (r["health"], r.get("lastError", "")) for g in rules for r in g["rules"]
    }
    assert len(health) == len(rules_in_file())
    assert all(h == ("ok", "") for h in health.values()), health


def test_rollout_flow_goes_through_the_control_model(prefect_api, server, onboarded_tiny):  # noqa: F811
    from flows.rollout import rollout_plan

    wh, _ = onboarded_tiny
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(two_partition_plan(cut=1), label="test-b")
    router = f"127.0.0.1:{server.deployment.grpc_port}"
    old_cuts = [p.path for p in server.deployment.parts.values()]
    assert old_cuts and all(path.exists() for path in old_cuts)
    result = rollout_plan(str(plan_id), router, warehouse=wh)
    assert result["ok"] and result["status"] == "done" and result["failed"] == 0
    assert server.plan_id == plan_id
    # the old generation's partition files leave the workspace with its models; the new
    # generation's are there, each with the file its node runs made beside it
    assert not any(path.exists() for path in old_cuts)
    for part in server.deployment.parts.values():
        assert part.path.exists() and node_onnx_path(part).exists()
    with Warehouse.open(wh) as w:
        status, downtime = w.con.execute(
            "SELECT status, downtime_ms FROM rollouts WHERE plan_id = ?", [plan_id]
        ).fetchone()
    assert status == "done" and 0 <= downtime < 1000
    _send(server, 2)  # still serving, on the new plan
    assert {p.start for p in server.deployment.layout.placements} == {0, 1}


def test_a_rollout_is_reported_as_it_happened_while_the_warehouse_is_held(
    prefect_api,
    server,
    onboarded_tiny,  # noqa: F811
    monkeypatch,
):
    """The issue: with the warehouse locked, `poolpipe rollout` said "did not happen" while
    the router had switched, and no row was written. Here another process takes the DuckDB
    file right after the switch, before the router records it: the flow reports the
    rollout done, the row waits in the spool beside the warehouse, and the next open after
    the holder lets go writes it."""
    from pathlib import Path

    from flows.rollout import rollout_plan
    from poolpipe.store.warehouse import spool_dir
    from testbed.holder import hold_elsewhere as hold

    wh, _ = onboarded_tiny
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(two_partition_plan(cut=3), label="test-held")
    holders = []
    switch = server.deployment.rollout

    def switch_then_held(*args, **kwargs):
        result = switch(*args, **kwargs)
        holders.append(hold(wh, 8))  # a real second process with the file open
        return result

    monkeypatch.setattr(server.deployment, "rollout", switch_then_held)
    router = f"127.0.0.1:{server.deployment.grpc_port}"
    try:
        result = rollout_plan(str(plan_id), router, warehouse=wh)
        assert result["ok"] and result["status"] == "done", result
        assert server.plan_id == plan_id and holders
        assert list(spool_dir(Path(wh)).glob("*.jsonl"))  # recorded, not yet written
    finally:
        for h in holders:
            h.wait(30)
    with Warehouse.open(wh) as w:
        assert w.con.execute(
            "SELECT status FROM rollouts WHERE plan_id = ?", [plan_id]
        ).fetchall() == [("done",)]
    assert not list(spool_dir(Path(wh)).glob("*.jsonl"))
    _send(server, 2)


def test_control_and_management_need_the_token(server):
    """Anonymous clients of the router may infer, but not control it, nor load or unload
    models on its nodes or on its own Triton (Triton's restricted APIs); with the token
    (the key derived from it) they may."""
    import os

    from poolpipe.client import send_control
    from poolpipe.client.control import TOKEN_FILE_VAR, node_headers, node_key, read_token

    router = f"127.0.0.1:{server.deployment.grpc_port}"
    refused = send_control(router, {"op": "stats"})
    assert refused["ok"] is False and "need this router's token" in refused["error"]
    assert send_control(router, {"op": "stats"}, token="x" * 32)["ok"] is False
    token = read_token(os.environ[TOKEN_FILE_VAR])
    assert send_control(router, {"op": "stats"}, token=token)["ok"] is True
    dep = server.deployment
    node = next(iter(dep.nodes.values()))
    partition = next(p.partition for p in dep.layout.placements if p.node == node.name)
    for url, model in ((f"http://{dep.http_url}", "tiny"), (f"http://{node.http_url}", partition)):
        r = httpx.post(f"{url}/v2/repository/models/{model}/unload")
        assert r.status_code == 403 and "restricted" in r.text
        r = httpx.post(f"{url}/v2/repository/index")
        assert r.status_code == 403
        r = httpx.post(
            f"{url}/v2/repository/index", headers=node_headers(node_key(token), grpc=False)
        )
        assert r.status_code == 200
    _send(server, 1)  # still serving: nothing was unloaded


def test_nightly_replan_rolls_out_only_when_better(prefect_api, server, onboarded_tiny):  # noqa: F811
    from flows.replan import nightly_replan

    wh, _ = onboarded_tiny
    _send(server, 4)
    server.flush_stats()
    router = f"127.0.0.1:{server.deployment.grpc_port}"
    kw = dict(cluster="local-1t", clusters_file=str(REPO / "local-clusters.toml"), warehouse=wh)
    # the hand-made plan claims 1 req/s (unknown); a real plan does far better, but not a
    # billion times better
    keep = nightly_replan(router=router, margin=1e9, **kw)
    assert keep["rolled_out"] is False and "not better" in keep["why"]
    assert keep["new_objective"] > keep["serving_objective"] > 0
    gen = server.deployment.generation
    done = nightly_replan(router=router, margin=0.05, **kw)
    assert done["rolled_out"] is True and server.deployment.generation == gen + 1
    assert server.plan_id == done["plan_id"]
    _send(server, 2)


def test_load_replan_waits_out_its_interval_then_replans(prefect_api, server, onboarded_tiny):  # noqa: F811
    """The flow prefect.yaml's load-replan trigger runs on a router's load event: within
    its interval of the deployment's last rollout it declines, saying so; past it, it is
    the nightly re-plan with the event as its trigger; with the cost objective, the cheapest
    GPUs for the router's rates, rolled out where they save enough."""
    from flows.replan import load_replan
    from flows.rollout import rollout_plan

    wh, _ = onboarded_tiny
    router = f"127.0.0.1:{server.deployment.grpc_port}"
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(two_partition_plan(cut=3), label="test-load")
    assert rollout_plan(str(plan_id), router, warehouse=wh)["ok"]  # a rollout just now
    _send(server, 3)
    server.flush_stats()
    kw = dict(cluster="local-1t", clusters_file=str(REPO / "local-clusters.toml"), warehouse=wh)
    gen = server.deployment.generation
    wait = load_replan(router=router, event="poolpipe.load.above", why="a test", **kw)
    assert wait["rolled_out"] is False and "at most one re-plan per 1800 s" in wait["why"]
    again = load_replan(
        router=router, event="poolpipe.load.mix", why="a test", min_interval_s=0, margin=1e9, **kw
    )
    assert again["trigger"] == "poolpipe.load.mix: a test"
    assert again["rolled_out"] is False and "not better" in again["why"]
    assert server.deployment.generation == gen and server.plan_id == plan_id
    # the cost objective: the cheapest GPUs of local-1t for the router's rates x 1.2
    follow = load_replan(
        router=router, event="poolpipe.load.below", why="a test", min_interval_s=0,
        objective="cost", **kw,
    )  # fmt: skip
    assert follow["objective"] == "cost" and follow["trigger"] == "poolpipe.load.below: a test"
    assert follow["in_use"] == {"cpu-1t": 2} and follow["needed"] == {"cpu-1t": 1}, follow
    assert follow["why"] == "below: 1 per hour against 2" and follow["rolled_out"] is True
    # ... told the router, whose gauges say what the load needs
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    assert re.search(r'poolpipe_gpus_needed\{gpu="cpu-1t"\} 1\.0', text), text
    assert re.search(r"poolpipe_gpus_needed_headroom 0\.2", text), text
    assert server.advice["needed"] == {"cpu-1t": 1} and server.advice["in_use"] == {"cpu-1t": 2}
    assert server.deployment.generation == gen + 1 and server.plan_id == follow["plan_id"]
    _send(server, 2)
    # asked again (the periodic check): the plan for the load is the one served, which stays
    kept = load_replan(
        router=router, event="poolpipe.load.check", why="a test", min_interval_s=0,
        objective="cost", **kw,
    )  # fmt: skip
    assert kept["rolled_out"] is False and "less than 10% saved" in kept["why"], kept
    assert kept["why"].endswith(f"plan {follow['plan_id']} stays")
    assert server.deployment.generation == gen + 1
    # the module's later tests expect the hand-made plan (no envelope) served again
    assert rollout_plan(str(plan_id), router, warehouse=wh)["ok"]
    assert server.plan_id == plan_id


def test_serve_and_rollout_commands(prefect_api, onboarded_tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    """`poolpipe serve PLAN.json` in its own process, a request to it, `poolpipe rollout`
    from this one, and a clean stop on SIGTERM. Its reply margin is the plan's whole SLO:
    serve refuses the plan (as a rollout does) unless --force, then warns, and requests
    that bring their own SLO are served."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from poolpipe.client import send_control
    from poolpipe.client.control import TOKEN_FILE_VAR, read_token
    from poolpipe_cli import main as cli_main

    monkeypatch.delenv(TOKEN_FILE_VAR, raising=False)  # serve makes its own token
    wh, _ = onboarded_tiny
    plan_file = tmp_path / "plan.json"
    two_partition_plan().save(plan_file)
    refused = tmp_path / "refused"
    argv = ["--warehouse", wh, "serve", str(plan_file), "--reply-margin-ms", "300"]
    assert cli_main([*argv, "--workspace", str(refused)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    # (300 ms, plus what the module's router measured beyond its floor, if anything)
    margin = r"reply margin 3[0-9][0-9](\.[0-9]+)? ms"
    assert re.search(rf"refused: tiny: SLO 300 ms less the router's {margin}", said), said
    assert "--force serves it anyway" in said and not refused.exists()
    for bad, why in (
        (["--door-ring-mb", "-1"], "--door-ring-mb must be 0 or more, got -1"),
        (["--door-queue", "-2"], "--door-queue must be 0 or more (0: no bound), got -2"),
        (["--door-ring-dir", str(tmp_path / "none")], "no such folder"),
    ):
        assert cli_main([*argv, "--workspace", str(refused), *bad]) == 2
        assert why in " ".join(capsys.readouterr().err.split()) and not refused.exists()
    env = {**os.environ, "COLUMNS": "300"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "poolpipe_cli",
            "--warehouse",
            wh,
            "serve",
            str(plan_file),
            "--workspace",
            str(tmp_path / "ws"),
            "--router-instances",
            "2",
            "--reply-margin-ms",
            "300",
            "--force",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # a process group of its own, as in a terminal
    )
    try:
        port, seen = None, []
        deadline = time.monotonic() + 180
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"gRPC 127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "".join(seen[-20:])
        while "Ctrl-C" not in seen[-1]:  # the rest of what serve says on start
            seen.append(proc.stdout.readline())
        said = " ".join("".join(seen).split())
        assert re.search(rf"tiny: SLO 300 ms less the router's {margin} leaves less", said)
        assert "every request at that SLO will be dropped" in said
        # each node and the router's Triton as they come up (serve was silent until all were)
        assert re.search(r"\(cpu-\dt\) up in [0-9.]+ s at 127\.0\.0\.1:\d+ \(gRPC\)", said)
        assert re.search(r"router-triton \(router\) up in [0-9.]+ s", said), said
        import tritonclient.grpc as tg

        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.zeros((1, 3, 32, 32), np.float32)
        i = tg.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        assert client.infer("tiny", [i], parameters={"slo_ms": 1000}).as_numpy(
            client.get_model_metadata("tiny").outputs[0].name
        ).shape == (1, 1000)
        b = tmp_path / "b.json"
        two_partition_plan(cut=1).save(b)
        # serve made a token only its user may read: without it no rollout happens
        token = tmp_path / "ws" / "control.token"
        assert f"--token-file {token}" in said and token.stat().st_mode & 0o077 == 0
        rollout = ["--warehouse", wh, "rollout", str(b), "--router", f"127.0.0.1:{port}"]
        capsys.readouterr()
        assert cli_main(rollout) == 2
        assert "refused: control commands need" in capsys.readouterr().err
        # its SLO leaves no room after a 300 ms margin: refused, unless forced
        assert cli_main([*rollout, "--token-file", str(token)]) == 2
        assert "no time to serve a request in" in " ".join(capsys.readouterr().err.split())
        assert cli_main([*rollout, "--token-file", str(token), "--force"]) == 0
        assert client.infer("tiny", [i], parameters={"slo_ms": 1000}).as_numpy(
            client.get_model_metadata("tiny").outputs[0].name
        ).shape == (1, 1000)
        # advise: the GPUs the load of the last 10 s needs, of those the router's nodes offer
        for _ in range(5):  # (the rates start anew with the plan rolled out)
            client.infer("tiny", [i], parameters={"slo_ms": 1000})
        capsys.readouterr()
        router = ["--router", f"127.0.0.1:{port}", "--token-file", str(token)]
        # the router samples its rates once a second, on a loop that a busy host delays:
        # ask until its window has seen the requests (10 s at most)
        deadline = time.monotonic() + 10
        while True:
            time.sleep(1.0)
            advise = ["--warehouse", wh, "advise", *router, "--window", "10", "--json"]
            assert cli_main(advise) == 0
            a = json.loads(capsys.readouterr().out)
            if a["rates"]["tiny"] > 0 or time.monotonic() > deadline:
                break
        assert a["in_use"] == two_partition_plan(cut=1).gpus_used(), a
        assert sum(a["available"].values()) == 2 and a["rates"]["tiny"] > 0, a
        assert a["needed"] and a["why_not"] is None and not a["priced"], a
        assert set(a["change"]) == set(a["in_use"]) | set(a["needed"]), a
        assert all(n["action"] for n in a["releasable"]), a
        assert cli_main(["--warehouse", wh, "advise", *router, "--window", "10"]) == 0
        said = " ".join(capsys.readouterr().out.split())
        assert "GPUs for the load of the router's last 10 s x 1.2" in said, said
        assert "no prices known: every GPU counted as 1" in said, said
        assert cli_main(["--warehouse", wh, "advise", *router, "--window", "7"]) == 2
        assert "keeps no 7s rate (it keeps: 10s, 60s, 300s)" in capsys.readouterr().err
        # --publish: the router keeps the advice (its gauges, its status)
        assert cli_main(["--warehouse", wh, "advise", *router, "--window", "10", "--publish"]) == 0
        assert "told router 127.0.0.1" in capsys.readouterr().out
        st = send_control(f"127.0.0.1:{port}", {"op": "status"}, token=read_token(token))
        assert st["advice"]["needed"] == a["needed"] and st["advice"]["headroom"] == 0.2, st
        bad = send_control(
            f"127.0.0.1:{port}", {"op": "advice", "advice": {"headroom": -1}},
            token=read_token(token),
        )  # fmt: skip
        assert bad["ok"] is False and "headroom must be a share >= 0" in bad["error"], bad
    finally:  # a terminal's Ctrl-C: SIGINT to serve and the nodes it started alike
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0
    # each stopping step (a stop printed nothing for seconds)
    assert "the last statistics are in the warehouse" in rest and "router stopped" in rest, rest
    assert re.search(r"stopped \S+, \S+", rest), rest  # the two nodes it started
    # the nodes ending with it are no warning, and none is restarted (both were, on Ctrl-C)
    assert not re.search(r"WARNING .*node .*(down|restart|exited)", rest), rest
    # a rollout refused is a warning; one done is news (it was logged as a warning too)
    assert re.search(r"WARNING poolpipe.serve: rollout of plan \d+: refused", rest), rest
    assert re.search(r"INFO poolpipe.serve: rollout of plan \d+: done", rest), rest


def test_serve_refuses_a_plan_the_nodes_measure_too_slow_for_its_slo(
    onboarded_tiny,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    """A plan whose SLO, less the reply margin, leaves a little more than its planned
    latency passes the check on the plan, but a stage call on a node costs more than the
    block's profiled run: serve checks again on the stage times it measured on the nodes
    and refuses what the door would refuse every request of (it served such a plan,
    refusing every request, while ready), and stops the nodes it started."""
    import shutil

    import duckdb

    from poolpipe.client.control import TOKEN_FILE_VAR
    from poolpipe_cli import main as cli_main

    monkeypatch.delenv(TOKEN_FILE_VAR, raising=False)
    wh, _ = onboarded_tiny
    fresh = str(Path(wh).with_name("wh-unserved.duckdb"))  # no router's margin measured
    shutil.copy(wh, fresh)
    with duckdb.connect(fresh) as db:
        db.execute("DELETE FROM serving_stats")
    plan = two_partition_plan(batch=1)
    planned_ms = plan.models[0].pipelines[0].latency_us / 1e3
    margin_ms = plan.models[0].slo_us / 1e3 - 1.05 * planned_ms
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    argv = ["--warehouse", fresh, "serve", str(plan_file), "--reply-margin-ms", f"{margin_ms}"]
    assert cli_main([*argv, "--workspace", str(tmp_path / "ws")]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert re.search(r"refused: tiny: its SLO 300 ms less .* less than its fastest pipeline's "
                     r"measured latency", said), said  # fmt: skip
    assert "--force serves it anyway" in said
    left = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(tmp_path / "ws").encode() in _cmdline(p)
    ]
    assert not left, f"processes of the refused serve still run: {left}"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b""


def test_two_quick_ctrl_c_leave_no_process_or_shared_memory(onboarded_tiny, tmp_path):  # noqa: F811
    """Two SIGINTs 0.5 s apart used to kill `serve` in the middle of its teardown with a
    traceback and leave its tritonservers listening: teardown now finishes whatever
    arrives meanwhile."""
    import os
    import signal
    import time

    from triton_backend.node.triton import descendants, still_running

    wh, _ = onboarded_tiny
    plan_file = tmp_path / "plan.json"
    two_partition_plan().save(plan_file)
    shm_before = set(os.listdir("/dev/shm"))
    proc = _serving(
        ["--warehouse", wh, "serve", str(plan_file), "--workspace", str(tmp_path / "ws")], 180
    )
    assert proc.stdout is not None
    children: list[tuple[int, str]] = []
    try:
        children = descendants(proc.pid)
        assert len(children) >= 3  # the router's and the nodes' tritonservers, at least
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(90)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = sorted(p for p, _ in still_running(children))  # (pid and start time: pids wrap)
    for p in left:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"orphaned processes {left}"
    assert "Traceback" not in out, out
    assert rc in (0, 130), out
    shm_left = {f for f in set(os.listdir("/dev/shm")) - shm_before if "triton" in f}
    assert not shm_left, shm_left


def test_a_node_beyond_loopback_does_not_start_without_a_token(tmp_path, monkeypatch, capsys):
    """A node's model-repository API answers whoever reaches it unless a token restricts
    it: beyond loopback, `poolpipe node` refuses to start without one (before any Triton
    starts), naming the fix."""
    from poolpipe.client.control import TOKEN_FILE_VAR
    from poolpipe_cli import main

    monkeypatch.delenv(TOKEN_FILE_VAR, raising=False)
    for address in ("0.0.0.0", "10.213.250.9", "::", "node-7.example"):
        argv = ["node", "--device", "cpu-1t", "--listen", address]
        assert main([*argv, "--workspace", str(tmp_path / "n")]) == 2
        err = capsys.readouterr().err
        assert f"--listen {address} without a token" in err and "--token-file" in err, err
    assert not (tmp_path / "n").exists()  # nothing started, nothing written


def test_a_node_killed_outright_takes_its_tritonserver_along(tmp_path):
    """`poolpipe node` SIGKILLed (the OOM killer, `kill -9`) used to leave its tritonserver
    serving, orphaned: the server now gets SIGTERM when the node's process dies."""
    argv = ["node", "--device", "cpu-1t", "--listen", "127.0.0.1"]
    proc = _serving([*argv, "--workspace", str(tmp_path / "node")], 120)
    left = _killed_outright(proc, at_least=1, within_s=20)
    assert not left, f"the node's tritonserver {left} outlived it"


def _leftovers() -> set[str]:
    """Triton's upload folders and routers' door folders in the temporary folders."""
    import tempfile
    from pathlib import Path

    uploads = {str(p) for p in Path("/tmp").glob("folder??????")}
    return uploads | {str(p) for p in Path(tempfile.gettempdir()).glob("poolpipe-door-*")}


def test_a_port_holder_is_named_while_its_other_threads_open_and_close_files():
    """The holder's descriptors closing while /proc is read (its other threads at work)
    used to hide it: one descriptor gone skipped the whole process, and the refusal said
    "another process" (a CI run of the test below)."""
    import os
    import socket
    import tempfile
    import threading

    from triton_backend.node.triton import port_holder

    stop = threading.Event()

    def churn() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "f")
            while not stop.is_set():
                for fd in [os.open(path, os.O_CREAT | os.O_RDWR) for _ in range(50)]:
                    os.close(fd)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            named = [port_holder("127.0.0.1", port) for _ in range(30)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(h is not None and h.endswith(f"(pid {os.getpid()})") for h in named), named


def test_a_port_another_process_holds_is_named_not_reused(onboarded_tiny, tmp_path, capsys):  # noqa: F811
    """A leftover Triton on the router's port used to answer for the new router (which
    printed "serving" while its own Triton had failed to bind): a taken port is refused
    before anything starts, with whoever holds it; a node's likewise."""
    import os
    import socket

    from poolpipe_cli import main as cli_main
    from triton_backend.node.triton import NodeError, TritonNode

    wh, _ = onboarded_tiny
    plan_file = tmp_path / "plan.json"
    two_partition_plan().save(plan_file)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["--warehouse", wh, "serve", str(plan_file), "--grpc-port", str(port)]
        assert cli_main([*argv, "--workspace", str(tmp_path / "ws")]) == 2
        err = capsys.readouterr().err
        assert f"gRPC port {port} on 127.0.0.1 is taken by" in err and f"pid {os.getpid()}" in err
        started = [f.name for f in (tmp_path / "ws").iterdir()]
        assert set(started) <= {"control.token"}, started  # refused before anything started
        node = TritonNode("n", "cpu-1t", tmp_path / "repo", tmp_path, http_port=port)
        with pytest.raises(NodeError, match=rf"http port {port} .* taken by .*pid {os.getpid()}"):
            node.start()
        assert node.process is None


def _two_nodes(tmp_path, keys):
    """Two tritonserver nodes on loopback (management APIs restricted by `keys`, one each)
    and the inventory that lists them, as an operator's would."""
    from poolpipe.domain.inventory import Inventory, InventoryNode, InventoryServer
    from triton_backend.node.triton import TritonNode

    nodes = [
        TritonNode(f"n{k}", "cpu-1t", tmp_path / f"repo{k}", tmp_path, key=key).start()
        for k, key in enumerate(keys)
    ]
    inv = Inventory(
        (InventoryServer("s0", 1.0),),
        tuple(InventoryNode(n.name, "s0", "cpu-1t", n.grpc_url, http=n.http_url) for n in nodes),
        str(tmp_path / "inventory.toml"),
    )
    return nodes, inv


def test_a_router_unloads_what_an_earlier_router_left_on_its_nodes(onboarded_tiny, tmp_path):  # noqa: F811
    """A router killed after a rollout left its generation's partitions loaded on its
    nodes, and no later router took them off: the next router of those models unloads
    them at start-up and says which."""
    from triton_backend.deploy.deployment import Deployment
    from triton_backend.node.triton import stop_nodes

    wh, _ = onboarded_tiny
    nodes, inv = _two_nodes(tmp_path, [None, None])
    try:
        dead = Deployment.up(two_partition_plan(), wh, tmp_path / "a", inventory=inv)
        assert dead.rollout(two_partition_plan(cut=1), wh).status == "done"
        dead.frontend.stop()  # it dies: nothing taken off its nodes
        dead.core.stop()
        left = sorted(m for n in nodes for m in n.models())
        assert left == ["tiny__b00-01__g1", "tiny__b01-04__g1"]
        with Deployment.up(two_partition_plan(), wh, tmp_path / "b", inventory=inv) as dep:
            assert sorted(c.split(": ")[1] for c in dep.cleaned) == left
            assert sorted(m for n in nodes for m in n.models()) == sorted(
                p.partition for p in dep.layout.placements
            )
        assert not [m for n in nodes for m in n.models()]  # and it takes its own off
    finally:
        stop_nodes(nodes)


def test_a_node_joins_a_routers_inventory_and_one_is_released(onboarded_tiny, tmp_path, capsys):  # noqa: F811
    """Capacity asked for and given back on a live router (serve --nodes): a node that
    answers joins its inventory (`poolpipe join`) and the next rollout places on it; a node
    the plan uses is not released, one the plan left is (`poolpipe release`), with nothing
    of the router's left on it; a node that does not answer is refused, nothing changed."""
    from dataclasses import replace

    from poolpipe.errors import PoolpipeError
    from poolpipe_cli import main as cli_main
    from triton_backend.deploy.serving import ServingProcess
    from triton_backend.env import free_ports
    from triton_backend.node.triton import stop_nodes

    wh, _ = onboarded_tiny
    nodes, inv = _two_nodes(tmp_path, [None, None])
    whole = hand_plan([(0, 4, 1)])
    srv = None
    try:
        first = replace(inv, nodes=inv.nodes[:1])
        srv = ServingProcess(whole, wh, tmp_path / "ws", stats_interval_s=3600, inventory=first)
        gone = f"127.0.0.1:{free_ports(1)[0]}"
        with pytest.raises(PoolpipeError, match=f"node n9 does not answer at {gone}"):
            srv.control({"op": "join", "node": {"name": "n9", "server": "s0", "device": "cpu-1t",
                                                "grpc": gone}})  # fmt: skip
        assert [n.name for n in srv.deployment.inventory.nodes] == ["n0"]
        n1, router = inv.nodes[1], ["--router", srv.deployment.grpc_url]
        capsys.readouterr()
        join = ["join", "n1", "--server", "s0", "--device", "cpu-1t", "--grpc", n1.grpc]
        assert cli_main([*join, "--http", str(n1.http), *router]) == 0
        assert "node n1 (cpu-1t) joined: 2 nodes in the inventory" in capsys.readouterr().out
        assert cli_main([*join, *router]) == 2  # once only
        assert "listed twice" in capsys.readouterr().err
        assert srv.rollout(two_partition_plan()).status == "done"
        dep = srv.deployment
        assert {dep.nodes[p.node].name for p in dep.layout.placements} == {"n0", "n1"}
        assert cli_main(["release", "n1", *router]) == 2
        assert "node n1 runs the plan served" in " ".join(capsys.readouterr().err.split())
        assert srv.rollout(whole).status == "done"
        assert {dep.nodes[p.node].name for p in dep.layout.placements} == {"n0"}
        assert cli_main(["release", "n1", *router]) == 0
        assert "node n1 released" in capsys.readouterr().out
        assert [n.name for n in srv.deployment.inventory.nodes] == ["n0"]
        assert nodes[1].models() == []  # nothing of the router's is left on it
    finally:
        if srv is not None:
            srv.close()
        stop_nodes(nodes)


def test_a_node_with_another_token_is_named_and_nothing_is_loaded(onboarded_tiny, tmp_path):  # noqa: F811
    """One node started with another token than the router's: serving used to fail on
    Triton's "expecting header ..." after the other node had loaded its partition, which
    stayed. It now fails saying the keys differ, before loading anything anywhere."""
    from poolpipe.client.control import node_key
    from triton_backend.deploy.deployment import Deployment
    from triton_backend.node.triton import NodeError, stop_nodes

    wh, _ = onboarded_tiny
    mine, other = "m" * 32, "o" * 32
    nodes, inv = _two_nodes(tmp_path, [node_key(mine), node_key(other)])
    try:
        with pytest.raises(
            NodeError,
            match=r"node n1 .*restricted to a key that does not match this router's token",
        ):
            Deployment.up(two_partition_plan(), wh, tmp_path / "ws", inventory=inv, token=mine)
        assert not nodes[0].models()  # (asked with its own key)
    finally:
        stop_nodes(nodes)


def _killed_outright(proc, at_least: int, within_s: float) -> list[str]:
    """SIGKILL `proc` (with `at_least` processes below it) and wait up to `within_s` for
    them to go; the ones that did not, each named by its pid and command line (killed now,
    not left to the next test). A process is known by its pid and start time: pids wrap
    (32768 here), and a thread of another process may take one of theirs meanwhile."""
    import os
    import signal
    import time

    from triton_backend.node.triton import _argv, descendants, still_running

    children: list[tuple[int, str]] = []
    named: dict[int, str] = {}
    try:
        children = descendants(proc.pid)
        assert len(children) >= at_least, children
        for p, _ in children:
            named[p] = " ".join(a.decode(errors="replace") for a in _argv(p)[:3])
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + within_s
        while still_running(children) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = sorted(p for p, _ in still_running(children))
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return [f"{p} ({named.get(p, '?')})" for p in left]


def _serving(args: list[str], timeout_s: float):
    """`poolpipe ARGS` in its own process, once it says it serves ("Ctrl-C stops"); killed
    (and the test failed with its last lines) if it does not within `timeout_s`."""
    import os
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "poolpipe_cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any("Ctrl-C stops" in line for line in seen):
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
    if not any("Ctrl-C stops" in line for line in seen):
        proc.kill()
        proc.wait()
        raise AssertionError("".join(seen[-20:]) or f"poolpipe {args} said nothing")
    return proc


def test_a_router_whose_triton_dies_stops_saying_so(onboarded_tiny, tmp_path):  # noqa: F811
    """The router's own Triton (its KServe v2 front end) killed: `poolpipe serve` used to
    run on, unreachable, with its nodes held; it now stops with an error naming the
    Triton's log (so that a supervisor restarts it and the routers of its tier adopt its
    nodes meanwhile), and takes its nodes down with it."""
    import os
    import signal

    from triton_backend.env import free_ports
    from triton_backend.node.triton import port_holder

    wh, _ = onboarded_tiny
    plan_file = tmp_path / "plan.json"
    hand_plan([(0, 4, 1)]).save(plan_file)
    (http,) = free_ports(1)
    argv = ["--warehouse", wh, "serve", str(plan_file), "--http-port", str(http)]
    proc = _serving([*argv, "--workspace", str(tmp_path / "ws"), "--stop-grace", "0"], 180)
    try:
        holder = port_holder("127.0.0.1", http)
        assert holder is not None and holder.startswith("tritonserver"), holder
        os.kill(int(holder.split("pid ")[1].rstrip(")")), signal.SIGKILL)
        rc = proc.wait(60)
        out = " ".join(proc.stdout.read().split())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 2, out
    assert "the router's Triton (its KServe v2 front end) exited; see" in out, out
    assert "Traceback" not in out


def test_an_operator_sees_status_drains_a_node_and_reads_the_statistics(
    server,
    onboarded_tiny,  # noqa: F811
    capsys,
):
    """`poolpipe status`, `drain`, `undrain` and `stats` against a running router: its plan,
    nodes with their states, figures and ports; a drained node takes no new batch while
    the other pipelines' requests are answered; node states and rollouts as metrics; the
    statistics as a table and as JSON. (There were no such commands nor metrics.)"""
    import json
    import os

    from poolpipe.client.control import TOKEN_FILE_VAR
    from poolpipe_cli import main as cli_main

    wh, _ = onboarded_tiny
    dep = server.deployment
    router = ["--router", dep.grpc_url, "--token-file", os.environ[TOKEN_FILE_VAR]]
    _send(server, 3)
    server.flush_stats()
    _load_sampled(server)
    capsys.readouterr()
    assert cli_main(["status", *router, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["plan_id"] == server.plan_id and s["generation"] == dep.generation
    assert {n["state"] for n in s["nodes"]} == {"in service"}
    assert len(s["nodes"]) == len(dep.nodes)
    assert s["models"]["tiny"]["arrivals"] >= 3 and s["windows"][-1]["models"]["tiny"]["arrivals"]
    assert s["ports"]["grpc"] == dep.grpc_url and s["ports"]["triton_metrics"]
    assert cli_main(["status", *router]) == 0
    table = capsys.readouterr().out
    assert "in service" in table and "reply margin" in table and dep.grpc_url in table
    # each node's clock against the router's, where its watch port tells it (clocks.py)
    assert all({"clock_offset_us", "clock_error_us"} <= set(n) for n in s["nodes"])
    assert "clock - router's" in table
    assert s["load"]["models"]["tiny"]["req_s"]["300s"] > 0 and s["load"]["envelope"] is False
    assert "load against the plan's envelope" in table and "envelope events: above" in table
    assert "no envelope: the plan states no deliverable req/s" in table

    names = sorted({n.name for n in dep.nodes.values()})
    try:
        for name in names:  # every node of the plan: no path is left
            assert cli_main(["drain", name, *router, "--timeout", "30"]) == 0
            assert f"node {name} drained" in capsys.readouterr().out
        s = server.status()
        assert {n["node"]: n["state"] for n in s["nodes"]} == dict.fromkeys(names, "drained")
        mod, client = _grpc(dep)
        with pytest.raises(Exception, match=r"no live path for model tiny.*drained"):
            _infer(mod, client, np.zeros((1, 3, 32, 32), np.float32))
        text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
        state = rf'poolpipe_node_state\{{address="[^"]+",node="{names[0]}",state="drained"\}} 1\.0'
        assert re.search(state, text)
        assert re.search(r'poolpipe_node_changes_total\{state="drained"\} [1-9]', text)
    finally:
        for name in names:
            assert cli_main(["undrain", name, *router]) == 0
    _send(server, 2)  # served again
    assert cli_main(["drain", "nope", *router]) == 2
    assert "no node 'nope' serves the plan here" in capsys.readouterr().err

    assert cli_main(["--warehouse", wh, "stats", "--json", "--last", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {"minute", "model", "arrivals", "on_time"} <= set(rows[-1])
    assert cli_main(["--warehouse", wh, "stats"]) == 0
    assert "serving statistics" in capsys.readouterr().out


def test_a_plan_that_cannot_be_served_is_refused_and_forced_its_requests_are_refused_503(
    prefect_api,
    server,
    onboarded_tiny,  # noqa: F811
    capsys,
):
    """A plan whose SLO, less the router's measured reply margin, is shorter than its
    fastest pipeline used to be rolled out ("ok": true) and then have every request refused
    as the client's fault (HTTP 400), counted nowhere. Now the rollout is refused with both
    numbers before anything is loaded; with force it goes out (logged), and its requests
    are refused as the server's condition (UNAVAILABLE / 503) and counted as refused, in
    the runtime, the metrics and the warehouse's window."""
    from flows.rollout import rollout_plan
    from poolpipe.domain.cluster import load_cluster
    from poolpipe.domain.plan import manual_plan
    from poolpipe.errors import PoolpipeError
    from poolpipe.runtime import DEFAULT_MARGIN_FLOOR_US
    from triton_backend.router.core import REFUSED_MARKER

    wh, _ = onboarded_tiny
    dep = server.deployment
    cluster = load_cluster(REPO / "local-clusters.toml", "local-1t")
    # An SLO of the reply margin's floor (1 ms: the margin measured is never below it), at
    # batch 1: the plan verifies against the profile (tiny takes well under 1 ms here; at
    # batch 4 and 0.5 ms it took 0.73 ms on a busy host), and leaves no time once the
    # margin is held back.
    floor_ms = DEFAULT_MARGIN_FLOOR_US / 1e3
    tight = manual_plan("tiny", DEFAULT_MARGIN_FLOOR_US, cluster, [(0, 4, "cpu-1t", 1)], 1)
    with Warehouse.open(wh) as w:
        plan_id = w.store_plan(tight, label="too tight")
    gen, loaded = dep.generation, sorted(p.partition for p in dep.layout.placements)
    with pytest.raises(PoolpipeError, match="refused") as e:
        rollout_plan(str(plan_id), dep.grpc_url, warehouse=wh)
    said = str(e.value)
    assert f"SLO {floor_ms:g} ms less the router's measured reply margin" in said
    assert "no time to serve a request in" in said and "--force" in said
    assert dep.generation == gen and sorted(p.partition for p in dep.layout.placements) == loaded
    assert server.rollouts["refused"] >= 1

    before = dep.core.stats["tiny"].counts()
    result = rollout_plan(str(plan_id), dep.grpc_url, warehouse=wh, force=True)
    assert result["status"] == "done" and dep.generation == gen + 1
    server.flush_stats()
    mod, client = _grpc(dep)
    x = np.zeros((1, 3, 32, 32), np.float32)
    for _ in range(3):
        with pytest.raises(Exception) as refused:
            _infer(mod, client, x)
        assert REFUSED_MARKER in str(refused.value) and "UNAVAILABLE" in str(refused.value)
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": [0.0] * 3072}]}  # fmt: skip
    r = httpx.post(f"http://{dep.http_url}/v2/models/tiny/infer", json=body, timeout=30)
    assert r.status_code == 503 and REFUSED_MARKER in r.text, (r.status_code, r.text)
    after = dep.core.stats["tiny"].counts()
    assert after["refused"] - before["refused"] == 4
    assert after["arrivals"] - before["arrivals"] == 4
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    m = re.search(r'poolpipe_requests_total\{model="tiny",outcome="refused"\} (\S+)', text)
    assert m and float(m.group(1)) >= 4
    assert re.search(r'poolpipe_rollouts_total\{result="refused"\} [1-9]', text)
    server.flush_stats()
    with Warehouse.open(wh) as w:
        arrivals, refused_rows = w.con.execute(
            "SELECT arrivals, refused FROM serving_stats ORDER BY minute DESC LIMIT 1"
        ).fetchone()
    assert refused_rows == 4 and arrivals == 4
    # what a person reads shows them (`stats` and `status` used to show 0 of everything)
    from poolpipe_cli import main as cli_main

    capsys.readouterr()
    assert cli_main(["--warehouse", wh, "stats", "--json", "--last", "1"]) == 0
    assert json.loads(capsys.readouterr().out)[-1]["refused"] == 4
    assert cli_main(["--warehouse", wh, "stats", "--last", "1"]) == 0
    assert "refused" in capsys.readouterr().out
    s = server.status()
    assert (
        s["models"]["tiny"]["refused"] >= 4 and s["windows"][-1]["models"]["tiny"]["refused"] == 4
    )
    # and a load balancer is told: not ready while every request of a model is refused
    state, why, _ = server.readiness()
    assert state == "not ready" and "the plan cannot serve tiny" in why, why

    # a plan that fits again (the rest of the module serves on it)
    back = rollout_plan(str(server_plan_id(wh)), dep.grpc_url, warehouse=wh)
    assert back["status"] == "done"
    _send(server, 1)
    assert server.readiness()[0] == "ready"


def server_plan_id(wh: str) -> int:
    with Warehouse.open(wh) as w:
        return w.stored_plan_id(two_partition_plan(), label="test")


ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())]
            )
            for r in requests
        ]
"""


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_node_stopped_or_killed_leaves_no_uploaded_model_behind(tmp_path, how):
    """Triton puts a model uploaded through the repository API in a folder of /tmp that it
    removes on unload but leaves behind when it stops (or dies) with the model loaded: a
    node's stop, or the kill a crash test makes, removes it (a host's /tmp filled up
    with them, one per node and model, over days of runs)."""
    import json

    from triton_backend.node.triton import TritonNode, descendants, model_folders

    node = TritonNode("n", "cpu-1t", tmp_path / "repo", tmp_path).start()
    try:
        config = {
            "name": "echo",
            "backend": "python",
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        }
        node.load("echo", json.dumps(config), {"1/model.py": ECHO_MODEL.encode()})
        assert node.process is not None
        folders = model_folders(descendants(node.process.pid))
        assert len(folders) == 1 and (folders[0] / "1" / "model.py").exists(), folders
    finally:
        node.stop() if how == "stop" else node.kill()
    assert not folders[0].exists()


def test_shared_memory_a_stopped_triton_left_is_swept_and_regions_in_use_kept(tmp_path):
    """A Python-backend region that no process maps and no stub names (its Triton stopped by
    a signal while it started the stub: `bench-reliability` found one) is removed by the
    sweep a starting node runs; one mapped by a live process, one a running process names
    and a young one are kept."""
    import mmap
    import os
    import subprocess
    import sys
    import time

    from triton_backend.node.triton import STALE_AFTER_S, sweep_regions

    def region(tag: str, old: bool = True):
        f = tmp_path / f"triton_python_backend_shm_region_{tag}"
        f.write_bytes(b"\0" * 4096)
        if old:
            t = time.time() - 2 * STALE_AFTER_S
            os.utime(f, (t, t))
        return f

    left, mapped, named = region("left"), region("mapped"), region("named")
    other = tmp_path / "not_a_region"
    other.write_bytes(b"x")
    os.utime(other, (0, 0))
    young = region("young", old=False)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", named.name])
    with open(mapped, "r+b") as fh, mmap.mmap(fh.fileno(), 4096) as held:
        try:
            time.sleep(0.2)  # (the holder's command line in /proc)
            assert sweep_regions(tmp_path) == [left]
            assert held[0] == 0
        finally:
            holder.kill()
            holder.wait()
    assert not left.exists()
    assert mapped.exists() and named.exists() and young.exists() and other.exists()
    # once nothing maps or names them, they are left over too
    assert sorted(sweep_regions(tmp_path)) == sorted([mapped, named])


def test_what_a_router_or_triton_killed_outright_left_is_swept_and_live_ones_kept(tmp_path):
    """`kill -9` of a router or a node leaves its door folder (or its door's ring) and its
    Triton's upload folders (Triton removes those only when it unloads). The next router or
    node removes the stale ones: a door whose socket takes no connection, a ring still named
    after STALE_AFTER_S, an upload folder no stub runs
    and no running tritonserver made; not a live door, a model a stub runs, a folder
    younger than STALE_AFTER_S or one a running Triton may have made."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from triton_backend.node.triton import STALE_AFTER_S, TritonNode, stop_nodes, sweep_uploads
    from triton_backend.router.door.server import sweep_doors

    node = TritonNode("n", "cpu-1t", tmp_path / "repo", tmp_path).start()
    stub = None
    try:
        started = time.time()
        time.sleep(0.05)

        def upload(name: str, mtime: float | None, model: bool = True):
            d = tmp_path / name
            (d / "1").mkdir(parents=True)
            (d / "config.pbtxt").write_text(f'name: "{name}"\n')
            if model:
                (d / "1" / "model.py").write_text("import time\ntime.sleep(120)\n")
            if mtime is not None:
                os.utime(d, (mtime, mtime))
            return d

        old = started - 10 * STALE_AFTER_S  # before the running Triton started
        dead = upload("folderDead01", old)
        running = upload("folderRun001", old)
        stub = subprocess.Popen([sys.executable, str(running / "1" / "model.py")])
        onnx_only = upload("folderOnnx01", old, model=False)  # no stub tells if it is used
        since = upload("folderSince1", None)  # made after the Triton started: maybe its
        envs = [tmp_path / f"python_env_{k}Env12" for k in "ab"]  # the Python backend's
        for e in envs:
            e.mkdir()
        (envs[1] / "x").mkdir()  # not empty: an environment in use
        for e in envs:
            os.utime(e, (old, old))
        time.sleep(0.2)  # (the stub's command line in /proc)
        later = time.time() + 2 * STALE_AFTER_S  # as if that much time had passed
        assert sorted(sweep_uploads(tmp_path, now=later)) == sorted([dead, envs[0]])
        assert envs[1].exists()
        assert running.exists() and onnx_only.exists() and since.exists()
        young = upload("folderYoung1", None)
        assert sweep_uploads(tmp_path) == [] and young.exists()
    finally:
        if stub is not None:
            stub.kill()
            stub.wait()
        stop_nodes([node])

    root = Path(tempfile.mkdtemp(prefix="pp"))  # a socket's path fits in 108 bytes
    try:
        gone, live, young = (root / f"poolpipe-door-{k}" for k in ("gone", "live", "young"))
        for d in (gone, live, young):
            d.mkdir()
        with socket.socket(socket.AF_UNIX) as s:  # bound, then closed: nobody listens
            s.bind(str(gone / "door.sock"))
        listening = socket.socket(socket.AF_UNIX)
        listening.bind(str(live / "door.sock"))
        listening.listen()
        # a stub's ring its router never mapped (a mapped one has no name), and a new one
        stale_ring, new_ring = (root / f"poolpipe-door-ring-{k}" for k in ("stale", "new"))
        stale_ring.write_bytes(b"0" * 64)
        new_ring.write_bytes(b"0" * 64)
        for d in (gone, live, stale_ring):
            os.utime(d, (time.time() - 2 * STALE_AFTER_S,) * 2)
        try:
            assert sweep_doors(root, rings=root) == [stale_ring, gone]
        finally:
            listening.close()
        assert live.exists() and young.exists() and new_ring.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
