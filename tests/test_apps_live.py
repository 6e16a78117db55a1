"""An application through the live router: real ONNX models onboarded by the flows, a plan
of the joint split (a real MILP) served by real tritonserver nodes, a real transform
(fan-out 2) and fan-in (a model waiting for two parents); each request answered once, as
a whole, or explicitly refused or failed."""

from __future__ import annotations

import numpy as np
import pytest

from poolpipe.domain.apps import parse_apps
from poolpipe.domain.cluster import Cluster, GpuPool
from poolpipe.offline.onnxgraph import session
from poolpipe.offline.zoo import make_model
from poolpipe.planner.apps import AppPlanRequest, app_plan_document, plan_apps
from poolpipe.store.warehouse import Warehouse
from tests.test_serving import _grpc, _infer  # noqa: F401

pytestmark = pytest.mark.integration

DIAMOND = {
    "name": "scene",
    "slo_ms": 3000,
    "edges": [
        {"from": "p", "to": "q", "fanout": 2, "transform": "tests.app_transforms:as_images"},
        {"from": "p", "to": "r", "fanout": 2, "transform": "tests.app_transforms:as_images"},
        {"from": "q", "to": "r", "fanout": 1, "transform": "tests.app_transforms:as_images"},
    ],
}
BAD = {
    "name": "buggy",
    "slo_ms": 3000,
    "edges": [{"from": "p", "to": "q", "transform": "tests.app_transforms:wrong_shape"}],
}


@pytest.fixture(scope="module")
def onboarded_three(prefect_api, tmp_path_factory):
    from flows.onboard import onboard_model

    tmp = tmp_path_factory.mktemp("apps")
    wh = str(tmp / "wh.duckdb")
    for k, name in enumerate("pqr"):
        path = make_model("resnet50", tmp / f"{name}.onnx", width=0.125, image=32, seed=k)
        onboard_model(str(path), name, warehouse=wh, blocks=2, batches=[1, 2], reps=2)
    return wh, tmp


def test_an_application_is_served_whole_through_the_router(onboarded_three):
    from triton_backend.deploy.deployment import Deployment

    wh, tmp = onboarded_three
    with Warehouse.open(wh) as w:
        profiles = {m: w.load_profile(m) for m in "pqr"}
        whole = {m: session(w.whole_model_file(m)) for m in "pqr"}
    apps = parse_apps({"apps": [DIAMOND, BAD]}, "test", profiles)
    cluster = Cluster("apps-local", 10.0, (GpuPool("cpu-1t", 5, 1, (1,)),))
    req = AppPlanRequest(tuple(apps), profiles, cluster, margin=0.3)
    doc, _ = app_plan_document(req, plan_apps(req))
    assert {m.name for m in doc.models} == {"scene.p", "scene.q", "scene.r", "buggy.p", "buggy.q"}
    dep = Deployment.up(doc, wh, tmp / "ws")
    try:
        mod, client = _grpc(dep)
        x = np.random.default_rng(5).standard_normal((1, 3, 32, 32)).astype(np.float32)
        i = mod.InferInput("input", [1, 3, 32, 32], "FP32")
        i.set_data_from_numpy(x)
        answer = client.infer("scene", [i])
        out_name = dep.core.apps.ios["scene"].outputs[0].name
        got = answer.as_numpy(out_name)
        # r's two parts, made by the transform from p's outputs (its first parent's edge)
        (p_out,) = whole["p"].run(None, {"input": x})
        from tests.app_transforms import as_images

        images = as_images({"o": p_out}, 2)
        want = np.concatenate([whole["r"].run(None, {"input": im[None]})[0] for im in images])
        assert got.shape == want.shape  # fan-out 2: two rows of r's outputs
        # the parts end in any order: match each row of the answer to one of r's
        scale = np.abs(want).max()
        for row in got:
            assert min(np.abs(row - w).max() for w in want) / scale < 2e-2
        stats = dep.core.stats
        assert stats["scene.p"].on_time == 1 and stats["scene.q"].on_time == 2
        assert stats["scene.r"].on_time == 2  # made once, after both parents
        assert stats["scene"].arrivals == stats["scene"].on_time == 1  # the application
        # the simulator on what the router serves (its calibrated topology and budgets),
        # a trace of two requests of scene, the answers as late as the router's were: both
        # on time, as live
        from testbed.predict import predict_apps

        scene_at = dep.core.apps.index["scene"]
        delays = dep.core.take_answer_delays()
        assert any(delays), delays  # (the parts' batches, at their pipelines' last pools)
        trace = (np.array([0.0, 1.0]), np.array([scene_at, scene_at]), 2.0)
        sim = predict_apps(dep, *trace, answer_delays=delays)
        assert sim.apps["scene"]["arrived"] == sim.apps["scene"]["on_time"] == 2
        assert sim.apps["buggy"]["arrived"] == 0
        second = [[1e6] for _ in delays]  # every answer a second late: none on time
        assert predict_apps(dep, *trace, answer_delays=second).apps["scene"]["on_time"] == 0
        # a transform that makes the wrong tensors fails the request, explicitly and whole
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException, match="transform made a tensor of shape"):
            client.infer("buggy", [i])
        # a request's own SLO: a bad one refused, a good one its deadline
        with pytest.raises(InferenceServerException, match="slo_ms must be a number"):
            client.infer("scene", [i], parameters={"slo_ms": "soon"})
        assert client.infer("scene", [i], parameters={"slo_ms": 2500}).as_numpy(out_name).shape
        # a plan of the same applications rolls out (its own budgets and pipelines) ...
        other = AppPlanRequest(tuple(apps), profiles, cluster, margin=0.2, grid=4)
        doc2, _ = app_plan_document(other, plan_apps(other))
        assert doc2.meta["apps"] != doc.meta["apps"]
        r = dep.rollout(doc2, wh)
        assert r.status == "done", r.reason
        scene = dep.core.apps.served[0]
        due = dict(zip(scene.models, scene.due_us, strict=True))
        budgets = doc2.meta["apps"]["scene"]["budgets_us"]
        assert due["p"] == pytest.approx(budgets["p"])
        assert due["r"] == pytest.approx(
            max(budgets["p"] + budgets["q"], budgets["p"]) + budgets["r"]
        )
        assert client.infer("scene", [i]).as_numpy(out_name).shape == want.shape
        # ... but not one whose applications differ (the same models, another SLO)
        longer = parse_apps({"apps": [{**DIAMOND, "slo_ms": 4000}, BAD]}, "test", profiles)
        req3 = AppPlanRequest(tuple(longer), profiles, cluster, margin=0.3)
        r = dep.rollout(app_plan_document(req3, plan_apps(req3))[0], wh)
        assert r.status == "refused" and "applications differ" in r.reason, r.reason
    finally:
        dep.down()
