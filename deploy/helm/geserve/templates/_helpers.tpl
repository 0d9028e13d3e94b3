{{- define "geserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "geserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "geserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "geserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "geserve.labels" -}}
{{ include "geserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
Whether an optional object renders: "true" or "false" as set, or, for "auto", only where the cluster
serves the API it needs (helm template renders it only with --api-versions naming that API).
Call with (dict "name" "<value's path>" "enabled" <value> "api" "<group/version>" "root" $).
*/}}
{{- define "geserve.renders" -}}
{{- $enabled := toString .enabled -}}
{{- if not (has $enabled (list "true" "false" "auto")) -}}
{{- fail (printf "%s is %q: it takes true, false or auto" .name $enabled) -}}
{{- end -}}
{{- if or (eq $enabled "true") (and (eq $enabled "auto") (.root.Capabilities.APIVersions.Has .api)) -}}
true
{{- end -}}
{{- end -}}

{{/* The image: image.tag, else the chart's appVersion with -<image.variant> where one is set. */}}
{{- define "geserve.image" -}}
{{- $tag := toString (.Values.image.tag | default "") -}}
{{- if not $tag -}}
{{- $tag = .Chart.AppVersion -}}
{{- with .Values.image.variant }}{{ $tag = printf "%s-%s" $tag . }}{{ end -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "geserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "geserve.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* Whether the HPA renders, "true" or empty. */}}
{{- define "geserve.hpa" -}}
{{- include "geserve.renders" (dict "name" "autoscaling.enabled" "enabled" .Values.autoscaling.enabled "api" "custom.metrics.k8s.io/v1beta1" "root" .) -}}
{{- end -}}

{{/* The fewest pods meant to run: the HPA's minimum where it renders (it owns the replica count), else replicaCount. */}}
{{- define "geserve.minReplicas" -}}
{{- if include "geserve.hpa" . -}}
{{- .Values.autoscaling.minReplicas | int -}}
{{- else -}}
{{- .Values.replicaCount | int -}}
{{- end -}}
{{- end -}}
