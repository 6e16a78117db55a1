"""poolpipe's Grafana dashboard, made with grafanalib: `python
deploy/grafana/poolpipe_dashboard.py` writes deploy/grafana/poolpipe.json (what Grafana
imports; tests/test_grafana.py checks that the file is what this makes, and every panel's
query returns series from a real Prometheus scraping a live router and its nodes).

Rows: the request path (arrivals, outcomes, attainment, drops by reason), the plan against
reality per pool (planned and observed utilisation, deliverable and arriving req/s), nodes
(states, changes, each node's Triton), rollouts, and the router process (CPU, memory,
requests in flight, reply margin, statistics writer). The series are documented in
docs/deployment.md; the recording rules are deploy/prometheus/poolpipe.rules.yml's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    Dashboard,
    GridPos,
    RowPanel,
    Stat,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

OUT = Path(__file__).with_name("poolpipe.json")
DS = "${datasource}"
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"
ARRIVALS = f'sum by (model) (rate(poolpipe_requests_total{{outcome="arrivals", {MODEL}}}[{RATE}]))'
OUTCOMES = (
    "sum by (model, outcome) "
    f'(rate(poolpipe_requests_total{{outcome!="arrivals", {MODEL}}}[{RATE}]))'
)
BUSY = f"rate(poolpipe_pool_busy_seconds_total{{{MODEL}}}[{RATE}]) / poolpipe_pool_vgpus"
# A panel's place: its row's panels fill 24 columns, 8 high, left to right
WIDTH, HEIGHT = 24, 8


def _ts(title: str, unit: str, *queries: tuple[str, str], description: str = "") -> TimeSeries:
    return TimeSeries(
        title=title,
        description=description,
        dataSource=DS,
        unit=unit,
        targets=[
            Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DS)
            for i, (expr, legend) in enumerate(queries)
        ],
    )


def _stat(title: str, unit: str, expr: str, legend: str, description: str = "") -> Stat:
    return Stat(
        title=title,
        description=description,
        dataSource=DS,
        format=unit,
        reduceCalc="lastNotNull",
        targets=[Target(expr=expr, legendFormat=legend, refId="A", datasource=DS)],
    )


ROWS: list[tuple[str, list]] = [
    (
        "Requests",
        [
            _ts(
                "Arrivals",
                "reqps",
                (ARRIVALS, "{{model}}"),
            ),
            _ts(
                "Outcomes",
                "reqps",
                (OUTCOMES, "{{model}} {{outcome}}"),
                description="on_time, late, dropped, failed, refused, retried per model",
            ),
            _stat(
                "On time (5 min)",
                "percentunit",
                f"poolpipe:attainment:ratio5m{{{MODEL}}}",
                "{{model}}",
                description="The SLO: at least 99% (alert PoolpipeAttainmentLow)",
            ),
            _ts(
                "Drops by reason",
                "reqps",
                (f"sum by (reason) (rate(poolpipe_drops_total[{RATE}]))", "{{reason}}"),
            ),
        ],
    ),
    (
        "Plan against reality",
        [
            _ts(
                "Pool utilisation: observed and planned",
                "percentunit",
                (BUSY, "{{model}} pool {{pool}} ({{gpu}})"),
                (
                    f"poolpipe_pool_planned_utilisation{{{MODEL}}}",
                    "{{model}} pool {{pool}} planned",
                ),
                description="Busy fraction of each pool's vGPUs, and what the plan holds it "
                "at (its model's deliverable load)",
            ),
            _ts(
                "Utilisation over plan",
                "none",
                (
                    f"poolpipe:pool_utilisation_over_plan:ratio5m{{{MODEL}}}",
                    "{{model}} pool {{pool}} ({{gpu}})",
                ),
                description="Above 1: the pool runs hotter than its plan said "
                "(alert PoolpipePoolAbovePlan at 1.1)",
            ),
            _ts(
                "Arriving and deliverable",
                "reqps",
                (ARRIVALS, "{{model}} arriving"),
                (
                    f"sum by (model) (poolpipe_model_deliverable_rps{{{MODEL}}})",
                    "{{model}} deliverable",
                ),
                (f"sum by (model) (poolpipe_model_planned_rps{{{MODEL}}})", "{{model}} planned"),
            ),
            _stat(
                "Deliverable headroom (5 min)",
                "percentunit",
                f"poolpipe:deliverable_headroom:ratio5m{{{MODEL}}}",
                "{{model}}",
                description="Share of the deliverable req/s not used (negative: more "
                "arrives than the plans serve at 99% on time)",
            ),
        ],
    ),
    (
        "Nodes",
        [
            _ts(
                "Nodes out of service",
                "none",
                (
                    'sum by (state) (poolpipe_node_state{state!="in service"})',
                    "{{state}}",
                ),
                (
                    'sum(poolpipe_node_state{state="in service"})',
                    "in service",
                ),
            ),
            _ts(
                "Node changes",
                "none",
                (
                    f"sum by (state) (increase(poolpipe_node_changes_total[{RATE}]))",
                    "{{state}}",
                ),
            ),
            _ts(
                "Time since a node's last stage",
                "s",
                ("max by (node) (poolpipe_node_idle_seconds)", "{{node}}"),
                description="Batches go to the lowest-numbered vGPUs: at a low load the "
                "others run nothing, and a node idle for long can be drained and released "
                "(poolpipe advise)",
            ),
            _ts(
                "GPUs in use and needed, per type",
                "short",
                ("sum by (gpu) (poolpipe_gpus_in_use)", "{{gpu}} in use"),
                ("max by (gpu) (poolpipe_gpus_needed)", "{{gpu}} needed"),
                ("count(poolpipe_node_releasable) or vector(0)", "nodes releasable now"),
                description="Needed: the cheapest GPUs that serve the observed load x (1 + "
                "headroom), by the last advice (the load-replan flow; poolpipe advise "
                "--publish). What an autoscaler acts on",
            ),
            _ts(
                "Inferences per node (Triton)",
                "reqps",
                (
                    f"sum by (instance) (rate(nv_inference_request_success[{RATE}]))",
                    "{{instance}}",
                ),
                (
                    f"sum by (instance) (rate(nv_inference_request_failure[{RATE}]))",
                    "{{instance}} failed",
                ),
            ),
            _ts(
                "Compute per inference (Triton)",
                "µs",
                (
                    f"sum by (instance) (rate(nv_inference_compute_infer_duration_us[{RATE}]))"
                    f" / sum by (instance) (rate(nv_inference_exec_count[{RATE}]))",
                    "{{instance}}",
                ),
            ),
        ],
    ),
    (
        "Rollouts and the router",
        [
            _ts(
                "Rollouts",
                "none",
                (f"sum by (result) (increase(poolpipe_rollouts_total[{RATE}]))", "{{result}}"),
                ("max(poolpipe_plan_generation)", "generation"),
            ),
            _ts(
                "Router CPU",
                "percentunit",
                (
                    # (the routers' processes: those exporting poolpipe's series, whatever
                    # their scrape job is called)
                    f"rate(process_cpu_seconds_total[{RATE}]) and on (instance) poolpipe_in_flight",
                    "{{instance}}",
                ),
                description="Cores the router process uses (its Triton front end is a "
                "process of its own: Triton's metrics)",
            ),
            _ts("Requests in flight", "none", ("poolpipe_in_flight", "{{instance}}")),
            _ts(
                "Reply margin",
                "s",
                ("poolpipe_reply_margin_seconds", "{{instance}}"),
                ("poolpipe_reply_margin_ceiling_seconds", "{{instance}} ceiling"),
                description="Held back from every deadline for the answer's way out "
                "(alert PoolpipeReplyMarginAtCeiling)",
            ),
            _ts(
                "Statistics writer",
                "s",
                (
                    "time() - poolpipe_stats_last_write_timestamp_seconds",
                    "{{instance}} since the last write",
                ),
                ("poolpipe_stats_interval_seconds", "{{instance}} interval"),
            ),
        ],
    ),
]


def dashboard() -> Dashboard:
    panels: list = []
    y = 0
    for title, row in ROWS:
        panels.append(RowPanel(title=title, gridPos=GridPos(h=1, w=WIDTH, x=0, y=y)))
        y += 1
        w = WIDTH // len(row)
        for i, panel in enumerate(row):
            last = i == len(row) - 1  # the last takes what is left of the width
            panel.gridPos = GridPos(h=HEIGHT, w=WIDTH - i * w if last else w, x=i * w, y=y)
            panels.append(panel)
        y += HEIGHT
    return Dashboard(
        title="poolpipe",
        uid="poolpipe",
        description="Pool-based pipeline serving: requests, the plan against reality, nodes, "
        "rollouts and the router",
        tags=["poolpipe"],
        timezone="browser",
        refresh="10s",
        time=Time("now-1h", "now"),
        templating=Templating(
            list=[
                Template(
                    name="datasource",
                    label="Prometheus",
                    query="prometheus",
                    type="datasource",
                ),
                Template(
                    name="model",
                    label="Model",
                    dataSource=DS,
                    query="label_values(poolpipe_requests_total, model)",
                    includeAll=True,
                    multi=True,
                    allValue=".+",
                    default="$__all",
                ),
            ]
        ),
        panels=panels,
    ).auto_panel_ids()


def render() -> str:
    return json.dumps(dashboard().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True)


def queries(data: dict) -> list[str]:
    """Every panel query of a dashboard's JSON."""
    return [t["expr"] for p in data["panels"] for t in p.get("targets", []) if t.get("expr")]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.write_text(render() + "\n")
    print(f"wrote {out}")
