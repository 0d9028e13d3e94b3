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
