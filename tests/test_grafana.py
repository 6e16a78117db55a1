"""poolpipe's Grafana dashboard (deploy/grafana/poolpipe.json, made by
deploy/grafana/poolpipe_dashboard.py with grafanalib): the file is what the code makes, its
panels tile the rows, and every query names only series poolpipe's routers, its recording
rules, Triton's nodes or the router process export. That every query returns series from a
real Prometheus scraping a live router and its nodes is checked in
tests/test_serving_ops.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.test_prometheus import rules_in_file

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "deploy" / "grafana" / "poolpipe_dashboard.py"
JSON = REPO / "deploy" / "grafana" / "poolpipe.json"
# A panel query's range and model selection, as a test's Prometheus evaluates them
RATE_INTERVAL = "10s"


def load_module(path: Path):
    """A script of deploy/ (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generator():
    return load_module(SOURCE)


def panel_queries() -> list[str]:
    """The dashboard's panel queries with Grafana's variables as a test Prometheus takes
    them ($model: every model; $__rate_interval: RATE_INTERVAL)."""
    queries = generator().queries(json.loads(JSON.read_text()))
    return [q.replace("$model", ".+").replace("$__rate_interval", RATE_INTERVAL) for q in queries]


def test_the_dashboard_file_is_what_its_code_makes():
    made = generator().render() + "\n"
    assert JSON.read_text() == made, (
        "deploy/grafana/poolpipe.json is out of date: python deploy/grafana/poolpipe_dashboard.py"
    )


def test_panels_tile_their_rows_and_have_unique_ids():
    data = json.loads(JSON.read_text())
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in data["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert [t["name"] for t in data["templating"]["list"]] == ["datasource", "model"]


@pytest.mark.parametrize("query", panel_queries())
def test_every_query_names_series_that_exist(query):
    from triton_backend.deploy import serving

    exported = set(re.findall(r'"(poolpipe_[a-z_]+)"', Path(serving.__file__).read_text()))
    counters = {"poolpipe_requests", "poolpipe_drops", "poolpipe_pool_busy_seconds"}
    counters |= {"poolpipe_node_changes", "poolpipe_rollouts", "poolpipe_nonfinite_inputs"}
    exported |= {f"{c}_total" for c in counters & exported}
    recorded = {r["record"] for r in rules_in_file() if "record" in r}
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|on) \([^)]*\)", "", query)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare))
    names -= {"sum", "max", "count", "rate", "increase", "time", "and", "or", "vector"}
    assert names, query
    for name in names:
        known = (
            name in exported or name in recorded or name.startswith(("nv_inference_", "process_"))
        )
        assert known, f"{name} (in {query}) is exported by nothing poolpipe runs"
