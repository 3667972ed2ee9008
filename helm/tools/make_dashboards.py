"""Write the chart's Grafana dashboards (helm/model-executor/dashboards/*.json).

The JSON files are generated so that every panel has the same datasource, variables, ids and
layout rules; edit this file, then run

    python helm/tools/make_dashboards.py

tests/test_dashboards.py fails when the committed JSON differs from what this writes, and
checks every expression against the metrics contract. Expressions use the `job` and
`instance` variables and Grafana's `$__rate_interval`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "model-executor" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
# Statuses that are the caller's doing, not the executor's failure (the alert leaves them out too).
CALLER_CODES = "OK|INVALID_ARGUMENT|CANCELLED|DEADLINE_EXCEEDED"
RATE = "$__rate_interval"
# Non-idle steps: IDLE batches do no device work, so per-step ratios leave them out.
STEPS = f'sum(rate(model_executor_forward_seconds_count{{{SEL}, mode!="idle"}}[{RATE}]))'


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    threshold: float | None = None  # a red line (timeseries) or step (stat)
    mappings: list[dict[str, Any]] = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    stack: bool = False
    text_mode: str = "value_and_name"  # stat panels: "name" shows only the legend


@dataclass
class Row:
    title: str
    panels: list[Panel]


def _on_off() -> list[dict[str, Any]]:
    return [
        {
            "type": "value",
            "options": {
                "0": {"text": "off", "color": "text", "index": 0},
                "1": {"text": "on", "color": "blue", "index": 1},
            },
        }
    ]


def _thresholds(threshold: float | None) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if threshold is not None:
        steps.append({"color": "red", "value": threshold})
    return {"mode": "absolute", "steps": steps}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, t in enumerate(panel.targets):
        target: dict[str, Any] = {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + i),
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": not t.instant,
            "instant": t.instant,
        }
        if t.table:
            target["format"] = "table"
        targets.append(target)
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": _thresholds(panel.threshold),
        "mappings": panel.mappings,
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    options: dict[str, Any]
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if panel.threshold is not None else "off"},
        }
        defaults["color"] = {"mode": "palette-classic"}
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": panel.text_mode,
            "orientation": "auto",
            "justifyMode": "auto",
        }
    elif panel.kind == "table":
        options = {"showHeader": True, "cellHeight": "sm"}
    else:  # pragma: no cover - a typo in this file
        raise ValueError(f"unknown panel kind {panel.kind!r}")
    out: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
    }
    if panel.kind == "table":
        out["transformations"] = [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}},
            },
        ]
    return out


def _variables() -> list[dict[str, Any]]:
    job_query = "label_values(model_executor_build_info, job)"
    instance_query = 'label_values(model_executor_build_info{job=~"$job"}, instance)'
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
        },
        {
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": DATASOURCE,
            "definition": job_query,
            "query": {"query": job_query, "refId": "job"},
            "current": {},
            "hide": 0,
            "refresh": 2,
            "includeAll": False,
            "multi": False,
            "sort": 1,
        },
        {
            "name": "instance",
            "label": "Instance",
            "type": "query",
            "datasource": DATASOURCE,
            "definition": instance_query,
            "query": {"query": instance_query, "refId": "instance"},
            "current": {},
            "hide": 0,
            "refresh": 2,
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "sort": 1,
        },
    ]


def dashboard(uid: str, title: str, description: str, rows: list[Row]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row in rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        row_height = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + row_height
                row_height = 0
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["model-executor"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "Model executor dashboards",
                "type": "dashboards",
                "tags": ["model-executor"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def _quantiles(metric: str, by: str, unit_legend: str = "") -> list[Target]:
    return [
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"{{{{{by}}}}} p{round(q * 100)}{unit_legend}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def overview() -> dict[str, Any]:
    rows = [
        Row(
            "Health and RPCs",
            [
                Panel(
                    "Ready",
                    "model_executor_ready per executor: 1 once the model is loaded, warmed up "
                    "and its graphs captured; 0 while loading or draining.",
                    [Target(f"model_executor_ready{{{SEL}}}", "{{instance}}")],
                    kind="stat",
                    width=6,
                    mappings=[
                        {
                            "type": "value",
                            "options": {
                                "0": {"text": "not ready", "color": "red", "index": 0},
                                "1": {"text": "ready", "color": "green", "index": 1},
                            },
                        }
                    ],
                ),
                Panel(
                    "RPCs/s by status code",
                    "Answered RPCs per second by gRPC status code (OK, INVALID_ARGUMENT, "
                    "RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL, ...).",
                    [
                        Target(
                            f"sum by (code) (rate(model_executor_requests_total{{{SEL}}}[{RATE}]))",
                            "{{code}}",
                        )
                    ],
                    unit="reqps",
                    width=9,
                    stack=True,
                ),
                Panel(
                    "RPC error ratio",
                    "Share of RPCs that ended with the executor's own failure (not OK, and "
                    "not the caller's doing: INVALID_ARGUMENT, CANCELLED, DEADLINE_EXCEEDED); "
                    "the ModelExecutorErrorRatioHigh alert fires above 1%.",
                    [
                        Target(
                            f'sum(rate(model_executor_requests_total{{{SEL}, code!~"{CALLER_CODES}"}}[{RATE}]))'
                            f" / sum(rate(model_executor_requests_total{{{SEL}}}[{RATE}]))",
                            "error ratio",
                        )
                    ],
                    unit="percentunit",
                    width=9,
                    threshold=0.01,
                    min=0,
                ),
                Panel(
                    "RPC latency p99 by method",
                    "99th percentile of the time from an RPC's arrival to its answer.",
                    [
                        Target(
                            "histogram_quantile(0.99, sum by (method, le) "
                            f"(rate(model_executor_rpc_seconds_bucket{{{SEL}}}[{RATE}])))",
                            "{{method}}",
                        )
                    ],
                    unit="s",
                    width=24,
                ),
            ],
        ),
        Row(
            "Throughput",
            [
                Panel(
                    "Steps/s by mode",
                    "Forward steps per second by batch mode (decode, extend, idle).",
                    [
                        Target(
                            "sum by (mode) "
                            f"(rate(model_executor_forward_seconds_count{{{SEL}}}[{RATE}]))",
                            "{{mode}}",
                        )
                    ],
                    unit="ops",
                    stack=True,
                ),
                Panel(
                    "Tokens/s by mode",
                    "Tokens the forward computed per second by batch mode (not counting padding).",
                    [
                        Target(
                            f"sum by (mode) (rate(model_executor_tokens_total{{{SEL}}}[{RATE}]))",
                            "{{mode}}",
                        )
                    ],
                    unit="short",
                    stack=True,
                ),
            ],
        ),
        Row(
            "Forward latency",
            [
                Panel(
                    "Forward latency by path",
                    "p50, p95 and p99 of one forward step by execution path (eager, "
                    "eager_no_copy, full_graph, piecewise).",
                    _quantiles("model_executor_forward_seconds", "path"),
                    unit="s",
                ),
                Panel(
                    "DECODE p99 by instance",
                    "p99 of DECODE steps per executor; the ModelExecutorDecodeLatencyHigh "
                    "alert fires above 250 ms for 10 minutes.",
                    [
                        Target(
                            "histogram_quantile(0.99, sum by (instance, le) "
                            f'(rate(model_executor_forward_seconds_bucket{{{SEL}, mode="decode"}}[{RATE}])))',
                            "{{instance}}",
                        )
                    ],
                    unit="s",
                    threshold=0.25,
                ),
            ],
        ),
        Row(
            "Batches and padding",
            [
                Panel(
                    "Batch size by mode",
                    "Requests per batch: mean and p95 by mode.",
                    [
                        Target(
                            f"sum by (mode) (rate(model_executor_batch_size_sum{{{SEL}}}[{RATE}]))"
                            f" / sum by (mode) (rate(model_executor_batch_size_count{{{SEL}}}[{RATE}]))",
                            "{{mode}} mean",
                        ),
                        Target(
                            "histogram_quantile(0.95, sum by (mode, le) "
                            f"(rate(model_executor_batch_size_bucket{{{SEL}}}[{RATE}])))",
                            "{{mode}} p95",
                        ),
                    ],
                ),
                Panel(
                    "Padded batch size by path",
                    "Batch size after padding to a captured graph bucket: mean and p95 by path.",
                    [
                        Target(
                            f"sum by (path) (rate(model_executor_padded_batch_size_sum{{{SEL}}}[{RATE}]))"
                            f" / sum by (path) (rate(model_executor_padded_batch_size_count{{{SEL}}}[{RATE}]))",
                            "{{path}} mean",
                        ),
                        Target(
                            "histogram_quantile(0.95, sum by (path, le) "
                            f"(rate(model_executor_padded_batch_size_bucket{{{SEL}}}[{RATE}])))",
                            "{{path}} p95",
                        ),
                    ],
                ),
                Panel(
                    "Padding tokens/s by path",
                    "Tokens computed only because a batch was padded up to its bucket.",
                    [
                        Target(
                            "sum by (path) "
                            f"(rate(model_executor_padding_tokens_total{{{SEL}}}[{RATE}]))",
                            "{{path}}",
                        )
                    ],
                    stack=True,
                ),
                Panel(
                    "Padding waste",
                    "Share of computed tokens that were padding.",
                    [
                        Target(
                            f"sum(rate(model_executor_padding_tokens_total{{{SEL}}}[{RATE}]))"
                            f" / (sum(rate(model_executor_padding_tokens_total{{{SEL}}}[{RATE}]))"
                            f" + sum(rate(model_executor_tokens_total{{{SEL}}}[{RATE}])))",
                            "padding share",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                ),
            ],
        ),
        Row(
            "Queue",
            [
                Panel(
                    "Queue depth",
                    "Batches waiting for the device; at --queue-size more get RESOURCE_EXHAUSTED.",
                    [Target(f"model_executor_queue_depth{{{SEL}}}", "{{instance}}")],
                ),
                Panel(
                    "Device occupancy",
                    "model_executor_forward_occupancy per executor: the device's busy time over "
                    "its time with a batch queued, over the last 10 s (1: it never waited for "
                    "the host while work was queued); the ModelExecutorOccupancyLow alert fires "
                    "below 0.8.",
                    [Target(f"model_executor_forward_occupancy{{{SEL}}}", "{{instance}}")],
                    unit="percentunit",
                    threshold=0.8,
                    min=0,
                    max=1,
                ),
                Panel(
                    "Device idle with work queued",
                    "Seconds per second the device waited for the host with a batch queued "
                    "(the host gap before each step: admission, staging, the answer before it).",
                    [
                        Target(
                            f"rate(model_executor_device_idle_seconds_total{{{SEL}}}[{RATE}])",
                            "{{instance}}",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                ),
                Panel(
                    "Queue wait",
                    "Time a batch waited for the device: p50 and p99.",
                    [
                        Target(
                            f"histogram_quantile({q}, sum by (le) "
                            f"(rate(model_executor_queue_wait_seconds_bucket{{{SEL}}}[{RATE}])))",
                            f"p{round(q * 100)}",
                        )
                        for q in (0.5, 0.99)
                    ],
                    unit="s",
                ),
            ],
        ),
        Row(
            "KV cache",
            [
                Panel(
                    "KV slots in use",
                    "Share of KV cache slots in use per executor; the "
                    "ModelExecutorKVSlotsNearlyFull alert fires above 95%.",
                    [
                        Target(
                            f"model_executor_kv_slots_used{{{SEL}}} / model_executor_kv_slots_total{{{SEL}}}",
                            "{{instance}}",
                        )
                    ],
                    unit="percentunit",
                    threshold=0.95,
                    min=0,
                    max=1,
                ),
                Panel(
                    "KV slots and request rows in use",
                    "Slots and request rows the scheduler holds on each executor.",
                    [
                        Target(f"model_executor_kv_slots_used{{{SEL}}}", "{{instance}} slots"),
                        Target(
                            f"model_executor_kv_slots_total{{{SEL}}}", "{{instance}} slots total"
                        ),
                        Target(f"model_executor_req_rows_used{{{SEL}}}", "{{instance}} rows"),
                    ],
                ),
            ],
        ),
    ]
    return dashboard(
        "model-executor-overview",
        "Model executor / Overview",
        "Steps, tokens, latency, batches, queue, RPC outcomes and KV cache of model-executor.",
        rows,
    )


def internals() -> dict[str, Any]:
    rows = [
        Row(
            "Input staging",
            [
                Panel(
                    "Fill copies/s by registry",
                    "Tensor copies made to stage batch inputs into registry buffers "
                    "(eager_decode, eager_extend, graph_decode, graph_extend).",
                    [
                        Target(
                            "sum by (registry) "
                            f"(rate(model_executor_fill_copies_total{{{SEL}}}[{RATE}]))",
                            "{{registry}}",
                        )
                    ],
                    unit="ops",
                    width=8,
                    stack=True,
                ),
                Panel(
                    "Fill bytes/s by registry",
                    "Bytes those staging copies moved.",
                    [
                        Target(
                            "sum by (registry) "
                            f"(rate(model_executor_fill_bytes_total{{{SEL}}}[{RATE}]))",
                            "{{registry}}",
                        )
                    ],
                    unit="Bps",
                    width=8,
                    stack=True,
                ),
                Panel(
                    "Fill copies per step by registry",
                    "Staging copies per non-idle step (grouped copies count once per tensor).",
                    [
                        Target(
                            "sum by (registry) "
                            f"(rate(model_executor_fill_copies_total{{{SEL}}}[{RATE}]))"
                            f" / scalar({STEPS})",
                            "{{registry}}",
                        ),
                        Target(
                            "sum by (registry) "
                            f"(rate(model_executor_fill_copy_calls_total{{{SEL}}}[{RATE}]))"
                            f" / scalar({STEPS})",
                            "{{registry}} copy calls",
                        ),
                    ],
                    width=8,
                ),
            ],
        ),
        Row(
            "Host and device transfers",
            [
                Panel(
                    "D2H syncs per step by reason",
                    "Device-to-host copies per non-idle step; expected: one for the sampled "
                    "tokens (their logprobs packed in). The ModelExecutorD2HSyncsPerStepHigh "
                    "alert fires above 2.",
                    [
                        Target(
                            "sum by (reason) "
                            f"(rate(model_executor_d2h_syncs_total{{{SEL}}}[{RATE}]))"
                            f" / scalar({STEPS})",
                            "{{reason}}",
                        )
                    ],
                    threshold=2,
                    stack=True,
                    width=8,
                ),
                Panel(
                    "D2H bytes/s by reason",
                    "Bytes copied from the device to the host.",
                    [
                        Target(
                            f"sum by (reason) (rate(model_executor_d2h_bytes_total{{{SEL}}}[{RATE}]))",
                            "{{reason}}",
                        )
                    ],
                    unit="Bps",
                    stack=True,
                    width=8,
                ),
                Panel(
                    "H2D uploads per step by reason",
                    "Host-to-device uploads per non-idle step: the asynchronous staged copy "
                    "(expected: one) and synchronizing uploads (expected: none; the "
                    "ModelExecutorH2DSyncs alert fires above 0.5).",
                    [
                        Target(
                            "sum by (reason) "
                            f"(rate(model_executor_h2d_copies_total{{{SEL}}}[{RATE}]))"
                            f" / scalar({STEPS})",
                            "{{reason}} (async)",
                        ),
                        Target(
                            "sum by (reason) "
                            f"(rate(model_executor_h2d_syncs_total{{{SEL}}}[{RATE}]))"
                            f" / scalar({STEPS})",
                            "{{reason}} (sync)",
                        ),
                    ],
                    width=8,
                ),
            ],
        ),
        Row(
            "Graphs",
            [
                Panel(
                    "Steps/s by path",
                    "Which execution path ran the steps: graphs (full_graph, piecewise) or "
                    "eager (eager, eager_no_copy).",
                    [
                        Target(
                            "sum by (path) "
                            f"(rate(model_executor_forward_seconds_count{{{SEL}}}[{RATE}]))",
                            "{{path}}",
                        )
                    ],
                    unit="ops",
                    width=12,
                    stack=True,
                ),
                Panel(
                    "Graph fallbacks/s",
                    "Steps that ran eagerly although graph mode was on, by graph kind and "
                    "reason; the ModelExecutorGraphFallbacks alert fires on a sustained rate.",
                    [
                        Target(
                            "sum by (kind, reason) "
                            f"(rate(model_executor_graph_fallbacks_total{{{SEL}}}[{RATE}]))",
                            "{{kind}} {{reason}}",
                        )
                    ],
                    unit="ops",
                    width=12,
                    stack=True,
                ),
                Panel(
                    "Graph captures",
                    "Graphs captured since each executor started, by kind; 'capture "
                    "disabled' is 1 once a poisoned capture stopped capturing for good "
                    "(GetInfo's graph_capture_disabled says why).",
                    [
                        Target(
                            f"sum by (instance, kind) (model_executor_graph_captures_total{{{SEL}}})",
                            "{{instance}} {{kind}}",
                        ),
                        Target(
                            f"max by (instance) (model_executor_graph_capture_disabled{{{SEL}}})",
                            "{{instance}} capture disabled",
                        ),
                    ],
                    width=12,
                ),
                Panel(
                    "Graph capture time",
                    "Seconds spent capturing graphs since start (total, and mean per capture); "
                    "'running' is how long the background capture now running (a CPU server's "
                    "compile or load while it serves) has run: a saturated server runs it only "
                    "in its idle time.",
                    [
                        Target(
                            "max by (instance) "
                            f"(model_executor_graph_capture_running_seconds{{{SEL}}})",
                            "{{instance}} running",
                        ),
                        Target(
                            "sum by (instance, kind) "
                            f"(model_executor_graph_capture_seconds_sum{{{SEL}}})",
                            "{{instance}} {{kind}} total",
                        ),
                        Target(
                            "sum by (instance, kind) "
                            f"(model_executor_graph_capture_seconds_sum{{{SEL}}})"
                            " / sum by (instance, kind) "
                            f"(model_executor_graph_capture_seconds_count{{{SEL}}})",
                            "{{instance}} {{kind}} mean",
                        ),
                    ],
                    unit="s",
                    width=12,
                ),
            ],
        ),
        Row(
            "Overlap and tensor parallelism",
            [
                Panel(
                    "Future-token references resolved per step",
                    "Input ids the device read from the future-token table (overlap "
                    "scheduling: the scheduler sent step N+1 before step N's tokens came back). "
                    "0 for schedulers that do not overlap.",
                    [
                        Target(
                            "sum(rate(model_executor_future_tokens_resolved_total"
                            f"{{{SEL}}}[{RATE}])) / scalar({STEPS})",
                            "references per step",
                        )
                    ],
                    width=12,
                ),
                Panel(
                    "All-reduce share of step time",
                    "Tensor parallelism: the share of rank 0's forward time spent in "
                    "all-reduces, by instance; 0 (no observations) at tp_size 1.",
                    [
                        Target(
                            "sum by (instance) "
                            f"(rate(model_executor_allreduce_seconds_sum{{{SEL}}}[{RATE}]))"
                            " / sum by (instance) "
                            f"(rate(model_executor_forward_seconds_sum{{{SEL}}}[{RATE}]))",
                            "{{instance}}",
                        )
                    ],
                    unit="percentunit",
                    width=12,
                ),
            ],
        ),
        Row(
            "Sampling controls and speculative decoding",
            [
                Panel(
                    "Rows per step using each sampling control",
                    "Rows a sampling control touched per non-idle step, by control (penalties, "
                    "logit_bias, min_tokens, token_ids, vocab_mask). 0 when no request uses one.",
                    [
                        Target(
                            "sum by (control) (rate(model_executor_sampling_control_rows_total"
                            f"{{{SEL}}}[{RATE}])) / scalar({STEPS})",
                            "{{control}}",
                        )
                    ],
                    width=8,
                ),
                Panel(
                    "Draft acceptance rate",
                    "VERIFY steps: drafts accepted over drafts scored. Low means drafting costs "
                    "more than it saves (the scheduler should stop drafting for such requests).",
                    [
                        Target(
                            f"sum(rate(model_executor_accepted_drafts_total{{{SEL}}}[{RATE}]))"
                            f" / sum(rate(model_executor_draft_tokens_total{{{SEL}}}[{RATE}]))",
                            "accepted / drafted",
                        )
                    ],
                    unit="percentunit",
                    width=8,
                ),
                Panel(
                    "Tokens per row per VERIFY step",
                    "Mean tokens a row gained in one VERIFY step (accepted drafts plus the "
                    "bonus token); 1 means no draft was accepted.",
                    [
                        Target(
                            f"sum(rate(model_executor_accepted_length_sum{{{SEL}}}[{RATE}]))"
                            f" / sum(rate(model_executor_accepted_length_count{{{SEL}}}[{RATE}]))",
                            "mean",
                        )
                    ],
                    width=8,
                ),
            ],
        ),
        Row(
            "Retries",
            [
                Panel(
                    "Retries answered from memory/s",
                    "Retried batches whose batch_id the executor had already applied: answered "
                    "with the stored response, not applied again (retry_memory). A steady rate "
                    "means schedulers lose answers (deadlines, disconnects) and resend.",
                    [
                        Target(
                            f"sum(rate(model_executor_batches_replayed_total{{{SEL}}}[{RATE}]))",
                            "replayed",
                        )
                    ],
                    unit="ops",
                    width=24,
                ),
            ],
        ),
        Row(
            "KV data plane",
            [
                Panel(
                    "KV transfer throughput",
                    "K/V bytes per second moved by completed transfers: export (read by a "
                    "scheduler), import (written here), push (sent from here to a peer).",
                    [
                        Target(
                            f"sum by (direction) (rate(model_executor_kv_transfer_bytes_total{{{SEL}}}[{RATE}]))",
                            "{{direction}}",
                        )
                    ],
                    unit="Bps",
                    width=8,
                ),
                Panel(
                    "KV transfers/s",
                    "Transfers by direction and outcome; failed ones (refused, damaged chunk, "
                    "peer unreachable) wrote nothing.",
                    [
                        Target(
                            f"sum by (direction, outcome) (rate(model_executor_kv_transfers_total{{{SEL}}}[{RATE}]))",
                            "{{direction}} {{outcome}}",
                        )
                    ],
                    unit="ops",
                    width=8,
                ),
                Panel(
                    "KV transfer latency",
                    "p50/p95/p99 of one transfer, header to last byte, by direction.",
                    _quantiles("model_executor_kv_transfer_seconds", "direction"),
                    unit="s",
                    width=8,
                ),
            ],
        ),
        Row(
            "Configuration",
            [
                Panel(
                    "eager_input_no_copy",
                    "Runtime toggle: eager steps run on the batch's own tensors (no staging "
                    "copies).",
                    [Target(f"model_executor_toggle_eager_input_no_copy{{{SEL}}}", "{{instance}}")],
                    kind="stat",
                    width=6,
                    mappings=_on_off(),
                ),
                Panel(
                    "needs_cpu_seq_lens",
                    "Runtime toggle (effective value): batches carry host copies of the "
                    "sequence lengths.",
                    [Target(f"model_executor_toggle_needs_cpu_seq_lens{{{SEL}}}", "{{instance}}")],
                    kind="stat",
                    width=6,
                    mappings=_on_off(),
                ),
                Panel(
                    "Graph mode",
                    "Runtime toggle: which batch modes run as graphs (none, decode, extend, both).",
                    [
                        Target(
                            f"model_executor_toggle_graph_mode_info{{{SEL}}} == 1",
                            "{{instance}}: {{mode}}",
                        )
                    ],
                    kind="stat",
                    width=12,
                    text_mode="name",
                ),
                Panel(
                    "Build info",
                    "Version, model, device, dtype and attention backend of each executor.",
                    [
                        Target(
                            f"model_executor_build_info{{{SEL}}}",
                            instant=True,
                            table=True,
                        )
                    ],
                    kind="table",
                    width=24,
                    height=6,
                ),
            ],
        ),
    ]
    return dashboard(
        "model-executor-internals",
        "Model executor / Internals",
        "Input staging copies, device-to-host syncs, graph captures and fallbacks, replayed "
        "retries, toggles and build info of model-executor.",
        rows,
    )


DASHBOARDS = {"overview.json": overview, "internals.json": internals}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2) + "\n"


def main() -> int:
    DASHBOARD_DIR.mkdir(parents=True, exist_ok=True)
    for name in DASHBOARDS:
        (DASHBOARD_DIR / name).write_text(render(name))
        print(f"wrote {DASHBOARD_DIR / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
