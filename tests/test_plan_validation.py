"""Plans are validated wherever they enter (reliability issue): a plan file that is not a
plan, or a plan that cannot run on its cluster, is refused with the file and the field or
constraint named, before anything is stored, simulated or served."""

from __future__ import annotations

import copy
import json
import re

import pytest

from poolpipe.domain.plan import Plan
from poolpipe.errors import PlanFormatError
from poolpipe.store.warehouse import Warehouse
from poolpipe_cli import main

MODEL = "repvgg-b3"


@pytest.fixture
def good(ppipe_dir, warehouse_path, tmp_path):
    """A warehouse with the shipped profiles and a valid plan file written by the planner."""
    wh = str(warehouse_path)
    assert main(["--warehouse", wh, "profiles", "import-ppipe", str(ppipe_dir)]) == 0
    out = tmp_path / "good.json"
    argv = ["--warehouse", wh, "plan", "--cluster", "hc2-large", "--models", MODEL]
    assert main([*argv, "--slo-scale", "5", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _write(tmp_path, doc, name="bad.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _broken(good, change):
    doc = copy.deepcopy(good)
    change(doc)
    return doc


def _first_part(doc):
    return doc["models"][0]["pipelines"][0]["partitions"][0]


FORMAT_CASES = [
    ("no SLO", lambda d: d["models"][0].pop("slo_us"), r"field models\[0\]\.slo_us is missing"),
    (
        "batch as text",
        lambda d: d["models"][0]["pipelines"][0].update(batch="four"),
        r"field models\[0\]\.pipelines\[0\]\.batch must be a whole number, got 'four'",
    ),
    ("no models", lambda d: d.pop("models"), "field models is missing"),
    (
        "blocks not a pair",
        lambda d: _first_part(d).update(blocks=[0]),
        r"models\[0\]\.pipelines\[0\]\.partitions\[0\]\.blocks must be \[start, end\]",
    ),
]


@pytest.mark.parametrize("what, change, message", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_a_malformed_plan_file_names_the_file_and_field(good, tmp_path, what, change, message):
    path = _write(tmp_path, _broken(good, change))
    with pytest.raises(PlanFormatError, match=message) as e:
        Plan.load(path)
    assert str(path) in str(e.value)


def test_a_truncated_or_foreign_file_is_named(good, tmp_path):
    text = json.dumps(good)
    with pytest.raises(PlanFormatError, match=r"truncated\.json is not a plan JSON file"):
        Plan.load(_write(tmp_path, text[: len(text) // 2], "truncated.json"))
    with pytest.raises(PlanFormatError, match="a plan is a JSON object, got list"):
        Plan.load(_write(tmp_path, "[1, 2]", "list.json"))
    with pytest.raises(PlanFormatError, match="cannot read plan file"):
        Plan.load(tmp_path)  # a folder


INFEASIBLE_CASES = [
    (
        "more vGPUs than the pool has GPUs",
        lambda d: _first_part(d).update(vgpus=500),
        r"plan uses \d+ GPUs \(per-share\), cluster has \d+",
    ),
    (
        "a GPU type the cluster lacks",
        lambda d: _first_part(d).update(gpu="H100"),
        "H100 share 1/1 not allowed/profiled",
    ),
    (
        "blocks that do not cover the model",
        lambda d: _first_part(d).update(blocks=[0, 7]),
        r"partitions \[0,7\) \[5,10\) do not cover blocks 0\.\.10 one after another",
    ),
    (
        "a batch never profiled",
        lambda d: d["models"][0]["pipelines"][0].update(batch=64),
        "batch 64 not profiled",
    ),
]


@pytest.mark.parametrize(
    "what, change, message", INFEASIBLE_CASES, ids=[c[0] for c in INFEASIBLE_CASES]
)
def test_an_infeasible_plan_is_refused_before_it_is_simulated_or_served(
    good, warehouse_path, tmp_path, capsys, what, change, message
):
    path = _write(tmp_path, _broken(good, change))
    with Warehouse.open(warehouse_path) as wh:
        (before,) = wh.con.execute("SELECT count(*) FROM plans").fetchone()  # type: ignore[misc]
    wh_arg = ["--warehouse", str(warehouse_path)]
    assert main([*wh_arg, "simulate", "--plan", str(path), "--duration", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(path) in err and re.search(message, err), err
    workspace = tmp_path / "serve"
    assert main([*wh_arg, "serve", str(path), "--workspace", str(workspace)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(path) in err and "violates" in err
    with Warehouse.open(warehouse_path) as wh:
        (after,) = wh.con.execute("SELECT count(*) FROM plans").fetchone()  # type: ignore[misc]
    assert after == before  # nothing stored
    assert not (workspace / "tritonserver").exists()  # nothing started
