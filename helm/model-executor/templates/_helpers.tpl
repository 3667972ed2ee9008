{{/* Names and labels shared by every object. */}}

{{- define "model-executor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "model-executor.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "model-executor.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "model-executor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "model-executor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "model-executor.labels" -}}
helm.sh/chart: {{ include "model-executor.chart" . }}
{{ include "model-executor.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: model-executor
{{- end }}

{{- define "model-executor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "model-executor.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: repository@digest when image.digest is set (the exact bytes that were
reviewed and scanned; the tag is then ignored), else repository:tag.
*/}}
{{- define "model-executor.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{- define "model-executor.tokenSecretName" -}}
{{- default (printf "%s-runtime-config-token" (include "model-executor.fullname" .)) .Values.runtimeConfigToken.existingSecret }}
{{- end }}

{{/*
The readiness service name of grpc.health.v1 (executor/service/server.py SERVICE_NAME): SERVING once
the model is loaded and warmed up, NOT_SERVING while loading and draining.
*/}}
{{- define "model-executor.readinessService" -}}
model_executor.v1.ModelExecutor
{{- end }}

{{- define "model-executor.callTokenSecretName" -}}
{{- default (printf "%s-call-token" (include "model-executor.fullname" .)) .Values.callToken.existingSecret }}
{{- end }}

{{/* Where the call token file is mounted. */}}
{{- define "model-executor.callTokenDir" -}}
/var/run/secrets/model-executor-call
{{- end }}

{{/* Where the runtime-config token file is mounted. */}}
{{- define "model-executor.tokenDir" -}}
/var/run/secrets/model-executor
{{- end }}

{{/*
A value as an environment string: numbers through toJson, so 1000000 stays 1000000 (not
1e+06, which the executor would refuse); booleans as true/false.
*/}}
{{- define "model-executor.envValue" -}}
{{- if kindIs "string" . }}{{ . | quote }}{{ else }}{{ . | toJson | quote }}{{ end }}
{{- end }}

{{/* Where the TLS Secrets are mounted (the server certificate, and the client CA for mTLS). */}}
{{- define "model-executor.tlsDir" -}}
/var/run/secrets/model-executor-tls
{{- end }}

{{- define "model-executor.clientCADir" -}}
/var/run/secrets/model-executor-client-ca
{{- end }}

{{/* The port the kubelet's gRPC probes use: the health-only server's, always. It has its
own threads, so no data-plane call can starve a probe, and it is plaintext (kubelet probes
cannot do TLS). */}}
{{- define "model-executor.probePort" -}}
{{ .Values.ports.health }}
{{- end }}

{{- define "model-executor.kvTokenSecretName" -}}
{{- default (printf "%s-kv-token" (include "model-executor.fullname" .)) .Values.kvTransfer.existingSecret }}
{{- end }}

{{/* Where the KV data plane's token file is mounted. */}}
{{- define "model-executor.kvTokenDir" -}}
/var/run/secrets/model-executor-kv
{{- end }}

{{/*
A token for a Secret the chart creates: the one in the values, else the one the Secret already
holds (an upgrade keeps a generated token), else a new random one.
Call with (dict "root" . "secret" NAME "key" KEY "token" VALUE).
*/}}
{{- define "model-executor.secretToken" -}}
{{- if .token -}}
{{ .token }}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret | default dict -}}
{{- $kept := dig "data" .key "" $existing | b64dec -}}
{{- $kept | default (randAlphaNum 48) -}}
{{- end -}}
{{- end }}

{{/*
What the chart's token Secrets are made from: the pods roll when it changes (a token set in the
values, a Secret swapped for another). A generated token is kept across upgrades, and the
executor re-reads a token file the kubelet rewrites, so neither needs a roll.
*/}}
{{- define "model-executor.secretsChecksum" -}}
{{- $inputs := dict "runtimeConfig" .Values.runtimeConfigToken "call" .Values.callToken "kv" (omit .Values.kvTransfer "peers") -}}
{{- toJson $inputs | sha256sum -}}
{{- end }}
