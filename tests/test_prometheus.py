"""poolpipe's Prometheus rules (deploy/prometheus/poolpipe.rules.yml): valid for a real
promtool, every recording rule and alert covered by its unit tests
(tests/prometheus/poolpipe.rules.test.yml), each alert both firing and not. A real
Prometheus scraping a live router and its nodes with these rules is in
tests/test_serving_ops.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "poolpipe.rules.yml"
CASES = REPO / "tests" / "prometheus" / "poolpipe.rules.test.yml"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian's prometheus package; ./run installs it as root)",
)


def rules_in_file() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_the_rules_are_valid_and_their_unit_tests_pass():
    check = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules_in_file())} rules found" in check.stdout
    test = subprocess.run(
        ["promtool", "test", "rules", CASES.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CASES.parent,
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_rule_has_a_case_and_every_alert_fires_and_stays_quiet_in_one():
    cases = yaml.safe_load(CASES.read_text())["tests"]
    exprs = {t["expr"] for c in cases for t in c.get("promql_expr_test", [])}
    fired: dict[str, set[bool]] = {}
    for c in cases:
        for t in c.get("alert_rule_test", []):
            fired.setdefault(t["alertname"], set()).add(bool(t["exp_alerts"]))
    for rule in rules_in_file():
        if "record" in rule:
            assert rule["record"] in exprs, f"recording rule {rule['record']} has no case"
        else:
            assert fired.get(rule["alert"]) == {True, False}, (
                f"alert {rule['alert']} needs a case where it fires and one where it does not"
            )
    names = {r.get("record") or r["alert"] for r in rules_in_file()}
    assert {"poolpipe:attainment:ratio5m", "PoolpipeAttainmentLow"} <= names


@needs_promtool
def test_the_example_configuration_is_valid_with_the_rules(tmp_path):
    example = REPO / "deploy" / "prometheus" / "prometheus.example.yml"
    text = example.read_text().replace("/etc/prometheus/poolpipe.rules.yml", str(RULES))
    (tmp_path / "prometheus.yml").write_text(text)
    check = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
