"""Every PromQL expression in the dashboards and alert rules parses with Prometheus's parser,
runs on a real Prometheus server, and selects only metrics, labels and label values of the
metrics contract (tests/metrics_contract.py), so a typo fails here and not on a dashboard."""

from __future__ import annotations

import http.server
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from tests.metrics_contract import CONTRACT, LABEL_VALUES, TARGET_LABELS, allowed_series
from tests.prometheus_tools import PrometheusBinaries, running_prometheus
from tests.promql_sources import (
    DASHBOARDS,
    RULES,
    Query,
    all_queries,
    dashboard_queries,
    grouping_labels,
    metric_names,
    rule_queries,
    selectors,
)

QUERIES = all_queries()


def contract_violations(query: Query) -> list[str]:
    """What in the query is not in the contract (empty: all good)."""
    allowed = allowed_series()
    problems = []
    labels_in_query: set[str] = set(TARGET_LABELS)
    for sel in selectors(query.promql):
        if sel.name not in allowed:
            problems.append(f"unknown metric {sel.name}")
            continue
        family, labels = allowed[sel.name]
        labels_in_query |= labels
        for label, op, value in sel.matchers:
            if label not in labels:
                problems.append(f"{sel.name} has no label {label!r}")
                continue
            values = LABEL_VALUES.get((family, label))
            if values is None:
                continue
            # Plain values and `a|b` alternations must name existing values.
            if op in ("=", "!=") or (op in ("=~", "!~") and value.replace("|", "").isidentifier()):
                for v in value.split("|") if op in ("=~", "!~") else [value]:
                    if v not in values:
                        problems.append(f'{sel.name}{{{label}{op}"{value}"}}: no value {v!r}')
    for label in grouping_labels(query.promql) - labels_in_query:
        problems.append(f"groups by {label!r}, which none of its metrics carries")
    return problems


def test_queries_found() -> None:
    sources = {q.source.split(":")[0] for q in QUERIES}
    assert sources == {"overview.json", "internals.json", "model-executor.rules.yml"}
    # Every rule in the file is read (counted from the raw text, not through the YAML reader).
    raw = [line.split(":")[0].strip() for line in RULES.read_text().splitlines()]
    assert len(rule_queries()) == raw.count("- alert") + raw.count("- record") >= 12
    assert all(len(dashboard_queries(path)) > 15 for path in DASHBOARDS)


@pytest.mark.parametrize("query", QUERIES, ids=[q.source for q in QUERIES])
def test_query_uses_only_contract_metrics_and_labels(query: Query) -> None:
    assert contract_violations(query) == []


def test_contract_check_catches_typos() -> None:
    def check(expr: str) -> list[str]:
        return contract_violations(Query("typo", expr, expr))

    assert check("model_executor_forward_second_count") == [
        "unknown metric model_executor_forward_second_count"
    ]
    assert check('model_executor_forward_seconds_count{mode="DECODE"}') == [
        "model_executor_forward_seconds_count{mode=\"DECODE\"}: no value 'DECODE'"
    ]
    assert check('model_executor_requests_total{code=~"OK|INVALID_ARGUMNT"}') != []
    assert check('model_executor_ready{path="eager"}') == [
        "model_executor_ready has no label 'path'"
    ]
    assert check("sum by (registry) (rate(model_executor_d2h_syncs_total[5m]))") == [
        "groups by 'registry', which none of its metrics carries"
    ]
    assert check('sum by (le) (model_executor_forward_seconds_bucket{job="x"})') == []


def test_every_expression_parses_with_promtool(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    """Prometheus's own parser: each expression as a recording rule, one `promtool check`."""
    rules = [{"record": f"check:query_{i}", "expr": q.promql} for i, q in enumerate(QUERIES)]
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    result = subprocess.run(
        [prometheus_binaries.promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_expression_runs_on_a_real_prometheus(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    """An empty TSDB: every query is accepted and evaluated (the live-scrape test fills it)."""
    with running_prometheus(prometheus_binaries, tmp_path / "prometheus") as prom:
        for q in QUERIES:
            result = prom.query(q.promql)
            assert result["resultType"] in {"vector", "scalar"}, q.source
        with pytest.raises(AssertionError, match="bad_data"):
            prom.query("sum(rate(model_executor_ready[5m])")


def test_dashboards_and_alerts_cover_the_contract() -> None:
    used = {
        allowed_series()[name][0]
        for q in QUERIES
        for name in metric_names(q.promql)
        if name in allowed_series()
    }
    assert set(CONTRACT) - used == set(), "contract metrics no dashboard or alert shows"


@pytest.mark.slow
def test_prometheus_helper_scrapes_a_target(
    prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    """The pieces the live-scrape test builds on: scrape a loopback target, list the names it
    exported, query them (here from a fixed exposition, not an executor)."""
    body = (
        b"# TYPE model_executor_ready gauge\nmodel_executor_ready 1\n"
        b"# TYPE model_executor_queue_wait_seconds histogram\n"
        b'model_executor_queue_wait_seconds_bucket{le="0.1"} 3\n'
        b'model_executor_queue_wait_seconds_bucket{le="+Inf"} 4\n'
        b"model_executor_queue_wait_seconds_sum 0.5\nmodel_executor_queue_wait_seconds_count 4\n"
    )

    class Exporter(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exporter) as exporter:
        threading.Thread(target=exporter.serve_forever, daemon=True).start()
        target = f"127.0.0.1:{exporter.server_address[1]}"
        scrape = {"job_name": "model-executor", "static_configs": [{"targets": [target]}]}
        try:
            with running_prometheus(
                prometheus_binaries, tmp_path / "prometheus", scrape_configs=[scrape]
            ) as prom:
                prom.wait_for_scrape("model-executor")
                assert {
                    "up",
                    "model_executor_ready",
                    "model_executor_queue_wait_seconds_bucket",
                } <= prom.metric_names()
                [sample] = prom.query('model_executor_ready{job="model-executor"}')["result"]
                assert sample["value"][1] == "1" and sample["metric"]["instance"] == target
        finally:
            exporter.shutdown()
