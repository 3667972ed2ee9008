"""The metric names and labels dashboards and alerts may use: issue 7's contract.

Until the metrics module exists this list is the contract as issue 7 writes it (plus the
toggle gauges named for the chart); once it does, a test should compare the two, so a
renamed metric fails here and not in a dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from executor.config import GRAPH_MODES


@dataclass(frozen=True)
class MetricSpec:
    kind: str  # counter | gauge | histogram
    labels: frozenset[str] = frozenset()


def _m(kind: str, *labels: str) -> MetricSpec:
    return MetricSpec(kind, frozenset(labels))


CONTRACT: dict[str, MetricSpec] = {
    "model_executor_forward_seconds": _m("histogram", "path", "mode"),
    "model_executor_queue_wait_seconds": _m("histogram"),
    "model_executor_rpc_seconds": _m("histogram", "method"),
    "model_executor_requests_total": _m("counter", "method", "code"),
    "model_executor_batches_replayed_total": _m("counter"),
    "model_executor_kv_transfer_bytes_total": _m("counter", "direction"),
    "model_executor_kv_transfers_total": _m("counter", "direction", "outcome"),
    "model_executor_kv_transfer_seconds": _m("histogram", "direction"),
    "model_executor_fill_copies_total": _m("counter", "registry"),
    "model_executor_fill_bytes_total": _m("counter", "registry"),
    "model_executor_fill_copy_calls_total": _m("counter", "registry"),
    "model_executor_d2h_syncs_total": _m("counter", "reason"),
    "model_executor_d2h_bytes_total": _m("counter", "reason"),
    "model_executor_h2d_syncs_total": _m("counter", "reason"),
    "model_executor_h2d_copies_total": _m("counter", "reason"),
    "model_executor_batch_size": _m("histogram", "mode"),
    "model_executor_padded_batch_size": _m("histogram", "path"),
    "model_executor_padding_tokens_total": _m("counter", "path"),
    "model_executor_tokens_total": _m("counter", "mode"),
    "model_executor_future_tokens_resolved_total": _m("counter"),
    "model_executor_sampling_control_rows_total": _m("counter", "control"),
    "model_executor_draft_tokens_total": _m("counter"),
    "model_executor_accepted_drafts_total": _m("counter"),
    "model_executor_accepted_length": _m("histogram"),
    "model_executor_graph_captures_total": _m("counter", "kind"),
    "model_executor_graph_capture_seconds": _m("histogram", "kind"),
    "model_executor_graph_fallbacks_total": _m("counter", "kind", "reason"),
    "model_executor_graph_capture_disabled": _m("gauge"),
    "model_executor_graph_capture_running_seconds": _m("gauge"),
    "model_executor_kv_slots_used": _m("gauge"),
    "model_executor_kv_slots_total": _m("gauge"),
    "model_executor_req_rows_used": _m("gauge"),
    "model_executor_queue_depth": _m("gauge"),
    "model_executor_forward_occupancy": _m("gauge"),
    "model_executor_device_idle_seconds_total": _m("counter"),
    "model_executor_ready": _m("gauge"),
    "model_executor_toggle_eager_input_no_copy": _m("gauge"),
    "model_executor_toggle_needs_cpu_seq_lens": _m("gauge"),
    "model_executor_toggle_graph_mode_info": _m("gauge", "mode"),
    "model_executor_build_info": _m(
        "gauge",
        "version",
        "model",
        "device",
        "dtype",
        "attention_backend",
        "quantization",
        "linear_kernel",
        "tp_size",
        "rank",
    ),
    "model_executor_allreduce_seconds": _m("histogram", "rank"),
}

# Series Prometheus itself makes (`up`) and labels its service discovery attaches to every
# scraped series (static configs: job and instance; the operator adds the rest).
SYNTHETIC: dict[str, MetricSpec] = {"up": _m("gauge")}
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
)

# Closed label value sets: a selector that names another value is a typo.
LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {}
_PATHS = frozenset({"eager", "eager_no_copy", "full_graph", "piecewise"})
_MODES = frozenset({"decode", "extend", "idle"})
_REGISTRIES = frozenset({"eager_decode", "eager_extend", "graph_decode", "graph_extend"})
_CODES = frozenset(code.name for code in grpc.StatusCode)
for _name, _spec in CONTRACT.items():
    if _name == "model_executor_toggle_graph_mode_info":
        # The config's spelling (executor/config.py); the alert also matches other cases.
        LABEL_VALUES[(_name, "mode")] = frozenset(GRAPH_MODES)
        continue
    for _label, _values in (
        ("path", _PATHS),
        ("mode", _MODES),
        ("registry", _REGISTRIES),
        ("code", _CODES),
    ):
        if _label in _spec.labels:
            LABEL_VALUES[(_name, _label)] = _values


def series_names(name: str, spec: MetricSpec) -> dict[str, frozenset[str]]:
    """The series names a metric family exposes, with the labels each may carry."""
    if spec.kind == "histogram":
        return {
            f"{name}_bucket": spec.labels | {"le"},
            f"{name}_sum": spec.labels,
            f"{name}_count": spec.labels,
        }
    return {name: spec.labels}


def allowed_series() -> dict[str, tuple[str, frozenset[str]]]:
    """Every series name a query may select -> (its family, the labels it may carry)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family, spec in {**CONTRACT, **SYNTHETIC}.items():
        for series, labels in series_names(family, spec).items():
            out[series] = (family, labels | TARGET_LABELS)
    return out
