{{/* The release's full name: "<release>" when it already contains the chart name. */}}
{{- define "kvstore.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.serviceAccountName" -}}
{{- default (include "kvstore.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvstore.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "kvstore.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "node"). */}}
{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The daemon's config tree: node.config with the addresses and paths that must
agree with the pod spec (ports, hostPath directories) filled in by the chart.
*/}}
{{- define "kvstore.nodeConfig" -}}
{{- $v := .Values -}}
{{- $fixed := dict
  "server" (dict
    "socket_path" (printf "%s/kvstore.sock" $v.node.socketDir)
    "tcp_address" (printf "0.0.0.0:%d" (int $v.ports.grpc)))
  "dram" (dict "path" (printf "%s/kvstore.dram" $v.node.shmDir))
  "metrics" (dict "address" (printf "0.0.0.0:%d" (int $v.ports.metrics)))
  "events" (dict
    "publish_address" (printf "tcp://0.0.0.0:%d" (int $v.ports.events))
    "replay_address" (printf "tcp://0.0.0.0:%d" (int $v.ports.replay)))
  "disk" (dict "path" $v.node.diskDir)
-}}
{{- $config := mustMergeOverwrite (deepCopy $v.node.config) $fixed -}}
{{- if not $v.node.diskDir -}}
{{- $_ := set $config "disk" (dict "path" "" "capacity_bytes" 0) -}}
{{- end -}}
{{- toToml $config -}}
{{- end -}}

{{/*
The indexer's config tree: indexer.config with its listen address and backend
set by the chart (the Redis URL too, unless it comes from a Secret).
*/}}
{{- define "kvstore.indexerConfig" -}}
{{- $ix := .Values.indexer -}}
{{- $fixed := dict
  "address" (printf "0.0.0.0:%d" (int .Values.ports.indexerGrpc))
  "backend" $ix.backend
-}}
{{- if eq $ix.backend "redis" -}}
{{- if not (or $ix.redis.url $ix.redis.existingSecret) -}}
{{- fail "indexer.backend=redis needs indexer.redis.url or indexer.redis.existingSecret" -}}
{{- end -}}
{{- if not $ix.redis.existingSecret -}}
{{- $_ := set $fixed "redis_url" $ix.redis.url -}}
{{- end -}}
{{- end -}}
{{- toToml (dict "indexer" (mustMergeOverwrite (deepCopy $ix.config) $fixed)) -}}
{{- end -}}

{{/*
The router's config tree: router.config with its listen port, this release's
indexer (when enabled) and the backends set by the chart.
*/}}
{{- define "kvstore.routerConfig" -}}
{{- $r := .Values.router -}}
{{- if not $r.backends -}}
{{- fail "router.enabled needs router.backends (node id -> engine URL)" -}}
{{- end -}}
{{- $fixed := dict
  "listen" (printf "0.0.0.0:%d" (int .Values.ports.router))
  "backends" $r.backends
-}}
{{- if .Values.indexer.enabled -}}
{{- $_ := set $fixed "indexer" (printf "%s-indexer:%d" (include "kvstore.fullname" .) (int .Values.ports.indexerGrpc)) -}}
{{- end -}}
{{- toToml (dict "router" (mustMergeOverwrite (deepCopy $r.config) $fixed)) -}}
{{- end -}}
