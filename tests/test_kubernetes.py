"""poolpipe's Kubernetes manifests (deploy/kubernetes/: a base, the node template per GPU
type, the example cluster's overlay), rendered with `kubectl kustomize` and validated
against the Kubernetes API's schemas (kubernetes-validate); the Prometheus Operator's
objects against their own shape. No cluster runs here: what is checked is what renders
and what each container would be told to run (its arguments parsed by poolpipe's own
command-line parser, as tests/test_docs.py parses the guide's commands)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from poolpipe.domain.inventory import parse_inventory
from tests.test_grafana import load_module
from tests.test_prometheus import RULES

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
OVERLAY = "overlays/example"
KUBERNETES_VERSION = "1.32.0"  # the schemas validated against
GPU_TYPES = {"T4": "Tesla-T4", "V100": "Tesla-V100-SXM2-16GB"}  # the example's

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed (it renders the overlays: kubectl kustomize)",
)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    """The example overlay rendered, from a copy of deploy/ given a token (the overlay's
    secretGenerator reads it; the real one is never in git)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders the overlays: kubectl kustomize)")
    root = tmp_path_factory.mktemp("k8s")
    shutil.copytree(REPO / "deploy", root / "deploy")
    (root / "deploy" / "kubernetes" / OVERLAY / "token").write_text("not-a-real-token\n")
    out = subprocess.run(
        ["kubectl", "kustomize", str(root / "deploy" / "kubernetes" / OVERLAY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_the_monitoring_objects_are_made_from_the_rules_and_the_dashboard():
    made = load_module(K8S / "make_monitoring.py")
    for name, make in made.MADE.items():
        assert (K8S / "base" / name).read_text() == make(), (
            f"deploy/kubernetes/base/{name} is out of date: "
            "python deploy/kubernetes/make_monitoring.py"
        )


@needs_kubectl
def test_every_object_is_valid_for_the_kubernetes_api(rendered):
    import kubernetes_validate

    operator = [d for d in rendered if d["apiVersion"].startswith("monitoring.coreos.com/")]
    core = [d for d in rendered if d not in operator]
    assert len(core) >= 12, [d["kind"] for d in core]
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # the Prometheus Operator's objects (no schema here): their shape, and the rules are
    # the rule file's
    (rule,) = _by_kind(rendered, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    monitors = _by_kind(rendered, "PodMonitor")
    assert set(monitors) == {"poolpipe-router", "poolpipe-node"}
    for m in monitors.values():
        assert m["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def _args(container: dict, env: dict[str, str]) -> list[str]:
    """A container's command line with Kubernetes's $(VAR) expanded from `env`."""
    line = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in line]


def _env(container: dict, config: dict[str, str]) -> dict[str, str]:
    """A container's environment as the example's cluster would give it (downward API:
    a node's name and address made up)."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            out[e["name"]] = config[e["valueFrom"]["configMapKeyRef"]["key"]]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            out[e["name"]] = {"spec.nodeName": "gpu-a", "status.hostIP": "10.0.0.21"}[field]
    return out


@needs_kubectl
def test_a_node_daemonset_per_gpu_type_and_what_each_container_runs_parses(rendered):
    from poolpipe_cli import build_parser

    parser = build_parser()
    maps = _by_kind(rendered, "ConfigMap")
    (settings,) = [m for n, m in maps.items() if n.startswith("poolpipe-settings")]
    config = settings["data"]
    daemonsets = _by_kind(rendered, "DaemonSet")
    assert len(daemonsets) == len(GPU_TYPES)
    for ds in daemonsets.values():
        pod = ds["spec"]["template"]["spec"]
        (node,) = pod["containers"]
        env = _env(node, config)
        device = env["POOLPIPE_DEVICE"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": GPU_TYPES[device]}
        assert pod["hostNetwork"] and node["resources"]["limits"]["nvidia.com/gpu"] == 1
        args = parser.parse_args(_args(node, env)[1:])
        assert (args.command, args.device, args.listen) == ("node", device, "10.0.0.21")
        ports = {p["name"]: p["containerPort"] for p in node["ports"]}
        assert (args.grpc_port, args.metrics_port, args.watch_port) == (
            ports["grpc"],
            ports["metrics"],
            ports["watch"],
        )
    deployments = _by_kind(rendered, "Deployment")
    router = deployments["poolpipe-router"]["spec"]["template"]["spec"]["containers"][0]
    args = parser.parse_args(_args(router, _env(router, config))[1:])
    assert args.command == "serve" and args.plan == config["plan"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "ready"}
    assert (args.ready_port, args.metrics_port) == (ports["ready"], ports["metrics"])
    balancer = deployments["poolpipe-balancer"]["spec"]["template"]["spec"]["containers"][0]
    assert parser.parse_args(_args(balancer, {})[1:]).command == "lb"
    workers = [n for n in deployments if n.startswith("prefect-worker")]
    assert sorted(workers) == [
        "prefect-worker-onboarding",
        "prefect-worker-t4",
        "prefect-worker-v100",
    ]
    images = {
        c["image"]
        for d in [*deployments.values(), *daemonsets.values()]
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"registry.example.com/poolpipe:0.1.0"}


@needs_kubectl
def test_the_inventory_and_the_token_reach_the_router_as_files(rendered):
    maps = _by_kind(rendered, "ConfigMap")
    (inventory,) = [m for n, m in maps.items() if n.startswith("poolpipe-inventory")]
    text = inventory["data"]["inventory.toml"]
    assert text == (K8S / OVERLAY / "inventory.toml").read_text()
    inv = parse_inventory(tomllib.loads(text), "inventory.toml")
    assert {n.device for n in inv.nodes} == set(GPU_TYPES)
    (secret,) = [
        s for n, s in _by_kind(rendered, "Secret").items() if n.startswith("poolpipe-token")
    ]
    assert set(secret["data"]) == {"token"}
    router = _by_kind(rendered, "Deployment")["poolpipe-router"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in router["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert volumes["inventory"]["configMap"]["name"] == inventory["metadata"]["name"]
