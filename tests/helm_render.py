"""Render and lint the chart with Helm's own engine (helm-python-sdk: Helm's Go SDK through a
C library; no helm binary, no cluster), and validate what it renders.

Built-in kinds are validated with kubernetes-validate (the Kubernetes OpenAPI schemas, strict:
unknown fields are errors). The prometheus-operator kinds (ServiceMonitor, PrometheusRule)
are CRDs those schemas do not cover: their metadata is validated as Kubernetes ObjectMeta
(strict) and their spec against CRD_SPEC_SCHEMAS below, a strict subset of the
monitoring.coreos.com/v1 API covering the fields this chart writes; the PrometheusRule's
rules are further checked by promtool (tests/test_helm_chart.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "model-executor"
ALL_OPTIONS = CHART / "ci" / "all-options-values.yaml"
RELEASE = "llm"
NAMESPACE = "serving"
# The newest Kubernetes the installed schemas describe, and the oldest the chart supports.
KUBE_VERSIONS = (kubernetes_validate.utils.latest_version(), "1.27.0")


@dataclass
class Rendered:
    objects: list[dict[str, Any]]
    notes: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.all(kind)
        assert len(found) == 1, f"{len(found)} objects of kind {kind}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)


def all_options_values() -> dict[str, Any]:
    return dict(yaml.safe_load(ALL_OPTIONS.read_text()))


def render(values: dict[str, Any] | None = None) -> Rendered:
    """Render like `helm install`; raises helm.HelmValuesError when values.schema.json refuses."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(objects, notes)


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")


_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {
            "enum": [
                "replace",
                "keep",
                "drop",
                "hashmod",
                "labelmap",
                "labeldrop",
                "labelkeep",
                "lowercase",
                "uppercase",
                "keepequal",
                "dropequal",
            ]
        },
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
    },
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string", "minLength": 1},
        "record": {"type": "string", "minLength": 1},
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
CRD_SPEC_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "endpoints"],
        "properties": {
            "jobLabel": {"type": "string"},
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "rules": {"type": "array", "items": _RULE},
                    },
                },
            }
        },
    },
}


def validate(obj: dict[str, Any], kube_version: str) -> None:
    """Raise jsonschema.ValidationError (or a subclass) if `obj` is not a valid object."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SPEC_SCHEMAS:
        # ObjectMeta through a ConfigMap, the simplest built-in kind that carries it.
        carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
        kubernetes_validate.validate(carrier, kube_version, strict=True)
        extra = set(obj) - {"apiVersion", "kind", "metadata", "spec"}
        if extra:
            raise jsonschema.ValidationError(f"unknown top-level fields {sorted(extra)}")
        jsonschema.Draft202012Validator(CRD_SPEC_SCHEMAS[key]).validate(obj["spec"])
        return
    kubernetes_validate.validate(obj, kube_version, strict=True)
