"""The alert rules (helm/model-executor/rules/model-executor.rules.yml) under Prometheus's own
promtool: they load, and every alert has a unit test where it fires and one where it stays
silent (tests/prometheus/model-executor.rules.test.yml). Each alert is documented in the
runbook and in docs/deploy.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.prometheus_tools import PrometheusBinaries
from tests.promql_sources import ROOT, RULES

RULE_TESTS = ROOT / "tests" / "prometheus" / "model-executor.rules.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def _promtool(binaries: PrometheusBinaries, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [binaries.promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_check_rules(prometheus_binaries: PrometheusBinaries) -> None:
    out = _promtool(prometheus_binaries, "check", "rules", str(RULES), cwd=ROOT)
    assert f"SUCCESS: {len(_alerts())} rules found" in out


def test_promtool_unit_tests_pass(prometheus_binaries: PrometheusBinaries) -> None:
    out = _promtool(prometheus_binaries, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert "SUCCESS" in out


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == ["../../helm/model-executor/rules/model-executor.rules.yml"]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert names - fires == set(), "alerts with no unit test where they fire"
    assert names - silent == set(), "alerts with no unit test where they stay silent"
    assert (fires | silent) - names == set(), "unit tests for alerts that do not exist"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    anchors = {
        _anchor(line.lstrip("#"))
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## ")
    }
    deploy_doc = DEPLOY_DOC.read_text()
    for rule in _alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        url = annotations["runbook_url"]
        assert url == f"docs/runbook.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbook.md has no '## {name}' section"
        assert f"[{name}](runbook.md#{name.lower()})" in deploy_doc, (
            f"docs/deploy.md does not say what {name} means"
        )
        assert rule.get("for"), f"{name} fires on a single evaluation: give it a `for`"
