"""The offline flows run for real: Prefect (a real temporary API via prefect_test_harness),
ONNX Runtime on small generated models, a DuckDB file, a MILP solved by HiGHS."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from flows.common import io_error_only
from flows.onboard import onboard_model
from flows.plan import plan_models
from flows.profile import profile_model
from poolpipe.errors import ModelError, PlanVerificationError
from poolpipe.offline.profiler import WHOLE
from poolpipe.offline.zoo import make_model
from poolpipe.store.plan_inputs import check_plan
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(blocks=4, batches=[1, 2, 3], warmup=1, reps=3)


@pytest.fixture(scope="module")
def small_resnet(tmp_path_factory) -> Path:
    return make_model("resnet50", tmp_path_factory.mktemp("m") / "r.onnx", width=0.125, image=32)


@pytest.fixture(scope="module")
def onboarded(prefect_api, small_resnet, tmp_path_factory):
    wh = str(tmp_path_factory.mktemp("wh") / "wh.duckdb")
    result = onboard_model(str(small_resnet), "tiny-resnet", warehouse=wh, **SMALL)
    return wh, result


def snapshot(wh: str) -> dict[str, list]:
    """Every row of every table, to show that a failed flow changed nothing."""
    with Warehouse.open(wh) as w:
        tables = [
            r[0]
            for r in w.con.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema='main'"
            ).fetchall()
        ]
        return {
            t: sorted(map(str, w.con.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables
        }


def test_onboard_flow_stores_blocks_latencies_and_provenance(onboarded):
    wh, r = onboarded
    assert r.verify_errors[0] <= 1e-4 < r.verify_errors[1] + 1  # fp32 exact, fp16 measured
    assert r.verify_errors[1] > 0
    with Warehouse.open(wh) as w:
        con = w.con
        (nb, ref, slo, source) = con.execute(
            "SELECT num_blocks, reference_latency_us, slo_us, source FROM models "
            "WHERE name = 'tiny-resnet'"
        ).fetchone()
        assert nb == 4 and source.startswith("onboard:")
        whole_b1 = next(m for m in r.measurements if m.block == WHOLE and m.batch == 1)
        assert ref == pytest.approx(whole_b1.median_us)
        # 5 x the model as served: its run, a stage call and the reply margin (defaults)
        assert slo == pytest.approx(5 * (ref + 2_500 + 3_000))
        files = con.execute(
            "SELECT onnx_path, inputs, outputs FROM blocks WHERE model='tiny-resnet' "
            "ORDER BY block_index"
        ).fetchall()
        assert len(files) == 4 and all(Path(p).is_file() for p, _, _ in files)
        for (_, _, outs), (_, ins, _) in itertools.pairwise(files):
            assert outs == ins  # each block feeds the next
        bytes_ = [
            b
            for (b,) in con.execute(
                "SELECT bytes FROM block_boundaries WHERE model='tiny-resnet' ORDER BY block_index"
            ).fetchall()
        ]
        assert bytes_ == [b.out_bytes for b in r.split.blocks[:-1]] and min(bytes_) > 0
        rows = con.execute(
            "SELECT block_index, batch, latency_us, p99_us, gpu_type, share, provenance "
            "FROM block_latency WHERE model='tiny-resnet'"
        ).fetchall()
        assert len(rows) == 4 * 3
        assert all(p99 >= lat > 0 for _, _, lat, p99, _, _, _ in rows)
        assert {(g, s) for *_, g, s, _ in rows} == {("cpu-1t", 1)}
        prov = json.loads(rows[0][-1])
        for key in ("host", "device_detail", "engine", "engine_version", "date", "reps"):
            assert prov[key], key
        assert prov["engine"] == "onnxruntime" and prov["reps"] == 3
        assert con.execute(
            "SELECT count(*) FROM model_latency WHERE model='tiny-resnet'"
        ).fetchone() == (3,)
        profile = w.load_profile("tiny-resnet")
    table = profile.tables[("cpu-1t", 1)]
    assert table.latency_us.shape == (4, 3)
    assert profile.boundary_bytes == tuple(bytes_)
    # what a vGPU holds of it, from the ONNX model (domain/memory.py)
    assert (profile.weight_bytes or 0) > 0 and (profile.activation_bytes or 0) > 0


def test_onboard_artifact_holds_the_block_table(onboarded):
    import httpx
    from prefect.settings import PREFECT_API_URL

    # Prefect's REST API (the filter endpoint of 3.8.8 mis-validates with FastAPI 0.154)
    art = httpx.get(f"{PREFECT_API_URL.value()}/artifacts/onboard-tiny-resnet/latest").json()
    assert art["type"] == "markdown"
    text = art["data"]
    assert "sum of blocks" in text and "whole model" in text
    assert text.count("\n| ") >= 4 + 2  # a row per block, the sums


def test_plan_flow_plans_the_onboarded_model_right_away(onboarded, tmp_path):
    wh, _ = onboarded
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(
        "[local]\nbandwidth_gbps = 10\n"
        'gpus = [ { type = "cpu-1t", count = 4, gpus_per_server = 1, shares = [1] } ]\n'
    )
    out = tmp_path / "plan.json"
    plan_id = plan_models(
        ["tiny-resnet"], "local", warehouse=wh, clusters_file=str(clusters), out=str(out)
    )
    with Warehouse.open(wh) as w:
        plan = w.load_plan(plan_id)
        parts = w.con.execute(
            "SELECT count(*) FROM plan_partitions WHERE plan_id = ?", [plan_id]
        ).fetchone()
    assert plan.models[0].name == "tiny-resnet" and plan.models[0].throughput > 0
    assert parts[0] >= 1 and json.loads(out.read_text())["strategy"] == "ppipe"


def test_slo_scale_counts_the_serving_path_of_an_onboarded_model(
    onboarded, ppipe_profiles, tmp_path, capsys
):
    """`--slo-scale` multiplies an onboarded model's reference as served: its run plus a
    stage call and the reply margin (defaults, or what a router serving it measured, where
    more). A 1-ms model planned at 5x its run alone got an SLO its serving path could not
    keep (plan served nothing). The paper's profiles keep the paper's reference."""
    import shutil
    from datetime import datetime

    from poolpipe.domain.profiles import served_reference

    wh = str(tmp_path / "wh.duckdb")
    shutil.copy(onboarded[0], wh)
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(
        "[local]\nbandwidth_gbps = 10\n"
        'gpus = [ { type = "cpu-1t", count = 4, gpus_per_server = 1, shares = [1] } ]\n'
    )
    argv = ["--warehouse", wh, "plan", "--models", "tiny-resnet", "--cluster", "local"]
    argv += ["--clusters-file", str(clusters), "--slo-scale", "5", "--json"]
    with Warehouse.open(wh) as w:
        ref = w.load_profile("tiny-resnet").reference_latency_us

    def planned_slo() -> tuple[float, str]:
        assert cli_main(argv) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["models"][0]["slo_us"], " ".join(out.err.split())

    slo, err = planned_slo()
    assert slo == pytest.approx(5 * (ref + 2_500 + 3_000))
    assert "tiny-resnet: SLO 5 x" in err and "a stage call 2.5 ms + the reply margin 3 ms" in err
    row = dict.fromkeys(("arrivals", "on_time", "late", "dropped", "failed", "refused"), 0)
    row |= {"minute": datetime.now(), "seconds": 60.0, "deployment": "d", "plan_id": None}
    # another model's measurements say nothing of this one's
    with Warehouse.open(wh) as w:
        w.store_rows(
            "serving_stats",
            [{**row, "model": "other", "reply_measured_ms": 90.0, "call_overhead_ms": 90.0}],
        )
    assert planned_slo()[0] == pytest.approx(5 * (ref + 2_500 + 3_000))
    # a router serving it measured a 4-ms stage call and 6 ms of the reply's way out (beyond
    # its 1-ms floor): those count
    with Warehouse.open(wh) as w:
        w.store_rows(
            "serving_stats",
            [{**row, "model": "tiny-resnet", "reply_measured_ms": 6.0, "call_overhead_ms": 4.0}],
        )
    slo, err = planned_slo()
    assert slo == pytest.approx(5 * (ref + 4_000 + 7_000)), err
    # explicit SLOs stay as given; the paper's profiles keep the paper's reference
    argv[-3:-1] = ["--slo-us", "tiny-resnet=9000"]
    assert planned_slo()[0] == 9000.0
    paper = ppipe_profiles["googlenet-v3-pytorch"]
    assert served_reference(paper, 4_000, 7_000).us == paper.reference_latency_us


def test_plan_apps_flow_stores_the_joint_split_of_an_application(prefect_api, tmp_path):
    """The plan-apps flow on the shipped group-2 profiles and hc2-small: the joint split's
    plan stored (its applications, budgets and graph with it) and written out."""
    from flows.plan import plan_applications
    from poolpipe.domain.apps import plan_applications as recorded_apps
    from poolpipe.domain.profiles import load_ppipe_dir

    group2 = REPO / "data" / "ppipe-gpu-group2"
    wh = str(tmp_path / "wh.duckdb")
    with Warehouse.open(wh) as w:
        w.store_profiles(load_ppipe_dir(group2))
    spec = tmp_path / "apps.toml"
    spec.write_text(
        '[[apps]]\nname = "cars"\nslo_ms = 80\n[[apps.edges]]\nfrom = "colorization-v2"\n'
        'to = "repvgg-b3"\nfanout = 2\ntransform = "shadow"\n'
    )
    out = tmp_path / "apps-plan.json"
    plan_id = plan_applications(
        str(spec),
        "hc2-small",
        warehouse=wh,
        clusters_file=str(group2 / "clusters.toml"),
        out=str(out),
    )
    with Warehouse.open(wh) as w:
        plan = w.load_plan(plan_id)
    apps, rec = recorded_apps(plan.meta)
    assert [a.name for a in apps] == ["cars"] and apps[0].edges[0].fanout.fixed == 2
    assert sum(rec["cars"]["budgets_us"].values()) == pytest.approx(80_000)
    assert {m.name for m in plan.models} == {"cars.colorization-v2", "cars.repvgg-b3"}
    assert json.loads(out.read_text())["meta"]["apps"]["cars"]["slo_us"] == 80_000
    # the split kept is the one that delivers most, stated
    assert plan.meta["split"] in ("joint", "equal", "proportional", "nexus")
    assert 0 < plan.meta["apps_deliverable"] <= plan.meta["apps_objective"] * (1 + 1e-9)


def test_profile_flow_adds_a_device_and_keeps_the_others(onboarded):
    wh, _ = onboarded
    before = snapshot(wh)["block_latency"]
    info, ms = profile_model("tiny-resnet", warehouse=wh, batches=[1, 2], threads=2, reps=2)
    assert info.device == "cpu-2t" and len(ms) == (4 + 1) * 2
    with Warehouse.open(wh) as w:
        rows = w.con.execute(
            "SELECT gpu_type, count(*) FROM block_latency WHERE model='tiny-resnet' GROUP BY 1 "
            "ORDER BY 1"
        ).fetchall()
        assert set(w.load_profile("tiny-resnet").tables) == {("cpu-1t", 1), ("cpu-2t", 1)}
    assert rows == [("cpu-1t", 12), ("cpu-2t", 8)]
    assert [r for r in snapshot(wh)["block_latency"] if "cpu-1t" in r] == before


def test_onboarding_again_replaces_the_model_only_when_asked(prefect_api, small_resnet, tmp_path):
    wh = str(tmp_path / "wh.duckdb")
    onboard_model(str(small_resnet), "again", warehouse=wh, **SMALL)
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(
        "[local]\nbandwidth_gbps = 10\n"
        'gpus = [ { type = "cpu-1t", count = 2, gpus_per_server = 1, shares = [1] } ]\n'
    )
    plan_id = plan_models(["again"], "local", warehouse=wh, clusters_file=str(clusters))
    with Warehouse.open(wh) as w:
        check_plan(w, w.load_plan(plan_id), "plan", plan_id)  # served as it is
    before = snapshot(wh)
    with pytest.raises(ModelError, match=rf"again: the warehouse holds .* plans {plan_id} serve"):
        onboard_model(str(small_resnet), "again", warehouse=wh, **{**SMALL, "blocks": 3})
    assert snapshot(wh) == before
    r = onboard_model(
        str(small_resnet), "again", warehouse=wh, replace=True, **{**SMALL, "blocks": 3}
    )
    assert r.outdated_plans == [plan_id]
    with (
        Warehouse.open(wh) as w,
        pytest.raises(
            PlanVerificationError,
            match=rf"plan {plan_id} was made for an earlier onboarding of 'again'",
        ),
    ):
        check_plan(w, w.load_plan(plan_id), f"plan {plan_id}", plan_id)
    with Warehouse.open(wh) as w:
        assert w.con.execute("SELECT count(*) FROM blocks WHERE model='again'").fetchone() == (3,)
        assert w.con.execute(
            "SELECT count(*) FROM block_latency WHERE model='again'"
        ).fetchone() == (9,)
    root = tmp_path / "blocks"
    assert sorted(p.name for p in (root / "again").glob("block_*.onnx")) == [
        "block_00.onnx",
        "block_01.onnx",
        "block_02.onnx",
    ]
    assert r.split.folder == root / "again"
    assert not [p for p in root.iterdir() if p.name.startswith(".old")]
    assert not list((root / ".staging").iterdir())


# ---------------------------------------------------------------------------- bad input


def _tiny_graph(path: Path, nodes, batch="batch", domains=()) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])
    g = helper.make_graph(nodes, "g", [x], [y])
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domains)]
    onnx.save(helper.make_model(g, opset_imports=opsets, ir_version=8), str(path))
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str, dict]]:
    (tmp / "notonnx.onnx").write_text("this is not a protobuf")
    relu = lambda i, o: helper.make_node("Relu", [i], [o])  # noqa: E731
    return {
        "not-onnx": (tmp / "notonnx.onnx", "load", {}),
        "no-cut": (_tiny_graph(tmp / "one.onnx", [relu("x", "y")]), "split", {}),
        "unknown-op": (
            _tiny_graph(
                tmp / "mystery.onnx",
                [
                    relu("x", "a"),
                    helper.make_node("Mystery", ["a"], ["b"], domain="com.example"),
                    relu("b", "y"),
                ],
                domains=("com.example",),
            ),
            "ONNX Runtime cannot run",
            {"blocks": 2},
        ),
        "fixed-batch": (  # a Reshape to [1, 8]: batch 1 only, found at load
            _tiny_graph(
                tmp / "fixed.onnx",
                [
                    relu("x", "a"),
                    helper.make_node(
                        "Constant",
                        [],
                        ["shape"],
                        value=helper.make_tensor("s", TensorProto.INT64, [2], [1, 8]),
                    ),
                    helper.make_node("Reshape", ["a", "shape"], ["b"]),
                    relu("b", "y"),
                ],
                1,
            ),
            "load: input 'x' has a fixed batch dimension of 1",
            {"blocks": 2, "batches": [1, 2]},
        ),
    }


@pytest.mark.parametrize("case", ["not-onnx", "no-cut", "unknown-op", "fixed-batch"])
def test_bad_input_names_model_and_step_and_changes_nothing(onboarded, tmp_path, case):
    wh, _ = onboarded
    path, step, extra = _bad_inputs(tmp_path)[case]
    before = snapshot(wh)
    root = Path(wh).parent / "blocks"
    folders = sorted(p.name for p in root.iterdir())
    params = {**SMALL, **extra}
    with pytest.raises(ModelError) as err:
        onboard_model(str(path), case, warehouse=wh, **params)
    assert f"{case}: " in str(err.value) and step in str(err.value), str(err.value)
    assert snapshot(wh) == before
    assert sorted(p.name for p in root.iterdir()) == folders
    assert not list((root / ".staging").iterdir())


def test_a_failure_while_storing_rolls_back_files_and_rows(onboarded, tmp_path):
    """The store step loses its staging folder while publishing (after the old folder was
    moved aside and the rows were written): rows and folders go back as they were."""
    from flows.onboard import store_task

    wh, r = onboarded
    before = snapshot(wh)
    final = r.split.folder
    files = sorted(p.name for p in final.iterdir())
    gone = dataclasses.replace(r.split, folder=final.parent / ".staging" / "gone")
    with pytest.raises(FileNotFoundError):
        store_task.fn(wh, gone, r.info, r.measurements, r.verify_errors, None, {})
    assert snapshot(wh) == before
    assert sorted(p.name for p in final.iterdir()) == files
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".old")]


def test_retries_only_on_io_errors(prefect_api):
    from prefect import flow, task

    calls = {"io": 0, "bad": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=io_error_only)
    def flaky_io():
        calls["io"] += 1
        if calls["io"] == 1:
            raise OSError("disk hiccup")
        return "ok"

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=io_error_only)
    def bad_input():
        calls["bad"] += 1
        raise ModelError("m: split: no valid cut")

    @flow
    def f():
        return flaky_io()

    @flow
    def g():
        return bad_input()

    assert f() == "ok" and calls["io"] == 2
    with pytest.raises(ModelError):
        g()
    assert calls["bad"] == 1


def test_cli_onboard_prints_the_block_table(prefect_api, small_resnet, tmp_path, capsys):
    wh = str(tmp_path / "wh.duckdb")
    rc = cli_main(
        [
            "--warehouse",
            wh,
            "onboard",
            str(small_resnet),
            "--name",
            "cli-resnet",
            "--blocks",
            "3",
            "--batches",
            "1-3",
            "--reps",
            "2",
            "--warmup",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "whole model" in out and "sum of" in out and "cli-resnet" in out
    # without a terminal, a line per step as it starts and ends (it printed nothing until
    # the end, and the bar read "0/None" before the first step)
    assert "cli-resnet: starting Prefect" in out and "None" not in out
    assert re.search(r"cli-resnet: verify 1/1 \([0-9.]+ s\)", out), out
    # a line as each batch size's profiling starts (a long profile printed nothing between
    # its first and its last)
    assert re.search(r"cli-resnet: profile: batch 2 \d+/\d+", out), out
    rc = cli_main(["--warehouse", wh, "onboard", str(tmp_path / "missing.onnx")])
    out = capsys.readouterr().err
    assert rc == 2 and "missing: load:" in out and "does not exist" in out


def test_prefect_yaml_deployments_resolve_to_flows():
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert {"onboard", "plan", "profile-cpu"} <= set(deps)
    clusters = REPO.parent / "shared" / "profiles" / "ppipe-gpu" / "clusters.toml"
    gpu_types = {"L4", "T4", "P4", "V100"}
    if clusters.is_file():
        import tomllib

        gpu_types = {
            g["type"] for c in tomllib.loads(clusters.read_text()).values() for g in c["gpus"]
        }
    for gpu in gpu_types:  # one profiling deployment per GPU type, on its own work pool
        d = deps[f"profile-{gpu}"]
        assert d["work_pool"]["name"] == gpu and d["entrypoint"].startswith("flows/profile.py")
    for d in deps.values():
        fl = load_flow_from_entrypoint(str(REPO / d["entrypoint"]))
        params = set(fl.parameters.properties)
        assert set(d.get("parameters", {})) <= params, (d["name"], params)
    assert all(d["work_pool"]["name"] for d in deps.values())


def test_worker_settings_name_what_is_missing(tmp_path, monkeypatch):
    from flows import settings

    for var in (settings.HOME_VAR, settings.ROUTER_VAR):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(settings.SettingError, match="POOLPIPE_HOME is not set on this worker"):
        settings.code_location()
    with pytest.raises(settings.SettingError, match="is not poolpipe's code"):
        settings.code_location(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(settings.HOME_VAR, str(REPO))
    assert settings.code_location() == {"directory": str(REPO)} and Path.cwd() == REPO
    with pytest.raises(settings.SettingError, match="POOLPIPE_ROUTER"):
        settings.router(None)
    with pytest.raises(settings.SettingError, match="is not host:port"):
        settings.router("10.0.0.5")
    monkeypatch.setenv(settings.ROUTER_VAR, "10.0.0.5:8001")
    assert settings.router(None) == "10.0.0.5:8001" and settings.router("h:1") == "h:1"
    # outside a deployment (the CLI, these tests) the local default warehouse applies
    monkeypatch.delenv(settings.WAREHOUSE_VAR, raising=False)
    assert settings.warehouse(None) is None
    monkeypatch.setenv(settings.WAREHOUSE_VAR, str(tmp_path / "w.duckdb"))
    assert settings.warehouse(None) == str(tmp_path / "w.duckdb")
    assert settings.warehouse("x.duckdb") == "x.duckdb"


def test_replanning_leaves_out_the_nodes_that_are_down(tmp_path):
    """The re-planning flow plans for the GPUs in service: a named cluster less as many GPUs
    of each type as the router reports down, or the inventory with those nodes marked."""
    from flows.replan import surviving_cluster
    from poolpipe.errors import ClusterError, PoolpipeError

    repo = Path(__file__).resolve().parents[1]
    clusters = str(repo / "local-clusters.toml")
    down = [{"node": "n1", "device": "cpu-1t"}, {"node": "n3", "device": "cpu-1t"}]
    whole = surviving_cluster(None, "local-1t", clusters, None, [])
    left = surviving_cluster(None, "local-1t", clusters, None, down)
    assert whole.pool("cpu-1t").count == 4 and left.pool("cpu-1t").count == 2
    with pytest.raises(ClusterError):  # more down than the cluster has
        surviving_cluster(None, "local-1t", clusters, None, down * 3)
    inv = tmp_path / "inv.toml"
    inv.write_text(
        '[[servers]]\nname = "s0"\nbandwidth_gbps = 1\n'
        + "".join(
            f'[[nodes]]\nname = "n{i}"\nserver = "s0"\ndevice = "cpu-1t"\n'
            f'grpc = "10.0.0.2:{8001 + i}"\n'
            for i in range(4)
        )
    )
    assert surviving_cluster(None, None, None, str(inv), down).pool("cpu-1t").count == 2
    with pytest.raises(PoolpipeError, match="give the cluster"):
        surviving_cluster(None, None, None, None, down)


def test_cli_onboards_a_model_of_dynamic_size_with_input_shape(prefect_api, tmp_path, capsys):
    """An exporter-style classifier (dynamic H and W, its batch read into a Reshape target
    with Shape/Gather/Concat) onboarded as a user would with --input-shape: the flow stores
    the shape, the cuts stay off the shape tensor, and one batch size gives one column."""
    from tests.factories import dynamic_classifier

    wh = str(tmp_path / "wh.duckdb")
    path = dynamic_classifier(tmp_path / "cls.onnx")
    argv = ["--warehouse", wh, "onboard", str(path), "--input-shape", "x=3x16x16"]
    rc = cli_main([*argv, "--blocks", "3", "--batches", "1", "--reps", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("ms b=1") == 1 and "nan" not in out
    with Warehouse.open(wh) as w:
        layers = w.block_layers("cls")
        (provenance,) = w.con.execute(
            "SELECT provenance FROM block_latency WHERE model = 'cls' LIMIT 1"
        ).fetchone()
    # after the Reshape (positions 12-14, chosen by the measured times), never among the convs
    assert set([a for a, _ in layers][1:]) <= {12, 13, 14}
    assert json.loads(provenance)["input_shapes"] == {"x": [3, 16, 16]}


def test_onboard_says_when_it_starts_prefects_temporary_api(tmp_path, monkeypatch):
    """Prefect's temporary API costs seconds on every onboard/profile where no server is
    configured: the first line says so, and how to skip it; where one is configured (the
    environment or the active profile), it does not."""
    from poolpipe_cli.onboard import _starting_prefect

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    assert "set PREFECT_API_URL to a running `prefect server`" in _starting_prefect()
    (tmp_path / "profiles.toml").write_text(
        'active = "ops"\n[profiles.ops]\nPREFECT_API_URL = "http://10.0.0.9:4200/api"\n'
    )
    assert _starting_prefect() == "starting Prefect"
    monkeypatch.setenv("PREFECT_PROFILE", "other")
    assert "temporary API" in _starting_prefect()
    monkeypatch.setenv("PREFECT_API_URL", "http://10.0.0.9:4200/api")
    assert _starting_prefect() == "starting Prefect"
