"""Every PromQL expression the chart ships (dashboard panels and variables, alert rules), and
what each one selects.

`all_queries()` is what a test evaluates: each `Query` carries the expression as written and
as plain PromQL (Grafana's variables replaced by values any Prometheus accepts).
`selectors()`, `metric_names()` and `grouping_labels()` read a query's syntax tree
(promql-parser, a port of Prometheus's own parser), not its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "model-executor"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "rules" / "model-executor.rules.yml"

# What Grafana substitutes before a query reaches Prometheus; `.*` stands for "all" of a
# multi-value variable (the dashboards' allValue).
GRAFANA_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "job": ".*",
    "instance": ".*",
}
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Query:
    source: str  # where it is: file and panel, variable or alert
    expr: str  # as written
    promql: str  # what Prometheus receives


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op: = != =~ !~, value)


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana variables; an unknown one raises (add it to GRAFANA_VARIABLES)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARIABLES:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return _VARIABLE.sub(sub, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries(path: Path) -> list[Query]:
    model = json.loads(path.read_text())
    out = []
    for panel in _panels(model["panels"]):
        for target in panel.get("targets", []):
            source = f"{path.name}: panel {panel['title']!r} {target['refId']}"
            out.append(Query(source, target["expr"], grafana_to_promql(target["expr"])))
    for var in model["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        if m is None:
            raise ValueError(f"{path.name}: variable {var['name']}: not label_values(): {query}")
        source = f"{path.name}: variable ${var['name']}"
        out.append(Query(source, query, grafana_to_promql(m.group("selector"))))
    return out


def rule_queries(path: Path = RULES) -> list[Query]:
    doc = yaml.safe_load(path.read_text())
    return [
        Query(f"{path.name}: {rule.get('alert') or rule['record']}", rule["expr"], rule["expr"])
        for group in doc["groups"]
        for rule in group["rules"]
    ]


def all_queries() -> list[Query]:
    return [q for path in DASHBOARDS for q in dashboard_queries(path)] + rule_queries()


def _children(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.Call):
        return [a for a in node.args if isinstance(a, promql_parser.Expr)]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, promql_parser.AggregateExpr):
        param = [node.param] if isinstance(node.param, promql_parser.Expr) else []
        return [node.expr, *param]
    if isinstance(
        node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr
    ):
        return [node.expr]
    return []


def _walk(node: Any) -> Iterator[Any]:
    yield node
    for child in _children(node):
        yield from _walk(child)


# MatchOp values are not hashable; their str() is "MatchOp.Equal".
_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


def selectors(promql: str) -> list[Selector]:
    """Every vector selector in the expression (parse errors raise ValueError)."""
    out = []
    for node in _walk(promql_parser.parse(promql)):
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers + [
                m for group in node.matchers.or_matchers for m in group
            ]
            name = node.name or next(m.value for m in matchers if m.name == "__name__")
            out.append(
                Selector(
                    name,
                    tuple(
                        (m.name, _OPS[str(m.op)], m.value) for m in matchers if m.name != "__name__"
                    ),
                )
            )
    return out


def metric_names(promql: str) -> set[str]:
    return {s.name for s in selectors(promql)}


def grouping_labels(promql: str) -> set[str]:
    """Labels named in by/without/on/ignoring/group_left/group_right clauses."""
    out: set[str] = set()
    for node in _walk(promql_parser.parse(promql)):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            out.update(node.modifier.labels)
        if isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                out.update(node.modifier.matching.labels)
            out.update(node.modifier.group_labels or [])
    return out
