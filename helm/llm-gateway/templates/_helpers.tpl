{{- define "llm-gateway.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "llm-gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/part-of: llm-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "llm-gateway.selector" -}}
app.kubernetes.io/name: llm-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector of one backend deployment: (dict "root" $ "name" "vllm"), and with "role" "prefill"
     one role's pods of a disaggregated backend (llm-d's label) */}}
{{- define "llm-gateway.backendSelector" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .role }}
llm-d.ai/role: {{ . }}
{{- end }}
{{- end -}}

{{- define "llm-gateway.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-keys" (include "llm-gateway.fullname" .)) -}}
{{- end -}}

{{/* An environment variable name for an API key: LLMGW_KEY_TEAM_A */}}
{{- define "llm-gateway.keyEnv" -}}
{{- printf "LLMGW_KEY_%s" (regexReplaceAll "[^A-Z0-9]" (upper .) "_") -}}
{{- end -}}

{{/* A TOML value from a YAML value: strings and scalars as JSON (valid TOML), lists as arrays,
     maps as inline tables. */}}
{{- define "llm-gateway.toml" -}}
{{- if kindIs "map" . -}}
{ {{- $first := true -}}{{- range $k, $v := . -}}{{- if not $first }}, {{ end -}}{{ $first = false -}}{{ $k }} = {{ include "llm-gateway.toml" $v }}{{- end -}} }
{{- else if kindIs "slice" . -}}
[{{- range $i, $v := . -}}{{- if $i }}, {{ end -}}{{ include "llm-gateway.toml" $v }}{{- end -}}]
{{- else if kindIs "float64" . -}}
{{- if eq (float64 (int64 .)) . }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else -}}
{{- toJson . -}}
{{- end -}}
{{- end -}}

{{/* `key = value` lines of a TOML table from a map */}}
{{- define "llm-gateway.tomlTable" -}}
{{- range $k, $v := . }}
{{ $k }} = {{ include "llm-gateway.toml" $v }}
{{- end -}}
{{- end -}}

{{/* The rendered config.toml */}}
{{- define "llm-gateway.configToml" -}}
{{- if .Values.configToml -}}
{{ .Values.configToml }}
{{- else -}}
{{- $c := .Values.config -}}
{{- $full := include "llm-gateway.fullname" . -}}
# rendered by the llm-gateway Helm chart {{ .Chart.Version }}
{{- with $c.defaultModel }}
default_model = {{ . | toJson }}
{{- end }}

[server]
host = "0.0.0.0"
port = {{ .Values.port }}
watch_config = {{ eq .Values.reloadStrategy "watch" }}
drain_timeout = {{ .Values.drainSeconds }}
{{- if .Values.auth.adminKey }}
admin_key_env = "LLMGW_ADMIN_KEY"
{{- end }}
{{- include "llm-gateway.tomlTable" (omit $c.server "host" "port" "watch_config" "drain_timeout") }}

[auth]
protect_metrics = {{ .Values.auth.protectMetrics }}
protect_health = {{ .Values.auth.protectHealth }}
{{- range .Values.auth.keys }}

[[auth.keys]]
name = {{ .name | toJson }}
key_env = {{ include "llm-gateway.keyEnv" .name | toJson }}
{{- include "llm-gateway.tomlTable" (omit . "name" "value" "existingSecret" "existingSecretKey") }}
{{- end }}
{{- with .Values.state }}{{ if .enabled }}

[state]
{{- /* the URLs (with their passwords) reach the pods as environment variables, never the ConfigMap */}}
database_env = "LLMGW_STATE_DATABASE"
{{- if include "llm-gateway.stateRedis" $ }}
redis_env = "LLMGW_STATE_REDIS"
{{- end }}
fail_open = {{ .failOpen }}
{{- /* the hook Job migrates before the pods roll: they only check the schema */}}
auto_migrate = {{ not .migrate }}
{{- include "llm-gateway.tomlTable" .settings }}
{{- end }}{{ end }}
{{- if $c.engine.enabled }}

[backends.local]
type = "engine"
{{- include "llm-gateway.tomlTable" (omit $c.engine "enabled" "servedModelName" "shmSize") }}
{{- end }}
{{- /* each backend's headless Service: every ready pod is a replica of its pool (DNS discovery) */}}
{{- with .Values.backends.vllm }}{{ if .enabled }}

[backends.vllm]
type = "openai"
{{- if .disaggregation.enabled }}
{{- /* two DNS pools, one per role's headless Service; the gateway picks prefill by prefix, decode by load */}}
prefill_endpoints = ["http://{{ $full }}-vllm-prefill:{{ .port }}"]
decode_endpoints = ["http://{{ $full }}-vllm-decode:{{ .port }}"]
discovery = "dns"
dns_interval = {{ .dnsInterval }}
{{- if not (kindIs "invalid" .disaggregation.thresholdTokens) }}
pd_threshold_tokens = {{ include "llm-gateway.toml" .disaggregation.thresholdTokens }}
{{- end }}
{{- else }}
base_url = "http://{{ $full }}-vllm:{{ .port }}"
discovery = "dns"
dns_interval = {{ .dnsInterval }}
balance = {{ .balance | toJson }}
{{- end }}
model = {{ .servedModelName | toJson }}
flavor = {{ .flavor | toJson }}
{{- end }}{{ end }}
{{- with .Values.backends.tgi }}{{ if .enabled }}

[backends.tgi]
type = "tgi"
base_url = "http://{{ $full }}-tgi:{{ .port }}"
discovery = "dns"
dns_interval = {{ .dnsInterval }}
balance = {{ .balance | toJson }}
{{- end }}{{ end }}
{{- with .Values.backends.triton }}{{ if .enabled }}

[backends.triton]
type = "triton"
base_url = "http://{{ $full }}-triton:{{ .port }}"
discovery = "dns"
dns_interval = {{ .dnsInterval }}
balance = {{ .balance | toJson }}
metrics_port = {{ .metricsPort }}
model = {{ .modelName | toJson }}
dialect = {{ .dialect | toJson }}
{{- end }}{{ end }}
{{- range $name, $table := $c.extraBackends }}

[backends.{{ $name }}]
{{- include "llm-gateway.tomlTable" $table }}
{{- end }}
{{- range $name, $model := $c.models }}

[models.{{ $name }}]
{{- include "llm-gateway.tomlTable" $model }}
{{- end }}
{{- if and (not $c.models) $c.engine.enabled }}

[models.{{ $c.engine.servedModelName }}]
backend = "local"
{{- end }}
{{- end }}
{{- end -}}

{{/* The engine's /dev/shm size, or "" for none: config.engine.shmSize, else with prefill_replicas > 0
     kv_cache_mb x prefill_replicas MiB (the prefill workers' KV, handed over through files there). */}}
{{- define "llm-gateway.engineShm" -}}
{{- $e := .Values.config.engine -}}
{{- $prefill := int (default 0 $e.prefill_replicas) -}}
{{- $rendered := and (not .Values.configToml) $e.enabled -}}
{{- if and $rendered (gt $prefill 0) (ge $prefill (int (default 1 $e.replicas))) -}}
{{- fail "config.engine.prefill_replicas must be less than config.engine.replicas (at least one decode worker)" -}}
{{- end -}}
{{- if $e.shmSize -}}{{ $e.shmSize }}
{{- else if and $rendered (gt $prefill 0) -}}{{ mul (int (default 512 $e.kv_cache_mb)) $prefill }}Mi
{{- end -}}
{{- end -}}

{{/* Whether the pods get a Redis URL for [state] (state.redis or state.redisExistingSecret): "true" or "" */}}
{{- define "llm-gateway.stateRedis" -}}
{{- with .Values.state -}}{{- if and .enabled (or .redis .redisExistingSecret) }}true{{ end -}}{{- end -}}
{{- end -}}

{{/* Refuses [state] values that cannot work: no database, a URL given twice, a password in a value
     (it would be in the pod spec for anyone who can read it: a Secret is the place). */}}
{{- define "llm-gateway.stateChecked" -}}
{{- $s := .Values.state -}}
{{- $password := "^[A-Za-z0-9+.-]+://[^/?#@]*:[^/?#@]*@" -}}
{{- if not (or $s.database $s.existingSecret) -}}
{{- fail "state.enabled needs the database every replica shares: state.database (postgresql://user@host:5432/db) or state.existingSecret (a Secret holding its URL, created before the chart)" -}}
{{- end -}}
{{- if and $s.database $s.existingSecret -}}
{{- fail "state: give state.database or state.existingSecret, not both" -}}
{{- end -}}
{{- if and $s.redis $s.redisExistingSecret -}}
{{- fail "state: give state.redis or state.redisExistingSecret, not both" -}}
{{- end -}}
{{- if regexMatch $password $s.database -}}
{{- fail "state.database carries a password, which would show in the pod spec: put the URL in a Secret and name it in state.existingSecret" -}}
{{- end -}}
{{- if regexMatch $password $s.redis -}}
{{- fail "state.redis carries a password, which would show in the pod spec: put the URL in a Secret and name it in state.redisExistingSecret" -}}
{{- end -}}
{{- end -}}

{{/* The [state] environment of a container, as `env` list items: LLMGW_STATE_DATABASE (config.toml's
     database_env) from state.existingSecret or state.database, and with (dict "root" $ "redis" true)
     LLMGW_STATE_REDIS (redis_env) when a Redis URL is given. */}}
{{- define "llm-gateway.stateEnv" -}}
{{- include "llm-gateway.stateChecked" .root -}}
{{- $s := .root.Values.state -}}
- name: LLMGW_STATE_DATABASE
{{- if $s.existingSecret }}
  valueFrom:
    secretKeyRef: {name: {{ $s.existingSecret }}, key: {{ $s.existingSecretKey }}}
{{- else }}
  value: {{ $s.database | quote }}
{{- end }}
{{- if and .redis (include "llm-gateway.stateRedis" .root) }}
- name: LLMGW_STATE_REDIS
{{- if $s.redisExistingSecret }}
  valueFrom:
    secretKeyRef: {name: {{ $s.redisExistingSecret }}, key: {{ $s.redisExistingSecretKey }}}
{{- else }}
  value: {{ $s.redis | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The gateway pod's securityContext (the state migration Job's too) */}}
{{- define "llm-gateway.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* A gateway container's securityContext */}}
{{- define "llm-gateway.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* The gateway's image */}}
{{- define "llm-gateway.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{ if eq .Values.image.variant "cuda" }}-cuda{{ end }}
{{- end -}}
