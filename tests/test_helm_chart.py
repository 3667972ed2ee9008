"""The Helm chart, rendered and linted by Helm's own engine for the default values and for
ci/all-options-values.yaml: every object valid for Kubernetes, the schema refusing wrong
values, and the rendered configuration being what the executor reads."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from executor.config import ExecutorConfig
from executor.service import settings
from executor.service.server import SERVICE_NAME
from executor.service.server_config import ServerConfig
from tests.helm_render import (
    ALL_OPTIONS,
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    Rendered,
    all_options_values,
    lint,
    render,
    validate,
)
from tests.prometheus_tools import PrometheusBinaries
from tests.promql_sources import RULES

# Settings the chart sets itself from other values (ports, drain, cache, model, the token
# Secret's mount path).
CHART_OWNED = {
    "model",
    "tp_size",  # tensorParallelSize
    "host",
    "port",
    "metrics_port",
    "drain_grace_s",
    "cache_dir",
    "runtime_config_token_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "health_port",
    "call_token_file",  # callToken
    "allowed_client_identities",  # tls.allowedClientIdentities
    "allowed_kv_identities",  # tls.allowedKvIdentities
    "allowed_operator_identities",  # tls.allowedOperatorIdentities
    "kv_transfer",  # kvTransfer.enabled
    "kv_token_file",  # kvTransfer's Secret
    "kv_peers",  # kvTransfer.peers
    "operator_calls_open",  # never: loopback only, and the chart listens on 0.0.0.0
}


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render()


@pytest.fixture(scope="module")
def everything() -> Rendered:
    return render(all_options_values())


def _container(r: Rendered) -> dict[str, Any]:
    [container] = r.one("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _environment(r: Rendered) -> dict[str, str]:
    """What the container's environment holds: the ConfigMap (envFrom), then `env` values."""
    [configmap] = [c for c in r.all("ConfigMap") if "MODEL_EXECUTOR_MODEL" in c.get("data", {})]
    env = dict(configmap["data"])
    env.update({e["name"]: e["value"] for e in _container(r).get("env", []) if "value" in e})
    return env


def test_default_values_render_the_always_on_objects(default: Rendered) -> None:
    assert default.kinds() == sorted(
        ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "PrometheusRule"]
        + ["Service", "ServiceAccount", "ServiceMonitor"]
        + ["ConfigMap", "ConfigMap"]  # the two dashboards
        + ["Secret"]  # the generated call token
    )
    assert "model_executor.v1.ModelExecutor" in default.notes


def test_all_options_render_every_optional_object(everything: Rendered) -> None:
    for kind in ("NetworkPolicy", "HorizontalPodAutoscaler", "Secret", "PodDisruptionBudget"):
        assert everything.all(kind), kind
    assert "replicas" not in everything.one("Deployment")["spec"]  # left to the HPA
    assert len(everything.all("ConfigMap")) == 3


def test_optional_objects_are_behind_their_flags() -> None:
    off = render(
        {
            "serviceAccount": {"create": False},
            "serviceMonitor": {"enabled": False},
            "prometheusRule": {"enabled": False},
            "dashboards": {"enabled": False},
            "podDisruptionBudget": {"enabled": False},
            "networkPolicy": {"enabled": False},
            "callToken": {"enabled": False},
            "allowInsecure": True,
        }
    )
    assert off.kinds() == ["ConfigMap", "Deployment", "Service"]
    assert off.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "default"


@pytest.mark.parametrize("values_file", [None, ALL_OPTIONS], ids=["default", "all-options"])
def test_lint_is_clean(values_file: Path | None) -> None:
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = lint(values)
    assert report["errors"] == []
    # Only the informational "icon is recommended": no icon URL to point at.
    assert [(m["severity"], m["error"]) for m in report["messages"]] == [(1, "icon is recommended")]


@pytest.mark.slow
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_validates(
    default: Rendered, everything: Rendered, kube_version: str
) -> None:
    for rendered in (default, everything):
        for obj in rendered.objects:
            validate(obj, kube_version)


@pytest.mark.slow
def test_validation_is_strict(default: Rendered) -> None:
    """The validator is not vacuous: an unknown or mistyped field fails."""
    deployment = json.loads(json.dumps(default.one("Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["srvice"] = ""
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBE_VERSIONS[0])
    monitor = json.loads(json.dumps(default.one("ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, KUBE_VERSIONS[0])
    rule = json.loads(json.dumps(default.one("PrometheusRule")))
    rule["metadata"]["labels"]["bad"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(rule, KUBE_VERSIONS[0])


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicaCount": -1}, "/replicaCount"),
        ({"replicas": 2}, "additional properties 'replicas'"),  # a typo of replicaCount
        ({"config": {"kv_slots": "lots"}}, "/config/kv_slots"),
        ({"config": {"kv_slot": 5}}, "additional properties 'kv_slot'"),
        ({"config": {"log_level": "verbose"}}, "/config/log_level"),
        ({"ports": {"grpc": 70000, "metrics": 9464}}, "/ports/grpc"),
        ({"gpu": {"count": 1.5, "resourceName": "nvidia.com/gpu"}}, "/gpu/count"),
        ({"serviceMonitor": {"interval": "15 seconds"}}, "/serviceMonitor/interval"),
        ({"prometheusRule": {"disabledAlerts": ["ModelExecutorDwn"]}}, "/disabledAlerts"),
        (
            {"model": {"spec": "x", "volume": {"enabled": True, "type": "pvc"}}},
            "/model/volume/claimName",
        ),
        ({"runtimeConfigToken": {"token": 5}}, "/runtimeConfigToken/token"),
        ({"kvTransfer": {"peers": "a:1"}}, "/kvTransfer/peers"),
        ({"tls": {"enabled": True}}, "/tls/secretName"),
        ({"cache": {"mountPath": "cache"}}, "/cache/mountPath"),
        ({"drain": {"graceSeconds": "30s"}}, "/drain/graceSeconds"),
    ],
)
def test_schema_refuses_wrong_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=complaint):
        render(values)


def test_schema_describes_every_value_and_accepts_the_defaults() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], path: str) -> None:
        for key, prop in node.get("properties", {}).items():
            assert prop.get("description"), f"{path}{key} has no description"
            walk(prop, f"{path}{key}.")

    walk(schema, "")
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(None)
        chart.validate_schema(all_options_values())


def test_disabled_alerts_enum_is_the_rules_files_alerts() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["prometheusRule"]["properties"]["disabledAlerts"]["items"]["enum"]
    doc = yaml.safe_load(RULES.read_text())
    assert enum == [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _json_type(field: dataclasses.Field[Any]) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[type(field.default)]


def test_every_executor_setting_is_a_typed_chart_value() -> None:
    """config.* in the schema are exactly the settings the chart does not own, same types."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]["properties"]
    fields = {f.name: f for cls in (ExecutorConfig, ServerConfig) for f in dataclasses.fields(cls)}
    assert set(config) == set(fields) - CHART_OWNED
    for name, prop in config.items():
        assert prop["type"] == _json_type(fields[name]), name


def test_rendered_environment_is_the_configuration_the_executor_reads(everything: Rendered) -> None:
    values = all_options_values()
    env = _environment(everything)
    executor_cfg = settings.build(ExecutorConfig, env=env)
    server_cfg = settings.build(ServerConfig, env=env)
    for key, value in values["config"].items():
        cfg = executor_cfg if hasattr(executor_cfg, key) else server_cfg
        assert getattr(cfg, key) == value, key
    assert executor_cfg.model == values["model"]["spec"]
    assert executor_cfg.cache_dir.startswith(values["cache"]["mountPath"] + "/")
    assert (server_cfg.host, server_cfg.port) == ("0.0.0.0", values["ports"]["grpc"])
    assert server_cfg.drain_grace_s == values["drain"]["graceSeconds"]
    fields = {
        settings.env_name(f.name)
        for cls in (ExecutorConfig, ServerConfig)
        for f in dataclasses.fields(cls)
    }
    ours = {k for k in env if k.startswith(settings.ENV_PREFIX)}
    assert ours - fields == set()  # every variable the chart sets is a setting the executor reads
    assert env["MODEL_EXECUTOR_METRICS_PORT"] == str(values["ports"]["metrics"])


def test_default_environment_keeps_the_executors_defaults(default: Rendered) -> None:
    env = _environment(default)
    cfg = settings.build(ExecutorConfig, env=env)
    # but the device: a GPU pod (gpu.count 1) runs on cuda, never `auto`'s CPU fallback
    assert cfg.device == "cuda"
    assert cfg.replace(model="smollm2", cache_dir="", device="auto") == ExecutorConfig()
    assert settings.build(ServerConfig, env=env).drain_grace_s == 30.0


@pytest.mark.parametrize("which", ["default", "everything"])
def test_deployment_probes_drain_and_security(
    which: str, default: Rendered, everything: Rendered
) -> None:
    rendered, values = (default, {}) if which == "default" else (everything, all_options_values())
    with helm.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    c = _container(rendered)
    grpc_port = merged["ports"]["grpc"]
    # The probes ask the health-only port: its own threads (the data plane cannot starve it),
    # plaintext (kubelet probes cannot do TLS).
    probe_port = merged["ports"]["health"]
    assert merged["tls"]["enabled"] is (which == "everything")
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": probe_port, "service": SERVICE_NAME}
    assert c["livenessProbe"]["grpc"] == {"port": probe_port, "service": ""}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # load + capture
    drain = merged["drain"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == [
        "sleep",
        str(drain["preStopSleepSeconds"]),
    ]
    assert (
        pod["terminationGracePeriodSeconds"] > drain["preStopSleepSeconds"] + drain["graceSeconds"]
    )
    assert _environment(rendered)["MODEL_EXECUTOR_DRAIN_GRACE_S"] == str(drain["graceSeconds"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["cache"] and "emptyDir" in volumes["tmp"]
    assert _environment(rendered)["MODEL_EXECUTOR_CACHE_DIR"].startswith(
        mounts["cache"]["mountPath"] + "/"
    )
    tp = merged["tensorParallelSize"]
    assert tp == (4 if which == "everything" else 1)
    # tensorParallelSize sets the GPUs (never fewer than gpu.count), the flag and /dev/shm.
    gpus = c["resources"]["limits"][merged["gpu"]["resourceName"]]
    assert gpus == max(merged["gpu"]["count"], tp)
    assert _environment(rendered)["MODEL_EXECUTOR_TP_SIZE"] == str(tp)
    assert settings.build(ExecutorConfig, env=_environment(rendered)).tp_size == tp
    assert ("shm" in volumes) is (tp > 1) and ("shm" in mounts) is (tp > 1)
    if tp > 1:
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
        assert mounts["shm"]["mountPath"] == "/dev/shm"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": grpc_port,
        "metrics": merged["ports"]["metrics"],
        "health": probe_port,
    }
    assert (
        "checksum/config"
        in rendered.one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    )


def test_all_options_mount_the_model_and_the_token(everything: Rendered) -> None:
    values = all_options_values()
    pod = everything.one("Deployment")["spec"]["template"]["spec"]
    c = _container(everything)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llm-models"
    assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
    [secret] = [s for s in everything.all("Secret") if "runtime-config" in s["metadata"]["name"]]
    assert volumes["runtime-config-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    token_file = _environment(everything)["MODEL_EXECUTOR_RUNTIME_CONFIG_TOKEN_FILE"]
    assert token_file == mounts["runtime-config-token"]["mountPath"] + "/bearer"
    assert set(secret["data"]) == {values["runtimeConfigToken"]["secretKey"]}
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["runtimeClassName"] == "nvidia"
    assert everything.one("Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_tls_mounts_the_secrets_and_points_the_executor_at_them(
    default: Rendered, everything: Rendered
) -> None:
    values = all_options_values()
    pod = everything.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in _container(everything)["volumeMounts"]}
    assert volumes["tls"]["secret"]["secretName"] == values["tls"]["secretName"]
    assert volumes["tls-client-ca"]["secret"]["secretName"] == values["tls"]["clientCASecret"]
    assert all("subPath" not in mounts[n] for n in ("tls", "tls-client-ca"))  # rotation reaches
    server_cfg = settings.build(ServerConfig, env=_environment(everything))
    assert server_cfg.tls_cert_file == mounts["tls"]["mountPath"] + "/tls.crt"
    assert server_cfg.tls_key_file == mounts["tls"]["mountPath"] + "/tls.key"
    assert server_cfg.tls_client_ca_file == mounts["tls-client-ca"]["mountPath"] + "/bundle.pem"
    assert server_cfg.health_port == values["ports"]["health"]
    assert server_cfg.tls is not None and server_cfg.tls.mutual
    # By default: plaintext, the health port on (the probes' own server), no TLS volumes.
    default_cfg = settings.build(ServerConfig, env=_environment(default))
    assert default_cfg.tls is None and default_cfg.health_port == 8081
    assert "tls" not in {
        v["name"] for v in default.one("Deployment")["spec"]["template"]["spec"]["volumes"]
    }
    # Without a client CA: TLS only.
    r = render({"tls": {"enabled": True, "secretName": "executor-tls"}})
    cfg = settings.build(ServerConfig, env=_environment(r))
    assert cfg.tls is not None and not cfg.tls.mutual


def test_identity_settings_reach_the_executor(default: Rendered, everything: Rendered) -> None:
    """The allowlist and the call token (a Secret, mounted) become the executor's settings;
    by default neither is set and the NetworkPolicy is on."""
    values = all_options_values()
    pod = everything.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in _container(everything)["volumeMounts"]}
    [secret] = [s for s in everything.all("Secret") if s["metadata"]["name"].endswith("call-token")]
    assert set(secret["data"]) == {values["callToken"]["secretKey"]}
    assert volumes["call-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    cfg = settings.build(ServerConfig, env=_environment(everything))
    assert cfg.call_token_file == mounts["call-token"]["mountPath"] + "/call"
    assert cfg.allowed_client_identities.split(",") == values["tls"]["allowedClientIdentities"]
    assert cfg.refusal_log_interval_s == values["config"]["refusal_log_interval_s"]
    default_cfg = settings.build(ServerConfig, env=_environment(default))
    assert default_cfg.call_token_file.endswith("/token")  # a generated one, see below
    assert default_cfg.allowed_client_identities == ""
    assert default.all("NetworkPolicy")
    # An allowlist without mTLS would check nothing: the chart refuses to render it.
    with pytest.raises(Exception, match="allowedClientIdentities needs mTLS"):
        render({"tls": {"enabled": True, "secretName": "t", "allowedClientIdentities": ["s"]}})


def test_host_path_model_an_existing_token_secret_and_a_cpu_pod() -> None:
    r = render(
        {
            "model": {
                "spec": "/models/model.gguf",
                "volume": {"enabled": True, "type": "hostPath", "hostPath": "/srv/models"},
            },
            "runtimeConfigToken": {"enabled": True, "existingSecret": "executor-token"},
            "callToken": {"enabled": True, "existingSecret": "scheduler-token"},
            "gpu": {"count": 0, "resourceName": "nvidia.com/gpu"},
            "tolerations": [],
        }
    )
    pod = r.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    assert volumes["runtime-config-token"]["secret"]["secretName"] == "executor-token"
    assert not r.all("Secret")  # the existing one is used
    assert "nvidia.com/gpu" not in _container(r)["resources"]["limits"]
    assert "MODEL_EXECUTOR_DEVICE" not in _environment(r)  # a CPU pod keeps `auto`
    assert "tolerations" not in pod
    for obj in r.objects:
        validate(obj, KUBE_VERSIONS[0])


def test_a_gpu_pod_runs_on_cuda_or_fails_start_up(default: Rendered, everything: Rendered) -> None:
    """`auto` would serve on the CPU where the pod cannot see its GPU: a GPU pod names cuda,
    and the executor refuses to start (never ready) without one."""
    env = _environment(default)
    assert env["MODEL_EXECUTOR_DEVICE"] == "cuda"
    assert settings.build(ExecutorConfig, env=env).device == "cuda"
    assert _environment(everything)["MODEL_EXECUTOR_DEVICE"] == "cuda:0"  # the configured one
    for device in ("auto", "cpu"):
        with pytest.raises(Exception, match=f'config.device "{device}" with gpu.count 1'):
            render({"config": {"device": device}})


def test_service_and_service_monitor_agree(default: Rendered, everything: Rendered) -> None:
    for r in (default, everything):
        service = r.one("Service")
        monitor = r.one("ServiceMonitor")
        assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items()
        )
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        # The alerts select job="model-executor": the last relabeling sets it.
        assert endpoint["relabelings"][-1] == {
            "action": "replace",
            "targetLabel": "job",
            "replacement": "model-executor",
        }
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert everything.one("Service")["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in default.one("Service")["spec"]


def test_network_policy_lets_only_the_scheduler_peers_and_prometheus_in(
    default: Rendered, everything: Rendered
) -> None:
    with helm.Chart.load(CHART) as chart:  # the default label stays unless set to null
        values = chart.merge_values(all_options_values())["networkPolicy"]
    assert values["scheduler"]["podSelector"]["matchLabels"]["model-executor.io/client"] == "true"
    policy = everything.one("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    scheduler, peers, prometheus = policy["ingress"]
    for rule, port in ((scheduler, "grpc"), (peers, "grpc"), (prometheus, "metrics")):
        assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
    for rule, who in ((scheduler, "scheduler"), (prometheus, "prometheus")):
        assert rule["from"] == [
            {
                "namespaceSelector": values[who]["namespaceSelector"],
                "podSelector": values[who]["podSelector"],
            }
        ]
    # peer executors: this release's pods, and the listed other executors
    own = {"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}
    assert peers["from"] == [own, *values["kvPeers"]]
    dns, pushes, otlp = policy["egress"]
    assert dns["to"] == [values["egress"]["dns"]] and {p["port"] for p in dns["ports"]} == {53}
    assert pushes["to"] == [own, *values["kvPeers"]]
    assert pushes["ports"] == [{"port": 6000, "protocol": "TCP"}]
    assert otlp == values["egress"]["extraTo"][0]
    # by default: a labelled scheduler pod (not every pod of its namespace), DNS out, no peers
    spec = default.one("NetworkPolicy")["spec"]
    assert spec["ingress"][0]["from"][0]["podSelector"] == {
        "matchLabels": {"model-executor.io/client": "true"}
    }
    assert len(spec["ingress"]) == 2 and len(spec["egress"]) == 1


def test_the_default_install_has_a_generated_call_token_and_refuses_none(
    default: Rendered,
) -> None:
    """Safe by default: a call token the chart generates (kept on upgrades: the Secret it
    finds), mounted for the executor; a render with no token and no TLS fails."""
    [secret] = default.all("Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert render().one("Secret")["data"]["token"] != secret["data"]["token"]  # random
    cfg = settings.build(ServerConfig, env=_environment(default))
    mounts = {m["name"]: m for m in _container(default)["volumeMounts"]}
    assert cfg.call_token_file == mounts["call-token"]["mountPath"] + "/token"
    assert not cfg.kv_transfer and cfg.kv_token_file == ""  # the KV plane stays off
    with pytest.raises(Exception, match="neither callToken nor tls"):
        render({"callToken": {"enabled": False}})
    assert render({"callToken": {"enabled": False}, "tls": {"enabled": True, "secretName": "t"}})
    assert "Secret" not in render({"callToken": {"enabled": False}, "allowInsecure": True}).kinds()


def test_a_changed_token_rolls_the_pods() -> None:
    def checksum(values: dict[str, Any]) -> str:
        annotations = render(values).one("Deployment")["spec"]["template"]["metadata"]
        return str(annotations["annotations"]["checksum/secrets"])

    base = checksum({})
    assert checksum({}) == base  # a generated token is not in it: no roll on every upgrade
    assert checksum({"callToken": {"token": "a-token-set-in-the-values"}}) != base
    assert checksum({"callToken": {"existingSecret": "another"}}) != base
    assert checksum({"kvTransfer": {"enabled": True}}) != base


def test_the_kv_plane_with_its_own_token_and_peers(everything: Rendered) -> None:
    values = all_options_values()
    cfg = settings.build(ServerConfig, env=_environment(everything))
    mounts = {m["name"]: m for m in _container(everything)["volumeMounts"]}
    pod = everything.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [secret] = [s for s in everything.all("Secret") if s["metadata"]["name"].endswith("kv-token")]
    assert base64.b64decode(secret["data"]["kv"]).decode() == values["kvTransfer"]["token"]
    assert volumes["kv-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert cfg.kv_transfer and cfg.kv_token_file == mounts["kv-token"]["mountPath"] + "/kv"
    assert cfg.kv_peers.split(",") == values["kvTransfer"]["peers"]
    assert cfg.allowed_kv_identities.split(",") == values["tls"]["allowedKvIdentities"]
    assert cfg.allowed_operator_identities.split(",") == values["tls"]["allowedOperatorIdentities"]
    with pytest.raises(Exception, match="clientCASecret"):
        render(
            {
                "tls": {"enabled": True, "secretName": "t"},
                "kvTransfer": {"enabled": True, "peers": ["a:1"]},
            }
        )


def test_gpu_visibility_is_only_what_the_gpu_request_grants(default: Rendered) -> None:
    """No GPU asked for: NVIDIA_VISIBLE_DEVICES=void (the image says all) and no GPU
    toleration; asked for: the device plugin's grant, which extraEnv may not override."""
    cpu = render({"gpu": {"count": 0, "resourceName": "nvidia.com/gpu"}})
    pod = cpu.one("Deployment")["spec"]["template"]["spec"]
    assert _environment(cpu)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "tolerations" not in pod
    gpu_pod = default.one("Deployment")["spec"]["template"]["spec"]
    assert "NVIDIA_VISIBLE_DEVICES" not in _environment(default)
    assert gpu_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    other = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    kept = render({"gpu": {"count": 0, "resourceName": "nvidia.com/gpu"}, "tolerations": [other]})
    assert kept.one("Deployment")["spec"]["template"]["spec"]["tolerations"] == [other]
    with pytest.raises(Exception, match="NVIDIA_VISIBLE_DEVICES"):
        render({"extraEnv": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})


def test_dashboards_ship_as_labelled_configmaps(default: Rendered, everything: Rendered) -> None:
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    for r, labels, namespace in (
        (default, {"grafana_dashboard": "1"}, None),
        (everything, {"grafana_dashboard": "llm"}, "monitoring"),
    ):
        maps = [c for c in r.all("ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
        shipped = {k: v for c in maps for k, v in c["data"].items()}
        assert {k: v.rstrip("\n") for k, v in shipped.items()} == {
            k: v.rstrip("\n") for k, v in files.items()
        }
        for c in maps:
            assert labels.items() <= c["metadata"]["labels"].items()
            assert c["metadata"].get("namespace") == namespace


def test_prometheus_rule_is_the_rules_file(default: Rendered) -> None:
    assert default.one("PrometheusRule")["spec"] == yaml.safe_load(RULES.read_text())


def test_prometheus_rule_values(everything: Rendered) -> None:
    groups = everything.one("PrometheusRule")["spec"]["groups"]
    rules = {(g["name"], r.get("alert") or r["record"]): r for g in groups for r in g["rules"]}
    assert ("model-executor.latency", "ModelExecutorDecodeLatencyHigh") not in rules
    assert ("model-executor.extra", "ModelExecutorDecodeLatencyHigh") in rules
    down = rules[("model-executor.availability", "ModelExecutorDown")]
    assert down["labels"] == {"severity": "critical", "team": "llm-serving"}
    assert down["annotations"]["runbook_url"] == (
        "https://runbooks.example.com/model-executor/runbook.html#modelexecutordown"
    )


def test_rendered_prometheus_rules_pass_promtool(
    everything: Rendered, prometheus_binaries: PrometheusBinaries, tmp_path: Path
) -> None:
    path = tmp_path / "rendered.rules.yml"
    path.write_text(yaml.safe_dump(everything.one("PrometheusRule")["spec"]))
    result = subprocess.run(
        [prometheus_binaries.promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_values_table_is_current() -> None:
    spec = importlib.util.spec_from_file_location(
        "values_table", CHART.parent / "tools" / "values_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    readme = (CHART / "README.md").read_text()
    assert readme == module.readme_with_table(readme), "run python helm/tools/values_table.py"


def test_the_cache_can_be_a_persistent_volume_claim() -> None:
    """Compiled code (the qmm kernel, inductor's caches) outlives the pod on a named claim."""
    volumes = {
        v["name"]: v
        for v in render({"cache": {"mountPath": "/cache", "existingClaim": "executor-cache"}}).one(
            "Deployment"
        )["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["cache"] == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": "executor-cache"},
    }


def test_image_by_digest(default: Rendered, everything: Rendered) -> None:
    values = all_options_values()["image"]
    assert _container(everything)["image"] == f"{values['repository']}@{values['digest']}"
    assert _container(default)["image"].endswith(":0.1.0") or ":" in _container(default)["image"]
    assert "@" not in _container(default)["image"]  # by tag when no digest is given
    with pytest.raises(Exception, match="digest"):
        render({"image": {"repository": "r", "digest": "latest"}})
