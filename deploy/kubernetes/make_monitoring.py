"""Make the Kubernetes monitoring objects from their one source:
deploy/prometheus/poolpipe.rules.yml as a PrometheusRule (Prometheus Operator) and
deploy/grafana/poolpipe.json as a ConfigMap that Grafana's dashboard sidecar loads (label
grafana_dashboard). `python deploy/kubernetes/make_monitoring.py` writes both into
deploy/kubernetes/base/; tests/test_kubernetes.py checks that they are up to date."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
RULES = DEPLOY / "prometheus" / "poolpipe.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "poolpipe.json"
BASE = DEPLOY / "kubernetes" / "base"
HEADER = "# made by deploy/kubernetes/make_monitoring.py from {}; edit that, not this\n"


def prometheus_rule() -> str:
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "poolpipe"},
        "spec": yaml.safe_load(RULES.read_text()),
    }
    body = yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)
    return HEADER.format("deploy/prometheus/poolpipe.rules.yml") + body


def grafana_dashboard() -> str:
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "poolpipe-grafana-dashboard", "labels": {"grafana_dashboard": "1"}},
        "data": {"poolpipe.json": json.dumps(json.loads(DASHBOARD.read_text()), indent=1)},
    }
    body = yaml.dump(config_map, Dumper=_Dumper, sort_keys=False, width=100)
    return HEADER.format("deploy/grafana/poolpipe.json") + body


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL over several lines) as literal blocks."""


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


MADE = {"prometheus-rule.yaml": prometheus_rule, "grafana-dashboard.yaml": grafana_dashboard}

if __name__ == "__main__":
    for name, make in MADE.items():
        (BASE / name).write_text(make())
        print(f"wrote {BASE / name}")
